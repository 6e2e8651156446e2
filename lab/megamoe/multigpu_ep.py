"""MegaMoE expert-parallel comparison on several GPUs (issue 6, step 3): expert-wave vs interleaved.

Per (shape, routing, tokens per rank) every rank holds ``tokens`` tokens routed to global
experts (E / P experts per rank) and runs ``MegaMoE.forward`` with the fused CuTe DSL kernel
(Dispatch pulls rows over NVLink from every source rank's symmetric ``x``; Combine stores
every L2 row back to its source rank) once per schedule and precision (``--precision``: BF16,
W8A8, W4A8; ``load_weights`` quantizes the same BF16 weights), each with its default
:class:`~megamoe_interleave.config.MegaMoEConfig` (``--block-n``, ``--stages``, ``--lead`` set
those fields; every row records the resolved config).

Time per rank and trial: the fused kernel's device time (``MegaMoE.last_kernel_us``, CUDA
events around the launch), and the whole ``forward`` wall time (host planning, staging,
barriers, top-k reduction).  Trials aligned across ranks; max across ranks per trial; median
of trials.  Speedup = T(expert_wave) / T(interleaved) per configuration; geometric mean over
configurations; configurations with speedup < 1 are listed as regressions.

``--grouped-gemms`` also times the two ``torch._grouped_mm`` GEMMs alone on each rank's rows
(every process regenerates every rank's routing, so it knows how many rows each of its local
experts receives; random bf16 A of those shapes), with the same trials, alignment and
reduction (:func:`lab.megamoe.bench.grouped_gemms` on the global weights), and reports
each schedule's kernel time over theirs. Medians of separate trial series, not paired or
clock-matched (lab.megamoe.bench's paired comparison is loopback only).

In the loopback world one call runs every simulated rank's kernel back to back on one GPU,
so ``last_kernel_us`` is the whole world's time (reported as rank 0's sample).

  torchrun --nproc-per-node=8 -m lab.megamoe.multigpu_ep --world torch-symm --out results/h200x8/megamoe
  python -m lab.megamoe.multigpu_ep --world loopback --P 8 --quick --out results/h200x1-loopback/megamoe

(``scripts/multigpu/megamoe_ep.py`` is the same command line.)
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from lab import bench
from lab import multigpu as mg
from megamoe_interleave.config import BLOCK_M, BLOCK_NS, PRECISIONS, MegaMoEConfig
from megamoe_interleave.scheduler import SCHEDULES

GROUPED = "grouped_mm x2"  # the rows of --grouped-gemms (their "schedule" key)
DEFAULT_SHAPES = ("deepseek-v4-flash", "mimo-v2-flash")  # same (H, I): one compile per schedule
DEFAULT_TOKENS = (2048, 8192)
QUICK_TOKENS = (1024,)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mg.add_world_args(p, default_out="results/h200xN/megamoe", trials=7)
    p.add_argument("--shape", nargs="+", default=list(DEFAULT_SHAPES),
                   help="megamoe_interleave.shapes names, or 'all' for every shape with known dimensions")
    p.add_argument("--routing", nargs="+", default=["balanced", "skewed"], choices=["balanced", "skewed"])
    p.add_argument("--strength", type=float, default=1.0, help="skewed routing strength")
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help=f"tokens per rank (default {DEFAULT_TOKENS}; {QUICK_TOKENS} with --quick)")
    p.add_argument("--precision", nargs="+", default=["bf16"], choices=PRECISIONS,
                   help="precisions to run, each on the same BF16 weights (default bf16)")
    p.add_argument("--block-n", type=int, default=None, choices=BLOCK_NS,
                   help=f"N tile of the fused kernel (M is {BLOCK_M}; default: MegaMoEConfig.resolve's)")
    p.add_argument("--stages", type=int, default=None, help="A/B ring depth (default: MegaMoEConfig.resolve's)")
    p.add_argument("--lead", type=int, default=None, help="interleaved: lead D (default: eq. 16)")
    p.add_argument("--grouped-gemms", action="store_true",
                   help="also time the two torch._grouped_mm GEMMs alone on each rank's rows (see above; "
                        "keeps the global weights on every GPU)")
    p.add_argument("--stem", default="ep", help="output file stem")
    return mg.parse_with_quick_grid(p, argv, "tokens", DEFAULT_TOKENS, QUICK_TOKENS, quick_trials=3)


def resolve_shapes(names, P: int):
    """Shape objects for ``names`` ('all' = every known shape); experts must split over P ranks."""
    from megamoe_interleave.shapes import SHAPES, get_shape

    if list(names) == ["all"]:
        names = [n for n, s in SHAPES.items() if s.known]
    try:
        shapes = [get_shape(n) for n in names]
    except (KeyError, ValueError) as e:
        raise mg.WorldArgsError(str(e.args[0] if e.args else e)) from None
    bad = [s.name for s in shapes if s.num_experts % P]
    if bad:
        raise mg.WorldArgsError(f"num_experts not divisible by P={P} for {bad}")
    return shapes


def schedule_config(schedule: str, args, precision: str = "bf16") -> MegaMoEConfig:
    """The MegaMoEConfig of one schedule from the command line (``--lead``: interleaved only)."""
    return MegaMoEConfig(schedule=schedule, block_n=args.block_n, stages=args.stages, precision=precision,
                         lead=args.lead if schedule == "interleaved" else None)


def summarize(rows) -> dict:
    """Per-config speedup (expert_wave / interleaved kernel time), geometric mean, regressions. Pure."""
    by_cfg = {}
    for r in rows:
        key = (r["shape"], r.get("precision", "bf16"), r["routing"], r["tokens_per_rank"])
        by_cfg.setdefault(key, {})[r["schedule"]] = r
    configs, speedups = [], []
    for key, d in by_cfg.items():
        if not all(s in d for s in SCHEDULES):
            continue
        ew, il = d["expert_wave"]["kernel_median_us"], d["interleaved"]["kernel_median_us"]
        sp = ew / il
        api = d["expert_wave"]["api_median_us"] / d["interleaved"]["api_median_us"]
        cfg = {"shape": key[0], "precision": key[1], "routing": key[2], "tokens_per_rank": key[3], "expert_wave_us": ew,
               "interleaved_us": il, "speedup": sp, "speedup_api": api}
        if GROUPED in d:  # fused kernel time over the GEMMs' alone (< 1: fused faster)
            gg = d[GROUPED]["kernel_median_us"]
            cfg.update(grouped_us=gg, expert_wave_vs_grouped=ew / gg, interleaved_vs_grouped=il / gg)
        configs.append(cfg)
        speedups.append(sp)
    out = {"configs": configs}
    if speedups:
        out["geomean_speedup"] = mg.geomean(speedups)
        out["max_speedup"] = max(speedups)
        out["min_speedup"] = min(speedups)
        out["regressions"] = [c for c in configs if c["speedup"] < 1.0]
        precisions = sorted({c["precision"] for c in configs})
        if len(precisions) > 1:
            out["geomean_by_precision"] = {p: mg.geomean([c["speedup"] for c in configs if c["precision"] == p])
                                           for p in precisions}
    return out


def run(ctx, args):
    import torch

    from megamoe_interleave.api import MegaMoE

    P = ctx.P
    shapes = resolve_shapes(args.shape, P)
    dev = ctx.device
    rows = []
    for shape in shapes:
        E, H, I, k = shape.num_experts, shape.hidden, shape.intermediate, shape.topk
        # Global weights, identical on every rank (same generator seed); only the local experts are kept.
        g = torch.Generator(device=dev).manual_seed(0)
        w1 = (torch.randn(E, 2 * I, H, generator=g, device=dev, dtype=torch.bfloat16) * H ** -0.5)
        w2 = (torch.randn(E, H, I, generator=g, device=dev, dtype=torch.bfloat16) * I ** -0.5)
        for precision in args.precision:
            moes = {}
            for sched in SCHEDULES:
                moes[sched] = MegaMoE(ctx.world, E, H, I, k, max(args.tokens), schedule_config(sched, args, precision),
                                      backend="fused",
                                      num_sms=torch.cuda.get_device_properties(dev).multi_processor_count)
                moes[sched].load_weights(w1, w2)
            # the GEMM baseline (BF16 grouped GEMMs) once per shape, with its first precision
            gemm_weights = (w1, w2) if args.grouped_gemms and precision == args.precision[0] else None
            rows += _time_schedules(ctx, args, shape, precision, moes, gemm_weights)
            del moes
            torch.cuda.empty_cache()
        del w1, w2
        torch.cuda.empty_cache()
    return rows


def _time_schedules(ctx, args, shape, precision: str, moes: dict, gemm_weights) -> list:
    """Every (routing, tokens) of ``args`` for one shape and precision: both schedules' layers of
    ``moes`` timed (and the grouped GEMMs where ``gemm_weights`` is given); the root's rows."""
    import torch

    from lab.megamoe.routing import imbalance, make_routing

    E, H, k, P, dev = shape.num_experts, shape.hidden, shape.topk, ctx.P, ctx.device
    rows = []
    for kind in args.routing:
        for T in args.tokens:
            xs, idx, wts = [], [], []
            for r in ctx.local_ranks:
                gx = torch.Generator(device=dev).manual_seed(7919 * r + T)
                xs.append(torch.randn(T, H, generator=gx, device=dev).to(torch.bfloat16))
                i_r, w_r = make_routing(kind, T, E, k, seed=r, strength=args.strength)
                idx.append(i_r.to(dev))
                wts.append(w_r.to(dev))
            imb = imbalance(torch.cat([i.cpu() for i in idx]), E)
            for sched in SCHEDULES:
                moe = moes[sched]
                arg = (xs, idx, wts) if ctx.backend == "loopback" else (xs[0], idx[0], wts[0])
                moe.forward(*arg)  # warm-up: compile, first-touch
                kern = {r: [] for r in ctx.local_ranks[:1]}
                api = {r: [] for r in ctx.local_ranks[:1]}
                t0 = time.time()
                for _ in range(args.trials):
                    ctx.align()
                    w0 = time.perf_counter()
                    moe.forward(*arg)
                    wall = (time.perf_counter() - w0) * 1e6
                    r0 = ctx.local_ranks[0]
                    kern[r0].append(moe.last_kernel_us)
                    api[r0].append(wall)
                red_k = mg.reduce_gathered(ctx, {"kernel": kern})
                red_a = mg.reduce_gathered(ctx, {"api": api})
                if ctx.is_root:
                    row = {"shape": shape.name, "precision": precision, "routing": kind, "tokens_per_rank": T,
                           "schedule": sched, "P": P, "world": ctx.backend, "lead": moe.config.lead,
                           "block": f"{BLOCK_M}x{moe.config.block_n}", "stages": moe.config.stages,
                           "dispatch_copy": moe.config.dispatch_copy, "routing_imbalance_local": imb,
                           "kernel_median_us": red_k["kernel"]["median_us"],
                           "kernel_p10_us": red_k["kernel"]["p10_us"], "kernel_p90_us": red_k["kernel"]["p90_us"],
                           "kernel_rank_spread": red_k["kernel"]["rank_spread"],
                           "api_median_us": red_a["api"]["median_us"], "wall_s": time.time() - t0,
                           "config": dataclasses.asdict(moe.config),
                           "kernel_timing": red_k["kernel"], "api_timing": red_a["api"]}
                    rows.append(row)
                    print(f"{shape.name} {precision} {kind} T={T} {sched}: kernel {row['kernel_median_us']:.1f} us "
                          f"(api {row['api_median_us']:.1f} us)", flush=True)
            if gemm_weights is not None:
                row = time_grouped_gemms(ctx, args, shape, kind, T, *gemm_weights)
                if row is not None:
                    rows.append(row)
                    print(f"{shape.name} {kind} T={T} {GROUPED}: {row['kernel_median_us']:.1f} us", flush=True)
            del xs, idx, wts
    return rows


