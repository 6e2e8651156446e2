"""CPU tests of the MegaMoE X-Stage sweep (lab.megamoe.sweep) and its evaluation
(lab.megamoe.evaluation): the cell grid and its memory-based skips, resumability, the
per-tile statistics, the per-cell comparison, the model's predictions, the GPU runner on a CPU
stand-in, the evaluation's tables and README, the command lines."""
import csv
import dataclasses
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lab.megamoe import bench, evaluation
from lab.megamoe import sweep as S
from megamoe_interleave.config import TRACE_FIELDS, MegaMoEConfig
from megamoe_interleave.shapes import get_shape
from lab import paired
from xstage import model, planner, profiles

ROOT = Path(__file__).resolve().parents[1]
FLASH = get_shape("deepseek-v4-flash")
PRO = get_shape("deepseek-v4-pro")


# ----------------------------------------------------------------------------- the grid, memory, time


def test_the_default_grid_is_every_known_shape_times_every_axis():
    cells = S.cell_grid()
    known = [n for n in S.SHAPES if S.SHAPES[n].known]
    assert len(known) == 6 and "dit-moe" not in known
    assert len(cells) == len(known) * 3 * 3 * 2 * 2 * 1 == 216
    assert len({c.key() for c in cells}) == 216
    assert [c.shape for c in cells[:36]] == [known[0]] * 36  # shape-major: one shape's weights per run
    assert {c.routing for c in cells} == {"balanced", "skewed1", "skewed2"}
    assert {(c.kind, c.strength) for c in cells} == {("balanced", None), ("skewed", 1.0), ("skewed", 2.0)}
    assert {c.world for c in cells} == {"loopback", "loopback+host"} and {c.P for c in cells} == {1, 8}
    assert {c.tokens for c in cells} == {2048, 4096, 8192} and {c.precision for c in cells} == {"bf16"}
    c = cells[0]
    assert S.Cell.from_dict(json.loads(json.dumps(c.as_dict()))) == c


def test_the_grid_rejects_unknown_values():
    with pytest.raises(ValueError, match="unknown dimensions"):
        S.cell_grid(shapes=["dit-moe"])
    with pytest.raises(KeyError):
        S.cell_grid(shapes=["no-such-model"])
    with pytest.raises(ValueError, match="routing"):
        S.cell_grid(routings=["zipf"])
    with pytest.raises(ValueError, match="precision"):
        S.cell_grid(precisions=["fp4"])
    assert {c.precision for c in S.cell_grid(shapes=["deepseek-v4-flash"], precisions=["w8a8"])} == {"w8a8"}
    with pytest.raises(ValueError, match="repeats"):
        S.cell_grid(tokens=[2048, 2048])
    with pytest.raises(ValueError, match="world"):
        S.Cell("deepseek-v4-flash", "balanced", 2048, "host", 8)


def test_memory_estimate_counts_weights_copies_and_buffers():
    E, H, I, k, P, T = 256, 4096, 2048, 6, 8, 8192
    m = S.memory_estimate(FLASH, P, T, "loopback")
    assert m["weights_bytes"] == 3 * E * H * I * 2 and m["kernel_w1_bytes"] == 2 * E * I * H * 2
    combine = P * k * T * H * 2
    scratch = (P * T * k + P * 128) * (H + I) * 2
    inputs = P * T * (2 * H + 12 * k)
    assert m["per_moe_bytes"] == inputs + combine + scratch + P * T * H * 2
    assert m["moe_phase_bytes"] == m["weights_bytes"] + inputs + m["kernel_w1_bytes"] + P * T * H * 2 \
        + 2 * m["per_moe_bytes"]
    assert m["gpu_bytes"] == max(m["moe_phase_bytes"], m["reference_phase_bytes"]) + S.ALLOWANCE
    assert m["host_pinned_bytes"] == 0
    h = S.memory_estimate(FLASH, P, T, "loopback+host")  # the Combine slots move to pinned host memory
    assert h["per_moe_bytes"] == m["per_moe_bytes"] - combine and h["host_pinned_bytes"] == 2 * combine


def test_cells_over_the_memory_budget_are_skipped_with_the_reason():
    big = S.Cell("deepseek-v4-pro", "skewed2", 8192, "loopback", 8)
    m = S.memory_estimate(PRO, 8, 8192, "loopback")
    assert S.skip_reason(big, gpu_budget=m["gpu_bytes"]) is None
    reason = S.skip_reason(big, gpu_budget=m["gpu_bytes"] - 1)
    assert reason.startswith("estimated GPU memory") and "budget" in reason
    assert S.skip_reason(S.Cell("deepseek-v4-flash", "balanced", 2048, "loopback", 1), gpu_budget=60e9) is None
    grid = S.cell_grid()
    skipped = [c for c in grid if S.skip_reason(c, gpu_budget=60e9)]
    assert big in skipped and S.Cell("deepseek-v4-flash", "balanced", 8192, "loopback", 8) not in skipped
    assert skipped == [c for c in grid if S.memory_estimate(
        get_shape(c.shape), c.P, c.tokens, c.world)["gpu_bytes"] > 60e9]
    assert not [c for c in grid if S.skip_reason(c)]  # the default budget fits every cell (Pro at 8192: 119.6 GB)
    host = S.Cell("deepseek-v4-pro", "balanced", 8192, "loopback+host", 8)
    assert "pinned host" in S.skip_reason(host, host_budget=1e9)
    odd = S.Cell("deepseek-v4-flash", "balanced", 2048, "loopback", 3)
    assert "not divisible by P=3" in S.skip_reason(odd)


def test_time_estimate_scales_with_the_trials_the_flops_and_the_pcie_volume():
    ref = S.Cell("deepseek-v4-flash", "balanced", 8192, "loopback", 8)
    assert S.call_seconds(ref) == pytest.approx(29.0e-3)
    assert S.call_seconds(dataclasses.replace(ref, P=1)) == pytest.approx(4.77e-3)
    assert S.call_seconds(dataclasses.replace(ref, tokens=4096)) == pytest.approx(14.5e-3)
    host = dataclasses.replace(ref, world="loopback+host")
    R = profiles.load("h200-pcie-host").R
    assert S.call_seconds(host) == pytest.approx(8 * 8192 * 6 * 4096 * 2 / R)  # PCIe-bound
    assert S.call_seconds(host, pcie_rate=1e15) == pytest.approx(29.0e-3)
    assert len(S.kernel_keys(ref)) == 4 and len(S.kernel_keys(ref, trace=False)) == 2
    assert S.calls_per_cell(20, 5) == 2 + S.REFERENCE_CALLS + 40 + 24 and S.calls_per_cell(20, 5, False) == 44.5
    a, b = S.estimate_seconds([ref], trials=20), S.estimate_seconds([ref], trials=40)
    assert b["total_seconds"] - a["total_seconds"] == pytest.approx(40 * (29.0e-3 + S.HOST_CALL_S))
    assert a["compiles"] == 4 and a["fixed_seconds"] == 4 * S.COMPILE_S + S.WEIGHTS_S
    two = S.estimate_seconds([ref, dataclasses.replace(ref, routing="skewed1")])
    assert two["compiles"] == 4 and two["per_world"]["loopback"]["cells"] == 2  # the same kernels


