"""xstage: the X-Stage Burst-Gap model and the shared core of the X-Stage-aware kernels.

Modules: model (eq. 1-20), simulate (fluid queue), profiles (platform JSON),
planner (design test), cli, world (peer memory), device (CuTe DSL helpers),
pipeline (mbarrier pipelines), cute_compile, provenance (result files' provenance;
calibration writes it). Timing, paired trials and the multi-GPU harness: the lab package.
"""
__version__ = "0.1.0"
