#!/usr/bin/env python3
"""The SM clock inside the fused kernel, from its trace build: per tile, ``%clock64`` cycles from
tile start to mainloop end over the ``%globaltimer`` nanoseconds between them. NVML cannot
resolve the clock within a 28-ms call (results/h200/megamoe/clock_probe/), so this is how to tell
whether a call runs power-limited: a call after the paired bench's cooldown ("cool") against
the last of back-to-back calls ("hot"), per rank (in a loopback call rank r runs r-th).

    python scripts/diag/megamoe_trace_clock.py --P 8 --tokens 8192 --hot-calls 10

Prints the median clock per rank and writes ``trace_clock<tag>.json`` under ``--out``.
"""
import argparse
import os
import statistics
import time

import torch

from lab.megamoe import bench
from megamoe_interleave.trace import decode_trace, trace_mainloop_cycles
from megamoe_interleave.config import MegaMoEConfig
from megamoe_interleave.shapes import get_shape
from xstage import provenance


def clock_per_rank(moe) -> dict:
    """rank -> median MHz over its tiles (api.trace_mainloop_cycles: cycles / ns from tile start
    to mainloop end)."""
    out = {}
    for rank, trace in sorted(moe.last_trace.items()):
        spans = (trace_mainloop_cycles(r["cycles"], r["t_start"], r["t_ready"], r["t_mainloop"])
                 for cta in decode_trace(trace) for r in cta)
        mhz = [m[0] * 1e3 for m in spans if m is not None]
        out[rank] = statistics.median(mhz) if mhz else None
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_one_problem_args(ap)
    ap.add_argument("--cooldown-s", type=float, default=0.25)
    ap.add_argument("--hot-calls", type=int, default=10)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=bench.DEFAULT_OUT)
    args = ap.parse_args()
    if min(args.P, args.tokens, args.hot_calls) < 1:
        raise SystemExit("--P, --tokens and --hot-calls must be >= 1")
    shape = get_shape(args.shape)
    w1, w2, xs, idx, wts = bench.make_problem(shape, "balanced", args.P, args.tokens)
    result = {}
    for sched in args.schedules:
        moe = bench.build_moe(shape, args.P, args.tokens, MegaMoEConfig(sched, trace=True), w1, w2)
        moe.forward(xs, idx, wts)  # compile
        torch.cuda.synchronize()
        time.sleep(args.cooldown_s)
        moe.forward(xs, idx, wts)
        cool = clock_per_rank(moe)
        for _ in range(args.hot_calls):
            moe.forward(xs, idx, wts)
        hot = clock_per_rank(moe)
        result[sched] = {"cool_mhz": cool, "hot_mhz": hot}
        for name, per_rank in (("cool", cool), ("hot", hot)):
            print(f"{sched:12s} {name:4s} " + " ".join(f"r{r}:{v:6.0f}" for r, v in per_rank.items()), flush=True)
        del moe
    os.makedirs(args.out, exist_ok=True)
    provenance.write_json(os.path.join(args.out, f"trace_clock{args.tag}.json"), {"args": vars(args), **result})


if __name__ == "__main__":
    main()
