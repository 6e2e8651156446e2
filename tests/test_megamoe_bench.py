"""lab.megamoe.bench on the CPU: the paired fused-vs-grouped-GEMM comparison (trial
rotation and the verdicts, through lab.bench) with fake timed calls, the side-by-side
MegaMoEConfig variants (names, configs, the skip of a variant that does not resolve), the
command line, and the trace analyses of lab.megamoe.trace on hand-made traces; the bench
itself needs a GPU."""
import csv
import dataclasses

import pytest

from lab.megamoe import bench
from lab.megamoe import trace as trace_mod
from megamoe_interleave.config import MegaMoEConfig
from megamoe_interleave.shapes import get_shape
from lab import bench as xbench

FLASH = get_shape("deepseek-v4-flash")


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
    """lab.megamoe.trace.timeline: per phase and time bucket, the median mainloop in
    cycles (clock from cycles / ns over tile start -> mainloop end) and the median clock."""
    import gzip
    import os
    import tempfile

    tl = trace_mod

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
    """lab.megamoe.trace.window_waits: row 2 (W = 2) opens when row 0's first L1 tile ends
    (t = 50 us); one of its tiles waits 8 us and its row is ready 12 us after the opening; row
    3's tiles do not wait; L2 tiles are not counted."""
    def tile(cta, row, t0, wait, end, phase=1):
        return dict(phase=phase, row=row, cta=cta, t_start_ns=t0, t_ready_ns=t0 + wait, t_epilogue_ns=end)
    rows = [tile(0, 0, 0, 100, 50_000), tile(1, 0, 1_000, 100, 60_000), tile(0, 1, 52_000, 100, 90_000),
            tile(1, 2, 54_000, 8_000, 100_000), tile(2, 2, 58_000, 4_000, 104_000), tile(2, 3, 70_000, 100, 110_000),
            tile(3, 3, 0, 50_000, 60_000, phase=2)]
    out = trace_mod.window_waits(rows, 2)
    assert out == dict(rows=2, rows_waited=1, ready_after_open_us_median=12.0, start_after_open_us_median=4.0,
                       l1_wait_us_per_cta=round((100 + 100 + 100 + 8_000 + 4_000 + 100) / 1e3 / 3, 1))


def _pm_export(path, read_pct, write_pct, cycles, totals_gb=None):
    """A hand-made ``ncu --page raw --csv --print-metric-instances values`` export of one kernel."""
    def series(values):
        return f"{values[0]} (" + "; ".join(str(v) for v in values) + ")"
    header = ["ID", "Kernel Name", "profiler__pmsampler_interval_time",
              "FBSP.TriageCompute." + trace_mod.PM_READ, "FBSP.TriageCompute." + trace_mod.PM_WRITE,
              "TPC.TriageCompute." + trace_mod.PM_CYCLES]
    units = ["", "", "us", "%", "%", "cycle"]
    row = ["0", "kernel_MegaMoESm90", "3 (3)", series(read_pct), series(write_pct), series(cycles)]
    if totals_gb is not None:
        header += ["dram__bytes_read.sum", "dram__bytes_write.sum"]
        units += ["Gbyte", "Gbyte"]
        row += [f"{totals_gb[0]:,}", f"{totals_gb[1]:,}"]
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([header, units, row])


