#!/usr/bin/env python
"""Mainloop cycles of a fused-kernel trace over time: median per phase (L1 / L2) and time
bucket, from a bench_megamoe --trace CSV (plain or .gz), per row through
api.trace_mainloop_cycles (the tensor pipe's ideal: 65536 cycles for a 128 x 256 x 4096
tile). Shows, e.g., the mainloops slowing while the overlapped Dispatch runs.

``--window W`` (the bulk Dispatch's window, MegaMoEConfig(dispatch_window=W)) adds how the L1
tiles waited for their rows: row r may be copied once row r - W has a finished L1 tile (the
window opens), and its tiles wait until every CTA has copied its share (see
lab.megamoe.trace.window_waits, which holds the analysis; this is its command line).

    python scripts/diag/megamoe_trace_timeline.py TRACE.csv[.gz] [--bucket-us 250] [--window 5]
"""
import argparse

from lab.megamoe.trace import read_trace, timeline, window_waits


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
