#!/usr/bin/env python
"""DRAM bytes of one fused-kernel launch per phase stretch: ncu's PM sampling (DRAM read /
write throughput, SM clock over time) against the L1 / L2 phases of a trace of the same
problem (bench_megamoe --trace). Says where in the schedule the DRAM bytes go.

    ncu --clock-control none --section PmSampling --metrics dram__bytes_read.sum,dram__bytes_write.sum \\
        --kernel-name regex:MegaMoE --launch-skip 8 --launch-count 1 -o pm \\
        python scripts/megamoe_ncu_driver.py --P 8
    ncu -i pm.ncu-rep --page raw --csv --print-metric-instances values > pm_raw.csv
    python scripts/bench_megamoe.py --P 8 --paired-only --paired-trials 0 --trace --schedules expert_wave
    python scripts/megamoe_pm_phases.py pm_raw.csv TRACE.csv[.gz] [--out DIR]

The trace is rank 0's, from a traced build (its own run, its own clock), so its span is
stretched onto the sampled kernel's active samples: phase boundaries are placed by their
share of the span, not by absolute times. The sampled throughputs are percentages of the
DRAM peak; they are scaled so that they add up to ncu's dram__bytes_*.sum of the same
launch when those are in the CSV, else by --dram-peak-gbs.
"""
import argparse
import csv
import gzip
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from megamoe_trace_timeline import read_trace  # noqa: E402
from xstage import provenance  # noqa: E402

READ = "dramc__read_throughput.avg.pct_of_peak_sustained_elapsed"
WRITE = "dramc__write_throughput.avg.pct_of_peak_sustained_elapsed"
CYCLES = "sm__cycles_active.avg"
_INSTANCES = re.compile(r"^(.*?)\s*\((.*)\)\s*$", re.S)
_BYTE_UNITS = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12}
DRAM_PEAK_GBS = 4800.0  # H200 HBM3e: the percentages' scale when the export has no byte totals


