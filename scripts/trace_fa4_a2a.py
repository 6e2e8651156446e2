#!/usr/bin/env python
"""Per-tile timelines of the fused FA + All-to-All kernel (store-issue spans, burst alignment,
retire/launch gaps, tail) with E_res and the trace's overhead: the command line of
:mod:`lab.fa4_a2a.trace` (issue 29, step 1).

    python scripts/trace_fa4_a2a.py --world host --P 8 --heads 24 40 --seqs 8192 16384 32768 65536
"""
from lab.fa4_a2a.trace import main

if __name__ == "__main__":
    main()
