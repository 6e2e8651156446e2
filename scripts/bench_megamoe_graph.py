#!/usr/bin/env python
"""MegaMoE as one CUDA-graph replay (MegaMoE.capture: staging, device-side plan, kernels,
reduction) against the fused kernels alone, the grouped GEMMs alone and the unfused pipeline,
paired; small batches included: the command line of :mod:`lab.megamoe.graph_bench`.

    python scripts/bench_megamoe_graph.py --P 1 8 --tokens 256 1024 2048 8192
"""
from lab.megamoe.graph_bench import main

if __name__ == "__main__":
    main()
