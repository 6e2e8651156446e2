#!/usr/bin/env python
"""Where does ``MegaMoE.forward`` spend the time outside the fused kernels?

Runs the benchmark problem (lab.megamoe.bench.make_problem: DeepSeek-V4-Flash by default,
balanced routing, loopback world; the schedule's default MegaMoEConfig)
and reports, per phase of one call, the host wall time with the GPU drained before and
after the phase (``--sync``: serialised view, each phase's full cost) and the overlapped
wall time of whole calls; then a ``torch.profiler`` table of the top CPU and CUDA ops and a
Chrome trace (``<out>/megamoe_api_trace.json``). Writes ``<out>/megamoe_api_profile.json``
with provenance.

    python scripts/diag/profile_megamoe_api.py --P 1 --tokens 8192
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

from lab.megamoe.bench import DEFAULT_OUT, build_moe, make_problem
from megamoe_interleave.api import MegaMoE
from megamoe_interleave.config import MegaMoEConfig
from megamoe_interleave.shapes import get_shape
from xstage import provenance

PHASES = (("", "stage_inputs"), ("planner", "plan"), ("launcher", "launch_arguments"), ("launcher", "run"),
          ("", "reduce_rank"))


def phase_owners(moe: MegaMoE):
    """(object, method name) of each phase: the layer, its host planner and its launcher."""
    return [(getattr(moe, part) if part else moe, name) for part, name in PHASES]


def timed_phases(moe: MegaMoE, totals: dict, sync: bool) -> None:
    """Wrap the instances' phase methods (instance attributes shadow the class methods; the
    classes are untouched) so each call adds its wall time to ``totals[name]``."""
    for owner, name in phase_owners(moe):
        fn = getattr(owner, name)

        def wrapper(*a, _fn=fn, _name=name, **kw):
            if sync:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = _fn(*a, **kw)
            if sync:
                torch.cuda.synchronize()
            totals[_name] = totals.get(_name, 0.0) + (time.perf_counter() - t0) * 1e6
            return out

        setattr(owner, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="deepseek-v4-flash")
    ap.add_argument("--P", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--schedule", default="interleaved", choices=["expert_wave", "interleaved"])
    ap.add_argument("--poison", default="on", choices=["on", "off"])
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args()
    if args.calls < 2 or args.P < 1 or args.tokens < 1:
        ap.error("--calls >= 2, --P >= 1, --tokens >= 1")
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    shape = get_shape(args.shape)
    w1, w2, xs, idx, wts = make_problem(shape, "balanced", args.P, args.tokens)
    moe = build_moe(shape, args.P, args.tokens, MegaMoEConfig(args.schedule), w1, w2,
                    poison_combine=args.poison == "on")
    del w1, w2
    moe.forward(xs, idx, wts)  # compile + warm caches
    torch.cuda.synchronize()

    result = {"args": vars(args), "config": dataclasses.asdict(moe.config)}
    for sync in (False, True):
        totals: dict = {}
        timed_phases(moe, totals, sync)
        kernel_us = []
        t0 = time.perf_counter()
        for _ in range(args.calls):
            moe.forward(xs, idx, wts)
            kernel_us.append(moe.last_kernel_us)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e6 / args.calls
        for owner, name in phase_owners(moe):  # restore the class methods
            owner.__dict__.pop(name, None)
        key = "serialised" if sync else "overlapped"
        per_call = {n: round(v / args.calls, 1) for n, v in totals.items()}
        kernel_med = sorted(kernel_us)[len(kernel_us) // 2]
        result[key] = {"wall_us_per_call": round(wall, 1), "kernel_us_median": round(kernel_med, 1),
                       "phase_us_per_call": per_call}
        print(f"{key:10s} wall {wall:9.1f} us/call, kernels {result[key]['kernel_us_median']:9.1f} us; phases (nested: "
              f"run contains launch_arguments): {per_call}", flush=True)

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            moe.forward(xs, idx, wts)
        torch.cuda.synchronize()
    os.makedirs(args.out, exist_ok=True)
    prof.export_chrome_trace(os.path.join(args.out, "megamoe_api_trace.json"))
    ka = prof.key_averages()
    for sort in ("self_cpu_time_total", "self_cuda_time_total"):
        print(ka.table(sort_by=sort, row_limit=15), flush=True)
    result["top_ops"] = [{"name": e.key, "calls": e.count, "self_cpu_us": round(e.self_cpu_time_total, 1),
                          "self_cuda_us": round(getattr(e, "self_device_time_total", 0.0), 1)}
                         for e in sorted(ka, key=lambda e: -e.self_cpu_time_total)[:25]]
    provenance.write_json(os.path.join(args.out, "megamoe_api_profile.json"), result)


if __name__ == "__main__":
    main()
