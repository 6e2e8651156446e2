"""The W4A8 fused kernel, :class:`MegaMoESm90W4A8`: the W8A8 kernel
(:class:`~megamoe_interleave.sm90_fp8.MegaMoESm90W8A8`) whose weights stay 4-bit in HBM and in the TMA
ring and are widened to E4M3 on chip (docs/w4a8.md, the kernel step by step).

* Ring: a stage holds A (128 E4M3 rows of K), B as packed E2M1 codes (``block_n`` rows x 64 bytes,
  64-byte swizzle, each CTA of the pair loading and multicasting half) and the B rows' shift words
  (one int32 per row: the four 32-groups' shifts ``d`` of this K block, a byte each; each CTA loads
  all of them).
* Widening: after a stage's wait, consumer thread t (0-255) widens B row t, its four 32-groups
  (:func:`~.fp4_widen.widen_e2m1x8`, exact ``e4m3(value x 2^d)``, the recipe's rounding below
  d = -8), into one of two E4M3 B blocks in the W8A8 B layout (128-byte swizzle); then
  ``fence.proxy.async`` and a barrier, and the W8A8 mainloop reads the widened block. Its block
  scale 2^r is W8A8's weight scale, so the promotion is unchanged.
* Barriers: a full tile's two warpgroups read every B row, so all 256 consumer threads meet
  (``Widen``) after widening; block kt + 1's buffer was last read by block kt - 1, whose WGMMAs every
  thread waited for before that barrier of block kt. A 64-row half tile's warpgroup w reads B rows
  128 w .. 128 w + 127, which are its own threads' rows, so each warpgroup meets alone
  (``WidenWg0`` / ``WidenWg1``), also once before each K pair (the pair before it in flight).
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float8E4M3FN, Int32, Int64, Uint8, const_expr
from cutlass.cute.nvgpu import cpasync
from cutlass.utils import LayoutEnum
from quack import sm90_utils
from quack.cute_dsl_utils import mlir_namedtuple

from xstage import device as xdev

from .arguments import MegaMoEArgumentsW4A8
from .config import BLOCK_K_FP8, BLOCK_M, WIDENED_BUFFERS
from .fp4_widen import MIN_SHIFT, TABLES, group_table, shift_factor, widen_e2m1x8
from .kernel_sm90 import TmaOperands
from .sm90_fp8 import MegaMoESm90W8A8

PACKED_K = BLOCK_K_FP8 // 2  # bytes of a packed B row per K block
GROUPS = BLOCK_K_FP8 // 32  # 32-groups per K block (a shift each)

mlir_namedtuple(MegaMoEArgumentsW4A8)
# TmaOperands plus the shift words' atoms and coordinate tensors of L1 and L2
TmaOperandsW4A8 = mlir_namedtuple(NamedTuple("TmaOperandsW4A8", [(f, Any) for f in TmaOperands._fields]
                                             + [(f, Any) for f in ("tma_s1", "mS1", "tma_s2", "mS2")]))


class MegaMoESm90W4A8(MegaMoESm90W8A8):
    """The fused kernel in W4A8 (``MegaMoEConfig(precision="w4a8")``; BN = 256, BK = 128, 3 stages)."""

    precision = "w4a8"
    lean_k_loop = False  # the widening's state spilled with it (48 B of stack)
    stagger_warpgroups = False  # the widening's barrier lines the warpgroups up every K block
    b_dtype, b_tile_k, widened_buffers = Uint8, PACKED_K, WIDENED_BUFFERS

    def stage_tx_bytes(self) -> int:
        return self.block_k * BLOCK_M * self.ab_bytes + self.block_n * (PACKED_K + 4)

    # -- producer: the shift words ride in each ring stage
    def tma_operands(self, args):
        return self.with_n_split_atoms(TmaOperandsW4A8, (*self.make_tma_atoms(args.mPoolX, args.mH, args.mW1, args.mW2),
                                                         *self.shift_atom(args.mW1Shift), *self.shift_atom(args.mW2Shift)),
                                       args)

    def shift_layout(self):
        return cute.make_layout((1, self.block_n, self.stages), stride=(self.block_n, 1, self.block_n))

    def shift_atom(self, mShift):
        """``(E_l, K/128, N)`` int32 as a 2-D ``(E_l K/128, N)`` view; one stage's box is a K block's words
        of the tile's ``block_n`` rows (1 KB, not multicast)."""
        rows = cute.size(mShift, mode=[0]) * cute.size(mShift, mode=[1])
        n = cute.size(mShift, mode=[2])
        compact = cute.make_tensor(mShift.iterator, cute.make_layout((rows, n), stride=(n, 1)))
        return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), compact,
                                           cute.slice_(self.shift_layout(), (None, None, 0)), (1, self.block_n))

    @cute.jit
    def stage_extras(self, ops, tile, l1: cutlass.Constexpr, sm):
        """(atom, global K blocks, shared stages) of the tile's shift words."""
        tma_s, mS, kb = ops.tma_s2, ops.mS2, self.intermediate // self.block_k
        if const_expr(l1):
            tma_s, mS, kb = ops.tma_s1, ops.mS1, self.hidden // self.block_k
        gS = cute.local_tile(cute.domain_offset((tile.expert * kb, tile.n_block * self.block_n), mS),
                             (1, self.block_n), (None, 0))
        tSsS, tSgS = cpasync.tma_partition(tma_s, 0, cute.make_layout(1), cute.group_modes(sm.shifts, 0, 2),
                                           cute.group_modes(gS, 0, 2))
        return tma_s, tSgS, tSsS

    @cute.jit
    def load_extras(self, extras, sm, kt, stage, bar):
        tma_s, tSgS, tSsS = extras
        cute.copy(tma_s, tSgS[None, kt], tSsS[None, stage], tma_bar_ptr=bar)

    def precision_shared_tensors(self, sm, storage, mma):
        """The ring's B as packed codes, the widened blocks, the stages' shift words, the group tables."""
        sW = sm90_utils.make_smem_layout(Float8E4M3FN, LayoutEnum.ROW_MAJOR, (self.block_n, self.block_k),
                                         stage=self.widened_buffers)
        return dataclasses.replace(sm, sB=storage.sB.get_tensor(mma.sB.outer, swizzle=mma.sB.inner, dtype=Uint8),
                                   sW=storage.sW.get_tensor(sW.outer, swizzle=sW.inner),
                                   shifts=storage.shifts.get_tensor(self.shift_layout()),
                                   tables=storage.tables.get_tensor(cute.make_layout(TABLES)))

    @cute.jit
    def precision_prologue(self, sm, tidx):
        """Thread i < TABLES builds shift MIN_SHIFT + i's :func:`group_table` once per CTA: a widening then
        looks its four groups' tables up (one 8-byte load each) instead of building them (~15 instructions)."""
        if tidx < TABLES:
            lo, hi = group_table(shift_factor(tidx + MIN_SHIFT))
            sm.tables[tidx] = (Int64(hi) << 32) | (Int64(lo) & 0xFFFFFFFF)

    # -- consumers: widen, then W8A8's mainloop on the widened block
    def consumer_fragments(self, tiled_mma, tidx, sm):
        """W8A8's fragments with B over the widened blocks, each followed by what the widening needs."""
        full, half = super().consumer_fragments(tiled_mma, tidx, dataclasses.replace(sm, sB=sm.sW))
        return full + ((sm, tidx),), half + ((sm, tidx),)

    @cute.jit
    def b_ready(self, frags, state, kt, half: cutlass.Constexpr):
        """Widen ring stage ``state`` into block ``kt % 2``, fence, meet (module docstring); returns the block."""
        sm, tidx = frags[6]
        buf = kt % 2
        self.widen_stage(sm, tidx, state.index, buf)
        cute.arch.fence_proxy("async.shared", space="cta")  # generic stores -> the WGMMAs' reads
        if const_expr(half):
            self.b_free()
        else:
            cute.arch.barrier(barrier_id=int(self.NamedBarrier.Widen), number_of_threads=self.num_mma_threads)
        return buf

    @cute.jit
    def b_free(self):
        """The consumer warpgroup's own barrier (a half tile's warpgroup reads only its threads' rows)."""
        wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) // 4
        cute.arch.barrier(barrier_id=int(self.NamedBarrier.WidenWg0) + wg, number_of_threads=self.num_mma_threads // 2)

    @cute.jit
    def widen_stage(self, sm, tidx, stage, buf):
        """B row ``tidx`` of ring stage ``stage``: per 32-group one 16-byte load of codes (64-byte
        swizzle: chunk c at 16 (c ^ (row / 2 % 4))), its shift byte's :func:`group_table`, four
        :func:`widen_e2m1x8` and two 16-byte stores of E4M3 (128-byte swizzle: chunk c at
        16 (c ^ (row % 8)); both checked against the layouts in tests/test_megamoe_w4a8_compile.py)."""
        row = tidx
        word = sm.shifts[0, row, stage]
        src = Int32(sm.sB.iterator.toint()) + stage * (self.block_n * PACKED_K) + row * PACKED_K
        dst = Int32(sm.sW.iterator.toint()) + buf * (self.block_n * BLOCK_K_FP8) + row * BLOCK_K_FP8
        swz_p = ((row >> 1) & 3) << 4
        swz_w = (row & 7) << 4
        for g in cutlass.range_constexpr(GROUPS):
            codes = xdev.load_shared_v4(src + ((16 * g) ^ swz_p))
            t = sm.tables[((word << (24 - 8 * g)) >> 24) - MIN_SHIFT]  # byte g, sign-extended: its shift's table
            table = (Int32(t), Int32(t >> 32))
            out = []
            for w in cutlass.range_constexpr(4):
                lo, hi = widen_e2m1x8(codes[w], table)
                out += [lo, hi]
            xdev.store_shared_v4(dst + ((32 * g) ^ swz_w), *out[:4])
            xdev.store_shared_v4(dst + ((32 * g + 16) ^ swz_w), *out[4:])
