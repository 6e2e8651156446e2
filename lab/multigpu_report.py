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


def _f(x, fmt="{:.2f}", none="–"):
    try:
        return none if x is None else fmt.format(x)
    except (TypeError, ValueError):
        return str(x)


def _world_line(d: dict) -> str:
    w = d.get("world", {})
    return (f"GPUs on the host: {d.get('gpu_count')}; world `{w.get('backend')}` with {w.get('world_size')} ranks "
            f"({w.get('processes')} process(es)); NVLink multicast env: `{d.get('multicast_env')}`")


def _topology_block(d: dict) -> list:
    # nvidia-smi underlines the header with ANSI escapes; markdown shows them as text
    topo = re.sub(r"\x1b\[[0-9;]*m", "", d.get("topology") or "").rstrip()
    return ["", "NVLink topology (`nvidia-smi topo -m`):", "", "```", topo or "<not recorded>", "```"]


def report_topology(d: dict) -> str:
    L = ["## Step 0: topology and environment", "", _world_line(d)]
    L += _topology_block(d)
    L += ["", "| rank | GPU | SMs | peer access | failed checks |", "|---|---|---|---|---|"]
    for r in d.get("ranks", []):
        bad = [k for k, v in r.get("checks", {}).items() if not v]
        peers = sum(1 for v in r.get("peer_access", {}).values() if v)
        L.append(f"| {r.get('rank')} | {r.get('name')} | {r.get('sms')} | {peers}/{len(r.get('peer_access', {}))} | "
                 f"{', '.join(bad) or 'none'} |")
    L += ["", f"All checks passed: **{d.get('all_ok')}**"]
    return "\n".join(L) + "\n"


def report_calibration(d: dict) -> str:
    paper = d.get("paper", mg.PAPER)
    L = ["## Step 1: peer (NVLink) calibration", "", _world_line(d)]
    L += ["", "| mode | R (GB/s) | paper R (GB/s) | R / paper | K | Q(K) (MiB) | T_iss0 (a, slope) | "
          "T_iss median err (spin / mma) | T_period median err (spin) |", "|---|---|---|---|---|---|---|---|---|"]
    for mode, s in d.get("modes", {}).items():
        if "skipped" in s or "error" in s:
            L.append(f"| {mode} | {s.get('skipped') or s.get('error')} |||||||| ")
            continue
        v = s.get("validation", {})
        sp, mm = v.get("spin", {}), v.get("mma", {})
        q = _f(s.get("Q_MiB")) + (" (lower bound)" if s.get("Q_is_lower_bound") else "")
        L.append(f"| {mode} | {_f(s.get('R_GBps'), '{:.1f}')} | {paper['R_GBps']:.0f} | {_f(s.get('R_vs_paper'))} | "
                 f"{s.get('K', '–')} | {q} | {_f(s.get('t_iss0_a_us'), '{:.3f}')} us + "
                 f"{_f(s.get('t_iss0_slope_us_per_MiB'), '{:.3f}')} us/MiB | "
                 f"{_f(sp.get('T_iss_median_abs_rel'), '{:.1%}')} / {_f(mm.get('T_iss_median_abs_rel'), '{:.1%}')} | "
                 f"{_f(sp.get('T_period_median_abs_rel'), '{:.1%}')} |")
    if d.get("profile"):
        L += ["", f"Profile (not shipped): `{d['profile']}`"]
    L += ["", "Per-mode fit, validation table and figures: `calibration/<mode>/report.md`.",
          "The paper's R is for its platform (B200 NVLink); ours is one H200 sender."]
    return "\n".join(L) + "\n"


def fa_headline(d: dict) -> dict:
    """Best speedup of every fused variant over each Serial baseline, and where. Pure."""
    best = {}
    for r in d.get("rows", []):
        for k, v in r.items():
            if k.startswith("speedup_") and isinstance(v, (int, float)):
                if k not in best or v > best[k]["value"]:
                    best[k] = {"value": v, "H": r["H"], "M": r["M"]}
    return best


def report_fa(d: dict) -> str:
    paper = d.get("paper", mg.PAPER)
    rows = d.get("rows", [])
    L = ["## Step 2: fa4_a2a Table-3 sweep", "", _world_line(d),
         "", "Times: max across ranks per trial, median of trials (us)."]
    if d.get("skipped_variants"):
        L.append(f"Skipped variants (no process group in this world): {d['skipped_variants']}")
    best = fa_headline(d)
    if best:
        L += ["", "| headline | ours | paper |", "|---|---|---|"]
        for k, b in sorted(best.items()):
            L.append(f"| max {k} | {b['value']:.3f}x (H={b['H']}, M={b['M']}) | up to {paper['fa_speedup_max']}x (FA3/FA4) |")
    variants = d.get("variants", [])
    for H in sorted({r["H"] for r in rows}):
        rs = sorted((r for r in rows if r["H"] == H), key=lambda r: r["M"])
        L += ["", f"### H = {H} (P = {rs[0]['P']}, Hl = {rs[0]['H_local']})", "",
              "| method | " + " | ".join(f"M={r['M']}" for r in rs) + " |", "|---" * (len(rs) + 1) + "|"]
        for v in variants:
            L.append(f"| {v} | " + " | ".join(_f(r["median_us"].get(v), "{:.1f}") for r in rs) + " |")
        keys = [k for k in rs[0] if k.startswith(("E_res", "speedup_", "H_fused"))]
        for k in keys:
            fmt = "{:+.1f}" if k.startswith("E_res") else ("{:.0%}" if k.startswith("H_") else "{:.3f}x")
            L.append(f"| {k} | " + " | ".join(_f(r.get(k), fmt) for r in rs) + " |")
        for k in ("E_drain_us", "E_cap_us", "E_tail_us", "M_star_ub"):
            if k in rs[0].get("model", {}):
                L.append(f"| model {k} ({rs[0]['model'].get('platform')}) | "
                         + " | ".join(_f(r["model"].get(k), "{:.1f}") for r in rs) + " |")
        L.append("| rank spread fused (max/min) | " + " | ".join(
            _f(r["timings"].get("fused", {}).get("rank_spread"), "{:.3f}") for r in rs) + " |")
    return "\n".join(L) + "\n"


