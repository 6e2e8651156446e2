"""Fit the Burst–Gap platform model M_X = (T_iss0(K, V), R, Q(K)) and validate it.

Pure numpy.  Three independent experiments, no per-curve refitting
(paper Sections 3.3–3.5):

1. **R** from zero-gap periodic bursts: in the drain-dominated steady state
   ``T_period = V / R`` across producer counts K and K/B decompositions
   (relative least squares through the origin on the drain-limited points;
   points whose apparent rate V/T_period is well below the others are
   issue-limited and left out).
2. **T_iss0(K, V)** and **Q(K)** from isolated bursts (each after full
   recovery): ``T_iss^iso = max(T_iss0(K, V), (V - Q)/R)`` (eq. 7), with the
   backpressure-free floor affine in V, ``T_iss0 = a_K + b_K V``, fitted on
   the points before the knee; Q from the points past it (eq. 6–7).  No knee
   inside the measured range gives a lower bound on Q.
3. **Prediction** of every gap sweep with eq. 1–3 using only R and the
   isolated issue time at the sweep's (K, B) as the plateau:
   ``T_iss = max(T_iss0, V/R - G)``, ``T_period = max(T_iss0 + G, V/R)``,
   where G is the measured effective gap.  Errors are reported per point.

Uncertainties are bootstrap percentiles (points resampled, R perturbed by
its own uncertainty for the isolated fit).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence

import numpy as np

__all__ = [
    "DrainFit",
    "IsolatedFit",
    "fit_drain_rate",
    "fit_isolated",
    "predict_t_iss",
    "predict_t_period",
    "filling",
    "validate_sweeps",
    "fit_points",
    "build_profile",
]


# ---------------------------------------------------------------------------
# R from zero-gap steady periods
# ---------------------------------------------------------------------------


@dataclass
class DrainFit:
    R: float  # bytes/s
    R_err: float  # 1-sigma (bootstrap)
    R_ci: tuple  # 16th..84th percentile
    used: np.ndarray  # mask of drain-limited points
    rel_resid: np.ndarray  # (T - V/R)/T for every point

    def as_dict(self) -> dict:
        return {
            "R_bytes_per_s": self.R,
            "R_err_bytes_per_s": self.R_err,
            "R_ci_bytes_per_s": list(self.R_ci),
            "n_used": int(self.used.sum()),
            "n_points": int(len(self.used)),
            "max_abs_rel_resid_used": float(np.max(np.abs(self.rel_resid[self.used]))) if self.used.any() else None,
        }


def _slope_through_origin_rel(V: np.ndarray, T: np.ndarray) -> float:
    """s minimizing sum((T - s V)/T)^2."""
    x = V / T
    return float(np.sum(x) / np.sum(x * x))


def _positive_points(V, T, kind: str, t_name: str):
    """(V, T) as float arrays of >= 2 matching, positive, finite points (ValueError otherwise)."""
    V = np.asarray(V, dtype=float)
    T = np.asarray(T, dtype=float)
    if V.shape != T.shape or V.ndim != 1 or len(V) < 2:
        raise ValueError(f"need >= 2 {kind} points with matching V and {t_name}")
    if np.any(V <= 0) or np.any(T <= 0) or not np.all(np.isfinite(T)):
        raise ValueError(f"V and {t_name} must be positive and finite")
    return V, T


def fit_drain_rate(
    V: Sequence[float], T_period: Sequence[float], *, min_rel: float = 0.9, n_boot: int = 300, seed: int = 0
) -> DrainFit:
    """Fit ``T_period = V / R`` on the drain-limited zero-gap points.

    A point is drain-limited when its apparent rate V/T_period is within
    ``min_rel`` of the fitted R (a point below is issue-limited: its period
    is set by the producers, not by the drain).
    """
    V, T = _positive_points(V, T_period, "zero-gap", "T_period")
    rate = V / T
    R = float(np.percentile(rate, 90))
    used = rate >= min_rel * R
    for _ in range(5):
        R_new = 1.0 / _slope_through_origin_rel(V[used], T[used])
        used_new = rate >= min_rel * R_new
        if not used_new.any():
            break
        if R_new == R and np.array_equal(used_new, used):
            break
        R, used = R_new, used_new
    R = 1.0 / _slope_through_origin_rel(V[used], T[used])
    rng = np.random.default_rng(seed)
    idx = np.nonzero(used)[0]
    boots = []
    for _ in range(n_boot):
        s = rng.choice(idx, size=len(idx), replace=True)
        boots.append(1.0 / _slope_through_origin_rel(V[s], T[s]))
    boots = np.asarray(boots)
    return DrainFit(
        R=R,
        R_err=_robust_sigma(boots) if len(idx) > 1 else float("nan"),
        R_ci=(float(np.percentile(boots, 16)), float(np.percentile(boots, 84))),
        used=used,
        rel_resid=(T - V / R) / T,
    )


# ---------------------------------------------------------------------------
# T_iss0 floor and Q from isolated bursts
# ---------------------------------------------------------------------------


@dataclass
class IsolatedFit:
    K: int
    a: float  # s
    b: float  # s/byte  (T_iss0 = a + b V)
    Q: float  # bytes (a lower bound when knee_found is False)
    knee_found: bool
    knee_V: float  # bytes, where the floor meets (V - Q)/R (nan without a knee)
    n_floor: int
    n_drain: int
    rel_rmse: float
    Q_err: float = float("nan")
    Q_ci: tuple = (float("nan"), float("nan"))
    a_err: float = float("nan")

    def t_iss0(self, V) -> np.ndarray:
        return self.a + self.b * np.asarray(V, dtype=float)

    def t_iss_iso(self, V, R: float) -> np.ndarray:
        V = np.asarray(V, dtype=float)
        return np.maximum(self.t_iss0(V), (V - self.Q) / R)

    def as_dict(self) -> dict:
        return {
            "K": self.K,
            "t_iss0_a_us": self.a * 1e6,
            "t_iss0_a_err_us": self.a_err * 1e6,
            "t_iss0_slope_us_per_MiB": self.b * 1e6 * 2**20,
            "Q_bytes": self.Q,
            "Q_err_bytes": self.Q_err,
            "Q_ci_bytes": list(self.Q_ci),
            "Q_is_lower_bound": not self.knee_found,
            "knee_V_bytes": self.knee_V,
            "n_floor": self.n_floor,
            "n_drain": self.n_drain,
            "rel_rmse": self.rel_rmse,
        }


def _affine_rel(V: np.ndarray, T: np.ndarray) -> tuple:
    """(a, b) minimizing sum(((T - a - bV)/T)^2), with b >= 0."""
    if len(V) == 1 or np.ptp(V) == 0:
        w = 1.0 / T**2
        return float(np.sum(w * T) / np.sum(w)), 0.0
    A = np.stack([1.0 / T, V / T], axis=1)
    (a, b), *_ = np.linalg.lstsq(A, np.ones_like(T), rcond=None)
    if b < 0:
        w = 1.0 / T**2
        return float(np.sum(w * T) / np.sum(w)), 0.0
    return float(a), float(b)


def _fit_isolated_once(V: np.ndarray, T: np.ndarray, R: float, min_excess: float) -> tuple:
    """Best split into floor / drain branch; returns (a, b, Q, knee_found, n_floor, rel_rmse)."""
    order = np.argsort(V, kind="stable")
    V, T = V[order], T[order]
    n = len(V)
    best = None
    for j in range(1, n + 1):
        a, b = _affine_rel(V[:j], T[:j])
        if j < n:
            Vd, Td = V[j:], T[j:]
            # Drain-branch points must sit clearly above the extrapolated floor.
            if np.any(Td < (1.0 + min_excess) * (a + b * Vd)):
                continue
            w = 1.0 / Td**2
            Q = float(np.sum(w * (Vd - R * Td)) / np.sum(w))
            if Q <= 0:
                continue
            knee = True
        else:
            Q = float(max(np.max(V - R * (a + b * V)), 0.0))
            knee = False
        model = np.maximum(a + b * V, (V - Q) / R) if knee else a + b * V
        err = float(np.sqrt(np.mean(((T - model) / T) ** 2)))
        if best is None or err < best[5] - 1e-12:
            best = (a, b, Q, knee, j, err)
    return best


def _robust_sigma(x) -> float:
    """Half the 16th..84th percentile range (1 sigma for a normal spread)."""
    x = np.asarray(x, dtype=float)
    if len(x) < 3:
        return float("nan")
    return float((np.percentile(x, 84) - np.percentile(x, 16)) / 2)


def fit_isolated(
    V: Sequence[float],
    T_iso: Sequence[float],
    R: float,
    *,
    K: int = 0,
    R_err: float = 0.0,
    min_excess: float = 0.10,
    n_boot: int = 300,
    seed: int = 0,
) -> IsolatedFit:
    """Fit eq. 7 ``T_iss^iso(V) = max(a + b V, (V - Q)/R)`` for one producer count K."""
    V, T = _positive_points(V, T_iso, "isolated", "T")
    if not R > 0:
        raise ValueError(f"R must be > 0, got {R}")
    a, b, Q, knee, j, err = _fit_isolated_once(V, T, R, min_excess)
    knee_V = (a * R + Q) / (1.0 - b * R) if knee and b * R < 1 else float("nan")
    rng = np.random.default_rng(seed)
    Qs, As = [], []
    for _ in range(n_boot):
        s = rng.choice(len(V), size=len(V), replace=True)
        if len(np.unique(V[s])) < 2:
            continue
        Rb = R + (rng.normal() * R_err if R_err and math.isfinite(R_err) else 0.0)
        res = _fit_isolated_once(V[s], T[s], max(Rb, 1e-9 * R), min_excess)
        if res is None:
            continue
        if res[3] == knee:  # same model branch as the fit: spread of comparable estimates
            Qs.append(res[2])
            As.append(res[0])
    Qs, As = np.asarray(Qs), np.asarray(As)
    return IsolatedFit(
        K=int(K), a=a, b=b, Q=Q, knee_found=bool(knee), knee_V=float(knee_V), n_floor=int(j),
        n_drain=int(len(V) - j), rel_rmse=err,
        Q_err=_robust_sigma(Qs),
        Q_ci=(float(np.percentile(Qs, 16)), float(np.percentile(Qs, 84))) if len(Qs) > 1 else (float("nan"),) * 2,
        a_err=_robust_sigma(As),
    )


# ---------------------------------------------------------------------------
# Burst–Gap prediction (eq. 1–3) and validation
# ---------------------------------------------------------------------------


def predict_t_iss(t_iss0, V, G, R: float):
    """Eq. 3: ``T_iss = max(T_iss0, V/R - G)``."""
    return np.maximum(np.asarray(t_iss0, dtype=float), np.asarray(V, dtype=float) / R - np.asarray(G, dtype=float))


def predict_t_period(t_iss0, V, G, R: float):
    """Eq. 1–2: ``T_period = max(T_iss0 + G, V/R)``."""
    return np.maximum(np.asarray(t_iss0, dtype=float) + np.asarray(G, dtype=float), np.asarray(V, dtype=float) / R)


FLOW_TOL = 0.03


def filling(V, T_period, R: float, tol: float = FLOW_TOL):
    """True where a run injected faster than the drain (V/T_period > R(1+tol)).

    Flow conservation forbids that in steady state, so such a run was still
    filling the queue (transient longer than the run): while the queue fills
    the issue time stays at its floor, so the transient is invisible in the
    issue-time series alone.
    """
    return np.asarray(V, dtype=float) / np.asarray(T_period, dtype=float) > R * (1.0 + tol)


def validate_sweeps(points: List[dict], R: float, plateau: Dict[tuple, float]) -> List[dict]:
    """Predict every gap-sweep point from R and the (K, B) plateau; returns rows with errors.

    ``points``: dicts with K, B, V, G_eff, T_iss, T_period (seconds, bytes).
    ``plateau[(K, B)]``: T_iss0 for that configuration (isolated burst).
    Rows get ``steady_flow``: settled series and no injection above R.
    """
    rows = []
    for p in points:
        key = (int(p["K"]), int(p["B"]))
        if key not in plateau:
            raise KeyError(f"no T_iss0 plateau for K={key[0]}, B={key[1]}")
        t0 = plateau[key]
        pi = float(predict_t_iss(t0, p["V"], p["G_eff"], R))
        pp = float(predict_t_period(t0, p["V"], p["G_eff"], R))
        rows.append({
            **p,
            "t_iss0": t0,
            "G_star": max(p["V"] / R - t0, 0.0),
            "T_iss_pred": pi,
            "T_period_pred": pp,
            "err_T_iss": (p["T_iss"] - pi) / pi,
            "err_T_period": (p["T_period"] - pp) / pp,
            "steady_flow": bool(p.get("steady", True)) and not bool(filling(p["V"], p["T_period"], R)),
        })
    return rows


def _err_stats(errs: Iterable[float]) -> dict:
    e = np.abs(np.asarray(list(errs), dtype=float))
    if len(e) == 0:
        return {"n": 0, "median_abs_rel": None, "max_abs_rel": None, "p90_abs_rel": None}
    return {
        "n": int(len(e)),
        "median_abs_rel": float(np.median(e)),
        "p90_abs_rel": float(np.percentile(e, 90)),
        "max_abs_rel": float(np.max(e)),
    }


@dataclass
class TargetFit:
    target: str
    drain: DrainFit
    isolated: Dict[int, IsolatedFit]
    plateau: Dict[tuple, float]
    plateau_source: Dict[tuple, str]
    sweep_rows: List[dict] = field(default_factory=list)
    zero_gap_rows: List[dict] = field(default_factory=list)

    def summary(self) -> dict:
        out = {
            "target": self.target,
            "R": self.drain.as_dict(),
            "isolated": {str(k): f.as_dict() for k, f in sorted(self.isolated.items())},
            "plateau_us": {f"K={k},B={b}": v * 1e6 for (k, b), v in sorted(self.plateau.items())},
            "plateau_source": {f"K={k},B={b}": s for (k, b), s in sorted(self.plateau_source.items())},
        }
        by_mode: Dict[str, List[dict]] = {}
        for r in self.sweep_rows:
            by_mode.setdefault(r.get("gap_mode", "spin"), []).append(r)
        out["validation"] = {}
        for mode, rows in sorted(by_mode.items()):
            st = [r for r in rows if r.get("steady_flow", True)]
            out["validation"][mode] = {
                "T_iss": _err_stats(r["err_T_iss"] for r in rows),
                "T_period": _err_stats(r["err_T_period"] for r in rows),
                "steady_only": {
                    "T_iss": _err_stats(r["err_T_iss"] for r in st),
                    "T_period": _err_stats(r["err_T_period"] for r in st),
                },
                "n_filling_or_unsettled": len(rows) - len(st),
                "volumes": sorted({int(r["V"]) for r in rows}),
                "n_gaps_per_volume": {str(int(v)): sum(1 for r in rows if int(r["V"]) == int(v))
                                       for v in sorted({int(r["V"]) for r in rows})},
            }
        return out


def fit_points(points: List[dict], target: str, *, seed: int = 0, min_excess: float = 0.10) -> TargetFit:
    """Fit one target's measurements.

    ``points``: launch summaries with keys experiment ("zero_gap" | "isolated"
    | "gap_sweep"), gap_mode, K, B, V and T_iss / T_period / G_eff (seconds).
    """
    pts = [p for p in points if p.get("target", target) == target]
    zg = [p for p in pts if p["experiment"] == "zero_gap"]
    iso = [p for p in pts if p["experiment"] == "isolated"]
    sw = [p for p in pts if p["experiment"] == "gap_sweep"]
    if len(zg) < 2:
        raise ValueError(f"target {target}: need >= 2 zero-gap points to fit R, got {len(zg)}")
    drain = fit_drain_rate([p["V"] for p in zg], [p["T_period"] for p in zg], seed=seed)
    zrows = [{**p, "drain_limited": bool(u), "T_period_model": p["V"] / drain.R}
             for p, u in zip(zg, drain.used)]
    fits: Dict[int, IsolatedFit] = {}
    for K in sorted({int(p["K"]) for p in iso}):
        sel = [p for p in iso if int(p["K"]) == K]
        if len(sel) >= 2:
            fits[K] = fit_isolated([p["V"] for p in sel], [p["T_iss"] for p in sel], drain.R,
                                   K=K, R_err=drain.R_err, seed=seed, min_excess=min_excess)
    plateau: Dict[tuple, float] = {}
    source: Dict[tuple, str] = {}
    iso_at = {(int(p["K"]), int(p["B"])): p["T_iss"] for p in iso}
    for p in sw:
        key = (int(p["K"]), int(p["B"]))
        if key in plateau:
            continue
        if key in iso_at:
            plateau[key], source[key] = iso_at[key], "isolated burst at this (K, B)"
        elif key[0] in fits:
            plateau[key] = float(fits[key[0]].t_iss_iso(p["V"], drain.R))
            source[key] = "eq. 7 fit of isolated bursts"
        else:
            raise ValueError(f"target {target}: no isolated data for K={key[0]} to predict the sweep")
    rows = validate_sweeps(sw, drain.R, plateau) if sw else []
    return TargetFit(target, drain, fits, plateau, source, rows, zrows)


# ---------------------------------------------------------------------------
# Platform profile
# ---------------------------------------------------------------------------


def build_profile(
    fit: TargetFit,
    *,
    name: str,
    description: str,
    gpu: str,
    num_sms: int,
    target: str,
    provenance: Optional[dict] = None,
    volumes: Optional[Sequence[float]] = None,
) -> dict:
    """Platform JSON (schema ``xstage-platform/1``, see ``xstage.profiles``).

    ``t_iss0_us`` is a table over the isolated fits' K and the given volumes
    (default: the isolated volumes) of the fitted floor ``a_K + b_K V``;
    ``Q_bytes`` maps K to Q(K) (lower bounds are marked in ``uncertainty``).
    """
    if not fit.isolated:
        raise ValueError("no isolated-burst fit: cannot build T_iss0 and Q")
    ks = sorted(fit.isolated)
    if volumes is None:
        volumes = [2.0**e for e in range(16, 27)]
    vols = sorted({float(v) for v in volumes})
    us = [[float(fit.isolated[k].t_iss0(v)) * 1e6 for v in vols] for k in ks]
    t0: object = {"K": ks, "V_bytes": vols, "us": us} if (len(ks) > 1 or len(vols) > 1) else us[0][0]
    q = {str(k): float(fit.isolated[k].Q) for k in ks}
    unc = {
        "R_err_bytes_per_s": fit.drain.R_err,
        "Q_err_bytes": {str(k): fit.isolated[k].Q_err for k in ks},
        "Q_is_lower_bound": {str(k): not fit.isolated[k].knee_found for k in ks},
        "t_iss0_a_err_us": {str(k): fit.isolated[k].a_err * 1e6 for k in ks},
    }
    prof = {
        "schema": "xstage-platform/1",
        "name": name,
        "source": "measured",
        "description": description,
        "gpu": gpu,
        "target": target,
        "num_sms": int(num_sms),
        "R_bytes_per_s": float(fit.drain.R),
        "t_iss0_us": t0,
        "Q_bytes": q,
        "uncertainty": _jsonable(unc),
        "notes": {
            "R": "zero-gap periodic bursts, drain-limited points, T_period = V/R (relative least squares)",
            "t_iss0": "isolated bursts before the knee: T_iss0 = a_K + b_K V (table evaluated on a V grid; "
                      "clamped outside by the loader)",
            "Q": "isolated-burst knee, eq. 6-7 (T_iss = (V - Q)/R past the knee)",
            "validation": _jsonable(fit.summary().get("validation", {})),
        },
    }
    if provenance is not None:
        prof["provenance"] = _jsonable(provenance)
    return prof


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, float)):
        v = float(x)
        return v if math.isfinite(v) else None
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x
