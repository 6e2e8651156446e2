"""Burst-Gap closed forms: the paper's own numbers, and agreement with the simulator."""
import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from xstage import model, profiles
from xstage.simulate import simulate, steady_state_index

MiB = 2**20
KB = 1024
US = 1e-6


@pytest.fixture(scope="module")
def paper():
    return profiles.load("paper-b200-nvlink")


# --- the paper's numbers (Sections 3.5, 4.3) --------------------------------

def test_fa4_worst_aligned_burst(paper):
    v = model.fa_burst_volume(148, 128, 128, 2)
    assert v == 148 * 32 * KB
    assert v / MiB == pytest.approx(4.6, abs=0.05)
    t0 = paper.t_iss0_at(148, v)
    excess = model.peak_outstanding(v, paper.R, t0)
    assert excess / MiB == pytest.approx(4.1, abs=0.05)
    assert excess < paper.q_at(148)
    g_star = model.recovery_gap(v, paper.R, t0)
    assert g_star / US == pytest.approx(6.0, abs=0.05)
    m_ub = model.m_star_ub(v, paper.R, t0, paper.sigma, 128)
    assert m_ub == pytest.approx(1000, rel=0.05)  # "~1.0K tokens"


def test_isolated_knee_reproduces_capacity(paper):
    # knee at ~33 KB per producer, K = 148 -> V ~= 4.77 MiB; eq. 6 gives Q ~= 4.25 MiB
    v_knee = 148 * 33 * KB
    assert v_knee / MiB == pytest.approx(4.77, abs=0.01)
    q = model.capacity_from_knee(v_knee, paper.R, 0.76 * US)
    assert q / MiB == pytest.approx(4.25, abs=0.03)
    # eq. 7 is continuous at the knee: issue time there is the floor
    assert model.isolated_issue_time(v_knee, paper.R, 0.76 * US, q) == pytest.approx(0.76 * US)
    # and rises on the drain-limited branch beyond it
    assert model.isolated_issue_time(2 * v_knee, paper.R, 0.76 * US, q) > 5 * US


def test_fa_qloop_gap_at_8k_far_above_gstar(paper):
    # Section 4.3: at M = 8192 the Q-loop lower bound is far above G*
    g = model.qloop_gap(8192, 128, paper.sigma)
    v = model.fa_burst_volume(148, 128, 128, 2)
    assert g > 5 * model.recovery_gap(v, paper.R, paper.t_iss0_at(148, v))
    assert model.drain_stall(v, paper.R, paper.t_iss0_at(148, v), g) == 0.0


def test_design_test_reports_failing_bound():
    r = 1e9
    dt = model.design_test(volume=10e3, gap=1e-6, rate=r, t_iss0=1e-6, capacity=1e3)
    assert not dt.rate_ok and not dt.capacity_ok
    assert dt.rate_ratio == pytest.approx(5.0)
    assert dt.capacity_ratio == pytest.approx(9.0)  # (10e3 - 1e9*1e-6) / 1e3
    assert len(dt.failing) == 2 and "rate bound" in dt.failing[0]
    ok = model.design_test(volume=1e3, gap=1e-6, rate=r, t_iss0=1e-6, capacity=1e3)
    assert ok.ok and ok.failing == []


def test_megamoe_equations():
    n1, n2 = model.tile_mix(4096, 2048, 128)
    assert (n1, n2) == (32, 32)
    g_int = model.interleaved_gap(4e-6, 8e-6, n1, n2)
    assert g_int == pytest.approx(12e-6)
    v, r, t0 = 4e6, 1e12, 1e-6
    wave = model.wave_overhead(v, r, t0, 2e-6)  # V/R = 4 us, gap 2 us -> 1 us
    assert wave == pytest.approx(1e-6)
    assert model.interleaved_overhead(v, r, t0, 2e-6, 0.4e-6, 1, 1) == pytest.approx(0.6e-6)
    assert model.interleaved_overhead(v, r, t0, 2e-6, 5e-6, 1, 1) == 0.0
    ok, ratio = model.interleave_sufficient(v, r, t0, 2e-6, 5e-6, 1, 1)
    assert ok and ratio == pytest.approx(4e6 / 8e-6 / 1e12)
    assert not model.interleave_sufficient(v, r, t0, 2e-6, 0.4e-6, 1, 1)[0]
    assert model.critical_path_stall(5e-6, 3e-6) == pytest.approx(2e-6)
    assert model.critical_path_stall(2e-6, 3e-6) == 0.0
    assert model.d_knee(128, 132, 2048) == pytest.approx(128 * 132 / 4096)


