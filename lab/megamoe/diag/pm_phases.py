#!/usr/bin/env python
"""DRAM bytes of one fused-kernel launch per phase stretch: ncu's PM sampling (DRAM read /
write throughput, SM clock over time) against the L1 / L2 phases of a trace of the same
problem (``python -m lab.megamoe.bench --trace``). Says where in the schedule the DRAM bytes go.

    ncu --clock-control none --section PmSampling --metrics dram__bytes_read.sum,dram__bytes_write.sum \\
        --kernel-name regex:MegaMoE --launch-skip 8 --launch-count 1 -o pm \\
        python scripts/diag/megamoe_ncu_driver.py --P 8
    ncu -i pm.ncu-rep --page raw --csv --print-metric-instances values > pm_raw.csv
    python scripts/bench_megamoe.py --P 8 --paired-only --paired-trials 0 --trace --schedules expert_wave
    python scripts/diag/megamoe_pm_phases.py pm_raw.csv TRACE.csv[.gz] [--out DIR]

The trace is rank 0's, from a traced build (its own run, its own clock), so its span is
stretched onto the sampled kernel's active samples: phase boundaries are placed by their
share of the span, not by absolute times. The sampled throughputs are percentages of the
DRAM peak; they are scaled so that they add up to ncu's dram__bytes_*.sum of the same
launch when those are in the CSV, else by --dram-peak-gbs. The analysis is
:mod:`lab.megamoe.trace` (read_pm_kernels, phase_bytes); this is its command line.
"""
import argparse
import os
import re
import sys

from lab.megamoe.trace import DRAM_PEAK_GBS, phase_bytes, read_pm_kernels, read_trace
from xstage import provenance


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pm_csv", help="ncu --page raw --csv --print-metric-instances values export")
    ap.add_argument("trace", help="bench_megamoe --trace CSV (plain or .gz) of the same problem")
    ap.add_argument("--kernel", default="MegaMoE", help="regex: the first matching kernel of the export")
    ap.add_argument("--dram-peak-gbs", type=float, default=DRAM_PEAK_GBS,
                    help="DRAM peak for the percentages when the export has no dram__bytes_*.sum")
    ap.add_argument("--out", default=None, help="directory for pm_phases.json")
    args = ap.parse_args()
    kernels = [k for k in read_pm_kernels(args.pm_csv) if re.search(args.kernel, k[0])]
    if not kernels:
        sys.exit(f"no kernel matching {args.kernel!r} in {args.pm_csv}")
    res = phase_bytes(kernels[0], read_trace(args.trace), args.dram_peak_gbs)
    print(f"{res['samples']} samples of {res['interval_us']} us; bytes scaled by {res['scaling']}; "
          f"DRAM read {res['read_gb']:.3f} GB, write {res['write_gb']:.3f} GB")
    print("phase   start_us   end_us  read_GB  write_GB  SM_MHz")
    for s in res["stretches"]:
        print(f"  L{s['phase']}  {s['start_us']:8.0f} {s['end_us']:8.0f} {s['read_gb']:8.3f} {s['write_gb']:9.3f} "
              f"{s['sm_clock_mhz']:7.0f}")
    for phase, tot in res["per_phase"].items():
        print(f"{phase}: {tot['time_us']:.0f} us, read {tot['read_gb']:.3f} GB, write {tot['write_gb']:.3f} GB")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        provenance.write_json(os.path.join(args.out, "pm_phases.json"),
                              dict(res, pm_csv=os.path.basename(args.pm_csv), trace=os.path.basename(args.trace)))


if __name__ == "__main__":
    main()
