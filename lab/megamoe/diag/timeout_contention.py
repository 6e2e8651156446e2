"""The fused kernel's error path under time-slicing (GPU): does a layer whose every wait gives up
at once (``timeout_ns=1``) still end each call in ``DeviceError`` with a healthy CUDA context
while other processes share the GPU?

Why: in a 10-process pytest run on one H200, ``test_fused_timeout_raises`` once ended in a launch
failure. Run with ``--busy 0`` too: the cause turned out to be the pair split along N, not the other
processes (results/h200/megamoe/archive/timeout_fault/).

``--busy N`` background processes each run back-to-back BF16 matmuls on the same GPU for the
whole run; this process then makes ``--calls`` broken calls (``timeout_ns=1``) and, after them, one
healthy call checked against the fp32 reference. One JSON record: outcome counts (``device_error``,
``launch_failure``, ``other``), whether the healthy call was right, provenance. A launch failure
kills this process's context, so the run stops at the first one.

    python scripts/diag/megamoe_timeout_contention.py --busy 9 --calls 50 --out DIR
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from pathlib import Path

BUSY_N = 8192  # the busy processes' square matmul: about 1.4 ms per call on an H200


def busy_loop(seconds: float, ready) -> None:
    """One background process: BF16 matmuls back to back for ``seconds``."""
    import torch

    a = torch.randn(BUSY_N, BUSY_N, device="cuda", dtype=torch.bfloat16)
    ready.set()
    end = time.time() + seconds
    while time.time() < end:
        for _ in range(10):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--busy", type=int, default=9, help="background processes on the same GPU")
    p.add_argument("--calls", type=int, default=50, help="broken calls (timeout_ns=1)")
    p.add_argument("--seconds", type=float, default=120.0, help="how long the background processes run")
    p.add_argument("--P", type=int, default=1)
    p.add_argument("--out", required=True, help="folder for timeout_contention.json")
    args = p.parse_args(argv)
    if args.busy < 0 or args.calls < 1 or args.P < 1 or args.seconds <= 0:
        p.error("--busy >= 0, --calls >= 1, --P >= 1 and --seconds > 0")
    return args


def classify(exc: BaseException) -> str:
    """``device_error`` (the kernel's error word), ``launch_failure`` (a dead context) or ``other``."""
    from xstage.device import DeviceError

    if isinstance(exc, DeviceError):
        return "device_error"
    if "launch failure" in str(exc) or "illegal" in str(exc):
        return "launch_failure"
    return "other"


def run(args) -> dict:
    import torch

    from megamoe_interleave import MegaMoE, MegaMoEConfig, make_world
    from megamoe_interleave.reference import reference_moe_fp32
    from lab.megamoe.routing import make_routing
    from lab.multigpu import check_close
    from xstage import provenance

    E, H, I, k, T = 16, 512, 256, 6, 200  # test_fused_timeout_raises' problem (tests/test_megamoe_gpu.py)
    g = torch.Generator().manual_seed(3)
    w1 = ((torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).bfloat16()).cuda()
    w2 = ((torch.randn(E, H, I, generator=g) / I ** 0.5).bfloat16()).cuda()
    xs = [torch.randn(T, H, generator=g).bfloat16().cuda() for _ in range(args.P)]
    routes = [make_routing("balanced", T, E, k, seed=31 * r) for r in range(args.P)]
    idx, wts = [r[0].cuda() for r in routes], [r[1].cuda() for r in routes]

    def layer(**config):
        moe = MegaMoE(make_world("loopback", world_size=args.P, device="cuda"), E, H, I, k, 256,
                      MegaMoEConfig("interleaved", lead=2, **config), backend="fused")
        moe.load_weights(w1, w2)
        return moe

    broken, healthy = layer(timeout_ns=1), layer()
    broken.compile()
    healthy.compile()
    ctx = mp.get_context("spawn")
    ready = [ctx.Event() for _ in range(args.busy)]
    procs = [ctx.Process(target=busy_loop, args=(args.seconds, ev), daemon=True) for ev in ready]
    for p in procs:
        p.start()
    for ev in ready:
        ev.wait(120)
    counts = {"device_error": 0, "launch_failure": 0, "other": 0, "no_error": 0}
    first_other = None
    t0 = time.time()
    for _ in range(args.calls):
        try:
            broken.forward(xs, idx, wts)
            counts["no_error"] += 1
        except Exception as e:  # noqa: BLE001 -- classified and counted
            kind = classify(e)
            counts[kind] += 1
            if kind != "device_error" and first_other is None:
                first_other = f"{type(e).__name__}: {e}"[:500]
            if kind == "launch_failure":
                break
    healthy_ok = None
    if counts["launch_failure"] == 0:
        ref = reference_moe_fp32(xs, idx, wts, w1, w2)
        ys = healthy.forward(xs, idx, wts)
        healthy_ok = all(check_close(y, r, 0.02, 0.02)["ok"] for y, r in zip(ys, ref))
    for p in procs:
        p.terminate()
    return {"what": "fused MoE, timeout_ns=1, under time-slicing", "busy": args.busy, "calls": args.calls,
            "P": args.P, "seconds": time.time() - t0, "counts": counts, "first_other": first_other,
            "healthy_after": healthy_ok, "provenance": provenance.collect()}


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise SystemExit(f"--out {out} is a file; it names a folder")
    rec = run(args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "timeout_contention.json").write_text(json.dumps(rec, indent=1, default=str))
    print(json.dumps({k: rec[k] for k in ("busy", "calls", "counts", "healthy_after", "first_other")}))
    return 0 if rec["counts"]["launch_failure"] == 0 and rec["counts"]["other"] == 0 else 1
