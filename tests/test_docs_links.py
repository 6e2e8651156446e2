"""The markdown files point at things that exist (issue 43): every relative link, every backticked
path into the repository, every commit cited (`git show abc1234:...`, "commit abc1234") and every
tag cited. CPU only; the commit and tag checks need a full git checkout and skip without one."""
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
PATH = re.compile(r"^[\w.\-/{},]+$")
EXTENSION = re.compile(r"\.[A-Za-z0-9]+$")
HEX = r"[0-9a-f]{7,40}"
GIT_COMMIT = re.compile(r"\bgit\s+(?:show|checkout|log|diff|switch|cat-file\s+-p)\s+(?:-\S+\s+)*(" + HEX + r")\b")
NAMED_COMMIT = re.compile(r"\bcommits?\s+`?(" + HEX + r"(?:`?\s*(?:/|,|and)\s*`?" + HEX + r")*)\b")
TAG = re.compile(r"\btag\s+(?:`([^`\s]+)`|([A-Za-z0-9][\w.]*-[\w.-]*[A-Za-z0-9]))")


def _git(*args):
    try:
        r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def _in_git_checkout():
    return (_git("rev-parse", "--is-inside-work-tree") or "").strip() == "true"


def _files_on_disk():
    """Repository-relative paths of the files outside hidden folders (no git checkout)."""
    found = []
    for d, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(x for x in dirs if not x.startswith(".") and x != "__pycache__")
        found += [str((Path(d) / f).relative_to(ROOT)) for f in files]
    return found


TEMPLATES = "lab/templates/"  # report templates: their links are filled in where the report is written


def markdown_files():
    """The tracked *.md files but the report templates (without git: every *.md outside hidden folders)."""
    out = _git("ls-files", "-z", "--", "*.md") if _in_git_checkout() else None
    files = _files_on_disk() if out is None else [f for f in out.split("\0") if f and (ROOT / f).is_file()]
    return sorted(ROOT / f for f in files if f.endswith(".md") and not f.startswith(TEMPLATES))


def _prose_lines(text):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield n, line


def relative_links(text):
    """(line, target) of the markdown links and images that point into the repository."""
    for n, line in _prose_lines(text):
        line = CODE_SPAN.sub("", line)
        targets = [m.group(1) for m in LINK.finditer(line)]
        m = REF_LINK.match(line)
        if m:
            targets.append(m.group(1))
        for t in targets:
            if SCHEME.match(t) or t.startswith("//"):
                continue
            t = t.split("#", 1)[0].split("?", 1)[0]
            if t:
                yield n, t


def _expand_braces(p):
    m = re.search(r"\{([^{}]*)\}", p)
    if not m:
        return [p]
    return [q for alt in m.group(1).split(",") for q in _expand_braces(p[:m.start()] + alt + p[m.end():])]


def _tracked():
    """(files, folders) of the repository: the tracked ones in a git checkout, else what is on disk."""
    out = _git("ls-files", "-z") if _in_git_checkout() else None
    files = set(_files_on_disk()) if out is None else {f for f in out.split("\0") if f}
    folders = {str(Path(f).parents[i]) for f in files for i in range(len(Path(f).parts) - 1)}
    return files, folders


def _key(p, base):
    """p (relative to the markdown file's folder base) as a repository-relative path, or None."""
    q = os.path.normpath(os.path.join(os.path.relpath(base, ROOT), p))
    return None if q.startswith("..") else q


def _anchored(p, base, folders):
    """Whether a backticked path is meant as a path into the repository: its first folder exists
    next to the markdown file, or it starts at the top of the repository in a folder whose
    contents are cited by path: results/<machine>/ (so that output folders of runs that are not
    shipped, such as results/h200xN/, are not checked), scripts/, docs/, tests/, or any folder
    for code and markdown. Anything else is prose, an example or a placeholder."""
    parts = [x for x in p.split("/") if x not in ("", ".")]
    if len(parts) < 2:
        return False
    rel = _key(parts[0], base)
    if base != ROOT and rel in folders:
        return True
    if parts[0] not in folders:
        return False
    if parts[0] == "results":
        return "/".join(parts[:2]) in folders
    return parts[0] in ("scripts", "docs", "tests") or p.endswith((".py", ".sh", ".md"))


def backticked_paths(text, base, folders):
    """(line, path) of the inline-code spans that are a path into the repository: one token with a
    '/', a file extension or a trailing '/', and a first folder that exists (see _anchored)."""
    for n, line in _prose_lines(text):
        for m in CODE_SPAN.finditer(line):
            s = m.group(2).strip()
            s = re.sub(r"::\S*$", "", s)              # tests/x.py::test_name
            s = re.sub(r":\d+(-\d+)?$", "", s)         # path:line
            if "/" not in s or "..." in s or not PATH.match(s) or SCHEME.match(s):
                continue
            for p in _expand_braces(s):
                if (p.endswith("/") or EXTENSION.search(p)) and _anchored(p, base, folders):
                    yield n, p


