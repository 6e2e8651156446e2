"""Benchmark machinery shared by every bench of the project (written once, used by all).

* :func:`event_timed` — a zero-argument callable returning the device time of one call (or the
  per-call time of a few back-to-back calls) between two CUDA events.
* :func:`replays_for` — how many back-to-back calls make one trial of about a target length.
* :func:`paired_trials` — trials of several variants, one timed call of each per trial in an
  order rotated per trial, the SM clock read after every call (optionally an idle cool-down and
  the clock before it; barriers for multi-process worlds).
* :func:`paired_verdicts` / :func:`print_paired` / :func:`paired_table` — every variant against
  a baseline on the paired, clock-matched trials (statistics: :mod:`lab.paired`).
* :func:`write_csv`, :func:`write_json`, :func:`write_result` — result files: CSV of dict rows,
  JSON with provenance (:func:`xstage.provenance.write_json`), both under one stem.
* :func:`progress` / :func:`log` — a progress bar (tqdm) for long sweeps, and printing that does
  not break it.

Everything but the timing itself runs on a CPU (tests/test_bench.py).
"""
from __future__ import annotations

import csv
import gzip
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional, Sequence

from lab import paired, timing
from xstage import provenance

__all__ = ["event_timed", "replays_for", "paired_trials", "paired_verdicts", "print_paired", "paired_table",
           "write_csv", "write_json", "write_result", "progress", "log", "VERDICT_KEYS"]

# The keys paired_verdicts adds to a paired row; every other key of the row names its case.
VERDICT_KEYS = ("baseline", "clock_tol_mhz", "reference_clock_mhz", "samples_us", "clocks_mhz", "variants")


# ----------------------------------------------------------------------------- timing


def event_timed(fn: Callable[[], object], *, calls: int = 1, warmup: int = 1) -> Callable[[], float]:
    """() -> device time in us per call of ``calls`` back-to-back calls of ``fn`` between two
    CUDA events (synchronised before it returns); ``warmup`` untimed calls first (compilation,
    first touch)."""
    for _ in range(warmup):
        fn()
    return lambda: timing.events_us(fn, calls)


def replays_for(est_us: float, target_us: float, min_replays: int, max_replays: int) -> int:
    """Calls per trial: about ``target_us`` of work at ``est_us`` per call, clamped to
    [min_replays, max_replays]."""
    return int(max(min_replays, min(max_replays, math.ceil(target_us / max(est_us, 1.0)))))


def paired_trials(fns: Mapping[str, Callable[[], float]], trials: int, cooldown_s: float = 0.0, *,
                  barrier: Optional[Callable[[], None]] = None, clocks_before: Optional[dict] = None):
    """One call of every variant per trial, in an order rotated per trial (:func:`paired.rotated`),
    the SM clock read after each: (samples_us, clocks) as name -> list per trial. ``fns[name]()``
    runs one timed call and returns its time (e.g. :func:`event_timed`).

    ``cooldown_s`` > 0: the host synchronises and sleeps that long before each timed call (the
    GPU leaves its power limit); ``clocks_before`` (name -> list), when given, gets the clock
    read after each cool-down. ``barrier`` (multi-process worlds): called after the cool-down's
    synchronisation, right before each timed call and right after it (the remote stores are
    visible once after the call, paper Section 5.1)."""
    samples = {k: [] for k in fns}
    clocks = {k: [] for k in fns}
    sync = barrier or (lambda: None)
    for t in range(trials):
        for k in paired.rotated(list(fns), t):
            if cooldown_s > 0:
                import torch

                torch.cuda.synchronize()
                sync()
                time.sleep(cooldown_s)
                if clocks_before is not None:
                    clocks_before[k].append(paired.sm_clock_mhz())
            sync()
            samples[k].append(fns[k]())
            clocks[k].append(paired.sm_clock_mhz())
            sync()
    return samples, clocks


# ----------------------------------------------------------------------------- verdicts (CPU)


def paired_verdicts(samples: dict, clocks: dict, baseline: str, tol_mhz: float, min_matched: int = 5) -> dict:
    """Every other variant against ``baseline`` on the trials where both ran at the reference
    clock: the median per-trial ratio variant / baseline, the share of trials where the variant
    was not slower, and both one-sided sign tests (``faster``: the variant is faster than the
    baseline; ``slower``: it is slower). "no slower than the baseline" = the median paired
    difference variant - baseline is <= 0. The row keeps the samples and clocks (keys
    :data:`VERDICT_KEYS`); callers add the keys that name the case."""
    out = {"baseline": baseline, "clock_tol_mhz": tol_mhz, "reference_clock_mhz": paired.reference_clock(clocks),
           "samples_us": samples, "clocks_mhz": clocks, "variants": {}}
    base = samples[baseline]
    for k in samples:
        if k == baseline:
            continue
        idx = paired.matched_trials(clocks, [k, baseline], tol_mhz)
        v = {"n_matched": len(idx),
             "faster": paired.acceptance(samples, clocks, baseline, k, tol_mhz, min_matched),
             "slower": paired.acceptance(samples, clocks, k, baseline, tol_mhz, min_matched)}
        if idx:
            diffs = [samples[k][i] - base[i] for i in idx]
            v.update(median_ratio=statistics.median(samples[k][i] / base[i] for i in idx),
                     frac_not_slower=sum(d <= 0 for d in diffs) / len(diffs),
                     median_us=statistics.median(samples[k][i] for i in idx),
                     baseline_median_us=statistics.median(base[i] for i in idx),
                     no_slower=statistics.median(diffs) <= 0)
        out["variants"][k] = v
    return out


