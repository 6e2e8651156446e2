#!/usr/bin/env python
"""Kernels side by side from ncu details exports: the command line of :mod:`lab.megamoe.diag.ncu_metrics`
(``--help``).

    python scripts/diag/megamoe_ncu_metrics.py ours.csv deepgemm.csv [--out DIR]
"""
from lab.megamoe.diag.ncu_metrics import main

if __name__ == "__main__":
    main()
