#!/usr/bin/env python
"""Mainloop cycles of a fused-kernel trace over time: median per phase (L1 / L2) and time
bucket, from a bench_megamoe --trace CSV (plain or .gz), per row through
api.trace_mainloop_cycles (the tensor pipe's ideal: 65536 cycles for a 128 x 256 x 4096
tile). Shows, e.g., the mainloops slowing while the overlapped Dispatch runs.

    python scripts/megamoe_trace_timeline.py TRACE.csv[.gz] [--bucket-us 250]
"""
import argparse
import csv
import gzip
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from megamoe_interleave.api import trace_mainloop_cycles  # noqa: E402


def read_trace(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        return list(csv.DictReader(f))


def timeline(rows, bucket_us: float = 250.0):
    """{phase: [(bucket start us, tiles, median mainloop cycles, median clock MHz)]} over the
    trace rows (dicts with t_start_ns, t_ready_ns, t_mainloop_ns, cycles, phase); rows without
    cycles (older traces) or with an empty span are skipped (api.trace_mainloop_cycles)."""
    buckets = {}
    for r in rows:
        t0 = int(r["t_start_ns"])
        m = trace_mainloop_cycles(int(r.get("cycles") or 0), t0, int(r["t_ready_ns"]), int(r["t_mainloop_ns"]))
        if m is not None:
            buckets.setdefault((int(r["phase"]), int(t0 / (bucket_us * 1e3))), []).append(m)
    out = {}
    for (phase, b), vals in sorted(buckets.items()):
        out.setdefault(phase, []).append((b * bucket_us, len(vals), round(statistics.median(v[1] for v in vals)),
                                          round(1e3 * statistics.median(v[0] for v in vals), 1)))
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
