#!/usr/bin/env python
"""The two ceilings of the GPU, copy bandwidth and dense bf16 rate: the command line of
:mod:`lab.ceilings` (``--help``).

    python scripts/measure_ceilings.py --out results/h200/ceilings.json
"""
import sys

from lab.ceilings import main

if __name__ == "__main__":
    sys.exit(main())