def test_compile_only_compiles_each_cells_kernels_once_in_the_cells_precision(monkeypatch, tmp_path):
    import megamoe_interleave.kernel as K

    cells = [S.Cell("deepseek-v4-flash", r, 2048, w, 4, "w4a8") for r in ("balanced", "skewed1")
             for w in ("loopback", "loopback+host")]
    assert {k[2].precision for k in S.kernel_keys(cells[0])} == {"w4a8"}
    built = []
    monkeypatch.setattr(K, "compiled_megamoe_sm90", lambda h, i, config: built.append((h, i, config)))
    monkeypatch.delenv("XSTAGE_KERNEL_CACHE", raising=False)
    with pytest.raises(ValueError, match="XSTAGE_KERNEL_CACHE"):
        S.compile_cells(cells, trace=False)
    monkeypatch.setenv("XSTAGE_KERNEL_CACHE", str(tmp_path))
    assert S.compile_cells(cells, trace=False, file=open(os.devnull, "w")) == 2
    assert sorted(c.schedule for _, _, c in built) == ["expert_wave", "interleaved"]
    assert all(c.precision == "w4a8" and not c.trace and (h, i) == (4096, 2048) for h, i, c in built)


def test_the_reduced_preset_has_24_cells_per_world_within_ten_minutes():
    args = S.build_parser().parse_args(["--preset", "reduced"])
    cells = S.grid_from_args(args)
    est = S.estimate_seconds(cells)
    assert {w: v["cells"] for w, v in est["per_world"].items()} == {"loopback": 24, "loopback+host": 24}
    assert est["total_seconds"] < 600
    assert not [c for c in cells if S.skip_reason(c)]
    args = S.build_parser().parse_args(["--preset", "reduced", "--P", "1"])  # a flag given wins
    assert {c.P for c in S.grid_from_args(args)} == {1}


# ----------------------------------------------------------------------------- resumability


class _FakeRunner:
    """Returns a record per cell; fails on the cells named in ``fail``; checks the JSON on disk
    holds every earlier cell (written after every cell)."""

    def __init__(self, out, fail=()):
        self.out, self.fail, self.calls, self.released = Path(out), set(fail), [], 0

    def __call__(self, cell, position):
        if self.out.exists():
            on_disk = {S.Cell.from_dict(r["cell"]) for r in json.loads(self.out.read_text())["cells"]}
            assert set(self.calls) <= on_disk
        self.calls.append(cell)
        if cell.key() in self.fail:
            raise RuntimeError("boom")
        return {"timing": {"speedup": 1.0 + position / 100, "verdict": "interleaved faster"}}

    def release(self):
        self.released += 1


def test_a_second_run_skips_the_cells_already_measured(tmp_path):
    out = tmp_path / "sweep.json"
    cells = S.cell_grid(shapes=["deepseek-v4-flash", "deepseek-v4-pro"], routings=["balanced"], tokens=[2048, 8192],
                        worlds=["loopback"], Ps=[8])
    budget = S.memory_estimate(PRO, 8, 8192, "loopback")["gpu_bytes"] - 1  # Pro at 8192 does not fit
    bad = cells[1]
    first = _FakeRunner(out, fail=[bad.key()])
    p = S.run_sweep(cells, out, first, gpu_budget=budget, bar=False)
    assert first.calls == [cells[0], cells[1], cells[2]] and first.released == 3
    status = {S.Cell.from_dict(r["cell"]): r["status"] for r in p["cells"]}
    assert status == {cells[0]: "ok", cells[1]: "error", cells[2]: "ok", cells[3]: "skipped"}
    rec = {S.Cell.from_dict(r["cell"]): r for r in p["cells"]}
    assert "RuntimeError: boom" in rec[bad]["error"] and "budget" in rec[cells[3]]["reason"]
    assert rec[cells[2]]["position"] == 2 and rec[cells[2]]["timing"]["speedup"] == 1.02
    assert rec[cells[2]]["wall_s"] >= 0 and "wall_s" not in rec[cells[3]]  # a skip runs nothing
    with open(out.with_suffix(".csv")) as f:
        rows = list(csv.DictReader(f))
    assert [r["status"] for r in rows] == ["ok", "error", "ok", "skipped"] and list(rows[0])[:6] == list(S.KEY_FIELDS)
    # the second run measures only what is not measured yet: the failed cell (the skip is planned again)
    second = _FakeRunner(out)
    p = S.run_sweep(cells, out, second, gpu_budget=budget, bar=False)
    assert second.calls == [bad]
    assert len(p["cells"]) == 4 and len(p["runs"]) == 2
    assert {S.Cell.from_dict(r["cell"]): r["status"] for r in p["cells"]}[bad] == "ok"
    assert {S.Cell.from_dict(r["cell"]): r["run"] for r in p["cells"]}[cells[0]] == 0
    assert S.load_sweep(out)["cells"] == p["cells"] and not out.with_name("sweep.json.tmp").exists()
    third = _FakeRunner(out)
    S.run_sweep(cells, out, third, resume=False, gpu_budget=budget, bar=False)
    assert third.calls == cells[:3]  # --no-resume runs everything again


def test_stop_on_error_records_the_cell_then_raises(tmp_path):
    out = tmp_path / "s.json"
    cells = S.cell_grid(shapes=["deepseek-v4-flash"], routings=["balanced"], tokens=[2048], worlds=["loopback"], Ps=[1])
    with pytest.raises(RuntimeError, match="boom"):
        S.run_sweep(cells, out, _FakeRunner(out, fail=[cells[0].key()]), stop_on_error=True, bar=False)
    assert S.load_sweep(out)["cells"][0]["status"] == "error"


