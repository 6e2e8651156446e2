"""scripts/bench_megamoe.py on the CPU: the paired fused-vs-grouped-GEMM comparison (trial
rotation and the verdicts) with fake timed calls; the bench itself needs a GPU. Also
scripts/megamoe_trace_timeline.py on a hand-made trace."""
import csv
import importlib.util
import random
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_megamoe", ROOT / "scripts" / "bench_megamoe.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
_spec = importlib.util.spec_from_file_location("megamoe_trace_timeline", ROOT / "scripts" / "megamoe_trace_timeline.py")
timeline_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(timeline_script)
_spec = importlib.util.spec_from_file_location("megamoe_pm_phases", ROOT / "scripts" / "megamoe_pm_phases.py")
pm_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pm_script)


def _bimodal_baseline(n=21, seed=1):
    """Grouped GEMMs alternate between a fast (4.6 ms) and a slow (5.3 ms) mode, the fused kernel
    sits at 5.2 ms: separately taken medians can land either side, the paired view cannot."""
    rnd = random.Random(seed)
    base = [(4600.0 if i % 3 else 5300.0) + rnd.gauss(0, 10) for i in range(n)]
    fused = [5200.0 + rnd.gauss(0, 5) for _ in range(n)]
    clocks = {"grouped_mm x2": [1980] * n, "fused": [1980] * n}
    return {"grouped_mm x2": base, "fused": fused}, clocks


def test_paired_verdicts_fused_slower_than_the_fast_mode():
    samples, clocks = _bimodal_baseline()
    v = bench.paired_verdicts(samples, clocks, "grouped_mm x2", 30.0)["variants"]["fused"]
    assert v["n_matched"] == 21
    assert v["median_ratio"] == pytest.approx(5200 / 4600, rel=0.01)
    assert v["frac_not_slower"] == pytest.approx(7 / 21)
    assert v["slower"]["verdict"] == "fail"  # 14 of 21 slower: p ~ 0.09, not significant
    assert v["faster"]["verdict"] == "fail"
    assert v["no_slower"] is False


def test_paired_verdicts_clock_matching_and_no_slower():
    n = 21
    samples = {"grouped_mm x2": [5000.0 + i for i in range(n)], "fused": [4900.0 + i for i in range(n)]}
    clocks = {"grouped_mm x2": [1980] * n, "fused": [1980] * (n - 4) + [1755] * 4}  # 4 throttled fused trials
    row = bench.paired_verdicts(samples, clocks, "grouped_mm x2", 30.0)
    v = row["variants"]["fused"]
    assert row["reference_clock_mhz"] == 1980 and v["n_matched"] == n - 4
    assert v["no_slower"] and v["frac_not_slower"] == 1.0 and v["faster"]["verdict"] == "pass"
    assert v["slower"]["verdict"] == "fail"


def test_paired_trials_rotates_and_reads_clocks(monkeypatch):
    calls = []
    monkeypatch.setattr(bench.paired, "sm_clock_mhz", lambda: 1980)
    fns = {k: (lambda k=k: calls.append(k) or 1.0) for k in ("g", "a", "b")}
    samples, clocks = bench.paired_trials(fns, 3)
    assert calls == ["g", "a", "b", "a", "b", "g", "b", "g", "a"]
    assert all(len(v) == 3 for v in samples.values()) and clocks["a"] == [1980] * 3


def test_paired_table_and_csv_without_rows(tmp_path):
    """--paired-only has no per-variant rows: no CSV of them (an empty run once crashed the
    bench before the JSON was written); the paired rows flatten to one CSV row per variant."""
    samples, clocks = _bimodal_baseline()
    row = dict(shape="s", routing="balanced", world="loopback", P=1, tokens_per_rank=8,
               **bench.paired_verdicts(samples, clocks, "grouped_mm x2", 30.0))
    bench.write_csv(tmp_path / "none.csv", [])
    assert not (tmp_path / "none.csv").exists()
    table = bench.paired_table([row])
    assert len(table) == 1 and table[0]["variant"] == "fused" and table[0]["no_slower"] is False
    assert table[0]["slower"] == "fail" and table[0]["n_matched"] == 21
    bench.write_csv(tmp_path / "paired.csv", table)
    assert (tmp_path / "paired.csv").read_text().splitlines()[0].startswith("shape,routing,world,P")