def report_megamoe(d: dict) -> str:
    paper = d.get("paper", mg.PAPER)
    s = d.get("summary", {})
    L = ["## Step 3: MegaMoE expert-wave vs interleaved", "", _world_line(d),
         "", "Fused-kernel device time, max across ranks per trial, median of trials.", "",
         "| headline | ours | paper |", "|---|---|---|",
         f"| geometric-mean speedup (expert_wave / interleaved) | {_f(s.get('geomean_speedup'), '{:.3f}x')} | "
         f"{paper['megamoe_geomean']}x |",
         f"| range | {_f(s.get('min_speedup'), '{:.3f}x')} – {_f(s.get('max_speedup'), '{:.3f}x')} | |",
         "", "| shape | routing | tokens/rank | expert_wave (us) | interleaved (us) | speedup | speedup (whole forward) |",
         "|---|---|---|---|---|---|---|"]
    for c in s.get("configs", []):
        L.append(f"| {c['shape']} | {c['routing']} | {c['tokens_per_rank']} | {c['expert_wave_us']:.1f} | "
                 f"{c['interleaved_us']:.1f} | {c['speedup']:.3f}x | {c['speedup_api']:.3f}x |")
    regs = s.get("regressions", [])
    L += ["", f"Regressions (speedup < 1): {len(regs)}"]
    for c in regs:
        L.append(f"- {c['shape']} {c['routing']} T={c['tokens_per_rank']}: {c['speedup']:.3f}x — explain from the "
                 "trace (`scripts/bench_megamoe.py --trace`) before quoting")
    return "\n".join(L) + "\n"


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
    L = ["## Step 4: correctness in the multi-GPU world", "", _world_line(d), "",
         "| kernel | checks | passed | failed |", "|---|---|---|---|"]
    for k, v in s.items():
        if isinstance(v, dict):
            L.append(f"| {k} | {v['checks']} | {v['passed']} | {len(v['failed'])} |")
    L += ["", f"All passed: **{s.get('all_ok')}**"]
    for k, v in s.items():
        if isinstance(v, dict):
            for f in v["failed"][:20]:
                L.append(f"- FAILED {k}: {f}")
    return "\n".join(L) + "\n"


RENDER = {"topology": report_topology, "calibration": report_calibration, "fa4_a2a": report_fa,
          "megamoe": report_megamoe, "correctness": report_correctness}


def write_reports(results_dir, steps=None, figures: Figures = None) -> list:
    """Write ``report-<step>.md`` for every step with a result file, and ``report.md`` with all of
    them; ``figures[step](payload, path)`` draws that step's figure (None: none drawn)."""
    results_dir = Path(results_dir)
    written, sections = [], []
    for step, rel in STEP_FILES.items():
        if steps and step not in steps:
            continue
        rels = (rel,) if isinstance(rel, str) else rel
        found = [results_dir / r for r in rels if (results_dir / r).exists()]
        if not found:
            sections.append(f"## {step}\n\nnot run (none of {', '.join(f'`{r}`' for r in rels)})\n")
            continue
        ds = [json.loads(f.read_text()) for f in found]
        d = merge_correctness(ds) if step == "correctness" else ds[0]
        md = RENDER[step](d)
        draw = (figures or {}).get(step)
        if draw is not None and step in FIGURES:
            rel, caption = FIGURES[step]
            fig = draw(d, results_dir / rel)
            if fig:
                md += f"\n![{caption}]({Path(rel).parent.as_posix()}/{Path(fig).name})\n"
        out = results_dir / f"report-{step}.md"
        out.write_text(f"# X-Stage multi-GPU: {step}\n\n" + md)
        written.append(out)
        sections.append(md)
    combined = results_dir / "report.md"
    combined.write_text(f"# X-Stage multi-GPU results: `{results_dir}`\n\n"
                        "Paper (arXiv:2607.23264): R = 717 GB/s on its platform; FA3/FA4 speedups up to 1.43x; "
                        "MegaMoE 1.18x geometric mean.\n\n" + "\n".join(sections))
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
