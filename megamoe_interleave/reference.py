"""Torch references for the fused MoE kernel.

* :func:`reference_moe_fp32` -- the float32 ground truth over the whole world.
* :func:`unfused_pipeline` -- the unfused bf16 baseline of one destination rank's experts:
  token permute + ``torch._grouped_mm`` L1 + SwiGLU x routing weight + ``torch._grouped_mm``
  L2 (+ combine by :func:`weighted_combine`). Benchmarks time it against the fused kernel.
* :func:`reference_moe_w8a8` -- the W8A8 recipe (:mod:`megamoe_interleave.quant`) emulated with
  its rounding points; :func:`w8a8_quantization_error` / :func:`relative_error` measure it
  against :func:`reference_moe_fp32`.
* :func:`reference_moe_w4a8` -- the W4A8 recipe: the FP4 weights widened to the W8A8 format
  (:func:`megamoe_interleave.quant_fp4.widen`), then the W8A8 recipe.

Conventions (shared with :mod:`megamoe_interleave.api` and the kernel):
expert parallelism over P ranks, rank r owns global experts ``[r*E_l, (r+1)*E_l)``;
``w1[e]`` is ``[2I, H]`` with gate rows ``0..I-1`` then up rows ``I..2I-1`` (before
:func:`megamoe_interleave.weights.transform_weights`), ``w2[e]`` is ``[H, I]``;
``y = sum_j w_j * W2[e_j] (silu(G[e_j] x) * U[e_j] x)`` over the unmasked picks j.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from . import quant, quant_fp4
from .config import QUANT_BLOCK


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


def slot_rows(topk_idx: torch.Tensor, stride: int, num_experts: Optional[int] = None) -> torch.Tensor:
    """[..., T, k] int32 rows of a flat ``[k * stride + 1, H]`` slot buffer for :func:`topk_reduce`
    (``topk_idx`` [..., T, k]: leading dims, e.g. ranks, share the layout): ``j * stride + t`` for
    pick j of token t, the last row (``k * stride``, the padding row) for a masked pick (-1) and,
    with ``num_experts``, for an id outside [0, num_experts)."""
    T, k = topk_idx.shape[-2:]
    dev = topk_idx.device
    valid = topk_idx >= 0 if num_experts is None else (topk_idx >= 0) & (topk_idx < num_experts)
    rows = torch.arange(k, device=dev, dtype=torch.int32)[None, :] * stride \
        + torch.arange(T, device=dev, dtype=torch.int32)[:, None]
    return torch.where(valid, rows, k * stride)


def topk_reduce(slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``y[t] = sum over j of slots[rows[t, j]]`` (bf16 out), skipping the padding row
    (``slots.shape[0] - 1``: masked picks; never read, so it may hold poison), in pick order with
    fp32 accumulation: each valid slot read once -- no mask pass, no fp32 copy, no host sync. On a
    CUDA device the CuTe DSL kernel of :mod:`~megamoe_interleave.topk_reduce`, elsewhere
    ``embedding_bag`` (the same order and rounding, so the same bits)."""
    if slots.is_cuda and slots.numel() < 2 ** 31:  # the kernel indexes elements with int32
        from .topk_reduce import topk_reduce_cuda

        return topk_reduce_cuda(slots, rows)
    return torch.nn.functional.embedding_bag(rows, slots, mode="sum", padding_idx=slots.shape[0] - 1)


