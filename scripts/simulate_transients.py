#!/usr/bin/env python
"""X-Stage transients in the fluid simulator, bursts until steady state per gap: the command line of
:mod:`lab.transients` (``--help``).

    python scripts/simulate_transients.py --platform paper-b200-nvlink --gaps-us 0,1,2,4,5,5.5,6,8
"""
import sys

from lab.transients import main

if __name__ == "__main__":
    sys.exit(main())
