#!/usr/bin/env python
"""The SM clock inside the fused kernel from its trace build, cool against hot calls: the command line of
:mod:`lab.megamoe.diag.trace_clock` (``--help``).

    python scripts/diag/megamoe_trace_clock.py --P 8 --tokens 8192 --hot-calls 10
"""
from lab.megamoe.diag.trace_clock import main

if __name__ == "__main__":
    main()
