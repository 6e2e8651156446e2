"""DeepGEMM's SM90 FP8 grouped GEMMs as a baseline of the fused W8A8 layer: per destination rank,
Linear-1 and Linear-2 of its routed rows with ``deep_gemm.m_grouped_fp8_gemm_nt_contiguous`` (the
1x128 activation / 128x128 weight recipe our W8A8 uses), nothing else (no Dispatch, SwiGLU, h
quantization, Combine or reduction) -- the GEMMs a user would run instead of the fused layer.

External: DeepGEMM is imported only when it is on ``PYTHONPATH`` or in the bundle that
``XSTAGE_DEEPGEMM_BUNDLE`` names (how to build and carry it: docs/gpu.md, "DeepGEMM, the FP8
baseline"); :func:`load` says in one line why not otherwise. Never a dependency of the library.

Layout (DeepGEMM's contiguous M-grouped layout): each local expert's rows padded to
``get_mk_alignment_for_contiguous_layout()`` (128), ``m_indices[row]`` = expert or -1 on padding
rows; activation scales made TMA-aligned MN-major once, outside the timed call.
"""
from __future__ import annotations

import os
import shutil
import sys
import tarfile
from typing import Callable, Optional, Sequence, Tuple

import torch

from lab.megamoe.routing import expert_load

E4M3 = torch.float8_e4m3fn
BLOCK = 128
VARIANT = "DeepGEMM fp8 GEMMs x2 only"  # the paired variant's name in the benches


def use_bundle(bundle: str, root: str = "/tmp") -> bool:
    """Put the DeepGEMM of ``bundle`` (a folder with the baseline bundle's ``dgu.tar.xz`` and, if there,
    ``jit_cache_h200.tar.xz``: its compiled kernels; docs/gpu.md) on ``sys.path``, unpacked once to
    ``root/dgu`` and ``root/dgcache_u``; its JIT finds the CUDA toolkit through ``nvcc``. False
    without the package archive."""
    package = os.path.join(bundle, "dgu.tar.xz")
    if not os.path.isfile(package):
        return False
    dest, cache = os.path.join(root, "dgu"), os.path.join(root, "dgcache_u")
    if not os.path.isdir(os.path.join(dest, "deep_gemm")):
        with tarfile.open(package) as t:
            t.extractall(dest, filter="tar")
    kernels = os.path.join(bundle, "jit_cache_h200.tar.xz")
    if os.path.isfile(kernels) and not os.path.isdir(cache):
        with tarfile.open(kernels) as t:
            t.extractall(root, filter="tar")
    nvcc = shutil.which("nvcc")
    if nvcc:
        os.environ.setdefault("CUDA_HOME", os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    os.environ.setdefault("DG_JIT_CACHE_DIR", cache)
    if dest not in sys.path:
        sys.path.insert(0, dest)
    return True


def load() -> Tuple[Optional[object], str]:
    """(the ``deep_gemm`` module, "") or (None, why it cannot be used here); first from
    ``XSTAGE_DEEPGEMM_BUNDLE`` (:func:`use_bundle`) where it is set."""
    bundle = os.environ.get("XSTAGE_DEEPGEMM_BUNDLE")
    if bundle and not use_bundle(bundle):
        return None, f"XSTAGE_DEEPGEMM_BUNDLE={bundle} has no dgu.tar.xz (the DeepGEMM bundle: docs/gpu.md)"
    try:
        import deep_gemm
    except Exception as e:  # not installed, or built for another torch / CUDA
        return None, f"DeepGEMM not importable ({type(e).__name__}: {str(e)[:120]}); see docs/gpu.md (DeepGEMM, the FP8 baseline)"
    if not hasattr(deep_gemm, "m_grouped_fp8_gemm_nt_contiguous"):
        return None, f"this DeepGEMM ({getattr(deep_gemm, '__version__', '?')}) has no m_grouped_fp8_gemm_nt_contiguous"
    return deep_gemm, ""


def rows_per_expert(shape, P: int, idx) -> list:
    """Rows per local expert of every destination rank (the routed picks of every source rank's
    ``idx``; -1 = masked)."""
    el = shape.num_experts // P
    counts = expert_load(torch.cat([i.flatten() for i in idx]), shape.num_experts).tolist()
    return [counts[d * el:(d + 1) * el] for d in range(P)]


def paired_variant(shape, P: int, w1: torch.Tensor, w2: torch.Tensor, idx) -> Tuple[Optional[Callable], dict]:
    """For a bench's paired trials: (the two GEMMs of every rank as a callable, or None, and a note:
    ``{"deepgemm": version or why not, "check": ...}``). The check is :func:`grouped_gemms`' error of
    rank 0's first expert against fp32; above 1 % the variant is left out (a broken build)."""
    dg, why = load()
    if dg is None:
        print(why, flush=True)
        return None, {"deepgemm": why}
    run, check = grouped_gemms(dg, shape, P, w1, w2, rows_per_expert(shape, P, idx))
    note = {"deepgemm": f"DeepGEMM {getattr(dg, '__version__', '?')}", "check": check}
    if check.get("relative_error_l1_expert0", 0.0) >= 0.01:
        print(f"DeepGEMM left out: its L1 is {check['relative_error_l1_expert0']:.4f} from fp32", flush=True)
        return None, note
    return run, note


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


def block_quantize(w: torch.Tensor, experts_per_pass: int = 16) -> Tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> (E4M3 [E, N, K], FP32 scales [E, N/128, K/128]): one scale per 128 x 128 block
    (``experts_per_pass`` experts' FP32 copies at a time: 256 experts' w1 at once would be 17 GB)."""
    E, N, K = w.shape
    q = torch.empty(E, N, K, dtype=E4M3, device=w.device)
    scales = torch.empty(E, N // BLOCK, K // BLOCK, dtype=torch.float32, device=w.device)
    for e0 in range(0, E, experts_per_pass):
        part = w[e0:e0 + experts_per_pass]
        blocks = part.float().view(part.shape[0], N // BLOCK, BLOCK, K // BLOCK, BLOCK)
        s = blocks.abs().amax(dim=(2, 4), keepdim=True).clamp(min=1e-4) / 448.0
        q[e0:e0 + experts_per_pass] = (blocks / s).to(E4M3).view(part.shape[0], N, K)
        scales[e0:e0 + experts_per_pass] = s.view(part.shape[0], N // BLOCK, K // BLOCK)
    return q, scales


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
