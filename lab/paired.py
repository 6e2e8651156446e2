"""Paired, clock-matched comparison of benchmark variants (CPU-testable statistics).

Benchmarks time their variants interleaved, in an order rotated per trial (:func:`rotated`), and
read the SM clock after every trial (:func:`sm_clock_mhz`). A comparison then uses the per-trial
differences of two variants (robust to drift that moves both medians), restricted to trials in
which both ran at the reference clock (DVFS on a power-limited GPU otherwise decides the
comparison, paper Section 5.3), with a one-sided sign test (:func:`acceptance`).
Used through lab.bench (paired trials and verdicts) by the benches.
"""
from __future__ import annotations

import math
import statistics


def rotated(names, t):
    """Trial t's variant order: the list rotated by t (every variant leads equally often)."""
    k = t % len(names)
    return list(names[k:]) + list(names[:k])


def sm_clock_mhz():
    """Current SM clock through NVML (None where NVML is unavailable)."""
    import torch

    try:
        return torch.cuda.clock_rate()
    except Exception:
        return None


def paired_stats(timings: dict, a: str, b: str) -> dict:
    """Per-trial differences a - b (same trial, rotated order): robust to slow drift that moves
    both medians. Returns the median difference and the fraction of trials with a > b.
    ``timings``: name -> object with ``samples_us`` (lab.timing.Timing) or a list of samples."""
    sa, sb = _samples(timings[a]), _samples(timings[b])
    d = sorted(x - y for x, y in zip(sa, sb))
    return {"median_diff_us": statistics.median(d), "frac_positive": sum(x > 0 for x in d) / len(d), "n": len(d)}


def _samples(t):
    return list(t.samples_us) if hasattr(t, "samples_us") else list(t)


def reference_clock(clocks: dict):
    """The row's reference SM clock: median of every reading of every variant (None if no NVML)."""
    vals = [c for cs in clocks.values() for c in (cs or []) if c is not None]
    return statistics.median(vals) if vals else None


def matched_trials(clocks: dict, names, tol_mhz: float, ref=None) -> list:
    """Indices of trials in which every variant of ``names`` ran within ``tol_mhz`` of ``ref``
    (default: the row's reference clock).  Without clock readings every trial counts."""
    ref = reference_clock(clocks) if ref is None else ref
    n = min(len(clocks[k]) for k in names)
    if ref is None:
        return list(range(n))
    return [i for i in range(n)
            if all(clocks[k][i] is not None and abs(clocks[k][i] - ref) <= tol_mhz for k in names)]


def sign_test_p(k_pos: int, n: int) -> float:
    """One-sided sign test: P(X >= k_pos) for X ~ Binomial(n, 1/2) (ties dropped beforehand)."""
    if n == 0:
        return 1.0
    return sum(math.comb(n, i) for i in range(k_pos, n + 1)) / 2 ** n


def matched_medians(samples: dict, clocks: dict, tol_mhz: float) -> dict:
    """Per variant: median over its own trials whose clock is within tol of the reference clock."""
    ref = reference_clock(clocks)
    out = {}
    for k, s in samples.items():
        idx = matched_trials({k: clocks[k]}, [k], tol_mhz, ref)
        out[k] = {"median_us": statistics.median([s[i] for i in idx]) if idx else None, "n": len(idx)}
    return out


def acceptance(samples: dict, clocks: dict, slow: str, fast: str, tol_mhz: float, min_matched: int,
               alpha: float = 0.05) -> dict:
    """Is ``fast`` faster than ``slow`` on the paired, matched-clock statistic?

    Trials where both variants ran within ``tol_mhz`` of the reference clock give paired
    differences slow_i - fast_i.  Verdict: "pass" when their median is > 0 and the one-sided sign
    test rejects "no difference" at ``alpha``; "inconclusive" with fewer than ``min_matched``
    matched trials; "fail" otherwise (slower, or faster by less than the noise shows).
    ``clock_matched`` is False when no clock readings exist (every trial then counts)."""
    ref = reference_clock(clocks)
    idx = matched_trials(clocks, [slow, fast], tol_mhz, ref)
    d = [samples[slow][i] - samples[fast][i] for i in idx]
    nonzero = [x for x in d if x != 0]
    res = {"slow": slow, "fast": fast, "reference_clock_mhz": ref, "clock_tol_mhz": tol_mhz,
           "clock_matched": ref is not None, "alpha": alpha,
           "n_trials": min(len(samples[slow]), len(samples[fast])), "n_matched": len(d)}
    if d:
        res.update(median_diff_us=statistics.median(d), frac_positive=sum(x > 0 for x in d) / len(d),
                   sign_test_p=sign_test_p(sum(x > 0 for x in nonzero), len(nonzero)))
    if len(d) < min_matched:
        res["verdict"] = "inconclusive"
    else:
        res["verdict"] = "pass" if res["median_diff_us"] > 0 and res["sign_test_p"] < alpha else "fail"
    return res
