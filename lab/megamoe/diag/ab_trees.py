#!/usr/bin/env python
"""Same-host A/B of fused-kernel builds from several source trees (a change against main): each tree's
:mod:`~lab.megamoe.diag.tile_budget` in a process of its own (working directory and ``PYTHONPATH`` = the
tree), the trees in alternating order round by round (A B, B A, ...), and per P each tree's untraced kernel
time (the median of its calls after the first, then the median over the rounds) with its ratio to the first
tree's, next to the traced mainloops.

    python scripts/diag/megamoe_ab_trees.py --tree main=.kc/mainwt --tree new=. --P 1 8 --rounds 2 --out DIR
    python scripts/diag/megamoe_ab_trees.py ... --bits   # first: do the trees compute the first tree's bits?
    XSTAGE_KERNEL_CACHE=.kernel-cache python scripts/diag/megamoe_ab_trees.py ... --compile-only   # ahead, on a CPU

The trees travel to the GPU host with ``carry`` (docs/gpu.md). Writes ``ab_trees.json`` (every run's
``tile_budget.json``, each tree's commit, provenance) and ``ab_trees.csv``, and prints the table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


def run_order(names, rounds: int) -> list:
    """[(round, name)] in run order: the trees as given in even rounds, reversed in odd ones."""
    return [(r, n) for r in range(rounds) for n in (names if r % 2 == 0 else names[::-1])]


def tree_commit(path: str) -> str:
    """The tree's commit: its ``.xstage_commit`` (a worktree on the GPU host has no git), else git's."""
    f = os.path.join(path, ".xstage_commit")
    if os.path.exists(f):
        with open(f) as fh:
            return fh.read().strip()
    out = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def kernel_median(run: dict) -> float:
    """A tile_budget run's untraced kernel time: the median of its calls after the first."""
    us = run["kernel_us"]
    return statistics.median(us[1:] or us)


def summarize(names, budgets: dict) -> list:
    """One row per (P, tree) from ``budgets[(round, name)]`` (tile_budget.json contents; a failed run is
    missing): the kernel's median per round, over the rounds, and its ratio to the first tree's; the traced
    L1 / L2 mainloop p50 cycles of the tree's last run."""
    rounds = sorted({r for r, _ in budgets})
    ps = sorted({p for b in budgets.values() for p in b["runs"]}, key=lambda k: int(k[1:]))
    rows = []
    for p in ps:
        base = None
        for name in names:
            per_round = [kernel_median(budgets[(r, name)]["runs"][p]) for r in rounds if (r, name) in budgets]
            med = statistics.median(per_round)
            base = med if base is None else base
            last = budgets[(max(r for r in rounds if (r, name) in budgets), name)]["runs"][p]
            rows.append(dict(P=int(p[1:]), tree=name, kernel_us_per_round=[round(x, 1) for x in per_round],
                             kernel_us=round(med, 1), over_first=round(med / base, 4),
                             l1_mainloop_p50=last.get("L1", {}).get("mainloop_cycles_p50"),
                             l2_mainloop_p50=last.get("L2", {}).get("mainloop_cycles_p50")))
    return rows


def parse_trees(specs) -> list:
    """``NAME=PATH`` specs -> [(name, absolute path)]; names unique, paths existing directories."""
    trees = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--tree wants NAME=PATH, got {spec!r}")
        if not os.path.isdir(path):
            raise ValueError(f"--tree {name}: no directory {path!r}")
        trees.append((name, os.path.abspath(path)))
    if len({n for n, _ in trees}) != len(trees) or len(trees) < 2:
        raise ValueError("give two or more --tree with distinct names")
    return trees


def parse_flags(specs, names) -> dict:
    """``NAME=FLAGS`` specs (FLAGS: tile_budget options, space-separated) -> {name: [flag, ...]},
    for trees of ``names`` only: the same tree can run twice, once with an option and once without."""
    flags = {}
    for spec in specs or []:
        name, sep, rest = spec.partition("=")
        if not sep or name not in names:
            raise ValueError(f"--flags wants NAME=FLAGS for a --tree name, got {spec!r}")
        flags[name] = rest.split()
    return flags


