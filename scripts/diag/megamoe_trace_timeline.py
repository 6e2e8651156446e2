#!/usr/bin/env python
"""Mainloop cycles of a fused-kernel trace over time, per phase and time bucket: the command line of
:mod:`lab.megamoe.diag.trace_timeline` (``--help``).

    python scripts/diag/megamoe_trace_timeline.py TRACE.csv[.gz] [--bucket-us 250] [--window 5]
"""
from lab.megamoe.diag.trace_timeline import main

if __name__ == "__main__":
    main()
