"""The FlashAttention Q-loop slope sigma (paper Section 4.3) from measured FA-only kernel times.

The paper: the Q-loop gap between two output bursts of an SM "has a positive fixed component and
an approximately linear steady-state slope" in the KV tiles it visits,
G_Qloop(M) ~= G_0 + sigma * ceil(M / b_n); sigma is that slope (0.79 us per KV tile on its GPU),
and dropping G_0 > 0 gives the conservative bound G_Qloop(M) >= sigma * M / b_n behind
M*_ub (eq. 20).

Measured here from fa4_a2a's bench (``scripts/bench_fa_a2a.py``): its FA-only variant is the FA4
kernel class with the stock epilogue (no remote stores), timed at several M and H. One rank runs
N = H_local * ceil(M / b_m) output tiles in N_t = ceil(N / K) waves of K = min(SMs, N) CTAs; a
CTA's whole run (the Q-loop over ceil(M / b_n) KV tiles, its prologue and epilogue) is the gap
before the next burst of that SM. So T_FA / N_t = G_0 + sigma * ceil(M / b_n), and a least-squares
line over the bench's rows gives sigma (slope) and G_0 (intercept).

Clocks matter: a GPU at its power cap runs the long kernels (large M) at a lower SM clock, which
steepens the slope and pushes G_0 below zero. Use a clock-stabilised bench (``--stabilize``: every
trial at the reference clock); then sigma is the per-KV-tile time at that clock, and at the
maximum clock a lower bound of it at any other, as the conservative bound needs.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

__all__ = ["QloopFit", "fit_qloop_slope", "fit_bench_file", "write_sigma"]

TILE_M = TILE_N = 128  # fa4_a2a's FA4 tile (b_m, KV tile b_n), as in the paper


@dataclass(frozen=True)
class QloopFit:
    sigma_s: float  # slope: Q-loop time per KV tile
    fixed_s: float  # intercept G_0: the per-tile time that does not grow with M
    sigma_err_s: float  # standard error of the slope
    n: int  # (H, M) rows fitted
    max_abs_rel_residual: float
    head_dim: int
    dtype: str
    clock_mhz: float | None  # the reference SM clock of every fitted trial (clock-stabilised bench), else None
    source: str

    def as_dict(self) -> dict:
        return asdict(self)


def _fa_only_us(row: Mapping) -> float:
    """The FA-only median of a bench row: at the reference clock where the bench matched clocks."""
    matched = (row.get("matched_median_us") or {}).get("fa_only") or {}
    return float(matched["median_us"] if matched.get("median_us") is not None else row["median_us"]["fa_only"])


def fit_qloop_slope(rows: Sequence[Mapping], num_sms: int, *, tile_m: int = TILE_M, tile_n: int = TILE_N,
                    source: str = "", clock_mhz: float | None = None) -> QloopFit:
    """sigma and G_0 from fa4_a2a bench rows (keys M, H_local, head_dim, dtype, median_us.fa_only)."""
    pts = [r for r in rows if "fa_only" in (r.get("median_us") or {})]
    if len(pts) < 3:
        raise ValueError(f"{source or 'bench'}: {len(pts)} rows with an FA-only time; the slope needs >= 3")
    kinds = {(int(r["head_dim"]), str(r["dtype"])) for r in pts}
    if len(kinds) != 1:
        raise ValueError(f"{source or 'bench'}: rows of several (head_dim, dtype) {sorted(kinds)}: fit one at a time")
    (head_dim, dtype), = kinds
    kv_tiles, per_wave = [], []
    for r in pts:
        tiles = int(r["H_local"]) * math.ceil(int(r["M"]) / tile_m)
        waves = math.ceil(tiles / min(num_sms, tiles))
        kv_tiles.append(math.ceil(int(r["M"]) / tile_n))
        per_wave.append(_fa_only_us(r) * 1e-6 / waves)
    x, y = np.asarray(kv_tiles, float), np.asarray(per_wave, float)
    if len(set(kv_tiles)) < 2:
        raise ValueError(f"{source or 'bench'}: every row has {kv_tiles[0]} KV tiles; the slope needs two M or more")
    a = np.vstack([x, np.ones_like(x)]).T
    (slope, intercept), *_ = np.linalg.lstsq(a, y, rcond=None)
    resid = y - (slope * x + intercept)
    dof = max(len(x) - 2, 1)
    slope_err = math.sqrt(float(resid @ resid) / dof / float(((x - x.mean()) ** 2).sum()))
    if slope <= 0:
        raise ValueError(f"{source or 'bench'}: the per-wave FA time does not grow with M (slope {slope:.3g} s)")
    return QloopFit(sigma_s=float(slope), fixed_s=float(intercept), sigma_err_s=slope_err, n=len(x),
                    max_abs_rel_residual=float(np.max(np.abs(resid / y))), head_dim=head_dim, dtype=dtype,
                    clock_mhz=clock_mhz, source=source)


def _reference_clock(payload: Mapping) -> float | None:
    """The bench's reference SM clock if every row's FA-only median is over trials at that clock
    (a clock-stabilised bench: ``matched_median_us``, trials within its ``clock_tol_mhz``), else None."""
    clocks = set()
    for r in payload["rows"]:
        matched = (r.get("matched_median_us") or {}).get("fa_only") or {}
        if r.get("reference_clock_mhz") is None or not matched.get("n"):
            return None
        clocks.add(r["reference_clock_mhz"])
    return float(clocks.pop()) if len(clocks) == 1 else None


def fit_bench_file(path: str | Path) -> QloopFit:
    """:func:`fit_qloop_slope` over a fa4_a2a bench JSON (``scripts/bench_fa_a2a.py``)."""
    payload = json.loads(Path(path).read_text())
    return fit_qloop_slope(payload["rows"], int(payload["num_sms"]), source=str(path),
                           clock_mhz=_reference_clock(payload))


def write_sigma(profile_path: str | Path, fit: QloopFit, note: str = "") -> dict:
    """Put ``fit`` into a platform profile JSON (sigma_us_per_kv_tile after Q_bytes, its error and
    its note, plus ``note``); returns the profile."""
    path = Path(profile_path)
    old = json.loads(path.read_text())
    prof = {}
    for key, value in old.items():
        if key != "sigma_us_per_kv_tile":
            prof[key] = value
        if key == "Q_bytes":
            prof["sigma_us_per_kv_tile"] = fit.sigma_s * 1e6
    prof.setdefault("uncertainty", {})["sigma_err_us"] = fit.sigma_err_s * 1e6
    clock = (f"FA-only medians of the trials at the {fit.clock_mhz:.0f} MHz reference SM clock" if fit.clock_mhz
             else "clocks not matched")
    prof.setdefault("notes", {})["sigma"] = (
        f"measured, not fitted by the calibration: FA4 Q-loop time per KV tile (b_m = b_n = {TILE_M},"
        f" d = {fit.head_dim}, {fit.dtype}) of the GPU model, the slope of the FA-only kernel's time per wave over"
        f" ceil(M/b_n) KV tiles (python -m calibration sigma --bench {fit.source}: {fit.n} rows, {clock};"
        f" slope {fit.sigma_s * 1e6:.4f} +- {fit.sigma_err_s * 1e6:.4f} us, fixed component"
        f" {fit.fixed_s * 1e6:.2f} us, max residual {fit.max_abs_rel_residual:.1%}). A compute property of the"
        " GPU's FA kernel, not of the remote path; the planner drops the fixed component (paper Section 4.3)."
        + (f" {note}" if note else ""))
    path.write_text(json.dumps(prof, indent=2) + "\n")
    return prof