def test_pm_phases_splits_dram_bytes_by_the_traces_phases(tmp_path):
    """lab.megamoe.trace.phase_bytes (scripts/diag/megamoe_pm_phases.py): the sampled DRAM percentages go to the L1 / L2 stretch
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
    (kernel,) = trace_mod.read_pm_kernels(str(path))
    assert kernel[1]["dram__bytes_read.sum"] == pytest.approx(2.2e9)  # Gbyte -> bytes
    out = trace_mod.phase_bytes(kernel, trace)
    assert out["samples"] == 10 and out["scaling"] == "dram__bytes_*.sum"
    assert [(s["phase"], s["start_us"], s["end_us"]) for s in out["stretches"]] == [(1, 0.0, 18.0), (2, 18.0, 30.0)]
    l1, l2 = out["stretches"]
    assert l1["read_gb"] == pytest.approx(2.2 * 180 / 220, abs=1e-3)  # 6 x 30 of 220 percent-samples
    assert l2["read_gb"] == pytest.approx(2.2 * 40 / 220, abs=1e-3)
    assert l2["write_gb"] == pytest.approx(0.7 * 32 / 62, abs=1e-3)
    assert l1["sm_clock_mhz"] == pytest.approx(1500.0)  # 4500 cycles per 3 us
    assert out["per_phase"]["L1"]["time_us"] == 18.0
    blip = [1, 1, 1, 1, 0, 0, 0, 0, 0.9, 0, 0, None]  # one L1 bin inside the L2 stretch; no tiles at the end
    assert trace_mod.stretches(blip) == [(1, 0, 4), (2, 4, 12)]
    assert trace_mod.stretches(blip, min_bins=1) == [(1, 0, 4), (2, 4, 8), (1, 8, 9), (2, 9, 12)]
    _pm_export(path, read, write, cycles)  # no totals: scaled by the peak
    out = trace_mod.phase_bytes(trace_mod.read_pm_kernels(str(path))[0], trace, dram_peak_gbs=1000.0)
    assert out["read_gb"] == pytest.approx(220 / 100 * 1000e9 * 3e-6 / 1e9)
    with pytest.raises(ValueError, match="not an ncu raw CSV"):
        (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
        trace_mod.read_pm_kernels(str(tmp_path / "bad.csv"))


def test_ncu_metrics_sets_the_launches_of_details_exports_side_by_side(tmp_path, capsys):
    """Two exports (the program's own output before one's header), three launches: a column each,
    a metric one launch lacks left blank, a file without the header refused."""
    import json

    from lab.megamoe.diag import ncu_metrics

    header = '"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value","Rule Name"'
    row = lambda i, k, m, v: f'"{i}","{k}","SOL","{m}","%","{v}",""'  # noqa: E731
    ours = tmp_path / "ours.csv"
    ours.write_text("config: ...\n==PROF== done\n" + "\n".join([header, row(0, "MegaMoESm90", "Tensor", "61.0"),
                                                                  row(0, "MegaMoESm90", "Issue", "50.0"),
                                                                  '"0","MegaMoESm90","SOL","","","",""']) + "\n")
    dg = tmp_path / "dg.csv"
    dg.write_text("\n".join([header, row(0, "sm90_fp8_gemm", "Tensor", "90.1"), row(1, "sm90_fp8_gemm", "Tensor", "82.4")]))
    columns, rows = ncu_metrics.side_by_side([str(ours), str(dg)])
    assert [c[0] for c in columns] == ["ours", "dg", "dg"]
    assert rows == [(("SOL", "Tensor", "%"), ["61.0", "90.1", "82.4"]), (("SOL", "Issue", "%"), ["50.0", "", ""])]
    ncu_metrics.main([str(ours), str(dg), "--out", str(tmp_path / "out")])
    assert "| SOL | Tensor | % | 61.0 | 90.1 | 82.4 |" in capsys.readouterr().out
    assert len(json.loads((tmp_path / "out" / "ncu_metrics.json").read_text())["columns"]) == 3
    (tmp_path / "bad.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="no ncu details header"):
        ncu_metrics.read_details(str(tmp_path / "bad.csv"))


def test_ncu_source_splits_samples_by_role_and_opcode(tmp_path, capsys):
    """The source-counter summary: rows from the consumers' setmaxnreg on are the consumers',
    opcodes lose predicate and modifiers, shares are of each role's samples, and an export of two
    kernels (ncu repeats the header) gives two summaries."""
    import gzip
    import json

    from lab.megamoe.diag import ncu_source

    header = ["Address", "Source", ncu_source.SAMPLES, ncu_source.EXECUTED, "stall_long_sb", "stall_barrier",
              "stall_long_sb (Not Issued)"]
    body = [["0x0", "BSSY B0, 0x10", "30", "1", "0", "30", "0"],
            ["0x1", "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xd8", "0", "1", "0", "0", "0"],
            ["0x2", "@!P1  LDG.E.STRONG.GPU R198, desc[UR8][R136.64+0x4]", "50", "1,000", "45", "0", "45"],
            ["0x3", "FFMA R1, R2, R3, R1", "20", "2,000", "0", "0", "0"]]
    path = tmp_path / "src.csv.gz"
    with gzip.open(path, "wt", newline="") as f:
        w = csv.writer(f)
        for name in ("kernel_a", "kernel_b"):
            w.writerow(["Kernel Name", name])
            w.writerow(header)
            w.writerows(body)
    kernels = ncu_source.read_source_kernels(path)
    assert [k for k, _ in kernels] == ["kernel_a", "kernel_b"] and len(kernels[0][1]) == 4
    s = ncu_source.summarize(kernels[0][1], top=2)
    assert s["samples"] == 100 and s["roles"]["aux"]["share_of_samples"] == 0.3
    consumer = s["roles"]["consumer"]
    assert consumer["opcodes"] == {"LDG": round(50 / 70, 4), "FFMA": round(20 / 70, 4)}
    assert consumer["stall_reasons"] == {"long_sb": round(45 / 70, 4)}
    assert consumer["executed_warp_instructions"]["FFMA"] == 2000
    assert consumer["top_instructions"][0]["reasons"] == {"long_sb": 45}
    assert ncu_source.summarize([dict(zip(header, body[0]))])["roles"].keys() == {"all"}
    ncu_source.main([str(path), "--out", str(tmp_path / "out")])
    assert len(json.loads((tmp_path / "out" / "ncu_source.json").read_text())["kernels"]) == 2
    assert "consumer: 70.0 % of the samples" in capsys.readouterr().out


def test_sass_report_finds_spills_by_role_and_moves_before_back_edges():
    """The SASS report on a hand-written listing: local accesses before the consumers' setmaxnreg
    are the aux warps', between the first and last WGMMA the mainloop's; a backward branch in the
    WGMMA span is a K-loop back edge, and the moves just before it are listed."""
    from lab.megamoe.diag.sass_report import analyze

    lines = ["STL [R1+0x8], R5", "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xd8", "LDL R2, [R1+0x8]",
             "QGMMA.64x64x32.F32.E4M3.E4M3 R56, gdesc[UR16], RZ, !UPT", "WARPGROUP.DEPBAR.LE gsb0, 0x1",
             "LDG.E.STRONG.GPU R199, desc[UR52][R24.64]", "IMAD.MOV.U32 R32, RZ, RZ, R199", "@P1 BRA 0x30",
             "QGMMA.64x64x32.F32.E4M3.E4M3 R24, gdesc[UR16], RZ, !UPT", "LDL.LU R88, [R1+0x24]", "EXIT"]
    sass = "\n".join(f"        /*{16 * i:04x}*/                   {t} ;  /* 0x0 */" for i, t in enumerate(lines))
    r = analyze(sass, "REG:168 STACK:48 SHARED:1024")
    assert (r["reg"], r["stack"], r["wgmma"], r["wgmma_waits"]) == (168, 48, 2, 1)
    assert r["local_accesses"] == {"aux": 1, "consumers_mainloop": 0, "consumers_other": 2}
    assert r["k_loop_back_edges"] == [{"address": "0x70", "moves_before": ["IMAD.MOV.U32 R32, RZ, RZ, R199"]}]


def test_tile_budget_summarizes_a_trace():
    """The tile budget on two hand-written CTAs: per phase the tiles, the mainloop in cycles at each
    tile's own clock (cycles / ns from tile start to mainloop end) and the medians of the waits; the
    shares of CTAs x span add up to 100 here (no overlapping tiles); the ideal is the tile at the
    dense rate (DeepSeek-V4-Flash W8A8: 32768 / 16384 cycles, bf16 twice that)."""
    from lab.megamoe.diag.tile_budget import ideal_mainloop_cycles, phase_summary, summarize, time_shares
    from megamoe_interleave.shapes import get_shape

    def tile(phase, start, ready, mainloop, epilogue, ghz=2.0):
        return dict(phase=phase, t_start=start, t_ready=ready, t_mainloop=mainloop, t_epilogue=epilogue,
                    t_slot=mainloop + 10, cycles=int(ghz * (mainloop - start)))

    recs = [[tile(1, 0, 100, 1100, 1200), tile(2, 1300, 1350, 1850, 1900)],  # a 100 ns gap between its tiles
            [tile(1, 100, 200, 1200, 1400, ghz=1.5)], []]  # head 100 ns, tail 500 ns; a CTA without tiles
    l1 = phase_summary(recs, 1)
    assert (l1["tiles"], l1["mainloop_cycles_p10"], l1["mainloop_cycles_p50"], l1["mainloop_cycles_p90"]) == \
        (2, 1550, 1750, 1950)  # 1000 ns at 1.5 and 2.0 GHz
    assert (l1["wait_ns_median"], l1["staging_ns_median"], l1["slot_ns_median"]) == (100, 150, 10)
    assert phase_summary(recs, 3) == {}
    s = time_shares(recs)
    assert (s["ctas"], s["span_ns"]) == (2, 1900)
    ns = {k: s[f"{k}_pct"] * 2 * 1900 / 100 for k in ("wait", "mainloop", "staging", "gap", "head", "tail")}
    assert ns == pytest.approx({"wait": 250, "mainloop": 2500, "staging": 350, "gap": 100, "head": 100, "tail": 500},
                              rel=1e-3)  # the shares are rounded to 0.01 %
    assert sum(ns.values()) == pytest.approx(2 * 1900, rel=1e-3)
    shape = get_shape("deepseek-v4-flash")
    assert ideal_mainloop_cycles(shape, "w8a8") == {1: 32768, 2: 16384}
    assert ideal_mainloop_cycles(shape, "bf16") == {1: 65536, 2: 32768}
    assert summarize(recs, {1: 7, 2: 8})["L2"]["ideal_cycles"] == 8


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
    from megamoe_interleave.row_grid import make_row_grid

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
    """Every side-by-side axis run_case reads (VARIANT_AXES) is a MegaMoEConfig field and a flag
    of the bench's command line, defaulting to [None] or a list (a flag lost to another parser
    broke the bench once); the axes of deleted kernel options are gone; new runs go to runs/."""
    fields = {f.name for f in dataclasses.fields(MegaMoEConfig)}
    args = bench.build_parser().parse_args([])
    for name in bench.VARIANT_AXES:
        assert name in fields and getattr(args, name) == [None], name
    assert args.out == "results/h200/megamoe/runs" and args.schedules == ["expert_wave", "interleaved"]
    a = bench.build_parser().parse_args(["--dispatch-window", "0", "6", "--block-n", "128", "--l2-columns", "0", "1"])
    assert a.dispatch_window == [0, 6] and a.block_n == [128] and a.l2_columns == [0, 1]
    for gone in ("--mma", "--dispatch-warps", "--l2-handoffs", "--silu", "--balance-l2", "--dispatch-evict-first",
                 "--dispatch-keep", "--split-tail", "--block-m"):
        with pytest.raises(SystemExit):
            bench.build_parser().parse_args([gone, "1"])


def _axes(**given):
    return {name: given.get(name) for name in bench.VARIANT_AXES}


def _values(**given):
    """Command-line values of every axis (lists; [None] = not given)."""
    return {name: given.get(name, [None]) for name in bench.VARIANT_AXES}


def test_variant_names_and_configs():
    """Paired names fused[<schedule><,axis value...>] (the axes given only), timing-row labels with
    the resolved tile and ring depth, and the config each variant runs: the axes given, the rest
    as MegaMoEConfig.resolve fills it in (l2_columns 0/1 from the command line as a bool)."""
    assert bench.variant_name("expert_wave", _axes()) == "fused[expert_wave]"
    assert bench.variant_name("interleaved", _axes(stages=4, dispatch_copy="lsu", lead=3)) == \
        "fused[interleaved,D3,s4,dc=lsu]"
    cfg = bench.variant_config("expert_wave", _axes(l2_columns=0, dispatch_window=6))
    assert cfg.l2_columns is False and cfg.dispatch_window == 6 and cfg.stages is None and not cfg.resolved
    (name, axes, resolved), = bench.resolved_variants(FLASH, 8, 8192, {**_values(), "l2_columns": [0]},
                                                      ["expert_wave"], 132)
    assert name == "fused[expert_wave,l2col0]" and resolved.resolved and resolved.l2_columns is False
    assert (resolved.block_n, resolved.stages, resolved.dispatch_copy, resolved.dispatch_window) == (256, 3, "bulk", 5)
    assert resolved == MegaMoEConfig("expert_wave", l2_columns=False).resolve(FLASH, 8, 8192, 132)
    assert bench.impl_label(resolved, axes) == "fused[expert_wave,128x256,s3,l2col0]"
    assert bench.impl_label(resolved, _axes(stages=3, block_n=256)) == "fused[expert_wave,128x256,s3]"
    assert bench.trace_file_name("_x", "expert_wave", _axes(stages=3, dispatch_copy="bulk"), 8, 8192) == \
        "trace_x_s3_dcbulk_expert_wave_P8_T8192.csv"


def test_a_variant_that_does_not_resolve_is_skipped(capsys):
    """The side-by-side axes may combine into a configuration that cannot run: skipped with a
    note naming the variant, the others still run. At 128 x 256 tiles 4 stages leave no room for
    the bulk Dispatch's bounce buffers (its default there is the LSU copy, so a window needs 3
    stages); a window with the LSU copy is refused by MegaMoEConfig itself."""
    values = _values(stages=[3, 4], dispatch_copy=["bulk"])
    got = bench.resolved_variants(FLASH, 8, 8192, values, ["expert_wave", "interleaved"], 132)
    assert [name for name, _, _ in got] == ["fused[expert_wave,s3,dc=bulk]", "fused[interleaved,s3,dc=bulk]"]
    out = capsys.readouterr().out
    assert "skipping fused[expert_wave,s4,dc=bulk]" in out and "skipping fused[interleaved,s4,dc=bulk]" in out
    assert "does not fit" in out
    values = _values(stages=[3, 4], dispatch_window=[6])
    got = bench.resolved_variants(FLASH, 8, 8192, values, ["expert_wave"], 132)
    assert [(n, c.dispatch_copy) for n, _, c in got] == [("fused[expert_wave,s3,W6]", "bulk")]
    assert "skipping fused[expert_wave,s4,W6]: dispatch_window needs dispatch_copy='bulk'" in capsys.readouterr().out
    values = _values(dispatch_copy=["lsu"], dispatch_window=[5])
    assert bench.resolved_variants(FLASH, 8, 8192, values, ["interleaved"], 132) == []
    assert "skipping fused[interleaved,dc=lsu,W5]" in capsys.readouterr().out


def test_write_trace_round_trip(tmp_path):
    """A decoded trace (api.decode_trace of the kernel's int64 rows) to CSV and back: one row per
    tile, times relative to the earliest tile start."""
    import torch

    from megamoe_interleave.trace import decode_trace

    from megamoe_interleave.config import TRACE_FIELDS

    t = torch.full((2, 3, len(TRACE_FIELDS)), -1, dtype=torch.int64)
    t[0, 0] = torch.tensor([(1 << 40) | (0 << 16) | 1, 1000, 1100, 5000, 5200, 7, 6000, 5100, 5900, 650])
    t[0, 1] = torch.tensor([(2 << 40) | (3 << 16) | 2, 6000, 6500, 9000, 9100, 7, 4500, 9050, 9800, 600])
    t[1, 0] = torch.tensor([(1 << 40) | (1 << 16) | 0, 1500, 1600, 4500, 4600, 9, 4500, 4550, 5000, 300])
    path = tmp_path / "trace.csv"
    trace_mod.write_trace(path, decode_trace(t))
    rows = trace_mod.read_trace(path)
    assert list(rows[0]) == list(trace_mod.TRACE_CSV_FIELDS) and len(rows) == 3
    assert [(r["cta"], r["seq"], r["phase"], r["row"], r["n_block"]) for r in rows] == [
        ("0", "0", "1", "0", "1"), ("0", "1", "2", "3", "2"), ("1", "0", "1", "1", "0")]
    assert [int(r["t_start_ns"]) for r in rows] == [0, 5000, 500] and rows[1]["t_epilogue_ns"] == "8100"
    assert (rows[1]["t_slot_ns"], rows[1]["t_rs_end_ns"], rows[1]["rs_ns"]) == ("8050", "8800", "600")
    # 4500 cycles over 3000 ns from start to mainloop end: 1.5 GHz, 2500 ns of mainloop
    assert trace_mod.timeline(rows, 1)[2] == [(5, 1, 3750, 1500.0)]


class _FakeMoE:
    """Stands in for the fused MegaMoE of bench.build_moe on the CPU: forward returns the
    reference, its kernel time is 100 us (expert_wave) or 90 us (interleaved)."""

    built = []

    def __init__(self, shape, P, tokens, config, w1, w2, *, world="loopback", poison_combine=False,
                 weight_cache=None, moe_class=None):
        import torch

        self.config, self.poison_combine, self.P = config, poison_combine, P
        self.last_kernel_us, self.last_trace = None, {}
        self._ys = [torch.ones(4, 8) * (r + 1) for r in range(P)]
        self.built.append(self)

    def forward(self, xs, idx, wts):
        import torch

        self.last_kernel_us = 100.0 if self.config.schedule == "expert_wave" else 90.0
        if self.config.trace:
            t = torch.full((1, 2, 10), -1, dtype=torch.int64)  # len(TRACE_FIELDS)
            t[0, 0] = torch.tensor([(1 << 40) | 1, 10, 20, 3020, 3100, 0, 4500, 3030, 3500, 400])
            t[0, 1] = torch.tensor([(2 << 40) | 2, 3200, 3300, 5300, 5400, 0, 3150, 5310, 6000, 590])
            self.last_trace = {0: t}
        return [y.clone() for y in self._ys]

    def rerun(self):
        return self.forward(None, None, None)


def test_main_on_a_cpu_stand_in(monkeypatch, tmp_path, capsys):
    """The whole bench (bench.main) with the GPU parts replaced: the baselines and timing rows,
    the side-by-side variants (a non-resolving one skipped), the paired rows and their CSV
    columns (as before the redesign), the traces, and the JSON with every variant's resolved
    config."""
    import json

    import torch

    from megamoe_interleave.config import MegaMoEConfig as Cfg
    from lab import paired, timing
    from xstage import provenance

    P = 8
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(provenance, "_torch_gpu", lambda: {})
    monkeypatch.setattr(bench, "dense_bf16_tflops", lambda: 500.0)
    monkeypatch.setattr(bench, "device_sms", lambda: 132)
    monkeypatch.setattr(bench, "make_problem", lambda shape, kind, P, T, strength=1.0: (
        None, None, [torch.zeros(T, 8)] * P, [torch.zeros(T, 6, dtype=torch.int64)] * P, [None] * P))
    monkeypatch.setattr(bench, "grouped_gemms", lambda *a, **k: ((None, None), lambda: None))
    monkeypatch.setattr(bench, "unfused_pipeline", lambda *a: [torch.ones(4, 8) * (r + 1) for r in range(P)])
    monkeypatch.setattr(bench, "build_moe", _FakeMoE)
    monkeypatch.setattr(timing, "bench", lambda fn, warmup, iters, trials: (
        [fn() for _ in range(warmup + iters * trials)], timing.Timing([1000.0, 2000.0, 3000.0]))[1])
    monkeypatch.setattr(xbench, "event_timed", lambda fn: lambda: 110.0)
    monkeypatch.setattr(paired, "sm_clock_mhz", lambda: 1980)
    _FakeMoE.built.clear()
    out = tmp_path / "runs"
    bench.main(["--P", str(P), "--tokens", "8192", "--stages", "3", "4", "--dispatch-copy", "bulk", "--trials", "2",
                "--paired-trials", "5", "--trace", "--tag", "_t", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "skipping fused[expert_wave,s4,dc=bulk]" in printed and "skipping fused[interleaved,s4,dc=bulk]" in printed
    d = json.loads((out / "bench_megamoe_t.json").read_text())
    names = ["fused[expert_wave,s3,dc=bulk]", "fused[interleaved,s3,dc=bulk]"]
    assert [v["name"] for v in d["variants"]] == names
    for v, sched in zip(d["variants"], ("expert_wave", "interleaved")):
        want = Cfg(sched, stages=3, dispatch_copy="bulk").resolve(FLASH, P, 8192, 132)
        assert v["config"] == dataclasses.asdict(want)
        assert v["P"] == P and v["shape"] == "deepseek-v4-flash"
    impls = [r["impl"] for r in d["rows"]]
    assert impls[:2] == ["grouped_mm x2 only", "unfused torch pipeline"]
    assert impls[2:5] == ["fused[expert_wave,128x256,s3,dc=bulk] api", "fused[expert_wave,128x256,s3,dc=bulk] kernels",
                          "fused[expert_wave,128x256,s3,dc=bulk] api,no-poison"]
    assert len(impls) == 2 + 2 * 3
    kernels = [r for r in d["rows"] if r["impl"].endswith("kernels")]
    assert [r["median_us"] for r in kernels] == [100.0, 90.0]  # the fused kernels' own times
    (row,) = d["paired"]
    assert row["baseline"] == "grouped_mm x2" and list(row["variants"]) == names
    assert row["variants"][names[1]]["median_ratio"] == pytest.approx(90 / 110)
    with open(out / "bench_megamoe_t_paired.csv") as f:
        table = list(csv.DictReader(f))
    assert list(table[0])[:7] == ["shape", "routing", "world", "P", "tokens_per_rank", "variant", "baseline"]
    assert [t["variant"] for t in table] == names
    with open(out / "bench_megamoe_t.csv") as f:
        assert next(csv.reader(f))[:6] == ["shape", "routing", "world", "P", "tokens_per_rank", "impl"]
    assert [t["impl"] for t in d["trace_summaries"]] == ["fused[expert_wave,128x256,s3,dc=bulk]",
                                                          "fused[interleaved,128x256,s3,dc=bulk]"]
    assert d["trace_summaries"][0]["l1_tiles"] == 1 and d["trace_summaries"][0]["span_ns"] == 5390
    assert (out / "trace_t_s3_dcbulk_expert_wave_P8_T8192.csv").exists()
    # the paired comparison's objects start poisoned (their first y checked), then time without poison
    timed = [m for m in _FakeMoE.built if not m.config.trace][-2:]
    assert all(m.poison_combine is False for m in timed)


@pytest.mark.parametrize("script", ["bench_megamoe.py", "bench_megamoe_graph.py", "bench_megamoe_w4a8.py",
                                    "diag/megamoe_dispatch_cost.py", "diag/megamoe_energy.py",
                                    "diag/megamoe_ncu_driver.py", "diag/megamoe_pm_phases.py",
                                    "diag/megamoe_trace_clock.py", "diag/megamoe_trace_timeline.py",
                                    "diag/profile_megamoe_api.py", "diag/wgmma_rate.py"])
def test_command_lines_import_the_library(script):
    """The bench's and the diagnostics' command lines start (``--help``) with the repository on
    PYTHONPATH only: no sys.path edits, no script importing another."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root)] + ([os.environ["PYTHONPATH"]]
                                                                       if os.environ.get("PYTHONPATH") else []))}
    r = subprocess.run([sys.executable, str(root / "scripts" / script), "--help"], capture_output=True, text=True,
                       timeout=300, env=env, cwd=root)
    assert r.returncode == 0 and "usage" in r.stdout, r.stderr[-2000:]
    text = (root / "scripts" / script).read_text()
    assert "sys.path" not in text and "import bench_megamoe" not in text


