#!/usr/bin/env python
"""Correctness of both kernels in a real multi-GPU world (issue 6, step 4): the command line of
:mod:`lab.multigpu_correctness` (``--help``).

    torchrun --nproc-per-node=8 scripts/multigpu/correctness.py --world torch-symm --out results/h200x8/correctness
    python scripts/multigpu/correctness.py --world loopback --P 4 --out results/h200x1-loopback/correctness
"""
import sys

from lab.multigpu_correctness import main

if __name__ == "__main__":
    sys.exit(main())
