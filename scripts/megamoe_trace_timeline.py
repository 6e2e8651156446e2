#!/usr/bin/env python
"""Mainloop cycles of a fused-kernel trace over time: median per phase (L1 / L2) and time
bucket, from a bench_megamoe --trace CSV (plain or .gz). Each trace row holds the SM cycles
from tile start to mainloop end, so a tile's clock is cycles / ns over that span and its
mainloop (first stage landed -> last WGMMA retired) in cycles is that clock times its ns --
comparable with the tensor pipe's ideal (4096 bf16 FLOP per cycle per SM: 65536 cycles for a
128 x 256 x 4096 tile). Shows, e.g., the mainloops slowing while the overlapped Dispatch runs.

    python scripts/megamoe_trace_timeline.py TRACE.csv[.gz] [--bucket-us 250]
"""
import argparse
import csv
import gzip
import statistics


def read_trace(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        return list(csv.DictReader(f))


def timeline(rows, bucket_us: float = 250.0):
    """{phase: [(bucket start us, tiles, median mainloop cycles, median clock MHz)]} over the
    trace rows (dicts with t_start_ns, t_ready_ns, t_mainloop_ns, cycles, phase); rows without
    cycles (older traces) or with an empty span are skipped."""
    out = {}
    buckets = {}
    for r in rows:
        t0, t1, t2 = int(r["t_start_ns"]), int(r["t_ready_ns"]), int(r["t_mainloop_ns"])
        cycles = int(r.get("cycles") or 0)
        if cycles <= 0 or t2 <= t0:
            continue
        clock = cycles / (t2 - t0)  # GHz
        key = (int(r["phase"]), int(t0 / (bucket_us * 1e3)))
        buckets.setdefault(key, []).append((clock * (t2 - t1), clock))
    for (phase, b), vals in sorted(buckets.items()):
        out.setdefault(phase, []).append((b * bucket_us, len(vals), round(statistics.median(v[0] for v in vals)),
                                          round(1e3 * statistics.median(v[1] for v in vals), 1)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--bucket-us", type=float, default=250.0)
    args = ap.parse_args()
    for phase, series in timeline(read_trace(args.trace), args.bucket_us).items():
        print(f"L{phase}: start_us tiles mainloop_cycles clock_MHz")
        for start, n, cyc, mhz in series:
            print(f"  {start:8.0f} {n:6d} {cyc:9d} {mhz:8.1f}")


if __name__ == "__main__":
    main()
