"""The X-Stage Burst–Gap model (paper Sections 3–4).

All quantities are SI: seconds, bytes, bytes per second. Helpers for the
usual display units live in :mod:`xstage.units`.

A *burst* is ``K`` concurrent producers each issuing ``B`` bytes of remote
stores (aggregate volume ``V = K·B``); the *gap* ``G`` that follows issues no
remote stores. The platform is described by three measurable quantities
(Section 3.6)::

    M_X = (T_iss0(K, V), R, Q(K))

* ``T_iss0`` – backpressure-free issue time of a recovered burst,
* ``R``      – effective aggregate drain rate,
* ``Q``      – effective outstanding capacity.

Equation numbers follow the paper. Its text extraction garbles several
equations; where that matters the docstring says how the form used here was
reconstructed (from the prose and the paper's own numbers, which the tests
reproduce).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence, Union

__all__ = [
    "IssueTimeTable",
    "CapacityTable",
    "Platform",
    "issue_time",
    "issue_overhead",
    "steady_issue_time",
    "period",
    "completion_coupled_period",
    "recovery_gap",
    "peak_outstanding",
    "isolated_issue_time",
    "capacity_from_knee",
    "DesignTest",
    "design_test",
    "tile_mix",
    "interleaved_gap",
    "wave_overhead",
    "interleaved_overhead",
    "interleave_sufficient",
    "critical_path_stall",
    "d_knee",
    "kernel_rate_bounds",
    "expert_wave_absorbs",
    "fa_burst_volume",
    "completion_coupled_exposure",
    "qloop_gap",
    "drain_stall",
    "critical_drain_stall",
    "drain_residual",
    "m_star_ub",
]


def _pos(x: float) -> float:
    """[x]+ = max(x, 0)."""
    return x if x > 0.0 else 0.0


def _check_nonneg(**values: float) -> None:
    for name, v in values.items():
        if not (isinstance(v, (int, float)) and math.isfinite(v)) or v < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")


def _check_pos(**values: float) -> None:
    for name, v in values.items():
        if not (isinstance(v, (int, float)) and math.isfinite(v)) or v <= 0:
            raise ValueError(f"{name} must be a finite number > 0, got {v!r}")


def _interp1(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear interpolation, clamped to the end values."""
    if x <= xs[0]:
        return float(ys[0])
    if x >= xs[-1]:
        return float(ys[-1])
    i = bisect.bisect_right(xs, x) - 1
    t = (x - xs[i]) / (xs[i + 1] - xs[i])
    return float(ys[i] + t * (ys[i + 1] - ys[i]))


def _check_axis(name: str, xs: Sequence[float]) -> None:
    if len(xs) == 0:
        raise ValueError(f"{name}: axis is empty")
    for a, b in zip(xs, xs[1:]):
        if not b > a:
            raise ValueError(f"{name}: axis must be strictly increasing, got {list(xs)}")


@dataclass(frozen=True)
class IssueTimeTable:
    """T_iss0(K, V) measured on a grid; bilinear interpolation, clamped.

    ``seconds[i][j]`` is the issue time for ``K = ks[i]`` and
    ``V = volumes[j]`` bytes. Outside the grid the nearest edge is used
    (no extrapolation: a calibration that did not cover a point should not
    pretend to know it).
    """

    ks: tuple[float, ...]
    volumes: tuple[float, ...]
    seconds: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        _check_axis("T_iss0 table K", self.ks)
        _check_axis("T_iss0 table V", self.volumes)
        if len(self.seconds) != len(self.ks) or any(len(r) != len(self.volumes) for r in self.seconds):
            raise ValueError(
                f"T_iss0 table has shape {[len(r) for r in self.seconds]}, "
                f"expected {len(self.ks)} rows of {len(self.volumes)}"
            )
        for row in self.seconds:
            for v in row:
                _check_pos(t_iss0=v)

    def __call__(self, k: float, v: float) -> float:
        rows = [_interp1(self.volumes, row, v) for row in self.seconds]
        return _interp1(self.ks, rows, k)


