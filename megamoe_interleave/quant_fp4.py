"""W4A8: FP4 (E2M1) expert weights with a power-of-two scale per row and 32 elements of K,
activations as in W8A8 (E4M3, 1x128 FP32 scales), and how the weights reach the FP8 mainloop.

**Storage** (DeepSeek-V4's expert format, as DeepGEMM's ``per_token_cast_to_fp4`` in
``deep_gemm/utils/math.py`` writes it with ``gran_k=32, use_ue8m0=True``):

* codes: E2M1 nibbles, ``sign << 3 | index`` with magnitudes ``E2M1_VALUES[index]``, two per byte
  (low nibble = even K index): ``uint8 [..., N, K/2]``;
* scales: one power of two ``2^e`` per row and 32 K, kept here as its UE8M0 byte ``e + 127``
  (the FP32 exponent field; DeepGEMM's packed int32 holds four such bytes): ``uint8 [..., N, K/32]``.

Quantizing from BF16 follows DeepGEMM: ``2^e`` is ``max(amax, 1e-4) / 6`` rounded up to a power of
two, and a scaled value goes to the nearest E2M1 magnitude, ties to the smaller (``bucketize``
against the midpoints). The kernel layout interleaves w1's gate and up rows
(:func:`~megamoe_interleave.weights.interleave_w1`); the scales are per row, so that is lossless.

**The W4A8 recipe** (what the fused kernel will compute, and what :func:`widen` emulates): a
128 x 128 block of weights becomes E4M3 values times one FP32 power of two ``2^r``, ``r`` = the
block's largest group exponent minus 6, each group's values ``e4m3(v * 2^(e - r))`` -- exact when
``e - r >= -8`` (docs/w4a8.md: E2M1 x 2^d is representable in E4M3 for d in [-8, 6]), that is
when the block's group exponents span at most 14; groups further down round to nearest-even on
E4M3's subnormal grid (:func:`inexact_groups` counts them). The widened weights are the W8A8
recipe's weight format, so the rest -- promotion per 128 K, h quantization, BF16 Combine -- is
W8A8's (:func:`~megamoe_interleave.reference.w8a8_expert_compute`).
"""
from __future__ import annotations

from typing import Tuple

import torch

