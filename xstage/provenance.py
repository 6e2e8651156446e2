"""Provenance for result files: GPU, driver, software versions, commit, date, clocks.

Every benchmark and calibration result written by this project carries the
dict returned by :func:`collect` under the key ``"provenance"``.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform as _platform
import socket
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["collect", "write_json", "package_versions", "git_commit"]

_PACKAGES = ("torch", "nvidia-cutlass-dsl", "flash-attn-4", "quack-kernels", "triton", "numpy")


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    if out["nvidia-cutlass-dsl"] is None:  # GPU hosts install the DSL with --target (no dist-info on path)
        try:
            import cutlass

            out["nvidia-cutlass-dsl"] = getattr(cutlass, "__version__", "present")
        except Exception:
            pass
    return out


def git_commit(repo: str | Path | None = None) -> str | None:
    """HEAD commit of the checkout (``+dirty`` when it has local changes), or XSTAGE_COMMIT."""
    if os.environ.get("XSTAGE_COMMIT"):
        return os.environ["XSTAGE_COMMIT"]
    cwd = str(repo or Path(__file__).resolve().parent.parent)
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        if len(sha) != 40:  # e.g. a copied tree without history prints "HEAD"
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _commit() -> str | None:
    """git_commit(), unless .xstage_commit (written by the post-commit hook, travels with the
    working tree) names another commit: a copied tree whose .git is an older snapshot (the
    GPU host) then reports the recorded commit. Without git history: the recorded commit."""
    sha = git_commit()
    f = Path(__file__).resolve().parent.parent / ".xstage_commit"
    recorded = f.read_text().strip() if f.is_file() else ""
    if recorded and (not sha or not sha.startswith(recorded)):
        stale = f"; git HEAD {sha} is stale" if sha else ""
        return recorded + f" (from .xstage_commit; working tree may differ{stale})"
    return sha


def _nvidia_smi() -> dict[str, Any]:
    q = "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw"
    try:
        r = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return {}
    if r.returncode != 0:
        return {}
    gpus = []
    for line in r.stdout.strip().splitlines():
        f = [x.strip() for x in line.split(",")]
        gpus.append(dict(zip(q.split(","), f)))
    return {"nvidia_smi": gpus, "driver": gpus[0].get("driver_version") if gpus else None}


def _torch_gpu() -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {}
    out: dict[str, Any] = {"cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, gpu_count=torch.cuda.device_count(), sm_count=props.multi_processor_count,
                   capability=f"{props.major}.{props.minor}", memory_GiB=round(props.total_memory / 2**30, 1))
    return out


def collect(extra: dict | None = None) -> dict[str, Any]:
    """Everything needed to know where and with what a result was produced."""
    d: dict[str, Any] = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "python": _platform.python_version(),
        "commit": _commit(),
        "packages": package_versions(),
    }
    d.update(_torch_gpu())
    d.update(_nvidia_smi())
    if extra:
        d.update(extra)
    return d


def write_json(path: str | Path, payload: dict, extra: dict | None = None) -> Path:
    """Write ``payload`` plus ``{"provenance": collect()}`` as indented JSON."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = dict(payload)
    data["provenance"] = collect(extra)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path
