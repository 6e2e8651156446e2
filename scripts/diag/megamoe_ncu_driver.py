#!/usr/bin/env python
"""Driver for ncu: DeepSeek-V4-Flash, loopback P ranks, 8192 tokens per rank, balanced routing.
Runs two fused forwards (P rank kernels each, default tiles), then rank 0's two grouped GEMMs
twice, so ncu can pick one rank kernel and the GEMMs of the same rank:

    ncu --clock-control none --kernel-name regex:MegaMoE --launch-skip P --launch-count 1 \\
        --section SpeedOfLight --csv --page details python scripts/megamoe_ncu_driver.py --P 8
    ncu --clock-control none --kernel-name regex:device_kernel --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight --csv --page details python scripts/megamoe_ncu_driver.py --P 8

(results/h200/megamoe/final2/ncu_*_P8_rank0.csv, with the ComputeWorkloadAnalysis and
MemoryWorkloadAnalysis sections and sm__pipe_tensor_op_hmma_cycles_active added.)

``--no-dispatch-copy``: the fused kernel without its Dispatch copy (megamoe_dispatch_cost's
NoDispatchCopy, pool filled by torch after the first call, so it computes the real y): one
forward, the fill, then the two forwards above, so ``--launch-skip P`` still picks the second
of them. Its kernel is named after the subclass: select it with
``--kernel-name regex:NoDispatchCopy`` (``regex:MegaMoE`` profiles nothing).

``--option NAME=VALUE`` passes a MegaMoE keyword to the fused kernel (e.g. dispatch_window=0,
dispatch_copy=lsu; integers are passed as int, anything else as a string).
For DRAM bytes over time per phase, see megamoe_pm_phases.py (``--section PmSampling``)."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_megamoe import fused_kwargs, grouped_gemms, loopback_moe, make_problem  # noqa: E402
from megamoe_interleave.shapes import get_shape  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--P", type=int, default=8)
ap.add_argument("--tokens", type=int, default=8192)
ap.add_argument("--schedule", default="expert_wave", choices=["expert_wave", "interleaved"])
ap.add_argument("--no-dispatch-copy", action="store_true", help="the kernel without its Dispatch copy (see above)")
ap.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                help="a MegaMoE keyword of the fused kernel, e.g. dispatch_evict_first=0 (repeatable)")
args = ap.parse_args()
options = {}
for item in args.option:
    name, sep, value = item.partition("=")
    if not sep:
        ap.error(f"--option {item!r}: expected NAME=VALUE")
    try:
        options[name] = int(value)
    except ValueError:
        options[name] = value
P, T = args.P, args.tokens
s = get_shape("deepseek-v4-flash")
w1, w2, xs, idx, wts = make_problem(s, "balanced", P, T)
if args.no_dispatch_copy:
    from megamoe_dispatch_cost import NO_COPY_OPTIONS, fill_pool, no_dispatch_copy_kernels

    with no_dispatch_copy_kernels():
        moe = loopback_moe(fused_kwargs(s, P, T, args.schedule, **{**NO_COPY_OPTIONS, **options}), w1, w2, P)
        moe.forward(xs, idx, wts)  # compiles NoDispatchCopy; sizes the pool
    for d in range(P):
        fill_pool(moe, d)
else:
    moe = loopback_moe(fused_kwargs(s, P, T, args.schedule, **options), w1, w2, P)
moe.forward(xs, idx, wts)
moe.forward(xs, idx, wts)
torch.cuda.synchronize()
_, rank0_gemms = grouped_gemms(s, P, w1, w2, idx, wts, ranks=[0])  # the bench's baseline, rank 0 only
for _ in range(2):
    rank0_gemms()
torch.cuda.synchronize()
print("done; last fused call", moe.last_kernel_us, "us")
