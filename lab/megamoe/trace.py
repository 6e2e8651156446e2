"""Per-tile traces of the fused kernel as files, and what the diagnostics read from them.

A traced call (``MegaMoEConfig(trace=True)``) leaves one int64 tensor per rank in
``MegaMoE.last_trace``; :func:`api.decode_trace` turns it into per-CTA tile records.
Here: those records as a CSV (:func:`write_trace`, the file ``lab.megamoe.bench --trace``
writes) and back (:func:`read_trace`, plain or .gz), the mainloop cycles over time
(:func:`timeline`), the L1 tiles' waits under a Dispatch window (:func:`window_waits`), and the
split of an ncu PM-sampling export of one launch by the trace's L1 / L2 phases
(:func:`read_pm_kernels`, :func:`phase_bytes`; scripts/diag/megamoe_pm_phases.py).

Everything here runs on a CPU (tests/test_megamoe_bench.py).
"""
from __future__ import annotations

import csv
import re
import statistics

from lab.bench import open_text
from megamoe_interleave.trace import trace_mainloop_cycles

# Columns of a trace CSV: one row per tile, times in ns from the earliest tile start of the call.
TRACE_CSV_FIELDS = ("cta", "seq", "phase", "row", "n_block", "t_start_ns", "t_ready_ns", "t_mainloop_ns",
                    "t_epilogue_ns", "smid", "cycles", "t_slot_ns", "t_rs_end_ns", "rs_ns")
# A tile's parts as (from, to) fields of a decoded record: ring / dependency wait, WGMMA, staging and handoff.
TILE_PARTS = {"wait": ("t_start", "t_ready"), "mainloop": ("t_ready", "t_mainloop"),
              "staging": ("t_mainloop", "t_epilogue")}


def write_trace(path, recs) -> None:
    """Decoded trace records (:func:`api.decode_trace`: a list per CTA) to a CSV of
    :data:`TRACE_CSV_FIELDS`, timestamps relative to the earliest tile start."""
    t_min = min(r["t_start"] for cta in recs for r in cta)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(TRACE_CSV_FIELDS)
        for c, cta in enumerate(recs):
            for i, r in enumerate(cta):
                w.writerow([c, i, r["phase"], r["row"], r["n_block"], r["t_start"] - t_min, r["t_ready"] - t_min,
                            r["t_mainloop"] - t_min, r["t_epilogue"] - t_min, r["smid"], r["cycles"],
                            r["t_slot"] - t_min, r["t_rs_end"] - t_min, r["rs_ns"]])


def read_trace(path):
    """The rows of a trace CSV (plain or .gz) as dicts of strings."""
    with open_text(path) as f:
        return list(csv.DictReader(f))


def read_trace_records(path):
    """The inverse of :func:`write_trace`: decoded records (a list per CTA, in order) of a trace CSV,
    integers, the ``t_*_ns`` columns under their record names (``t_start``, ...), times relative to
    the earliest tile start."""
    ctas = {}
    for row in read_trace(path):
        rec = {(k[:-3] if k.startswith("t_") and k.endswith("_ns") else k): int(v) for k, v in row.items()}
        ctas.setdefault(rec["cta"], []).append(rec)
    return [sorted(ctas[c], key=lambda r: r["seq"]) for c in sorted(ctas)]


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


# ----------------------------------------------------------------------------- ncu PM sampling vs the trace

PM_READ = "dramc__read_throughput.avg.pct_of_peak_sustained_elapsed"
PM_WRITE = "dramc__write_throughput.avg.pct_of_peak_sustained_elapsed"
PM_CYCLES = "sm__cycles_active.avg"
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
    with open_text(path) as f:
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
    first, end = active_window(series[PM_CYCLES])
    rd, wr = series[PM_READ][first:end], series[PM_WRITE][first:end]
    cycles = series[PM_CYCLES][first:end]
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
