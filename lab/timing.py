"""Timing harness: CUDA events, CUDA-graph replay, medians (device METHOD).

* :func:`bench` — events around ``iters`` back-to-back eager calls, one
  sample per trial (per-call time), median over trials.
* :func:`bench_graph` — capture ``fn`` once into a CUDA graph and time
  ``replays`` replays per trial: removes host launch overhead (the CuTe DSL
  Python launch path is comparable to short kernels, Section 5.3).
* :func:`events_us` — one such sample (CUDA events around a few back-to-back
  calls), for loops that interleave variants (lab.bench).

bench and bench_graph warm up first and report the median and spread; compare
variants from the same run with :func:`ratio`.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["Timing", "bench", "bench_graph", "capture_graph", "events_us", "ratio"]


@dataclass(frozen=True)
class Timing:
    """Per-call times in microseconds, one sample per trial."""

    samples_us: list[float] = field(default_factory=list)

    def _q(self, q: float) -> float:
        s = sorted(self.samples_us)
        if not s:
            raise ValueError("no samples")
        i = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
        return s[i]

    @property
    def median_us(self) -> float:
        return statistics.median(self.samples_us)

    @property
    def p10_us(self) -> float:
        return self._q(0.10)

    @property
    def p90_us(self) -> float:
        return self._q(0.90)

    def as_dict(self) -> dict:
        return {"median_us": self.median_us, "p10_us": self.p10_us, "p90_us": self.p90_us,
                "trials": len(self.samples_us), "samples_us": list(self.samples_us)}


def _check(**kw: int) -> None:
    for k, v in kw.items():
        if not isinstance(v, int) or v < (0 if k == "warmup" else 1):
            raise ValueError(f"{k} must be a positive integer, got {v!r}")


def events_us(step: Callable[[], object], calls: int = 1) -> float:
    """Device time in us per call of ``calls`` back-to-back calls of ``step`` between two CUDA
    events (synchronised before it returns)."""
    import torch

    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(calls):
        step()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / calls


def _event_trials(step: Callable[[], object], per_trial: int, trials: int) -> Timing:
    """CUDA events around ``per_trial`` back-to-back calls of ``step``; one per-call sample per trial."""
    return Timing([events_us(step, per_trial) for _ in range(trials)])


def bench(fn: Callable[[], object], *, warmup: int = 5, iters: int = 20, trials: int = 21) -> Timing:
    """Median over ``trials`` of the mean per-call time of ``iters`` back-to-back calls."""
    import torch

    _check(warmup=warmup, iters=iters, trials=trials)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return _event_trials(fn, iters, trials)


def capture_graph(fn: Callable[[], object], *, warmup: int = 3):
    """Warm ``fn`` up eagerly on a side stream, then capture one call into a CUDA graph.

    Returns the ``torch.cuda.CUDAGraph`` (replayed once, synchronized). The
    warm-up keeps compilation, allocation and handle creation out of the graph.
    """
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(max(warmup, 1)):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    return g


def bench_graph(fn: Callable[[], object], *, replays: int = 20, trials: int = 21, warmup: int = 3) -> Timing:
    """Capture ``fn`` once (after eager warm-up on a side stream) and time graph replays."""
    import torch

    _check(warmup=warmup, replays=replays, trials=trials)
    g = capture_graph(fn, warmup=warmup)
    for _ in range(warmup):
        g.replay()
    torch.cuda.synchronize()
    return _event_trials(g.replay, replays, trials)


def ratio(a: Timing, b: Timing) -> float:
    """a / b of the medians (e.g. speedup = ratio(t_serial, t_fused))."""
    return a.median_us / b.median_us