def test_no_dispatch_copy_moe_compiles_its_own_kernel(monkeypatch):
    """lab.megamoe.diag.no_dispatch_copy.NoDispatchCopyMoE: the same resolved config as a MegaMoE, but its
    fused kernel is NoDispatchCopy of that config, under its own compile-cache key (a shipped
    kernel of the same config in the cache is not reused)."""
    from lab.megamoe.diag import no_dispatch_copy as diag
    from megamoe_interleave.api import MegaMoE, make_world
    from xstage import cute_compile

    built = []
    monkeypatch.setattr(cute_compile, "_CACHE", {})
    monkeypatch.setattr(cute_compile, "compile_hopper", lambda kernel, *args, **kw: (
        built.append((kernel, len(args))) or type("C", (), {"fn": f"compiled {type(kernel).__name__}"})()))
    world = make_world("loopback", 2, device="cpu")
    args = (world, 16, 256, 128, 2, 64, MegaMoEConfig("expert_wave", block_n=64, dispatch_copy="bulk"))
    shipped, nocopy = MegaMoE(*args, backend="fused"), diag.NoDispatchCopyMoE(*args, backend="fused")
    assert nocopy.config == shipped.config and nocopy.config.dispatch_window > 0
    cute_compile._CACHE[("MegaMoESm90", 256, 128, shipped.config.kernel_key())] = "shipped"
    assert shipped.launcher.kernel(shipped.config) == "shipped" and nocopy.launcher.kernel(nocopy.config) == "compiled NoDispatchCopy"
    (kernel, nargs), = built
    assert type(kernel) is diag.NoDispatchCopy and kernel.config == nocopy.config.kernel_key() and nargs == 1 + 4 + 1  # MegaMoEArguments, scalars, stream
    assert nocopy.launcher.kernel(nocopy.config) == "compiled NoDispatchCopy" and len(built) == 1  # cached


