"""fa4_a2a Table-3 sweep on several GPUs (issue 6, step 2): FA4 + Ulysses post-attention A2A.

Per (H heads, sequence M), every rank r of a world of P ranks holds its head shard
``[1, M, H/P, 128]`` (after the pre-attention A2A, which Table 3 does not time) and runs:

  fa_only       FA4 with the stock epilogue, local output                     [T_FA]
  fa_only_pers  ... static persistent tile order
  a2a_nccl      the post-attention A2A alone: torch.distributed.all_to_all_single (yunchang permutes)
  a2a_symm      the post-attention A2A alone: ``fa4_a2a.a2a_symm``, a copy kernel that stores the rank's
                output through the fused kernel's own peer table (same bytes, same places, no attention)
  a2a_symm_torch  the same by torch copies into torch symmetric-memory peer views (handle.get_buffer)
  serial_nccl   fa_only, then a2a_nccl                                        [T_serial]
  serial_symm   fa_only, then a2a_symm
  serial_symm_torch  fa_only, then a2a_symm_torch
  fused         FA4 whose epilogue stores every tile at its Ulysses destination (remote stores)
  fused_pers    ... static persistent tile order

Timing (lab.multigpu.time_variants): CUDA-graph replays (NCCL variants eager), trials
aligned across ranks, max across ranks per trial, median of trials.  E_res = T_fused - T_FA,
hiding H = 1 - E_res / (T_serial - T_FA), speedup = T_serial / T_fused; E_res vs M against the
Burst-Gap prediction (lab.fa4_a2a.bench.model_prediction) with ``--profile`` (default: the
peer profile fitted in step 1 when its JSON is given, else paper-b200-nvlink).
:func:`eres_figure` draws E_res / T_FA vs M for the suite's report.

  torchrun --nproc-per-node=8 -m lab.fa4_a2a.multigpu_sweep --world torch-symm --out results/h200x8/fa4_a2a
  python -m lab.fa4_a2a.multigpu_sweep --world loopback --P 8 --quick --out results/h200x1-loopback/fa4_a2a

(``scripts/multigpu/fa_a2a_sweep.py`` is the same command line.)
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

from lab import bench
from lab import multigpu as mg

VARIANTS = ("fa_only", "fa_only_pers", "a2a_nccl", "a2a_symm", "a2a_symm_torch", "serial_nccl", "serial_symm",
            "serial_symm_torch", "fused", "fused_pers")
NEEDS_A2A_SYMM = ("a2a_symm", "serial_symm")
NCCL_VARIANTS = ("a2a_nccl", "serial_nccl")
FUSED = ("fused", "fused_pers")
QUICK_SEQS = (8192, 32768)
SEQS = (8192, 16384, 32768, 49152, 65536)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mg.add_world_args(p, default_out="results/h200xN/fa4_a2a")
    p.add_argument("--heads", type=int, nargs="+", default=[24, 40])
    p.add_argument("--seqs", type=int, nargs="+", default=None, help=f"default {SEQS} ({QUICK_SEQS} with --quick)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--target-trial-us", type=float, default=3000.0)
    p.add_argument("--max-replays", type=int, default=20)
    p.add_argument("--profile", default=None, help="xstage.profiles name or JSON path for the model prediction")
    p.add_argument("--stem", default="sweep", help="output file stem")
    return mg.parse_with_quick_grid(p, argv, "seqs", SEQS, QUICK_SEQS, quick_trials=7)


def check_shapes(heads, seqs, P: int) -> None:
    """Every H divisible by P (head shards) and every M by P (sequence shards); raise before launching."""
    bad = [f"H={h}" for h in heads if h % P] + [f"M={m}" for m in seqs if m % P]
    if bad:
        raise mg.WorldArgsError(f"not divisible by the world size P={P}: {', '.join(bad)}")
    if any(h < P for h in heads):
        raise mg.WorldArgsError(f"every head count must be >= P={P}")


def active_variants(requested, backend: str, have_a2a_symm: bool = True):
    """NCCL variants need a process group: dropped (with a note) in the loopback world; the
    symmetric-memory copy-kernel variants need ``fa4_a2a.a2a_symm``."""
    keep = [v for v in requested if (backend == "torch-symm" or v not in NCCL_VARIANTS)
            and (have_a2a_symm or v not in NEEDS_A2A_SYMM)]
    skipped = [v for v in requested if v not in keep]
    return keep, skipped


def derive(med: dict) -> dict:
    """E_res, hiding ratio and speedups from the per-variant medians (us). Pure."""
    out = {}
    t_fa = med.get("fa_only")
    for f in FUSED:
        if f not in med or t_fa is None:
            continue
        e = med[f] - t_fa
        out[f"E_res_{f}_us"] = e
        out[f"{f}_vs_fa"] = med[f] / t_fa
        for a2a in ("nccl", "symm", "symm_torch"):
            s = med.get(f"serial_{a2a}")
            if s is None:
                continue
            out[f"speedup_{f}_vs_serial_{a2a}"] = s / med[f]
            if s - t_fa > 0:
                out[f"H_{f}_vs_serial_{a2a}"] = 1.0 - e / (s - t_fa)
    if "fused_pers" in med and "fa_only_pers" in med:
        out["E_res_pers_vs_fa_pers_us"] = med["fused_pers"] - med["fa_only_pers"]
    return out


def run(ctx, args):
    import torch

    import fa4_a2a
    from fa4_a2a.baselines import a2a_all_to_all_single, a2a_copy
    from lab.fa4_a2a.bench import load_platform, model_prediction

    P, D = ctx.P, args.head_dim
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    check_shapes(args.heads, args.seqs, P)
    a2a_symm = getattr(fa4_a2a, "a2a_symm", None)  # the copy kernel (fa4_a2a.a2a_copy)
    variants, skipped = active_variants(args.variants, ctx.backend, a2a_symm is not None)
    platform = load_platform(args.profile)
    num_sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count
    rows, table = [], []
    for H in args.heads:
        Hl = H // P
        for M in args.seqs:
            t0 = time.time()
            q, k, v, o_loc, tables = {}, {}, {}, {}, {}
            dest = ctx.world.alloc((1, M // P, H, D), dtype, remote=True)
            views, keepalive = mg.symm_peer_views(ctx, (1, M // P, H, D), dtype)
            held = [dest, keepalive]  # alive until this shape is done
            for r in ctx.local_ranks:
                g = torch.Generator(device=ctx.device).manual_seed(1000003 * r + M + H)
                q[r], k[r], v[r] = (torch.randn(1, M, Hl, D, generator=g, device=ctx.device).to(dtype)
                                    for _ in range(3))
                o_loc[r] = torch.empty_like(q[r])
                tables[r] = (dest.peer_table(r) + r * Hl * D * q[r].element_size()).contiguous()

            def fns_for(r):
                return {
                    "fa_only": lambda: fa4_a2a.attention_local(q[r], k[r], v[r], o_loc[r]),
                    "fa_only_pers": lambda: fa4_a2a.attention_local(q[r], k[r], v[r], o_loc[r], persistent=True),
                    "a2a_nccl": lambda: a2a_all_to_all_single(o_loc[r]),
                    "a2a_symm": lambda: a2a_symm(o_loc[r], dest.local(r), tables[r], num_ranks=P),
                    "a2a_symm_torch": lambda: a2a_copy(o_loc[r], views[r], r),
                    "serial_nccl": lambda: (fa4_a2a.attention_local(q[r], k[r], v[r], o_loc[r]),
                                            a2a_all_to_all_single(o_loc[r])),
                    "serial_symm": lambda: (fa4_a2a.attention_local(q[r], k[r], v[r], o_loc[r]),
                                            a2a_symm(o_loc[r], dest.local(r), tables[r], num_ranks=P)),
                    "serial_symm_torch": lambda: (fa4_a2a.attention_local(q[r], k[r], v[r], o_loc[r]),
                                                  a2a_copy(o_loc[r], views[r], r)),
                    "fused": lambda: fa4_a2a.attention_a2a(q[r], k[r], v[r], dest.local(r), tables[r], num_ranks=P),
                    "fused_pers": lambda: fa4_a2a.attention_a2a(q[r], k[r], v[r], dest.local(r), tables[r],
                                                                num_ranks=P, persistent=True),
                }

            per_rank = {r: fns_for(r) for r in ctx.local_ranks}
            fns = {n: {r: per_rank[r][n] for r in ctx.local_ranks} for n in variants}
            samples, replays = mg.time_variants(ctx, fns, trials=args.trials, target_trial_us=args.target_trial_us,
                                                max_replays=args.max_replays, eager=NCCL_VARIANTS)
            red = mg.reduce_gathered(ctx, samples)
            ctx.host_barrier()
            if ctx.is_root:
                med = {n: red[n]["median_us"] for n in variants}
                row = {"H": H, "H_local": Hl, "M": M, "P": P, "head_dim": D, "dtype": args.dtype,
                       "world": ctx.backend, "replays": replays, "median_us": med, "timings": red,
                       "graphs": {n: n not in NCCL_VARIANTS for n in variants}, "wall_s": time.time() - t0,
                       **derive(med)}
                if "fa_only" in med:
                    row["model"] = model_prediction(platform, M, Hl, med["fa_only"], num_sms, q[ctx.local_ranks[0]]
                                                    .element_size(), D)
                rows.append(row)
                flat = {k2: row[k2] for k2 in ("H", "H_local", "M", "P", "world")}
                flat.update({f"{n}_us": med[n] for n in variants})
                flat.update({f"{n}_rank_spread": red[n]["rank_spread"] for n in variants})
                flat.update({k2: v2 for k2, v2 in row.items() if k2.startswith(("E_res", "H_", "speedup", "fused"))})
                for key in ("E_drain_us", "E_cap_us", "E_tail_us", "M_star_ub", "capacity_ok"):
                    if key in row.get("model", {}):
                        flat[f"model_{key}"] = row["model"][key]
                table.append(flat)
                print(f"H={H} M={M} " + " ".join(f"{n}={med[n]:.1f}" for n in variants)
                      + " | " + " ".join(f"{k2}={v2:.3f}" for k2, v2 in derive(med).items()), flush=True)
            held.clear()  # free before the next shape allocates
            fns = per_rank = samples = views = dest = None
            torch.cuda.empty_cache()
    return {"variants": variants, "skipped_variants": skipped, "num_sms": num_sms,
            "platform": getattr(platform, "name", None), "rows": rows}, table


def _main(ctx, args) -> None:
    payload, table = run(ctx, args)
    if ctx.is_root:
        payload = {**mg.header(ctx, "fa4_a2a", args), **payload}
        path = bench.write_result(args.out, args.stem, payload, table)
        print(f"wrote {path} and {Path(args.out) / (args.stem + '.csv')}")


def eres_figure(payload: dict, path):
    """E_res / T_FA vs M of a sweep result, measured and modelled (lab.fa4_a2a.bench.plot): the
    figure's path, or None without matplotlib or rows (a partial payload: the tables still stand)."""
    if importlib.util.find_spec("matplotlib") is None or not payload.get("rows"):
        return None
    from lab.fa4_a2a.bench import plot

    try:
        return plot(payload, str(path))
    except (KeyError, TypeError, ValueError) as e:
        print(f"no E_res figure: {type(e).__name__}: {e}")
        return None


def main(argv=None) -> int:
    args = parse_args(argv)
    return mg.run_entry(args, lambda ctx: _main(ctx, args))


if __name__ == "__main__":
    sys.exit(main())