# ----------------------------------------------------------------------------- per-tile statistics


def _tile(phase, t_start, mainloop, slot_wait=0, rs=0, wait=100, row=0, n_block=0):
    t_ready = t_start + wait
    t_mainloop = t_ready + mainloop
    t_slot = t_mainloop + slot_wait
    return dict(phase=phase, row=row, n_block=n_block, t_start=t_start, t_ready=t_ready, t_mainloop=t_mainloop,
                t_epilogue=t_slot + 200, smid=0, cycles=1, t_slot=t_slot, t_rs_end=t_slot + 200 + rs, rs_ns=rs)


def _synthetic_trace():
    """Rank 0: CTA 0 runs L2 a (T_RS 5000) -> L2 b (mainloop 3000, slot wait 1500; T_RS 4000)
    -> L1 c (mainloop 8000, no wait); CTA 1 one L2 tile (no successor). Rank 1: L2 d (T_RS 2500)
    -> L2 e (mainloop 1000, slot wait 1200; T_RS 700)."""
    cta0 = [_tile(2, 0, 2000, rs=5000), _tile(2, 2500, 3000, slot_wait=1500, rs=4000),
            _tile(1, 7000, 8000, slot_wait=0, rs=300)]
    cta1 = [_tile(2, 0, 2500, rs=9000)]
    rank1 = [[_tile(2, 0, 2000, rs=2500), _tile(2, 3000, 1000, slot_wait=1200, rs=700)]]
    return {0: [cta0, cta1], 1: rank1}


def test_l2_samples_pair_each_tile_with_its_successor():
    s = S.l2_samples(_synthetic_trace())
    assert [(x["t_rs"], x["successor"], x["cover"], x["measured"], x["predicted"]) for x in s] == [
        (5000, 2, 3000, 1500, 2000),  # eq. 15: [5000 - 3000]+
        (4000, 1, 8000, 0, 0),  # the L1 successor's mainloop covers the span: predicted zero
        (2500, 2, 1000, 1200, 1500)]


def test_trace_statistics_span_mainloops_and_stalls():
    st = S.trace_statistics(_synthetic_trace())
    assert (st["ranks"], st["ctas"], st["l1_tiles"], st["l2_tiles"]) == (2, 3, 1, 5)
    assert st["rs_ns"]["n"] == 5 and st["rs_ns"]["median"] == 4000
    q = st["rs_ns"]["quantiles"]
    assert len(q) == 101 and q[0] == 700 and q[100] == 9000 and q[50] == 4000 and q == sorted(q)
    assert st["l2_mainloop_ns"]["median"] == 2000 and st["l1_mainloop_ns"]["median"] == 8000
    assert st["l1_store_ns"]["median"] == 300
    stall = st["stall"]
    assert stall["sampled"] == 3 and stall["without_successor"] == 2
    assert stall["measured_ns"]["median"] == 1200 and stall["predicted_ns"]["median"] == 1500
    assert stall["predicted_zero_frac"] == pytest.approx(1 / 3)
    assert stall["overprediction_ns_median"] == 300  # medians of 500, 0, 300
    assert stall["by_successor"]["L1"] == {"n": 1, "measured_median": 0, "predicted_median": 0}
    assert stall["by_successor"]["L2"]["n"] == 2 and stall["by_successor"]["L2"]["predicted_median"] == 1750
    empty = S.trace_statistics({0: [[]]})
    assert empty["rs_ns"]["median"] is None and empty["stall"]["predicted_zero_frac"] is None


def test_the_prediction_is_eq_15_per_tile():
    st = S.l2_samples({0: [[_tile(2, 0, 1000, rs=3000), _tile(1, 2000, 2999)]]})
    assert st[0]["predicted"] == model.critical_path_stall(3000.0, 2999.0) == 1.0


# ----------------------------------------------------------------------------- the per-cell comparison


def _paired(ew, il, clocks_ew=None, clocks_il=None):
    n = len(ew)
    return {"expert_wave": list(ew), "interleaved": list(il)}, {
        "expert_wave": clocks_ew or [1980] * n, "interleaved": clocks_il or [1980] * n}


def test_compare_schedules_ratio_and_sign_tests():
    samples, clocks = _paired([110 + (i % 3) for i in range(20)], [100 + (i % 2) for i in range(20)])
    c = S.compare_schedules(samples, clocks)
    assert c["verdict"] == "interleaved faster" and c["speedup"] > 1.08 and c["n_matched"] == 20
    assert c["p_interleaved_faster"] == pytest.approx(2 ** -20) and c["p_interleaved_slower"] == 1.0
    assert c["expert_wave_median_us"] == 111 and c["interleaved_median_us"] == 100.5
    assert c["paired"]["baseline"] == "interleaved" and c["paired"]["samples_us"]["expert_wave"][0] == 110
    slower = S.compare_schedules(*_paired([100] * 20, [105] * 20))
    assert slower["verdict"] == "interleaved slower" and slower["speedup"] == pytest.approx(100 / 105)
    mixed = S.compare_schedules(*_paired([100, 102] * 10, [101] * 20))
    assert mixed["verdict"] == "no significant difference"
    off = [1980] * 3 + [1500] * 17  # most trials away from the reference clock
    few = S.compare_schedules(*_paired([110] * 20, [100] * 20, off, [1500] * 3 + [1980] * 17))
    assert few["verdict"] == "inconclusive" and few["n_matched"] < 5


def test_trace_overhead_is_the_median_paired_ratio():
    o = S.trace_overhead({"untraced": [100.0] * 5, "traced": [102.0, 103.0, 101.0, 102.0, 104.0]},
                         {"untraced": [1980] * 5, "traced": [1980] * 5}, min_matched=5)
    assert o["ratio"] == pytest.approx(1.02) and o["traced_slower"] == "pass" and o["n_matched"] == 5


