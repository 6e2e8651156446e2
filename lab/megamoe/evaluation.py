"""The MegaMoE X-Stage evaluation from a sweep JSON (:mod:`lab.megamoe.sweep`), on a CPU:
the analogues of the paper's Figure 8 (speedup of interleaved over expert_wave per model and
routing, the loopback control next to the remote Combine over PCIe), Figure 10 (the
distributions of the Linear-2 tiles' sender-visible remote-store span T_RS per schedule, remote
vs the loopback control) and Table 2 (per shape: span wave / interleaved, mainloop L2 / L1,
predicted / measured stall), the whole kernel against the drain-rate bound
(:func:`xstage.model.kernel_rate_bounds`), and a markdown README (its text:
lab/templates/megamoe_xstage_readme.md, filled with the tables): geometric mean, median and max speedup per
world next to the paper's 1.18x / 1.17x / 1.62x, the sign-test verdict per cell, and the
regressions (cells where interleaved is slower) for the author to explain. Figures need
matplotlib (the ``plot`` extra); without it they are skipped with a message, the tables stay.
The command line is ``scripts/megamoe_xstage_report.py`` (:func:`main`).
"""
from __future__ import annotations

import argparse
import math
import importlib.util
import statistics
from collections import Counter
from pathlib import Path
from typing import Mapping, Optional, Sequence

from lab import bench as xbench
from lab.megamoe.sweep import DEFAULT_OUT, NO_PREDICTION, QUANTILES, ROUTINGS, WORLDS, load_sweep
from lab.multigpu import geomean
from lab.report import Templates, fmt, md_table

# The paper's MegaMoE headline (Section 5.2.1): 84 configurations on eight GPUs.
PAPER = {"geomean": 1.18, "median": 1.17, "max": 1.62, "configs": 84,
         "setting": "8 GPUs (NVLink/NVSwitch), W4A8 and W8A8, seven model shapes, EP = 8"}
FIGURE8 = "fig8_speedup.png"
FIGURE10 = "fig10_rs_span.png"
RATE_FIGURE = "rate_bound.png"
FINDINGS = "findings.md"  # hand-written notes of a results folder, included in its README
README_TEMPLATE = "megamoe_xstage_readme.md"  # the README's text, under lab/templates/
ROUTING_COLORS = {"balanced": "tab:green", "skewed1": "tab:orange", "skewed2": "tab:red"}
SCHEDULE_COLORS = {"expert_wave": "tab:red", "interleaved": "tab:blue"}


# ----------------------------------------------------------------------------- selections


def measured_cells(payload: Mapping) -> list:
    """The records that hold a measured speedup."""
    return [r for r in payload.get("cells", [])
            if r.get("status") == "ok" and (r.get("timing") or {}).get("speedup") is not None]


def apply_rechecks(payload: Mapping, rechecks: Sequence[tuple]) -> dict:
    """``payload`` with the timing of each cell re-measured in a recheck sweep (same protocol, more
    trials; ``rechecks``: (name, payload) pairs) in place of the sweep's, traces kept. The
    replaced cells are listed under ``rechecked`` (cell, file, trials, both speedups) for the
    README; a recheck's ``auto`` (``--with-auto``) replaces the cell's too. A recheck cell absent
    from the sweep is an error."""
    cells = [dict(r) for r in payload.get("cells", [])]
    index = {tuple(sorted(r["cell"].items())): i for i, r in enumerate(cells)}
    done = []
    for name, rp in rechecks:
        for r in [c for c in rp.get("cells", []) if c.get("status") == "ok"]:
            key = tuple(sorted(r["cell"].items()))
            if key not in index:
                raise ValueError(f"recheck {name}: cell {r['cell']} is not in the sweep")
            old = cells[index[key]]
            done.append(dict(cell=r["cell"], file=name, trials=r["timing"]["n_trials"],
                             matched=r["timing"]["n_matched"], sweep_speedup=old["timing"].get("speedup"),
                             recheck_speedup=r["timing"].get("speedup")))
            cells[index[key]] = dict(old, timing=r["timing"], **({"auto": r["auto"]} if "auto" in r else {}))
    return dict(payload, cells=cells, rechecked=done)


def _label(cell: Mapping) -> str:
    """A cell's label (:attr:`sweep.Cell.label`) from a record's cell dict or a row holding its keys."""
    from lab.megamoe.sweep import Cell

    return Cell(cell["shape"], cell["routing"], cell["tokens"], cell["world"], cell["P"],
                cell.get("precision", "bf16")).label


def _x4(ratio) -> str:
    return "inconclusive" if ratio is None else f"{ratio:.4f}x"


def _c(rec, field):
    return rec["cell"][field]


def _us(ns):
    return None if ns is None else ns / 1e3


def _trace(rec, schedule) -> dict:
    return ((rec.get("schedules") or {}).get(schedule) or {}).get("trace") or {}


def stats(speedups: Sequence[float]) -> dict:
    """n, geometric mean, median, max, min of speedups (None entries for none)."""
    s = [float(x) for x in speedups]
    if not s:
        return dict(n=0, geomean=None, median=None, max=None, min=None)
    return dict(n=len(s), geomean=geomean(s), median=statistics.median(s), max=max(s), min=min(s))


def speedup_summary(cells: Sequence[Mapping]) -> dict:
    """Speedup statistics (:func:`stats`) and sign-test verdict counts: every cell, per world and
    per (world, P)."""
    groups = {"all": list(cells)}
    for world in WORLDS:
        groups[world] = [r for r in cells if _c(r, "world") == world]
    for world in WORLDS:
        for P in sorted({_c(r, "P") for r in cells}):
            groups[f"{world}, P={P}"] = [r for r in cells if (_c(r, "world"), _c(r, "P")) == (world, P)]
    groups = {k: v for k, v in groups.items() if v or k == "all"}
    out = {}
    for name, recs in groups.items():
        d = stats([r["timing"]["speedup"] for r in recs])
        d["verdicts"] = dict(Counter(r["timing"]["verdict"] for r in recs))
        out[name] = d
    return out


