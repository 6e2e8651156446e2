"""FP8 (E4M3) quantization of the W8A8 recipe: the SM90 one of DeepSeek-V3 and DeepGEMM.

The recipe (DeepSeek-V3 Technical Report, arXiv:2412.19437, Section 3.3.2 "Fine-grained
quantization" and "Increasing accumulation precision"; DeepGEMM's SM90 FP8 GEMMs,
github.com/deepseek-ai/DeepGEMM):

* weights: E4M3 with one FP32 scale per 128x128 block of a ``[N, K]`` matrix;
* activations: E4M3 with one FP32 scale per token and 128-element group along K (1x128);
* GEMM: FP32 accumulation, the scales applied per 128-K block ("promotion":
  :func:`~megamoe_interleave.reference.blockwise_scaled_mm`).

Scale rule, as ``per_token_cast_to_fp8`` / ``per_block_cast_to_fp8`` in DeepGEMM's
``deep_gemm/utils/math.py``: ``s = max(amax, 1e-4) / 448`` over the group or block (448 = the
largest E4M3 value; the 1e-4 floor keeps an all-zero group's scale finite and nonzero, so it
quantizes and dequantizes to exact zeros; the division evaluated as torch does it on a GPU, times fl32(1/448)),
``q = e4m3(x * (1 / s))`` with round-to-nearest-even,
saturating (the ``cvt.rn.satfinite`` of the kernel) and ``x ~= q * s``. The scales stay FP32:
they are NOT rounded to powers of two. DeepGEMM rounds them up to powers of two (UE8M0, its
``use_ue8m0``) for the SM100 kernels, whose block-scaled MMAs take 8-bit exponents; the SM90
kernels (``sm90_fp8_gemm_1d2d``) multiply FP32 scales in the promotion, and the DeepSeek-V3 FP8
checkpoints store an FP32 ``<weight>_scale_inv`` per 128x128 block of each weight, dequantized as
``q * s`` (github.com/deepseek-ai/DeepSeek-V3, ``inference/fp8_cast_bf16.py``, ``weight_dequant``).

Layouts here: activation ``q [T, K]`` with ``s [T, K/128]`` (token-major); weight ``q [..., N, K]``
with ``s [..., N/128, K/128]``. w1 is quantized as DeepSeek's checkpoints and DeepGEMM do, in
128x128 blocks of its gate rows and of its up rows, and only then interleaved by 8 for the kernel
(:func:`~megamoe_interleave.weights.transform_weights`): an L1 N tile of 256 interleaved rows holds
gate block n and up block n, whose columns alternate every 8, so the kernel keeps the tile's two
scales in its ``w1_s`` rows 2n (gate) and 2n + 1 (up) (:func:`kernel_w1_scales`) and its promotion
picks one by the column's 8-group. A DeepSeek FP8 checkpoint thus loads bit for bit
(:func:`from_deepgemm_layout`); :func:`w1_scale_rows` gives each interleaved row its scale.
"""
from __future__ import annotations

from typing import Optional

import torch

from .config import QUANT_BLOCK
from .weights import INTERLEAVE_GRANULARITY, interleave_w1

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4