def test_cell_model_uses_the_worlds_profile_and_the_measured_mainloops():
    wave = {"l1_mainloop_ns": {"median": 4000.0}, "l2_mainloop_ns": {"median": 2000.0}}
    loop = S.cell_model(S.Cell("deepseek-v4-flash", "skewed1", 8192, "loopback", 8), FLASH, 256, 3, wave)
    assert loop == {"platform": None, "note": S.NO_PREDICTION}
    cell = S.Cell("deepseek-v4-flash", "skewed1", 8192, "loopback+host", 8)
    m = S.cell_model(cell, FLASH, 256, 3, wave)
    plan = planner.plan_megamoe(profiles.load("h200-pcie-host"), hidden=4096, intermediate=2048, experts=256, topk=6,
                                tokens=8192, world=8, block_n=256, t_l1_mma=4e-6, t_l2_mma=2e-6)
    assert m["platform"] == "h200-pcie-host" and m["mma_source"].startswith("measured")
    assert (m["n1"], m["n2"]) == (plan.n1, plan.n2) == (16, 16)
    assert m["interleaved_gap_us"] == pytest.approx(plan.interleaved_gap_s * 1e6) == pytest.approx(6.0)
    assert m["interleaved_overhead_us"] == pytest.approx(plan.interleaved_overhead_s * 1e6)
    assert m["interleave_sufficient"] is plan.interleave_sufficient and m["verdict"] == plan.verdict
    assert m["d_knee_rows"] == pytest.approx(model.d_knee(256, 132, 2048)) and m["lead_rows"] == 3
    assert m["predicted_rs_wave_us"] == pytest.approx((plan.t_iss0_s + plan.wave_overhead_s) * 1e6)
    est = S.cell_model(cell, FLASH, 256, 3, None)
    assert est["mma_source"].startswith("estimated") and est["t_l2_mma_us"] != m["t_l2_mma_us"]


def test_flat_row_of_a_record():
    st = S.trace_statistics(_synthetic_trace())
    rec = {"cell": S.Cell("deepseek-v4-flash", "skewed2", 4096, "loopback+host", 8).as_dict(),
           "routing_kind": "skewed", "strength": 2.0, "status": "ok", "memory": {"gpu_bytes": 42.84e9},
           "timing": S.compare_schedules(*_paired([110] * 20, [100] * 20)),
           "schedules": {"expert_wave": {"trace": st, "trace_overhead": {"ratio": 1.01},
                                         "config": {"block_n": 256, "stages": 3, "dispatch_copy": "bulk"}},
                         "interleaved": {"config": {"block_n": 256}}},
           "model": {"platform": "h200-pcie-host", "n1": 16, "interleave_sufficient": False}}
    row = S.flat_row(rec)
    assert list(row)[:6] == list(S.KEY_FIELDS) and row["routing"] == "skewed2" and row["strength"] == 2.0
    assert row["speedup"] == pytest.approx(1.1) and row["verdict"] == "interleaved faster"
    assert row["rs_median_us_ew"] == 4.0 and row["stall_measured_us_ew"] == 1.2 and row["stall_predicted_us_ew"] == 1.5
    assert row["rs_median_us_il"] is None and row["trace_overhead_ew"] == 1.01 and row["stages_ew"] == 3
    assert row["model_n1"] == 16 and row["model_interleave_sufficient"] is False and row["gpu_gb_estimate"] == 42.8
    skipped = S.flat_row({"cell": rec["cell"], "status": "skipped", "reason": "too big"})
    assert skipped["reason"] == "too big" and skipped["speedup"] is None


# ----------------------------------------------------------------------------- the GPU runner on a CPU stand-in


def _trace_tensor(cta_tiles):
    import torch

    t = torch.full((len(cta_tiles), max(len(c) for c in cta_tiles) + 1, len(TRACE_FIELDS)), -1, dtype=torch.int64)
    for i, cta in enumerate(cta_tiles):
        for j, r in enumerate(cta):
            key = (r["phase"] << 40) | (r["row"] << 16) | r["n_block"]
            t[i, j] = torch.tensor([key] + [r[f] for f in TRACE_FIELDS[1:]])
    return t


class _World:
    def __init__(self, placement):
        self.placement = placement


class _StandInMoE:
    """What GpuRunner uses of a MegaMoE: forward / rerun (y, last_kernel_us), set_trace,
    last_trace, config, world.placement, poison_combine."""

    built = []
    placement = None

    def __init__(self, shape, P, tokens, config, w1, w2, *, world, poison_combine, weight_cache):
        import torch

        self.config = (config or MegaMoEConfig()).resolve(shape, P, tokens, 132)
        self.world = _World(_StandInMoE.placement or world)
        self.poison_combine = poison_combine
        self.last_trace, self.last_kernel_us, self.calls = {}, None, []
        self.ys = [torch.full((4, 8), float(r + 1)) for r in range(P)]
        _StandInMoE.built.append(self)

    def set_trace(self, enabled):
        self.config = dataclasses.replace(self.config, trace=bool(enabled))

    def forward(self, xs, idx, wts):
        ew = self.config.schedule == "expert_wave"
        self.last_kernel_us = (110.0 if ew else 100.0) * (1.02 if self.config.trace else 1.0)
        self.calls.append(("trace" if self.config.trace else "plain", self.poison_combine))
        if self.config.trace:
            tr = _synthetic_trace()
            self.last_trace = {r: _trace_tensor(ctas) for r, ctas in tr.items()}
        return [y.clone() for y in self.ys]

    def rerun(self):
        return self.forward(None, None, None)


def _stand_in(monkeypatch):
    import torch

    from megamoe_interleave import reference

    P = 8
    made = []
    monkeypatch.setattr(bench, "make_weights", lambda shape, rng: made.append((shape.name, rng)) or (
        torch.zeros(shape.num_experts, 1, 2), torch.zeros(shape.num_experts, 2, 1)))
    monkeypatch.setattr(bench, "make_inputs", lambda shape, kind, P, T, strength: (["x"] * P, ["i"] * P, ["w"] * P))
    monkeypatch.setattr(reference, "unfused_pipeline", lambda *a: [torch.full((4, 8), float(r + 1)) for r in range(P)])
    monkeypatch.setattr(bench, "build_moe", _StandInMoE)
    monkeypatch.setattr(paired, "sm_clock_mhz", lambda: 1980)
    _StandInMoE.built.clear()
    _StandInMoE.placement = None
    return made


