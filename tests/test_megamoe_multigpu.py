"""CPU tests of the megamoe parts of the multi-GPU suite: lab.megamoe.multigpu_ep (step 3)
and lab.megamoe.multigpu_checks (the megamoe half of step 4), imported as library modules
(their command lines, scripts/multigpu/megamoe_ep.py and correctness.py, only run as
subprocesses: tests/test_multigpu_suite.py)."""
import argparse
import json
import math

import pytest
from test_multigpu_suite import _moe_row, use_cpu_loopback

from lab.megamoe import multigpu_checks as checks
from lab.megamoe import multigpu_ep as megamoe_ep
from lab import multigpu as mg
from lab import multigpu_report


@pytest.fixture
def cpu_loopback(monkeypatch):
    use_cpu_loopback(monkeypatch)


def test_correctness_moe_cases():
    for P in (1, 2, 4, 8):
        for name, tokens, k, kind, mask, cfg in checks.moe_cases(P):
            assert len(tokens) == P and k <= checks.MOE_E and max(tokens) <= cfg["max_tokens"]
    with pytest.raises(mg.WorldArgsError, match="P=3"):
        checks.moe_cases(3)


def test_megamoe_summary_speedups_geomean_regressions():
    rows = [_moe_row("a", "balanced", 1024, "expert_wave", 120.0, 200.0),
            _moe_row("a", "balanced", 1024, "interleaved", 100.0, 180.0),
            _moe_row("a", "skewed", 1024, "expert_wave", 90.0, 150.0),
            _moe_row("a", "skewed", 1024, "interleaved", 100.0, 150.0),
            _moe_row("b", "skewed", 8, "expert_wave", 1.0, 1.0)]  # incomplete pair: ignored
    s = megamoe_ep.summarize(rows)
    assert len(s["configs"]) == 2
    assert s["geomean_speedup"] == pytest.approx(math.sqrt(1.2 * 0.9))
    assert [c["routing"] for c in s["regressions"]] == ["skewed"]
    assert s["max_speedup"] == pytest.approx(1.2) and s["min_speedup"] == pytest.approx(0.9)
    assert megamoe_ep.summarize([]) == {"configs": []}
    # --grouped-gemms rows: each schedule's kernel time over the GEMMs' alone; not a schedule
    s = megamoe_ep.summarize(rows + [_moe_row("a", "balanced", 1024, megamoe_ep.GROUPED, 125.0, 0.0)])
    bal = next(c for c in s["configs"] if c["routing"] == "balanced")
    assert bal["expert_wave_vs_grouped"] == pytest.approx(0.96) and bal["interleaved_vs_grouped"] == pytest.approx(0.8)
    assert "grouped_us" not in next(c for c in s["configs"] if c["routing"] == "skewed")
    assert s["geomean_speedup"] == pytest.approx(math.sqrt(1.2 * 0.9))
    assert megamoe_ep.parse_args(["--world", "loopback", "--P", "2", "--grouped-gemms"]).grouped_gemms


def test_megamoe_args_and_shapes():
    a = megamoe_ep.parse_args(["--world", "loopback", "--P", "2", "--quick"])
    assert a.tokens == list(megamoe_ep.QUICK_TOKENS) and a.trials == 3
    assert [s.name for s in megamoe_ep.resolve_shapes(["deepseek-v4-flash"], 8)] == ["deepseek-v4-flash"]
    assert len(megamoe_ep.resolve_shapes(["all"], 8)) >= 5
    with pytest.raises(mg.WorldArgsError, match="unknown shape"):
        megamoe_ep.resolve_shapes(["nope"], 8)
    with pytest.raises(mg.WorldArgsError, match="unknown dimensions"):
        megamoe_ep.resolve_shapes(["dit-moe"], 8)
    with pytest.raises(mg.WorldArgsError, match="not divisible by P=3"):
        megamoe_ep.resolve_shapes(["deepseek-v4-flash"], 3)