def test_kernel_config_ok_skips_what_does_not_fit():
    kw = dict(schedule="expert_wave", block_m=128, block_n=256, mma="tma_ws_mcast_b", split_tail=None,
              dispatch_warps=None, l2_handoffs=None)
    assert bench.kernel_config_ok(4096, 2048, dict(kw, stages=4))
    assert bench.kernel_config_ok(4096, 2048, dict(kw, stages=3, l2_handoffs=1))
    assert not bench.kernel_config_ok(4096, 2048, dict(kw, stages=4, l2_handoffs=1))
    # the Dispatch options resolve as in the API: no dispatch_copy given = bulk where the bounce
    # buffers fit (3 stages), so a window is accepted there and not at 4 stages (LSU copy)
    assert bench.kernel_config_ok(4096, 2048, dict(kw, stages=3, dispatch_copy=None, dispatch_window=6,
                                                    dispatch_keep=1))
    assert not bench.kernel_config_ok(4096, 2048, dict(kw, stages=4, dispatch_copy=None, dispatch_window=6))
    assert not bench.kernel_config_ok(4096, 2048, dict(kw, stages=3, dispatch_window=0, dispatch_keep=1))


def test_cta_budget_splits_each_ctas_time():
    """Two CTAs, hand-made timelines: per-CTA sums of mainloop / wait / staging / gaps and the
    tail while the slower CTA finishes."""
    def tile(t0, wait, main, stage):
        return dict(t_start=t0, t_ready=t0 + wait, t_mainloop=t0 + wait + main, t_epilogue=t0 + wait + main + stage)
    a = [tile(0, 1, 10, 2), tile(15, 1, 10, 2)]  # ends at 28, gap 2
    b = [tile(1, 3, 10, 2), tile(16, 0, 20, 4)]  # ends at 40, gap 0
    out = bench.cta_budget([a, b, []])
    assert out["cta_tail_ns_min"] == 0 and out["cta_tail_ns_max"] == 12
    assert out["cta_start_ns_max"] == 1
    assert bench.cta_budget([a])["cta_mainloop_ns_median"] == 20
    assert bench.cta_budget([a])["cta_gap_ns_median"] == 2 and bench.cta_budget([b])["cta_gap_ns_median"] == 0
    assert bench.cta_budget([b])["cta_staging_ns_median"] == 6 and bench.cta_budget([b])["cta_wait_ns_median"] == 3
    assert bench.cta_budget([a])["cta_busy_ns_median"] == 28
    assert bench.cta_budget([]) == {}


def test_mainloop_cycles_converts_through_each_tiles_clock():
    """cycles / ns over tile start -> mainloop end is the clock; the mainloop in cycles is that
    clock times its ns (a 1.5 GHz and a 2 GHz tile, both 3000-cycle mainloops); rows without
    cycles (older traces) give nothing."""
    rs = [dict(t_start=0, t_ready=1000, t_mainloop=3000, cycles=4500),  # 1.5 GHz, 2000 ns mainloop
          dict(t_start=0, t_ready=500, t_mainloop=2000, cycles=4000),  # 2 GHz, 1500 ns mainloop
          dict(t_start=0, t_ready=500, t_mainloop=2000, cycles=4000)]
    out = bench.mainloop_cycles(rs, "l1")
    assert out == {"l1_clock_mhz_median": 2000.0, "l1_mainloop_cycles_median": 3000}
    assert bench.mainloop_cycles([dict(t_start=0, t_ready=1, t_mainloop=2)], "l2") == {}


def test_trace_timeline_buckets_mainloop_cycles():
    """scripts/megamoe_trace_timeline.py: per phase and time bucket, the median mainloop in
    cycles (clock from cycles / ns over tile start -> mainloop end) and the median clock."""
    import gzip
    import os
    import tempfile

    tl = timeline_script

    def row(phase, t0, wait, main, clock_ghz):
        return dict(phase=phase, t_start_ns=t0, t_ready_ns=t0 + wait, t_mainloop_ns=t0 + wait + main,
                    cycles=round(clock_ghz * (wait + main)))
    rows = [row(1, 0, 100, 40000, 1.5), row(1, 10000, 100, 50000, 1.5), row(2, 260000, 0, 20000, 2.0),
            dict(phase=1, t_start_ns=5, t_ready_ns=6, t_mainloop_ns=7, cycles=0)]  # no cycles: skipped
    out = tl.timeline(rows, bucket_us=250)
    assert out[1] == [(0.0, 2, 67500, 1500.0)]  # medians of 60000 and 75000 cycles
    assert out[2] == [(250.0, 1, 40000, 2000.0)]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.csv.gz")
        with gzip.open(path, "wt", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows[:3])
        assert tl.timeline(tl.read_trace(path), 250) == {1: out[1], 2: out[2]}


