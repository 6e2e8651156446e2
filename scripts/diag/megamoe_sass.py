#!/usr/bin/env python
"""Registers, spills, WGMMA waits and K-loop moves of the fused kernel's SASS, on a CPU: the command
line of :mod:`lab.megamoe.diag.sass_report` (``--help``).

    python scripts/diag/megamoe_sass.py --P 8 --schedule interleaved --precision w8a8 [--out DIR]
"""
from lab.megamoe.diag.sass_report import main

if __name__ == "__main__":
    main()
