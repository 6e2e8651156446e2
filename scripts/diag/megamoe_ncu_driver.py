#!/usr/bin/env python
"""A problem for ncu to profile: two fused forwards, then rank 0's grouped GEMMs twice (the ncu
command lines are in the module's docstring): the command line of
:mod:`lab.megamoe.diag.ncu_driver` (``--help``).

    ncu ... python scripts/diag/megamoe_ncu_driver.py --P 8
"""
from lab.megamoe.diag.ncu_driver import main

if __name__ == "__main__":
    main()