@dataclass(frozen=True)
class CapacityTable:
    """Q(K) at measured producer counts; linear interpolation, clamped."""

    ks: tuple[float, ...]
    capacities: tuple[float, ...]

    def __post_init__(self) -> None:
        _check_axis("Q table K", self.ks)
        if len(self.capacities) != len(self.ks):
            raise ValueError("Q table: K and capacity lists differ in length")
        for q in self.capacities:
            _check_pos(Q=q)

    def __call__(self, k: float) -> float:
        return _interp1(self.ks, self.capacities, k)


IssueTime = Union[float, IssueTimeTable]
Capacity = Union[float, CapacityTable]


@dataclass(frozen=True)
class Platform:
    """Platform parameters M_X = (T_iss0(K, V), R, Q(K)) plus context.

    Attributes:
        name: profile name (``paper-b200-nvlink``, ``h200-pcie-host``...).
        R: effective aggregate drain rate, bytes/s.
        t_iss0: backpressure-free issue time, seconds (a constant or a
            table over (K, V)).
        Q: effective outstanding capacity, bytes (a constant or a table
            over K).
        num_sms: SM count of the GPU (the paper's worst aligned case uses
            K = num_sms producers).
        sigma: FlashAttention Q-loop time per KV tile, seconds (Section 4.3),
            if known for this platform.
        dense_flops: dense matrix rate in FLOP/s used to estimate mainloop
            times when none are given, if known.
        source: ``"paper"`` (transcribed) or ``"measured"``.
        description, target, gpu: free text.
        provenance: where the numbers come from.
        uncertainty: optional one-sigma (or range) information per parameter.
    """

    name: str
    R: float
    t_iss0: IssueTime
    Q: Capacity
    num_sms: int
    sigma: float | None = None
    dense_flops: float | None = None
    source: str = "measured"
    description: str = ""
    target: str = ""
    gpu: str = ""
    provenance: Mapping = field(default_factory=dict)
    uncertainty: Mapping = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_pos(R=self.R)
        if not isinstance(self.t_iss0, IssueTimeTable):
            _check_pos(t_iss0=self.t_iss0)
        if not isinstance(self.Q, CapacityTable):
            _check_pos(Q=self.Q)
        if not isinstance(self.num_sms, int) or self.num_sms <= 0:
            raise ValueError(f"num_sms must be a positive integer, got {self.num_sms!r}")
        if self.sigma is not None:
            _check_pos(sigma=self.sigma)
        if self.dense_flops is not None:
            _check_pos(dense_flops=self.dense_flops)

    def t_iss0_at(self, k: float, v: float) -> float:
        """T_iss0(K, V) in seconds."""
        if isinstance(self.t_iss0, IssueTimeTable):
            return self.t_iss0(k, v)
        return float(self.t_iss0)

    def q_at(self, k: float) -> float:
        """Q(K) in bytes."""
        if isinstance(self.Q, CapacityTable):
            return self.Q(k)
        return float(self.Q)


# ---------------------------------------------------------------------------
# Section 3: periodic and isolated bursts
# ---------------------------------------------------------------------------

def issue_time(gap: float, volume: float, rate: float, t_iss0: float) -> float:
    """Steady-state sender-visible issue time, eq. (3) (= eq. 8).

    T_iss(G; K, V) = max(T_iss0, V/R - G).
    """
    _check_nonneg(gap=gap, volume=volume)
    _check_pos(rate=rate, t_iss0=t_iss0)
    return max(t_iss0, volume / rate - gap)


def steady_issue_time(gap: float, volume: float, rate: float, t_iss0: float, capacity: float) -> float:
    """Steady-state issue time without assuming the single-burst capacity bound.

    max(T_iss0, V/R - G, (V - Q)/R): eq. (3) combined with eq. (7). Eq. (3)
    assumes [V - R·T_iss0]+ <= Q (eq. 10's second bound); when one burst
    alone overfills X-Stage and the gap drains it fully (R·G >= Q), every
    burst behaves like an isolated one. Not in the paper; it is what the
    fluid simulator (:mod:`xstage.simulate`) converges to, and is equal to
    eq. (3) whenever the capacity bound holds.
    """
    _check_pos(capacity=capacity)
    return max(issue_time(gap, volume, rate, t_iss0), (volume - capacity) / rate)


