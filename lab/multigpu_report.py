"""Markdown reports of the multi-GPU suite (issue 6), one per step plus a combined ``report.md``.

Reads the result files of ``scripts/multigpu_suite.sh`` under one results directory
(``results/h200xN``; format in results/README-multigpu.md) and puts the headline numbers next
to the paper's: R = 717 GB/s (its platform), FA3/FA4 Serial/Fused speedups up to 1.43x, MegaMoE
interleaved/expert-wave 1.18x geometric mean.  Runs on a CPU.  Figures come from the packages
that own the step (``figures``: step -> ``draw(payload, path)``; the suite's command line
``scripts/multigpu/report.py`` passes :data:`SUITE_FIGURES`, fa4_a2a's E_res figure).

  python scripts/multigpu/report.py --dir results/h200x8
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Callable, Mapping, Optional

from lab import multigpu as mg
from lab.bench import open_text
from lab.report import Templates, fmt, md_table

# step -> result file (relative to the results directory)
STEP_FILES = {
    "topology": "topology/env.json",
    "calibration": "calibration/summary.json",
    "fa4_a2a": "fa4_a2a/sweep.json",
    "megamoe": "megamoe/ep.json",
    "correctness": ("correctness/correctness-fa4.json", "correctness/correctness-megamoe.json",
                    "correctness/correctness.json"),
}

# step -> (its figure, relative to the results directory; caption): drawn by the callable that
# write_reports gets for the step (from the package that owns the step's results)
FIGURES = {"fa4_a2a": ("fa4_a2a/eres_vs_m.png", "E_res / T_FA vs M, measured and modelled")}
Figures = Optional[Mapping[str, Callable[[dict, Path], Optional[str]]]]


def fa4_a2a_figure(payload: dict, path: Path) -> Optional[str]:
    """lab.fa4_a2a.multigpu_sweep.eres_figure, imported only when a sweep result is there to draw."""
    from lab.fa4_a2a.multigpu_sweep import eres_figure

    return eres_figure(payload, path)


# the figures of the suite's command line (scripts/multigpu/report.py)
SUITE_FIGURES = {"fa4_a2a": fa4_a2a_figure}


TEMPLATE = Templates("multigpu_report.md")  # the reports' text, under lab/templates/


def _f(x, spec="{:.2f}"):
    return fmt(x, spec)


def _world_line(d: dict) -> str:
    w = d.get("world", {})
    return TEMPLATE.row("world", gpu_count=d.get("gpu_count"), backend=w.get("backend"),
                        world_size=w.get("world_size"), processes=w.get("processes"),
                        multicast_env=d.get("multicast_env"))


def _topology(d: dict) -> str:
    # nvidia-smi underlines the header with ANSI escapes; markdown shows them as text
    return re.sub(r"\x1b\[[0-9;]*m", "", d.get("topology") or "").rstrip() or TEMPLATE.row("no_topology")


def report_topology(d: dict) -> str:
    rows = []
    for r in d.get("ranks", []):
        bad = [k for k, v in r.get("checks", {}).items() if not v]
        peers = sum(1 for v in r.get("peer_access", {}).values() if v)
        rows.append([r.get("rank"), r.get("name"), r.get("sms"), f"{peers}/{len(r.get('peer_access', {}))}",
                     ", ".join(bad) or "none"])
    return TEMPLATE.document({"body": dict(
        world=_world_line(d), topology=_topology(d), all_ok=d.get("all_ok"),
        table=md_table(["rank", "GPU", "SMs", "peer access", "failed checks"], rows))}, "topology")


def report_calibration(d: dict) -> str:
    paper = d.get("paper", mg.PAPER)
    rows = []
    for mode, s in d.get("modes", {}).items():
        if "skipped" in s or "error" in s:
            rows.append([mode, s.get("skipped") or s.get("error")] + [""] * 7)
            continue
        v = s.get("validation", {})
        sp, mm = v.get("spin", {}), v.get("mma", {})
        q = _f(s.get("Q_MiB")) + (" (lower bound)" if s.get("Q_is_lower_bound") else "")
        rows.append([mode, _f(s.get("R_GBps"), "{:.1f}"), f"{paper['R_GBps']:.0f}", _f(s.get("R_vs_paper")),
                     s.get("K", "–"), q, f"{_f(s.get('t_iss0_a_us'), '{:.3f}')} us + "
                     f"{_f(s.get('t_iss0_slope_us_per_MiB'), '{:.3f}')} us/MiB",
                     f"{_f(sp.get('T_iss_median_abs_rel'), '{:.1%}')} / {_f(mm.get('T_iss_median_abs_rel'), '{:.1%}')}",
                     _f(sp.get("T_period_median_abs_rel"), "{:.1%}")])
    table = md_table(["mode", "R (GB/s)", "paper R (GB/s)", "R / paper", "K", "Q(K) (MiB)", "T_iss0 (a, slope)",
                      "T_iss median err (spin / mma)", "T_period median err (spin)"], rows)
    return TEMPLATE.document({"body": dict(world=_world_line(d), table=table),
                              "profile": dict(profile=d["profile"]) if d.get("profile") else None,
                              "notes": {}}, "calibration")


def fa_headline(d: dict) -> dict:
    """Best speedup of every fused variant over each Serial baseline, and where. Pure."""
    best = {}
    for r in d.get("rows", []):
        for k, v in r.items():
            if k.startswith("speedup_") and isinstance(v, (int, float)):
                if k not in best or v > best[k]["value"]:
                    best[k] = {"value": v, "H": r["H"], "M": r["M"]}
    return best


def _fa_heads_table(rs: list, variants) -> str:
    """One head count's table: a column per M, a row per variant and per derived number."""
    rows = [[v] + [_f(r["median_us"].get(v), "{:.1f}") for r in rs] for v in variants]
    for k in [k for k in rs[0] if k.startswith(("E_res", "speedup_", "H_fused"))]:
        spec = "{:+.1f}" if k.startswith("E_res") else ("{:.0%}" if k.startswith("H_") else "{:.3f}x")
        rows.append([k] + [_f(r.get(k), spec) for r in rs])
    for k in ("E_drain_us", "E_cap_us", "E_tail_us", "M_star_ub"):
        if k in rs[0].get("model", {}):
            rows.append([f"model {k} ({rs[0]['model'].get('platform')})"]
                        + [_f(r["model"].get(k), "{:.1f}") for r in rs])
    rows.append(["rank spread fused (max/min)"]
                + [_f(r["timings"].get("fused", {}).get("rank_spread"), "{:.3f}") for r in rs])
    return md_table(["method"] + [f"M={r['M']}" for r in rs], rows)