def figure8_rows(cells: Sequence[Mapping]) -> list:
    """Per (shape, routing, world): the cells' speedups over P and tokens (geometric mean, min,
    max, count), in the sweep's order of shapes and :data:`ROUTINGS` / :data:`WORLDS` order."""
    groups = {}
    for rec in cells:
        groups.setdefault((_c(rec, "shape"), _c(rec, "routing"), _c(rec, "world")), []).append(rec)
    shapes = list(dict.fromkeys(_c(r, "shape") for r in cells))
    rows = []
    for (shape, routing, world), recs in sorted(groups.items(), key=lambda kv: (
            shapes.index(kv[0][0]), list(ROUTINGS).index(kv[0][1]), list(WORLDS).index(kv[0][2]))):
        s = stats([r["timing"]["speedup"] for r in recs])
        rows.append(dict(shape=shape, routing=routing, world=world, cells=s["n"], geomean=s["geomean"], min=s["min"],
                         max=s["max"], speedups=[r["timing"]["speedup"] for r in recs]))
    return rows


def select_cell(cells: Sequence[Mapping], shape: str, world: str, routing: str, P: Optional[int] = None):
    """The record of ``shape`` / ``world`` / ``routing`` at ``P`` (None: the largest P measured)
    with the most tokens per rank, or None."""
    recs = [r for r in cells if (_c(r, "shape"), _c(r, "world"), _c(r, "routing")) == (shape, world, routing)]
    if P is None and recs:
        P = max(_c(r, "P") for r in recs)
    recs = [r for r in recs if _c(r, "P") == P]
    return max(recs, key=lambda r: _c(r, "tokens")) if recs else None


def _shapes(cells) -> list:
    return list(dict.fromkeys(_c(r, "shape") for r in cells))


def figure10_rows(cells: Sequence[Mapping], shapes: Optional[Sequence[str]] = None, routing: str = "skewed1",
                  P: Optional[int] = None, max_shapes: int = 3) -> list:
    """T_RS of the L2 tiles per (shape, world, schedule) of the cell :func:`select_cell` picks
    (us: median, p10, p90, p99 and the :data:`QUANTILES`), for ``shapes`` (default: the first
    ``max_shapes`` measured), remote next to the loopback control, and the span the model
    predicts (loopback+host)."""
    shapes = list(shapes) if shapes is not None else _shapes(cells)[:max_shapes]
    rows = []
    for shape in shapes:
        for world in WORLDS:
            rec = select_cell(cells, shape, world, routing, P)
            if rec is None:
                continue
            m = rec.get("model") or {}
            for sched, tag in (("expert_wave", "wave"), ("interleaved", "interleaved")):
                rs = _trace(rec, sched).get("rs_ns") or {}
                if not rs.get("n"):
                    continue
                rows.append(dict(shape=shape, world=world, schedule=sched, routing=routing, P=_c(rec, "P"),
                                 tokens=_c(rec, "tokens"), tiles=rs["n"], median_us=_us(rs["median"]),
                                 p10_us=_us(rs["p10"]), p90_us=_us(rs["p90"]), p99_us=_us(rs["p99"]),
                                 predicted_us=m.get(f"predicted_rs_{tag}_us"),
                                 quantiles_us=[_us(q) for q in rs.get("quantiles") or []]))
    return rows


def table2_rows(cells: Sequence[Mapping], world: str = "loopback+host", routing: str = "skewed1",
                P: Optional[int] = None) -> list:
    """Table 2 per shape, from the cell :func:`select_cell` picks (us): T_RS medians wave /
    interleaved; the expert_wave trace's L2 / L1 mainloop medians (the model's inputs); the
    median predicted (eq. 15) / measured stall over the sampled L2 tiles, per schedule; the
    share of tiles predicted zero under interleaving; eq. 14; the cell's speedup."""
    rows = []
    for shape in _shapes(cells):
        rec = select_cell(cells, shape, world, routing, P)
        if rec is None:
            continue
        ew, il = _trace(rec, "expert_wave"), _trace(rec, "interleaved")

        def med(tr, *path):
            d = tr
            for p in path:
                d = (d or {}).get(p)
            return _us(d)

        m = rec.get("model") or {}
        rows.append(dict(
            shape=shape, world=world, routing=routing, P=_c(rec, "P"), tokens=_c(rec, "tokens"),
            span_wave_us=med(ew, "rs_ns", "median"), span_interleaved_us=med(il, "rs_ns", "median"),
            mma_l2_us=med(ew, "l2_mainloop_ns", "median"), mma_l1_us=med(ew, "l1_mainloop_ns", "median"),
            stall_wave_pred_us=med(ew, "stall", "predicted_ns", "median"),
            stall_wave_meas_us=med(ew, "stall", "measured_ns", "median"),
            stall_int_pred_us=med(il, "stall", "predicted_ns", "median"),
            stall_int_meas_us=med(il, "stall", "measured_ns", "median"),
            int_pred_zero_frac=(il.get("stall") or {}).get("predicted_zero_frac"),
            sampled_wave=(ew.get("stall") or {}).get("sampled"), sampled_int=(il.get("stall") or {}).get("sampled"),
            eq14_holds=m.get("interleave_sufficient"), speedup=rec["timing"]["speedup"]))
    return rows


