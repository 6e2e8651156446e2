"""lab.bench on the CPU: the paired trial loop with fake timed calls, the clock-matched
verdicts against a baseline and their table on synthetic samples, result files, progress."""
import csv
import json
import random

import pytest
import torch
from test_paired import _dvfs_row  # synthetic DVFS-affected row (pytest puts tests/ on sys.path)

from lab import bench


def _bimodal_baseline(n=21, seed=1):
    """The baseline alternates between a fast (4.6 ms) and a slow (5.3 ms) mode, the variant sits
    at 5.2 ms: separately taken medians can land either side, the paired view cannot."""
    rnd = random.Random(seed)
    base = [(4600.0 if i % 3 else 5300.0) + rnd.gauss(0, 10) for i in range(n)]
    fused = [5200.0 + rnd.gauss(0, 5) for _ in range(n)]
    return {"base": base, "fused": fused}, {"base": [1980] * n, "fused": [1980] * n}


def test_verdicts_of_a_variant_slower_than_the_fast_mode():
    samples, clocks = _bimodal_baseline()
    row = bench.paired_verdicts(samples, clocks, "base", 30.0)
    assert set(row) == set(bench.VERDICT_KEYS) and row["samples_us"] is samples
    v = row["variants"]["fused"]
    assert "base" not in row["variants"] and v["n_matched"] == 21
    assert v["median_ratio"] == pytest.approx(5200 / 4600, rel=0.01)
    assert v["frac_not_slower"] == pytest.approx(7 / 21)
    assert v["slower"]["verdict"] == "fail" and v["faster"]["verdict"] == "fail"  # 14 of 21: not significant
    assert v["no_slower"] is False


def test_verdicts_drop_the_trials_off_the_reference_clock():
    samples, clocks = _dvfs_row()  # fused 20 us faster at 1635 MHz; serial boosted in 7 trials
    row = bench.paired_verdicts(samples, clocks, "serial", 30.0)
    v = row["variants"]["fused"]
    assert row["reference_clock_mhz"] == 1635 and v["n_matched"] == 14
    assert v["faster"]["verdict"] == "pass" and v["slower"]["verdict"] == "fail"
    assert v["no_slower"] and v["frac_not_slower"] == 1.0
    assert v["baseline_median_us"] - v["median_us"] == pytest.approx(20, abs=8)
    none = bench.paired_verdicts(samples, {"serial": [1700] * 21, "fused": [1600] * 21}, "serial", 30.0)
    assert none["variants"]["fused"]["n_matched"] == 0 and "median_ratio" not in none["variants"]["fused"]
    assert none["variants"]["fused"]["faster"]["verdict"] == "inconclusive"


def test_print_paired_and_table(capsys):
    samples, clocks = _bimodal_baseline()
    case = dict(shape="s", routing="balanced", world="loopback", P=1, tokens_per_rank=8)
    row = dict(case, **bench.paired_verdicts(samples, clocks, "base", 30.0))
    bench.print_paired(row)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("paired (shape=s, routing=balanced, world=loopback, P=1, tokens_per_rank=8; "
                             "reference clock 1980.0 MHz, +-30.0 MHz): variant / base")
    assert out[1].split()[0] == "fused" and "faster: fail" in out[1]
    bench.print_paired(dict(row, variants={"x": {"n_matched": 0}}), label="P=1")
    assert capsys.readouterr().out.splitlines() == [
        "paired (P=1; reference clock 1980.0 MHz, +-30.0 MHz): variant / base",
        f"  {'x':40s} no trial at the reference clock"]
    (flat,) = bench.paired_table([row])
    assert list(flat) == ["shape", "routing", "world", "P", "tokens_per_rank", "variant", "baseline",
                          "reference_clock_mhz", "n_matched", "median_us", "baseline_median_us", "median_ratio",
                          "frac_not_slower", "no_slower", "faster", "slower"]
    assert flat["variant"] == "fused" and flat["slower"] == "fail" and flat["no_slower"] is False


