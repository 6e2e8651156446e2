#!/usr/bin/env python
"""Our fused kernels against the public fused SM90 Mega MoEs (DeepGEMM forks: FP8, ``--fork nvfp4``), paired in
one process on one H200: the command line of :mod:`lab.megamoe.megamoe_fork` (``--help``). The fork must be on
PYTHONPATH and upstream DeepGEMM must not (all are ``deep_gemm``): docs/gpu.md, "DeepGEMM, the FP8 baseline".

    PYTHONPATH=/tmp/dgf:$PWD:$PYTHONPATH DG_JIT_CACHE_DIR=/tmp/dgcache_f python scripts/bench_megamoe_fork.py --out DIR  # and CUDA_HOME
"""
from lab.megamoe.megamoe_fork import main

if __name__ == "__main__":
    main()
