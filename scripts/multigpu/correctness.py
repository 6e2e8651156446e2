#!/usr/bin/env python
"""Correctness of both kernels in a real multi-GPU world (issue 6, step 4).

The checks of tests/test_fa4_a2a_gpu.py (fa4_a2a.multigpu_checks) and tests/test_megamoe_gpu.py
(here), run across processes (frame: xstage.multigpu.run_checks):
every rank generates the *whole* problem (all ranks' inputs, same seeds) so it can compute the
float32 reference of its own output locally, poisons its destination (NaN), synchronizes the
world, runs its own part of the real multi-rank kernel path (peer stores / peer loads over
NVLink), synchronizes again and checks every element of its own output.  Per-case results of
every rank are gathered on rank 0 and written to JSON; the exit status is 1 if any check failed.

fa4_a2a cases: fa4_a2a.multigpu_checks. megamoe cases: the fused kernel with both schedules
(bitwise equal) for every ``mma`` kind the kernel has (``kernel_sm90.MMA_KINDS``; ``--mma`` to
choose) on irregular token counts, zero-token ranks, masked picks, skew (64 x 64 tiles); and one case with every option at the
API's default (``api-defaults``: 128 x 256 tiles, 3 stages, the bulk Dispatch from the peers'
``x`` with its L2 policy and, for expert_wave, its window and the L2 column order) at a size
where those defaults apply (H = 1024, I = 512, 768 rows per local expert at P = 2).

  torchrun --nproc-per-node=8 scripts/multigpu/correctness.py --world torch-symm --out results/h200x8/correctness
  python scripts/multigpu/correctness.py --world loopback --P 4 --out results/h200x1-loopback/correctness
"""
from __future__ import annotations

import argparse
import sys
import traceback

from xstage import multigpu as mg

KERNELS = ("fa4", "megamoe")
MOE_E, MOE_H, MOE_I = 16, 256, 128
# api-defaults case: (H, I, tokens per rank before the per-rank trim, top-k); P * T * k / E rows
# per local expert >= api.DEEP_RING_MAX_ROWS (512) selects the 3-stage tiles and the bulk Dispatch
MOE_DEFAULTS = (1024, 512, 1024, 6)
IRREGULAR = (40, 1, 0, 77, 64, 5, 9, 120)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mg.add_world_args(p, default_out="results/h200xN/correctness", trials=1)
    p.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    p.add_argument("--mma", nargs="+", default=None,
                   help="megamoe fused-kernel variants (default: every MegaMoE mma kind; wgmma with --quick)")
    p.add_argument("--stem", default="correctness")
    return p.parse_args(argv)


def moe_mma_kinds(requested=None, quick: bool = False):
    """The megamoe ``mma`` variants to check: ``requested``, else every kind the kernel knows."""
    if requested:
        return tuple(requested)
    if quick:
        return ("wgmma",)
    try:
        from megamoe_interleave.kernel_sm90 import MMA_KINDS
    except ImportError:
        return ("wgmma", "wgmma_cpasync", "fma")
    return tuple(MMA_KINDS)


def moe_cases(P: int, quick: bool = False):
    """(name, tokens per rank [P], top-k, routing, mask ratio, config); config: H, I,
    max_tokens (per rank) and api_defaults (no MegaMoE option given, one run at the default
    mma). MOE_E experts must split over P."""
    if MOE_E % P:
        raise mg.WorldArgsError(f"megamoe correctness uses E={MOE_E} experts: P={P} must divide it")
    small = dict(H=MOE_H, I=MOE_I, max_tokens=256)
    cases = [
        ("irregular-skewed-k8", [IRREGULAR[r % 8] for r in range(P)], 8, "skewed", 0.1, small),
        ("uniform-balanced-k6", [32] * P, 6, "balanced", 0.0, small),
        ("mixed-balanced-k2-masked", [(65, 3, 130, 17)[r % 4] for r in range(P)], 2, "balanced", 0.2, small),
        ("one-source-skewed-k1", [100] + [0] * (P - 1), 1, "skewed", 0.0, small),
    ]
    H, I, T, k = MOE_DEFAULTS
    defaults = ("api-defaults-balanced-k6", [T - 37 * (r % 3) for r in range(P)], k, "balanced", 0.0,
                dict(H=H, I=I, max_tokens=T, api_defaults=True))
    return cases[:2] if quick else cases + [defaults]


