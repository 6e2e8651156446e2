"""Routing generators for expert-parallel MoE tests and benchmarks.

All generators are seedable and return ``(topk_idx int64 [T, k], topk_weights float32 [T, k])``
with *global* expert ids; masked picks carry index ``-1`` (their weight is ignored).
"""
from __future__ import annotations

import math

import torch


def _check(num_tokens: int, num_experts: int, topk: int) -> None:
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if num_experts <= 0:
        raise ValueError(f"num_experts must be > 0, got {num_experts}")
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk must be in [1, num_experts={num_experts}], got {topk}")


def _topk_of_scores(scores: torch.Tensor, topk: int):
    vals, idx = torch.topk(scores, topk, dim=-1)
    weights = torch.softmax(vals.float(), dim=-1)
    return idx.to(torch.int64), weights.to(torch.float32)


def balanced_routing(num_tokens: int, num_experts: int, topk: int, *, seed: int = 0, device="cpu"):
    """Top-k of i.i.d. Gaussian scores: every expert is equally likely (DeepGEMM's test routing)."""
    _check(num_tokens, num_experts, topk)
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(num_tokens, num_experts, generator=gen)
    idx, w = _topk_of_scores(scores, topk)
    return idx.to(device), w.to(device)


def zipf_bias(num_experts: int, strength: float, *, hot_seed: int = 1234) -> torch.Tensor:
    """Score bias ``strength * log(E * p_i)`` with Zipf probabilities p_i ∝ 1/rank.

    The expert -> Zipf-rank permutation depends only on ``hot_seed``, so every rank that
    uses the same ``hot_seed`` has the same hot experts (the skewed case that hurts EP)."""
    if strength < 0:
        raise ValueError("strength must be >= 0")
    ranks = torch.arange(1, num_experts + 1, dtype=torch.float64)
    p = (1.0 / ranks) / (1.0 / ranks).sum()
    perm = torch.randperm(num_experts, generator=torch.Generator().manual_seed(hot_seed))
    bias = torch.empty(num_experts, dtype=torch.float64)
    bias[perm] = strength * torch.log(p * num_experts)
    return bias.float()


def skewed_routing(
    num_tokens: int,
    num_experts: int,
    topk: int,
    *,
    strength: float = 1.0,
    seed: int = 0,
    hot_seed: int = 1234,
    device="cpu",
):
    """Top-k of Gaussian scores plus a Zipf bias shared by all ranks (``strength`` 0 = balanced)."""
    _check(num_tokens, num_experts, topk)
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(num_tokens, num_experts, generator=gen) + zipf_bias(num_experts, strength, hot_seed=hot_seed)
    idx, w = _topk_of_scores(scores, topk)
    return idx.to(device), w.to(device)


def mask_picks(topk_idx: torch.Tensor, ratio: float, *, seed: int = 0) -> torch.Tensor:
    """Return a copy with a random fraction ``ratio`` of the picks set to -1 (dropped)."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError("ratio must be in [0, 1]")
    gen = torch.Generator().manual_seed(seed)
    drop = torch.rand(topk_idx.shape, generator=gen) < ratio
    out = topk_idx.clone()
    out[drop.to(out.device)] = -1
    return out


def make_routing(kind: str, num_tokens: int, num_experts: int, topk: int, *, seed: int = 0,
                 strength: float = 1.0, mask_ratio: float = 0.0, device="cpu"):
    """Dispatch on ``kind`` in {"balanced", "skewed"}; optionally mask picks."""
    if kind == "balanced":
        idx, w = balanced_routing(num_tokens, num_experts, topk, seed=seed)
    elif kind == "skewed":
        idx, w = skewed_routing(num_tokens, num_experts, topk, strength=strength, seed=seed)
    else:
        raise ValueError(f"unknown routing kind {kind!r}")
    if mask_ratio > 0:
        idx = mask_picks(idx, mask_ratio, seed=seed + 7919)
    return idx.to(device), w.to(device)


def expert_load(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens received per expert (masked picks ignored)."""
    valid = topk_idx[topk_idx >= 0]
    return torch.bincount(valid.flatten(), minlength=num_experts)


def imbalance(topk_idx: torch.Tensor, num_experts: int) -> float:
    """max / mean expert load (1.0 = perfectly balanced)."""
    load = expert_load(topk_idx, num_experts).double()
    m = load.mean().item()
    return math.inf if m == 0 else load.max().item() / m
