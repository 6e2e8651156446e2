#!/usr/bin/env python3
"""The SM clock and board power *during* a call, fused MegaMoE vs the two grouped GEMMs.

The paired bench (bench_megamoe.py) reads the clock after each call, when the GPU is idle
again, so it cannot tell whether a call ran power-limited. Here a sampler thread polls NVML
(``torch.cuda.clock_rate`` / ``torch.cuda.power_draw``) while each call runs, with the paired
bench's cooldown and rotated order. Per variant it reports the median clock and power over the
busy samples (power >= half the largest power seen in that call) and the event time.

    python scripts/megamoe_clock_probe.py --P 8 --tokens 8192 --trials 7

Writes ``clock_probe<tag>.json`` (provenance, per-call samples) under ``--out``.
"""
import argparse
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import bench_megamoe as bench  # noqa: E402
from megamoe_interleave.shapes import get_shape  # noqa: E402
from xstage import paired, provenance  # noqa: E402


def sampled_call(fn):
    """Run ``fn`` (returns its device time in us) while a thread polls NVML: (us, samples),
    samples = [(seconds since launch, SM MHz, W)]."""
    samples, stop = [], threading.Event()
    t0 = time.perf_counter()

    def poll():
        while not stop.is_set():
            samples.append((time.perf_counter() - t0, torch.cuda.clock_rate(), torch.cuda.power_draw() / 1000))
    th = threading.Thread(target=poll, daemon=True)
    th.start()
    us = fn()
    stop.set()
    th.join(timeout=5)
    return us, samples


def busy(samples):
    """The samples taken while the GPU drew at least half of the call's largest power."""
    if not samples:
        return []
    top = max(w for _, _, w in samples)
    return [s for s in samples if s[2] >= 0.5 * top]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="deepseek-v4-flash")
    ap.add_argument("--P", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--cooldown-s", type=float, default=0.25)
    ap.add_argument("--schedules", nargs="+", default=["expert_wave", "interleaved"])
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default="results/h200/megamoe")
    args = ap.parse_args()
    if args.trials < 1 or args.P < 1 or args.tokens < 1:
        raise SystemExit("--trials, --P and --tokens must be >= 1")
    if paired.sm_clock_mhz() is None:
        raise SystemExit("NVML is not available (torch.cuda.clock_rate failed): nothing to sample")
    shape = get_shape(args.shape)
    w1, w2, xs, idx, wts = bench.make_problem(shape, "balanced", args.P, args.tokens)
    (w1_t, w2_t), gemms_only = bench.grouped_gemms(shape, args.P, w1, w2, idx, wts)
    refs = bench.unfused_pipeline(xs, idx, wts, w1_t, w2_t)
    fns = {"grouped_mm x2": bench.event_timed(gemms_only)}
    cache = {}
    for sched in args.schedules:
        kw = bench.fused_kwargs(shape, args.P, args.tokens, sched)
        fns[f"fused[{sched}]"] = bench.fused_kernel_timed(kw, w1, w2, xs, idx, wts, args.P, "loopback", refs=refs,
                                                          name=sched, weight_cache=cache)
    calls = {k: [] for k in fns}
    for t in range(args.trials):
        for k in paired.rotated(list(fns), t):
            torch.cuda.synchronize()
            time.sleep(args.cooldown_s)
            us, samples = sampled_call(fns[k])
            calls[k].append({"us": us, "samples": samples})
        print(f"trial {t + 1}/{args.trials}", flush=True)
    summary = {}
    print(f"{'variant':24s} {'time us':>10s} {'busy MHz':>9s} {'busy W':>7s} {'samples':>8s}")
    for k, cs in calls.items():
        b = [s for c in cs for s in busy(c["samples"])]
        row = {"median_us": statistics.median(c["us"] for c in cs), "busy_samples": len(b),
               "busy_clock_mhz_median": statistics.median(s[1] for s in b) if b else None,
               "busy_power_w_median": statistics.median(s[2] for s in b) if b else None}
        summary[k] = row
        print(f"{k:24s} {row['median_us']:10.1f} {row['busy_clock_mhz_median'] or float('nan'):9.0f} "
              f"{row['busy_power_w_median'] or float('nan'):7.0f} {len(b):8d}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    provenance.write_json(os.path.join(args.out, f"clock_probe{args.tag}.json"),
                          {"args": vars(args), "summary": summary, "calls": calls})


if __name__ == "__main__":
    main()
