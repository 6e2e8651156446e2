"""Event-driven fluid simulator of one X-Stage queue.

The model of Section 3.2 as a process rather than a closed form: producers
inject a burst of V bytes at the backpressure-free rate V/T_iss0 while the
outstanding volume q is below Q; at q = Q injection is throttled to the
drain rate; the path drains at R whenever q > 0 (work-conserving). After a
burst the producers run a gap G with no stores while q keeps draining.

Every phase is linear in time, so the simulation is exact (no time step):
each burst has at most two phases (free injection, then capacity-limited
injection) and each gap one. It is used to test the closed forms
(eq. 1–7) and to show transients: with a large Q and a rate just above R,
many bursts pass before the queue fills and the steady state is reached.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, Union

import numpy as np

__all__ = ["SimResult", "simulate", "steady_state_index"]

IssueTimeSpec = Union[float, Sequence[float], Callable[[float], float]]


@dataclass(frozen=True)
class SimResult:
    """Per-burst arrays (seconds / bytes), all of length ``n``.

    start: burst start times; issue_time: sender-visible issue time of each
    burst; end: start + issue_time; period: start-to-start period (for the
    last burst, issue time plus its gap); q_start / q_end: outstanding
    volume at the start / end of each burst's issue; throttled: whether the
    burst hit the capacity.
    """

    start: np.ndarray
    issue_time: np.ndarray
    end: np.ndarray
    period: np.ndarray
    q_start: np.ndarray
    q_end: np.ndarray
    throttled: np.ndarray

    @property
    def n(self) -> int:
        return len(self.start)


def _broadcast(name: str, x, n: int) -> np.ndarray:
    arr = np.asarray(x, dtype=float)
    if arr.ndim == 0:
        arr = np.full(n, float(arr))
    if arr.shape != (n,):
        raise ValueError(f"{name} has {arr.shape[0]} entries, expected {n}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"{name} must be finite and >= 0")
    return arr


def _burst(q: float, volume: float, t0: float, rate: float, capacity: float) -> tuple[float, float, bool]:
    """Issue one burst starting with q outstanding. Returns (issue time, q at end, throttled)."""
    if volume == 0.0:
        return 0.0, q, False
    r_in = volume / t0
    net = r_in - rate
    if net <= 0.0:
        # Injection no faster than drain: q falls (or stays at 0) during issue.
        return t0, max(q + net * t0, 0.0), False
    # q rises at `net` until it reaches the capacity (if it ever does).
    t_fill = (capacity - q) / net if q < capacity else 0.0
    if t_fill >= t0:
        return t0, q + net * t0, False
    injected = r_in * t_fill
    return t_fill + (volume - injected) / rate, capacity, True


def simulate(
    t_iss0: IssueTimeSpec,
    R: float,
    Q: float,
    volumes: Sequence[float] | float,
    gaps: Sequence[float] | float,
    n: int | None = None,
    q0: float = 0.0,
) -> SimResult:
    """Simulate bursts of ``volumes[i]`` bytes each followed by ``gaps[i]`` seconds.

    Args:
        t_iss0: backpressure-free issue time in seconds: a constant, one per
            burst, or a function of the burst volume.
        R: drain rate in bytes/s. Q: outstanding capacity in bytes.
        volumes, gaps: per-burst sequences, or scalars broadcast to ``n``.
        n: number of bursts when both volumes and gaps are scalars.
        q0: outstanding volume before the first burst.
    """
    if not (R > 0 and np.isfinite(R)):
        raise ValueError(f"R must be > 0, got {R!r}")
    if not (Q > 0 and np.isfinite(Q)):
        raise ValueError(f"Q must be > 0, got {Q!r}")
    if q0 < 0 or q0 > Q:
        raise ValueError(f"q0 must be in [0, Q], got {q0!r}")
    if n is None:
        lens = [len(x) for x in (volumes, gaps) if np.ndim(x) == 1]
        if not lens:
            raise ValueError("give n when volumes and gaps are both scalars")
        n = lens[0]
    v = _broadcast("volumes", volumes, n)
    g = _broadcast("gaps", gaps, n)
    if callable(t_iss0):
        t0 = np.array([float(t_iss0(x)) for x in v])
    else:
        t0 = _broadcast("t_iss0", t_iss0, n)
    if np.any(t0 <= 0):
        raise ValueError("t_iss0 must be > 0")

    start = np.empty(n)
    iss = np.empty(n)
    q_start = np.empty(n)
    q_end = np.empty(n)
    throttled = np.zeros(n, dtype=bool)
    t, q = 0.0, float(q0)
    for i in range(n):
        start[i], q_start[i] = t, q
        iss[i], q, throttled[i] = _burst(q, v[i], t0[i], R, Q)
        q_end[i] = q
        t += iss[i] + g[i]
        q = max(q - R * g[i], 0.0)
    end = start + iss
    period = np.empty(n)
    period[:-1] = np.diff(start)
    period[-1] = iss[-1] + g[-1]
    return SimResult(start, iss, end, period, q_start, q_end, throttled)


def steady_state_index(values: np.ndarray, rel_tol: float = 1e-6, window: int = 3) -> int | None:
    """Index of the first burst from which ``values`` stay within ``rel_tol`` of the final value.

    Returns None if the last ``window`` values are not yet settled (the run
    was too short to reach steady state). Used to report how many bursts the
    transient lasts.
    """
    values = np.asarray(values, dtype=float)
    if len(values) < window:
        return None
    final = values[-1]
    ok = np.abs(values - final) <= rel_tol * max(abs(final), 1e-300)
    if not ok[-window:].all():
        return None
    bad = np.nonzero(~ok)[0]
    return 0 if len(bad) == 0 else int(bad[-1]) + 1
