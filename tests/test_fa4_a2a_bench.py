"""lab.fa4_a2a.bench (scripts/bench_fa_a2a.py) on the CPU: its arguments, the acceptance verdicts of
its rows (the statistics themselves: tests/test_paired.py), re-analysis of a saved JSON, the
multi-process agreement and the trial loop on host stand-ins (trial sizing: tests/test_bench.py)."""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from test_paired import _dvfs_row  # synthetic DVFS-affected row (pytest puts tests/ on sys.path)

from lab.fa4_a2a import bench
from lab import paired


def test_args_defaults_plain_and_stabilized():
    a = bench.parse_args([])
    assert (a.target_trial_us, a.max_replays, a.min_replays, a.stabilize) == (3000.0, 20, 3, False)
    s = bench.parse_args(["--stabilize", "--seqs", "65536"])
    assert (s.target_trial_us, s.max_replays, s.min_replays, s.stabilize) == (2000.0, 4, 1, True)
    assert bench.parse_args(["--stabilize", "--max-replays", "9"]).max_replays == 9
    with pytest.raises(SystemExit):
        bench.parse_args(["--min-replays", "5", "--max-replays", "2"])
    assert set(bench.VARIANTS) >= {"a2a_symm", "serial_symm"}
    assert set(bench.parse_args(["--world", "torch-symm"]).variants) == set(bench.VARIANTS)


def test_analyse_row_and_tables():
    samples, clocks = _dvfs_row()
    samples["fa_only"] = [x - 5 for x in samples["fused"]]
    clocks["fa_only"] = [1635] * 21
    samples["serial_symm"] = [x + 30 for x in samples["fused"]]
    clocks["serial_symm"] = [1635] * 21
    row = bench.analyse_row({"H": 40, "H_local": 5, "M": 65536, "P": 8, "world": "loopback"}, samples, clocks,
                            30.0, 5)
    assert set(row["acceptance"]) == {"fused_lt_serial", "fused_lt_serial_symm"}
    assert all(a["verdict"] == "pass" for a in row["acceptance"].values())
    assert row["matched_median_us"]["serial"]["n"] == 14
    assert row["E_res_fused_us"] == pytest.approx(5, abs=1e-6)
    assert "paired_serial_minus_fused" in row and "paired_serial_symm_minus_fused" in row
    payload = {"rows": [row], "acceptance_fused_lt_serial": bench.acceptance_summary([row])}
    assert payload["acceptance_fused_lt_serial"]["fused_lt_serial"]["all_pass"]
    md = bench.table3(payload)
    assert "**PASS**" in md and "@ matched clock" in md and "PASS at every point" in md


def test_reanalyse_a_saved_json(tmp_path):
    samples, clocks = _dvfs_row()
    rows = [{"H": 24, "H_local": 3, "M": M, "P": 8, "world": "loopback", "dtype": "bf16", "head_dim": 128,
             "timings": {k: {"samples_us": v} for k, v in samples.items()}, "sm_clock_mhz": clocks}
            for M in (49152, 65536)]
    rows[1]["sm_clock_mhz"] = None  # an older JSON without clocks: paired only, flagged
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"rows": rows, "num_sms": 132}))
    assert bench.main(["--plot", str(path), "--reanalyse"]) == 0
    out = json.loads((tmp_path / "bench_reanalysed.json").read_text())
    acc = [r["acceptance"]["fused_lt_serial"] for r in out["rows"]]
    assert acc[0]["verdict"] == "pass" and acc[0]["n_matched"] == 14
    assert acc[1]["n_matched"] == 21 and not acc[1]["clock_matched"]
    assert not out["acceptance_fused_lt_serial"]["fused_lt_serial"]["clock_matched"]
    assert "**PASS**" in (tmp_path / "bench_reanalysed.md").read_text()


def test_multiprocess_sync_agrees_on_replays():
    calls = []

    def all_reduce(t, op=None, group=None):
        calls.append(op)
        t.copy_(torch.maximum(t, torch.tensor([5.0, 2.0], dtype=t.dtype)))

    dist = types.SimpleNamespace(all_reduce=all_reduce, ReduceOp=types.SimpleNamespace(MAX="max"))
    world = types.SimpleNamespace(local_ranks=[3], world_size=8, device=torch.device("cpu"),
                                  barrier=lambda: calls.append("barrier"))
    sync = bench.WorldSync(world, dist)
    assert sync.multi
    # keys sorted: [a2a_only, fused]; the other ranks want [5, 2]
    assert sync.agree_max({"fused": 3, "a2a_only": 4}) == {"a2a_only": 5, "fused": 3}
    sync.barrier()
    assert calls == ["max", "barrier"]
    single = bench.WorldSync(types.SimpleNamespace(local_ranks=list(range(8)), world_size=8), None)
    assert not single.multi and single.agree_max({"x": 1}) == {"x": 1}
    single.barrier()  # no-op


