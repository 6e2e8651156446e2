"""The W4A8 widening on the device: E2M1 nibbles times a group's power of two ``2^d`` to E4M3 bytes,
:func:`~megamoe_interleave.quant_fp4.widen`'s rounding bit for bit (docs/w4a8.md). The W4A8 kernel
will run it between the TMA ring's packed stage and the FP8 WGMMA's operand; it is tested alone.

A nibble's magnitude bits placed at bit 9 of an FP16, with its sign at bit 15, are the E2M1 value
times 2^-14 (E2M1's subnormal 0.5 included: the two formats share their lowest exponents). Two exact
FP16 multiplies, by 2^7 and by 2^(7 + d) (one would overflow FP16 for d > 1), and one
``cvt.rn.satfinite.e4m3x2.f16x2`` give ``e4m3(value * 2^d)``: exact for d in [-8, 6], rounded to
nearest even below, as the recipe. The FP16 pairs are nibbles i and i + 4 of a word (16 bits apart),
so each pair takes two shifts and one LOP3 of the word itself; two PRMTs put the E4M3 bytes back in
K order.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from xstage.device import cvt_e4m3x4_f16x2, mul_f16x2, prmt

F16X2_TWO_POW_7 = 0x58005800  # 2^7 in both FP16 halves (biased exponent 22)
MASK_SIGNS = -0x7FFF8000  # 0x80008000 as an int32: both halves' sign bits
MIN_SHIFT = -20  # the smallest d with 2^(7 + d) a normal FP16: the recipe's inexact groups, down to here


def shift_factor(d):
    """FP16x2 word of 2^(7 + d) in both halves, for MIN_SHIFT <= d <= 6 (Python int or DSL Int32)."""
    h = (22 + d) << 10
    return h | (h << 16)


@cute.jit
def widen_e2m1x8(codes: Int32, factor: Int32):
    """Eight E2M1 nibbles (``codes``: nibble i at bits 4i..4i+3, K order) times ``2^d`` as eight E4M3
    bytes (two words, byte i = nibble i), ``factor`` = :func:`shift_factor` ``(d)``."""
    f = []
    for p in cutlass.range_constexpr(4):  # FP16 pair p: nibbles p and p + 4, at bits 4p and 4p + 16
        mag = (codes << (9 - 4 * p)) if p < 3 else (codes >> 3)
        sign = codes << (12 - 4 * p)
        f.append(mul_f16x2(mul_f16x2((mag & 0x0E000E00) | (sign & MASK_SIGNS), Int32(F16X2_TWO_POW_7)), factor))
    w01 = cvt_e4m3x4_f16x2(f[0], f[1])  # bytes: e0 e4 e1 e5
    w23 = cvt_e4m3x4_f16x2(f[2], f[3])  # e2 e6 e3 e7
    return prmt(w01, w23, 0x6420), prmt(w01, w23, 0x7531)