def _cpu_build(monkeypatch):
    """bench.build_moe on a CPU loopback world (the fused MegaMoE is built and its weights
    loaded; nothing can launch)."""
    from megamoe_interleave import api

    monkeypatch.setattr(bench, "make_world", lambda backend, world_size, device: api.make_world(
        backend, world_size=world_size, device="cpu"))


def _tiny_problem(P=2, T=40, seed=0):
    import torch

    from lab.megamoe.routing import make_routing
    from megamoe_interleave.shapes import MoEShape

    shape = MoEShape("tiny", 256, 128, 16, 4, "test")
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(16, 256, 256, generator=g).bfloat16()
    w2 = torch.randn(16, 256, 128, generator=g).bfloat16()
    xs = [torch.randn(T, 256, generator=g).bfloat16() for _ in range(P)]
    routes = [make_routing("balanced", T, 16, 4, seed=r) for r in range(P)]
    return shape, w1, w2, xs, [r[0] for r in routes], [r[1] for r in routes]


def test_build_moe_resolves_the_config_and_shares_the_weights(monkeypatch):
    """build_moe: a fused MegaMoE of the shape with P ranks of ``tokens`` (its config resolved by
    MegaMoE as the bench resolved the variant), weights loaded once per weight cache (the later
    objects share the kernel-layout tensors), poison as asked."""
    _cpu_build(monkeypatch)
    shape, w1, w2, *_ = _tiny_problem()
    config = MegaMoEConfig("interleaved", block_n=64)
    cache = {}
    a = bench.build_moe(shape, 2, 64, config, w1, w2, poison_combine=True, weight_cache=cache)
    b = bench.build_moe(shape, 2, 64, MegaMoEConfig("expert_wave"), w1, w2, weight_cache=cache)
    assert a.backend == b.backend == "fused" and a.poison_combine and not b.poison_combine
    assert a.config == config.resolve(shape, 2, 64, 132) and a.config.block_n == 64 and b.config.block_n == 128
    assert a.buffer.max_tokens == 64 and a.world.world_size == 2 and a.num_experts == 16 and a.topk == 4
    assert all(b.w1[r] is a.w1[r] and b.w2[r] is a.w2[r] for r in range(2)) and b.w1 is not a.w1
    c = bench.build_moe(shape, 2, 64, None, w1, w2)
    assert c.config == MegaMoEConfig().resolve(shape, 2, 64, 132) and c.w1[1] is not a.w1[1]