def report_fa(d: dict) -> str:
    paper = d.get("paper", mg.PAPER)
    rows = d.get("rows", [])
    best = fa_headline(d)
    per_heads = []
    for H in sorted({r["H"] for r in rows}):
        rs = sorted((r for r in rows if r["H"] == H), key=lambda r: r["M"])
        per_heads.append(TEMPLATE.row("fa4_a2a_heads", H=H, P=rs[0]["P"], H_local=rs[0]["H_local"]) + "\n\n"
                         + _fa_heads_table(rs, d.get("variants", [])))
    skipped = d.get("skipped_variants")
    return TEMPLATE.document({
        "body": dict(world=_world_line(d), skipped=TEMPLATE.row("fa4_a2a_skipped", variants=skipped) if skipped else ""),
        "headline": dict(table=md_table(["headline", "ours", "paper"], [
            [f"max {k}", f"{b['value']:.3f}x (H={b['H']}, M={b['M']})", f"up to {paper['fa_speedup_max']}x (FA3/FA4)"]
            for k, b in sorted(best.items())])) if best else None,
        "per_heads": dict(tables="\n\n".join(per_heads)) if per_heads else None}, "fa4_a2a")


def report_megamoe(d: dict) -> str:
    paper = d.get("paper", mg.PAPER)
    s = d.get("summary", {})
    headline = md_table(["headline", "ours", "paper"], [
        ["geometric-mean speedup (expert_wave / interleaved)", _f(s.get("geomean_speedup"), "{:.3f}x"),
         f"{paper['megamoe_geomean']}x"],
        ["range", f"{_f(s.get('min_speedup'), '{:.3f}x')} – {_f(s.get('max_speedup'), '{:.3f}x')}", ""]]
        + [[f"geometric mean, {p}", f"{g:.3f}x", ""] for p, g in s.get("geomean_by_precision", {}).items()])
    table = md_table(["shape", "precision", "routing", "tokens/rank", "expert_wave (us)", "interleaved (us)",
                      "speedup", "speedup (whole forward)"],
                     [[c["shape"], c.get("precision", "bf16"), c["routing"], c["tokens_per_rank"],
                       f"{c['expert_wave_us']:.1f}",
                       f"{c['interleaved_us']:.1f}", f"{c['speedup']:.3f}x", f"{c['speedup_api']:.3f}x"]
                      for c in s.get("configs", [])])
    regs = s.get("regressions", [])
    return TEMPLATE.document({"body": dict(
        world=_world_line(d), headline=headline, table=table, n_regressions=len(regs),
        regressions="\n".join(TEMPLATE.row("megamoe_regression", shape=c["shape"],
                                           precision=c.get("precision", "bf16"), routing=c["routing"],
                                           tokens=c["tokens_per_rank"], speedup=f"{c['speedup']:.3f}x")
                              for c in regs))}, "megamoe")


