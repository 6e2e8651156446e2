#!/usr/bin/env python
"""Mainloop cycles of a fused-kernel trace over time: median per phase (L1 / L2) and time
bucket, from a bench_megamoe --trace CSV (plain or .gz), per row through
api.trace_mainloop_cycles (the tensor pipe's ideal: 65536 cycles for a 128 x 256 x 4096
tile). Shows, e.g., the mainloops slowing while the overlapped Dispatch runs.

``--window W`` (expert_wave's Dispatch window, MegaMoE(dispatch_window=W)) adds how the L1
tiles waited for their rows: row r may be copied once row r - W has a finished L1 tile (the
window opens), and its tiles wait until every CTA has copied its share (see window_waits).

    python scripts/megamoe_trace_timeline.py TRACE.csv[.gz] [--bucket-us 250] [--window 5]
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


def window_waits(rows, window: int, min_wait_ns: int = 2000) -> dict:
    """The L1 tiles' waits for their rows under a Dispatch window of ``window`` rows, from trace
    rows (dicts with phase, row, cta, t_start_ns, t_ready_ns, t_epilogue_ns). Per scheduler row
    r >= window, "opened" = the first end of an L1 tile of row r - window. A row "waited" when
    at least one of its tiles waited >= ``min_wait_ns`` from its start to its first stage; the
    earliest such tile's first stage is when the row was ready. Returns the rows counted, the
    rows that waited, the medians of (ready - opened) and (first tile start - opened) in us
    over the rows that waited, and the L1 wait summed per CTA in us."""
    l1 = [r for r in rows if int(r["phase"]) == 1]
    by_row = {}
    for r in l1:
        by_row.setdefault(int(r["row"]), []).append(r)
    first_end = {k: min(int(t["t_epilogue_ns"]) for t in v) for k, v in by_row.items()}
    ready_lag, start_lag, counted = [], [], 0
    for k, tiles in by_row.items():
        if k < window or k - window not in first_end:
            continue
        counted += 1
        opened = first_end[k - window]
        waited = [t for t in tiles if int(t["t_ready_ns"]) - int(t["t_start_ns"]) >= min_wait_ns]
        if waited:
            ready_lag.append((min(int(t["t_ready_ns"]) for t in waited) - opened) / 1e3)
            start_lag.append((min(int(t["t_start_ns"]) for t in tiles) - opened) / 1e3)
    ctas = {int(r["cta"]) for r in l1}
    wait_us = sum(int(r["t_ready_ns"]) - int(r["t_start_ns"]) for r in l1) / 1e3
    return dict(rows=counted, rows_waited=len(ready_lag),
                ready_after_open_us_median=round(statistics.median(ready_lag), 2) if ready_lag else None,
                start_after_open_us_median=round(statistics.median(start_lag), 2) if start_lag else None,
                l1_wait_us_per_cta=round(wait_us / len(ctas), 1) if ctas else 0.0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--bucket-us", type=float, default=250.0)
    ap.add_argument("--window", type=int, default=None, metavar="W",
                    help="also the L1 tiles' waits for their rows under a Dispatch window of W rows")
    args = ap.parse_args()
    rows = read_trace(args.trace)
    for phase, series in timeline(rows, args.bucket_us).items():
        print(f"L{phase}: start_us tiles mainloop_cycles clock_MHz")
        for start, n, cyc, mhz in series:
            print(f"  {start:8.0f} {n:6d} {cyc:9d} {mhz:8.1f}")
    if args.window is not None:
        print(f"Dispatch window W = {args.window}: {window_waits(rows, args.window)}")


if __name__ == "__main__":
    main()
