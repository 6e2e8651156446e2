#!/usr/bin/env python
"""The MegaMoE X-Stage sweep on one GPU: expert_wave vs interleaved per cell (shape x routing x
tokens x world x P x precision), paired and clock-matched, with per-tile statistics and the
model's predictions; resumable. The command line of :mod:`lab.megamoe.sweep` (method,
cells and output: ``--help``; how long it takes: ``--dry-run``; docs/xstage-evaluation.md).

    python scripts/sweep_megamoe.py --dry-run
    python scripts/sweep_megamoe.py --preset reduced
    python scripts/sweep_megamoe.py --shapes deepseek-v4-flash --routing skewed1 --P 8
"""
from lab.megamoe.sweep import main

if __name__ == "__main__":
    main()
