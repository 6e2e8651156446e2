#!/usr/bin/env python
"""Seeded GPU fuzz of the fused MoE layer: the command line of :mod:`lab.megamoe.fuzz` (``--help``).

    python scripts/fuzz_megamoe.py --cases 500 --seed 0 --out results/h200/megamoe/fuzz
"""
from lab.megamoe.fuzz import main

if __name__ == "__main__":
    main()
