#!/usr/bin/env python
"""Driver for ncu: DeepSeek-V4-Flash, loopback P ranks, 8192 tokens per rank, balanced routing.
Runs two fused forwards (P rank kernels each, default config), then rank 0's two grouped GEMMs
twice, so ncu can pick one rank kernel and the GEMMs of the same rank:

    ncu --clock-control none --kernel-name regex:MegaMoE --launch-skip P --launch-count 1 \\
        --section SpeedOfLight --csv --page details python scripts/diag/megamoe_ncu_driver.py --P 8
    ncu --clock-control none --kernel-name regex:device_kernel --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight --csv --page details python scripts/diag/megamoe_ncu_driver.py --P 8

(results/h200/megamoe/final2/ncu_*_P8_rank0.csv, with the ComputeWorkloadAnalysis and
MemoryWorkloadAnalysis sections and sm__pipe_tensor_op_hmma_cycles_active added.)

``--no-dispatch-copy``: the fused kernel without its Dispatch copy
(lab.megamoe.diag.no_dispatch_copy.NoDispatchCopy, same config; pool filled by torch after the first
call, so it computes the real y): one forward, the fill, then the two forwards above, so
``--launch-skip P`` still picks the second of them. Its kernel is named after the subclass:
select it with ``--kernel-name regex:NoDispatchCopy`` (``regex:MegaMoE`` profiles nothing).

``--gemms deepgemm``: no fused layer, only DeepGEMM's two GEMMs (``m_grouped_fp8_gemm_nt_contiguous`` L1 and L2,
the same rows per expert; the bundle of docs/gpu.md) of every rank, twice, so ``--kernel-name
regex:sm90_fp8_gemm --launch-skip 2P --launch-count 2`` picks rank 0's second pair (scripts/gpu_calls.sh ncu).

``--option NAME=VALUE`` sets a MegaMoEConfig field of the fused kernel (e.g. dispatch_window=0,
dispatch_copy=lsu, stages=4; integers are passed as int, anything else as a string).
For DRAM bytes over time per phase, see megamoe_pm_phases.py (``--section PmSampling``)."""
import argparse

import torch

from lab.megamoe.bench import build_moe, grouped_gemms, make_problem
from lab.megamoe.diag import config_options
from megamoe_interleave.config import MegaMoEConfig
from megamoe_interleave.shapes import get_shape


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--P", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--schedule", default="expert_wave", choices=["expert_wave", "interleaved"])
    ap.add_argument("--no-dispatch-copy", action="store_true", help="the kernel without its Dispatch copy (see above)")
    ap.add_argument("--gemms", choices=("torch", "deepgemm"), default="torch",
                    help="torch: its GEMMs after the fused calls; deepgemm: DeepGEMM's alone (see above)")
    ap.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                    help="a MegaMoEConfig field of the fused kernel, e.g. dispatch_window=0 (repeatable)")
    args = ap.parse_args()
    try:
        config = MegaMoEConfig(schedule=args.schedule, **config_options(args.option))
    except (TypeError, ValueError) as e:
        ap.error(f"--option: {e}")
    P, T = args.P, args.tokens
    s = get_shape("deepseek-v4-flash")
    w1, w2, xs, idx, wts = make_problem(s, "balanced", P, T)
    if args.gemms == "deepgemm":
        return deepgemm_gemms(s, P, w1, w2, idx)
    if args.no_dispatch_copy:
        from lab.megamoe.diag.no_dispatch_copy import NoDispatchCopyMoE, fill_pool

        moe = build_moe(s, P, T, config, w1, w2, moe_class=NoDispatchCopyMoE)
        moe.forward(xs, idx, wts)  # compiles NoDispatchCopy; sizes the pool
        for d in range(P):
            fill_pool(moe, d)
    else:
        moe = build_moe(s, P, T, config, w1, w2)
    print("config:", moe.config, flush=True)
    moe.forward(xs, idx, wts)
    moe.forward(xs, idx, wts)
    torch.cuda.synchronize()
    _, rank0_gemms = grouped_gemms(s, P, w1, w2, idx, wts, ranks=[0])  # the bench's baseline, rank 0 only
    for _ in range(2):
        rank0_gemms()
    torch.cuda.synchronize()
    print("done; last fused call", moe.last_kernel_us, "us")


def deepgemm_gemms(shape, P: int, w1, w2, idx) -> None:
    """``--gemms deepgemm``: no fused layer; every rank's two DeepGEMM launches once (inside
    ``grouped_gemms``, with its check), then again, so ncu takes rank 0's second pair."""
    from lab.megamoe import deepgemm

    dg, why = deepgemm.load()
    if dg is None:
        raise SystemExit(why)
    all_gemms, _ = deepgemm.grouped_gemms(dg, shape, P, w1, w2, deepgemm.rows_per_expert(shape, P, idx))
    all_gemms()
    torch.cuda.synchronize()
    print("done: DeepGEMM's two GEMMs of every rank, twice", flush=True)


if __name__ == "__main__":
    main()