def _blocks(x: torch.Tensor, block_rows: int) -> torch.Tensor:
    """``[..., N, K]`` -> ``[..., N / block_rows, block_rows, K / 128, 128]`` (a view)."""
    *lead, n, k = x.shape
    if n % block_rows or k % QUANT_BLOCK:
        raise ValueError(f"[{n}, {k}] does not tile into {block_rows}x{QUANT_BLOCK} blocks")
    return x.reshape(*lead, n // block_rows, block_rows, k // QUANT_BLOCK, QUANT_BLOCK)


def quantize(x: torch.Tensor, block_rows: int, scales: Optional[torch.Tensor] = None):
    """``x [..., N, K]`` -> (E4M3 ``q``, FP32 scales ``[..., N / block_rows, K / 128]``), one scale
    per ``block_rows x 128`` block: 1 for activations, 128 for weights. ``scales`` given: quantize
    with those instead of the amax rule (the cast alone)."""
    v = _blocks(x.float(), block_rows)
    if scales is None:
        # times fl32(1/448), not / 448: what torch computes for a scalar divisor on a GPU, written
        # out so that the CPU gives the same bits (and the staging kernel, act_quant, can match).
        scales = v.abs().amax(dim=(-3, -1)).clamp(min=AMAX_FLOOR) * (1.0 / E4M3_MAX)
    q = (v * (1.0 / scales[..., :, None, :, None])).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q.reshape(x.shape), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """FP32 ``q * s`` of :func:`quantize`'s output (the block height follows from the shapes)."""
    v = _blocks(q.float(), q.shape[-2] // scales.shape[-2])
    return (v * scales[..., :, None, :, None]).reshape(q.shape)


def quantize_act(x: torch.Tensor):
    """Per token and 128-element group along K: ``x [T, K]`` -> (``q [T, K]``, ``s [T, K/128]``)."""
    return quantize(x, 1)


def quantize_weight(w: torch.Tensor):
    """Per 128x128 block: ``w [..., N, K]`` -> (``q``, ``s [..., N/128, K/128]``)."""
    return quantize(w, QUANT_BLOCK)


def quantize_weights(w1: torch.Tensor, w2: torch.Tensor):
    """BF16 global weights (``w1 [E, 2I, H]`` gate then up rows, ``w2 [E, H, I]``) -> the kernel
    layout ``(w1_q, w1_s, w2_q, w2_s)``: w1 quantized in 128x128 blocks of its gate and up rows,
    then interleaved (:func:`from_deepgemm_layout`); w2 quantized as is (``w2_s [E, H/128, I/128]``)."""
    return from_deepgemm_layout(*quantize_weight(w1), *quantize_weight(w2))


def kernel_w1_scales(w1_s: torch.Tensor) -> torch.Tensor:
    """w1's block scales over its gate then up rows ``[..., 2I/128, K/128]`` -> the kernel's order:
    row 2n = gate block n, row 2n + 1 = up block n (L1 N tile n's two scales, read together)."""
    gate, up = w1_s.chunk(2, dim=-2)
    return torch.stack([gate, up], dim=-2).flatten(-3, -2).contiguous()


def w1_scale_rows(w1_s: torch.Tensor) -> torch.Tensor:
    """The kernel's ``w1_s [..., 2I/128, K/128]`` -> each interleaved w1 row's scales ``[..., 2I, K/128]``:
    row p of N tile p // 256 takes the tile's gate scale (row 2 (p // 256)) where p // 8 is even
    (:func:`~megamoe_interleave.weights.interleave_w1`), its up scale (row 2 (p // 256) + 1) where odd."""
    p = torch.arange(w1_s.shape[-2] * QUANT_BLOCK, device=w1_s.device)
    return w1_s.index_select(-2, 2 * (p // (2 * QUANT_BLOCK)) + (p // INTERLEAVE_GRANULARITY) % 2)


def dequantize_w1(w1_q: torch.Tensor, w1_s: torch.Tensor) -> torch.Tensor:
    """FP32 ``q * s`` of the kernel-layout w1 (interleaved rows, :func:`kernel_w1_scales`)."""
    return w1_q.float() * w1_scale_rows(w1_s).repeat_interleave(QUANT_BLOCK, dim=-1)


def from_deepgemm_layout(w1_q: torch.Tensor, w1_s: torch.Tensor, w2_q: torch.Tensor, w2_s: torch.Tensor):
    """Pre-quantized weights in the DeepGEMM / DeepSeek FP8 checkpoint layout -> the kernel layout,
    bit for bit: ``w1_q [E, 2I, H]`` gate then up rows with ``w1_s [E, 2I/128, H/128]`` over those
    rows (a checkpoint's gate_proj and up_proj with their 128x128 ``scale_inv`` blocks, stacked)
    -> w1's rows interleaved by 8 and its scales in :func:`kernel_w1_scales`' order, as DeepGEMM's
    SM90 Mega MoE does (``transform_weights_for_mega_moe_sm90`` in ``deep_gemm/mega/__init__.py``
    of its SM90 branches: a gate and an up scale per N tile). w2 has the same layout in both."""
    E, two_i, H = w1_q.shape
    if w1_s.shape != (E, two_i // QUANT_BLOCK, H // QUANT_BLOCK) or two_i % (2 * QUANT_BLOCK):
        raise ValueError(f"w1_q {tuple(w1_q.shape)} with w1_s {tuple(w1_s.shape)}: not 128x128 blocks of "
                         f"gate then up rows (I a multiple of {QUANT_BLOCK})")
    return interleave_w1(w1_q), kernel_w1_scales(w1_s), w2_q.contiguous(), w2_s.contiguous()
