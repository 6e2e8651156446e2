#!/usr/bin/env python
"""fa4_a2a Table-3 sweep on several GPUs (issue 6, step 2): the command line of
:mod:`lab.fa4_a2a.multigpu_sweep` (``--help``).

  torchrun --nproc-per-node=8 scripts/multigpu/fa_a2a_sweep.py --world torch-symm --out results/h200x8/fa4_a2a
  python scripts/multigpu/fa_a2a_sweep.py --world loopback --P 8 --quick --out results/h200x1-loopback/fa4_a2a
"""
import sys

from lab.fa4_a2a.multigpu_sweep import main

if __name__ == "__main__":
    sys.exit(main())
