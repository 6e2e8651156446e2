#!/usr/bin/env python
"""Environment and world check before the multi-GPU measurements (issue 6, step 0): the command
line of :mod:`lab.multigpu_envcheck` (``--help``).

  torchrun --nproc-per-node=8 scripts/multigpu/envcheck.py --world torch-symm --out results/h200x8/topology
  python scripts/multigpu/envcheck.py --world loopback --P 4 --out results/h200x1-loopback/topology
"""
import sys

from lab.multigpu_envcheck import main

if __name__ == "__main__":
    sys.exit(main())
