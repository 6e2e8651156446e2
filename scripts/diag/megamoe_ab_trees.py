#!/usr/bin/env python
"""Same-host A/B of fused-kernel builds from several source trees (GPU): the command line of
:mod:`lab.megamoe.diag.ab_trees` (``--help``).

    python scripts/diag/megamoe_ab_trees.py --tree main=.kc/mainwt --tree new=. --P 1 8 --out DIR
"""
from lab.megamoe.diag.ab_trees import main

if __name__ == "__main__":
    main()