def _case(row: Mapping) -> dict:
    """The keys of a paired row that name its case (everything paired_verdicts did not add)."""
    return {k: v for k, v in row.items() if k not in VERDICT_KEYS}


def print_paired(row: Mapping, label: Optional[str] = None) -> None:
    """One line per variant of a :func:`paired_verdicts` row; ``label`` names the case (default:
    its keys, ``shape=..., P=...``)."""
    label = label if label is not None else ", ".join(f"{k}={v}" for k, v in _case(row).items())
    print(f"paired ({label}; reference clock {row['reference_clock_mhz']} MHz, +-{row['clock_tol_mhz']} MHz): "
          f"variant / {row['baseline']}", flush=True)
    for k, v in row["variants"].items():
        if not v["n_matched"]:
            print(f"  {k:40s} no trial at the reference clock", flush=True)
            continue
        print(f"  {k:40s} {v['median_us']:10.1f} vs {v['baseline_median_us']:10.1f} us  ratio {v['median_ratio']:.3f}  "
              f"not slower in {100 * v['frac_not_slower']:.0f}% of {v['n_matched']}  "
              f"faster: {v['faster']['verdict']}  slower: {v['slower']['verdict']}  "
              f"no_slower={v['no_slower']}", flush=True)


def paired_table(rows: Iterable[Mapping]) -> list:
    """One flat row per (case, variant) of the paired rows: the case's keys first, then the
    verdict's fields (the JSON keeps the samples)."""
    out = []
    for row in rows:
        for name, v in row["variants"].items():
            out.append(dict(_case(row), variant=name, baseline=row["baseline"],
                            reference_clock_mhz=row["reference_clock_mhz"], n_matched=v["n_matched"],
                            median_us=v.get("median_us"), baseline_median_us=v.get("baseline_median_us"),
                            median_ratio=v.get("median_ratio"), frac_not_slower=v.get("frac_not_slower"),
                            no_slower=v.get("no_slower"), faster=v["faster"]["verdict"],
                            slower=v["slower"]["verdict"]))
    return out


# ----------------------------------------------------------------------------- result files


def write_csv(path, rows: Sequence[Mapping]) -> Optional[Path]:
    """Rows (flat dicts) -> CSV with the union of their keys in first-seen order (missing cells
    empty); nothing is written for no rows (returns None)."""
    rows = list(rows)
    if not rows:
        return None
    keys: list = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in keys})
    return path


def open_text(path):
    """A result file opened for reading as text, gzip-decompressed when its name ends in ``.gz`` (the
    larger files of results/ are committed that way)."""
    return gzip.open(path, "rt", newline="") if str(path).endswith(".gz") else open(path, newline="")


def read_csv(path) -> list:
    """The rows of a :func:`write_csv` file as dicts, each cell an int or float where it is one, else its
    text (None for an empty cell)."""
    def cell(text: str):
        if text == "":
            return None
        for kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                pass
        return text

    with open(path, newline="") as f:
        return [{k: cell(v) for k, v in r.items()} for r in csv.DictReader(f)]


def write_json(path, payload: dict, extra: Optional[dict] = None) -> Path:
    """``payload`` as indented JSON with ``{"provenance": ...}`` (:func:`xstage.provenance.write_json`)."""
    return Path(provenance.write_json(path, payload, extra))


def write_result(out_dir, stem: str, payload: dict, rows: Sequence[Mapping] = ()) -> Path:
    """``out_dir/stem.json`` (with provenance) and, when rows are given, ``out_dir/stem.csv``;
    returns the JSON's path."""
    out_dir = Path(out_dir)
    path = write_json(out_dir / f"{stem}.json", payload)
    write_csv(out_dir / f"{stem}.csv", rows)
    return path


# ----------------------------------------------------------------------------- progress


def progress(iterable: Iterable, *, desc: Optional[str] = None, total: Optional[int] = None,
             enabled: Optional[bool] = None):
    """``iterable`` with a tqdm progress bar on stderr; by default only when stderr is a
    terminal (logs of batch runs stay free of bar updates). ``enabled=False``: no bar (e.g. on
    every rank but rank 0)."""
    from tqdm import tqdm

    if enabled is None:
        enabled = sys.stderr.isatty()
    return tqdm(iterable, desc=desc, total=total, disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def log(text: str) -> None:
    """Print a line (flushed) above a running :func:`progress` bar without breaking it."""
    from tqdm import tqdm

    tqdm.write(str(text), file=sys.stdout)
    sys.stdout.flush()


def ratio_bars(path, labels: Sequence[str], series: Sequence, *, ylabel: str, title: str, ticks: Sequence[float],
               ref: Optional[tuple] = None, figsize=(8, 4), ylim: Optional[tuple] = None) -> Optional[Path]:
    """A grouped bar chart of time ratios on a log axis with plain tick labels at ``ticks``:
    ``series`` = [(name, one value per label)], ``ref`` = (y, label, linestyle) of a reference
    line, ``ylim`` the axis range (bars start at its bottom). Returns ``path``, or None without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FixedLocator, NullFormatter, ScalarFormatter
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=figsize)
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series):
        ax.bar([x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))], values, width, label=name)
    if ref is not None:
        ax.axhline(ref[0], color="k", lw=0.8, ls=ref[2], label=ref[1])
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel(ylabel)
    ax.set_yscale("log")
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.yaxis.set_major_locator(FixedLocator(list(ticks)))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return Path(path)