def test_fill_pool_gathers_the_dispatched_rows(monkeypatch):
    """diag.fill_pool: each rank's pool row i becomes x[src rank][src token] of its plan (what
    the Dispatch copy writes, so the no-copy kernel computes the shipped kernel's y)."""
    import torch

    from lab.megamoe.diag import no_dispatch_copy as diag

    _cpu_build(monkeypatch)
    shape, w1, w2, xs, idx, wts = _tiny_problem()
    moe = bench.build_moe(shape, 2, 64, MegaMoEConfig("expert_wave", block_n=64), w1, w2,
                          moe_class=diag.NoDispatchCopyMoE)
    moe.stage_inputs(xs, idx, wts)
    for d in range(2):
        moe.launcher.launch_arguments(d)  # sizes the pool scratch, as the first forward does
        moe.launcher.dispatched_rows(d).zero_()
        diag.fill_pool(moe, d)
        perm = moe.planner.plan_rank(d)[0]
        want = torch.stack([xs[s][t] for s, t in zip(perm.src_rank.tolist(), perm.src_token.tolist())])
        assert perm.src_rank.numel() > 0 and torch.equal(moe.launcher.dispatched_rows(d), want)


def test_graph_report_splits_the_replay_into_kernels_and_writes_the_summary(tmp_path):
    """graph_bench --report (no GPU): the replay's kernels split into fused / reduction / the rest,
    the replay over their sum, the ratios against the baselines; cases without a matched trial are
    left out."""
    import csv
    import json

    from lab.megamoe import graph_bench

    def case(P, T, n_matched, replay):
        v = lambda med: {"median_us": med, "baseline_median_us": 1000.0, "median_ratio": med / 1000.0,  # noqa: E731
                         "n_matched": n_matched}
        return {"paired": {"shape": "deepseek-v4-flash", "routing": "balanced", "world": "loopback", "P": P,
                           "tokens_per_rank": T, "variants": {"graph replay": v(replay),
                                                              "grouped_mm x2 only": v(1050.0),
                                                              "unfused torch pipeline": v(2000.0)}},
                "eager_us": {"eager enqueue": 3000.0, "eager forward": 4000.0, "enqueue host": 2500.0},
                "replay_kernels": [["kernel_cutlass_MegaMoESm90_x", 1, 990.0], ["kernel_TopkReduceSm90_y", 1, 20.0],
                                   ["at::native::sort", 8, 40.0]],
                "checks": {"replay_blocking_calls": []}}

    path = tmp_path / "r.json"
    path.write_text(json.dumps({"cases": [case(8, 256, 4, 1100.0), case(1, 256, 0, 1200.0)]}))
    (row,) = graph_bench.report([path], tmp_path)
    assert (row["P"], row["fused_us"], row["reduce_us"], row["plan_and_rest_us"]) == (8, 990.0, 20.0, 40.0)
    assert row["nodes"] == 10 and row["replay_over_kernels_sum"] == pytest.approx(1100.0 / 1050.0, abs=1e-4)
    assert row["replay_over_kernels"] == pytest.approx(1.1) and row["replay_over_grouped_mm"] == pytest.approx(
        1100.0 / 1050.0, abs=1e-4)
    assert row["replay_blocking_calls"] == "none"
    spanned = dict(case(1, 8192, 4, 1100.0), replay_span_us=1071.0)  # the profiled replay's own span wins
    (srow,) = graph_bench.report([_write(tmp_path / "s.json", {"cases": [spanned]})], tmp_path / "s")
    assert srow["replay_over_kernels_sum"] == pytest.approx(1071.0 / 1050.0, abs=1e-4)
    assert srow["replay_over_fused_in_replay"] == pytest.approx(1071.0 / 990.0, abs=1e-4)
    (row,) = graph_bench.report([path], tmp_path)
    with open(tmp_path / "summary.csv") as f:
        assert len(list(csv.DictReader(f))) == 1


