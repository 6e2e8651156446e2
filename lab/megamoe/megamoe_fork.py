"""The one public fused SM90 FP8 Mega MoE, a fork of DeepGEMM (AichenF/DeepGEMM ``megamoe_sm90_opt``), as a
baseline of our fused W8A8 layer: ``deep_gemm.fp8_mega_moe`` (Dispatch, both FP8 GEMMs with SwiGLU, Combine in
one kernel) next to our fused kernel, paired in one process on the same problem (DeepSeek-V4-Flash, P = 1, our
balanced routing and weights; the same 1x128 / 128x128 recipe, and our W8A8 weights are DeepSeek's blocks).

External, like :mod:`lab.megamoe.deepgemm`: the fork is imported only when it is on ``PYTHONPATH`` (the bundle of
docs/gpu.md, ``dgf.tar.xz``); :func:`load` says in one line why not otherwise. Its package is also named
``deep_gemm``, so a process holds the fork or upstream DeepGEMM, not both: this runs in its own process
(``scripts/bench_megamoe_fork.py``). The fork needs a ``torch.distributed`` group; one rank is enough
(:func:`one_rank_group`). Measured: results/h200/megamoe/fork/.
"""
from __future__ import annotations

import os
import socket
import statistics
from typing import Callable, Optional, Tuple

import torch


def load() -> Tuple[Optional[object], str]:
    """(the fork's ``deep_gemm`` module, "") or (None, why it cannot be used here)."""
    try:
        import deep_gemm
    except Exception as e:  # not on PYTHONPATH, or built for another torch / CUDA
        return None, f"the SM90 Mega MoE fork is not importable ({type(e).__name__}: {str(e)[:120]}); see docs/gpu.md"
    missing = [n for n in ("fp8_mega_moe", "get_symm_buffer_for_sm90_mega_moe", "transform_weights_for_mega_moe_sm90")
               if not hasattr(deep_gemm, n)]
    if missing:
        return None, f"this deep_gemm ({getattr(deep_gemm, '__version__', '?')}) is not the SM90 Mega MoE fork: no {missing[0]}"
    return deep_gemm, ""


