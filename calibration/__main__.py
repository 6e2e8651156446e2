"""``python -m calibration``: run the microbenchmarks, fit the Burst–Gap model, write a report.

    python -m calibration run --target host local --out results/h200/calibration   # GPU
    python -m calibration fit --dir results/h200/calibration [--profile xstage/profiles/h200-pcie-host.json]
    python -m calibration report --dir results/h200/calibration
    python -m calibration all --target host local --out DIR --profile FILE          # run + fit + report
    python -m calibration sigma --bench results/h200/fa4_a2a/bench_loopback_stabilized.json \
        [--profile xstage/profiles/h200-pcie-host.json ...]   # FA Q-loop slope (CPU), into the profiles

``run --quick`` shrinks the grids (smoke test).  ``--target peer`` needs
torchrun with >= 2 GPUs (torch symmetric memory).  ``run`` and ``all`` check
for a Hopper GPU first: without one they write nothing and exit with 1.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m calibration", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("run", "all"):
        p = sub.add_parser(name, help="run the GPU microbenchmarks" + (" then fit and report" if name == "all" else ""))
        p.add_argument("--target", nargs="+", choices=("host", "local", "peer"), default=["host", "local"])
        p.add_argument("--out", type=Path, required=True, help="output directory")
        p.add_argument("--quick", action="store_true", help="small grids (smoke test)")
        p.add_argument("--region-mib", type=int, default=1024, help="destination rotation region (MiB)")
        p.add_argument("--no-mma", action="store_true", help="skip the Tensor Core gap sweep")
        p.add_argument("--cache", choices=("cs", "no_allocate"), default=None, help="store cache hint")
        p.add_argument("--align", choices=("grid", "free", "both"), default="grid",
                       help="grid barrier before every burst (default; the committed H200 results), "
                            "free-running producers (EXPERIMENTAL: its per-producer analysis is not validated and gave "
                            "R above the PCIe link on the H200), or both")
        p.add_argument("--no-progress", action="store_true")
        if name == "all":
            p.add_argument("--profile", type=Path, default=None)
    p = sub.add_parser("fit", help="fit R, T_iss0, Q and validate the gap sweeps")
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--profile", type=Path, default=None, help="also write the host profile here")
    p.add_argument("--profile-name", default="h200-pcie-host")
    p = sub.add_parser("report", help="figures + markdown report from a fitted directory")
    p.add_argument("--dir", type=Path, required=True)
    p = sub.add_parser("sigma", help="fit the FlashAttention Q-loop slope sigma from a fa4_a2a bench JSON (CPU)")
    p.add_argument("--bench", type=Path, required=True, help="scripts/bench_fa_a2a.py output, clock-stabilised")
    p.add_argument("--profile", type=Path, nargs="*", default=[], help="write sigma into these profile JSONs")
    p.add_argument("--note", default="", help="a sentence to append to the profiles' sigma note")
    return ap


def _config(args):
    from .runner import KiB, RunConfig

    kw = {"region_bytes": args.region_mib * 2**20, "cache": args.cache}
    if args.quick:
        kw.update(zero_gap_K=(33, 132), zero_gap_B=(16 * KiB, 128 * KiB), isolated_K=(132,),
                  isolated_B=(4 * KiB, 32 * KiB, 256 * KiB), sweep_B=(64 * KiB,),
                  gap_factors=(0.0, 0.5, 1.0, 2.0), max_bursts=200, min_bursts=32)
    if args.no_mma:
        kw["mma_B"] = None
    return RunConfig(**kw)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from .runner import NoGPUError

    try:
        if args.cmd == "sigma":
            from .qloop import fit_bench_file, write_sigma

            fit = fit_bench_file(args.bench)
            print(f"sigma = {fit.sigma_s * 1e6:.4f} +- {fit.sigma_err_s * 1e6:.4f} us per KV tile, fixed component "
                  f"{fit.fixed_s * 1e6:.2f} us ({fit.n} rows, d = {fit.head_dim} {fit.dtype}, "
                  + (f"{fit.clock_mhz:.0f} MHz)" if fit.clock_mhz else "clocks NOT matched)"))
            for prof in args.profile:
                write_sigma(prof, fit, args.note)
                print(f"wrote sigma into {prof}")
            return 0
        if args.cmd in ("run", "all"):
            from .runner import run_targets

            aligns = {"grid": (True,), "free": (False,), "both": (True, False)}[args.align]
            meta = run_targets(args.target, args.out, _config(args), progress=not args.no_progress, aligns=aligns)
            print(f"wrote {args.out}/points.csv, bursts.csv.gz, meta.json ({meta['seconds']:.1f} s)")
            if meta["errors"]:
                print(f"errors in targets: {sorted(meta['errors'])}", file=sys.stderr)
            if args.cmd == "run":
                return 1 if meta["errors"] else 0
        if args.cmd in ("fit", "all"):
            from .report import fit_directory

            d = args.dir if args.cmd == "fit" else args.out
            out = fit_directory(d, profile_out=args.profile,
                                profile_name=getattr(args, "profile_name", "h200-pcie-host"))
            for t, s in out["targets"].items():
                if "R" in s:
                    print(f"{t}: R = {s['R']['R_bytes_per_s'] / 1e9:.2f} GB/s; validation: "
                          + "; ".join(f"{m}: T_iss median {v['T_iss']['median_abs_rel'] * 100:.1f} % "
                                      f"(max {v['T_iss']['max_abs_rel'] * 100:.1f} %), T_period median "
                                      f"{v['T_period']['median_abs_rel'] * 100:.1f} %"
                                      for m, v in s.get("validation", {}).items()))
                else:
                    print(f"{t}: {s}")
        if args.cmd in ("report", "all"):
            from .report import make_figures, write_report

            d = args.dir if args.cmd == "report" else args.out
            figs = make_figures(d)
            path = write_report(d, figs)
            print(f"wrote {path}" + (f" and {', '.join(figs)}" if figs else " (no matplotlib: no figures)"))
    except NoGPUError as e:
        print(f"calibration: error: {e}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as e:
        print(f"calibration: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