def test_graph_report_sets_w8a8_cases_against_the_streaming_floor(tmp_path):
    """graph_bench --report (no GPU): a case with the streaming read gets its floor (weight bytes over
    the read rate of the 4 GiB sum), the replay over it, and stream_floor.png; the FP8 GEMMs are the
    GEMMs-alone baseline of a W8A8 case."""
    from lab.megamoe import graph_bench

    v = lambda med: {"median_us": med, "baseline_median_us": 2000.0, "median_ratio": med / 2000.0,  # noqa: E731
                     "n_matched": 5}
    read_us = graph_bench.STREAM_BYTES / 4.0e6  # 4 TB/s: 4e6 bytes per us
    case = {"paired": {"shape": "deepseek-v4-flash", "routing": "balanced", "world": "loopback", "P": 1,
                       "tokens_per_rank": 256, "precision": "w8a8",
                       "variants": {"graph replay": v(2200.0), "scaled_grouped_mm x2 only": v(2500.0),
                                    "unfused torch pipeline": v(6000.0), "streaming read": v(read_us),
                                    "DeepGEMM fp8 GEMMs x2 only": v(1760.0)}},
            "eager_us": {"eager enqueue": 3000.0, "eager forward": 4000.0, "enqueue host": 2500.0},
            "replay_kernels": [["kernel_cutlass_MegaMoESm90W8A8_x", 1, 1990.0]], "weight_bytes": 6.4e9,
            "checks": {"replay_blocking_calls": []}}
    (row,) = graph_bench.report([_write(tmp_path / "w.json", {"cases": [case]})], tmp_path)
    assert row["precision"] == "w8a8" and row["grouped_mm_us"] == 2500.0
    assert row["stream_read_GBps"] == pytest.approx(4000.0) and row["stream_bound_us"] == pytest.approx(1600.0)
    assert row["replay_over_stream_bound"] == pytest.approx(2200.0 / 1600.0, abs=1e-4)
    assert row["replay_over_deepgemm"] == pytest.approx(1.25) and row["kernels_over_deepgemm"] == pytest.approx(
        2000.0 / 1760.0, abs=1e-4)
    assert (tmp_path / "stream_floor.png").exists() or not _has_matplotlib()
    # a run's CSV of summary rows stands in for its JSON (one that did not come back from the GPU host)
    (again,) = graph_bench.report([tmp_path / "summary.csv"], tmp_path / "from_csv")
    assert again["replay_over_stream_bound"] == row["replay_over_stream_bound"] and again["P"] == 1
    assert again["precision"] == "w8a8" and again["stream_bound_us"] == pytest.approx(1600.0)


