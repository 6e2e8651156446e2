"""CPU tests of the calibration analysis and fit on synthetic data from xstage.simulate.

Ground truth (T_iss0(V), R, Q) is chosen, bursts are simulated with the
fluid model, measurement noise is added, and the same summarize/fit path as
for GPU data must recover the parameters within 5 %.
"""
import json

import numpy as np
import pytest

from calibration import analysis, fit
from xstage.simulate import simulate

R_TRUE = 25e9  # bytes/s (PCIe-like)
Q_TRUE = 3 * 2**20  # bytes
A_TRUE, U_TRUE = 2e-6, 400e9  # T_iss0 = A + V/U


def t0_true(V):
    return A_TRUE + V / U_TRUE


BARRIER = 1e-6  # per-burst alignment overhead seen as part of the gap


def _series(sim, rng, noise=0.01, jitter=20e-9):
    n = sim.n
    issue = sim.issue_time * (1.0 + noise * rng.standard_normal(n))
    start = sim.start + jitter * rng.standard_normal(n)
    start[0] = 0.0
    return analysis.BurstSeries(start=start, end=start + issue, issue=issue, issue_span=issue)


def _synthetic_points(seed=1, noise=0.01):
    rng = np.random.default_rng(seed)
    pts = []
    for K in (33, 66, 132):
        for B in (16384, 65536, 262144):
            V = K * B
            sim = simulate(t0_true, R_TRUE, Q_TRUE, V, BARRIER, n=200)
            s = analysis.summarize(_series(sim, rng, noise))
            pts.append({"experiment": "zero_gap", "gap_mode": "spin", "K": K, "B": B, "V": V, **s.as_dict()})
    for K in (66, 132):
        for e in range(11, 20):
            B = 2**e
            V = K * B
            gap = 3 * V / R_TRUE + 10e-6
            sim = simulate(t0_true, R_TRUE, Q_TRUE, V, gap, n=8)
            s = analysis.summarize_isolated(_series(sim, rng, noise))
            pts.append({"experiment": "isolated", "gap_mode": "spin", "K": K, "B": B, "V": V, **s})
    K = 132
    for B in (16384, 65536, 262144):
        V = K * B
        gstar = V / R_TRUE - t0_true(V)
        for f in (0.0, 0.25, 0.5, 0.7, 0.85, 1.0, 1.2, 1.5, 2.0):
            G = f * gstar + BARRIER
            sim = simulate(t0_true, R_TRUE, Q_TRUE, V, G, n=300)
            s = analysis.summarize(_series(sim, rng, noise))
            pts.append({"experiment": "gap_sweep", "gap_mode": "spin", "K": K, "B": B, "V": V,
                        "gap_ns": int(G * 1e9), **s.as_dict()})
    return pts


@pytest.fixture(scope="module")
def synthetic_fit():
    pts = _synthetic_points()
    return pts, fit.fit_points(pts, target="synthetic")


def test_recovers_R(synthetic_fit):
    _, tf = synthetic_fit
    assert tf.drain.R == pytest.approx(R_TRUE, rel=0.05)
    assert tf.drain.R_err < 0.05 * R_TRUE


def test_recovers_Q_and_floor(synthetic_fit):
    _, tf = synthetic_fit
    for K in (66, 132):
        f = tf.isolated[K]
        assert f.knee_found, f
        assert f.Q == pytest.approx(Q_TRUE, rel=0.05)
        for V in (K * 16384, K * 65536):
            assert f.t_iss0(V) == pytest.approx(t0_true(V), rel=0.05)


def test_recovers_t_iss0_plateau(synthetic_fit):
    _, tf = synthetic_fit
    for (K, B), t0 in tf.plateau.items():
        V = K * B
        expect = max(t0_true(V), (V - Q_TRUE) / R_TRUE)
        assert t0 == pytest.approx(expect, rel=0.05)


def test_predicts_gap_sweeps(synthetic_fit):
    _, tf = synthetic_fit
    summ = tf.summary()["validation"]["spin"]
    assert summ["T_iss"]["n"] == 27
    assert summ["n_filling_or_unsettled"] == 0
    assert summ["T_iss"]["median_abs_rel"] < 0.05
    assert summ["T_period"]["median_abs_rel"] < 0.05
    json.dumps(fit._jsonable(tf.summary()))


