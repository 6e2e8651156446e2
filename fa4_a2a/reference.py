"""Plain-torch Ulysses layouts and a float32 reference (no kernels; runs on any device).

Layout conventions (yunchang / xDiT BSHD):
  sequence-sharded  x_r : [B, S/P, H, D]   rank r holds rows [r*S/P, (r+1)*S/P) of all heads
  head-sharded      y_r : [B, S, H/P, D]   rank r holds heads [r*H/P, (r+1)*H/P) of all rows
The pre-attention All-to-All maps x -> y, the post-attention All-to-All maps y -> x.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch


def seq_to_head_shards(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Pre-attention All-to-All: P tensors [B, S/P, H, D] -> P tensors [B, S, H/P, D]."""
    P = len(xs)
    H = xs[0].shape[2]
    if H % P:
        raise ValueError(f"heads {H} not divisible by world size {P}")
    Hl = H // P
    return [torch.cat([x[:, :, r * Hl:(r + 1) * Hl] for x in xs], dim=1).contiguous() for r in range(P)]


def head_to_seq_shards(ys: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Post-attention All-to-All: P tensors [B, S, H/P, D] -> P tensors [B, S/P, H, D]."""
    P = len(ys)
    S = ys[0].shape[1]
    if S % P:
        raise ValueError(f"sequence {S} not divisible by world size {P}")
    C = S // P
    return [torch.cat([y[:, j * C:(j + 1) * C] for y in ys], dim=2).contiguous() for j in range(P)]


def attention_fp32(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: Optional[float] = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full attention in float32 on [B, S, H, D]; returns (out [B, S, H, D] fp32, lse [B, H, S])."""
    qf, kf, vf = (t.float() for t in (q, k, v))
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("bshd,bthd->bhst", qf, kf) * scale
    if causal:
        S, T = scores.shape[-2:]
        mask = torch.ones(S, T, dtype=torch.bool, device=scores.device).triu(T - S + 1)
        scores = scores.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    return torch.einsum("bhst,bthd->bshd", probs, vf), lse


def ulysses_reference(
    qs: Sequence[torch.Tensor], ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor],
    softmax_scale: Optional[float] = None, causal: bool = False,
) -> list[torch.Tensor]:
    """What Ulysses attention must return: full-sequence fp32 attention, split by sequence."""
    q, k, v = (torch.cat(list(x), dim=1) for x in (qs, ks, vs))
    out, _ = attention_fp32(q, k, v, softmax_scale, causal)
    return list(out.chunk(len(qs), dim=1))


def ulysses_destination(row: int, local_head: int, rank: int, seq_len: int, heads_local: int,
                        num_ranks: int) -> tuple[int, int, int]:
    """Where rank ``rank``'s output row ``row`` of its local head goes: (dst_rank, dst_row, dst_head).

    The same arithmetic the fused epilogue does on the device (documentation and CPU tests).
    """
    shard = seq_len // num_ranks
    dst_rank = row // shard
    return dst_rank, row - dst_rank * shard, rank * heads_local + local_head
