#!/usr/bin/env python
"""DRAM bytes of one fused-kernel launch per phase stretch, from ncu PM sampling and a trace: the command line of
:mod:`lab.megamoe.diag.pm_phases` (``--help``).

    python scripts/diag/megamoe_pm_phases.py pm_raw.csv TRACE.csv[.gz] [--out DIR]
"""
from lab.megamoe.diag.pm_phases import main

if __name__ == "__main__":
    main()
