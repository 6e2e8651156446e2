#!/usr/bin/env python
"""MegaMoE on one GPU (loopback world): the fused kernel (both schedules, side-by-side
MegaMoEConfig variants) vs the unfused torch pipeline vs the two grouped GEMMs alone, with the
clock-matched paired comparison: the command line of :mod:`lab.megamoe.bench` (variants,
method, flags and output files: ``--help``).

    python scripts/bench_megamoe.py --shape deepseek-v4-flash --P 1 8 --tokens 8192
    python scripts/bench_megamoe.py --P 8 --stages 3 4 --dispatch-copy lsu bulk --paired-only --tag _ring
"""
from lab.megamoe.bench import main

if __name__ == "__main__":
    main()