def _exists(p, base, files, folders):
    """p names a tracked file or folder, next to the markdown file or from the top."""
    keys = {_key(p, base), os.path.normpath(p)}
    return any(k in files or k in folders for k in keys if k)


def test_relative_links_resolve():
    files, folders = _tracked()
    bad = []
    for f in markdown_files():
        for n, t in relative_links(f.read_text(errors="replace")):
            k = _key(t, f.parent)
            if not (k in files or k in folders or (k == "." and t)):
                bad.append(f"{f.relative_to(ROOT)}:{n}: {t}")
    assert not bad, "links to nothing:\n" + "\n".join(bad)


def test_backticked_repository_paths_exist():
    files, folders = _tracked()
    bad = []
    for f in markdown_files():
        for n, p in backticked_paths(f.read_text(errors="replace"), f.parent, folders):
            if not _exists(p, f.parent, files, folders):
                bad.append(f"{f.relative_to(ROOT)}:{n}: {p}")
    assert not bad, "paths to nothing:\n" + "\n".join(bad)


def cited_commits(text):
    for n, line in enumerate(text.splitlines(), 1):
        for m in GIT_COMMIT.finditer(line):
            yield n, m.group(1)
        for m in NAMED_COMMIT.finditer(line):
            for h in re.findall(HEX, m.group(1)):
                if re.search(r"\d", h):
                    yield n, h


def cited_tags(text):
    for n, line in enumerate(text.splitlines(), 1):
        for m in TAG.finditer(line):
            yield n, m.group(1) or m.group(2)


def _needs_history():
    if not _in_git_checkout():
        pytest.skip("not a git checkout")
    if (_git("rev-parse", "--is-shallow-repository") or "").strip() == "true":
        pytest.skip("shallow clone: the cited commits may be outside it")


def test_cited_commits_exist():
    _needs_history()
    cites = [(f, n, h) for f in markdown_files() for n, h in cited_commits(f.read_text(errors="replace"))]
    assert cites, "no commit cited anywhere: the pattern is broken"
    hashes = sorted({h for _, _, h in cites})
    r = subprocess.run(["git", "cat-file", "--batch-check"], cwd=ROOT, capture_output=True, text=True,
                       input="".join(f"{h}^{{commit}}\n" for h in hashes), timeout=60)
    missing = {line.split()[0].removesuffix("^{commit}") for line in r.stdout.splitlines()
               if line.endswith(" missing") or line.endswith(" ambiguous")}
    bad = [f"{f.relative_to(ROOT)}:{n}: {h}" for f, n, h in cites if h in missing]
    assert not bad, "commits that are not in the repository:\n" + "\n".join(bad)


def test_cited_tags_exist():
    _needs_history()
    bad = []
    for f in markdown_files():
        for n, t in cited_tags(f.read_text(errors="replace")):
            if _git("rev-parse", "-q", "--verify", f"refs/tags/{t}") is None:
                bad.append(f"{f.relative_to(ROOT)}:{n}: {t}")
    assert not bad, "tags that do not exist:\n" + "\n".join(bad)


def test_the_checks_catch_what_they_are_for(tmp_path):
    """The patterns on a made-up file: what must be found is, prose and examples are not."""
    text = ("[a](docs/status.md#x) [b](https://example.com) ![c](fig.png) [d](#top)\n"
            "`scripts/run` `results/h200/README.md` `results/h200xN/topology/` `python x.py --out y/`\n"
            "`scripts/x.{py,sh}` `fa4_a2a/sweep.json` `tests/test_static.py::test_no_undefined_names`\n"
            "```\n[e](inside/a/fence.md) `scripts/in_fence.py`\n```\n"
            "git show bedde32:results/x, commit 579559c, commits 9606b57 / 80fcb8f, the tag on one machine,"
            " tag `v1`, tag some-name\n")
    assert [t for _, t in relative_links(text)] == ["docs/status.md", "fig.png"]
    assert [p for _, p in backticked_paths(text, ROOT / "docs", _tracked()[1])] == [
        "results/h200/README.md", "scripts/x.py", "scripts/x.sh", "tests/test_static.py"]
    assert [h for _, h in cited_commits(text)] == ["bedde32", "579559c", "9606b57", "80fcb8f"]
    assert [t for _, t in cited_tags(text)] == ["v1", "some-name"]