def test_paired_trials_rotates_and_reads_clocks(monkeypatch):
    calls, clock = [], iter(range(1000))
    monkeypatch.setattr(bench.paired, "sm_clock_mhz", lambda: 1980 + next(clock))
    fns = {k: (lambda k=k: calls.append(k) or 1.0) for k in ("g", "a", "b")}
    samples, clocks = bench.paired_trials(fns, 3)
    assert calls == ["g", "a", "b", "a", "b", "g", "b", "g", "a"]
    assert samples == {k: [1.0] * 3 for k in fns}
    assert clocks["g"] == [1980, 1985, 1987]  # read right after each of its calls


def test_paired_trials_cooldown_barriers_and_clock_before(monkeypatch):
    calls = []
    monkeypatch.setattr(bench.paired, "sm_clock_mhz", lambda: 1500)
    monkeypatch.setattr(bench.time, "sleep", lambda s: calls.append(f"sleep {s}"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("sync"))
    before = {"a": [], "b": []}
    fns = {k: (lambda k=k: calls.append(k) or 2.0) for k in ("a", "b")}
    samples, clocks = bench.paired_trials(fns, 2, 0.25, barrier=lambda: calls.append("|"), clocks_before=before)
    one = ["sync", "|", "sleep 0.25", "|"]
    assert calls == one + ["a", "|"] + one + ["b", "|"] + one + ["b", "|"] + one + ["a", "|"]
    assert before == {"a": [1500] * 2, "b": [1500] * 2} and clocks == before


class _FakeEvent:
    """torch.cuda.Event stand-in: 'device time' = how many calls ran since it was recorded."""
    ticks = 0

    def __init__(self, enable_timing=True):
        self.t = None

    def record(self):
        self.t = _FakeEvent.ticks

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e-3  # ms: one call = 1 us


def test_event_timed_warms_up_then_times_per_call(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    calls = []

    def step():  # 3 us of "device time" per call
        calls.append(1)
        _FakeEvent.ticks += 3

    timed = bench.event_timed(step, calls=4, warmup=2)
    assert len(calls) == 2  # the warm-up
    assert timed() == pytest.approx(3.0) and len(calls) == 6
    assert bench.event_timed(step, warmup=0)() == pytest.approx(3.0) and len(calls) == 7


def test_replays_for():
    assert bench.replays_for(16000.0, 2000.0, 1, 4) == 1  # long call: one replay, short trial
    assert bench.replays_for(300.0, 2000.0, 1, 4) == 4
    assert bench.replays_for(300.0, 3000.0, 3, 20) == 10
    assert bench.replays_for(0.0, 3000.0, 3, 20) == 20  # no estimate: 1 us floor


def test_result_files(tmp_path):
    assert bench.write_csv(tmp_path / "none.csv", []) is None and not (tmp_path / "none.csv").exists()
    path = bench.write_csv(tmp_path / "sub" / "rows.csv", [{"a": 1, "b": 2}, {"a": 3, "c": 4}])
    assert list(csv.reader(path.open())) == [["a", "b", "c"], ["1", "2", ""], ["3", "", "4"]]
    j = bench.write_result(tmp_path / "out", "stem", {"rows": [1]}, [{"x": 1}])
    d = json.loads(j.read_text())
    assert j.name == "stem.json" and d["rows"] == [1] and "commit" in d["provenance"]
    assert (tmp_path / "out" / "stem.csv").read_text().splitlines() == ["x", "1"]
    bench.write_result(tmp_path / "out", "nocsv", {})
    assert not (tmp_path / "out" / "nocsv.csv").exists()


def test_progress_and_log(capsys):
    assert list(bench.progress(range(3), desc="x")) == [0, 1, 2]  # stderr is not a terminal here: no bar
    assert capsys.readouterr().err == ""
    assert list(bench.progress(range(2), desc="sweep", enabled=True)) == [0, 1]
    assert "sweep" in capsys.readouterr().err
    bench.log("row 1")
    assert capsys.readouterr().out == "row 1\n"
