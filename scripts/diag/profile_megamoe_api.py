#!/usr/bin/env python
"""Where MegaMoE.forward spends the time outside the fused kernels: the command line of
:mod:`lab.megamoe.diag.api_profile` (``--help``).

    python scripts/diag/profile_megamoe_api.py --P 1 --tokens 8192
"""
from lab.megamoe.diag.api_profile import main

if __name__ == "__main__":
    main()