def test_gpu_runner_measures_a_cell_on_a_cpu_stand_in(monkeypatch):
    made = _stand_in(monkeypatch)
    runner = S.GpuRunner(trials=6, trace_trials=3, weight_rng="cpu")
    cell = S.Cell("deepseek-v4-flash", "skewed1", 8192, "loopback+host", 8)
    rec = runner(cell, 1)
    assert made == [("deepseek-v4-flash", "cpu")]
    assert rec["order"] == ["interleaved", "expert_wave"]  # rotated by the cell's position
    assert rec["placement"] == "loopback+host" and rec["time_scope"] == S.TIME_SCOPE
    t = rec["timing"]
    assert t["speedup"] == pytest.approx(1.1) and t["verdict"] == "interleaved faster" and t["n_trials"] == 6
    for sched in ("expert_wave", "interleaved"):
        s = rec["schedules"][sched]
        assert s["config"] == dataclasses.asdict(MegaMoEConfig(sched).resolve(FLASH, 8, 8192, 132))
        assert s["config"]["trace"] is False  # the untraced config is what was timed
        assert s["traced_output_equal"] is True and s["trace_full_ctas"] == 0
        assert s["trace_overhead"]["ratio"] == pytest.approx(1.02) and s["trace_overhead"]["n_matched"] == 3
        assert s["trace"] == S.trace_statistics(_synthetic_trace())
    assert rec["model"]["platform"] == "h200-pcie-host" and rec["model"]["t_l2_mma_us"] == pytest.approx(2.0)
    assert rec["model"]["lead_rows"] == rec["schedules"]["interleaved"]["config"]["lead"]
    il, ew = _StandInMoE.built
    assert il.config.schedule == "interleaved" and not il.config.trace and not il.poison_combine
    # calls of one object: the checked warm-up (poisoned), 6 timed, then an untraced + a traced call,
    # 3 paired trials of each
    assert il.calls[0] == ("plain", True) and len(il.calls) == 1 + 6 + 2 + 6
    assert [c[0] for c in il.calls[7:9]] == ["plain", "trace"] and sum(c[0] == "trace" for c in il.calls) == 4
    runner(dataclasses.replace(cell, routing="balanced"), 2)
    assert len(made) == 1  # the weights of one shape are made once


def test_gpu_runner_checks_the_outputs_and_the_placement(monkeypatch):
    import torch

    from megamoe_interleave import reference

    _stand_in(monkeypatch)
    runner = S.GpuRunner(trials=2, trace=False)
    cell = S.Cell("deepseek-v4-flash", "balanced", 2048, "loopback", 8)
    rec = runner(cell, 0)
    assert "trace" not in rec["schedules"]["expert_wave"] and rec["model"]["platform"] is None
    _StandInMoE.placement = "loopback+host"
    with pytest.raises(RuntimeError, match="placed as"):
        runner(cell, 0)
    _StandInMoE.placement = None
    monkeypatch.setattr(reference, "unfused_pipeline", lambda *a: [torch.zeros(4, 8)] * 8)
    with pytest.raises(RuntimeError, match=re.escape("max |fused - unfused|")):
        runner(cell, 0)
    # W8A8 cells build W8A8 layers and are checked by relative error (the recipe's E4M3 rounding
    # fails the elementwise bound): far off still raises, the stand-in's y on itself passes
    w8 = dataclasses.replace(cell, precision="w8a8")
    with pytest.raises(RuntimeError, match="relative error"):
        runner(w8, 0)
    monkeypatch.setattr(reference, "unfused_pipeline", lambda *a: [torch.full((4, 8), float(r + 1)) for r in range(8)])
    _StandInMoE.built.clear()
    runner(w8, 0)
    assert {m.config.precision for m in _StandInMoE.built} == {"w8a8"}


# ----------------------------------------------------------------------------- pieces of lab.megamoe.bench / api


def test_make_weights_cpu_numbers_and_the_weight_views():
    import torch

    from megamoe_interleave.shapes import MoEShape

    shape = MoEShape("tiny", 64, 32, 4, 2, "test")
    w1, w2 = bench.make_weights(shape, device="cpu")
    g = torch.Generator().manual_seed(0)
    assert torch.equal(w1[0], (torch.randn(64, 64, generator=g) / 64 ** 0.5).bfloat16())
    assert w1.shape == (4, 64, 64) and w2.shape == (4, 64, 32) and w1.dtype == torch.bfloat16
    assert torch.equal(bench.make_weights(shape, device="cpu")[1], w2)
    with pytest.raises(ValueError, match="CUDA device"):
        bench.make_weights(shape, device="cpu", rng="cuda")
    w1_t, w2_t = bench.rank_weight_views(shape, 2, w1, w2)
    assert len(w1_t) == 2 and torch.equal(w1_t[1], w1[2:4].transpose(1, 2)) and w2_t[0].shape == (2, 32, 64)


def test_set_trace_switches_the_kernel_and_the_trace_tensor(monkeypatch):
    from megamoe_interleave import api
    from lab.megamoe.routing import make_routing
    from xstage import cute_compile

    import torch

    monkeypatch.setattr(cute_compile, "_CACHE", {})
    world = api.make_world("loopback", 2, device="cpu")
    moe = api.MegaMoE(world, 16, 256, 128, 4, 64, MegaMoEConfig("interleaved", block_n=64), backend="fused")
    g = torch.Generator().manual_seed(0)
    moe.load_weights(torch.randn(16, 256, 256, generator=g).bfloat16(), torch.randn(16, 256, 128, generator=g).bfloat16())
    routes = [make_routing("balanced", 40, 16, 4, seed=r) for r in range(2)]
    moe.stage_inputs([torch.randn(40, 256).bfloat16() for _ in range(2)], [r[0] for r in routes], [r[1] for r in routes])
    off = moe.launcher.launch_arguments(0)[1].mTrace
    assert off.shape == (1, 1, len(TRACE_FIELDS)) and moe.last_trace == {}
    before = moe.config
    moe.set_trace(True)
    assert moe.config == dataclasses.replace(before, trace=True) and moe.config.kernel_key() != before.kernel_key()
    on = moe.launcher.launch_arguments(0)[1].mTrace
    assert on.shape[0] == moe.launcher.launch_arguments(0)[0] and on.shape[1] > 1 and moe.last_trace[0].shape == on.shape
    moe.set_trace(False)
    assert moe.config == before and moe.launcher.launch_arguments(1)[1].mTrace.shape == (1, 1, len(TRACE_FIELDS))


# ----------------------------------------------------------------------------- evaluation


