#!/usr/bin/env python
"""Warp stalls by role and instruction from an ncu source-counter export: the command line of
:mod:`lab.megamoe.diag.ncu_source` (``--help``).

    python scripts/diag/megamoe_ncu_source.py ours_src.csv.gz [--top 20] [--out DIR]
"""
from lab.megamoe.diag.ncu_source import main

if __name__ == "__main__":
    main()
