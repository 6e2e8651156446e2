#!/usr/bin/env python
"""``scripts/run``'s main job: on a Hopper GPU both fused kernels checked and timed, on a CPU
the planner and the calibration refit: the command line of
:mod:`lab.demo` (``--help``)."""
import sys

from lab.demo import main

if __name__ == "__main__":
    sys.exit(main())