def _record(shape, routing, tokens, world, P, speedup, verdict=None, rs=(9000, 3600), stall=(4000, 0)):
    """A measured cell: T_RS median wave / int. (ns), stall prediction / measurement medians."""
    def trace(rs_ns, st):
        return {"rs_ns": {"n": 10, "median": rs_ns, "p10": rs_ns / 2, "p90": rs_ns * 2, "p99": rs_ns * 3,
                          "quantiles": [rs_ns * (0.5 + q / 100) for q in range(101)]},
                "l1_mainloop_ns": {"median": 9000.0}, "l2_mainloop_ns": {"median": 5000.0},
                "stall": {"sampled": 8, "predicted_ns": {"median": st}, "measured_ns": {"median": st * 0.8},
                          "predicted_zero_frac": 1.0 if st == 0 else 0.0}}
    verdict = verdict or ("interleaved faster" if speedup > 1 else "interleaved slower")
    return {"cell": S.Cell(shape, routing, tokens, world, P).as_dict(), "status": "ok",
            "timing": {"speedup": speedup, "verdict": verdict, "n_matched": 20, "n_trials": 20,
                       "expert_wave_median_us": 1000.0 * speedup, "interleaved_median_us": 1000.0,
                       "p_interleaved_faster": 1e-6 if speedup > 1 else 1.0,
                       "p_interleaved_slower": 1.0 if speedup > 1 else 1e-6},
            "schedules": {"expert_wave": {"trace": trace(rs[0], stall[0]), "trace_overhead": {"ratio": 1.01},
                                          "config": {"block_n": 256}},
                          "interleaved": {"trace": trace(rs[1], stall[1]), "trace_overhead": {"ratio": 1.03},
                                          "config": {"block_n": 256}}},
            "model": {"platform": "h200-pcie-host", "interleave_sufficient": False,
                      "predicted_rs_wave_us": 160.0, "predicted_rs_interleaved_us": 150.0}
            if world == "loopback+host" else {"platform": None}}


def _sweep_payload():
    recs = [
        _record("deepseek-v4-flash", "skewed1", 4096, "loopback+host", 8, 1.20),
        _record("deepseek-v4-flash", "skewed1", 8192, "loopback+host", 8, 1.50),
        _record("deepseek-v4-flash", "balanced", 8192, "loopback+host", 8, 0.90),
        _record("deepseek-v4-pro", "skewed1", 8192, "loopback+host", 8, 1.00, verdict="no significant difference"),
        _record("deepseek-v4-flash", "skewed1", 8192, "loopback", 8, 1.10),
        _record("deepseek-v4-flash", "balanced", 8192, "loopback", 1, 0.95, verdict="no significant difference"),
    ]
    recs.append({"cell": S.Cell("deepseek-v4-pro", "skewed2", 8192, "loopback", 8).as_dict(), "status": "skipped",
                 "reason": "estimated GPU memory 130.0 GB > budget 120 GB"})
    payload = S.new_payload()
    payload["cells"] = recs
    payload["runs"] = [{"provenance": {"date_utc": "2026-12-02", "gpu": "NVIDIA H200", "commit": "abc"}}]
    return payload


def test_speedup_summary_geomean_median_max_per_world():
    cells = evaluation.measured_cells(_sweep_payload())
    assert len(cells) == 6
    s = evaluation.speedup_summary(cells)
    host = s["loopback+host"]
    assert host["n"] == 4 and host["geomean"] == pytest.approx((1.2 * 1.5 * 0.9 * 1.0) ** 0.25)
    assert host["median"] == pytest.approx(1.1) and host["max"] == 1.5 and host["min"] == 0.9
    assert host["verdicts"] == {"interleaved faster": 2, "interleaved slower": 1, "no significant difference": 1}
    assert s["loopback"]["n"] == 2 and s["loopback, P=1"]["geomean"] == pytest.approx(0.95)
    assert s["all"]["n"] == 6 and s["all"]["max"] == 1.5
    assert list(s) == ["all", "loopback", "loopback+host", "loopback, P=1", "loopback, P=8", "loopback+host, P=8"]


def test_figure8_rows_group_model_routing_world():
    rows = evaluation.figure8_rows(evaluation.measured_cells(_sweep_payload()))
    key = {(r["shape"], r["routing"], r["world"]): r for r in rows}
    r = key[("deepseek-v4-flash", "skewed1", "loopback+host")]
    assert r["cells"] == 2 and r["geomean"] == pytest.approx(math.sqrt(1.2 * 1.5)) and (r["min"], r["max"]) == (1.2, 1.5)
    assert [(r["shape"], r["routing"], r["world"]) for r in rows][:3] == [
        ("deepseek-v4-flash", "balanced", "loopback"), ("deepseek-v4-flash", "balanced", "loopback+host"),
        ("deepseek-v4-flash", "skewed1", "loopback")]


def test_table2_and_figure10_pick_the_largest_cell_per_shape():
    cells = evaluation.measured_cells(_sweep_payload())
    t2 = evaluation.table2_rows(cells)
    assert [(r["shape"], r["tokens"]) for r in t2] == [("deepseek-v4-flash", 8192), ("deepseek-v4-pro", 8192)]
    r = t2[0]
    assert (r["span_wave_us"], r["span_interleaved_us"], r["mma_l2_us"], r["mma_l1_us"]) == (9.0, 3.6, 5.0, 9.0)
    assert (r["stall_wave_pred_us"], r["stall_wave_meas_us"], r["stall_int_pred_us"]) == (4.0, 3.2, 0.0)
    assert r["int_pred_zero_frac"] == 1.0 and r["eq14_holds"] is False and r["speedup"] == 1.5
    f10 = evaluation.figure10_rows(cells)
    assert {(r["shape"], r["world"], r["schedule"]) for r in f10} == {
        ("deepseek-v4-flash", w, s) for w in S.WORLDS for s in ("expert_wave", "interleaved")} | {
        ("deepseek-v4-pro", "loopback+host", s) for s in ("expert_wave", "interleaved")}
    wave_host = next(r for r in f10 if (r["shape"], r["world"], r["schedule"]) ==
                     ("deepseek-v4-flash", "loopback+host", "expert_wave"))
    assert wave_host["median_us"] == 9.0 and wave_host["predicted_us"] == 160.0 and len(wave_host["quantiles_us"]) == 101
    assert evaluation.select_cell(cells, "deepseek-v4-flash", "loopback", "balanced")["cell"]["P"] == 1


