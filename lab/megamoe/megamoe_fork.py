"""The public fused SM90 Mega MoEs, forks of DeepGEMM (AichenF/DeepGEMM), as baselines of our fused layers, each
next to our fused kernels, paired in one process on the same problem (DeepSeek-V4-Flash, P = 1, our balanced routing
and BF16 weights, each side quantizing them its own way):

* ``fp8`` (branch ``megamoe_sm90_opt``): ``deep_gemm.fp8_mega_moe`` (Dispatch, both FP8 GEMMs with SwiGLU,
  Combine in one kernel) against our W8A8 kernel; the same 1x128 / 128x128 recipe, and our W8A8 weights are
  DeepSeek's blocks.
* ``nvfp4`` (branch ``megamoe_nvfp4_dev``): ``deep_gemm.nvfp4_mega_moe``, NVFP4 weights (E2M1 with an E4M3 scale
  per 16, widened to E4M3 in shared memory) and FP8 activations, against our W4A8 and W8A8 kernels.

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


# per fork: (the layer call, its symmetric buffer, its weight transform), as the fork's own benches call them
FORKS = {"fp8": ("fp8_mega_moe", "get_symm_buffer_for_sm90_mega_moe", "transform_weights_for_mega_moe_sm90"),
         "nvfp4": ("nvfp4_mega_moe", "get_symm_buffer_for_mega_moe", "transform_nvfp4_weights_for_mega_moe_sm90")}


def load(fork: str = "fp8") -> Tuple[Optional[object], str]:
    """(the fork's ``deep_gemm`` module, "") or (None, why it cannot be used here)."""
    try:
        import deep_gemm
    except Exception as e:  # not on PYTHONPATH, or built for another torch / CUDA
        return None, f"the SM90 Mega MoE fork is not importable ({type(e).__name__}: {str(e)[:120]}); see docs/gpu.md"
    missing = [n for n in FORKS[fork] if not hasattr(deep_gemm, n)]
    if missing:
        return None, (f"this deep_gemm ({getattr(deep_gemm, '__version__', '?')}) is not the {fork} SM90 Mega MoE fork: "
                      f"no {missing[0]}")
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
                topk_weights: torch.Tensor, fork: str = "fp8") -> Tuple[Callable[[], float], Callable[[], torch.Tensor]]:
    """The fork's fused layer on one rank: (``timed``: stage the inputs into its symmetric buffer, then one
    call between two CUDA events, returning its device time in us; ``forward``: one call, returning y).
    ``w1`` [E, 2I, H] gate then up rows, ``w2`` [E, H, I] bf16, quantized here: in 128x128 blocks as
    DeepSeek's checkpoints are (``fp8``: ``quant.quantize_weight``), or by the fork's own NVFP4 quantizer
    (``nvfp4``, scale groups of 16, its block_n chosen by the fork for this batch); ``x`` [T, H] bf16
    (quantized per token and 128 columns); ``topk_idx`` [T, k] (-1 = masked), ``topk_weights`` [T, k] f32."""
    from megamoe_interleave import quant

    E, H, I, k = shape.num_experts, shape.hidden, shape.intermediate, shape.topk
    T = x.shape[0]
    layer_call, symm_buffer, transform = (getattr(dg, n) for n in FORKS[fork])
    if fork == "fp8":
        l1, l2 = transform(quant.quantize_weight(w1), quant.quantize_weight(w2))
    else:
        from deep_gemm.quantization_nvfp4 import quantize_to_nvfp4

        def nvfp4(w, per=32):  # by expert slices: the quantizer's FP32 copy of all of w1 would be 17 GB
            parts = [quantize_to_nvfp4(w[e:e + per], group_size=16) for e in range(0, w.shape[0], per)]
            return tuple(torch.cat(p) for p in zip(*parts))

        block_n = dg.choose_nvfp4_block_n_for_mega_moe_sm90(T, k, E, I)
        l1, l2 = transform(nvfp4(w1), nvfp4(w2), block_n=block_n)
    buffer = symm_buffer(one_rank_group(), E, T, k, H, I)
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
        layer_call(y, l1, l2, buffer, cumulative_local_expert_recv_stats=stats, recipe=(128, 128, 128),
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


OURS = {"fp8": ("w8a8",), "nvfp4": ("w4a8", "w8a8")}  # our fused kernels set against each fork
BASELINE = {"fp8": "Mega MoE fork", "nvfp4": "NVFP4 Mega MoE fork"}
FORK_OVER_OURS_FP4 = 1.25  # the NVFP4 fork's error against fp32 may be this much over our W4A8's (see check_fork)


def check_ours(precision: str, ys, picked, w1, w2, fp32) -> dict:
    """Our fused layer against its recipe's emulation (within the kernel tolerance) and fp32."""
    from megamoe_interleave import quant, quant_fp4
    from megamoe_interleave.reference import (W8A8_KERNEL_REL_ERROR, reference_moe_w4a8, reference_moe_w8a8,
                                              relative_error)

    recipe = (reference_moe_w8a8(*picked, *quant.quantize_weights(w1, w2)) if precision == "w8a8"
              else reference_moe_w4a8(*picked, *quant_fp4.quantize_weights(w1, w2)))
    c = {"vs_recipe": relative_error(ys, recipe), "vs_fp32": relative_error(ys, fp32)}
    return dict(c, ok=c["vs_recipe"] <= W8A8_KERNEL_REL_ERROR)


def check_fork(fork: str, err_fp32: float, checks: dict) -> dict:
    """The fork's y against fp32 on the BF16 weights. FP8: within the W8A8 recipe's bound plus the kernel
    tolerance. NVFP4: its weights' own FP4 rounding dominates and its format is finer than ours (an E4M3
    scale per 16 against a power of two per 32), so at most FORK_OVER_OURS_FP4 times our W4A8's error on
    the same tokens: a broken build is far above that."""
    from megamoe_interleave.reference import W8A8_FP32_REL_ERROR, W8A8_KERNEL_REL_ERROR

    bound = (W8A8_FP32_REL_ERROR[1] + W8A8_KERNEL_REL_ERROR if fork == "fp8"
             else FORK_OVER_OURS_FP4 * checks["ours w4a8"]["vs_fp32"])
    return {"vs_fp32": err_fp32, "bound": bound, "ok": err_fp32 <= bound}


def against_ours(*, tokens: int = 8192, trials: int = 11, cooldown_s: float = 0.25, fork: str = "fp8") -> dict:
    """Our fused kernels alone (:data:`OURS`) and the fork's fused layer, paired and cooled, at loopback P = 1
    on DeepSeek-V4-Flash (balanced routing): all checked first on a sample of tokens (ours against the
    recipe's emulation and fp32, the fork against fp32: :func:`check_fork`), then timed; the fork as the
    baseline."""
    from lab import bench
    from lab.megamoe.bench import build_moe
    from lab.megamoe.demo import CHECK_TOKENS, SHAPE, problem, rerun_time
    from megamoe_interleave import MegaMoEConfig
    from megamoe_interleave.reference import reference_moe_fp32, relative_error
    from megamoe_interleave.shapes import get_shape

    dg, why = load(fork)
    if dg is None:
        raise SystemExit(why)
    shape = get_shape(SHAPE)
    w1, w2, xs, idx, wts = problem(shape, 1, tokens)
    sample = torch.randperm(tokens, generator=torch.Generator().manual_seed(1))[:CHECK_TOKENS].cuda()
    picked = ([xs[0][sample]], [idx[0][sample]], [wts[0][sample]])
    fp32 = reference_moe_fp32(*picked, w1, w2)
    out = {"shape": f"DeepSeek-V4-Flash MoE, loopback P = 1, {tokens} tokens, balanced routing",
           "fork": f"deep_gemm {getattr(dg, '__version__', '?')} ({fork} SM90 Mega MoE fork)", "checks": {}}
    fns = {}
    for precision in OURS[fork]:
        moe = build_moe(shape, 1, tokens, MegaMoEConfig("interleaved", precision=precision), w1, w2,
                        poison_combine=True)
        ys = [y[sample] for y in moe(xs, idx, wts)]
        out["checks"][f"ours {precision}"] = check_ours(precision, ys, picked, w1, w2, fp32)
        moe.poison_combine = False
        fns[f"fused {precision} (ours)"] = rerun_time(moe)
    timed, forward = fused_layer(dg, shape, w1, w2, xs[0], idx[0], wts[0], fork)
    out["checks"]["fork"] = check_fork(fork, relative_error([forward()[sample]], fp32), out["checks"])
    timed()  # warm-up (forward ran it once already); each trial stages, then times the call alone
    fns[BASELINE[fork]] = timed
    samples, clocks = bench.paired_trials(fns, trials, cooldown_s)
    out["paired"] = bench.paired_verdicts(samples, clocks, BASELINE[fork], 30.0)
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
    ap.add_argument("--fork", default="fp8", choices=sorted(FORKS), help="which fork (its package on PYTHONPATH)")
    ap.add_argument("--out", default=None, help="directory for megamoe_fork.json (megamoe_fork_nvfp4.json)")
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.trials < 5:
        ap.error("--tokens >= 1 and --trials >= 5 (the sign test needs five matched trials)")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        ap.error("needs a Hopper GPU (sm_90)")
    out = against_ours(tokens=args.tokens, trials=args.trials, fork=args.fork)
    print(f"{out['shape']}; {out['fork']}")
    for name, c in out["checks"].items():
        print(f"   check {name:9s} " + ", ".join(f"{k} {v:.2e}" for k, v in c.items() if k != "ok") +
              (" -> ok" if c["ok"] else " -> FAILED"))
    for name, us in out["median_us"].items():
        print(f"   {name:20s} {us:8.0f} us  {out['tflops'][name]:5.0f} TFLOP/s")
    for precision in OURS[args.fork]:
        v = out["paired"]["variants"][f"fused {precision} (ours)"]
        print(f"   ours {precision} / fork: {v['median_ratio']:.3f} (paired, {out['paired']['reference_clock_mhz']} MHz, "
              f"{v['n_matched']} matched trials)")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = "megamoe_fork.json" if args.fork == "fp8" else f"megamoe_fork_{args.fork}.json"
        with open(os.path.join(args.out, name), "w") as f:
            json.dump({**out, "provenance": provenance.collect()}, f, indent=1, default=str)
    if not out["ok"]:
        raise SystemExit("a check failed (see above)")