def one_rank_group():
    """The default ``torch.distributed`` group, initialised with one NCCL rank on a free local port if
    none is yet (the fork's symmetric buffer asks for a group; with one rank it allocates plain memory)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    return dist.group.WORLD


def fused_layer(dg, shape, w1: torch.Tensor, w2: torch.Tensor, x: torch.Tensor, topk_idx: torch.Tensor,
                topk_weights: torch.Tensor) -> Tuple[Callable[[], float], Callable[[], torch.Tensor]]:
    """The fork's fused layer on one rank: (``timed``: stage the inputs into its symmetric buffer, then one
    call between two CUDA events, returning its device time in us; ``forward``: one call, returning y).
    ``w1`` [E, 2I, H] gate then up rows, ``w2`` [E, H, I] bf16 (quantized here in 128x128 blocks, as
    DeepSeek's checkpoints are: ``quant.quantize_weight``); ``x`` [T, H] bf16 (quantized per token and 128
    columns); ``topk_idx`` [T, k] (-1 = masked), ``topk_weights`` [T, k] f32."""
    from megamoe_interleave import quant

    E, H, I, k = shape.num_experts, shape.hidden, shape.intermediate, shape.topk
    T = x.shape[0]
    l1, l2 = dg.transform_weights_for_mega_moe_sm90(quant.quantize_weight(w1), quant.quantize_weight(w2))
    buffer = dg.get_symm_buffer_for_sm90_mega_moe(one_rank_group(), E, T, k, H, I)
    x_q, x_s = quant.quantize_act(x)
    idx = topk_idx.to(buffer.topk_idx.dtype)
    wts = topk_weights.to(buffer.topk_weights.dtype)
    y = torch.empty(T, H, dtype=torch.bfloat16, device=x.device)
    stats = torch.zeros(E, dtype=torch.int32, device=x.device)

    def stage():  # the fork's bench stages every call: the kernel consumes its inputs' slots
        buffer.x[:T].copy_(x_q)
        buffer.x_sf[:T].copy_(x_s)
        buffer.topk_idx[:T].copy_(idx)
        buffer.topk_weights[:T].copy_(wts)

    def call():
        dg.fp8_mega_moe(y, l1, l2, buffer, cumulative_local_expert_recv_stats=stats, recipe=(128, 128, 128),
                        activation="swiglu", activation_clamp=None, fast_math=True)

    def timed() -> float:
        stage()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    def forward() -> torch.Tensor:
        stage()
        call()
        torch.cuda.synchronize()
        return y.clone()

    return timed, forward


def against_ours(*, tokens: int = 8192, trials: int = 11, cooldown_s: float = 0.25) -> dict:
    """Our fused W8A8 kernel alone and the fork's fused layer, paired and cooled, at loopback P = 1 on
    DeepSeek-V4-Flash (balanced routing): both checked first against the fp32 reference on a sample of
    tokens (ours also against the recipe's emulation), then timed; the fork as the baseline."""
    from lab import bench
    from lab.megamoe.bench import build_moe
    from lab.megamoe.demo import CHECK_TOKENS, SHAPE, problem, rerun_time
    from megamoe_interleave import MegaMoEConfig, quant
    from megamoe_interleave.reference import (W8A8_FP32_REL_ERROR, W8A8_KERNEL_REL_ERROR, reference_moe_fp32,
                                              reference_moe_w8a8, relative_error)
    from megamoe_interleave.shapes import get_shape

    dg, why = load()
    if dg is None:
        raise SystemExit(why)
    shape = get_shape(SHAPE)
    w1, w2, xs, idx, wts = problem(shape, 1, tokens)
    sample = torch.randperm(tokens, generator=torch.Generator().manual_seed(1))[:CHECK_TOKENS].cuda()
    picked = ([xs[0][sample]], [idx[0][sample]], [wts[0][sample]])
    fp32 = reference_moe_fp32(*picked, w1, w2)
    out = {"shape": f"DeepSeek-V4-Flash MoE, loopback P = 1, {tokens} tokens, balanced routing",
           "fork": f"deep_gemm {getattr(dg, '__version__', '?')} (SM90 Mega MoE fork)", "checks": {}}
    moe = build_moe(shape, 1, tokens, MegaMoEConfig("interleaved", precision="w8a8"), w1, w2, poison_combine=True)
    ys = [y[sample] for y in moe(xs, idx, wts)]
    out["checks"]["ours"] = {"vs_recipe": relative_error(ys, reference_moe_w8a8(*picked, *quant.quantize_weights(w1, w2))),
                             "vs_fp32": relative_error(ys, fp32)}
    out["checks"]["ours"]["ok"] = out["checks"]["ours"]["vs_recipe"] <= W8A8_KERNEL_REL_ERROR
    moe.poison_combine = False
    timed, forward = fused_layer(dg, shape, w1, w2, xs[0], idx[0], wts[0])
    err = relative_error([forward()[sample]], fp32)
    out["checks"]["fork"] = {"vs_fp32": err, "ok": err <= W8A8_FP32_REL_ERROR[1] + W8A8_KERNEL_REL_ERROR}
    timed()  # warm-up (forward ran it once already); each trial stages, then times the call alone
    fns = {"fused w8a8 (ours)": rerun_time(moe), "Mega MoE fork": timed}
    samples, clocks = bench.paired_trials(fns, trials, cooldown_s)
    out["paired"] = bench.paired_verdicts(samples, clocks, "Mega MoE fork", 30.0)
    flops = 6 * int((idx[0] >= 0).sum()) * shape.hidden * shape.intermediate
    out["median_us"] = {k: statistics.median(v) for k, v in samples.items()}
    out["tflops"] = {k: flops / us / 1e6 for k, us in out["median_us"].items()}
    out["ok"] = all(c["ok"] for c in out["checks"].values())
    return out


def main(argv=None):
    import argparse
    import json

    from xstage import provenance

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--trials", type=int, default=11)
    ap.add_argument("--out", default=None, help="directory for megamoe_fork.json")
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.trials < 5:
        ap.error("--tokens >= 1 and --trials >= 5 (the sign test needs five matched trials)")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        ap.error("needs a Hopper GPU (sm_90)")
    out = against_ours(tokens=args.tokens, trials=args.trials)
    print(f"{out['shape']}; {out['fork']}")
    for name, c in out["checks"].items():
        print(f"   check {name:5s} " + ", ".join(f"{k} {v:.2e}" for k, v in c.items() if k != "ok") +
              (" -> ok" if c["ok"] else " -> FAILED"))
    for name, us in out["median_us"].items():
        print(f"   {name:20s} {us:8.0f} us  {out['tflops'][name]:5.0f} TFLOP/s")
    v = out["paired"]["variants"]["fused w8a8 (ours)"]
    print(f"   ours / fork: {v['median_ratio']:.3f} (paired, {out['paired']['reference_clock_mhz']} MHz, "
          f"{v['n_matched']} matched trials)")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "megamoe_fork.json"), "w") as f:
            json.dump({**out, "provenance": provenance.collect()}, f, indent=1, default=str)
    if not out["ok"]:
        raise SystemExit("a check failed (see above)")
