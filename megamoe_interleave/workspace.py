"""The layer's memory that lives across calls: the symmetric buffers every rank reads and writes
(:class:`MegaMoEBuffer`) and the int32 counter words of each rank's kernel, whose layout is defined
here once (the kernel and the host read it from here).

Counter words of rank r (``MegaMoEBuffer.counters[r]``): ``[COUNTER_ERROR]`` the error word
(:mod:`xstage.device` codes; the host reads it after a call), ``[COUNTER_BARRIER]`` the grid-barrier
counter (zeroed by the host before each launch), then from ``COUNTER_ROWS`` one ``l2_full`` word per
scheduler row (L1 tiles of the row published) and one ``x_ready`` word per row (Dispatch of the row
published); the kernel zeroes the row words at its end, so a call needs no host memset.
"""
from __future__ import annotations

import torch

from . import quant
from .config import FP8_PRECISIONS, QUANT_BLOCK

COUNTER_ERROR = 0
COUNTER_BARRIER = 1
COUNTER_ROWS = 2


def counter_words(num_rows: int) -> int:
    """Counter words a launch of ``num_rows`` scheduler rows uses."""
    return COUNTER_ROWS + 2 * num_rows


class MegaMoEBuffer:
    """Symmetric per-rank buffers, sized from ``max_tokens_per_rank``.

    ``x`` [T, H] bf16, ``topk_idx`` [T, k] int64, ``topk_weights`` [T, k] f32 (inputs, read
    remotely by Dispatch), ``combine`` [k, T, H] bf16 (written remotely by Combine),
    ``precision="w8a8"`` or ``"w4a8"``: ``x`` [T, H] E4M3 and ``x_scales`` [T, H/128] f32 (read by Dispatch too;
    None otherwise), ``combine`` still bf16;
    ``counters[r]`` int32 workspace of rank r (kernel: error word, grid-barrier counter,
    per-row L1->L2 and Dispatch readiness counters; row counters are reset in-kernel so repeated calls
    need no host memset). Only rank r's own kernel touches it, so it is plain device memory,
    not symmetric (in the ``host`` world the symmetric buffers live in pinned host memory,
    where the counters' atomics would cross PCIe)."""

    def __init__(self, world, *, hidden: int, topk: int, max_tokens_per_rank: int, num_counters: int = 1024,
                 dtype=torch.bfloat16, precision: str = "bf16"):
        if max_tokens_per_rank <= 0 or hidden <= 0 or topk <= 0:
            raise ValueError("hidden, topk and max_tokens_per_rank must be positive")
        if (hidden * torch.tensor([], dtype=dtype).element_size()) % 16:
            raise ValueError(f"hidden*{dtype} row must be a multiple of 16 bytes (16-byte remote stores)")
        self.world = world
        self.hidden, self.topk, self.max_tokens = hidden, topk, max_tokens_per_rank
        self.dtype = dtype
        T = max_tokens_per_rank
        fp8 = precision in FP8_PRECISIONS
        self.x = world.alloc((T, hidden), quant.E4M3 if fp8 else dtype)
        self.x_scales = world.alloc((T, hidden // QUANT_BLOCK), torch.float32) if fp8 else None
        self.topk_idx = world.alloc((T, topk), torch.int64)
        self.topk_weights = world.alloc((T, topk), torch.float32)
        # The Combine stores' destinations: [k, T, H] slots (combine_slots) plus one padding row,
        # where the reduction's masked picks point (reference.topk_reduce: never read).
        self.combine = world.alloc((topk * T + 1, hidden), dtype, remote=True)
        # One [local ranks, n] tensor, n padded to 16 bytes, so the device-side path touches every
        # rank's error word / barrier counter with one op; counters[r] is rank r's row.
        n = -(-num_counters // 4) * 4
        self.counters_all = torch.zeros(len(world.local_ranks), n, dtype=torch.int32, device=world.device)
        self.counters = {r: self.counters_all[i] for i, r in enumerate(world.local_ranks)}
        self.num_tokens = [0] * world.world_size

    def combine_slots(self, r: int) -> torch.Tensor:
        """Rank ``r``'s Combine slots ``[k, T, H]``: ``[pick, token]`` receives that pick's weighted
        expert output (the kernel's stores; ``max_tokens`` is the pick stride)."""
        k, T = self.topk, self.max_tokens
        return self.combine.local(r)[: k * T].view(k, T, self.hidden)