def test_fa_counterfactual_and_residual():
    assert model.completion_coupled_exposure(1e6, 1e12, 2e-6, 0.5e-6) == pytest.approx(2.5e-6)
    # 3 waves, each stalled 1 us beyond G_QK
    assert model.drain_residual(3, 4e6, 1e12, 1e-6, 1e-6, 1e-6) == pytest.approx(3e-6)
    assert model.critical_drain_stall(4e6, 1e12, 1e-6, 1e-6, 5e-6) == 0.0


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_negative_or_nonfinite_sizes_rejected(bad):
    with pytest.raises(ValueError):
        model.issue_time(bad, 1e6, 1e9, 1e-6)
    with pytest.raises(ValueError):
        model.recovery_gap(bad, 1e9, 1e-6)
    with pytest.raises(ValueError):
        model.peak_outstanding(1e6, bad, 1e-6)
    with pytest.raises(ValueError):
        model.design_test(1e6, 1e-6, 1e9, 1e-6, bad)


def test_bad_integer_shapes_rejected():
    with pytest.raises(ValueError):
        model.fa_burst_volume(0, 128, 128, 2)
    with pytest.raises(ValueError):
        model.tile_mix(4000, 2048, 128)  # hidden not a multiple of block_n
    with pytest.raises(ValueError):
        model.d_knee(128, -1, 2048)


def test_tables_interpolate_and_clamp():
    t = model.IssueTimeTable(ks=(66.0, 132.0), volumes=(1e6, 3e6), seconds=((1e-6, 3e-6), (2e-6, 4e-6)))
    assert t(66, 2e6) == pytest.approx(2e-6)
    assert t(99, 1e6) == pytest.approx(1.5e-6)
    assert t(500, 10e6) == pytest.approx(4e-6)  # clamped, no extrapolation
    q = model.CapacityTable(ks=(32.0, 132.0), capacities=(1e6, 2e6))
    assert q(82) == pytest.approx(1.5e6) and q(1) == 1e6
    with pytest.raises(ValueError):
        model.CapacityTable(ks=(132.0, 32.0), capacities=(1e6, 2e6))


# --- simulator vs closed forms ------------------------------------------------

params = st.fixed_dictionaries({
    "t0": st.floats(0.2e-6, 5e-6),
    "R": st.floats(50e9, 2000e9),
    "V": st.floats(64e3, 16e6),
    "G": st.floats(0.0, 40e-6),
    "Qf": st.floats(0.05, 2.0),  # Q relative to V
})


@settings(max_examples=200, deadline=None)
@given(params)
def test_steady_state_matches_closed_forms(p):
    t0, r, v, g = p["t0"], p["R"], p["V"], p["G"]
    q = p["Qf"] * v
    excess = v - r * (t0 + g)  # bytes accumulated per period before saturation
    # bursts needed to fill the queue; skip cases that converge too slowly
    n_fill = 0 if excess <= 0 else math.ceil(q / excess)
    assume(n_fill < 4000)
    assume(abs(excess) > 1e-3 * v)  # not right at the boundary
    n = n_fill + 20
    res = simulate(t0, r, q, v, g, n=n)
    assert res.issue_time[-1] == pytest.approx(model.steady_issue_time(g, v, r, t0, q), rel=1e-9)
    if model.peak_outstanding(v, r, t0) <= q:  # eq. 10's capacity bound: eq. 1-3 apply as stated
        assert res.issue_time[-1] == pytest.approx(model.issue_time(g, v, r, t0), rel=1e-9)
        assert res.period[-2] == pytest.approx(model.period(g, v, r, t0), rel=1e-9)
    assert steady_state_index(res.issue_time, rel_tol=1e-9) is not None


