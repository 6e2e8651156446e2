#!/usr/bin/env python
"""The fused W8A8 kernel against torch's FP8 grouped GEMMs, the unfused FP8 pipeline and our BF16
fused kernel, paired, sustained and cooled: the command line of :mod:`lab.megamoe.w8a8_bench`.

    python scripts/bench_megamoe_w8a8.py --P 1 8 --tokens 8192
"""
from lab.megamoe.w8a8_bench import main

if __name__ == "__main__":
    main()