def test_wrong_model_is_detected():
    """A completion-coupled world (T_period = G + V/R) must fail the max-law prediction."""
    rng = np.random.default_rng(3)
    pts = _synthetic_points(seed=3)
    bad = []
    for p in pts:
        if p["experiment"] == "gap_sweep":
            q = dict(p)
            q["T_period"] = p["G_eff"] + p["V"] / R_TRUE
            q["T_iss"] = q["T_period"] - p["G_eff"]
            bad.append(q)
        else:
            bad.append(p)
    tf = fit.fit_points(bad, target="synthetic")
    assert tf.summary()["validation"]["spin"]["T_period"]["max_abs_rel"] > 0.3
    del rng


def test_drain_fit_excludes_issue_limited_points():
    V = np.array([1e6, 2e6, 4e6, 8e6, 16e6, 1e5])
    T = V / 20e9
    T[-1] = 50e-6  # issue-limited: far slower than V/R
    d = fit.fit_drain_rate(V, T)
    assert d.R == pytest.approx(20e9, rel=1e-6)
    assert not d.used[-1] and d.used[:-1].all()


def test_isolated_without_knee_gives_lower_bound():
    V = np.array([1e5, 2e5, 4e5, 8e5])
    T = 1e-6 + V / 500e9
    f = fit.fit_isolated(V, T, 25e9, K=132, n_boot=20)
    assert not f.knee_found
    assert f.Q == pytest.approx(np.max(V - 25e9 * T), rel=1e-6)


def test_bad_inputs_raise():
    with pytest.raises(ValueError):
        fit.fit_drain_rate([1.0], [1.0])
    with pytest.raises(ValueError):
        fit.fit_drain_rate([1.0, -2.0], [1.0, 1.0])
    with pytest.raises(ValueError):
        fit.fit_isolated([1.0, 2.0], [1.0, 1.0], R=0.0)


def test_transient_detected_on_long_fill():
    # Large Q, small deficit: the queue needs many bursts to fill.
    R, Q, V = 25e9, 64 * 2**20, 4 * 2**20
    G = 0.9 * (V / R - 10e-6)
    sim = simulate(10e-6, R, Q, V, G, n=400)
    s = analysis.summarize(analysis.BurstSeries(sim.start, sim.end, sim.issue_time, sim.issue_time))
    assert s.transient > 50
    assert s.steady
    assert s.T_iss == pytest.approx(V / R - G, rel=0.02)
    short = simulate(10e-6, R, Q, V, G, n=60)
    s2 = analysis.summarize(analysis.BurstSeries(short.start, short.end, short.issue_time, short.issue_time))
    # While the queue fills the issue time sits on its floor: the series looks
    # settled, but injection above the drain rate gives the transient away.
    assert s2.transient == 0
    assert fit.filling(V, s2.T_period, R)
    assert not fit.filling(V, s.T_period, R)


def test_bursts_from_timestamps_converts_clock():
    K, N, ghz = 4, 10, 1.98
    ts = np.zeros((K, N, 4), dtype=np.int64)
    rng = np.random.default_rng(0)
    for k in range(K):
        t = 1_000_000 + 37 * k
        for n in range(N):
            dur = 5_000 + 100 * k + int(rng.integers(0, 50))
            ts[k, n, 0], ts[k, n, 1] = t, t + dur
            ts[k, n, 2], ts[k, n, 3] = int(t * ghz), int((t + dur) * ghz)
            t += dur + 10_000
    s = analysis.bursts_from_timestamps(ts)
    assert s.clock_ghz == pytest.approx(ghz, rel=1e-3)
    expect = (ts[:, :, 1] - ts[:, :, 0]).max(axis=0) * 1e-9
    np.testing.assert_allclose(s.issue, expect, rtol=2e-3)
    assert s.start[0] == 0.0 and np.all(np.diff(s.start) > 0)
    bad = ts.copy()
    bad[0, 3, 1] = bad[0, 3, 0] - 1
    with pytest.raises(ValueError):
        analysis.bursts_from_timestamps(bad)


def test_transient_ignores_jitter_but_finds_a_step():
    rng = np.random.default_rng(5)
    flat = 1.0 + 0.15 * rng.standard_normal(300)  # 15 % burst-to-burst jitter, no transient
    assert analysis.transient_length(flat) < 30
    step = np.concatenate([np.full(120, 0.3), np.full(180, 1.0)]) * (1 + 0.1 * rng.standard_normal(300))
    n0 = analysis.transient_length(step)
    assert 110 <= n0 <= 135