def test_correctness_api_defaults_case_takes_the_default_path():
    """The api-defaults megamoe case (P = 2, the smallest multi-GPU world, and up) resolves, as
    MegaMoE resolves it, to the path loopback P = 8 runs at DeepSeek-V4-Flash: 128 x 256 tiles,
    3 stages, the bulk Dispatch, for expert_wave its window and the L2 column order (the run
    records the resolved config); the small cases take 128 x 64 tiles and the copy asked for."""
    from megamoe_interleave.config import MegaMoEConfig
    from megamoe_interleave.shapes import MoEShape, get_shape

    flash = {s: MegaMoEConfig(s).resolve(get_shape("deepseek-v4-flash"), 8, 8192, 132)
             for s in ("expert_wave", "interleaved")}
    for P in (2, 4, 8):
        (case,) = [c for c in checks.moe_cases(P) if c[5].get("api_defaults")]
        _, tokens, k, _, _, cfg = case
        shape = MoEShape("api-defaults", cfg["H"], cfg["I"], checks.MOE_E, k, "test")
        for sched in ("expert_wave", "interleaved"):
            config = checks.case_config(sched, checks.DEFAULTS, cfg)
            assert config == MegaMoEConfig(sched)  # nothing given
            got = config.resolve(shape, P, cfg["max_tokens"], 132)
            ref = flash[sched]
            assert (got.block_n, got.stages, got.dispatch_copy) == (ref.block_n, ref.stages, ref.dispatch_copy) \
                == (256, 3, "bulk"), (P, sched)
            assert (got.dispatch_window > 0) == (ref.dispatch_window > 0) == (sched == "expert_wave")
            assert got.l2_columns == ref.l2_columns == (True if sched == "expert_wave" else None)
    small = dict(H=checks.MOE_H, I=checks.MOE_I, max_tokens=256)
    for copy in ("lsu", "bulk"):
        il = checks.case_config("interleaved", copy, small)
        ew = checks.case_config("expert_wave", copy, small)
        assert (il.block_n, il.lead, il.dispatch_copy) == (64, 2, copy)
        assert (ew.block_n, ew.experts_per_wave, ew.dispatch_copy) == (64, 2, copy)
    assert len(checks.moe_cases(2, quick=True)) == 2  # the quick run keeps the two small cases


def test_correctness_dispatch_copies():
    assert checks.dispatch_copies(["lsu"]) == ("lsu",)
    assert checks.dispatch_copies(None, quick=True) == ("bulk",)
    assert checks.dispatch_copies() == ("lsu", "bulk")
    p = argparse.ArgumentParser()
    checks.add_args(p)
    assert p.parse_args([]).dispatch_copy is None
    assert p.parse_args(["--dispatch-copy", "lsu"]).dispatch_copy == ["lsu"]
    with pytest.raises(SystemExit):
        p.parse_args(["--dispatch-copy", "tma"])


def test_megamoe_main_on_cpu_stand_in(cpu_loopback, monkeypatch, tmp_path):
    """Step 3's driver (multigpu_ep.main) with MegaMoE.forward replaced: every (routing, schedule)
    timed, the summary's speedups, and each row's resolved config (``--block-n`` for both
    schedules, ``--lead`` for interleaved only)."""
    import torch

    from megamoe_interleave import api
    from megamoe_interleave.shapes import MoEShape

    tiny = MoEShape("tiny", 256, 128, 16, 2, "test")
    monkeypatch.setattr(megamoe_ep, "resolve_shapes", lambda names, P: [tiny])
    seen = []

    def fake_forward(self, x, idx, w):
        seen.append((self.config.schedule, len(x), int(x[0].shape[0])))
        self.last_kernel_us = 100.0 if self.config.schedule == "expert_wave" else 80.0
        return [torch.zeros_like(t) for t in x]

    monkeypatch.setattr(api.MegaMoE, "forward", fake_forward)
    out = tmp_path / "moe"
    rc = megamoe_ep.main(["--world", "loopback", "--P", "2", "--tokens", "64", "--routing", "balanced", "skewed",
                          "--trials", "3", "--block-n", "64", "--lead", "3", "--out", str(out)])
    assert rc == 0
    d = json.loads((out / "ep.json").read_text())
    assert len(d["rows"]) == 4 and {r["schedule"] for r in d["rows"]} == {"expert_wave", "interleaved"}
    assert all(s == (sched, 2, 64) for s, sched in zip(seen, [s[0] for s in seen]))
    assert len(seen) == 4 * (1 + 3)  # warm-up + trials per (routing, schedule)
    for r in d["rows"]:
        assert r["block"] == "128x64" and r["config"]["block_n"] == 64 and r["config"]["schedule"] == r["schedule"]
        assert r["lead"] == r["config"]["lead"] == (3 if r["schedule"] == "interleaved" else None)
        assert r["config"]["stages"] == r["stages"] == 4 and r["dispatch_copy"] == r["config"]["dispatch_copy"]
    s = d["summary"]
    assert s["geomean_speedup"] == pytest.approx(1.25) and s["regressions"] == []
    header = (out / "ep.csv").read_text().splitlines()[0].split(",")
    assert "block" in header and "config" not in header  # dict fields stay in the JSON
    assert "1.250x" in multigpu_report.report_megamoe(d)