def test_diag_config_options_and_tile_budget_refuse_bad_ones_before_a_launch(capsys):
    """--option NAME=VALUE of the diagnostics: integers as int, the rest as strings; tile_budget checks
    them against MegaMoEConfig before it looks for a GPU."""
    from lab.megamoe.diag import config_options
    from lab.megamoe.diag import tile_budget

    assert config_options(["stages=4", "dispatch_copy=lsu"]) == {"stages": 4, "dispatch_copy": "lsu"}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        config_options(["stages"])
    for bad, why in ((["--option", "stages=x4"], "stages must be an int"), (["--option", "bogus=1"], "bogus")):
        with pytest.raises(SystemExit):
            tile_budget.main(["--P", "1", "--out", "unused", *bad])
        assert why in capsys.readouterr().err


def test_ab_trees_alternates_the_trees_and_sets_each_against_the_first(tmp_path, monkeypatch):
    """scripts/diag/megamoe_ab_trees.py on a CPU, with two stand-in trees whose tile_budget script writes a
    fixed result: runs alternate (A B, B A), each in its own tree, and the table holds per P each tree's
    median over the rounds (of the medians of its calls after the first) and its ratio to the first tree."""
    import json
    import textwrap

    from lab.megamoe.diag import ab_trees

    assert ab_trees.run_order(["a", "b"], 3) == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]
    for bad in (["a=" + str(tmp_path)], ["a"], ["a=" + str(tmp_path), "a=" + str(tmp_path)],
                ["a=" + str(tmp_path), "b=" + str(tmp_path / "missing")]):
        with pytest.raises(ValueError):
            ab_trees.parse_trees(bad)
    log = tmp_path / "order.log"
    for name, us in (("base", 100.0), ("new", 90.0)):
        tree = tmp_path / name
        (tree / "scripts" / "diag").mkdir(parents=True)
        (tree / ".xstage_commit").write_text(f"commit-{name}\n")
        (tree / "scripts" / "diag" / "megamoe_tile_budget.py").write_text(textwrap.dedent(f"""
            import json, os, sys
            out = sys.argv[sys.argv.index("--out") + 1]
            os.makedirs(out, exist_ok=True)
            open({str(log)!r}, "a").write({name!r} + " " + os.getcwd() + " " + str("--pair-split" in sys.argv) + " "
                                          + str("--routing" in sys.argv and "skewed2" in sys.argv) + "\\n")
            ps = sys.argv[sys.argv.index("--P") + 1:]
            runs = {{"P" + p: {{"kernel_us": [999.0, {us} * int(p), {us} * int(p) + 2, {us} * int(p) - 2],
                              "L1": {{"mainloop_cycles_p50": 5}}, "L2": {{}}}} for p in ps}}
            json.dump({{"runs": runs}}, open(os.path.join(out, "tile_budget.json"), "w"))
        """))
    with pytest.raises(ValueError):
        ab_trees.parse_flags(["other=--pair-split n"], ["base", "new"])
    ab_trees.main(["--tree", f"base={tmp_path / 'base'}", "--tree", f"new={tmp_path / 'new'}", "--P", "1", "8",
                   "--rounds", "2", "--flags", "new=--pair-split n", "--out", str(tmp_path / "out")])
    order = [line.split() for line in log.read_text().splitlines()]
    assert [n for n, _, _, _ in order] == ["base", "new", "new", "base"]
    assert all(cwd == str(tmp_path / n) and flag == str(n == "new") and skew == "False" for n, cwd, flag, skew in order)
    res = json.loads((tmp_path / "out" / "ab_trees.json").read_text())
    assert res["trees"]["new"]["commit"] == "commit-new" and not res["failed"]
    rows = {(r["P"], r["tree"]): r for r in res["rows"]}
    log.write_text("")  # --routing reaches every tree's run (a balanced run passes none: older trees lack it)
    ab_trees.main(["--tree", f"base={tmp_path / 'base'}", "--tree", f"new={tmp_path / 'new'}", "--P", "1",
                   "--rounds", "1", "--routing", "skewed2", "--out", str(tmp_path / "out2")])
    assert [line.split()[3] for line in log.read_text().splitlines()] == ["True", "True"]
    assert rows[(8, "base")]["kernel_us"] == 800.0 and rows[(8, "new")]["over_first"] == pytest.approx(0.9)
    assert rows[(1, "new")]["kernel_us_per_round"] == [90.0, 90.0] and rows[(1, "new")]["l1_mainloop_p50"] == 5
    # --compile-only: every tree's builds once, into the kernel cache, which it needs
    log.write_text("")
    trees = ["--tree", f"base={tmp_path / 'base'}", "--tree", f"new={tmp_path / 'new'}", "--P", "1", "--out",
             str(tmp_path / "out3"), "--compile-only"]
    monkeypatch.delenv("XSTAGE_KERNEL_CACHE", raising=False)
    with pytest.raises(SystemExit):
        ab_trees.main(trees)
    monkeypatch.setenv("XSTAGE_KERNEL_CACHE", str(tmp_path / "kc"))
    ab_trees.main(trees)
    assert [line.split()[0] for line in log.read_text().splitlines()] == ["base", "new"]
    assert not (tmp_path / "out3" / "ab_trees.json").exists()
    # a failed run is left out of its tree's rounds
    run = lambda us: {"runs": {"P1": {"kernel_us": [9, us, us]}}}  # noqa: E731
    a, b = ab_trees.summarize(["a", "b"], {(0, "a"): run(10), (0, "b"): run(5), (1, "a"): run(12)})
    assert (a["kernel_us"], b["kernel_us_per_round"]) == (11.0, [5.0]) and b["over_first"] == pytest.approx(5 / 11, abs=1e-4)


def _has_matplotlib():
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def _write(path, obj):
    import json

    path.write_text(json.dumps(obj))
    return path