def verdict_rows(cells: Sequence[Mapping]) -> list:
    """One row per cell: its key, speedup, sign-test verdict and p values, matched trials."""
    out = []
    for rec in cells:
        t = rec["timing"]
        out.append(dict(rec["cell"], speedup=t["speedup"], verdict=t["verdict"], n_matched=t.get("n_matched"),
                        n_trials=t.get("n_trials"), p_interleaved_faster=t.get("p_interleaved_faster"),
                        p_interleaved_slower=t.get("p_interleaved_slower"),
                        expert_wave_median_us=t.get("expert_wave_median_us"),
                        interleaved_median_us=t.get("interleaved_median_us")))
    return out


# Linear-1 has 2I outputs over K = H, Linear-2 H outputs over K = I: 2/3 of the FLOPs are L1's.
L1_FLOP_SHARE = 2.0 / 3.0


def _controls(cells: Sequence[Mapping]) -> dict:
    """The loopback cells by (shape, routing, tokens, P, precision): each remote cell's control."""
    return {_control_key(rec["cell"]): rec for rec in cells if rec["cell"]["world"] == "loopback"}


def _control_key(c: Mapping) -> tuple:
    return c["shape"], c["routing"], c["tokens"], c["P"], c["precision"]


def rate_bound_rows(cells: Sequence[Mapping]) -> list:
    """Per remote-path cell with its loopback control: the whole-kernel prediction of
    :func:`xstage.model.kernel_rate_bounds` -- the control's time of each schedule as its
    uncontended compute (split 2:1 into L1 and L2 by FLOPs), the Combine of all P simulated ranks
    (they share the one path) over the profile's R -- next to the measured times (us)."""
    from xstage import model, profiles

    from megamoe_interleave.shapes import get_shape

    control = _controls(cells)
    out = []
    for rec in cells:
        c, m = rec["cell"], rec.get("model") or {}
        lb = (control.get(_control_key(c)) or {}).get("timing")
        times = [t.get(f"{s}_median_us") for t in (lb or {}, rec["timing"]) for s in ("expert_wave", "interleaved")]
        if c["world"] == "loopback" or lb is None or not m.get("platform") or None in times:
            continue
        shape = get_shape(c["shape"])
        volume = c["P"] * c["tokens"] * shape.topk * shape.hidden * 2
        rate = profiles.load(m["platform"]).R
        row = dict(c, drain_us=volume / rate * 1e6)
        for sched, pick in (("expert_wave", 1), ("interleaved", 0)):
            t_c = lb[f"{sched}_median_us"] * 1e-6
            pred = model.kernel_rate_bounds(L1_FLOP_SHARE * t_c, (1 - L1_FLOP_SHARE) * t_c, volume, rate)[pick]
            row[f"{sched}_control_us"] = t_c * 1e6
            row[f"{sched}_predicted_us"] = pred * 1e6
            row[f"{sched}_measured_us"] = rec["timing"][f"{sched}_median_us"]
            row[f"{sched}_measured_over_predicted"] = row[f"{sched}_measured_us"] / row[f"{sched}_predicted_us"]
        row["speedup_predicted"] = row["expert_wave_predicted_us"] / row["interleaved_predicted_us"]
        row["speedup_measured"] = rec["timing"]["speedup"]
        out.append(row)
    return out


def rate_bound_summary(rows: Sequence[Mapping]) -> list:
    """Per world, P and routing: median (min - max) of measured / predicted per schedule and the
    geometric mean speedup measured / predicted."""
    groups = {}
    for r in rows:
        groups.setdefault((r["world"], r["P"], r["routing"]), []).append(r)
    out = []
    for (world, P, routing), rs in sorted(groups.items()):
        row = dict(world=world, P=P, routing=routing, cells=len(rs))
        for sched in ("expert_wave", "interleaved"):
            x = [r[f"{sched}_measured_over_predicted"] for r in rs]
            row[sched] = (statistics.median(x), min(x), max(x))
        row["speedup_measured"] = geomean([r["speedup_measured"] for r in rs])
        row["speedup_predicted"] = geomean([r["speedup_predicted"] for r in rs])
        out.append(row)
    return out


def planner_verdicts(cells: Sequence[Mapping]) -> list:
    """Per remote-path cell with its loopback control: the planner's verdict fed with the cell's own
    (contended) expert_wave mainloops, as the sweep recorded it, and re-run with the control's
    (uncontended) mainloops (:func:`sweep.cell_model`), next to the measured speedup."""
    from megamoe_interleave.shapes import get_shape
    from lab.megamoe.sweep import Cell, cell_model

    control = _controls(cells)
    out = []
    for rec in cells:
        c, m = rec["cell"], rec.get("model") or {}
        lb = control.get(_control_key(c))
        lb_trace = _trace(lb, "expert_wave") if lb else {}
        if (c["world"] == "loopback" or not m.get("platform") or None in (m.get("block_n"), m.get("verdict"))
                or not lb_trace.get("l1_mainloop_ns")):
            continue
        clean = cell_model(Cell.from_dict(c), get_shape(c["shape"]), m["block_n"], m.get("lead_rows"), lb_trace)
        out.append(dict(c, speedup=rec["timing"]["speedup"], verdict_contended=m["verdict"],
                        verdict_uncontended=clean["verdict"], l2_mainloop_contended_us=m["t_l2_mma_us"],
                        l2_mainloop_uncontended_us=clean["t_l2_mma_us"]))
    return out


def planner_verdict_summary(rows: Sequence[Mapping]) -> list:
    """Per planner verdict and mainloop input: cells and the speedups measured there."""
    out = []
    for inputs in ("contended", "uncontended"):
        groups = {}
        for r in rows:
            groups.setdefault(r[f"verdict_{inputs}"], []).append(r["speedup"])
        for verdict, sp in sorted(groups.items()):
            out.append(dict(mainloops=inputs, verdict=verdict, cells=len(sp), median=statistics.median(sp),
                            min=min(sp), max=max(sp)))
    return out