def test_trace_window_waits():
    """megamoe_trace_timeline.window_waits: row 2 (W = 2) opens when row 0's first L1 tile ends
    (t = 50 us); one of its tiles waits 8 us and its row is ready 12 us after the opening; row
    3's tiles do not wait; L2 tiles are not counted."""
    def tile(cta, row, t0, wait, end, phase=1):
        return dict(phase=phase, row=row, cta=cta, t_start_ns=t0, t_ready_ns=t0 + wait, t_epilogue_ns=end)
    rows = [tile(0, 0, 0, 100, 50_000), tile(1, 0, 1_000, 100, 60_000), tile(0, 1, 52_000, 100, 90_000),
            tile(1, 2, 54_000, 8_000, 100_000), tile(2, 2, 58_000, 4_000, 104_000), tile(2, 3, 70_000, 100, 110_000),
            tile(3, 3, 0, 50_000, 60_000, phase=2)]
    out = timeline_script.window_waits(rows, 2)
    assert out == dict(rows=2, rows_waited=1, ready_after_open_us_median=12.0, start_after_open_us_median=4.0,
                       l1_wait_us_per_cta=round((100 + 100 + 100 + 8_000 + 4_000 + 100) / 1e3 / 3, 1))


def _pm_export(path, read_pct, write_pct, cycles, totals_gb=None):
    """A hand-made ``ncu --page raw --csv --print-metric-instances values`` export of one kernel."""
    def series(values):
        return f"{values[0]} (" + "; ".join(str(v) for v in values) + ")"
    header = ["ID", "Kernel Name", "profiler__pmsampler_interval_time",
              "FBSP.TriageCompute." + pm_script.READ, "FBSP.TriageCompute." + pm_script.WRITE,
              "TPC.TriageCompute." + pm_script.CYCLES]
    units = ["", "", "us", "%", "%", "cycle"]
    row = ["0", "kernel_MegaMoESm90", "3 (3)", series(read_pct), series(write_pct), series(cycles)]
    if totals_gb is not None:
        header += ["dram__bytes_read.sum", "dram__bytes_write.sum"]
        units += ["Gbyte", "Gbyte"]
        row += [f"{totals_gb[0]:,}", f"{totals_gb[1]:,}"]
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([header, units, row])


