#!/usr/bin/env python
"""compute-sanitizer (memcheck, racecheck) over a small case of every shipped kernel: the command line
of :mod:`lab.sanitize` (``--help``).

    python scripts/diag/sanitize.py --out results/h200/sanitizers
    python scripts/diag/sanitize.py --case megamoe_w8a8_expert_wave      # one case, no sanitizer
"""
from lab.sanitize import main

if __name__ == "__main__":
    main()
