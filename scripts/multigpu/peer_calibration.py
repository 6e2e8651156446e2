#!/usr/bin/env python
"""Peer (NVLink) X-Stage calibration (issue 6, step 1): the command line of
:mod:`lab.calibration.peer` (``--help``).

  torchrun --nproc-per-node=8 scripts/multigpu/peer_calibration.py --world torch-symm --out results/h200x8/calibration
  python scripts/multigpu/peer_calibration.py --world loopback --P 2 --quick --out results/h200x1-loopback/calibration
"""
import sys

from lab.calibration.peer import main

if __name__ == "__main__":
    sys.exit(main())