def weighted_combine(combine: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
    """``y[t] = sum over valid picks j of combine[j, t]`` (fp32 accumulate in pick order, bf16 out;
    :func:`topk_reduce`); ``combine`` [k, T, H] holds the already weighted expert outputs. Masked
    slots (-1) are never read: they may hold poison (NaN) or stale data."""
    k, T, H = combine.shape
    flat = torch.cat([combine.reshape(k * T, H), combine.new_zeros(1, H)])
    return topk_reduce(flat, slot_rows(topk_idx[:T], T))


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
    # Flat slots with the padding row topk_reduce expects, so the reduction needs no copy.
    flat = [torch.zeros(k * x.shape[0] + 1, H, dtype=x.dtype, device=x.device) for x in xs]
    combine = [f[:-1].view(k, x.shape[0], H) for f, x in zip(flat, xs)]
    for d in range(P):
        perm = permute_for_rank(topk_idx, topk_weights, d, e_local)
        dev = w1_t_local[d].device
        rows = gather_rows(xs, perm, dev)
        out = unfused_expert_compute(rows, perm.weights.to(dev), perm.counts, w1_t_local[d], w2_t_local[d])
        for s in range(P):
            sel = (perm.src_rank == s).nonzero(as_tuple=True)[0]
            combine[s][perm.src_pick[sel].to(dev), perm.src_token[sel].to(dev)] = out[sel.to(dev)]
    return [topk_reduce(f, slot_rows(idx.to(f.device), x.shape[0])) for f, x, idx in zip(flat, xs, topk_idx)]


def gather_rows(xs: Sequence[torch.Tensor], perm: Permutation, device) -> torch.Tensor:
    """The dispatched rows of ``perm`` gathered with torch: row i = ``xs[src_rank[i]][src_token[i]]``
    (what the fused kernel's Dispatch copies into its pool), on ``device``."""
    out = torch.empty(perm.src_rank.numel(), xs[0].shape[1], dtype=xs[0].dtype, device=device)
    for s, x in enumerate(xs):
        sel = (perm.src_rank == s).nonzero(as_tuple=True)[0]
        out[sel.to(device)] = x[perm.src_token[sel].to(x.device)].to(device)
    return out


# -- W8A8 ------------------------------------------------------------------------------------
# End-to-end error of the recipe against reference_moe_fp32 on the BF16 weights (random data):
# E4M3 keeps 3 mantissa bits, so round-to-nearest moves a (normal) element by at most 2^-4 of its
# value and by an RMS eps in [2^-5, 2^-4] / sqrt(3) (ulp / sqrt(12), relative to a value at the
# top / bottom of its binade); a dot product of many such elements has relative RMS error eps.
# y carries x's and w1's errors twice (SwiGLU multiplies the gate and the up product, each with
# both) and h's and w2's once: ||y - ref|| / ||ref|| ~ sqrt(2 + 2 + 1 + 1) * eps, in
# [sqrt(2) * 2^-5, sqrt(2) * 2^-4] = [0.044, 0.088] (measured ~0.063; the BF16 output rounding,
# 2^-9, is negligible). DeepGEMM's tests' calc_diff = ||y - ref||^2 / (||y||^2 + ||ref||^2) ~ rel^2 / 2.
W8A8_FP32_REL_ERROR = (2 ** 0.5 * 2 ** -5, 2 ** 0.5 * 2 ** -4)
# What the fused W8A8 kernel must match reference_moe_w8a8 to (relative, as relative_error). It
# cannot be bitwise: Hopper's FP8 WGMMA accumulates a 128-K block with ~14 bits (DeepSeek-V3
# report, Section 3.3.2) and its SiLU / FMAs round differently, and these perturbations flip
# E4M3 roundings of h. Perturbing every promoted GEMM result by 2^-14 / 2^-13 / 2^-11 relative
# moves y by ~0.003 / 0.004 / 0.0085 (the square root of the perturbation: it acts through rounding
# flips), so 0.01 admits up to ~4x Hopper's accumulation error; a missing rounding point (h not
# quantized) moves y by ~0.023 and is rejected (tests/test_megamoe_w8a8.py).
W8A8_KERNEL_REL_ERROR = 0.01
# W4A8 against fp32 on the DEQUANTIZED FP4 weights (the weights' own FP4 error is not counted; the
# widening is exact): x twice and h once, sqrt(2 + 1) * eps, in [2^-5, 2^-4] (eps as above).
W4A8_FP32_REL_ERROR = (2 ** -5, 2 ** -4)


def blockwise_scaled_mm(a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor) -> torch.Tensor:
    """The SM90 FP8 GEMM with per-128-K promotion: ``out [M, N]`` FP32 = sum over the K blocks
    ``kb`` in K order of ``fp32(block dot) * (a_s[:, kb] * b_s[:, kb])``, accumulated in FP32
    (DeepGEMM ``sm90_fp8_gemm_1d2d.cuh``: ``final_accum += (scale_a * scale_b) * accum`` after
    each BLOCK_K = 128 of WGMMAs; DeepSeek-V3 report Section 3.3.2, N_C = 128).

    ``a_q [M, K]`` E4M3 with ``a_s [M, K/128]``; ``b_q [N, K]`` E4M3 with ``b_s [N, K/128]`` (one
    scale per row and K block: a 128x128 weight block's scale repeated over its 128 rows).
    The block dot is exact in float64 whatever the summation order (an E4M3 product is a
    multiple of 2^-18 below 2^18, a 128-term sum stays below 2^25 < 2^35), so the result does
    not depend on BLAS, M or the device; it is rounded to FP32 once (Hopper's FP8 WGMMA
    accumulates a block with ~14 bits, which the kernel will not reproduce bit for bit)."""
    out = torch.zeros(a_q.shape[0], b_q.shape[0], dtype=torch.float32, device=a_q.device)
    for kb in range(a_q.shape[1] // QUANT_BLOCK):
        k = slice(kb * QUANT_BLOCK, (kb + 1) * QUANT_BLOCK)
        part = (a_q[:, k].double() @ b_q[:, k].double().t()).float()
        out = out + part * (a_s[:, kb, None] * b_s[None, :, kb])
    return out


def w8a8_expert_compute(x_q, x_s, weights, counts, w1_q, w1_s, w2_q, w2_s) -> torch.Tensor:
    """The W8A8 counterpart of :func:`unfused_expert_compute` on dispatched rows (expert-major,
    ``counts[e]`` rows per local expert): per expert, Linear-1 with promotion, SwiGLU x routing
    weight in FP32, h quantized per token and 128 columns, Linear-2 with promotion, BF16 out
    (the Combine slot values).

    ``x_q [rows, H]`` E4M3 with ``x_s [rows, H/128]``; ``weights [rows]`` FP32; weights in the
    kernel layout of :func:`quant.quantize_weights` (``w1_q [E_l, 2I, H]`` interleaved rows with
    ``w1_s [E_l, 2I/128, H/128]``, a gate and an up scale per N tile, ``w2_q [E_l, H, I]`` with
    ``w2_s [E_l, H/128, I/128]``). Linear-1 runs over the interleaved rows as the kernel's N tiles
    do; its columns are de-interleaved for SwiGLU. Every row is computed on its own (no dependence on the other rows)."""
    from .weights import untransform_w1

    inter = w2_q.shape[-1]
    out = torch.empty(x_q.shape[0], w2_q.shape[1], dtype=torch.bfloat16, device=x_q.device)
    start = 0
    for e, n in enumerate(counts.tolist() if isinstance(counts, torch.Tensor) else counts):
        r = slice(start, start + n)
        start += n
        if n == 0:
            continue
        acc = blockwise_scaled_mm(x_q[r], x_s[r], w1_q[e], quant.w1_scale_rows(w1_s[e]))
        gate_up = untransform_w1(acc.t()[None])[0].t()  # columns back to gate | up
        h_q, h_s = quant.quantize_act(swiglu(gate_up[:, :inter], gate_up[:, inter:]) * weights[r, None])
        out[r] = blockwise_scaled_mm(h_q, h_s, w2_q[e], w2_s[e].repeat_interleave(QUANT_BLOCK, 0)).to(torch.bfloat16)
    return out


def reference_moe_w8a8(xs: Sequence[torch.Tensor], topk_idx: Sequence[torch.Tensor],
                       topk_weights: Sequence[torch.Tensor], w1_q: torch.Tensor, w1_s: torch.Tensor,
                       w2_q: torch.Tensor, w2_s: torch.Tensor,
                       x_scales: Optional[Sequence[torch.Tensor]] = None) -> List[torch.Tensor]:
    """BF16 output of every rank under the W8A8 recipe, with its rounding points: x quantized per
    token and 128-group (unless ``xs`` are E4M3 with ``x_scales [T, H/128]``), each pick through
    :func:`w8a8_expert_compute`, the BF16 results in ``[k, T, H]`` Combine slots reduced by
    :func:`weighted_combine`. Global weights in the kernel layout (:func:`quant.quantize_weights`).
    The fused W8A8 kernel must match it (``backend="torch"`` does bit for bit)."""
    E, _, H = w1_q.shape
    ys = []
    for r, (x, idx, w) in enumerate(zip(xs, topk_idx, topk_weights)):
        check_routing(x, idx, w, E)
        x_q, x_s = quant.quantize_act(x) if x_scales is None else (x, x_scales[r])
        perm = permute_for_rank([idx], [w], 0, E)
        rows = perm.src_token.to(x.device)
        out = w8a8_expert_compute(x_q[rows], x_s[rows], perm.weights.to(x.device), perm.counts_host,
                                  w1_q, w1_s, w2_q, w2_s)
        combine = torch.zeros(idx.shape[1], x.shape[0], H, dtype=torch.bfloat16, device=x.device)
        combine[perm.src_pick.to(x.device), rows] = out
        ys.append(weighted_combine(combine, idx))
    return ys


def reference_moe_w4a8(xs, topk_idx, topk_weights, w1_p: torch.Tensor, w1_sf: torch.Tensor, w2_p: torch.Tensor,
                       w2_sf: torch.Tensor, x_scales=None) -> List[torch.Tensor]:
    """BF16 output of every rank under the W4A8 recipe: :func:`reference_moe_w8a8` on the FP4
    weights (kernel layout, :func:`quant_fp4.quantize_weights`) widened by
    :func:`quant_fp4.widen_weights`. ``backend="torch"`` matches it bit for bit."""
    return reference_moe_w8a8(xs, topk_idx, topk_weights, *quant_fp4.widen_weights(w1_p, w1_sf, w2_p, w2_sf),
                              x_scales=x_scales)


def relative_error(ys: Sequence[torch.Tensor], refs: Sequence[torch.Tensor]) -> float:
    """``||y - ref|| / ||ref||`` (Frobenius, float64) over every rank's output together: the
    end-to-end quantization error of ``ys`` against e.g. :func:`reference_moe_fp32`."""
    num = sum(float((y.double() - r.double()).pow(2).sum()) for y, r in zip(ys, refs))
    den = sum(float(r.double().pow(2).sum()) for r in refs)
    return (num / den) ** 0.5 if den else float(num > 0)


def w8a8_quantization_error(xs, topk_idx, topk_weights, w1: torch.Tensor, w2: torch.Tensor) -> float:
    """End-to-end error of the recipe on global BF16 weights ``w1`` [E, 2I, H] (gate | up), ``w2``:
    :func:`relative_error` of :func:`reference_moe_w8a8` (weights by :func:`quant.quantize_weights`)
    against :func:`reference_moe_fp32` (within W8A8_FP32_REL_ERROR on random data)."""
    ys = reference_moe_w8a8(xs, topk_idx, topk_weights, *quant.quantize_weights(w1, w2))
    return relative_error(ys, reference_moe_fp32(xs, topk_idx, topk_weights, w1, w2))