def test_pm_phases_splits_dram_bytes_by_the_traces_phases(tmp_path):
    """scripts/megamoe_pm_phases.py: the sampled DRAM percentages go to the L1 / L2 stretch
    the trace puts each sample in (trace span stretched onto the active samples), scaled to
    ncu's counted totals when the export has them, else by the peak; idle samples at either
    end are dropped; a short blip of the other phase joins the stretch around it."""
    # 2 idle samples, 6 L1 samples, 4 L2 samples, 1 idle
    read = [0, 0, 30, 30, 30, 30, 30, 30, 10, 10, 10, 10, 0]
    write = [0, 0, 5, 5, 5, 5, 5, 5, 8, 8, 8, 8, 0]
    cycles = [0, 0] + [4500] * 10 + [0]
    trace = [dict(phase=1, t_start_ns=0, t_epilogue_ns=600), dict(phase=1, t_start_ns=0, t_epilogue_ns=590),
             dict(phase=2, t_start_ns=600, t_epilogue_ns=1000), dict(phase=1, t_start_ns=700, t_epilogue_ns=705)]
    path = tmp_path / "pm.csv"
    _pm_export(path, read, write, cycles, totals_gb=(2.2, 0.7))
    (kernel,) = pm_script.read_pm_kernels(str(path))
    assert kernel[1]["dram__bytes_read.sum"] == pytest.approx(2.2e9)  # Gbyte -> bytes
    out = pm_script.phase_bytes(kernel, trace)
    assert out["samples"] == 10 and out["scaling"] == "dram__bytes_*.sum"
    assert [(s["phase"], s["start_us"], s["end_us"]) for s in out["stretches"]] == [(1, 0.0, 18.0), (2, 18.0, 30.0)]
    l1, l2 = out["stretches"]
    assert l1["read_gb"] == pytest.approx(2.2 * 180 / 220, abs=1e-3)  # 6 x 30 of 220 percent-samples
    assert l2["read_gb"] == pytest.approx(2.2 * 40 / 220, abs=1e-3)
    assert l2["write_gb"] == pytest.approx(0.7 * 32 / 62, abs=1e-3)
    assert l1["sm_clock_mhz"] == pytest.approx(1500.0)  # 4500 cycles per 3 us
    assert out["per_phase"]["L1"]["time_us"] == 18.0
    blip = [1, 1, 1, 1, 0, 0, 0, 0, 0.9, 0, 0, None]  # one L1 bin inside the L2 stretch; no tiles at the end
    assert pm_script.stretches(blip) == [(1, 0, 4), (2, 4, 12)]
    assert pm_script.stretches(blip, min_bins=1) == [(1, 0, 4), (2, 4, 8), (1, 8, 9), (2, 9, 12)]
    _pm_export(path, read, write, cycles)  # no totals: scaled by the peak
    out = pm_script.phase_bytes(pm_script.read_pm_kernels(str(path))[0], trace, dram_peak_gbs=1000.0)
    assert out["read_gb"] == pytest.approx(220 / 100 * 1000e9 * 3e-6 / 1e9)
    with pytest.raises(ValueError, match="not an ncu raw CSV"):
        (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
        pm_script.read_pm_kernels(str(tmp_path / "bad.csv"))


def test_check_against_flags_wrong_outputs():
    """The bench checks each fused variant's first output against the unfused pipeline: within
    2 % of the output range passes; a NaN (an unwritten, poisoned Combine slot) or a larger
    error anywhere raises, naming the rank."""
    import torch

    g = torch.Generator().manual_seed(3)
    refs = [torch.randn(64, 32, generator=g).bfloat16() for _ in range(2)]
    close = [r.float() * (1 + 0.005 * torch.randn(r.shape, generator=g)) for r in refs]
    bench.check_against([c.bfloat16() for c in close], refs, "v")
    nan = [r.clone() for r in refs]
    nan[1][7, 3] = float("nan")
    with pytest.raises(RuntimeError, match="rank 1 output has non-finite"):
        bench.check_against(nan, refs, "v")
    off = [r.clone() for r in refs]
    off[0][63, 31] += 0.5 * refs[0].float().abs().max().item()
    with pytest.raises(RuntimeError, match="rank 0 max"):
        bench.check_against(off, refs, "v")


def test_variant_cases_run_each_schedule_once_per_axis_it_reads():
    """--experts-per-wave multiplies expert_wave's runs only, --lead interleaved's only."""
    values = {name: [None] for name in bench.VARIANT_AXES}
    values["experts_per_wave"] = [4, 16]
    values["lead"] = [3, 9]
    values["dispatch_window"] = [0, 5]
    cases = bench.variant_cases(values, ["expert_wave", "interleaved"])
    ew = sorted((a["experts_per_wave"], a["dispatch_window"]) for a, s in cases if s == "expert_wave")
    il = sorted((a["lead"], a["dispatch_window"]) for a, s in cases if s == "interleaved")
    assert ew == [(4, 0), (4, 5), (16, 0), (16, 5)]
    assert il == [(3, 0), (3, 5), (9, 0), (9, 5)]
    assert all(a["lead"] is None for a, s in cases if s == "expert_wave")
    assert all(a["experts_per_wave"] is None for a, s in cases if s == "interleaved")
    assert len(bench.variant_cases(values, ["expert_wave"])) == 4


def test_experts_per_wave_must_be_positive():
    from megamoe_interleave.scheduler import make_row_grid

    with pytest.raises(ValueError, match="experts_per_wave"):
        make_row_grid([5, 7, 0, 3], block_m=4, n_blocks_l1=4, n_blocks_l2=2, experts_per_wave=0)


def test_one_problem_args_defaults_and_checks():
    """The one-problem scripts (megamoe_energy, megamoe_trace_clock) share their problem flags."""
    import argparse

    ap = argparse.ArgumentParser()
    bench.add_one_problem_args(ap)
    args = ap.parse_args([])
    assert (args.shape, args.P, args.tokens, args.schedules) == ("deepseek-v4-flash", 8, 8192,
                                                                  ["expert_wave", "interleaved"])
    assert ap.parse_args(["--P", "1", "--schedules", "interleaved"]).schedules == ["interleaved"]
    with pytest.raises(SystemExit):
        ap.parse_args(["--schedules", "column"])


def test_bench_parser_has_every_variant_axis():
    """Every side-by-side axis run_case reads (VARIANT_AXES) is a flag of the bench's command
    line, defaulting to [None] or a list (a flag lost to another parser broke the bench once)."""
    args = bench.build_parser().parse_args([])
    for name in bench.VARIANT_AXES:
        assert isinstance(getattr(args, name), list), name
    assert bench.build_parser().parse_args(["--dispatch-window", "0", "6"]).dispatch_window == [0, 6]