def issue_overhead(gap: float, volume: float, rate: float, t_iss0: float) -> float:
    """Backpressure overhead, eq. (4) (= eq. 9).

    ΔT_iss = [V/R - G - T_iss0]+.
    """
    return issue_time(gap, volume, rate, t_iss0) - t_iss0


def period(gap: float, volume: float, rate: float, t_iss0: float) -> float:
    """Steady-state start-to-start period, eqs. (1)–(2): the max law.

    T_period = T_iss + G = max(T_iss0 + G, V/R): the drain-limited plateau
    V/R (eq. 1) at short gaps, the T_iss0 + G branch beyond G*.
    """
    return issue_time(gap, volume, rate, t_iss0) + gap


def completion_coupled_period(gap: float, volume: float, rate: float) -> float:
    """The completion-coupled counterfactual of Section 3.4: T^cc = G + V/R."""
    _check_nonneg(gap=gap, volume=volume)
    _check_pos(rate=rate)
    return gap + volume / rate


def recovery_gap(volume: float, rate: float, t_iss0: float) -> float:
    """Minimum recovery gap, eq. (5): G* = [V/R - T_iss0]+."""
    _check_nonneg(volume=volume)
    _check_pos(rate=rate, t_iss0=t_iss0)
    return _pos(volume / rate - t_iss0)


def peak_outstanding(volume: float, rate: float, t_iss0: float) -> float:
    """Peak outstanding volume of an isolated burst without a capacity limit, eq. (6).

    q_peak = [V - R·T_iss0]+: V bytes are injected while about R·T_iss0 drain.
    """
    _check_nonneg(volume=volume)
    _check_pos(rate=rate, t_iss0=t_iss0)
    return _pos(volume - rate * t_iss0)


def isolated_issue_time(volume: float, rate: float, t_iss0: float, capacity: float) -> float:
    """Issue time of one burst into an empty X-Stage, eq. (7).

    T_iss^iso = max(T_iss0, (V - Q)/R). The garbled text reads as a max of the
    baseline and the drain-limited branch; this is the form that is
    continuous at the knee q_peak = Q (where (V - Q)/R = T_iss0), which the
    paper's own numbers satisfy (see :func:`capacity_from_knee`).
    """
    _check_nonneg(volume=volume)
    _check_pos(rate=rate, t_iss0=t_iss0, capacity=capacity)
    return max(t_iss0, (volume - capacity) / rate)


def capacity_from_knee(knee_volume: float, rate: float, t_iss0: float) -> float:
    """Q from the isolated-burst knee through eq. (6): Q = V_knee - R·T_iss0.

    Paper check (Section 3.5): V_knee ≈ 4.77 MiB, R = 717 GB/s,
    T_iss0 ≈ 0.76 µs gives Q ≈ 4.25 MiB.
    """
    return peak_outstanding(knee_volume, rate, t_iss0)


@dataclass(frozen=True)
class DesignTest:
    """Result of the design test, eq. (10).

    ``rate_ratio`` is the long-term injection rate V/(T_iss0 + G) over R (the
    rate bound holds when it is <= 1); ``capacity_ratio`` is [V - R·T_iss0]+
    over Q (the single-burst bound holds when it is <= 1).
    """

    injection_rate: float
    rate: float
    peak_outstanding: float
    capacity: float

    @property
    def rate_ratio(self) -> float:
        return self.injection_rate / self.rate

    @property
    def capacity_ratio(self) -> float:
        return self.peak_outstanding / self.capacity

    @property
    def rate_ok(self) -> bool:
        return self.injection_rate <= self.rate

    @property
    def capacity_ok(self) -> bool:
        return self.peak_outstanding <= self.capacity

    @property
    def ok(self) -> bool:
        return self.rate_ok and self.capacity_ok

    @property
    def failing(self) -> list[str]:
        """Names of the failing bounds with how much they are exceeded."""
        out = []
        if not self.rate_ok:
            out.append(f"rate bound: injection {self.rate_ratio:.2f}x the drain rate")
        if not self.capacity_ok:
            out.append(f"capacity bound: peak outstanding {self.capacity_ratio:.2f}x the capacity")
        return out

    def as_dict(self) -> dict:
        return {
            "injection_rate_Bps": self.injection_rate,
            "rate_Bps": self.rate,
            "rate_ratio": self.rate_ratio,
            "rate_ok": self.rate_ok,
            "peak_outstanding_bytes": self.peak_outstanding,
            "capacity_bytes": self.capacity,
            "capacity_ratio": self.capacity_ratio,
            "capacity_ok": self.capacity_ok,
            "ok": self.ok,
            "failing": self.failing,
        }