def _number(text: str):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def read_pm_kernels(path: str):
    """Kernels of an ``ncu --page raw --csv --print-metric-instances values`` export (plain or .gz):
    [(kernel name, scalars, series)], scalars = metric -> value (first number of the cell),
    series = PM-sampled metric (the part after ``TriageCompute.``) -> list of samples. Scalars
    in byte units (Kbyte, Mbyte, ...) are converted to bytes."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) < 3 or "Kernel Name" not in rows[0]:
        raise ValueError(f"{path}: not an ncu raw CSV export (no 'Kernel Name' column)")
    header, units = rows[0], rows[1]
    kernels = []
    for row in rows[2:]:  # rows[1] holds the units
        scalars, series = {}, {}
        for name, unit, cell in zip(header, units, row):
            m = _INSTANCES.match(cell)
            head = m.group(1) if m else cell
            if "TriageCompute." in name and m and ";" in m.group(2):
                series[name.split("TriageCompute.", 1)[1]] = [_number(v) or 0.0 for v in m.group(2).split(";")]
            elif _number(head) is not None:
                scalars[name] = _number(head) * _BYTE_UNITS.get(unit, 1.0)
        kernels.append((row[header.index("Kernel Name")], scalars, series))
    return kernels


def active_window(cycles):
    """(first, end) of the samples in which the SMs were active."""
    idx = [i for i, c in enumerate(cycles) if c > 0]
    if not idx:
        raise ValueError("no sample with active SM cycles")
    return idx[0], idx[-1] + 1


def l1_share(trace_rows, n_bins: int):
    """Per bin of the trace's span cut into ``n_bins``: the L1 tiles' share of the tile time
    (tile start -> epilogue end, summed over CTAs) in that bin; None where no tile ran."""
    span = max(int(r["t_epilogue_ns"]) for r in trace_rows)
    width = span / n_bins
    busy = [[0.0, 0.0] for _ in range(n_bins)]
    for r in trace_rows:
        t0, t1 = int(r["t_start_ns"]), int(r["t_epilogue_ns"])
        phase = int(r["phase"])
        for b in range(int(t0 // width), min(n_bins - 1, int(t1 // width)) + 1):
            overlap = min(t1, (b + 1) * width) - max(t0, b * width)
            if overlap > 0:
                busy[b][phase - 1] += overlap
    return [l1 / (l1 + l2) if l1 + l2 > 0 else None for l1, l2 in busy]


def stretches(shares, min_bins: int = 3):
    """Runs of bins by their majority phase (1 where the L1 share is >= 0.5, else 2; bins
    without tiles join the run before them): [(phase, first bin, end bin)]; a run shorter
    than ``min_bins`` between two others merges into the run before it (the first and the
    last run stay as they are)."""
    runs = []
    for b, s in enumerate(shares):
        phase = runs[-1][0] if s is None and runs else (1 if (s or 0) >= 0.5 else 2)
        if runs and runs[-1][0] == phase:
            runs[-1][2] = b + 1
        elif len(runs) > 1 and runs[-1][2] - runs[-1][1] < min_bins:
            blip = runs.pop()  # too short: it joins the run before it
            runs[-1][2] = blip[2]
            if runs[-1][0] == phase:
                runs[-1][2] = b + 1
            else:
                runs.append([phase, b, b + 1])
        else:
            runs.append([phase, b, b + 1])
    return [tuple(r) for r in runs]


def phase_bytes(kernel, trace_rows, dram_peak_gbs: float = DRAM_PEAK_GBS):
    """Per stretch of the trace's phases: DRAM bytes read / written and the mean SM clock
    from the PM samples of ``kernel`` (a read_pm_kernels entry). Returns a dict with the
    stretches, the totals per phase and how the percentages were scaled to bytes."""
    name, scalars, series = kernel
    interval_us = scalars.get("profiler__pmsampler_interval_time")
    if not interval_us:
        raise ValueError(f"{name}: no profiler__pmsampler_interval_time (not a PmSampling export?)")
    first, end = active_window(series[CYCLES])
    rd, wr = series[READ][first:end], series[WRITE][first:end]
    cycles = series[CYCLES][first:end]
    # percent of peak per sample -> bytes: calibrated on the launch's counted totals when present
    per_pct = dram_peak_gbs * 1e9 * interval_us * 1e-6 / 100.0
    scale_rd = scale_wr = per_pct
    calibrated = "dram__bytes_read.sum" in scalars and "dram__bytes_write.sum" in scalars
    if calibrated:
        scale_rd = scalars["dram__bytes_read.sum"] / max(sum(rd), 1e-12)
        scale_wr = scalars["dram__bytes_write.sum"] / max(sum(wr), 1e-12)
    shares = l1_share(trace_rows, len(rd))
    out = {"kernel": name, "interval_us": interval_us, "samples": len(rd),
           "scaling": "dram__bytes_*.sum" if calibrated else f"peak {dram_peak_gbs} GB/s",
           "stretches": [], "per_phase": {}}
    for phase, b0, b1 in stretches(shares):
        seg = dict(phase=phase, start_us=round(b0 * interval_us, 1), end_us=round(b1 * interval_us, 1),
                   read_gb=round(sum(rd[b0:b1]) * scale_rd / 1e9, 4), write_gb=round(sum(wr[b0:b1]) * scale_wr / 1e9, 4),
                   sm_clock_mhz=round(sum(cycles[b0:b1]) / ((b1 - b0) * interval_us), 1))
        out["stretches"].append(seg)
        tot = out["per_phase"].setdefault(f"L{phase}", dict(time_us=0.0, read_gb=0.0, write_gb=0.0))
        tot["time_us"] = round(tot["time_us"] + seg["end_us"] - seg["start_us"], 1)
        tot["read_gb"] = round(tot["read_gb"] + seg["read_gb"], 4)
        tot["write_gb"] = round(tot["write_gb"] + seg["write_gb"], 4)
    out["read_gb"] = round(sum(rd) * scale_rd / 1e9, 4)
    out["write_gb"] = round(sum(wr) * scale_wr / 1e9, 4)
    return out


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
