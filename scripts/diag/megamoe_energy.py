#!/usr/bin/env python
"""Energy per call of the fused MoE kernels and of the two grouped GEMMs, from NVML: the command line of
:mod:`lab.megamoe.diag.energy` (``--help``).

    python scripts/diag/megamoe_energy.py --P 8 --tokens 8192 --out results/h200/megamoe/energy
"""
from lab.megamoe.diag.energy import main

if __name__ == "__main__":
    main()