def merge_correctness(parts) -> dict:
    """One correctness payload from several (per-kernel) result files. Pure."""
    parts = list(parts)
    merged = dict(parts[0]) if parts else {}
    summ = {}
    for p in parts:
        for k, v in p.get("summary", {}).items():
            if isinstance(v, dict):
                summ[k] = v
    summ["all_ok"] = bool(parts) and all(p.get("summary", {}).get("all_ok") for p in parts)
    merged["summary"] = summ
    return merged


def report_correctness(d: dict) -> str:
    s = d.get("summary", {})
    kernels = {k: v for k, v in s.items() if isinstance(v, dict)}
    return TEMPLATE.document({"body": dict(
        world=_world_line(d), all_ok=s.get("all_ok"),
        table=md_table(["kernel", "checks", "passed", "failed"],
                       [[k, v["checks"], v["passed"], len(v["failed"])] for k, v in kernels.items()]),
        failed="\n".join(TEMPLATE.row("correctness_failed", kernel=k, failure=f)
                         for k, v in kernels.items() for f in v["failed"][:20]))}, "correctness")


RENDER = {"topology": report_topology, "calibration": report_calibration, "fa4_a2a": report_fa,
          "megamoe": report_megamoe, "correctness": report_correctness}


def read_json(path: Path):
    """A result file, plain or gzipped (:func:`lab.bench.open_text`)."""
    with open_text(path) as f:
        return json.load(f)


def write_reports(results_dir, steps=None, figures: Figures = None) -> list:
    """Write ``report-<step>.md`` for every step with a result file, and ``report.md`` with all of
    them; ``figures[step](payload, path)`` draws that step's figure (None: none drawn)."""
    results_dir = Path(results_dir)
    written, sections = [], []
    for step, rel in STEP_FILES.items():
        if steps and step not in steps:
            continue
        rels = (rel,) if isinstance(rel, str) else rel
        # each file plain or gzipped, never both read
        found = [next((f for f in (results_dir / r, results_dir / f"{r}.gz") if f.exists()), None) for r in rels]
        found = [f for f in found if f is not None]
        if not found:
            sections.append(TEMPLATE.row("not_run", step=step, files=", ".join(f"`{r}`" for r in rels)) + "\n")
            continue
        ds = [read_json(f) for f in found]
        d = merge_correctness(ds) if step == "correctness" else ds[0]
        md = RENDER[step](d)
        draw = (figures or {}).get(step)
        if draw is not None and step in FIGURES:
            rel, caption = FIGURES[step]
            fig = draw(d, results_dir / rel)
            if fig:
                md += "\n" + TEMPLATE.row("figure", caption=caption, path=f"{Path(rel).parent.as_posix()}/{Path(fig).name}") + "\n"
        out = results_dir / f"report-{step}.md"
        out.write_text(TEMPLATE.row("step_file", step=step) + "\n\n" + md)
        written.append(out)
        sections.append(md)
    combined = results_dir / "report.md"
    combined.write_text(TEMPLATE.row("combined", results_dir=results_dir) + "\n\n" + "\n".join(sections))
    written.append(combined)
    return written


def main(argv=None, figures: Figures = None) -> int:
    """The report command line (``--dir``, ``--steps``); ``figures`` as in :func:`write_reports`."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="results directory (results/h200xN)")
    p.add_argument("--steps", nargs="+", choices=list(STEP_FILES), default=None)
    args = p.parse_args(argv)
    if not Path(args.dir).is_dir():
        return mg.fail(f"no results directory {args.dir}")
    for w in write_reports(args.dir, args.steps, figures):
        print(f"wrote {w}")
    return 0
