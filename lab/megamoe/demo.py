"""The megamoe_interleave half of ``scripts/run`` on a Hopper GPU: DeepSeek-V4-Flash's MoE layer
(E = 256, H = 4096, I = 2048, top-6) in the loopback world, P = 8 ranks of 8192 tokens, balanced
routing. Both schedules' fused kernels are checked against the fp32 reference (a sample of every
rank's tokens) and the unfused pipeline, then timed next to the two grouped GEMMs alone and the
unfused pipeline in paired, rotated, clock-read trials (lab.bench), each call after a 0.25 s
cool-down: back to back, the P = 8 calls run at the 700 W cap and their clocks spread over
1.5-2.0 GHz, so no trial matched the reference clock (the bench's ``--cooldown-s``).

Weights and inputs are drawn on the GPU (seconds instead of the bench's CPU generator), so the
numbers are not the bench's inputs; the kernels' times do not depend on the values' seed.
"""
from __future__ import annotations


def run(*, P: int = 8, tokens: int = 8192, trials: int = 11, check_tokens: int = 64, cooldown_s: float = 0.25) -> dict:
    import torch

    from megamoe_interleave import MegaMoEConfig
    from lab.megamoe.bench import build_moe, check_against, grouped_gemms
    from megamoe_interleave.reference import reference_moe_fp32, unfused_pipeline
    from megamoe_interleave.routing import make_routing
    from megamoe_interleave.shapes import get_shape
    from lab import bench

    shape = get_shape("deepseek-v4-flash")
    E, H, I, k = shape.num_experts, shape.hidden, shape.intermediate, shape.topk
    g = torch.Generator(device="cuda").manual_seed(0)
    w1 = torch.randn(E, 2 * I, H, generator=g, device="cuda", dtype=torch.bfloat16) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g, device="cuda", dtype=torch.bfloat16) / I ** 0.5
    xs = [torch.randn(tokens, H, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(P)]
    routes = [make_routing("balanced", tokens, E, k, seed=r) for r in range(P)]
    idx, wts = [r[0].cuda() for r in routes], [r[1].cuda() for r in routes]
    (w1_t, w2_t), gemms = grouped_gemms(shape, P, w1, w2, idx, wts)
    unfused = unfused_pipeline(xs, idx, wts, w1_t, w2_t)
    sample = torch.randperm(tokens, generator=torch.Generator().manual_seed(1))[:check_tokens].cuda()
    refs = reference_moe_fp32([x[sample] for x in xs], [i[sample] for i in idx], [w[sample] for w in wts], w1, w2)
    fns = {"grouped_mm x2": bench.event_timed(gemms),
           "unfused pipeline": bench.event_timed(lambda: unfused_pipeline(xs, idx, wts, w1_t, w2_t))}
    out = {"shape": f"DeepSeek-V4-Flash MoE, loopback P = {P}, {tokens} tokens per rank, balanced routing",
           "checks": {}, "configs": {}}
    weights = {}  # the two layers share one copy of the kernel-layout weights (12 GB at P = 8)
    for schedule in ("interleaved", "expert_wave"):
        moe = build_moe(shape, P, tokens, MegaMoEConfig(schedule), w1, w2, poison_combine=True, weight_cache=weights)
        ys = moe(xs, idx, wts)
        err = max((y[sample].float() - r).abs().max().item() for y, r in zip(ys, refs))
        check_against(ys, unfused, f"fused[{schedule}]")  # every element, against the unfused pipeline
        out["checks"][schedule] = {"max_abs_err_vs_fp32_sample": err, "ok": err <= 0.02 + 0.02 * max(
            r.abs().max().item() for r in refs)}
        out["configs"][schedule] = str(moe.config)
        moe.poison_combine = False
        fns[f"fused[{schedule}]"] = _kernel_time(moe)
    samples, clocks = bench.paired_trials(fns, trials, cooldown_s)
    row = dict(shape=shape.name, P=P, tokens_per_rank=tokens,
               **bench.paired_verdicts(samples, clocks, "grouped_mm x2", 30.0))
    picks = sum(int((i >= 0).sum()) for i in idx)
    out["tflops"] = {n: 6 * picks * H * I / (v.get("median_us") or float("nan")) / 1e6
                     for n, v in row["variants"].items()}
    out["paired"] = row
    out["ok"] = all(c["ok"] for c in out["checks"].values())
    return out


def _kernel_time(moe):
    """() -> the fused kernels' device time of one call (the staged inputs again: MegaMoE.rerun)."""
    def timed():
        moe.rerun()
        return moe.last_kernel_us
    return timed
