"""Static checks: names used but never defined (e.g. in a launch or error path that CPU tests cannot
reach, which only a GPU run would otherwise find), no path outside the repository in code, and the
layers' import graph (the libraries never import lab, and no import cycles among their modules) and
the libraries' parameter lists (at most twelve, named exceptions)."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ("xstage", "calibration", "fa4_a2a", "megamoe_interleave")
TARGETS = [*LIBRARIES, "lab", "scripts"]
FATAL = ("undefined name", "referenced before assignment", "undefined local variable")


def test_no_undefined_names():
    pytest.importorskip("pyflakes")
    paths = [str(ROOT / t) for t in TARGETS if (ROOT / t).exists()]
    r = subprocess.run([sys.executable, "-m", "pyflakes", *paths], capture_output=True, text=True, timeout=300)
    bad = [line for line in r.stdout.splitlines() if any(f in line for f in FATAL)]
    assert not bad, "\n".join(bad)


def test_code_cites_no_path_outside_the_repository():
    """Code (*.py, *.sh, *.toml) must not point at the workplace's folders: others cannot see them."""
    import os

    outside = ("/" + "work/", "../" + "shared")  # split so that this file does not match itself
    bad = []
    for d, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(x for x in dirs if not x.startswith(".") and x not in ("results", "__pycache__"))
        for name in sorted(files):
            if not name.endswith((".py", ".sh", ".toml")):
                continue
            f = Path(d) / name
            for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
                if any(o in line for o in outside):
                    bad.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bad, "\n".join(bad)


def library_import_graph() -> dict:
    """module -> the modules of the packages in LIBRARIES and of lab that it imports, from the source
    with ast: module-level and function-local imports, relative ones resolved. ``from P import N``
    is an edge to the module P.N where that is a module, else to P; importing a module does not add
    edges to its parent packages (Python imports them first, which is no cycle of the code's)."""
    modules = {}
    for package in (*LIBRARIES, "lab"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    graph = {}
    for name, path in modules.items():
        if name.split(".")[0] not in LIBRARIES:
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                for alias in node.names:
                    imported.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        # an import of a module not in the table (lab.x.y where lab.x is a module): its longest known prefix
        resolved = set()
        for target in imported:
            parts = target.split(".")
            known = next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in modules),
                         None)
            if known is None and parts[0] == "lab":
                known = "lab"  # lab itself, or a lab module this checkout does not have
            if known is not None and known != name:
                resolved.add(known)
        graph[name] = resolved
    return graph


def import_cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan), each with one cycle
    through it as a readable path."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [(c, _cycle_path(graph, c)) for c in components]


def _cycle_path(graph: dict, component: frozenset) -> str:
    """One cycle inside ``component``, from its first module back to it (breadth-first)."""
    start = min(component)
    parent, frontier = {}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [w, v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return " -> ".join(reversed(path))
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    return start


def test_libraries_do_not_import_lab():
    """xstage <- calibration, fa4_a2a, megamoe_interleave <- lab <- scripts: no library module imports lab."""
    bad = sorted(f"{m} imports {t}" for m, ts in library_import_graph().items() for t in ts
                 if t.split(".")[0] == "lab")
    assert not bad, "\n".join(bad)


def test_no_import_cycles_among_the_libraries():
    cycles = import_cycles(library_import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(path for _, path in cycles)


def test_import_graph_sees_relative_function_local_and_lab_imports(tmp_path, monkeypatch):
    """The graph builder on a made-up tree: a relative import inside a function, an import of lab,
    and the cycle they close."""
    for rel, text in {"xstage/__init__.py": "", "xstage/a.py": "def f():\n    from . import b\n",
                      "xstage/b.py": "from xstage.a import f\nimport lab.bench\n", "lab/__init__.py": "",
                      "lab/bench.py": "", "calibration/__init__.py": "", "fa4_a2a/__init__.py": "",
                      "megamoe_interleave/__init__.py": ""}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    graph = library_import_graph()
    assert graph["xstage.a"] == {"xstage.b"} and graph["xstage.b"] == {"xstage.a", "lab.bench"}
    assert import_cycles(graph) == [(frozenset({"xstage.a", "xstage.b"}), "xstage.a -> xstage.b -> xstage.a")]


# Functions of the libraries allowed more than MAX_PARAMS parameters, each with its reason.
MANY_PARAMS = {
    "fa4_a2a/kernel.py:mma": "overrides FlashAttentionForwardSm90.mma (upstream's parameter list)",
    "fa4_a2a/kernel.py:epilogue": "overrides FlashAttentionForwardSm90.epilogue (upstream's parameter list)",
    "xstage/planner.py:plan_megamoe": "keyword-only, each validated; a problem object would only move the list",
    "calibration/kernels.py:__call__": "keyword-only launch shape, validated before the launch (callers run on GPUs)",
}
MAX_PARAMS = 12


def test_library_functions_take_at_most_twelve_parameters():
    """No library function takes more than MAX_PARAMS parameters (self aside) except MANY_PARAMS; a
    launch contract that grows goes into a typed arguments object (megamoe_interleave.arguments)."""
    found = {}
    for lib in LIBRARIES:
        for path in sorted((ROOT / lib).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    a = node.args
                    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
                    n = len(names) - (names[:1] in (["self"], ["cls"]))
                    if n > MAX_PARAMS:
                        found[f"{path.relative_to(ROOT).as_posix()}:{node.name}"] = n
    assert set(found) == set(MANY_PARAMS), {k: found.get(k) for k in set(found) ^ set(MANY_PARAMS)}