def test_megamoe_grouped_gemms_on_cpu_stand_in(cpu_loopback, monkeypatch, tmp_path):
    """--grouped-gemms: the two grouped GEMMs of every rank's received rows (lab.megamoe.bench.
    grouped_gemms on the global weights, run for real on the CPU), one timed call per aligned
    trial (lab.bench.event_timed, faked: 125 us), a row per case; the summary's kernel times
    over theirs."""
    import torch

    from megamoe_interleave import api
    from megamoe_interleave.shapes import MoEShape
    from lab import bench as xbench

    tiny = MoEShape("tiny", 256, 128, 16, 2, "test")
    monkeypatch.setattr(megamoe_ep, "resolve_shapes", lambda names, P: [tiny])

    def fake_forward(self, x, idx, w):
        self.last_kernel_us = 100.0 if self.config.schedule == "expert_wave" else 80.0
        return [torch.zeros_like(t) for t in x]

    gemm_calls = []

    def event_timed(fn):
        fn()  # the warm-up runs the real GEMMs
        return lambda: (fn(), gemm_calls.append(1), 125.0)[-1]

    monkeypatch.setattr(api.MegaMoE, "forward", fake_forward)
    monkeypatch.setattr(xbench, "event_timed", event_timed)
    out = tmp_path / "moe"
    rc = megamoe_ep.main(["--world", "loopback", "--P", "2", "--tokens", "64", "--routing", "balanced",
                          "--trials", "3", "--grouped-gemms", "--out", str(out)])
    assert rc == 0 and len(gemm_calls) == 3
    d = json.loads((out / "ep.json").read_text())
    (gg,) = [r for r in d["rows"] if r["schedule"] == megamoe_ep.GROUPED]
    assert gg["kernel_median_us"] == 125.0 and gg["kernel_timing"]["trials"] == 3
    (cfg,) = d["summary"]["configs"]
    assert cfg["expert_wave_vs_grouped"] == pytest.approx(0.8) and cfg["interleaved_vs_grouped"] == pytest.approx(0.64)


def _reference_forward(monkeypatch, wrong=None):
    """MegaMoE.load_weights keeps the global weights and forward returns, in bf16, the float32
    reference (BF16) or the recipe's emulation (W8A8, W4A8: multigpu_checks.references);
    ``wrong(config)`` -> True: that object's rank-0 output is off by one somewhere."""
    import torch

    from megamoe_interleave import api

    load = api.MegaMoE.load_weights

    def load_and_keep(self, w1, w2):
        self._global = (w1, w2)
        return load(self, w1, w2)

    def forward(self, x, idx, w):
        fp32, emulated = checks.references(self.config.precision, x, idx, w, *self._global)
        ys = [y.to(torch.bfloat16) for y in (fp32 if emulated is None else emulated)]
        if wrong is not None and wrong(self.config) and ys[0].numel():
            ys[0].view(-1)[-1] += 1.0
        return ys

    monkeypatch.setattr(api.MegaMoE, "load_weights", load_and_keep)
    monkeypatch.setattr(api.MegaMoE, "forward", forward)


