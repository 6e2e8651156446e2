#!/usr/bin/env python
"""The fused kernel's error path under time-slicing (GPU): the command line of
:mod:`lab.megamoe.diag.timeout_contention` (``--help``).

    python scripts/diag/megamoe_timeout_contention.py --busy 9 --calls 50 --out DIR
"""
import sys

from lab.megamoe.diag.timeout_contention import main

if __name__ == "__main__":
    sys.exit(main())
