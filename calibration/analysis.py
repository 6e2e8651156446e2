"""From raw per-producer timestamps to per-burst series and steady-state summaries.

Pure numpy.  The kernel (``calibration.kernels``) records, per producer ``k``
and burst ``n``: globaltimer at issue start/end and clock64 at the same two
points.  Here:

* a burst's **start** is its earliest producer's start (globaltimer, ns);
* a burst's **issue time** is its *slowest producer's* issue interval
  (clock64 cycles of that producer's SM, converted with the clock rate fitted
  over the whole launch against globaltimer; clock64 resolves what the coarse
  globaltimer step cannot);
* the **period** is start-to-start, and the **effective gap** is
  ``period - issue time`` (model: ``T_period = T_iss + G``), i.e. everything
  between the end of a burst's issue and the next start (requested gap plus
  the per-burst alignment barrier).

Steady state: the first ``transient`` bursts are those before the issue-time
and period series settle (a rolling median stays within a tolerance of the
tail median).  With a large Q and a small per-period deficit the queue takes
many bursts to fill, so the transient is reported, and a run whose transient
covers most of it is flagged ``steady=False``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

__all__ = [
    "BurstSeries", "Summary", "bursts_from_timestamps", "transient_length", "summarize", "summarize_isolated",
]


@dataclass
class BurstSeries:
    """Per-burst arrays in seconds (length N)."""

    start: np.ndarray
    end: np.ndarray  # latest producer's issue end (globaltimer)
    issue: np.ndarray  # slowest producer's issue interval (clock64-based)
    issue_span: np.ndarray  # latest end - earliest start (globaltimer)
    clock_ghz: float = float("nan")
    timer_step_ns: float = float("nan")
    start_skew: np.ndarray = None  # latest - earliest producer start

    @property
    def n(self) -> int:
        return len(self.start)


def _timer_step_ns(gt: np.ndarray) -> float:
    """Smallest positive difference between distinct globaltimer readings (ns)."""
    u = np.unique(gt.ravel())
    if len(u) < 2:
        return float("nan")
    d = np.diff(u)
    d = d[d > 0]
    return float(d.min()) if len(d) else float("nan")


def bursts_from_timestamps(ts: np.ndarray, clock_ghz: Optional[float] = None, aligned: bool = True) -> BurstSeries:
    """Per-burst series from the kernel's int64 ``[K, N, 4]`` record
    (gt_start, gt_end, clk_start, clk_end).

    ``aligned=True`` (producers start every burst together): start = earliest
    producer's start, issue = slowest producer's issue interval.
    ``aligned=False`` (free-running producers): every quantity is taken per
    producer from its own clock64 (no cross-SM comparison needed) and
    averaged over producers: issue = mean producer issue interval, start =
    cumulative mean producer period; ``issue_span`` then holds the slowest
    producer's issue interval and ``start_skew`` the spread of producer
    start times (drift) per burst.

    ``clock_ghz``: SM clock to convert cycles; default: fitted per producer
    from (clk, globaltimer) pairs across the launch, median over producers.
    """
    ts = np.asarray(ts, dtype=np.int64)
    if ts.ndim != 3 or ts.shape[2] != 4:
        raise ValueError(f"timestamps must have shape [K, N, 4], got {ts.shape}")
    K, N, _ = ts.shape
    gt0, gt1 = ts[:, :, 0].astype(np.float64), ts[:, :, 1].astype(np.float64)
    c0, c1 = ts[:, :, 2].astype(np.float64), ts[:, :, 3].astype(np.float64)
    if np.any(gt1 < gt0) or np.any(c1 < c0):
        raise ValueError("timestamps are not monotone within a burst (end before start)")
    if N > 1 and (np.any(c0[:, 1:] < c1[:, :-1]) or np.any(gt0[:, 1:] < gt1[:, :-1])):
        raise ValueError("timestamps are not monotone across bursts (a burst starts before the previous ended)")
    if clock_ghz is None:
        rates = []
        for k in range(K):
            dt = gt1[k, -1] - gt0[k, 0]
            if dt > 0:
                rates.append((c1[k, -1] - c0[k, 0]) / dt)
        clock_ghz = float(np.median(rates)) if rates else float("nan")
    if not (clock_ghz > 0):
        raise ValueError("cannot determine the SM clock rate (launch too short); pass clock_ghz")
    to_s = 1e-9 / clock_ghz
    dur_s = (c1 - c0) * to_s  # [K, N]
    skew = (gt0.max(axis=0) - gt0.min(axis=0)) * 1e-9
    step = _timer_step_ns(ts[:, :, :2])
    if aligned:
        start = gt0.min(axis=0) * 1e-9
        end = gt1.max(axis=0) * 1e-9
        return BurstSeries(start=start - start[0], end=end - start[0], issue=dur_s.max(axis=0),
                           issue_span=end - start, clock_ghz=clock_ghz, timer_step_ns=step, start_skew=skew)
    issue = dur_s.mean(axis=0)
    period = np.empty(N)
    if N > 1:
        period[:-1] = ((c0[:, 1:] - c0[:, :-1]) * to_s).mean(axis=0)
        period[-1] = period[-2] if N > 2 else period[0]
    else:
        period[:] = issue
    start = np.concatenate([[0.0], np.cumsum(period[:-1])])
    return BurstSeries(start=start, end=start + issue, issue=issue, issue_span=dur_s.max(axis=0),
                       clock_ghz=clock_ghz, timer_step_ns=step, start_skew=skew)


def _rolling_median(x: np.ndarray, w: int) -> np.ndarray:
    n = len(x)
    if n == 0:
        return x
    w = max(1, min(w, n))
    out = np.empty(n)
    for i in range(n):
        lo = max(0, i - w // 2)
        hi = min(n, lo + w)
        lo = max(0, hi - w)
        out[i] = np.median(x[lo:hi])
    return out


def transient_length(x: np.ndarray, rel_tol: float = 0.05, abs_tol: float = 0.0, window: Optional[int] = None,
                     noise_sigmas: float = 3.0) -> int:
    """Number of leading samples before ``x`` settles to its tail median.

    Settled from index ``i`` on: the rolling median (``window``, default
    ``clip(n // 10, 5, 25)``) stays within the tolerance of the median of the
    last half.  The tolerance is the largest of ``rel_tol * |tail|``,
    ``abs_tol`` and ``noise_sigmas`` standard errors of a window median
    (burst-to-burst jitter, estimated from the tail's MAD), so measurement
    noise is not mistaken for a transient while a filling queue (a step of
    the issue time or period) still is.
    """
    x = np.asarray(x, dtype=float)
    n = len(x)
    if n < 4:
        return 0
    if window is None:
        window = int(np.clip(n // 10, 5, 25))
    tail = x[n // 2 :]
    ref = float(np.median(tail))
    sigma = 1.4826 * float(np.median(np.abs(tail - ref)))
    noise = noise_sigmas * 1.25 * sigma / np.sqrt(window)
    tol = max(rel_tol * abs(ref), abs_tol, noise)
    rm = _rolling_median(x, window)
    bad = np.nonzero(np.abs(rm - ref) > tol)[0]
    return 0 if len(bad) == 0 else int(bad[-1]) + 1


@dataclass
class Summary:
    """Steady-state summary of one launch (seconds)."""

    T_iss: float  # median slowest-producer issue time over steady bursts
    T_iss_p10: float
    T_iss_p90: float
    T_period: float  # mean start-to-start period over steady bursts
    G_eff: float  # T_period - T_iss
    transient: int  # bursts before steady state
    steady: bool  # transient ended in the first half of the run
    n_steady: int
    first_issue: float  # issue time of burst 0 (empty queue)
    T_iss_span: float  # median latest-end - earliest-start over steady bursts

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(series: BurstSeries, skip: int = 1, rel_tol: float = 0.05, abs_tol: float = 0.0) -> Summary:
    """Steady-state summary of a periodic launch.

    ``skip``: bursts always excluded at the start (burst 0 follows the launch
    with cold TLBs).  ``abs_tol``: absolute settling tolerance (use a few
    timer steps for globaltimer-limited series).
    """
    n = series.n
    if n < 3:
        raise ValueError(f"need >= 3 bursts to summarize, got {n}")
    periods = np.diff(series.start)
    t_iss = transient_length(series.issue[:-1], rel_tol, abs_tol)
    t_per = transient_length(periods, rel_tol, abs_tol)
    n0 = max(skip, t_iss, t_per)
    steady = n0 <= (n - 1) // 2
    n0 = min(n0, n - 3)  # keep at least two periods to report
    last = n - 1  # last burst has no following start
    iss = series.issue[n0:last]
    T_period = float((series.start[last] - series.start[n0]) / (last - n0))
    T_iss = float(np.median(iss))
    return Summary(
        T_iss=T_iss,
        T_iss_p10=float(np.percentile(iss, 10)),
        T_iss_p90=float(np.percentile(iss, 90)),
        T_period=T_period,
        G_eff=T_period - float(np.mean(iss)),
        transient=int(max(t_iss, t_per)),
        steady=bool(steady),
        n_steady=int(last - n0),
        first_issue=float(series.issue[0]),
        T_iss_span=float(np.median(series.issue_span[n0:last])),
    )


def summarize_isolated(series: BurstSeries, skip: int = 1) -> dict:
    """Isolated bursts (each after full recovery): median issue time of bursts ``skip..``.

    Also returns the spread and burst 0's issue time (first touch after launch).
    """
    if series.n <= skip:
        raise ValueError(f"need more than {skip} bursts, got {series.n}")
    iss = series.issue[skip:]
    gaps = np.diff(series.start) - series.issue[:-1]
    return {
        "T_iss": float(np.median(iss)),
        "T_iss_p10": float(np.percentile(iss, 10)),
        "T_iss_p90": float(np.percentile(iss, 90)),
        "first_issue": float(series.issue[0]),
        "G_eff": float(np.median(gaps)) if len(gaps) else float("nan"),
        "n_used": int(len(iss)),
    }
