"""torch custom ops (``torch.ops.fa4_a2a.*``) around the launch wrappers.

Both ops only launch (no host sync), so they can be captured in a CUDA graph once compiled.
``attention_a2a_`` mutates ``out`` (this rank's destination buffer) and, as a side effect torch
does not see, the peers' buffers named by ``peer_table``; order with the world's barrier.
"""

from __future__ import annotations

from typing import Optional

import torch

from fa4_a2a.interface import attention_a2a, attention_local


@torch.library.custom_op("fa4_a2a::attention_a2a_", mutates_args=("out", "lse"))
def attention_a2a_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    peer_table: torch.Tensor,
    lse: Optional[torch.Tensor],
    num_ranks: int,
    softmax_scale: float,
    causal: bool,
    persistent: bool,
) -> None:
    attention_a2a(q, k, v, out, peer_table, num_ranks=num_ranks, lse=lse, softmax_scale=softmax_scale,
                  causal=causal, persistent=persistent)


@attention_a2a_op.register_fake
def _(q, k, v, out, peer_table, lse, num_ranks, softmax_scale, causal, persistent) -> None:
    return None


@torch.library.custom_op("fa4_a2a::attention_local_", mutates_args=("out", "lse"))
def attention_local_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: Optional[torch.Tensor],
    softmax_scale: float,
    causal: bool,
    persistent: bool,
) -> None:
    attention_local(q, k, v, out, lse=lse, softmax_scale=softmax_scale, causal=causal, persistent=persistent)


@attention_local_op.register_fake
def _(q, k, v, out, lse, softmax_scale, causal, persistent) -> None:
    return None
