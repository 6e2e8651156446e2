"""MegaMoE correctness in a real multi-GPU world (issue 6, step 4; ``scripts/multigpu/correctness.py``).

The checks of tests/test_megamoe_gpu.py across processes (frame: :func:`lab.multigpu.run_checks`):
every rank generates the *whole* problem (all ranks' inputs, same seeds) so it can compute the
float32 reference of its own output locally, runs its own part of the real multi-rank kernel path
(Dispatch's peer loads, Combine's peer stores over NVLink; MegaMoE NaN-poisons the Combine slots
it reads before each call) and checks every element of its own output; the interleaved schedule's
output must equal expert_wave's bitwise.

Cases (:func:`moe_cases`): irregular token counts, zero-token ranks, masked picks, skew at
E = 16, H = 256, I = 128 with 128 x 64 tiles (lead 2, 2 experts per wave), once per Dispatch copy
(``--dispatch-copy``: :func:`dispatch_copies`, both by default, the bulk copy alone with
``--quick``); and one case with the config left at its defaults (``api-defaults``) at a size
where they resolve to the path loopback P = 8 runs at DeepSeek-V4-Flash: 128 x 256 tiles, 3
stages, the bulk Dispatch and, for expert_wave, its window and the L2 column order (H = 1024,
I = 512, 768 rows per local expert at P = 2); its records carry the resolved config.

``--precision`` also runs the cases in W8A8 and W4A8 (the FP8 kernels, weights quantized from the
same BF16 by ``load_weights``): the small cases at H = 512, I = 256 (the FP8 tiles are 128 x 256)
with the Dispatch copy that ``MegaMoEConfig.resolve`` picks unless ``--dispatch-copy`` says
otherwise (one copy keeps the compiles of a rarely lent multi-GPU host few; the api-defaults case
takes the bulk copy), each rank's output within the kernel tolerance of the recipe's emulation and
within the recipe's bound of float32, the schedules bitwise equal.
"""
from __future__ import annotations

import dataclasses
import traceback

from lab import multigpu as mg
from megamoe_interleave.config import DISPATCH_COPIES, PRECISIONS
from megamoe_interleave.scheduler import SCHEDULES

MOE_E, MOE_H, MOE_I = 16, 256, 128
# api-defaults case: (H, I, tokens per rank before the per-rank trim, top-k); P * T * k / E rows
# per local expert >= config.DEEP_RING_MAX_ROWS (512) selects the 3-stage tiles and the bulk Dispatch
MOE_DEFAULTS = (1024, 512, 1024, 6)
FP8_SMALL = (512, 256)  # (H, I) of the small cases in W8A8 / W4A8: one 128 x 256 tile holds an L1 row
IRREGULAR = (40, 1, 0, 77, 64, 5, 9, 120)
DEFAULTS = "defaults"  # the variant name of the api-defaults case
RESOLVED = "resolved"  # the variant of a small case with the Dispatch copy MegaMoEConfig.resolve picks


def add_args(p) -> None:
    """The megamoe flags of the correctness command line."""
    p.add_argument("--dispatch-copy", nargs="+", default=None, choices=DISPATCH_COPIES,
                   help="megamoe small cases: the Dispatch copies to check (default: both in BF16, bulk with "
                        "--quick; in W8A8 / W4A8 the one MegaMoEConfig.resolve picks)")
    p.add_argument("--precision", nargs="+", default=["bf16"], choices=PRECISIONS,
                   help="megamoe: the precisions to check (default bf16)")


def dispatch_copies(requested=None, quick: bool = False, precision: str = "bf16"):
    """The Dispatch copies the small cases run with: ``requested``, else in BF16 both (bulk with
    ``quick``), in an FP8 ``precision`` the resolved one (:data:`RESOLVED`)."""
    if requested:
        return tuple(requested)
    if precision != "bf16":
        return (RESOLVED,)
    return ("bulk",) if quick else DISPATCH_COPIES


def moe_cases(P: int, quick: bool = False):
    """(name, tokens per rank [P], top-k, routing, mask ratio, config); config: H, I,
    max_tokens (per rank) and api_defaults (no MegaMoEConfig field given, one run). MOE_E
    experts must split over P."""
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


def case_config(schedule: str, variant: str, cfg: dict, precision: str = "bf16"):
    """The MegaMoEConfig of one (case, variant): every field but the precision at its default for
    the api-defaults case, else lead 2 / 2 experts per wave, the Dispatch copy ``variant`` and
    128 x 64 tiles in BF16 (the FP8 precisions' 128 x 256)."""
    from megamoe_interleave.config import MegaMoEConfig

    if cfg.get("api_defaults"):
        return MegaMoEConfig(schedule=schedule, precision=precision)
    own = dict(lead=2) if schedule == "interleaved" else dict(experts_per_wave=2)
    return MegaMoEConfig(schedule=schedule, block_n=64 if precision == "bf16" else None, precision=precision,
                         dispatch_copy=None if variant == RESOLVED else variant, **own)


def case_dims(cfg: dict, precision: str):
    """(H, I) of a case in ``precision``: the FP8 precisions' small cases at :data:`FP8_SMALL`."""
    if precision == "bf16" or cfg.get("api_defaults"):
        return cfg["H"], cfg["I"]
    return FP8_SMALL


