#!/usr/bin/env python
"""``scripts/run``'s main job. On a Hopper GPU (a few minutes): both fused kernels on one
representative shape each, checked against the fp32 reference, timed next to their baselines
(lab.fa4_a2a.demo, lab.megamoe.demo). Without one (seconds): the Burst-Gap planner on every
shipped platform profile and the calibration fit and report recomputed from the shipped raw data.
Prints a table and writes ``<out>/demo.json`` (with provenance).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

CALIBRATION = Path("results/h200/calibration")


def gpu(out: Path) -> dict:
    from lab.fa4_a2a import demo as fa_demo
    from lab.megamoe import demo as moe_demo

    t0 = time.time()
    fa = fa_demo.run()
    print(f"\n== fa4_a2a: {fa['shape']}")
    print(f"   fused vs fp32 reference: max abs error {fa['max_abs_err_vs_fp32']:.2e}, "
          f"{fa['unwritten_elements']} unwritten elements -> {'ok' if fa['ok'] else 'FAILED'}")
    for name, us in fa["median_us"].items():
        print(f"   {name:14s} {us:9.1f} us")
    print(f"   fused / FA-only {fa['fused_vs_fa_only']:.3f}; Serial (FA-only + A2A copy kernel) / fused "
          f"{fa['serial_symm_vs_fused']:.3f} (paired sign test: fused faster: {fa['fused_lt_serial_symm']})")
    moe = moe_demo.run()
    print(f"\n== megamoe_interleave: {moe['shape']}")
    for s, c in moe["checks"].items():
        print(f"   fused[{s}] vs fp32 reference (token sample): max abs error "
              f"{c['max_abs_err_vs_fp32_sample']:.2e} -> {'ok' if c['ok'] else 'FAILED'}")
    row = moe["paired"]
    print(f"   paired, clock-matched (reference clock {row['reference_clock_mhz']} MHz), against the two grouped GEMMs "
          f"({row['variants'][next(iter(row['variants']))].get('baseline_median_us', float('nan')):.0f} us):")
    for name, v in row["variants"].items():
        if v.get("n_matched"):
            print(f"   {name:22s} {v['median_us']:9.0f} us  ratio {v['median_ratio']:.3f}  "
                  f"{moe['tflops'][name]:6.0f} TFLOP/s  faster in {100 * v['frac_not_slower']:.0f} % of "
                  f"{v['n_matched']} trials")
        else:
            print(f"   {name:22s} no trial at the reference clock (+-{row['clock_tol_mhz']:.0f} MHz): no ratio")
    print(f"\n{time.time() - t0:.0f} s")
    return {"fa4_a2a": fa, "megamoe_interleave": moe, "ok": fa["ok"] and moe["ok"]}


def cpu(out: Path) -> dict:
    from calibration.report import fit_directory, make_figures, write_report
    from xstage import cli

    print("== No Hopper GPU here: the kernels need an H100/H200 (sm_90a). "
          "This run: the planner and the calibration fit (scripts/test compiles every kernel for sm_90a).")
    cli.main(["profiles"])
    for profile in ("paper-b200-nvlink", "h200-nvlink-peer", "h200-pcie-host"):
        print(f"\n== plan, {profile}")
        cli.main(["plan", "fa-a2a", "--platform", profile, "--seq", "8192", "--heads", "24", "--head-dim", "128",
                  "--world", "8"])
        cli.main(["plan", "megamoe", "--platform", profile, "--hidden", "4096", "--intermediate", "2048",
                  "--experts", "256", "--topk", "6", "--tokens", "8192", "--world", "8"])
    # The fit and report again from the shipped raw per-burst data, into a copy.
    cal = out / "calibration"
    cal.mkdir(parents=True, exist_ok=True)
    for name in ("points.csv", "bursts.csv.gz", "meta.json"):
        shutil.copy(CALIBRATION / name, cal / name)
    fit = fit_directory(cal)
    write_report(cal, make_figures(cal))
    shipped = json.loads((CALIBRATION / "fit.json").read_text())["targets"]
    print(f"\n== calibration refit from {CALIBRATION}/bursts.csv.gz (report: {cal}/report.md)")
    same = True
    for target, s in fit["targets"].items():
        r, r0 = s["R"]["R_bytes_per_s"], shipped[target]["R"]["R_bytes_per_s"]
        q = s["isolated"]["132"]["Q_bytes"] if "132" in s.get("isolated", {}) else float("nan")
        same &= abs(r / r0 - 1) < 1e-9
        print(f"   {target:6s} R = {r / 1e9:.2f} GB/s, Q(132) = {q / 2 ** 20:.2f} MiB "
              f"({'= the shipped fit' if abs(r / r0 - 1) < 1e-9 else 'DIFFERS from the shipped fit'})")
    return {"calibration_refit_matches_shipped": same, "ok": same}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("results/demo"))
    ap.add_argument("--cpu", action="store_true", help="the CPU part even where a Hopper GPU is present")
    args = ap.parse_args(argv)
    import torch

    from xstage import provenance

    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
    args.out.mkdir(parents=True, exist_ok=True)
    result = gpu(args.out) if hopper and not args.cpu else cpu(args.out)
    path = provenance.write_json(args.out / "demo.json", result)
    print(f"wrote {path}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
