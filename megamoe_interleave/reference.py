"""Torch references for the fused MoE kernel.

* :func:`reference_moe_fp32` -- the float32 ground truth over the whole world.
* :func:`unfused_pipeline` -- the unfused bf16 baseline of one destination rank's experts:
  token permute + ``torch._grouped_mm`` L1 + SwiGLU x routing weight + ``torch._grouped_mm``
  L2 (+ combine by :func:`weighted_combine`). Benchmarks time it against the fused kernel.

Conventions (shared with :mod:`megamoe_interleave.api` and the kernel):
expert parallelism over P ranks, rank r owns global experts ``[r*E_l, (r+1)*E_l)``;
``w1[e]`` is ``[2I, H]`` with gate rows ``0..I-1`` then up rows ``I..2I-1`` (before
:func:`megamoe_interleave.api.transform_weights`), ``w2[e]`` is ``[H, I]``;
``y = sum_j w_j * W2[e_j] (silu(G[e_j] x) * U[e_j] x)`` over the unmasked picks j.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import torch
import torch.nn.functional as F


def check_routing(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got {tuple(x.shape)}")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"topk_idx must be [T={x.shape[0]}, k], got {tuple(topk_idx.shape)}")
    if topk_weights.shape != topk_idx.shape:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} != topk_idx {tuple(topk_idx.shape)}")
    if topk_idx.numel() and (int(topk_idx.max()) >= num_experts or int(topk_idx.min()) < -1):
        raise ValueError(f"topk_idx entries must be in [-1, {num_experts})")


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def reference_moe_fp32(
    xs: Sequence[torch.Tensor],
    topk_idx: Sequence[torch.Tensor],
    topk_weights: Sequence[torch.Tensor],
    w1: torch.Tensor,
    w2: torch.Tensor,
) -> List[torch.Tensor]:
    """Float32 MoE output of every rank. ``w1`` [E, 2I, H] (gate then up), ``w2`` [E, H, I]
    are the *global* weights; inputs are per source rank."""
    E, two_i, H = w1.shape
    inter = two_i // 2
    w1f, w2f = w1.float(), w2.float()
    ys = []
    for x, idx, w in zip(xs, topk_idx, topk_weights):
        check_routing(x, idx, w, E)
        xf = x.float()
        y = torch.zeros(x.shape[0], H, dtype=torch.float32, device=x.device)
        for e in torch.unique(idx[idx >= 0]).tolist():
            tok, pick = (idx == e).nonzero(as_tuple=True)
            h = xf[tok] @ w1f[e].t()
            a = swiglu(h[:, :inter], h[:, inter:]) * w[tok, pick].float()[:, None]
            y.index_add_(0, tok, a @ w2f[e].t())
        ys.append(y)
    return ys


@dataclass
class Permutation:
    """Tokens received by one destination rank, expert-major.

    Row i of the pool came from ``(src_rank[i], src_token[i], src_pick[i])`` and is
    processed by local expert ``expert[i]``; ``counts[e]`` rows per local expert.
    Within an expert, rows are ordered by (source rank, token, pick): deterministic."""

    src_rank: torch.Tensor
    src_token: torch.Tensor
    src_pick: torch.Tensor
    expert: torch.Tensor
    counts: torch.Tensor  # [E_local] int64
    weights: torch.Tensor  # [rows] float32


def permute_for_rank(
    topk_idx: Sequence[torch.Tensor], topk_weights: Sequence[torch.Tensor], dst_rank: int, experts_per_rank: int
) -> Permutation:
    lo = dst_rank * experts_per_rank
    parts = []
    for s, (idx, w) in enumerate(zip(topk_idx, topk_weights)):
        local = idx - lo
        hit = (idx >= 0) & (local >= 0) & (local < experts_per_rank)
        tok, pick = hit.nonzero(as_tuple=True)
        e = local[tok, pick]
        parts.append((torch.full_like(tok, s), tok, pick, e, w[tok, pick].float()))
    src = torch.cat([p[0] for p in parts])
    tok = torch.cat([p[1] for p in parts])
    pick = torch.cat([p[2] for p in parts])
    e = torch.cat([p[3] for p in parts])
    wt = torch.cat([p[4] for p in parts])
    # Expert-major, then source rank, token, pick (nonzero is already token/pick-major).
    order = torch.sort(e * len(topk_idx) + src, stable=True).indices
    counts = torch.bincount(e, minlength=experts_per_rank)
    return Permutation(src[order], tok[order], pick[order], e[order], counts, wt[order])


def grouped_mm(a: torch.Tensor, b_t: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``out[rows of e] = a[rows of e] @ b_t[e]`` with ``b_t`` [E, K, N]: torch._grouped_mm
    (bf16, fp32 accumulate) with cumulative int32 offsets."""
    offs = torch.cumsum(counts.to(torch.int64), 0).to(torch.int32).to(a.device)
    if a.shape[0] == 0:
        return a.new_empty(0, b_t.shape[-1])
    return torch._grouped_mm(a, b_t, offs=offs)