def tree_env(path: str) -> dict:
    """The environment of a run in the tree at ``path``: its packages first on ``PYTHONPATH``."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([path, os.environ.get("PYTHONPATH", "")]))


def tile_budget_args(args, extra) -> list:
    """The tile_budget options of one tree's run: the problem, the tree's ``extra`` flags, the Ps (last)."""
    return ["--precision", args.precision, "--schedule", args.schedule, "--tokens", str(args.tokens),
            *([] if args.routing == "balanced" else ["--routing", args.routing]), *extra, "--P", *map(str, args.P)]


OUTPUT_HASH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "output_hash.py")


def tree_bits(path: str, precision: str, timeout_s: int, compile_only: bool = False) -> dict:
    """:mod:`output_hash` (this tree's file, run in the tree's environment) of the tree at ``path``: its
    outputs' SHA-256 on a fixed small problem, or the failure's tail (``compile_only``: its kernels into
    ``XSTAGE_KERNEL_CACHE``, no GPU)."""
    cmd = [sys.executable, OUTPUT_HASH, "--precision", precision, *(["--compile-only"] if compile_only else [])]
    try:
        done = subprocess.run(cmd, cwd=path, env=tree_env(path), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s} s"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": (done.stdout + done.stderr)[-2000:]}
    return json.loads(lines[-1])


def bits_verdicts(names, bits: dict) -> dict:
    """{tree: whether its outputs' bits equal the first tree's} (None where either run failed)."""
    first = bits[names[0]].get("sha256")
    return {n: (None if first is None or "sha256" not in bits[n] else bits[n]["sha256"] == first) for n in names}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, metavar="NAME=PATH",
                    help="a source tree to build and time (the first is the baseline)")
    ap.add_argument("--flags", action="append", metavar="NAME=FLAGS",
                    help='extra tile_budget options for one tree, e.g. "n=--pair-split n"')
    ap.add_argument("--P", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--precision", default="w8a8", choices=["bf16", "w8a8", "w4a8"])
    ap.add_argument("--schedule", default="interleaved", choices=["interleaved", "expert_wave"])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--routing", default="balanced", choices=["balanced", "skewed1", "skewed2"],
                    help="tile_budget's (a tree from before 2026-12-04 takes balanced only)")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="every tree once per round, the order alternating")
    ap.add_argument("--timeout-s", type=int, default=300, help="bound of one tree's run")
    ap.add_argument("--out", required=True)
    ap.add_argument("--bits", action="store_true",
                    help="first hash each tree's outputs on a small fixed problem (output_hash.py): equal bits to the "
                         "first tree's, for trees that must not change the results")
    ap.add_argument("--compile-only", action="store_true",
                    help="compile every tree's builds into XSTAGE_KERNEL_CACHE once and exit (a CPU host is fine: "
                         "carry the cache, and the GPU run compiles nothing)")
    args = ap.parse_args(argv)
    try:
        trees = parse_trees(args.tree)
        flags = parse_flags(args.flags, [n for n, _ in trees])
    except ValueError as e:
        ap.error(str(e))
    if args.rounds < 1 or args.calls < 2:
        ap.error("--rounds >= 1 and --calls >= 2")
    from lab import bench
    from xstage import provenance

    paths = dict(trees)
    names = [n for n, _ in trees]
    if args.compile_only:
        from xstage.cute_compile import KERNEL_CACHE_ENV

        if not os.environ.get(KERNEL_CACHE_ENV):
            ap.error(f"--compile-only keeps the kernels for the GPU run: set {KERNEL_CACHE_ENV}")
        for name in names:
            env = tree_env(paths[name])
            cmd = [sys.executable, "scripts/diag/megamoe_tile_budget.py", "--compile-only", "--out", args.out,
                   *tile_budget_args(args, flags.get(name, []))]
            done = subprocess.run(cmd, cwd=paths[name], env=env, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"{name}: compiling failed\n{(done.stdout + done.stderr)[-2000:]}")
            if args.bits and "error" in (b := tree_bits(paths[name], args.precision, args.timeout_s, True)):
                sys.exit(f"{name}: compiling the output hash's layer failed\n{b['error']}")
            bench.log(f"{name}: compiled")
        return
    bits = {}
    if args.bits:
        for name in names:
            bits[name] = tree_bits(paths[name], args.precision, args.timeout_s)
            bench.log(f"{name}: outputs " + (bits[name]["sha256"][:16] if "sha256" in bits[name] else
                                             f"not hashed: {bits[name]['error'][-300:]}"))
        for name, same in bits_verdicts(names, bits).items():
            bench.log(f"{name}: bits {'equal to' if same else 'unknown against' if same is None else 'DIFFER from'} "
                      f"{names[0]}'s")
    budgets, failed = {}, []
    for r, name in bench.progress(run_order(names, args.rounds), desc="tree runs"):
        out = os.path.join(os.path.abspath(args.out), f"{name}_round{r}")
        env = tree_env(paths[name])
        cmd = [sys.executable, "scripts/diag/megamoe_tile_budget.py", "--calls", str(args.calls), "--out", out,
               *tile_budget_args(args, flags.get(name, []))]
        try:
            done = subprocess.run(cmd, cwd=paths[name], env=env, capture_output=True, text=True,
                                  timeout=args.timeout_s)
            ok = done.returncode == 0
            tail = (done.stdout + done.stderr)[-2000:]
        except subprocess.TimeoutExpired:
            ok, tail = False, f"timed out after {args.timeout_s} s"
        if not ok:
            failed.append(dict(round=r, tree=name, tail=tail))
            bench.log(f"{name} round {r}: failed\n{tail}")
            continue
        with open(os.path.join(out, "tile_budget.json")) as f:
            budgets[(r, name)] = json.load(f)
        bench.log(f"{name} round {r}: " + ", ".join(
            f"P={p[1:]} {kernel_median(v):.0f} us" for p, v in budgets[(r, name)]["runs"].items()))
    if {n for _, n in budgets} != set(names):
        sys.exit(f"no complete comparison: {len(failed)} run(s) failed")
    rows = summarize(names, budgets)
    for row in rows:
        print(f"P={row['P']} {row['tree']:>12}: kernel {row['kernel_us']:.0f} us (rounds {row['kernel_us_per_round']}), "
              f"{row['over_first']:.4f}x the first tree; L1 mainloop p50 {row['l1_mainloop_p50']}, "
              f"L2 {row['l2_mainloop_p50']}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    bench.write_csv(os.path.join(args.out, "ab_trees.csv"), rows)
    with open(os.path.join(args.out, "ab_trees.json"), "w") as f:
        json.dump({"what": __doc__.splitlines()[0], "args": vars(args),
                   "trees": {n: dict(path=p, commit=tree_commit(p)) for n, p in trees}, "rows": rows,
                   "runs": {f"{n}_round{r}": b for (r, n), b in budgets.items()}, "failed": failed,
                   "bits": bits, "bits_equal_first": bits_verdicts(names, bits) if bits else {},
                   "provenance": provenance.collect()}, f, indent=1)


if __name__ == "__main__":
    main()
