#!/usr/bin/env python
"""Figures, tables and README of a MegaMoE X-Stage sweep (scripts/sweep_megamoe.py), on a CPU:
the Figure 8, Figure 10 and Table 2 analogues next to the paper's numbers. The command line of
:mod:`lab.megamoe.evaluation` (``--help``).

    python scripts/megamoe_xstage_report.py --sweep results/h200/megamoe/xstage/sweep.json.gz
"""
from lab.megamoe.evaluation import main

if __name__ == "__main__":
    main()