def call_expert_rows(shape, kind: str, P: int, tokens: int, strength: float = 1.0) -> list:
    """Rows per local expert of every destination rank for the sweep's routing of a cell (the
    routing :func:`bench.make_inputs` draws, regenerated on the CPU): what a fused ``forward``
    of that cell hands ``schedule="auto"`` per call."""
    from lab.megamoe.routing import expert_load, make_routing

    load = sum(expert_load(make_routing(kind, tokens, shape.num_experts, shape.topk, seed=src, strength=strength)[0],
                           shape.num_experts) for src in range(P))
    el = shape.num_experts // P
    return [load[d * el:(d + 1) * el].tolist() for d in range(P)]


def auto_rows(cells: Sequence[Mapping], num_sms: int = 132) -> list:
    """``schedule="auto"`` over the sweep: per cell the schedule ``MegaMoEConfig("auto")`` picks
    for the cell's call (:meth:`MegaMoEConfig.choose_schedule`, the function ``forward`` calls:
    with a remote path from the call's routing, :func:`call_expert_rows`; host arithmetic, no
    measurement), and its time against the better fixed schedule from the cell's paired trials
    (auto runs the kernel of the schedule it picks, so its time is that schedule's)."""
    from xstage import profiles

    from megamoe_interleave.config import MegaMoEConfig
    from megamoe_interleave.shapes import get_shape
    from lab.megamoe.sweep import PLATFORM_OF_WORLD, ROUTINGS

    out = []
    for rec in cells:
        c, t = rec["cell"], rec["timing"]
        shape = get_shape(c["shape"])
        name = PLATFORM_OF_WORLD[c["world"]]
        platform = profiles.load(name) if name else None
        kind, strength = ROUTINGS[c["routing"]]
        rows = None if platform is None else call_expert_rows(shape, kind, c["P"], c["tokens"], strength or 1.0)
        _, choice = MegaMoEConfig("auto", precision=c.get("precision", "bf16")).choose_schedule(
            shape, c["P"], c["tokens"], num_sms, platform, expert_rows=rows)
        sp = t["speedup"]  # expert_wave / interleaved, paired median
        over_better = max(1.0, 1.0 / sp) if choice.schedule == "interleaved" else max(1.0, sp)
        out.append(dict(c, pick=choice.schedule, speedup=sp, auto_over_better=over_better,
                        expert_wave_us=t["expert_wave_median_us"], interleaved_us=t["interleaved_median_us"],
                        auto_us=t[f"{choice.schedule}_median_us"], reason=choice.reason))
    return out


def auto_summary(rows: Sequence[Mapping]) -> list:
    """Per world and overall: cells, picks, cells where auto is more than 1 % slower than the better
    fixed schedule, the worst such ratio, and the geometric means of auto's time over each fixed
    schedule's."""
    def geo(xs):
        return math.exp(sum(math.log(x) for x in xs) / len(xs))

    out = []
    for world in sorted({r["world"] for r in rows}) + ["all"]:
        rs = [r for r in rows if world in ("all", r["world"])]
        if not rs:
            continue
        out.append(dict(world=world, cells=len(rs), picks_interleaved=sum(r["pick"] == "interleaved" for r in rs),
                        over_1pct=sum(r["auto_over_better"] > 1.01 for r in rs),
                        worst=max(r["auto_over_better"] for r in rs),
                        geo_over_interleaved=geo([r["auto_us"] / r["interleaved_us"] for r in rs]),
                        geo_over_expert_wave=geo([r["auto_us"] / r["expert_wave_us"] for r in rs])))
    return out


def measured_auto_rows(cells: Sequence[Mapping], min_matched: int = 5) -> list:
    """``schedule="auto"`` timed in the cells' own paired trials (``sweep_megamoe.py --with-auto``):
    per cell its pick, its median per-trial ratio to each fixed schedule and to the better, and
    whether both comparisons had ``min_matched`` clock-matched trials (``conclusive``)."""
    out = []
    for rec in cells:
        a = rec.get("auto")
        if not a or a.get("over_better") is None:
            continue
        matched = min(a["n_matched_expert_wave"], a["n_matched_interleaved"])
        out.append(dict(rec["cell"], pick=a["pick"], over_expert_wave=a["over_expert_wave"],
                        over_interleaved=a["over_interleaved"], over_better=a["over_better"], matched=matched,
                        trials=rec["timing"]["n_trials"], conclusive=matched >= min_matched))
    return out


def measured_auto_summary(rows: Sequence[Mapping]) -> list:
    """Per world and overall: cells, expert_wave picks, cells over 1 %, the worst, geometric means
    of auto / each schedule, and the spread of auto / interleaved where auto ran interleaved's
    kernel (identical kernels: the paired measurement's noise floor); conclusive cells only."""
    out = []
    for world in sorted({r["world"] for r in rows}) + ["all"]:
        rs = [r for r in rows if world in ("all", r["world"]) and r["conclusive"]]
        if not rs:
            continue
        same = [r["over_interleaved"] for r in rs if r["pick"] == "interleaved" and r["over_interleaved"] is not None]
        out.append(dict(world=world, cells=len(rs), picks_expert_wave=sum(r["pick"] == "expert_wave" for r in rs),
                        over_1pct=sum(r["over_better"] > 1.01 for r in rs), worst=max(r["over_better"] for r in rs),
                        geo_over_interleaved=geomean([r["over_interleaved"] for r in rs if r["over_interleaved"]]),
                        geo_over_expert_wave=geomean([r["over_expert_wave"] for r in rs if r["over_expert_wave"]]),
                        same_kernel_min=min(same) if same else None, same_kernel_max=max(same) if same else None))
    return out


