"""Multi-GPU smoke tests of the issue-6 entry points under torchrun (2 GPUs).

Marked ``gpu`` and skipped unless at least two CUDA GPUs are visible.  Each test starts
``torchrun --nproc-per-node=2`` on one entry point in quick mode, with NVLink multicast
disabled, and checks the exit status and the result file.  The full measurement runs are
``scripts/multigpu_suite.sh`` (docs/multigpu.md)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
MG = ROOT / "scripts" / "multigpu"
N_GPU = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(N_GPU < 2, reason=f"needs >= 2 GPUs (found {N_GPU})")]

ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _torchrun(entry, *args, timeout=580, nproc=2):
    env = {**os.environ, **ENV}
    env["PYTHONPATH"] = str(ROOT) + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(MG / entry), "--world", "torch-symm", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_envcheck_two_gpus(tmp_path):
    r = _torchrun("envcheck.py", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    d = json.loads((tmp_path / "env.json").read_text())
    assert d["all_ok"] and len(d["ranks"]) == 2 and d["gpu_count"] >= 2
    assert all(rk["checks"]["symm_peer_views"] and rk["checks"]["nccl_all_reduce"] for rk in d["ranks"])


def test_correctness_two_gpus(tmp_path):
    r = _torchrun("correctness.py", "--quick", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    d = json.loads((tmp_path / "correctness.json").read_text())
    assert d["summary"]["all_ok"]
    ranks = {x["rank"] for x in d["results"]}
    assert ranks == {0, 1}  # both processes checked their own outputs


def test_fa_sweep_two_gpus_max_across_ranks(tmp_path):
    r = _torchrun("fa_a2a_sweep.py", "--heads", "8", "--seqs", "4096", "--trials", "3", "--variants", "fa_only",
                  "a2a_nccl", "a2a_symm", "serial_nccl", "fused", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    d = json.loads((tmp_path / "sweep.json").read_text())
    (row,) = d["rows"]
    for name, t in row["timings"].items():
        assert t["ranks"] == 2 and t["trials"] == 3
        assert t["median_us"] > 0
        # per-trial max dominates every rank's sample, so its median dominates every rank's median
        assert t["median_us"] >= max(t["rank_median_us"].values()) * (1 - 1e-12), name
    assert (tmp_path / "sweep.csv").exists()


def test_world_size_mismatch_is_a_clear_error(tmp_path):
    r = _torchrun("envcheck.py", "--P", "3", "--out", str(tmp_path), timeout=120)
    assert r.returncode != 0
    assert "does not match torchrun's WORLD_SIZE=2" in r.stderr