def time_grouped_gemms(ctx, args, shape, kind: str, T: int, w1, w2):
    """--grouped-gemms: the two grouped GEMMs of every local rank (its received rows per local
    expert, from every rank's routing regenerated with the seeds of ``run``; the global weights
    ``w1``, ``w2``), timed with CUDA events per aligned trial; the reduced row on the root, None
    elsewhere."""
    from lab.megamoe.bench import grouped_gemms
    from lab.megamoe.routing import make_routing

    routes = [make_routing(kind, T, shape.num_experts, shape.topk, seed=r, strength=args.strength)
              for r in range(ctx.P)]
    _, gemms = grouped_gemms(shape, ctx.P, w1, w2, [i for i, _ in routes], [w for _, w in routes],
                             ranks=ctx.local_ranks)
    timed = bench.event_timed(gemms)  # after one warm-up call
    samples = {r: [] for r in ctx.local_ranks[:1]}
    for _ in range(args.trials):
        ctx.align()
        samples[ctx.local_ranks[0]].append(timed())
    red = mg.reduce_gathered(ctx, {"kernel": samples})
    if not ctx.is_root:
        return None
    return {"shape": shape.name, "routing": kind, "tokens_per_rank": T, "schedule": GROUPED, "P": ctx.P,
            "world": ctx.backend, "kernel_median_us": red["kernel"]["median_us"],
            "kernel_p10_us": red["kernel"]["p10_us"], "kernel_p90_us": red["kernel"]["p90_us"],
            "kernel_rank_spread": red["kernel"]["rank_spread"], "kernel_timing": red["kernel"]}


def _main(ctx, args) -> None:
    rows = run(ctx, args)
    if ctx.is_root:
        summ = summarize(rows)
        payload = {**mg.header(ctx, "megamoe", args), "rows": rows, "summary": summ}
        flat = [{k: v for k, v in r.items() if not isinstance(v, dict)} for r in rows]
        path = bench.write_result(args.out, args.stem, payload, flat)
        print(f"wrote {path}; geomean speedup {summ.get('geomean_speedup', float('nan')):.3f}x "
              f"(paper {mg.PAPER['megamoe_geomean']}x)")


def main(argv=None) -> int:
    args = parse_args(argv)
    return mg.run_entry(args, lambda ctx: _main(ctx, args))


if __name__ == "__main__":
    sys.exit(main())