def regressions(cells: Sequence[Mapping]) -> list:
    """The cells where interleaved is slower (speedup < 1), slowest first, with what the author
    needs to explain them: the verdict, the mainloop medians of both schedules (interleaving
    mixes experts: weight locality) and the measured stall medians (us)."""
    out = []
    for rec in sorted(cells, key=lambda r: r["timing"]["speedup"]):
        if rec["timing"]["speedup"] >= 1.0:
            continue
        ew, il = _trace(rec, "expert_wave"), _trace(rec, "interleaved")
        ml = lambda tr, k: _us(((tr.get(k) or {}).get("median")))  # noqa: E731
        st = lambda tr: _us(((tr.get("stall") or {}).get("measured_ns") or {}).get("median"))  # noqa: E731
        out.append(dict(rec["cell"], speedup=rec["timing"]["speedup"], verdict=rec["timing"]["verdict"],
                        l1_mainloop_us=(ml(ew, "l1_mainloop_ns"), ml(il, "l1_mainloop_ns")),
                        l2_mainloop_us=(ml(ew, "l2_mainloop_ns"), ml(il, "l2_mainloop_ns")),
                        stall_measured_us=(st(ew), st(il))))
    return out


def trace_overhead_summary(payload: Mapping) -> dict:
    """Per schedule: the median, min and max over the cells of the traced / untraced ratio."""
    out = {}
    for sched in ("expert_wave", "interleaved"):
        r = [((rec.get("schedules") or {}).get(sched) or {}).get("trace_overhead", {}).get("ratio")
             for rec in payload.get("cells", []) if rec.get("status") == "ok"]
        r = [x for x in r if x is not None]
        out[sched] = dict(n=len(r), median=statistics.median(r) if r else None, min=min(r, default=None),
                          max=max(r, default=None))
    return out


# ----------------------------------------------------------------------------- figures