def _megamoe_step(tmp_path, quick, copies=None, precisions=("bf16",)):
    args = argparse.Namespace(world="loopback", P=2, out=str(tmp_path), stem="correctness-megamoe", quick=quick,
                              trials=1)
    rc = mg.run_entry(args, lambda ctx: mg.run_checks(ctx, args, {
        "megamoe": lambda ctx: checks.run_checks(ctx, quick, copies, precisions)}))
    return rc, json.loads((tmp_path / "correctness-megamoe.json").read_text())


def test_megamoe_checks_on_cpu_stand_in(cpu_loopback, monkeypatch, tmp_path):
    """The megamoe checks through step 4's frame (real MegaMoE objects, each case's config
    resolved by the constructor; forward a float32 stand-in): every case, both Dispatch copies
    and the api-defaults case (made small here) pass, the schedules bitwise equal, every record
    carries the resolved config; the report counts them."""
    monkeypatch.setattr(checks, "MOE_DEFAULTS", (1024, 512, 64, 6))  # the api-defaults case, small
    _reference_forward(monkeypatch)
    rc, d = _megamoe_step(tmp_path, quick=False)
    s = d["summary"]
    assert rc == 0 and s["all_ok"] and s["megamoe"]["failed"] == []
    assert s["megamoe"]["passed"] == s["megamoe"]["checks"] == 4 * 2 * 2 * 2 + 1 * 2 * 2
    res = d["results"]
    assert {r["variant"] for r in res} == {f"{sched},{v}" for sched in ("expert_wave", "interleaved")
                                           for v in ("lsu", "bulk", checks.DEFAULTS)}
    for r in res:
        sched, variant = r["variant"].split(",")
        assert r["config"]["schedule"] == sched and r["config"]["stages"] is not None
        if variant == checks.DEFAULTS:
            assert r["case"].startswith("api-defaults") and r["config"]["block_n"] == 256
        else:
            assert r["config"]["dispatch_copy"] == variant and r["config"]["block_n"] == 64
    assert all(r["bitwise_equal_to_expert_wave"] for r in res if r["variant"].startswith("interleaved"))
    assert "| megamoe | 36 | 36 | 0 |" in multigpu_report.report_correctness(d)
    lines = (tmp_path / "ranks" / "correctness-megamoe-rank0.jsonl").read_text().splitlines()
    assert len(lines) == len(res)


def test_megamoe_checks_fail_on_a_wrong_output(cpu_loopback, monkeypatch, tmp_path):
    """An interleaved output off by one element fails that check (not bitwise equal to
    expert_wave, outside the tolerance) and the step exits 1; expert_wave's checks still pass."""
    _reference_forward(monkeypatch, wrong=lambda config: config.schedule == "interleaved")
    rc, d = _megamoe_step(tmp_path, quick=True)
    assert rc == 1
    failed = d["summary"]["megamoe"]["failed"]
    assert failed and all(f["variant"] == "interleaved,bulk" and f["rank"] == 0 for f in failed)
    assert len(failed) == 2 and d["summary"]["megamoe"]["passed"] == 2 * 2 * 2 - 2  # 2 quick cases, bulk only