from . import quant
from .config import QUANT_BLOCK, WIDEN_MAX_SHIFT
from .weights import interleave_w1, untransform_w1

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
SCALE_GROUP = 32  # K elements per power-of-two scale
UE8M0_BIAS = 127
AMAX_FLOOR = 1e-4
# E2M1 x 2^d is exact in E4M3 for d in [-8, 6]: the widening shifts a block's largest group to d = 6
WIDEN_MIN_SHIFT = -8


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """FP32 (already divided by its scale) -> E2M1 nibbles ``uint8`` (nearest magnitude, ties to the
    smaller; saturating at 6; -0 becomes +0)."""
    mid = torch.tensor(E2M1_MIDPOINTS, dtype=torch.float32, device=x.device)
    index = torch.bucketize(x.abs().float().clamp_max(E2M1_MAX), mid).to(torch.uint8)
    return index | (((x < 0) & (index != 0)).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 nibbles -> their FP32 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    v = table[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -v, v)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` nibbles -> ``[..., K/2]`` bytes, the even K index in the low nibble."""
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return (pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack` (``int8`` input is read as its bytes)."""
    b = packed.view(torch.uint8) if packed.dtype == torch.int8 else packed
    return torch.stack([b & 0xF, b >> 4], dim=-1).reshape(*b.shape[:-1], 2 * b.shape[-1])


CHUNK_ELEMENTS = 1 << 27  # weights per slice of the per-expert functions (their temporaries take ~20 B each)
# The fused kernel's sign layout per 32-bit word of eight nibbles (K order): nibble j keeps weight j's magnitude
# bits, and its bit 3 holds the sign of weight SIGN_SOURCE[j]. So weights 0-3's signs sit at bit 7 of the word's
# bytes and weights 4-7's at bit 3, where one mask (and a shift by 4) puts them on the E4M3 bytes (fp4_widen).
SIGN_SOURCE = (4, 0, 5, 1, 6, 2, 7, 3)


def _by_experts(fn):
    """``fn`` applied to slices of its tensors along the leading (expert) dimension, the results
    concatenated: the same values, with the temporaries of a slice (int64 indices, FP32 copies), not
    of every expert at once (a DeepSeek-V4-Flash rank's 4.3 G weights would need ~90 GB)."""
    def run(*tensors):
        t = tensors[0]
        per = max(1, CHUNK_ELEMENTS // max(1, t[0].numel())) if t.dim() == 3 else t.shape[0]
        if t.dim() != 3 or per >= t.shape[0]:
            return fn(*tensors)
        parts = [fn(*(x[i:i + per] for x in tensors)) for i in range(0, t.shape[0], per)]
        if isinstance(parts[0], tuple):
            return tuple(torch.cat(p) for p in zip(*parts))
        return torch.cat(parts)
    run.__doc__, run.__name__ = fn.__doc__, fn.__name__
    return run


def _check_k(k: int) -> None:
    if k % QUANT_BLOCK:
        raise ValueError(f"K = {k} must be a multiple of {QUANT_BLOCK} (W4A8's widened 128 x 128 blocks)")


@_by_experts
def quantize_weight(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` -> (codes ``uint8 [..., N, K/2]``, UE8M0 scale bytes ``uint8 [..., N, K/32]``)."""
    _check_k(w.shape[-1])
    g = w.float().reshape(*w.shape[:-1], -1, SCALE_GROUP)
    sf = g.abs().amax(dim=-1).clamp_min(AMAX_FLOOR) / E2M1_MAX
    bits = sf.view(torch.int32)
    # round up to a power of two: the exponent field, plus one where any mantissa bit is set
    e = (bits >> 23) - UE8M0_BIAS + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    codes = e2m1_codes(g * torch.exp2(-e.float())[..., None]).reshape(w.shape)
    return pack(codes), (e + UE8M0_BIAS).to(torch.uint8)


def group_exponents(sf: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes -> the exponents ``e`` (int32)."""
    return sf.to(torch.int32) - UE8M0_BIAS


@_by_experts
def dequantize(packed: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """FP32 ``value * 2^e`` of :func:`quantize_weight`'s output."""
    v = e2m1_values(unpack(packed))
    scale = torch.exp2(group_exponents(sf).float()).repeat_interleave(SCALE_GROUP, dim=-1)
    return v * scale


def _block_shift(sf: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(per-group shift ``d = e - r`` [..., N, K/32], block exponent ``r`` [..., N/128, K/128])."""
    *lead, n, g = sf.shape
    per = QUANT_BLOCK // SCALE_GROUP
    if n % QUANT_BLOCK or g % per:
        raise ValueError(f"scales {tuple(sf.shape)}: N and K must be multiples of {QUANT_BLOCK}")
    e = group_exponents(sf)
    blocks = e.reshape(*lead, n // QUANT_BLOCK, QUANT_BLOCK, g // per, per)
    r = blocks.amax(dim=(-3, -1)) - WIDEN_MAX_SHIFT
    d = blocks - r[..., :, None, :, None]
    return d.reshape(e.shape), r


@_by_experts
def widen(packed: torch.Tensor, sf: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The W4A8 recipe's weights for the FP8 mainloop: (E4M3 ``q [..., N, K]``, FP32 block scales
    ``[..., N/128, K/128]`` = ``2^r``), ``q = e4m3(value * 2^(e - r))`` (exact where
    :func:`inexact_groups` counts nothing)."""
    d, r = _block_shift(sf)
    v = e2m1_values(unpack(packed)) * torch.exp2(d.float()).repeat_interleave(SCALE_GROUP, dim=-1)
    return v.to(torch.float8_e4m3fn), torch.exp2(r.float())


def inexact_groups(sf: torch.Tensor) -> int:
    """Scale groups whose widening can round (shift below -8: the block's exponents span > 14)."""
    d, _ = _block_shift(sf)
    return int((d < WIDEN_MIN_SHIFT).sum())


def quantize_weights(w1: torch.Tensor, w2: torch.Tensor):
    """BF16 global weights (``w1 [E, 2I, H]`` gate then up rows, ``w2 [E, H, I]``) -> the kernel
    layout ``(w1_codes, w1_sf, w2_codes, w2_sf)``: w1's rows interleaved (codes and scales alike)."""
    w1_p, w1_sf = quantize_weight(w1)
    w2_p, w2_sf = quantize_weight(w2)
    return interleave_w1(w1_p), interleave_w1(w1_sf), w2_p.contiguous(), w2_sf.contiguous()


def widen_weights(w1_p, w1_sf, w2_p, w2_sf):
    """:func:`widen` of both kernel-layout weights: ``(w1_q, w1_s, w2_q, w2_s)`` in the W8A8
    kernel layout (:func:`megamoe_interleave.reference.reference_moe_w8a8` takes them): w1 widened
    per 128x128 block of its gate and of its up rows, as :func:`quant.quantize_weights` blocks them."""
    w1_q, w1_s = widen(untransform_w1(w1_p), untransform_w1(w1_sf))
    return (interleave_w1(w1_q), quant.kernel_w1_scales(w1_s), *widen(w2_p, w2_sf))


def braid_signs(packed: torch.Tensor) -> torch.Tensor:
    """Packed codes ``uint8 [..., K/2]`` (K a multiple of 8) -> the kernel's codes: magnitudes in place, each
    word's signs moved as :data:`SIGN_SOURCE` says (a lossless permutation of bits; :func:`unbraid_signs`)."""
    return _by_experts(lambda p: _move_signs(p, SIGN_SOURCE))(packed)


def unbraid_signs(braided: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`braid_signs`."""
    inverse = tuple(SIGN_SOURCE.index(i) for i in range(8))
    return _by_experts(lambda p: _move_signs(p, inverse))(braided)


def _move_signs(packed: torch.Tensor, source) -> torch.Tensor:
    nib = unpack(packed)
    words = nib.reshape(*nib.shape[:-1], -1, 8)
    signs = words[..., list(source)] & 8
    return pack(((words & 7) | signs).reshape(nib.shape))


def shift_words(d: torch.Tensor) -> torch.Tensor:
    """Per-group shifts ``d [..., N, K/32]`` -> the kernel's shift words ``int32 [..., K/128, N]``: a
    row's four shifts of one K block, group g in byte g, clamped below at ``fp4_widen.MIN_SHIFT``
    (a group that far down widens to zeros either way: 6 x 2^-21 rounds to 0 in E4M3)."""
    from .fp4_widen import MIN_SHIFT

    *lead, n, g = d.shape
    b = d.clamp_min(MIN_SHIFT).to(torch.int8).view(torch.uint8).reshape(*lead, n, g // 4, 4).to(torch.int32)
    words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    return words.transpose(-1, -2).contiguous()


def kernel_operands(w1_p, w1_sf, w2_p, w2_sf):
    """The fused W4A8 kernel's weight operands from the kernel-layout FP4 weights: ``(w1 codes, w1
    block scales, w1 shift words, w2 codes, w2 block scales, w2 shift words)``. The codes with their
    signs braided (:func:`braid_signs`); the block scales ``2^r`` are :func:`widen_weights`' (w1 in
    ``quant.kernel_w1_scales`` order), the shift words are ``d = e - r`` of each row and 32-group
    (:func:`shift_words`), so the kernel's widening is :func:`widen` bit for bit."""
    d1, r1 = _block_shift(untransform_w1(w1_sf))
    d2, r2 = _block_shift(w2_sf)
    return (braid_signs(w1_p), quant.kernel_w1_scales(torch.exp2(r1.float())), shift_words(interleave_w1(d1)),
            braid_signs(w2_p), torch.exp2(r2.float()), shift_words(d2))


def dequantize_weights(w1_p, w1_sf, w2_p, w2_sf, dtype=torch.float32):
    """Global weights (FP32, exact; or ``dtype``) in the natural layout (``w1`` gate then up rows) of
    the kernel-layout FP4 weights: what :func:`~megamoe_interleave.reference.reference_moe_fp32`
    takes. Expert by expert slice, so only the result is held in ``dtype`` (a rank's FP32 w1 at
    DeepSeek-V4-Flash is 17 GB)."""
    w1 = _by_experts(lambda p, sf: untransform_w1(dequantize(p, sf)).to(dtype))
    w2 = _by_experts(lambda p, sf: dequantize(p, sf).to(dtype))
    return w1(w1_p, w1_sf), w2(w2_p, w2_sf)


def from_deepgemm_layout(w1_p, w1_sf, w2_p, w2_sf):
    """DeepGEMM's ``per_token_cast_to_fp4(..., gran_k=32, use_ue8m0=True)`` layout (w1 gate then up
    rows, codes ``int8`` or ``uint8 [..., N, K/2]``, scales FP32 powers of two ``[..., N, K/32]`` or
    packed UE8M0 ``int32 [..., N, K/128]``) -> the kernel layout, bit for bit (the rows interleaved,
    the scales as their UE8M0 bytes)."""
    def codes(p):
        if p.dtype not in (torch.int8, torch.uint8):
            raise ValueError(f"packed FP4 codes must be int8 or uint8, got {p.dtype}")
        return p.view(torch.uint8)

    def scale_bytes(sf, k_half):
        if sf.dtype == torch.int32:  # four UE8M0 bytes per int32, in K order (little endian)
            b = sf.contiguous().view(torch.uint8)
        elif sf.dtype == torch.float32:
            bits = sf.view(torch.int32)
            if bool(((bits & 0x7FFFFF) != 0).any()) or bool((sf <= 0).any()):
                raise ValueError("FP32 FP4 scales must be positive powers of two (UE8M0)")
            b = (bits >> 23).to(torch.uint8)
        else:
            raise ValueError(f"FP4 scales must be float32 or packed int32 UE8M0, got {sf.dtype}")
        if b.shape[-1] != 2 * k_half // SCALE_GROUP:
            raise ValueError(f"{b.shape[-1]} scales per row for K = {2 * k_half}: expected one per {SCALE_GROUP}")
        return b

    w1_b, w2_b = codes(w1_p), codes(w2_p)
    return (interleave_w1(w1_b), interleave_w1(scale_bytes(w1_sf, w1_b.shape[-1])), w2_b.contiguous(),
            scale_bytes(w2_sf, w2_b.shape[-1]).contiguous())