def test_the_whole_kernel_against_the_drain_rate(tmp_path):
    """rate_bound_rows: the loopback control's time as compute, the Combine of all P ranks over R."""
    from xstage import model, profiles

    payload = _sweep_payload()
    times = {("loopback+host", 8): (30000.0, 20000.0), ("loopback", 8): (9000.0, 8500.0)}
    for rec in payload["cells"]:
        c = rec["cell"]
        if (c["shape"], c["routing"], c["tokens"]) == ("deepseek-v4-flash", "skewed1", 8192):
            rec["timing"]["expert_wave_median_us"], rec["timing"]["interleaved_median_us"] = times[(c["world"], c["P"])]
    (row,) = evaluation.rate_bound_rows(evaluation.measured_cells(payload))  # the one cell with a control
    rate = profiles.load("h200-pcie-host").R
    volume = 8 * 8192 * 6 * 4096 * 2
    assert row["drain_us"] == pytest.approx(volume / rate * 1e6)
    assert row["drain_us"] > 9000  # drain-bound: both predictions involve V/R
    assert row["interleaved_predicted_us"] == pytest.approx(row["drain_us"])
    assert row["expert_wave_predicted_us"] == pytest.approx(6000 + max(3000, row["drain_us"]))
    assert row["interleaved_measured_over_predicted"] == pytest.approx(20000 / row["drain_us"])
    assert row["speedup_predicted"] == pytest.approx(row["expert_wave_predicted_us"] / row["drain_us"])
    (summary,) = evaluation.rate_bound_summary([row])
    assert summary["cells"] == 1 and summary["speedup_measured"] == pytest.approx(1.5)
    assert model.kernel_rate_bounds(6e-3, 3e-3, volume, rate)[0] == pytest.approx(volume / rate)
    if importlib.util.find_spec("matplotlib") is not None:
        assert evaluation.draw_rate_bound([row], tmp_path / evaluation.RATE_FIGURE).stat().st_size > 0


def test_the_planner_verdict_with_the_controls_mainloops():
    payload = _sweep_payload()
    for rec in payload["cells"]:
        if rec["cell"]["world"] == "loopback+host":
            rec["model"].update(block_n=256, lead_rows=9, verdict="expert-wave already backpressure-free",
                                t_l2_mma_us=150.0)
    rows = evaluation.planner_verdicts(evaluation.measured_cells(payload))
    (row,) = rows  # the one remote cell with a loopback control (DeepSeek-V4-Flash skewed1 8192, P = 8)
    assert row["verdict_contended"] == "expert-wave already backpressure-free"
    assert row["l2_mainloop_uncontended_us"] == pytest.approx(5.0)  # the control's trace: 5000 ns
    assert row["verdict_uncontended"].startswith("interleave")  # a 5 us gap cannot hide a 132-tile burst
    summary = evaluation.planner_verdict_summary(rows)
    assert [(r["mainloops"], r["cells"]) for r in summary] == [("contended", 1), ("uncontended", 1)]


def test_auto_over_the_sweep_is_the_picked_schedules_paired_time():
    """auto picks interleaved in every synthetic cell (the model's bound and the locality ratio);
    its ratio to the better schedule is 1 where interleaved won and 1/speedup where it lost; the
    summary counts the cells over 1 % and takes geometric means of the medians."""
    rows = evaluation.auto_rows(evaluation.measured_cells(_sweep_payload()))
    assert len(rows) == 6 and {r["pick"] for r in rows} == {"interleaved"}
    by = {(r["shape"], r["routing"], r["tokens"], r["world"], r["P"]): r for r in rows}
    assert by[("deepseek-v4-flash", "balanced", 8192, "loopback+host", 8)]["auto_over_better"] == pytest.approx(1 / 0.9)
    assert by[("deepseek-v4-flash", "skewed1", 8192, "loopback+host", 8)]["auto_over_better"] == 1.0
    summary = {r["world"]: r for r in evaluation.auto_summary(rows)}
    assert summary["all"]["cells"] == 6 and summary["all"]["over_1pct"] == 2  # the 0.90x and 0.95x cells
    assert summary["all"]["geo_over_interleaved"] == pytest.approx(1.0)
    want = math.exp(sum(math.log(1 / s) for s in (1.2, 1.5, 0.9, 1.0, 1.1, 0.95)) / 6)
    assert summary["all"]["geo_over_expert_wave"] == pytest.approx(want)


def test_regressions_and_the_readme(tmp_path):
    payload = _sweep_payload()
    regs = evaluation.regressions(evaluation.measured_cells(payload))
    assert [(r["shape"], r["routing"], r["world"], r["speedup"]) for r in regs] == [
        ("deepseek-v4-flash", "balanced", "loopback+host", 0.90), ("deepseek-v4-flash", "balanced", "loopback", 0.95)]
    text = evaluation.readme(payload)
    assert "| paper | 84 | 1.18x | 1.17x | 1.62x |" in text
    host_line = next(line for line in text.splitlines() if line.startswith("| loopback+host |"))
    assert f"{(1.2 * 1.5 * 0.9) ** 0.25:.3f}x" in host_line and "| 1.100x | 1.500x | 0.900x |" in host_line
    assert "| 2 / 1 / 1 / 0 |" in host_line
    assert "deepseek-v4-flash balanced T=8192 loopback+host P=8: 0.900x (interleaved slower)" in text
    assert "Explanation: _to be written_" in text
    assert "| deepseek-v4-flash | 8 | 8192 | 9.00 / 3.60 | 5.00 / 9.00 | 4.00 / 3.20 | 0.00 / 0.00 | 100% | fails" \
        in text
    assert "skipped: estimated GPU memory 130.0 GB" in text
    paths = evaluation.write_report(payload, tmp_path)
    assert (tmp_path / "README.md").read_text() == evaluation.readme(payload, fig8=paths["fig8"], fig10=paths["fig10"],
                                                                    rate_fig=paths["rate_fig"])
    with open(tmp_path / "table2.csv") as f:
        assert [r["shape"] for r in csv.DictReader(f)] == ["deepseek-v4-flash", "deepseek-v4-pro"]
    with open(tmp_path / "verdicts.csv") as f:
        assert len(list(csv.DictReader(f))) == 6
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / evaluation.FIGURE8).stat().st_size > 0 and (tmp_path / evaluation.FIGURE10).exists()
        assert f"![Figure 8 analogue]({evaluation.FIGURE8})" in (tmp_path / "README.md").read_text()


def test_a_compressed_sweep_round_trips_with_its_csv(tmp_path):
    payload = _sweep_payload()
    path = S.write_sweep(tmp_path / "sweep.json.gz", payload)
    assert path.read_bytes()[:2] == b"\x1f\x8b" and (tmp_path / "sweep.csv").exists()
    assert S.load_sweep(path)["cells"] == payload["cells"]
    assert S.sweep_csv_path(tmp_path / "sweep.json") == tmp_path / "sweep.csv"


