"""xstage: the X-Stage Burst-Gap model and the shared core of the X-Stage-aware kernels.

Modules: model (eq. 1-20), simulate (fluid queue), profiles (platform JSON),
planner (design test), cli, world (peer memory), device (CuTe DSL helpers),
timing (CUDA events / graph replay), bench (paired trials, verdicts, result
files), multigpu (the multi-GPU suite's world set-up, timing protocol and result
header; multigpu_envcheck, multigpu_report), provenance, cute_compile.
"""
__version__ = "0.1.0"
