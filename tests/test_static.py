"""Static check that catches what only a GPU run would otherwise find: names used but never
defined (e.g. in a launch or error path that CPU tests cannot reach)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ["xstage", "calibration", "fa4_a2a", "megamoe_interleave", "scripts"]
FATAL = ("undefined name", "referenced before assignment", "undefined local variable")


def test_no_undefined_names():
    pytest.importorskip("pyflakes")
    paths = [str(ROOT / t) for t in TARGETS if (ROOT / t).exists()]
    r = subprocess.run([sys.executable, "-m", "pyflakes", *paths], capture_output=True, text=True, timeout=300)
    bad = [line for line in r.stdout.splitlines() if any(f in line for f in FATAL)]
    assert not bad, "\n".join(bad)