def test_reduce_over_ranks_takes_max_time_and_min_clock():
    per_rank = [{"samples": {"f": [10.0, 20.0]}, "clocks": {"f": [1700, 1600]}},
                {"samples": {"f": [12.0, 18.0]}, "clocks": {"f": [1650, None]}}]

    def all_gather_object(out, obj, group=None):
        out[:] = per_rank

    dist = types.SimpleNamespace(all_gather_object=all_gather_object)
    world = types.SimpleNamespace(world_size=2)
    s, c, raw = bench.reduce_over_ranks(dist, world, {"f": [10.0, 20.0]}, {"f": [1700, 1600]})
    assert s == {"f": [12.0, 20.0]} and c == {"f": [1650, None]} and len(raw) == 2


class _FakeEvent:
    def __init__(self, enable_timing=True):
        self.t = None

    def record(self):
        import time

        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3  # ms


class _FakeGraph:
    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        self.fn()


@pytest.mark.parametrize("cooldown", [0.0, 0.001])
def test_time_interleaved_loop_logic(monkeypatch, cooldown):
    """The trial loop with CUDA replaced by host stand-ins: rotation, replay counts, one clock
    reading per trial (two with a cool-down), barriers around every timed burst."""
    calls, clock = [], iter(range(10**6))
    monkeypatch.setattr(bench, "_capture", _FakeGraph)
    monkeypatch.setattr(paired, "sm_clock_mhz", lambda: 1500 + next(clock) % 3)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    world = types.SimpleNamespace(local_ranks=[0], world_size=2, barrier=lambda: calls.append("barrier"))
    dist = types.SimpleNamespace(all_reduce=lambda t, op=None, group=None: None,
                                 ReduceOp=types.SimpleNamespace(MAX="max"))
    world.device = torch.device("cpu")
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    samples, replays, clocks, before = bench.time_interleaved(
        fns, 4, target_us=1.0, max_replays=5, min_replays=2, cooldown_s=cooldown, sync=bench.WorldSync(world, dist))
    assert replays == {"a": 2, "b": 2}
    assert all(len(samples[k]) == 4 and len(clocks[k]) == 4 for k in fns)
    assert (before is None) == (cooldown == 0) and (before is None or all(len(before[k]) == 4 for k in fns))
    timed = [c for c in calls if c != "barrier"][6:]  # after the sizing bursts (3 replays each)
    assert timed == ["a", "a", "b", "b", "b", "b", "a", "a"] * 2  # rotated order, 2 replays each
    assert calls[-1] == "barrier"  # remote visibility once after the replays (Section 5.1)


def test_variant_fns_on_a_cpu_loopback_world():
    from fa4_a2a.reference import head_to_seq_shards
    from xstage.world import make_world

    P, M, Hl, D = 4, 64, 2, 64
    world = make_world("loopback", P, device="cpu")
    dest = world.alloc((1, M // P, Hl * P, D), torch.bfloat16)
    dest.fill_(float("nan"))
    q = torch.randn(1, M, Hl, D).to(torch.bfloat16)
    fns = bench.variant_fns(world, 1, q, q, q, q.clone(), dest, dest.peer_table(1), P)
    assert set(fns) == set(bench.VARIANTS)
    fns["a2a_only"]()  # rank 1's torch-copy A2A: its head slice in every destination
    want = head_to_seq_shards([torch.zeros_like(q)] + [q] + [torch.zeros_like(q)] * (P - 2))
    for j in range(P):
        assert torch.equal(dest.local(j)[:, :, Hl:2 * Hl], want[j][:, :, Hl:2 * Hl])
        assert torch.isnan(dest.local(j)[:, :, :Hl].float()).all()


def test_script_is_a_thin_cli():
    """scripts/bench_fa_a2a.py runs lab.fa4_a2a.bench.main with nothing but the repository on the path."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, str(root / "scripts" / "bench_fa_a2a.py"), "--help"], capture_output=True,
                       text=True, timeout=300, env=env, cwd=root)
    assert r.returncode == 0 and "--stabilize" in r.stdout and "fused_pers_dq" in r.stdout, r.stderr[-2000:]
