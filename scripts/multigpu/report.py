#!/usr/bin/env python
"""Markdown reports of the multi-GPU suite (issue 6): the command line of
:mod:`xstage.multigpu_report` (``--help``), with fa4_a2a's E_res figure for step 2.

  python scripts/multigpu/report.py --dir results/h200x8
"""
import sys

from xstage.multigpu_report import main


def fa_figure(payload, path):
    """fa4_a2a.multigpu_sweep.eres_figure, imported only when a sweep result is there to draw."""
    from fa4_a2a.multigpu_sweep import eres_figure

    return eres_figure(payload, path)


if __name__ == "__main__":
    sys.exit(main(figures={"fa4_a2a": fa_figure}))
