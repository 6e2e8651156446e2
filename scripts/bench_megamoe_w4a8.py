#!/usr/bin/env python
"""The fused W4A8 kernel against our W8A8 and BF16 fused kernels and the unfused BF16 pipeline on the
dequantized FP4 weights, paired: the command line of :mod:`lab.megamoe.w4a8_bench`.

    python scripts/bench_megamoe_w4a8.py --P 1 --tokens 256 1024 2048 8192
"""
from lab.megamoe.w4a8_bench import main

if __name__ == "__main__":
    main()