def test_w8a8_bench_summary_and_rowwise_quantize():
    """The W8A8 bench's summary rows (medians, ratios to the fused W8A8 kernel, its TFLOP/s and
    share of the dense FP8 rate) from a paired result, and its rowwise E4M3 quantization."""
    import torch

    from lab.megamoe import w8a8_bench

    x = torch.randn(8, 256)
    q, s = w8a8_bench.rowwise_quantize(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (8,)
    assert (q.float() * s[:, None] - x).abs().max() <= x.abs().max() * 2 ** -4
    assert q.float().abs().amax(1).eq(448.0).all()

    def v(med):
        return {"median_us": med, "baseline_median_us": 1000.0, "median_ratio": med / 1000.0, "n_matched": 6}

    def row(protocol):
        return {"shape": "deepseek-v4-flash", "routing": "balanced", "world": "loopback", "P": 1,
                "tokens_per_rank": 8192, "protocol": protocol,
                "variants": {"fused bf16": v(1330.0), "scaled_grouped_mm x2 only": v(1050.0)}}

    (sus, cool) = w8a8_bench.summary_rows([{"sustained": row("sustained"), "cooled": row("cooled")}], 1400.0)
    assert (sus["protocol"], cool["protocol"]) == ("sustained", "cooled")
    assert sus["fused_bf16_over_w8a8"] == pytest.approx(1.33) and sus["scaled_grouped_mm_x2_us"] == 1050.0
    flops = 2.0 * 8192 * 6 * 3 * 4096 * 2048
    assert sus["fused_w8a8_tflops"] == pytest.approx(flops / 1000.0 / 1e6, abs=0.1)
    assert sus["fused_w8a8_of_dense"] == pytest.approx(flops / 1000.0 / 1e6 / 1400.0, abs=1e-3)


def test_w4a8_bench_summary_and_report(tmp_path):
    """The W4A8 bench's summary rows (each variant over the fused W4A8 kernel, the weight bytes' ratio)
    and its report (summary.csv, w4a8.png) from a result file, without a GPU."""
    import json

    from lab.megamoe import deepgemm, w4a8_bench

    def v(med):
        return {"median_us": med, "baseline_median_us": 1000.0, "median_ratio": med / 1000.0, "n_matched": 6}

    case = {"checks": {}, "weight_bytes": {"w4a8": 3.3e9, "w8a8": 6.5e9, "bf16": 13e9},
            "paired": {"shape": "deepseek-v4-flash", "routing": "balanced", "world": "loopback", "P": 1,
                       "tokens_per_rank": 1024, "variants": {"fused w8a8": v(1450.0), "fused bf16": v(2600.0),
                                                            w4a8_bench.UNFUSED: v(4100.0),
                                                            deepgemm.VARIANT: v(1300.0)}}}
    (row,) = w4a8_bench.summary_rows([case])
    assert row["fused_w4a8_us"] == 1000.0 and row["fused_w8a8_over_w4a8"] == pytest.approx(1.45)
    assert row["DeepGEMM_fp8_GEMMs_x2_only_over_w4a8"] == pytest.approx(1.3)
    assert row["unfused_bf16_pipeline_fp4_dequantized_over_w4a8"] == pytest.approx(4.1)
    assert row["w4a8_weight_bytes_over_w8a8"] == pytest.approx(3.3 / 6.5, abs=1e-4)
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"cases": [case]}))
    assert w4a8_bench.report([str(path)], str(tmp_path / "out")) == [row]
    assert (tmp_path / "out" / "summary.csv").exists() and (tmp_path / "out" / "w4a8.png").exists()


def test_timeout_contention_args_and_outcomes(tmp_path):
    """lab.megamoe.diag.timeout_contention: bad counts refused before any GPU work, an --out that is a
    file refused, and the outcome classes (the kernel's DeviceError, a dead context, anything else)."""
    from lab.megamoe.diag import timeout_contention as tc
    from xstage.device import DeviceError

    a = tc.parse_args(["--out", str(tmp_path)])
    assert (a.busy, a.calls, a.P) == (9, 50, 1)
    for bad in (["--busy", "-1"], ["--calls", "0"], ["--seconds", "0"]):
        with pytest.raises(SystemExit):
            tc.parse_args(bad + ["--out", str(tmp_path)])
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(SystemExit, match="is a file"):
        tc.main(["--out", str(f)])
    assert tc.classify(DeviceError("ring timeout")) == "device_error"
    assert tc.classify(RuntimeError("CUDA error: unspecified launch failure")) == "launch_failure"
    assert tc.classify(ValueError("bad shape")) == "other"


def test_ab_trees_bits_compare_each_tree_s_outputs_with_the_first_s(tmp_path, monkeypatch):
    """--bits: each tree's output hash (output_hash.py, run in the tree's directory and environment; here a stand-in
    that hashes the tree's marker file) is set against the first tree's; a failed hash is reported, not equal."""
    import json
    import textwrap

    from lab.megamoe.diag import ab_trees

    stand_in = tmp_path / "output_hash.py"
    stand_in.write_text(textwrap.dedent("""
        import hashlib, json, os, sys
        marker = open("marker").read()
        if marker == "broken":
            sys.exit("no kernel")
        print("compiling...")
        print(json.dumps({"sha256": hashlib.sha256(marker.encode()).hexdigest(), "argv": sys.argv[1:]}))
    """))
    monkeypatch.setattr(ab_trees, "OUTPUT_HASH", str(stand_in))
    for name, marker in (("base", "x"), ("same", "x"), ("other", "y"), ("bad", "broken")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "marker").write_text(marker)
    names = ["base", "same", "other", "bad"]
    bits = {n: ab_trees.tree_bits(str(tmp_path / n), "w8a8", 60) for n in names}
    assert bits["base"]["argv"] == ["--precision", "w8a8"] and "no kernel" in bits["bad"]["error"]
    assert ab_trees.bits_verdicts(names, bits) == {"base": True, "same": True, "other": False, "bad": None}
    assert ab_trees.tree_bits(str(tmp_path / "base"), "w4a8", 60, compile_only=True)["argv"] == [
        "--precision", "w4a8", "--compile-only"]
    assert json.loads(json.dumps(bits))  # what ab_trees.json records


def test_output_hash_runs_its_problem_through_the_public_api_and_is_deterministic():
    """lab/megamoe/diag/output_hash.py on a CPU (the torch backend): its problem goes through MegaMoE's public API as
    the fused run will, and two runs give one hash (the seeded inputs), another seed another."""
    from lab.megamoe.diag import output_hash as oh

    a = oh.output_hash("bf16", device="cpu", backend="torch")
    assert a["finite"] and len(a["sha256"]) == 64 and a["precision"] == "bf16"
    assert oh.output_hash("bf16", device="cpu", backend="torch")["sha256"] == a["sha256"]
    assert oh.output_hash("bf16", device="cpu", backend="torch", seed=1)["sha256"] != a["sha256"]
