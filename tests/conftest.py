"""Shared pytest setup: GPU marker handling and the CPU compile environment.

Tests marked ``gpu`` are skipped unless a Hopper (sm_90) GPU is visible.
Compile tests run everywhere: the CuTe DSL targets ``sm_90a`` from the
environment below even on a CPU-only machine.
"""
import os

import pytest

# Compile for Hopper even without a GPU (CI). A GPU host overrides nothing
# it already set.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ.setdefault("FLASH_ATTENTION_ARCH", "sm_90")
os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", "132")


def _hopper_gpu_present() -> bool:
    try:
        import torch
    except ImportError:
        return False
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(0) == (9, 0)


HOPPER = _hopper_gpu_present()


def pytest_collection_modifyitems(config, items):
    if HOPPER:
        return
    skip = pytest.mark.skip(reason="needs a Hopper (sm_90) GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