def _pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with a message) without matplotlib."""
    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is not installed (pip install '.[plot]'): figures skipped; the tables are in the README")
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _legend(fig, axes, **kw) -> None:
    """One legend on the last panel with every label of every panel (each once)."""
    entries = {}
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, h)
    if entries:
        axes[-1].legend(list(entries.values()), list(entries), **kw)


def draw_rate_bound(rows: Sequence[Mapping], path) -> Optional[Path]:
    """Measured against predicted kernel time (:func:`rate_bound_rows`), one panel per P, both
    schedules, log-log, the line measured = predicted."""
    plt = _pyplot()
    if plt is None or not rows:
        return None
    from matplotlib import ticker

    Ps = sorted({r["P"] for r in rows})
    fig, axes = plt.subplots(1, len(Ps), figsize=(4.5 * len(Ps), 4.2), squeeze=False)
    for ax, P in zip(axes[0], Ps):
        sel = [r for r in rows if r["P"] == P]
        for sched, color in SCHEDULE_COLORS.items():
            ax.scatter([r[f"{sched}_predicted_us"] / 1e3 for r in sel], [r[f"{sched}_measured_us"] / 1e3 for r in sel],
                       s=14, color=color, label=sched)
        lo = min(min(r[f"{s}_predicted_us"], r[f"{s}_measured_us"]) for r in sel for s in SCHEDULE_COLORS) / 1e3
        hi = max(max(r[f"{s}_predicted_us"], r[f"{s}_measured_us"]) for r in sel for s in SCHEDULE_COLORS) / 1e3
        ax.plot([lo, hi], [lo, hi], color="gray", lw=0.8)
        ax.set(xscale="log", yscale="log", xlabel="predicted kernel time (ms)", ylabel="measured (ms)",
               title=f"{sel[0]['world']}, P = {P}")
        for axis in (ax.xaxis, ax.yaxis):  # plain numbers at 1, 2, 5 x 10^n
            axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            axis.set_minor_locator(ticker.LogLocator(subs=(2.0, 5.0)))
            axis.set_minor_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    _legend(fig, axes[0], loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def draw_figure8(rows: Sequence[Mapping], path) -> Optional[Path]:
    """Figure 8 analogue: per world a panel, per shape a group of bars (one per routing: the
    geometric mean over P and tokens), every cell's speedup as a dot; the line at 1."""
    plt = _pyplot()
    if plt is None or not rows:
        return None
    worlds = [w for w in WORLDS if any(r["world"] == w for r in rows)]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(worlds), figsize=(1.6 * len(shapes) * len(worlds) + 2, 4), squeeze=False,
                             sharey=True)
    width = 0.8 / len(ROUTINGS)
    for ax, world in zip(axes[0], worlds):
        for j, routing in enumerate(ROUTINGS):
            xs, ys = [], []
            for i, shape in enumerate(shapes):
                r = next((r for r in rows if (r["shape"], r["routing"], r["world"]) == (shape, routing, world)), None)
                if r is None:
                    continue
                x = i + (j - (len(ROUTINGS) - 1) / 2) * width
                xs.append(x)
                ys.append(r["geomean"])
                ax.plot([x] * len(r["speedups"]), r["speedups"], "k.", ms=3)
            if xs:
                ax.bar(xs, ys, width=width, label=routing, color=ROUTING_COLORS[routing])
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(shapes, rotation=30, ha="right")
        ax.set_title(world)
    axes[0][0].set_ylabel("speedup T_expert_wave / T_interleaved")
    _legend(fig, axes[0], title="routing")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def draw_figure10(rows: Sequence[Mapping], path) -> Optional[Path]:
    """Figure 10 analogue: per shape a panel of T_RS CDFs (log us), one line per (schedule,
    world): the remote path solid, the loopback control dashed; the model's predicted spans
    (loopback+host) as vertical lines."""
    plt = _pyplot()
    if plt is None or not rows:
        return None
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.2 * len(shapes), 3.6), squeeze=False)
    colors = SCHEDULE_COLORS
    levels = [q / 100 for q in QUANTILES]
    for ax, shape in zip(axes[0], shapes):
        for r in (r for r in rows if r["shape"] == shape):
            if not r["quantiles_us"]:
                continue
            ax.plot(r["quantiles_us"], levels, color=colors[r["schedule"]],
                    ls="-" if r["world"] == "loopback+host" else "--", label=f"{r['schedule']}, {r['world']}")
            if r["world"] == "loopback+host" and r["predicted_us"]:
                ax.axvline(r["predicted_us"], color=colors[r["schedule"]], lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_xlabel("T_RS of one L2 tile (us)")
        first = next(r for r in rows if r["shape"] == shape)
        ax.set_title(f"{shape} ({first['routing']}, P={first['P']}, T={first['tokens']})", fontsize=9)
    axes[0][0].set_ylabel("fraction of L2 tiles")
    _legend(fig, axes[0], fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- README


def _pair(a, b, spec="{:.2f}"):
    return f"{fmt(a, spec)} / {fmt(b, spec)}"


def readme(payload: Mapping, *, fig8: Optional[Path] = None, fig10: Optional[Path] = None,
           table2_world: str = "loopback+host", table2_routing: str = "skewed1", table2_P: Optional[int] = None,
           fig10_routing: str = "skewed1", fig10_shapes: Optional[Sequence[str]] = None,
           findings: Optional[str] = None, source: str = Path(DEFAULT_OUT).name,
           rate_fig: Optional[Path] = None) -> str:
    """The README of a sweep folder (markdown): :data:`README_TEMPLATE` filled with the tables and
    numbers of ``payload``; ``findings`` (the folder's hand-written ``findings.md``: what the
    numbers mean, every regression explained) goes after the method."""
    T = Templates(README_TEMPLATE)
    cells = measured_cells(payload)
    allrecs = payload.get("cells", [])
    status = Counter(r.get("status") for r in allrecs)
    runs = [r.get("provenance") or {} for r in payload.get("runs", [])]
    doc = {"header": dict(source=source, n_cells=len(allrecs), n_measured=status.get("ok", 0),
                          n_skipped=status.get("skipped", 0), n_failed=status.get("error", 0), n_runs=len(runs),
                          runs="; ".join(T.row("run", date=p.get("date_utc"), gpu=p.get("gpu"), commit=p.get("commit"))
                                         for p in runs),
                          time_scope=payload.get("time_scope", ""), paper_setting=PAPER["setting"])}
    doc["rechecked"] = dict(table=md_table(
        ["cell", "recheck", "trials (matched)", "speedup in the sweep", "speedup rechecked"],
        [[_label(r["cell"]), r["file"], f"{r['trials']} ({r['matched']})", _x4(r["sweep_speedup"]),
          _x4(r["recheck_speedup"])] for r in payload["rechecked"]])) if payload.get("rechecked") else None
    doc["findings"] = dict(findings=findings.strip()) if findings else None

    # Figure 8 / the headline
    rows = [["paper", PAPER["configs"], f"{PAPER['geomean']:.2f}x", f"{PAPER['median']:.2f}x", f"{PAPER['max']:.2f}x",
             "–", "–"]]
    for name, s in speedup_summary(cells).items():
        v = s["verdicts"]
        rows.append([name, s["n"], fmt(s["geomean"], "{:.3f}x"), fmt(s["median"], "{:.3f}x"), fmt(s["max"], "{:.3f}x"),
                     fmt(s["min"], "{:.3f}x"), f"{v.get('interleaved faster', 0)} / {v.get('interleaved slower', 0)} / "
                     f"{v.get('no significant difference', 0)} / {v.get('inconclusive', 0)}"])
    f8 = figure8_rows(cells)
    doc["figure8"] = dict(
        summary_table=md_table(["cells", "n", "geometric mean", "median", "max", "min",
                                "interleaved faster / slower / n.s. / inconclusive (sign test)"], rows),
        figure=T.row("figure8", path=fig8.name) if fig8 else T.row("no_figure8"),
        shape_table=md_table(["shape", "routing", "world", "cells", "geometric mean", "min", "max"],
                             [[r["shape"], r["routing"], r["world"], r["cells"], fmt(r["geomean"], "{:.3f}x"),
                               fmt(r["min"], "{:.3f}x"), fmt(r["max"], "{:.3f}x")] for r in f8]) if f8 else "")

    # Figure 10
    f10 = figure10_rows(cells, fig10_shapes, fig10_routing)
    doc["figure10"] = dict(
        routing=fig10_routing,
        table=md_table(["shape", "world", "schedule", "P", "tokens", "L2 tiles", "T_RS median (p10 – p90) us", "p99 us",
                        "model span us"],
                       [[r["shape"], r["world"], r["schedule"], r["P"], r["tokens"], r["tiles"],
                         f"{fmt(r['median_us'], '{:.2f}')} ({fmt(r['p10_us'], '{:.2f}')} – {fmt(r['p90_us'], '{:.2f}')})",
                         fmt(r["p99_us"], "{:.2f}"), fmt(r["predicted_us"], "{:.2f}")] for r in f10])
        if f10 else T.row("no_figure10_cell"),
        figure=T.row("figure10", path=fig10.name) if fig10 else T.row("no_figure10"))

    # Table 2
    t2 = table2_rows(cells, table2_world, table2_routing, table2_P)
    doc["table2"] = dict(world=table2_world, routing=table2_routing, table=md_table(
        ["shape", "P", "tokens", "span wave / int.", "T_mma L2 / L1", "Δt wave (pred. / meas.)",
         "Δt int. (pred. / meas.)", "int. predicted 0", "eq. 14", "speedup"],
        [[r["shape"], r["P"], r["tokens"], _pair(r["span_wave_us"], r["span_interleaved_us"]),
          _pair(r["mma_l2_us"], r["mma_l1_us"]), _pair(r["stall_wave_pred_us"], r["stall_wave_meas_us"]),
          _pair(r["stall_int_pred_us"], r["stall_int_meas_us"]), fmt(r["int_pred_zero_frac"], "{:.0%}"),
          {True: "holds", False: "fails", None: "–"}[r["eq14_holds"]], fmt(r["speedup"], "{:.3f}x")] for r in t2])
        if t2 else T.row("no_table2_cell_loopback", world=table2_world, routing=table2_routing, why=NO_PREDICTION)
        if table2_world == "loopback" else T.row("no_table2_cell", world=table2_world, routing=table2_routing))

    # the whole-kernel rate bound
    rb = rate_bound_rows(cells)
    doc["rate_bound"] = dict(
        table=md_table(["world", "P", "routing", "cells", "expert_wave meas. / pred.", "interleaved meas. / pred.",
                        "speedup meas. / pred."],
                       [[r["world"], r["P"], r["routing"], r["cells"],
                         f"{r['expert_wave'][0]:.2f} ({r['expert_wave'][1]:.2f} – {r['expert_wave'][2]:.2f})",
                         f"{r['interleaved'][0]:.2f} ({r['interleaved'][1]:.2f} – {r['interleaved'][2]:.2f})",
                         f"{r['speedup_measured']:.3f}x / {r['speedup_predicted']:.3f}x"]
                        for r in rate_bound_summary(rb)]),
        figure=T.row("rate_figure", path=rate_fig.name) if rate_fig else T.row("no_rate_figure")) if rb else None

    # the planner's verdict, contended against uncontended mainloops
    pv = planner_verdicts(cells)
    doc["planner"] = dict(table=md_table(
        ["mainloops", "verdict", "cells", "speedup median", "min", "max"],
        [[r["mainloops"], r["verdict"], r["cells"], f"{r['median']:.3f}x", f"{r['min']:.3f}x", f"{r['max']:.3f}x"]
         for r in planner_verdict_summary(pv)])) if pv else None

    # schedule="auto": what it picks, against the better fixed schedule
    ar = auto_rows(cells)
    doc["auto"] = dict(
        table=md_table(["world", "cells", "picks interleaved", "> 1 % slower than the better", "worst",
                        "geomean auto / interleaved", "geomean auto / expert_wave"],
                       [[r["world"], r["cells"], r["picks_interleaved"], r["over_1pct"], f"{r['worst']:.4f}x",
                         f"{r['geo_over_interleaved']:.4f}", f"{r['geo_over_expert_wave']:.4f}"]
                        for r in auto_summary(ar)]),
        notes="\n".join(T.row("auto_slower", shape=r["shape"], routing=r["routing"], tokens=r["tokens"],
                              world=r["world"], P=r["P"], pick=r["pick"], ratio=f"{r['auto_over_better']:.4f}x")
                        for r in ar if r["auto_over_better"] > 1.01)) if ar else None

    # schedule="auto" timed directly (sweep_megamoe.py --with-auto)
    ma = payload.get("auto_measured")
    doc["auto_measured"] = None
    if ma:
        mr = measured_auto_rows(ma)
        notes = [T.row("auto_rechecked", cell=_label(r["cell"]), before=_x4(r["sweep_speedup"]),
                       after=_x4(r["recheck_speedup"]), trials=r["trials"], file=r["file"])
                 for r in payload.get("auto_rechecked", [])]
        for r in mr:
            if not r["conclusive"]:
                notes.append(T.row("auto_inconclusive", cell=_label(r), pick=r["pick"],
                                   over_expert_wave=f"{r['over_expert_wave']:.4f}x",
                                   over_interleaved=f"{r['over_interleaved']:.4f}x", matched=r["matched"],
                                   trials=r["trials"]))
            elif r["over_better"] > 1.01:
                notes.append(T.row("auto_measured_slower", cell=_label(r), pick=r["pick"],
                                   ratio=f"{r['over_better']:.4f}x", matched=r["matched"]))
        doc["auto_measured"] = dict(
            n_cells=len(mr), rechecked_note=T.row("auto_rechecked_note") if payload.get("auto_rechecked") else "",
            table=md_table(["world", "cells", "picks expert_wave", "> 1 % slower than the better", "worst",
                            "geomean auto / interleaved", "geomean auto / expert_wave",
                            "identical kernels: auto / interleaved"],
                           [[r["world"], r["cells"], r["picks_expert_wave"], r["over_1pct"], f"{r['worst']:.4f}x",
                             f"{r['geo_over_interleaved']:.4f}", f"{r['geo_over_expert_wave']:.4f}",
                             "–" if r["same_kernel_min"] is None
                             else f"{r['same_kernel_min']:.4f} – {r['same_kernel_max']:.4f}"]
                            for r in measured_auto_summary(mr)]),
            notes="\n".join(notes))

    # the sign test per cell
    doc["sign_test"] = dict(table=md_table(
        ["shape", "routing", "tokens", "world", "P", "speedup", "verdict", "p (faster / slower)", "matched"],
        [[r["shape"], r["routing"], r["tokens"], r["world"], r["P"], fmt(r["speedup"], "{:.3f}x"), r["verdict"],
          _pair(r["p_interleaved_faster"], r["p_interleaved_slower"], "{:.3g}"), f"{r['n_matched']}/{r['n_trials']}"]
         for r in verdict_rows(cells)]))

    # regressions
    explanation = T.row("explained" if findings else "unexplained")
    regs = [T.row("regression", shape=r["shape"], routing=r["routing"], tokens=r["tokens"], world=r["world"], P=r["P"],
                  speedup=f"{r['speedup']:.3f}x", verdict=r["verdict"], l1=_pair(*r["l1_mainloop_us"]),
                  l2=_pair(*r["l2_mainloop_us"]), stall=_pair(*r["stall_measured_us"]), explanation=explanation)
            for r in regressions(cells)]
    doc["regressions"] = dict(notes="\n".join(regs) or T.row("no_regression"))

    # overhead, skips, errors
    doc["trace_overhead"] = dict(table=md_table(
        ["schedule", "cells", "median", "min", "max"],
        [[s, o["n"], fmt(o["median"]), fmt(o["min"]), fmt(o["max"])] for s, o in trace_overhead_summary(payload).items()]))
    other = [r for r in allrecs if r.get("status") != "ok"]
    doc["not_measured"] = dict(notes="\n".join(
        T.row("not_measured", **{k: r["cell"][k] for k in ("shape", "routing", "tokens", "world", "P", "precision")},
              status=r.get("status"), reason=r.get("reason") or r.get("error")) for r in other)) if other else None
    return T.document(doc)


def write_report(payload: Mapping, out_dir, *, precision: str = "bf16", **selection) -> dict:
    """Figures (when matplotlib is there), the tables as CSV and README.md into ``out_dir``
    (with ``out_dir``/findings.md in it when that file exists) over the cells of one
    ``precision`` (a sweep may hold both; their speedups are not pooled);
    ``selection``: :func:`readme`'s table2_* / fig10_* arguments. Returns the paths written."""
    payload = dict(payload, cells=[r for r in payload.get("cells", [])
                                   if r.get("cell", {}).get("precision", "bf16") == precision])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cells = measured_cells(payload)
    f10_rows = figure10_rows(cells, selection.get("fig10_shapes"), selection.get("fig10_routing", "skewed1"))
    rate_rows = rate_bound_rows(cells)
    paths = {"fig8": draw_figure8(figure8_rows(cells), out_dir / FIGURE8),
             "fig10": draw_figure10(f10_rows, out_dir / FIGURE10),
             "rate_fig": draw_rate_bound(rate_rows, out_dir / RATE_FIGURE)}
    paths["fig8_csv"] = xbench.write_csv(out_dir / "fig8_speedup.csv",
                                         [{k: v for k, v in r.items() if k != "speedups"} for r in figure8_rows(cells)])
    paths["fig10_csv"] = xbench.write_csv(out_dir / "fig10_rs_span.csv",
                                          [{k: v for k, v in r.items() if k != "quantiles_us"} for r in f10_rows])
    paths["table2_csv"] = xbench.write_csv(out_dir / "table2.csv", table2_rows(
        cells, selection.get("table2_world", "loopback+host"), selection.get("table2_routing", "skewed1"),
        selection.get("table2_P")))
    paths["verdicts_csv"] = xbench.write_csv(out_dir / "verdicts.csv", verdict_rows(cells))
    paths["rate_bound_csv"] = xbench.write_csv(out_dir / "rate_bound.csv", rate_rows)
    paths["planner_verdicts_csv"] = xbench.write_csv(out_dir / "planner_verdicts.csv", planner_verdicts(cells))
    paths["auto_csv"] = xbench.write_csv(out_dir / "auto.csv", auto_rows(cells))
    readme_path = out_dir / "README.md"
    notes = out_dir / FINDINGS
    readme_path.write_text(readme(payload, fig8=paths["fig8"], fig10=paths["fig10"], rate_fig=paths["rate_fig"],
                                  findings=notes.read_text() if notes.exists() else None, **selection))
    paths["readme"] = readme_path
    return paths


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", default=DEFAULT_OUT, help="the sweep JSON (scripts/sweep_megamoe.py --out)")
    ap.add_argument("--out", default=None, help="folder of the figures, tables and README (default: the sweep's)")
    ap.add_argument("--table2-world", default="loopback+host", choices=WORLDS)
    ap.add_argument("--table2-routing", default="skewed1", choices=tuple(ROUTINGS))
    ap.add_argument("--table2-P", type=int, default=None, help="default: the largest P measured per shape")
    ap.add_argument("--fig10-routing", default="skewed1", choices=tuple(ROUTINGS))
    ap.add_argument("--fig10-shapes", nargs="+", default=None, help="default: the first three shapes measured")
    ap.add_argument("--precision", default="bf16", choices=("bf16", "w8a8", "w4a8"),
                    help="the cells reported (an FP8 report belongs in its own --out folder)")
    ap.add_argument("--recheck", nargs="+", default=(), metavar="JSON",
                    help="sweeps that re-measured some cells with more trials: their timing replaces the sweep's")
    ap.add_argument("--auto-measured", nargs="+", default=(), metavar="JSON",
                    help="sweeps run with --with-auto: auto timed directly (a README section)")
    ap.add_argument("--auto-recheck", nargs="+", default=(), metavar="JSON",
                    help="--with-auto sweeps that re-measured some of those cells with more trials")
    return ap


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    payload = load_sweep(args.sweep)
    if args.recheck:
        payload = apply_rechecks(payload, [(Path(f).name, load_sweep(f)) for f in args.recheck])
    if args.auto_measured:
        auto = dict(cells=[c for f in args.auto_measured for c in load_sweep(f).get("cells", [])])
        auto = apply_rechecks(auto, [(Path(f).name, load_sweep(f)) for f in args.auto_recheck])
        payload = dict(payload, auto_measured=[r for r in auto["cells"] if r.get("status") == "ok" and r.get("auto")],
                       auto_rechecked=auto["rechecked"])
    out = Path(args.out) if args.out else Path(args.sweep).parent
    paths = write_report(payload, out, precision=args.precision, table2_world=args.table2_world, table2_routing=args.table2_routing,
                         table2_P=args.table2_P, fig10_routing=args.fig10_routing, fig10_shapes=args.fig10_shapes,
                         source=Path(args.sweep).name)
    for name, p in paths.items():
        if p is not None:
            print(f"{name}: {p}")
    return paths


if __name__ == "__main__":
    main()
