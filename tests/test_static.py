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
