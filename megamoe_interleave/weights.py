"""The kernel's weight layout: w1's gate and up rows interleaved so that an L1 N tile holds matching
gate and up columns (SwiGLU is tile-local). A leaf module: the API, the quantization and the
references all read it."""
from __future__ import annotations

import torch

from .config import INTERLEAVE

INTERLEAVE_GRANULARITY = INTERLEAVE


def transform_weights(w1: torch.Tensor, w2: torch.Tensor, granularity: int = INTERLEAVE_GRANULARITY):
    """Kernel weight layout.

    ``w1`` [E, 2I, H] (gate rows then up rows) -> gate/up interleaved in chunks of
    ``granularity`` rows (``[g0..g7, u0..u7, g8..g15, ...]``) so an L1 N-tile holds
    matching gate and up columns and SwiGLU is tile-local. ``w2`` [E, H, I] is returned
    contiguous. Returns (w1_interleaved, w2)."""
    if w1.dim() != 3 or w2.dim() != 3:
        raise ValueError("w1 must be [E, 2I, H] and w2 [E, H, I]")
    E, two_i, H = w1.shape
    if two_i % 2 or w2.shape != (E, H, two_i // 2):
        raise ValueError(f"shape mismatch: w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}")
    return interleave_w1(w1, granularity), w2.contiguous()


def interleave_w1(w1: torch.Tensor, granularity: int = INTERLEAVE_GRANULARITY) -> torch.Tensor:
    """The w1 part of :func:`transform_weights` on any per-row data ``[E, 2I, X]`` (gate rows then
    up rows): the weights themselves, or W4A8's packed FP4 rows and their per-row scales."""
    E, two_i, X = w1.shape
    inter = two_i // 2
    if two_i % 2 or inter % granularity:
        raise ValueError(f"intermediate {inter} must be a multiple of {granularity}")
    g = w1[:, :inter].reshape(E, inter // granularity, granularity, X)
    u = w1[:, inter:].reshape(E, inter // granularity, granularity, X)
    return torch.stack([g, u], dim=2).reshape(E, two_i, X).contiguous()


def untransform_w1(w1_il: torch.Tensor, granularity: int = INTERLEAVE_GRANULARITY) -> torch.Tensor:
    """Inverse of the w1 part of :func:`transform_weights`."""
    E, two_i, H = w1_il.shape
    v = w1_il.reshape(E, two_i // (2 * granularity), 2, granularity, H)
    return torch.cat([v[:, :, 0].reshape(E, two_i // 2, H), v[:, :, 1].reshape(E, two_i // 2, H)], dim=1)
