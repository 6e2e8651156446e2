#!/usr/bin/env python
"""What the Dispatch copy costs the fused kernel in the loopback world: the command line of
:mod:`lab.megamoe.diag.dispatch_cost` (``--help``).

    python scripts/diag/megamoe_dispatch_cost.py [--P 8] [--trials 15] [--out DIR]
"""
from lab.megamoe.diag.dispatch_cost import main

if __name__ == "__main__":
    main()
