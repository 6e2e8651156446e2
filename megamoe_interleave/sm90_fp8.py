"""The W8A8 fused kernel, :class:`MegaMoESm90W8A8`: the bf16 kernel
(:class:`~megamoe_interleave.kernel_sm90.MegaMoESm90`) with the recipe of
:mod:`~megamoe_interleave.quant` -- E4M3 operands and their scales through Dispatch, FP8 WGMMA with
per-128-K promotion, and the Linear-1 epilogue that quantizes h per token and 128 columns in
registers. It overrides the consumers' fragments, MMA and L1 staging, the Dispatch addressing, the h
stores and the register split; everything else (roles, schedule, ring, Combine) is the base's.

The mainloop (FP8 WGMMA, per-128-K promotion, the scales) is :class:`~.sm90_fp8_mainloop.Fp8ConsumerMixin`.

h quantization: an L1 tile of 256 interleaved w1 rows holds 128 h columns of its rows, one 1x128
group; a row's amax comes from the four lanes that hold it (two shuffles), and in a 64-row half
tile, where each warpgroup holds 64 of the columns, from shared memory across the warpgroups.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float8E4M3FN, Float32, Int32, Int64, const_expr

from xstage import device as xdev

from .activation import swiglu_tanh
from .config import BLOCK_K_FP8, BLOCK_M, QUANT_BLOCK
from .kernel_sm90 import MegaMoESm90
from .sm90_fp8_mainloop import Fp8ConsumerMixin
from .sm90_mainloop import ConsumerMixin

E4M3_MAX = 448.0  # quant.E4M3_MAX
AMAX_FLOOR = 1e-4  # quant.AMAX_FLOOR


class MegaMoESm90W8A8(Fp8ConsumerMixin, MegaMoESm90):
    """The fused kernel in W8A8 (``MegaMoEConfig(precision="w8a8")``; BN = 256, BK = 128)."""

    precision = "w8a8"
    # One ring stage is a 128-byte swizzle row either way: 128 E4M3 of K = one scale block.
    ab_dtype, ab_bytes, block_k = Float8E4M3FN, 1, BLOCK_K_FP8
    # The consumers hold the promoted sums (128 registers), one 64-register batch fragment and the
    # scales: at 216 the tile loop's state spilled around each tile (5.8-7.6 % of the time between
    # tiles; at 224 1.6 %, the layer 2 % faster). The aux warps fit 56 (256 x 224 + 128 x 56 = 64512)
    # with a shallower Dispatch unroll.
    aux_warpgroup_regs, mma_warpgroup_regs, dispatch_warp_unroll = 56, 224, 8
    row_scale_words, amax_words = BLOCK_M, 2 * 64  # the staged rows' h scales; the half tiles' amax

    def __init__(self, hidden: int, intermediate: int, config):
        if config.block_n != 256:
            raise ValueError("the W8A8 kernel needs block_n=256 (MegaMoEConfig.resolve)")
        super().__init__(hidden, intermediate, config)

    # -- Dispatch: the rows' scales travel with them
    def dispatch_chunks_per_row(self):
        """16-byte chunks of one dispatched row: its H E4M3 bytes, then its H/128 FP32 scales
        (H % 512 == 0, so they are whole chunks)."""
        x_chunks = self.hidden * self.ab_bytes // 16
        return x_chunks, x_chunks + self.hidden // QUANT_BLOCK * 4 // 16

    @cute.jit
    def chunk_source(self, gm, i, x_chunks: cutlass.Constexpr, chunks: cutlass.Constexpr):
        addr, _ = self.chunk_addresses_w8a8(gm, i, x_chunks, chunks)
        return addr

    @cute.jit
    def chunk_destination(self, gm, pool_base, i, x_chunks: cutlass.Constexpr, chunks: cutlass.Constexpr):
        _, dst = self.chunk_addresses_w8a8(gm, i, x_chunks, chunks)  # (its loads are dead code)
        return dst

    @cute.jit
    def chunk_addresses_w8a8(self, gm, i, x_chunks: cutlass.Constexpr, chunks: cutlass.Constexpr):
        """(source, destination) of pool chunk ``i``, chunk ``c = i % chunks`` of pool row
        ``i // chunks``: from its source rank's x (c < x_chunks) or x_scales."""
        row, c = i // chunks, i % chunks
        src, tok = gm.mPoolSrc[row, 0], Int64(gm.mPoolSrc[row, 1])
        s_chunks = chunks - x_chunks
        src_addr = Int64(gm.mPeerX[src]) + tok * (x_chunks * 16) + Int64(c) * 16
        dst_addr = Int64(gm.mPoolX.iterator.toint()) + Int64(row) * (x_chunks * 16) + Int64(c) * 16
        if c >= x_chunks:
            src_addr = Int64(gm.mPeerXScale[src]) + tok * (s_chunks * 16) + Int64(c - x_chunks) * 16
            dst_addr = Int64(gm.mPoolXScale.iterator.toint()) + Int64(row) * (s_chunks * 16) \
                + Int64(c - x_chunks) * 16
        return src_addr, dst_addr

    @cute.jit
    def bulk_row_extras(self, gm, sm, i, j: Int32, ok: Boolean, err):
        """The bulk Dispatch's one more piece per row: the row's scales."""
        scale_bytes = self.hidden // QUANT_BLOCK * 4
        tok = Int64(gm.mPoolSrc[i, 1])
        j, ok = self.bulk_piece(sm, Int64(gm.mPeerXScale[gm.mPoolSrc[i, 0]]) + tok * scale_bytes,
                                Int64(gm.mPoolXScale.iterator.toint()) + Int64(i) * scale_bytes, scale_bytes, j, ok,
                                err)
        return j, ok

    # -- epilogue: E4M3 h rows and their scales
    def h_store_address(self, h_base, row, c):
        return h_base + Int64(row) * self.intermediate + c * 16

    @cute.jit
    def store_h_scales(self, gm, sm, tile, row0, rows, et):
        """The staged rows' h scales (one 1x128 group per L1 tile)."""
        m = et
        while m < rows:
            gm.mHScale[row0 + m, tile.n_block] = sm.row_scale[m]
            m = m + self.num_epi_threads

    # -- consumers: the L1 staging (h quantized) and the L2 staging; the mainloop is Fp8ConsumerMixin's
    @cute.jit
    def stage_output(self, frags, half: Boolean, sm, swiglu_l1: cutlass.Constexpr, part: cutlass.Constexpr):
        """L1: the E4M3 h tile and its rows' scales (:meth:`stage_h_fp8`); L2: the base's bf16 staging."""
        full_f, half_f = frags
        if const_expr(swiglu_l1):
            if half:
                self.stage_h_fp8(half_f[1], half_f[4], sm, True)
            else:
                self.stage_h_fp8(full_f[1], full_f[4], sm, False)
        else:
            ConsumerMixin.stage_output(self, frags, half, sm, swiglu_l1, part)

    @cute.jit
    def stage_l2(self, acc, tCcC, sm, row, vals, lo: cutlass.Constexpr, hi: cutlass.Constexpr,
                 col0: cutlass.Constexpr):
        """The base's L2 staging with fewer live addresses: element i0 holds column 2 i0 + 2 q (+ the
        warpgroup's first), so its group is element 0's + i0 / 4 - col0 / 8, addressed as one of
        ``swizzle_groups`` swizzled bases plus a compile-time offset. (ptxas hoisted the base's
        address per group out of the tile loop and spilled them, 22 local loads per L2 tile; the
        bf16 kernel keeps the base's form, which this one serializes there: C7511.)"""
        lane = cute.arch.lane_idx()
        words = cute.recast_tensor(vals, Int32)
        _, nn = tCcC[0]
        group0 = (nn - 2 * (lane % 4)) // 8 + lane // 16
        bases = {}
        for i0 in cutlass.range_constexpr(lo, hi, 8):
            for k in cutlass.range_constexpr(8):
                vals[k] = BFloat16(acc[i0 + k])
            wrap, r = divmod(i0 // 4 - col0 // 8, self.swizzle_groups)
            if const_expr(r not in bases):
                bases[r] = sm.sC.iterator + self.stage_index(row, 4 * (group0 + r))
            xdev.stmatrix_x4(bases[r] + 4 * self.swizzle_groups * wrap, words[0], words[1], words[2], words[3])

    @cute.jit
    def stage_h_fp8(self, acc, tCcC, sm, half: cutlass.Constexpr):
        """L1 hand-off: h = SwiGLU(gate, up) x routing weight in FP32 (gate/up interleaved by 8
        columns: element groups 2 j, 2 j + 1) in place of the gate elements, each row's amax over the
        tile's 128 h columns, its scale ``max(amax, 1e-4) / 448`` (to ``sm.row_scale``, written to
        global by the epilogue warps), and E4M3 pairs ``e4m3(h * (1 / s))`` into the staging tile
        (byte ``c`` of row ``m`` at word ``stage_index(m, c // 4)``)."""
        lane = cute.arch.lane_idx()
        q = lane % 4
        wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) // 4
        groups = cute.size(acc) // 8  # 8-column groups of gate (and of up) per thread
        for jt in cutlass.range_constexpr(groups):
            for v1 in cutlass.range_constexpr(2):
                i = 8 * jt + 2 * v1
                mm, _ = tCcC[i]
                w = sm.row_w[mm]
                for v0 in cutlass.range_constexpr(2):
                    acc[i + v0] = swiglu_tanh(acc[i + v0], acc[i + 4 + v0]) * w
        inv = cute.make_rmem_tensor((2,), Float32)
        for v1 in cutlass.range_constexpr(2):
            m = Float32(0.0)
            for jt in cutlass.range_constexpr(groups):
                for v0 in cutlass.range_constexpr(2):
                    m = cute.arch.fmax(m, cute.absf(acc[8 * jt + 2 * v1 + v0]))
            m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=1))
            m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=2))
            row, _ = tCcC[2 * v1]
            if const_expr(half):  # the other warpgroup holds the row's other 64 columns
                if q == 0:
                    sm.amax_x[wg * 64 + row] = m
                cute.arch.barrier(barrier_id=int(self.NamedBarrier.Consumers), number_of_threads=self.num_mma_threads)
                m = cute.arch.fmax(m, sm.amax_x[(1 - wg) * 64 + row])
            scale = cute.arch.fmax(m, Float32(AMAX_FLOOR)) / Float32(E4M3_MAX)
            inv[v1] = Float32(1.0) / scale
            if q == 0:
                if const_expr(half):
                    if wg == 0:
                        sm.row_scale[row] = scale
                else:
                    sm.row_scale[row] = scale
        base = Int32(sm.sC.iterator.toint())
        for jt in cutlass.range_constexpr(groups):
            for v1 in cutlass.range_constexpr(2):
                mm, nn = tCcC[8 * jt + 2 * v1]  # the gate element's column 16 g + 2 q -> h column 8 g + 2 q
                hcol = (nn // 16) * 8 + nn % 8
                k = 8 * jt + 2 * v1
                pair = xdev.cvt_e4m3x2(acc[k] * inv[v1], acc[k + 1] * inv[v1])
                xdev.store_shared_b16(base + self.stage_index(mm, hcol // 4) * 4 + hcol % 4, pair)
