#!/usr/bin/env python
"""What does the Dispatch copy cost the fused kernel in the loopback world? DeepSeek-V4-Flash,
P ranks (default 8) x 8192 tokens, balanced routing: the fused kernel of both schedules as
shipped (MegaMoEConfig defaults: the bulk Dispatch at P = 8, with its window for expert_wave),
and the same kernel, same resolved config, with the Dispatch copy skipped
(lab.megamoe.diag.no_dispatch_copy.NoDispatchCopy: rows are published at the shipped kernel's pace, without
being copied), timed side by side against the two grouped GEMMs (clock-matched paired trials,
lab.bench.paired_trials). The no-copy objects first get their pool filled by torch (each pool
row gathered from its source rank's x, as the Dispatch copies it: lab.megamoe.diag.no_dispatch_copy.fill_pool),
so they compute the shipped kernel's y from the same data -- checked bitwise -- without the
Dispatch traffic. (Without that fill their pool holds stale memory, and the tensor cores,
multiplying mostly zeros, run at higher clocks under the power limit: 0.86x, an artefact.)
Diagnostic only: writes dispatch_cost_P{P}.json to --out.

    python scripts/diag/megamoe_dispatch_cost.py [--P 8] [--trials 15] [--out DIR]
"""
import argparse
import dataclasses
import os

import torch

from lab import bench
from lab.megamoe import bench as moe_bench
from lab.megamoe.diag.no_dispatch_copy import NoDispatchCopyMoE, fill_pool
from megamoe_interleave.config import MegaMoEConfig
from megamoe_interleave.shapes import get_shape


def timed_object(shape, P, T, config, problem, **kw):
    """(MegaMoE, its first y, () -> kernel us of one forward); ``kw`` to bench.build_moe."""
    w1, w2, xs, idx, wts = problem
    moe = moe_bench.build_moe(shape, P, T, config, w1, w2, **kw)
    y = [t.clone() for t in moe.forward(xs, idx, wts)]

    def timed():
        moe.forward(xs, idx, wts)
        return moe.last_kernel_us
    return moe, y, timed


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--P", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--trials", type=int, default=15)
    ap.add_argument("--cooldown-s", type=float, default=0.25)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    P, T = args.P, args.tokens
    shape = get_shape("deepseek-v4-flash")
    problem = w1, w2, xs, idx, wts = moe_bench.make_problem(shape, "balanced", P, T)
    _, gemms_only = moe_bench.grouped_gemms(shape, P, w1, w2, idx, wts)
    fns = {moe_bench.BASELINE: bench.event_timed(gemms_only)}
    real, bitwise = {}, {}
    for sched in ("expert_wave", "interleaved"):
        real[sched] = timed_object(shape, P, T, MegaMoEConfig(sched), problem)
        fns[f"fused[{sched}]"] = real[sched][2]
    for sched in ("expert_wave", "interleaved"):
        moe, _, timed = timed_object(shape, P, T, real[sched][0].config, problem, moe_class=NoDispatchCopyMoE)
        for d in range(P):
            fill_pool(moe, d)
        y = moe.forward(xs, idx, wts)
        bitwise[sched] = all(torch.equal(a, b) for a, b in zip(y, real[sched][1]))
        print(f"{sched}: no-copy kernel on the real pool gives the real y bitwise: {bitwise[sched]}", flush=True)
        fns[f"fused[{sched},no-dispatch-copy]"] = timed
    samples, clocks = bench.paired_trials(fns, args.trials, args.cooldown_s)
    row = dict(shape=shape.name, P=P, tokens_per_rank=T, bitwise_equal=bitwise,
               shipped_config={sched: dataclasses.asdict(real[sched][0].config) for sched in real},
               **bench.paired_verdicts(samples, clocks, moe_bench.BASELINE, 30.0))
    bench.print_paired(row, label=f"{shape.name}, P={P}, T={T}")
    os.makedirs(args.out, exist_ok=True)
    bench.write_json(os.path.join(args.out, f"dispatch_cost_P{P}.json"), {"paired": row})


if __name__ == "__main__":
    main()
