"""scripts/gpu_calls.sh, the next device session's calls: every shell script parses, an unknown call is refused
(exit status 2), and the experiment commits it checks out as worktrees are in this repository's history."""
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_calls.sh"


@pytest.mark.parametrize("script", sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "scripts").rglob("*.sh")))
def test_shell_scripts_parse(script):
    r = subprocess.run(["bash", "-n", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_an_unknown_call_is_refused(tmp_path):
    r = subprocess.run(["bash", str(SCRIPT), "bogus", str(tmp_path / "out")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown call bogus" in r.stderr


def test_the_experiment_trees_are_commits_of_this_history():
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        pytest.skip("not a git checkout with its whole history")
    text = SCRIPT.read_text()
    commits = re.findall(r"\b\w+=([0-9a-f]{7,40})\b", text)
    assert len(commits) >= 3, commits  # the two K-loop experiments and the W4A8 swapped half tiles
    for c in commits:
        r = subprocess.run(["git", "merge-base", "--is-ancestor", c, "HEAD"], cwd=ROOT, capture_output=True, timeout=60)
        assert r.returncode == 0, f"{c} (scripts/gpu_calls.sh) is not an ancestor of HEAD"