def design_test(volume: float, gap: float, rate: float, t_iss0: float, capacity: float) -> DesignTest:
    """Design test, eq. (10): V/(T_iss0 + G) <= R and [V - R·T_iss0]+ <= Q."""
    _check_nonneg(volume=volume, gap=gap)
    _check_pos(rate=rate, t_iss0=t_iss0, capacity=capacity)
    return DesignTest(
        injection_rate=volume / (t_iss0 + gap),
        rate=rate,
        peak_outstanding=peak_outstanding(volume, rate, t_iss0),
        capacity=capacity,
    )


# ---------------------------------------------------------------------------
# Section 4.2: MegaMoE interleaving
# ---------------------------------------------------------------------------

def tile_mix(hidden: int, intermediate: int, block_n_l1: int, block_n_l2: int | None = None) -> tuple[int, int]:
    """Per-row tile counts (n1, n2) of Linear-1 and Linear-2.

    Linear-1 produces the interleaved gate/up projection (2·intermediate
    columns), Linear-2 the hidden dimension, so per row of tokens there are
    n1 = 2·I / b_n1 L1 tiles and n2 = h / b_n2 L2 tiles. Algorithm 1 keeps
    this ratio in the long run whatever the lead D (Section 4.2).
    """
    block_n_l2 = block_n_l1 if block_n_l2 is None else block_n_l2
    for name, v in (("hidden", hidden), ("intermediate", intermediate), ("block_n_l1", block_n_l1), ("block_n_l2", block_n_l2)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if (2 * intermediate) % block_n_l1:
        raise ValueError(f"2*intermediate={2 * intermediate} is not a multiple of block_n={block_n_l1}")
    if hidden % block_n_l2:
        raise ValueError(f"hidden={hidden} is not a multiple of block_n={block_n_l2}")
    return (2 * intermediate) // block_n_l1, hidden // block_n_l2


def interleaved_gap(t_l2_mma: float, t_l1_mma: float, n1: float, n2: float) -> float:
    """Average interleaved gap per Linear-2 burst, eq. (12).

    G_int ≈ T_L2^mma + (n1/n2)·T_L1^mma (the expert-wave gap is G_wave ≈ T_L2^mma).
    """
    _check_nonneg(t_l2_mma=t_l2_mma, t_l1_mma=t_l1_mma, n1=n1)
    _check_pos(n2=n2)
    return t_l2_mma + (n1 / n2) * t_l1_mma


def wave_overhead(volume: float, rate: float, t_iss0: float, t_l2_mma: float) -> float:
    """Expert-wave issue overhead: eq. (9) with G_wave ≈ T_L2^mma."""
    return issue_overhead(t_l2_mma, volume, rate, t_iss0)


def interleaved_overhead(volume: float, rate: float, t_iss0: float, t_l2_mma: float,
                         t_l1_mma: float, n1: float, n2: float) -> float:
    """Residual overhead after interleaving, eq. (13).

    ΔT_iss^int = [ΔT_iss^wave - (n1/n2)·T_L1^mma]+: useful computation
    offsets issue stall one-for-one until it reaches zero.
    """
    return _pos(wave_overhead(volume, rate, t_iss0, t_l2_mma) - (n1 / n2) * t_l1_mma)


def interleave_sufficient(volume: float, rate: float, t_iss0: float, t_l2_mma: float,
                          t_l1_mma: float, n1: float, n2: float) -> tuple[bool, float]:
    """Sufficiency test, eq. (14). Returns (holds, injection rate / R).

    Complete recovery needs G_int >= G*, i.e. per steady-state cycle of n2
    Linear-2 bursts and n1 Linear-1 tiles::

        n2·V / (n2·(T_iss0 + T_L2^mma) + n1·T_L1^mma) <= R.

    (The extraction shows ``n2 T_iss0 + T_L2 + n1 T_L1`` in the
    denominator; grouping n2 with T_L2 too is the form equivalent to
    G_int >= G* with eq. 12, which is how the prose defines it.)
    """
    _check_nonneg(volume=volume, t_l2_mma=t_l2_mma, t_l1_mma=t_l1_mma, n1=n1)
    _check_pos(rate=rate, t_iss0=t_iss0, n2=n2)
    inj = n2 * volume / (n2 * (t_iss0 + t_l2_mma) + n1 * t_l1_mma)
    return inj <= rate, inj / rate


def critical_path_stall(t_rs: float, t_cover_mma: float) -> float:
    """Per-tile critical-path stall, eq. (15): Δt = [T_RS - T_cover^mma]+.

    T_RS ≈ T_iss0 + ΔT_iss (plus fixed staging overhead) is the epilogue's
    sender-visible remote-store span; T_cover^mma the mainloop that local
    double-buffered staging lets the MMA role run meanwhile.
    """
    _check_nonneg(t_rs=t_rs, t_cover_mma=t_cover_mma)
    return _pos(t_rs - t_cover_mma)


def d_knee(block_n: int, k_sm: int, intermediate: int) -> float:
    """Anti-starvation lead of Algorithm 1, eq. (16): D_knee = b_n·K_SM / (2·h_inter).

    In scheduler rows. It comes from cross-SM data readiness (paired CTAs,
    strided streams over K_SM SMs), not from the X-Stage parameters.
    """
    for name, v in (("block_n", block_n), ("k_sm", k_sm), ("intermediate", intermediate)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return block_n * k_sm / (2.0 * intermediate)


def kernel_rate_bounds(t_l1: float, t_l2: float, volume: float, rate: float) -> tuple[float, float]:
    """Whole-kernel times of the two MegaMoE schedules: the drain-limited period of eq. (11),
    T_period >= V/R, applied to the whole kernel (our extension, not an equation of the paper).
    Returns ``(T_interleaved, T_wave)``::

        T_interleaved = max(T_L1 + T_L2, V/R)
        T_wave        = T_L1 + max(T_L2, V/R)

    ``t_l1`` / ``t_l2``: the kernel's uncontended Linear-1 / Linear-2 compute time (no remote
    path; e.g. ``tiles · T^mma / K_SM``), ``volume``: its Combine bytes. Interleaving
    spreads the Combine over all the compute, so the path can drain the whole time. Expert-wave
    issues Combine only in its L2 waves, and a wave's backlog beyond the capacity Q (a few MiB
    against tens of MiB per wave) holds its L2 tiles back until it has drained, so its L1 work
    and the drain add up. Measured on the H200 over PCIe (results/h200/megamoe/xstage/):
    T_wave within -15..+26 %, T_interleaved 6 % below to 46 % above (median +22 %: the drain also
    slows the concurrent mainloops, which the model does not contain).
    """
    _check_nonneg(t_l1=t_l1, t_l2=t_l2, volume=volume)
    _check_pos(rate=rate)
    drain = volume / rate
    return max(t_l1 + t_l2, drain), t_l1 + max(t_l2, drain)


def expert_wave_absorbs(volume: float, rate: float, t_l2: float, waves: int, capacity: float) -> tuple[bool, float]:
    """Eq. (10)'s single-burst capacity bound, V − R·T_iss ≤ Q, with one expert wave's Linear-2
    phase as the burst (our reading at wave granularity, not an equation of the paper): a wave
    issues its Combine while its L2 tiles run, the path drains R·T_L2,w meanwhile, and a backlog
    up to Q is absorbed without holding the issuer back and drains under the next wave's Linear-1
    work. Over ``waves`` equal waves of a kernel with Combine bytes ``volume`` and Linear-2 compute
    ``t_l2``::

        V − R·T_L2 ≤ W·Q

    Returns ``(holds, backlog)`` with backlog = [V − R·T_L2]_+ in bytes. Where it holds, expert_wave
    sees no backpressure: there is nothing for interleaving to remove (Section 4.1, "criterion
    satisfied").
    """
    _check_nonneg(volume=volume, t_l2=t_l2, capacity=capacity)
    _check_pos(rate=rate)
    if not isinstance(waves, int) or waves < 1:
        raise ValueError(f"waves must be a positive integer, got {waves!r}")
    backlog = max(volume - rate * t_l2, 0.0)
    return backlog <= waves * capacity, backlog


# ---------------------------------------------------------------------------
# Section 4.3: FlashAttention–A2A piggybacking
# ---------------------------------------------------------------------------

def fa_burst_volume(producers: int, tile_m: int, head_dim: int, out_bytes: int) -> int:
    """Aligned output burst, Section 4.3: V = K·B_t with B_t = b_m·d·s_out.

    Paper check: K = 148, b_m = d = 128, bf16 gives B_t = 32 KiB and
    V ≈ 4.6 MiB.
    """
    for name, v in (("producers", producers), ("tile_m", tile_m), ("head_dim", head_dim), ("out_bytes", out_bytes)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return producers * tile_m * head_dim * out_bytes


def completion_coupled_exposure(volume: float, rate: float, t_lat: float, t_cover: float) -> float:
    """Exposure of one aligned burst if the issuer waited for remote visibility, eq. (17).

    Δt^cc = [V/R + T_lat - T_cover]+, with T_cover ≲ T_QK^mma.
    """
    _check_nonneg(volume=volume, t_lat=t_lat, t_cover=t_cover)
    _check_pos(rate=rate)
    return _pos(volume / rate + t_lat - t_cover)


def qloop_gap(seq_len: int, tile_n: int, sigma: float, fixed: float = 0.0) -> float:
    """Q-loop gap between output bursts: G_Qloop(M) >= σ·M/b_n (Section 4.3).

    ``fixed`` is the positive fixed component the paper drops for a
    conservative bound (default 0, i.e. the bound itself).
    """
    _check_nonneg(fixed=fixed)
    _check_pos(sigma=sigma)
    if seq_len <= 0 or tile_n <= 0:
        raise ValueError("seq_len and tile_n must be positive")
    return fixed + sigma * seq_len / tile_n


def drain_stall(volume: float, rate: float, t_iss0: float, gap_qloop: float) -> float:
    """Drain-induced issue stall per burst, eq. (18): Δt(M) = [V/R - G_Qloop(M) - T_iss0]+."""
    return issue_overhead(gap_qloop, volume, rate, t_iss0)


def critical_drain_stall(volume: float, rate: float, t_iss0: float, gap_qloop: float, gap_qk: float) -> float:
    """Stall that reaches the compute critical path, eq. (19): Δt'(M) = [Δt(M) - G_QK]+."""
    _check_nonneg(gap_qk=gap_qk)
    return _pos(drain_stall(volume, rate, t_iss0, gap_qloop) - gap_qk)


def drain_residual(num_waves: int, volume: float, rate: float, t_iss0: float,
                   gap_qloop: float, gap_qk: float = 0.0) -> float:
    """Model drain-induced residual over all burst waves: E_drain = N_t·[Δt(M) - G_QK]+."""
    if num_waves < 0:
        raise ValueError("num_waves must be >= 0")
    return num_waves * critical_drain_stall(volume, rate, t_iss0, gap_qloop, gap_qk)


def m_star_ub(volume: float, rate: float, t_iss0: float, sigma: float, tile_n: int) -> float:
    """Sequence-length bound, eq. (20): M*_ub = b_n·G*/σ with G* = [V/R - T_iss0]+.

    For every M >= M*_ub the Q-loop lower bound σ·M/b_n covers G*, so both
    bounds of the piggyback design test hold (given the capacity bound).
    Paper check: G* ≈ 6.0 µs, σ ≈ 0.79 µs, b_n = 128 gives ≈ 1.0K tokens.
    """
    _check_pos(sigma=sigma)
    if tile_n <= 0:
        raise ValueError("tile_n must be positive")
    return tile_n * recovery_gap(volume, rate, t_iss0) / sigma