@settings(max_examples=200, deadline=None)
@given(params)
def test_isolated_burst_matches_eq7(p):
    t0, r, v = p["t0"], p["R"], p["V"]
    q = p["Qf"] * v
    res = simulate(t0, r, q, [v], [0.0])
    assert res.issue_time[0] == pytest.approx(model.isolated_issue_time(v, r, t0, q), rel=1e-9)
    assert res.throttled[0] == (model.peak_outstanding(v, r, t0) > q)


def test_transient_length_reported():
    # injection 10% above drain, big capacity: many bursts before steady state
    r, t0, v = 1e12, 1e-6, 2.2e6  # V/R = 2.2 us
    g = 1.0e-6  # T0 + G = 2 us -> 0.2 MB accumulates per period
    q = 4e6
    res = simulate(t0, r, q, v, g, n=60)
    k = steady_state_index(res.issue_time, rel_tol=1e-9)
    # q grows 0.2 MB per period and first saturates once q_start + (V - R*T0) >= Q:
    # (4.0 - 1.2) MB / 0.2 MB = 14 bursts of transient
    assert k is not None and 14 <= k <= 16
    assert res.issue_time[0] == pytest.approx(t0)
    assert res.issue_time[-1] == pytest.approx(v / r - g)
    # too short a run: the issue times look settled at T_iss0 while X-Stage is
    # still filling -- only the outstanding volume shows the transient
    short = simulate(t0, r, q, v, g, n=10)
    assert steady_state_index(short.issue_time, rel_tol=1e-9) == 0
    assert steady_state_index(short.q_end, rel_tol=1e-9) is None


@pytest.mark.parametrize("q", [3.6e6, 3.0e6])
def test_gap_sweep_matches_max_law(q):
    r, t0, v = 700e9, 0.8e-6, 4e6  # V - R*T0 = 3.44 MB: capacity bound holds for 3.6 MB only
    for g in np.linspace(0, 10e-6, 11):
        res = simulate(t0, r, q, v, g, n=400)
        expect = model.steady_issue_time(g, v, r, t0, q) + g
        assert res.period[-2] == pytest.approx(expect, rel=1e-9)
        if q > model.peak_outstanding(v, r, t0):
            assert res.period[-2] == pytest.approx(max(t0 + g, v / r), rel=1e-9)  # eq. 2


def test_simulator_input_validation():
    with pytest.raises(ValueError):
        simulate(1e-6, -1.0, 1e6, [1e6], [0.0])
    with pytest.raises(ValueError):
        simulate(1e-6, 1e9, 1e6, [1e6, 2e6], [0.0])
    with pytest.raises(ValueError):
        simulate(1e-6, 1e9, 1e6, [-1e6], [0.0])
    with pytest.raises(ValueError):
        simulate(1e-6, 1e9, 1e6, 1e6, 0.0)  # scalars without n


def test_kernel_rate_bounds_compute_bound_and_drain_bound():
    from xstage.model import kernel_rate_bounds

    # no Combine to speak of: both schedules are their compute
    assert kernel_rate_bounds(2.0, 1.0, 1.0, 1e9) == pytest.approx((3.0, 3.0))
    # drain-bound (V/R = 5): interleaved drains the whole time, expert-wave only in its L2 waves
    assert kernel_rate_bounds(2.0, 1.0, 5e9, 1e9) == pytest.approx((5.0, 7.0))
    # in between (V/R = 2.5): interleaved hides it all, expert-wave not
    assert kernel_rate_bounds(2.0, 1.0, 2.5e9, 1e9) == pytest.approx((3.0, 4.5))
    with pytest.raises(ValueError):
        kernel_rate_bounds(1.0, 1.0, 1.0, 0.0)


