"""DeepGEMM's SM90 FP8 grouped GEMMs as a baseline of the fused W8A8 layer: per destination rank,
Linear-1 and Linear-2 of its routed rows with ``deep_gemm.m_grouped_fp8_gemm_nt_contiguous`` (the
1x128 activation / 128x128 weight recipe our W8A8 uses), nothing else (no Dispatch, SwiGLU, h
quantization, Combine or reduction) -- the GEMMs a user would run instead of the fused layer.

External: DeepGEMM is imported only when it is on ``PYTHONPATH`` (how to build and carry it:
docs/gpu.md, "DeepGEMM, the FP8 baseline"); :func:`load` says in one line why not otherwise. Never a
dependency of the library.

Layout (DeepGEMM's contiguous M-grouped layout): each local expert's rows padded to
``get_mk_alignment_for_contiguous_layout()`` (128), ``m_indices[row]`` = expert or -1 on padding
rows; activation scales made TMA-aligned MN-major once, outside the timed call.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch

E4M3 = torch.float8_e4m3fn
BLOCK = 128


def load() -> Tuple[Optional[object], str]:
    """(the ``deep_gemm`` module, "") or (None, why it cannot be used here)."""
    try:
        import deep_gemm
    except Exception as e:  # not installed, or built for another torch / CUDA
        return None, f"DeepGEMM not importable ({type(e).__name__}: {str(e)[:120]}); see docs/gpu.md (DeepGEMM, the FP8 baseline)"
    if not hasattr(deep_gemm, "m_grouped_fp8_gemm_nt_contiguous"):
        return None, f"this DeepGEMM ({getattr(deep_gemm, '__version__', '?')}) has no m_grouped_fp8_gemm_nt_contiguous"
    return deep_gemm, ""


def contiguous_rows(counts: Sequence[int], align: int) -> Tuple[torch.Tensor, int]:
    """DeepGEMM's grouped layout for ``counts`` rows per expert: (``m_indices`` int32 [M], M) with
    each expert's rows padded to a multiple of ``align`` and marked -1 there. Experts without rows
    take no rows."""
    parts = []
    for e, n in enumerate(int(c) for c in counts):
        padded = -(-n // align) * align
        parts += [torch.full((n,), e, dtype=torch.int32), torch.full((padded - n,), -1, dtype=torch.int32)]
    m_indices = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)
    return m_indices, int(m_indices.numel())


def block_quantize(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> (E4M3 [E, N, K], FP32 scales [E, N/128, K/128]): one scale per 128 x 128 block."""
    E, N, K = w.shape
    blocks = w.float().view(E, N // BLOCK, BLOCK, K // BLOCK, BLOCK)
    s = blocks.abs().amax(dim=(2, 4), keepdim=True).clamp(min=1e-4) / 448.0
    return (blocks / s).to(E4M3).view(E, N, K), s.view(E, N // BLOCK, K // BLOCK)


def token_quantize(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (E4M3 [M, K], FP32 scales [M, K/128]): one scale per token and 128 columns."""
    M, K = x.shape
    groups = x.float().view(M, K // BLOCK, BLOCK)
    s = groups.abs().amax(dim=2, keepdim=True).clamp(min=1e-4) / 448.0
    return (groups / s).to(E4M3).view(M, K), s.view(M, K // BLOCK)


def grouped_gemms(dg, shape, P: int, w1: torch.Tensor, w2: torch.Tensor, rank_counts) -> Tuple[Callable, dict]:
    """The two FP8 grouped GEMMs of every destination rank on random rows: (a callable running them,
    a check: the relative error of rank 0's first expert's L1 against a dequantized fp32 matmul).
    ``rank_counts[d]``: rows per local expert of rank d; ``w1`` [E, 2I, H], ``w2`` [E, H, I] bf16."""
    H, I = shape.hidden, shape.intermediate
    el = shape.num_experts // P
    align = dg.get_mk_alignment_for_contiguous_layout()
    dev = w1.device
    ranks = []
    for d in range(P):
        m_indices, M = contiguous_rows(rank_counts[d], align)
        m_indices = m_indices.to(dev)
        w1_q, w1_s = block_quantize(w1[d * el:(d + 1) * el])
        w2_q, w2_s = block_quantize(w2[d * el:(d + 1) * el])
        x_q, x_s = token_quantize(torch.randn(M, H, device=dev))
        h_q, h_s = token_quantize(torch.randn(M, I, device=dev))
        # DeepGEMM takes the activation scales MN-major and TMA-aligned; transformed once, untimed
        ranks.append(dict(m=m_indices, x_s=x_s,
                          l1=((x_q, dg.get_mn_major_tma_aligned_tensor(x_s)), (w1_q, w1_s)),
                          l2=((h_q, dg.get_mn_major_tma_aligned_tensor(h_s)), (w2_q, w2_s)),
                          d1=torch.empty(M, 2 * I, device=dev, dtype=torch.bfloat16),
                          d2=torch.empty(M, H, device=dev, dtype=torch.bfloat16)))

    def run():
        for r in ranks:
            dg.m_grouped_fp8_gemm_nt_contiguous(*r["l1"], r["d1"], r["m"], disable_ue8m0_cast=True)
            dg.m_grouped_fp8_gemm_nt_contiguous(*r["l2"], r["d2"], r["m"], disable_ue8m0_cast=True)

    run()
    check = {}
    r, n0 = ranks[0], int(rank_counts[0][0])
    if n0:  # rank 0's first expert: layout rows 0..n0-1, dequantized in fp32
        (x_q, _), (w_q, w_s) = r["l1"]
        a = (x_q[:n0].float().view(n0, H // BLOCK, BLOCK) * r["x_s"][:n0, :, None]).view(n0, H)
        w = (w_q[0].float().view(2 * I // BLOCK, BLOCK, H // BLOCK, BLOCK) * w_s[0][:, None, :, None]).view(2 * I, H)
        ref = a @ w.t()
        check["relative_error_l1_expert0"] = ((r["d1"][:n0].float() - ref).norm() / ref.norm().clamp(min=1e-12)).item()
    return run, check
