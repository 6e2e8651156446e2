"""What every stack hook checks before it hands a call to the fused kernel."""
from __future__ import annotations

from typing import Optional

import torch

from fa4_a2a.validate import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS


def on_hopper(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.get_device_capability(t.device) == (9, 0)


def kernel_reason(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, hopper: bool) -> Optional[str]:
    """Why the kernel itself cannot take these tensors (None: it can): no Hopper GPU, a dtype or
    head_dim it was not built for (:mod:`fa4_a2a.validate`)."""
    if not hopper:
        return "the kernel needs a Hopper GPU (sm_90)"
    if query.dtype not in SUPPORTED_DTYPES or not (query.dtype == key.dtype == value.dtype):
        return f"dtype {query.dtype} (bf16 or fp16 only)"
    if query.shape[-1] not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {query.shape[-1]} (64 or 128 only)"
    return None
