"""The W4A8 widening on the device: E2M1 nibbles times a group's power of two ``2^d`` to E4M3 bytes,
:func:`~megamoe_interleave.quant_fp4.widen`'s rounding bit for bit (docs/w4a8.md). The W4A8 kernel
runs it between the TMA ring's packed stage and the FP8 WGMMA's operand (:mod:`.sm90_fp4`).

Per 32-group, :func:`group_table` builds the group's lookup table: the eight E2M1 magnitudes times
2^-7 as FP16 constants, one exact FP16 multiply by 2^(7 + d) each (four ``mul.rn.f16x2``), and
``cvt.rn.satfinite.e4m3x2.f16x2`` to E4M3 -- the recipe's ``e4m3(m * 2^d)``, exact for d in [-8, 6]
and rounded to nearest even below, for every d down to :data:`MIN_SHIFT` (the products are FP16
normals or subnormals, all exact). Per word of eight nibbles, :func:`widen_e2m1x8` looks the
magnitudes up with ``prmt`` (a nibble's three magnitude bits select one of the table's eight bytes)
and ORs each weight's sign into bit 7 of its byte (E4M3's rounding is symmetric, so the sign commutes
with it; the host braids the signs so that a mask places them): seven instructions per eight weights,
against 29 for an FP16 multiply pair per weight pair.
"""
from __future__ import annotations

import struct

import cutlass.cute as cute
from cutlass import Int32

from xstage.device import cvt_e4m3x4_f16x2, mul_f16x2, prmt

from .config import WIDEN_MAX_SHIFT as MAX_SHIFT  # noqa: F401  (the largest d: docs/w4a8.md)
from .config import WIDEN_TABLE_MIN_SHIFT as MIN_SHIFT  # the smallest d with 2^(7 + d) a normal FP16
from .config import WIDEN_TABLES as TABLES  # group tables, one per shift: the kernel looks them up
SIGN_BYTES = 0x80808080 - (1 << 32)  # bit 7 of every byte, as an int32


def _f16x2(lo: float, hi: float) -> int:
    """An int32 holding two FP16 values (``lo`` in the low half)."""
    (word,) = struct.unpack("<i", struct.pack("<ee", lo, hi))
    return word


# E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (codes 0-7) times 2^-7, code 2p in the low half of pair p
E2M1_F16X2 = tuple(_f16x2(a * 2.0 ** -7, b * 2.0 ** -7) for a, b in ((0, 0.5), (1, 1.5), (2, 3), (4, 6)))


def shift_factor(d):
    """FP16x2 word of 2^(7 + d) in both halves, for MIN_SHIFT <= d <= 6 (Python int or DSL Int32)."""
    h = (22 + d) << 10
    return h | (h << 16)


@cute.jit
def group_table(factor: Int32):
    """The E4M3 bytes of ``e4m3(m * 2^d)`` for the E2M1 magnitude codes 0-7 (``factor`` =
    :func:`shift_factor` ``(d)``): two words, code c at byte c of the pair."""
    p = [mul_f16x2(Int32(c), factor) for c in E2M1_F16X2]
    return cvt_e4m3x4_f16x2(p[0], p[1]), cvt_e4m3x4_f16x2(p[2], p[3])


@cute.jit
def widen_e2m1x8(codes: Int32, table):
    """Eight E2M1 weights (``codes``: weight i's magnitude bits at bits 4i..4i+2, K order, the signs braided
    as :data:`~.quant_fp4.SIGN_SOURCE` says) as eight E4M3 bytes (two words, byte i = weight i),
    ``table`` = :func:`group_table` of their group. Seven instructions: weights 0-3's signs already sit at
    bit 7 of the codes' bytes, weights 4-7's at bit 3."""
    t_lo, t_hi = table
    mags = codes & 0x77777777
    lo = prmt(t_lo, t_hi, mags)  # weights 0-3 (prmt reads the selector's low 16 bits)
    hi = prmt(t_lo, t_hi, mags >> 16)
    return lo | (codes & SIGN_BYTES), hi | ((codes << 4) & SIGN_BYTES)