def _fa(ctx, quick):
    """The fa4 checks (fa4_a2a.multigpu_checks; imported only when they run)."""
    from fa4_a2a.multigpu_checks import run_checks

    return run_checks(ctx, quick)


def _moe(ctx, quick, mmas):
    import torch

    from megamoe_interleave.api import MegaMoE
    from megamoe_interleave.reference import reference_moe_fp32
    from megamoe_interleave.routing import make_routing

    P, dev = ctx.P, ctx.device
    results = []
    for name, tokens, k, kind, mask, cfg in moe_cases(P, quick):
        H, I = cfg["H"], cfg["I"]
        seed = P * 7 + k
        g = torch.Generator().manual_seed(seed)
        w1 = (torch.randn(MOE_E, 2 * I, H, generator=g) / H ** 0.5).bfloat16().to(dev)
        w2 = (torch.randn(MOE_E, H, I, generator=g) / I ** 0.5).bfloat16().to(dev)
        xs = [torch.randn(t, H, generator=g).bfloat16().to(dev) for t in tokens]
        routes = [make_routing(kind, t, MOE_E, k, seed=seed * 31 + r, mask_ratio=mask, strength=2.0)
                  for r, t in enumerate(tokens)]
        idx = [r_[0].to(dev) for r_ in routes]
        wts = [r_[1].to(dev) for r_ in routes]
        refs = reference_moe_fp32(xs, idx, wts, w1, w2)
        # the api-defaults case runs the API's default mma once, with no option given
        for mma in ("defaults",) if cfg.get("api_defaults") else mmas:
            outs = {}
            for sched in ("expert_wave", "interleaved"):
                rec = {"kernel": "megamoe", "case": name, "variant": f"{sched},{mma}", "P": P, "tokens": tokens,
                       "topk": k, "routing": kind, "mask": mask}
                try:
                    options = {} if cfg.get("api_defaults") else dict(lead=2, block_m=64, block_n=64,
                                                                      experts_per_wave=2, mma=mma)
                    moe = MegaMoE(ctx.world, num_experts=MOE_E, hidden=H, intermediate=I, topk=k,
                                  max_tokens_per_rank=cfg["max_tokens"], schedule=sched, backend="fused", **options)
                    if cfg.get("api_defaults"):
                        opts = moe.kernel_options
                        rec["kernel_options"] = {key: opts[key] for key in (
                            "block_m", "block_n", "stages", "mma", "dispatch_copy", "dispatch_evict_first",
                            "dispatch_window")}
                        rec["kernel_options"]["l2_columns"] = moe.schedule.l2_columns
                    moe.load_weights(w1, w2)
                    if ctx.backend == "loopback":
                        ys = moe.forward(xs, idx, wts)
                    else:
                        ys = moe.forward(xs[ctx.rank], idx[ctx.rank], wts[ctx.rank])
                    for r, y in zip(ctx.local_ranks, ys):
                        c = mg.check_close(y, refs[r], 0.02, 0.02)
                        c["shape_ok"] = tuple(y.shape) == tuple(refs[r].shape)
                        c["ok"] = c["ok"] and c["shape_ok"]
                        outs.setdefault(sched, {})[r] = y.clone()
                        if sched == "interleaved" and "expert_wave" in outs:
                            c["bitwise_equal_to_expert_wave"] = bool(torch.equal(outs["expert_wave"][r], y))
                            c["ok"] = c["ok"] and c["bitwise_equal_to_expert_wave"]
                        results.append({**rec, "rank": r, **c})
                    del moe
                except Exception as e:
                    results.append({**rec, "rank": ctx.rank, "ok": False, "error": f"{type(e).__name__}: {e}",
                                    "traceback": traceback.format_exc()})
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    mmas = moe_mma_kinds(args.mma, args.quick)
    checks = {"fa4": lambda ctx: _fa(ctx, args.quick),
              "megamoe": lambda ctx: _moe(ctx, args.quick, mmas)}
    chosen = {k: checks[k] for k in KERNELS if k in args.kernels}
    return mg.run_entry(args, lambda ctx: mg.run_checks(ctx, args, chosen))


if __name__ == "__main__":
    sys.exit(main())
