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


@pytest.fixture
def one_rank_nccl_group():
    """torch.distributed on one NCCL rank (gpu tests of the process-group paths): initialised
    here unless it already is, and torn down after, with the cached group worlds."""
    import torch
    import torch.distributed as dist

    from fa4_a2a import ulysses

    if not HOPPER:
        pytest.skip("needs a Hopper (sm_90) GPU")
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        yield None  # the default group
    finally:
        ulysses._group_worlds.clear()
        if created:
            dist.destroy_process_group()
