#!/usr/bin/env python
"""Correctness of both kernels in a real multi-GPU world (issue 6, step 4): the checks of
tests/test_fa4_a2a_gpu.py (:mod:`lab.fa4_a2a.multigpu_checks`) and tests/test_megamoe_gpu.py
(:mod:`lab.megamoe.multigpu_checks`: both schedules, bitwise equal, for each Dispatch copy
on irregular token counts, zero-token ranks, masked picks, skew; and the ``api-defaults`` case),
run across processes (frame: :func:`lab.multigpu.run_checks`): every rank generates the
*whole* problem, computes the float32 reference of its own output, runs its own part of the real
multi-rank kernel path and checks every element of its own output. Per-case results of every
rank are gathered on rank 0 and written to JSON; the exit status is 1 if any check failed.

  torchrun --nproc-per-node=8 scripts/multigpu/correctness.py --world torch-symm --out results/h200x8/correctness
  python scripts/multigpu/correctness.py --world loopback --P 4 --out results/h200x1-loopback/correctness
"""
from __future__ import annotations

import argparse
import sys

from lab import multigpu as mg
from lab.megamoe import multigpu_checks as moe_checks

KERNELS = ("fa4", "megamoe")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mg.add_world_args(p, default_out="results/h200xN/correctness", trials=1)
    p.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    moe_checks.add_args(p)
    p.add_argument("--stem", default="correctness")
    return p.parse_args(argv)


def _fa(ctx, quick):
    """The fa4 checks (lab.fa4_a2a.multigpu_checks; imported only when they run)."""
    from lab.fa4_a2a.multigpu_checks import run_checks

    return run_checks(ctx, quick)


def main(argv=None) -> int:
    args = parse_args(argv)
    checks = {"fa4": lambda ctx: _fa(ctx, args.quick),
              "megamoe": lambda ctx: moe_checks.run_checks(ctx, args.quick, args.dispatch_copy, args.precision)}
    chosen = {k: checks[k] for k in KERNELS if k in args.kernels}
    return mg.run_entry(args, lambda ctx: mg.run_checks(ctx, args, chosen))


if __name__ == "__main__":
    sys.exit(main())
