"""scripts/run's main job on a CPU machine: the planner on every shipped profile, the calibration
fit recomputed from the shipped raw data (equal to the shipped fit) and the MoE layer on the torch
backend (BF16 and W8A8 against their references), in seconds."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_main_job_refits_the_shipped_calibration(tmp_path):
    t0 = time.time()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, "scripts/demo.py", "--cpu", "--out", str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "need an H100/H200" in r.stdout or "kernels need" in r.stdout
    for profile in ("paper-b200-nvlink", "h200-nvlink-peer", "h200-pcie-host"):
        assert f"== plan, {profile}" in r.stdout
    out = json.loads((tmp_path / "demo.json").read_text())
    assert out["ok"] and out["calibration_refit_matches_shipped"] and "provenance" in out
    assert (tmp_path / "calibration" / "report.md").exists()
    moe = out["megamoe_torch_backend"]
    assert moe["ok"] and moe["bf16"]["relative_error_vs_fp32"] < 0.01 and moe["w8a8"]["relative_error_vs_recipe"] <= 0.01
    assert "megamoe_interleave on the CPU" in r.stdout
    assert time.time() - t0 < 120


def test_gpu_demo_modules_import_without_a_gpu():
    import lab.fa4_a2a.demo
    import lab.megamoe.demo

    assert callable(lab.fa4_a2a.demo.run) and callable(lab.megamoe.demo.run)