def test_the_folders_findings_go_into_its_readme(tmp_path):
    payload = _sweep_payload()
    (tmp_path / evaluation.FINDINGS).write_text("## Findings\n\nThe 0.90x cell: weight locality.\n")
    evaluation.write_report(payload, tmp_path)
    text = (tmp_path / "README.md").read_text()
    assert text.index("## Findings") < text.index("## Speedup of interleaved")
    assert "_to be written_" not in text and "Explained under Findings." in text


def test_figures_are_skipped_with_a_message_without_matplotlib(monkeypatch, tmp_path, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    paths = evaluation.write_report(_sweep_payload(), tmp_path)
    assert paths["fig8"] is None and paths["fig10"] is None and not (tmp_path / evaluation.FIGURE8).exists()
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert "(Figure 8 not drawn" in (tmp_path / "README.md").read_text()


def test_report_main_reads_a_sweep_json(tmp_path):
    S.write_sweep(tmp_path / "sweep.json", _sweep_payload())
    assert (tmp_path / "sweep.csv").exists()
    paths = evaluation.main(["--sweep", str(tmp_path / "sweep.json"), "--table2-world", "loopback"])
    assert paths["readme"] == tmp_path / "README.md"
    assert "World loopback, routing skewed1" in paths["readme"].read_text()
    (tmp_path / "other.json").write_text(json.dumps({"schema": "something-else"}))
    with pytest.raises(ValueError, match="not a megamoe-xstage-sweep"):
        evaluation.main(["--sweep", str(tmp_path / "other.json")])


# ----------------------------------------------------------------------------- command lines


def test_sweep_dry_run_plans_without_a_gpu(capsys, tmp_path):
    out = tmp_path / "sweep.json"
    assert S.main(["--dry-run", "--shapes", "deepseek-v4-pro", "--tokens", "8192", "--P", "8", "--worlds", "loopback",
                   "--routing", "balanced", "skewed1", "--gpu-memory-gb", "100", "--out", str(out)]) is None
    text = capsys.readouterr().out
    assert "2 cells: 0 to run, 2 skipped" in text and "skip deepseek-v4-pro balanced T=8192 loopback P=8" in text
    assert "estimated GPU time" in text and not out.exists()


def test_sweep_out_must_be_a_file_not_a_folder(tmp_path):
    with pytest.raises(SystemExit, match="is a folder"):
        S.main(["--dry-run", "--out", str(tmp_path)])


@pytest.mark.parametrize("script", ["sweep_megamoe.py", "megamoe_xstage_report.py"])
def test_command_lines_start_with_help(script):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + ([os.environ["PYTHONPATH"]]
                                                                       if os.environ.get("PYTHONPATH") else []))}
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--help"], capture_output=True, text=True,
                       timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0 and "usage" in r.stdout, r.stderr[-2000:]
    flags = {"sweep_megamoe.py": ["--shapes", "--routing", "--tokens", "--worlds", "--P", "--trials", "--out",
                                  "--resume", "--no-resume", "--dry-run", "--preset"],
             "megamoe_xstage_report.py": ["--sweep", "--out", "--table2-world", "--fig10-shapes"]}[script]
    assert all(f in r.stdout for f in flags)
    assert "sys.path" not in (ROOT / "scripts" / script).read_text()


def test_rechecks_replace_a_cells_timing_keep_its_traces_and_are_listed_in_the_readme():
    payload = _sweep_payload()
    recheck = S.new_payload()
    again = _record("deepseek-v4-flash", "balanced", 8192, "loopback+host", 8, 0.97, verdict="interleaved slower")
    again["timing"].update(n_trials=40, n_matched=31)
    del again["schedules"]  # a recheck without traces (--no-trace)
    recheck["cells"] = [again]
    out = evaluation.apply_rechecks(payload, [("recheck_x.json", recheck)])
    cells = {tuple(r["cell"].values()): r for r in evaluation.measured_cells(out)}
    cell = cells[("deepseek-v4-flash", "balanced", 8192, "loopback+host", 8, "bf16")]
    assert cell["timing"]["speedup"] == 0.97 and cell["schedules"]["expert_wave"]["trace"]  # traces kept
    assert payload["cells"][2]["timing"]["speedup"] == 0.90  # the input is not modified
    (row,) = out["rechecked"]
    assert (row["file"], row["trials"], row["matched"], row["sweep_speedup"]) == ("recheck_x.json", 40, 31, 0.90)
    assert "recheck_x.json | 40 (31) | 0.9000x | 0.9700x" in evaluation.readme(out)
    stray = S.new_payload()
    stray["cells"] = [_record("mimo-v2-flash", "balanced", 2048, "loopback", 1, 1.0)]
    with pytest.raises(ValueError, match="not in the sweep"):
        evaluation.apply_rechecks(payload, [("stray.json", stray)])


def test_compare_auto_ratios_against_each_schedule_and_the_better_one():
    """--with-auto: auto's median per-trial ratio to each fixed schedule on their clock-matched
    trials, and to the faster one; the CSV row carries them."""
    clocks = {k: [1980.0] * 6 for k in ("expert_wave", "interleaved", "auto")}
    samples = {"expert_wave": [100.0] * 6, "interleaved": [110.0] * 6, "auto": [101.0] * 6}
    a = S.compare_auto(samples, clocks, "expert_wave")
    assert a["pick"] == "expert_wave" and a["n_matched_expert_wave"] == 6
    assert a["over_expert_wave"] == pytest.approx(1.01) and a["over_interleaved"] == pytest.approx(101 / 110)
    assert a["over_better"] == pytest.approx(1.01)
    rec = _record("deepseek-v4-pro", "balanced", 2048, "loopback+host", 1, 0.98)
    rec["auto"] = a
    row = S.flat_row(rec)
    assert row["auto_pick"] == "expert_wave" and row["auto_over_better"] == pytest.approx(1.01)
    assert S.flat_row(_record("deepseek-v4-pro", "balanced", 2048, "loopback", 1, 1.0))["auto_pick"] is None


def test_with_auto_budgets_memory_for_three_layers():
    """--with-auto keeps three MegaMoE layers per cell alive: the memory estimate and the skip
    check count three."""
    cell = S.Cell("deepseek-v4-pro", "balanced", 4096, "loopback", 8)
    two, three = (S.memory_estimate(get_shape(cell.shape), 8, 4096, "loopback", n_moes=n)["gpu_bytes"] for n in (2, 3))
    between = (two + three) / 2
    assert S.skip_reason(cell, gpu_budget=between) is None
    assert "3 x" in S.skip_reason(cell, gpu_budget=between, n_moes=3)
