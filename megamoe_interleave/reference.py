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
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F


def check_routing_shapes(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> None:
    """Shape checks of one rank's inputs (no device sync)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got {tuple(x.shape)}")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"topk_idx must be [T={x.shape[0]}, k], got {tuple(topk_idx.shape)}")
    if topk_weights.shape != topk_idx.shape:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} != topk_idx {tuple(topk_idx.shape)}")


def routing_bounds(topk_idx: Sequence[torch.Tensor]) -> List[Optional[Tuple[int, int]]]:
    """``(min, max)`` expert id of every routing tensor (``None`` when empty), read back
    with one device->host copy for all of them (the tensors must share a device)."""
    nonempty = [i for i in topk_idx if i.numel()]
    if not nonempty:
        return [None] * len(topk_idx)
    flat = torch.stack([torch.stack(torch.aminmax(i)) for i in nonempty]).tolist()
    it = iter(flat)
    return [tuple(next(it)) if i.numel() else None for i in topk_idx]


def check_expert_range(bounds: Optional[Tuple[int, int]], num_experts: int) -> None:
    if bounds is not None and (bounds[1] >= num_experts or bounds[0] < -1):
        raise ValueError(f"topk_idx entries must be in [-1, {num_experts}), got [{bounds[0]}, {bounds[1]}]")


def check_routing(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> None:
    check_routing_shapes(x, topk_idx, topk_weights)
    check_expert_range(routing_bounds([topk_idx])[0], num_experts)


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
    Within an expert, rows are ordered by (source rank, token, pick): deterministic.
    ``counts_host``: ``counts`` as a Python list (already read back by the permutation,
    so planners need no second device sync)."""

    src_rank: torch.Tensor
    src_token: torch.Tensor
    src_pick: torch.Tensor
    expert: torch.Tensor
    counts: torch.Tensor  # [E_local] int64
    weights: torch.Tensor  # [rows] float32
    counts_host: Optional[List[int]] = None


def permute_ranks(
    topk_idx: Sequence[torch.Tensor], topk_weights: Sequence[torch.Tensor], dst_ranks: Sequence[int],
    experts_per_rank: int,
) -> Dict[int, Permutation]:
    """:func:`permute_for_rank` for several destination ranks at once: one stable sort of
    every (source, token, pick) slot by global expert and ONE device->host read (the
    per-expert counts) for all of them; each rank's arrays are views of one slice.

    All sources share ``k`` (``topk_idx[s]`` is ``[T_s, k]``) and a device."""
    dst_ranks = sorted(set(int(d) for d in dst_ranks))
    if not dst_ranks or not topk_idx:
        return {}
    el = experts_per_rank
    k = topk_idx[0].shape[1]
    sizes = [int(i.numel()) for i in topk_idx]
    if len(topk_idx) == 1:
        idx, w = topk_idx[0].reshape(-1), topk_weights[0].reshape(-1)
    else:
        idx = torch.cat([i.reshape(-1) for i in topk_idx])
        w = torch.cat([x.reshape(-1) for x in topk_weights])
    lo, n_e = dst_ranks[0] * el, (dst_ranks[-1] + 1 - dst_ranks[0]) * el
    local = idx - lo
    # Experts of the ranks asked for get keys 0..n_e-1, everything else (masked picks,
    # other ranks' experts) the sentinel n_e, sorted last. A stable sort keeps the flat
    # (source, token, pick) order inside an expert.
    key = torch.where((local >= 0) & (local < n_e), local, n_e)
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key, minlength=n_e + 1)
    counts_host = counts.tolist()  # the one device sync
    n_sel = sum(counts_host[:n_e])
    sel = order[:n_sel]
    e_sel = key[sel]
    w_sel = w[sel].float()
    pick = sel % k
    if len(set(sizes)) == 1 and sizes[0]:  # equal token counts: the source is a division
        src, pos = sel // sizes[0], sel % sizes[0]
    else:
        src, start, base = torch.zeros_like(sel), torch.zeros_like(sel), 0
        for s, n in enumerate(sizes[:-1]):
            base += n
            ge = sel >= base
            src += ge
            start = torch.where(ge, base, start)
        pos = sel - start
    tok = pos // k
    out = {}
    for d in dst_ranks:
        e0 = (d - dst_ranks[0]) * el
        a = sum(counts_host[:e0])
        b = a + sum(counts_host[e0:e0 + el])
        expert = e_sel[a:b] if e0 == 0 else e_sel[a:b] - e0
        out[d] = Permutation(src[a:b], tok[a:b], pick[a:b], expert, counts[e0:e0 + el], w_sel[a:b],
                             counts_host[e0:e0 + el])
    return out


def permute_for_rank(
    topk_idx: Sequence[torch.Tensor], topk_weights: Sequence[torch.Tensor], dst_rank: int, experts_per_rank: int
) -> Permutation:
    return permute_ranks(topk_idx, topk_weights, [dst_rank], experts_per_rank)[dst_rank]


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


def weighted_combine(combine: torch.Tensor, topk_idx: torch.Tensor, *, any_masked: Optional[bool] = None) -> torch.Tensor:
    """``y[t] = sum over valid picks j of combine[j, t]`` (fp32 accumulate, bf16 out);
    ``combine`` [k, T, H] holds the already weighted expert outputs.

    ``any_masked=False`` (the caller knows no pick is -1, e.g. from
    :func:`routing_bounds`) skips the mask: one read of ``combine``. Otherwise masked
    slots are excluded with where(), not a multiply: they are never written and may hold
    poison (NaN) or stale data. Both accumulate in fp32 without an fp32 copy of ``combine``."""
    k, T, H = combine.shape
    if any_masked is False:
        return combine.sum(0, dtype=torch.float32).to(combine.dtype)
    valid = (topk_idx[:T] >= 0).t()[:, :, None]  # [k, T, 1]
    return torch.where(valid, combine, 0.0).sum(0, dtype=torch.float32).to(combine.dtype)


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
        rows = gather_rows(xs, perm, dev)
        out = unfused_expert_compute(rows, perm.weights.to(dev), perm.counts, w1_t_local[d], w2_t_local[d])
        for s in range(P):
            sel = (perm.src_rank == s).nonzero(as_tuple=True)[0]
            combine[s][perm.src_pick[sel].to(dev), perm.src_token[sel].to(dev)] = out[sel.to(dev)]
    return [weighted_combine(c, idx.to(c.device)) for c, idx in zip(combine, topk_idx)]


def gather_rows(xs: Sequence[torch.Tensor], perm: Permutation, device) -> torch.Tensor:
    """The dispatched rows of ``perm`` gathered with torch: row i = ``xs[src_rank[i]][src_token[i]]``
    (what the fused kernel's Dispatch copies into its pool), on ``device``."""
    out = torch.empty(perm.src_rank.numel(), xs[0].shape[1], dtype=xs[0].dtype, device=device)
    for s, x in enumerate(xs):
        sel = (perm.src_rank == s).nonzero(as_tuple=True)[0]
        out[sel.to(device)] = x[perm.src_token[sel].to(x.device)].to(device)
    return out