def unfused_expert_compute(
    x_rows: torch.Tensor,
    weights: torch.Tensor,
    counts: torch.Tensor,
    w1_t: torch.Tensor,
    w2_t: torch.Tensor,
) -> torch.Tensor:
    """L1 grouped GEMM -> SwiGLU x weight (fp32 math, bf16 out) -> L2 grouped GEMM (bf16).

    ``w1_t`` [E_l, H, 2I] (gate columns then up columns), ``w2_t`` [E_l, I, H]."""
    inter = w1_t.shape[-1] // 2
    h = grouped_mm(x_rows, w1_t, counts)
    a = (swiglu(h[:, :inter].float(), h[:, inter:].float()) * weights[:, None]).to(x_rows.dtype)
    return grouped_mm(a, w2_t, counts)


def weighted_combine(combine: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
    """``y[t] = sum over valid picks j of combine[j, t]`` (fp32 accumulate, bf16 out);
    ``combine`` [k, T, H] holds the already weighted expert outputs."""
    k, T, H = combine.shape
    valid = (topk_idx[:T] >= 0).t()[:, :, None]  # [k, T, 1]
    # where(), not a multiply: masked slots are never written and may hold poison (NaN).
    return torch.where(valid, combine.float(), 0.0).sum(0).to(combine.dtype)


def unfused_pipeline(
    xs: Sequence[torch.Tensor],
    topk_idx: Sequence[torch.Tensor],
    topk_weights: Sequence[torch.Tensor],
    w1_t_local: Sequence[torch.Tensor],
    w2_t_local: Sequence[torch.Tensor],
) -> List[torch.Tensor]:
    """The whole world's unfused baseline: per destination rank permute + 2 grouped GEMMs,
    scatter into the sources' [k, T, H] combine slots, then the weighted top-k sum."""
    P = len(xs)
    k = topk_idx[0].shape[1]
    H = xs[0].shape[1]
    e_local = w1_t_local[0].shape[0]
    combine = [torch.zeros(k, x.shape[0], H, dtype=x.dtype, device=x.device) for x in xs]
    for d in range(P):
        perm = permute_for_rank(topk_idx, topk_weights, d, e_local)
        dev = w1_t_local[d].device
        rows = _gather_rows(xs, perm, dev)
        out = unfused_expert_compute(rows, perm.weights.to(dev), perm.counts, w1_t_local[d], w2_t_local[d])
        for s in range(P):
            sel = (perm.src_rank == s).nonzero(as_tuple=True)[0]
            combine[s][perm.src_pick[sel].to(dev), perm.src_token[sel].to(dev)] = out[sel.to(dev)]
    return [weighted_combine(c, idx.to(c.device)) for c, idx in zip(combine, topk_idx)]


def _gather_rows(xs: Sequence[torch.Tensor], perm: Permutation, device) -> torch.Tensor:
    out = torch.empty(perm.src_rank.numel(), xs[0].shape[1], dtype=xs[0].dtype, device=device)
    for s, x in enumerate(xs):
        sel = (perm.src_rank == s).nonzero(as_tuple=True)[0]
        out[sel.to(device)] = x[perm.src_token[sel].to(x.device)].to(device)
    return out
