"""scripts/_env.sh picks the system python3 only when asked, or when the GPU-host bundle's
environment file exists, and then says so on stderr (issue 43)."""
import hashlib
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINE = "[xstage] using system python3 + {} (GPU host bundle); set XSTAGE_SYSTEM_PYTHON=0 to use ./.venv"


def _source(env_file: Path, system_python=None):
    env = {k: v for k, v in os.environ.items() if k not in ("XSTAGE_SYSTEM_PYTHON", "XSTAGE_MARK")}
    env["XSTAGE_GPU_ENV"] = str(env_file)
    if system_python is not None:
        env["XSTAGE_SYSTEM_PYTHON"] = system_python
    return subprocess.run(["bash", "-c", 'source scripts/_env.sh && echo "$PY|${XSTAGE_MARK:-}"'], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def _gpu_env(tmp_path):
    f = tmp_path / "gpu-env.sh"
    f.write_text("export XSTAGE_MARK=sourced\n")
    return f


def test_bundle_file_selects_system_python_and_says_so(tmp_path):
    f = _gpu_env(tmp_path)
    p = _source(f)
    assert p.returncode == 0 and p.stdout.strip() == "python3|sourced"
    assert p.stderr.splitlines() == [LINE.format(f)]


def test_asking_for_system_python_is_silent(tmp_path):
    p = _source(tmp_path / "missing.sh", "1")
    assert (p.returncode, p.stdout.strip(), p.stderr) == (0, "python3|", "")


def _venv_ready() -> bool:
    stamp = ROOT / ".venv" / ".xstage-installed"
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:16]
    return (ROOT / ".venv/bin/python").exists() and stamp.exists() and stamp.read_text().strip() == want


@pytest.mark.skipif(not _venv_ready(), reason="./.venv not set up for this pyproject.toml (would install)")
def test_zero_keeps_the_venv_where_the_bundle_file_exists(tmp_path):
    p = _source(_gpu_env(tmp_path), "0")
    assert p.returncode == 0 and p.stdout.strip() == f"{ROOT}/.venv/bin/python|" and p.stderr == ""
