#!/usr/bin/env python
"""Where the fused kernel's time goes, tile by tile (GPU): the command line of
:mod:`lab.megamoe.diag.tile_budget` (``--help``).

    python scripts/diag/megamoe_tile_budget.py --precision w8a8 --P 8 1 --out DIR
"""
from lab.megamoe.diag.tile_budget import main

if __name__ == "__main__":
    main()