def test_megamoe_checks_fp8_precisions_on_cpu_stand_in(cpu_loopback, monkeypatch, tmp_path):
    """--precision w8a8 w4a8: the small cases at FP8_SMALL with 128 x 256 tiles and the resolved Dispatch copy,
    each output held against the recipe's emulation (relative error) and float32 (the recipe's
    bound); a stand-in returning the emulation passes, one returning the float32 reference of the
    BF16 weights fails W4A8's emulation check (its FP4 error is above the 1 % kernel tolerance)."""
    from megamoe_interleave.reference import W8A8_KERNEL_REL_ERROR

    _reference_forward(monkeypatch)
    rc, d = _megamoe_step(tmp_path / "a", quick=True, precisions=("w8a8", "w4a8"))
    assert rc == 0 and d["summary"]["megamoe"]["passed"] == 2 * 2 * 2 * 2  # cases x precisions x schedules x ranks
    for r in d["results"]:
        assert r["variant"].endswith("," + checks.RESOLVED) and r["dims"] == list(checks.FP8_SMALL)
        assert r["config"]["precision"] == r["precision"] and r["config"]["block_n"] == 256
        assert r["rel_err_emulation"] == 0.0 and r["tol_emulation"] == W8A8_KERNEL_REL_ERROR
        assert 0.0 < r["rel_err_fp32"] <= r["tol_fp32"]
    assert {r["precision"] for r in d["results"]} == {"w8a8", "w4a8"}

    import torch
    from megamoe_interleave import api
    from megamoe_interleave.reference import reference_moe_fp32

    monkeypatch.setattr(api.MegaMoE, "forward", lambda self, x, idx, w: [
        y.to(torch.bfloat16) for y in reference_moe_fp32(x, idx, w, *self._global)])
    rc, d = _megamoe_step(tmp_path / "b", quick=True, precisions=("w4a8",))
    assert rc == 1
    assert all(r["rel_err_emulation"] > W8A8_KERNEL_REL_ERROR for r in d["results"] if r["tokens"][r["rank"]])
    assert checks.dispatch_copies(None, False, "w8a8") == (checks.RESOLVED,)
    assert checks.dispatch_copies(["lsu"], False, "w8a8") == ("lsu",)


def test_megamoe_ep_precisions_on_cpu_stand_in(cpu_loopback, monkeypatch, tmp_path):
    """--precision bf16 w8a8: both schedules per precision, a row each with its precision; the summary's
    geometric mean per precision and the report's precision column."""
    import torch

    from megamoe_interleave import api
    from megamoe_interleave.shapes import MoEShape

    monkeypatch.setattr(megamoe_ep, "resolve_shapes", lambda names, P: [MoEShape("tiny", 512, 256, 16, 2, "test")])

    def fake_forward(self, x, idx, w):
        fast = {"bf16": 80.0, "w8a8": 50.0}[self.config.precision]
        self.last_kernel_us = 100.0 if self.config.schedule == "expert_wave" else fast
        return [torch.zeros_like(t) for t in x]

    monkeypatch.setattr(api.MegaMoE, "forward", fake_forward)
    out = tmp_path / "moe"
    assert megamoe_ep.main(["--world", "loopback", "--P", "2", "--tokens", "64", "--routing", "balanced",
                            "--trials", "2", "--precision", "bf16", "w8a8", "--out", str(out)]) == 0
    d = json.loads((out / "ep.json").read_text())
    assert sorted((r["precision"], r["schedule"]) for r in d["rows"]) == [
        ("bf16", "expert_wave"), ("bf16", "interleaved"), ("w8a8", "expert_wave"), ("w8a8", "interleaved")]
    assert all(r["config"]["precision"] == r["precision"] for r in d["rows"])
    s = d["summary"]
    assert s["geomean_by_precision"] == pytest.approx({"bf16": 1.25, "w8a8": 2.0})
    assert s["geomean_speedup"] == pytest.approx((1.25 * 2.0) ** 0.5)
    text = multigpu_report.report_megamoe(d)
    assert "| tiny | w8a8 | balanced | 64 |" in text and "geometric mean, w8a8" in text


def test_reports_read_gzipped_results(cpu_loopback, monkeypatch, tmp_path):
    """write_reports reads a step's result file gzipped (results/ keeps its larger JSONs as .json.gz)."""
    import gzip
    import shutil

    test_megamoe_ep_precisions_on_cpu_stand_in(cpu_loopback, monkeypatch, tmp_path)
    ep = tmp_path / "moe" / "ep.json"
    (tmp_path / "run" / "megamoe").mkdir(parents=True)
    with open(ep, "rb") as src, gzip.open(tmp_path / "run" / "megamoe" / "ep.json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    multigpu_report.write_reports(tmp_path / "run", steps=["megamoe"])
    assert "geometric mean, w8a8 | 2.000x" in (tmp_path / "run" / "report-megamoe.md").read_text()
