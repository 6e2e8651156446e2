"""lab.paired: rotation, sign test, clock matching and the paired acceptance verdict."""
import random

import pytest

from lab import paired


def test_rotation():
    names = ["a", "b", "c"]
    orders = [paired.rotated(names, t) for t in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert [o[0] for o in orders] == names  # every variant leads once per cycle


def test_sign_test():
    assert paired.sign_test_p(10, 10) == pytest.approx(1 / 1024)
    assert paired.sign_test_p(0, 10) == 1.0
    assert paired.sign_test_p(5, 10) == pytest.approx(sum(__import__("math").comb(10, i) for i in range(5, 11)) / 1024)
    assert paired.sign_test_p(0, 0) == 1.0


def _dvfs_row(n=21, seed=0):
    """Fused truly 20 us faster than serial at a fixed clock, but in 6 trials serial ran at a
    higher clock (DVFS) and measured 200 us faster than fused."""
    rnd = random.Random(seed)
    serial, fused, c_s, c_f = [], [], [], []
    for i in range(n):
        base = 16000 + rnd.gauss(0, 30)
        if i % 7 in (0, 3) or i == 20:  # serial boosted
            serial.append(base - 200 + 20)
            c_s.append(1755)
        else:
            serial.append(base + 20)
            c_s.append(1635)
        fused.append(base + rnd.gauss(0, 2))
        c_f.append(1635)
    return {"serial": serial, "fused": fused}, {"serial": c_s, "fused": c_f}


def test_matched_clock_acceptance_removes_dvfs_trials():
    samples, clocks = _dvfs_row()
    assert paired.reference_clock(clocks) == 1635
    idx = paired.matched_trials(clocks, ["serial", "fused"], 30.0)
    assert len(idx) == 21 - 7 and all(clocks["serial"][i] == 1635 for i in idx)
    a = paired.acceptance(samples, clocks, "serial", "fused", 30.0, 5)
    assert a["verdict"] == "pass" and a["n_matched"] == 14 and a["clock_matched"]
    assert a["median_diff_us"] == pytest.approx(20, abs=8) and a["sign_test_p"] < 1e-3
    # Without clock readings every trial counts: the boosted trials still dominate nothing here,
    # but with a tolerance of 0 MHz around an unmatched reference no trial survives.
    loose = paired.acceptance(samples, {k: [None] * 21 for k in clocks}, "serial", "fused", 30.0, 5)
    assert loose["n_matched"] == 21 and not loose["clock_matched"]
    tight = paired.acceptance(samples, {"serial": [1700] * 21, "fused": [1600] * 21}, "serial", "fused", 30.0, 5)
    assert tight["verdict"] == "inconclusive" and tight["n_matched"] == 0


def test_acceptance_fails_when_fused_is_slower_or_indistinguishable():
    clocks = {"serial": [1635] * 21, "fused": [1635] * 21}
    slower = {"serial": [100.0 + i for i in range(21)], "fused": [105.0 + i for i in range(21)]}
    assert paired.acceptance(slower, clocks, "serial", "fused", 30.0, 5)["verdict"] == "fail"
    coin = {"serial": [100.0 + (1 if i % 2 else -1) for i in range(21)], "fused": [100.0] * 21}
    a = paired.acceptance(coin, clocks, "serial", "fused", 30.0, 5)
    assert a["verdict"] == "fail" and a["sign_test_p"] > 0.05