def references(precision: str, xs, idx, wts, w1, w2):
    """(the float32 reference, the recipe's emulation or None for BF16) of every rank's output."""
    from megamoe_interleave import quant, quant_fp4
    from megamoe_interleave.reference import reference_moe_fp32, reference_moe_w4a8, reference_moe_w8a8

    if precision == "w8a8":
        return (reference_moe_fp32(xs, idx, wts, w1, w2),
                reference_moe_w8a8(xs, idx, wts, *quant.quantize_weights(w1, w2)))
    if precision == "w4a8":  # fp32 on the dequantized FP4 weights: the recipe's bound is against those
        fp4 = quant_fp4.quantize_weights(w1, w2)
        return (reference_moe_fp32(xs, idx, wts, *quant_fp4.dequantize_weights(*fp4)),
                reference_moe_w4a8(xs, idx, wts, *fp4))
    return reference_moe_fp32(xs, idx, wts, w1, w2), None


def check_output(y, ref, emulated, precision: str) -> dict:
    """One rank's output against its references: BF16 every element within 0.02 + 0.02 max|ref|;
    W8A8 / W4A8 finite, within W8A8_KERNEL_REL_ERROR of the emulation (relative Frobenius error) and
    within the recipe's bound of float32 plus that tolerance."""
    from megamoe_interleave.reference import (W4A8_FP32_REL_ERROR, W8A8_FP32_REL_ERROR, W8A8_KERNEL_REL_ERROR,
                                              relative_error)

    c = mg.check_close(y, ref, 0.02, 0.02)
    if emulated is not None:  # the element check's max_abs_err stays in the record, its verdict does not count
        bound = (W8A8_FP32_REL_ERROR if precision == "w8a8" else W4A8_FP32_REL_ERROR)[1] + W8A8_KERNEL_REL_ERROR
        c.update(rel_err_emulation=relative_error([y], [emulated]), rel_err_fp32=relative_error([y], [ref]),
                 tol_emulation=W8A8_KERNEL_REL_ERROR, tol_fp32=bound)
        c["ok"] = c["finite"] and c["rel_err_emulation"] <= W8A8_KERNEL_REL_ERROR and c["rel_err_fp32"] <= bound
    c["shape_ok"] = tuple(y.shape) == tuple(ref.shape)
    c["ok"] = c["ok"] and c["shape_ok"]
    return c


def run_checks(ctx, quick: bool = False, copies=None, precisions=("bf16",)) -> list:
    """Every case of :func:`moe_cases` on this process's ranks of ``ctx`` (an
    :class:`lab.multigpu.Ctx`), both schedules, in each of ``precisions``, once per Dispatch copy
    of ``copies`` (default :func:`dispatch_copies`): one record per (case, precision, variant,
    rank), ``ok`` on a pass; an exception is recorded as a failed check and the next case runs
    (the other ranks do the same)."""
    results = []
    for case in moe_cases(ctx.P, quick):
        for precision in precisions:
            results += _check_case(ctx, case, precision, quick, copies)
    return results


def _check_case(ctx, case, precision: str, quick: bool, copies) -> list:
    """The records of one case in one precision (see :func:`run_checks`)."""
    import torch

    from megamoe_interleave.api import MegaMoE
    from lab.megamoe.routing import make_routing

    name, tokens, k, kind, mask, cfg = case
    P, dev = ctx.P, ctx.device
    H, I = case_dims(cfg, precision)
    seed = P * 7 + k
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(MOE_E, 2 * I, H, generator=g) / H ** 0.5).bfloat16().to(dev)
    w2 = (torch.randn(MOE_E, H, I, generator=g) / I ** 0.5).bfloat16().to(dev)
    xs = [torch.randn(t, H, generator=g).bfloat16().to(dev) for t in tokens]
    routes = [make_routing(kind, t, MOE_E, k, seed=seed * 31 + r, mask_ratio=mask, strength=2.0)
              for r, t in enumerate(tokens)]
    idx = [r_[0].to(dev) for r_ in routes]
    wts = [r_[1].to(dev) for r_ in routes]
    refs, emulated = references(precision, xs, idx, wts, w1, w2)
    results = []
    for variant in (DEFAULTS,) if cfg.get("api_defaults") else dispatch_copies(copies, quick, precision):
        outs = {}
        for sched in SCHEDULES:
            rec = {"kernel": "megamoe", "case": name, "precision": precision, "variant": f"{sched},{variant}",
                   "P": P, "tokens": tokens, "topk": k, "routing": kind, "mask": mask, "dims": [H, I]}
            try:
                moe = MegaMoE(ctx.world, MOE_E, H, I, k, cfg["max_tokens"],
                              case_config(sched, variant, cfg, precision), backend="fused")
                rec["config"] = dataclasses.asdict(moe.config)
                moe.load_weights(w1, w2)
                if ctx.backend == "loopback":
                    ys = moe.forward(xs, idx, wts)
                else:
                    ys = moe.forward(xs[ctx.rank], idx[ctx.rank], wts[ctx.rank])
                for r, y in zip(ctx.local_ranks, ys):
                    c = check_output(y, refs[r], None if emulated is None else emulated[r], precision)
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