def test_schedule_auto_follows_the_drain_bound_and_the_locality_ratio():
    """No remote path: the locality ratio alone decides; on the PCIe profile eq. 11 over the kernel
    (interleaved x the ratio against expert_wave), so only a ratio above the bound's gap flips it."""
    from xstage import planner, profiles

    dims = dict(hidden=4096, intermediate=2048, experts=256, topk=6, tokens=4096, world=8)
    assert planner.choose_megamoe_schedule(None, **dims).schedule == "interleaved"
    assert planner.choose_megamoe_schedule(None, locality_ratio=1.05, **dims).schedule == "expert_wave"
    pcie = profiles.load("h200-pcie-host")
    c = planner.choose_megamoe_schedule(pcie, **dims)
    plan = planner.plan_megamoe(pcie, block_n=256, **dims)
    assert c.schedule == "interleaved" and c.platform == "h200-pcie-host"
    assert c.predicted_interleaved_s == pytest.approx(plan.kernel_interleaved_s * planner.INTERLEAVED_LOCALITY_RATIO)
    assert c.predicted_wave_s == pytest.approx(plan.kernel_wave_s)
    flip = 1.01 * plan.kernel_wave_s / plan.kernel_interleaved_s
    assert planner.choose_megamoe_schedule(pcie, locality_ratio=flip, **dims).schedule == "expert_wave"
    with pytest.raises(ValueError):
        planner.choose_megamoe_schedule(pcie, locality_ratio=0.0, **dims)


def test_expert_wave_absorbs_is_eq10_capacity_bound_per_wave():
    from xstage.model import expert_wave_absorbs

    # 10 GB drained at 1 GB/s during 8 s of L2 leaves 2 GB, against 4 waves x 0.5 GB: just absorbed
    assert expert_wave_absorbs(10e9, 1e9, 8.0, 4, 0.5e9) == (True, pytest.approx(2e9))
    assert expert_wave_absorbs(10e9, 1e9, 8.0, 3, 0.5e9) == (False, pytest.approx(2e9))
    assert expert_wave_absorbs(1e9, 1e9, 8.0, 1, 0.0) == (True, 0.0)  # the L2 phase drains it all
    for bad in (dict(waves=0), dict(waves=1.5), dict(capacity=-1.0), dict(rate=0.0)):
        args = dict(dict(volume=1e9, rate=1e9, t_l2=1.0, waves=2, capacity=1e6), **bad)
        with pytest.raises(ValueError):
            expert_wave_absorbs(**args)


def test_schedule_auto_picks_expert_wave_where_its_waves_absorb_the_combine():
    """DeepSeek-V4-Pro at 2048 tokens, P = 1 over PCIe: 32 rows per expert pad to one 128-row
    block, so T_L2 nearly covers the drain and the backlog fits 4 waves x Q: expert_wave. The
    same layer under a skewed call (fewer padded blocks) does not fit: interleaved. The call's
    rows decide, the balanced default equals rows of 32 per expert."""
    from xstage import planner, profiles

    pcie = profiles.load("h200-pcie-host")
    dims = dict(hidden=7168, intermediate=3072, experts=384, topk=6, tokens=2048, world=1, block_n=256, waves=4)
    c = planner.choose_megamoe_schedule(pcie, **dims)
    assert c.schedule == "expert_wave" and "no backpressure" in c.reason
    assert c.wave_backlog_bytes <= c.wave_capacity_bytes == pytest.approx(4 * pcie.q_at(pcie.num_sms))
    balanced = planner.choose_megamoe_schedule(pcie, expert_rows=[[32] * 384], **dims)
    assert balanced.schedule == "expert_wave" and balanced.wave_backlog_bytes == pytest.approx(c.wave_backlog_bytes)
    skewed = [[128] * 96 + [0] * 288]  # the same 12288 rows on a quarter of the experts: 96 blocks
    s = planner.choose_megamoe_schedule(pcie, expert_rows=skewed, **dims)
    assert s.schedule == "interleaved" and s.wave_backlog_bytes > s.wave_capacity_bytes
    assert planner.choose_megamoe_schedule(pcie, **dict(dims, waves=1)).schedule == "interleaved"
    assert planner.choose_megamoe_schedule(None, expert_rows=skewed, **dims).schedule == "interleaved"
    for bad in ([[32] * 383], [], [[32.0] * 384], [[-1] + [32] * 383]):
        with pytest.raises(ValueError, match="expert_rows"):
            planner.choose_megamoe_schedule(pcie, expert_rows=bad, **dims)
