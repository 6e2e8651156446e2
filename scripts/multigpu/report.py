#!/usr/bin/env python
"""Markdown reports of the multi-GPU suite (issue 6), with fa4_a2a's E_res figure for step 2: the
command line of :mod:`lab.multigpu_report` (``--help``).

  python scripts/multigpu/report.py --dir results/h200x8
"""
import sys

from lab.multigpu_report import SUITE_FIGURES, main

if __name__ == "__main__":
    sys.exit(main(figures=SUITE_FIGURES))
