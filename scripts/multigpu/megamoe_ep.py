#!/usr/bin/env python
"""MegaMoE expert-parallel comparison on several GPUs (issue 6, step 3): the command line of
:mod:`lab.megamoe.multigpu_ep` (``--help``).

  torchrun --nproc-per-node=8 scripts/multigpu/megamoe_ep.py --world torch-symm --out results/h200x8/megamoe
  python scripts/multigpu/megamoe_ep.py --world loopback --P 8 --quick --out results/h200x1-loopback/megamoe
"""
import sys

from lab.megamoe.multigpu_ep import main

if __name__ == "__main__":
    sys.exit(main())
