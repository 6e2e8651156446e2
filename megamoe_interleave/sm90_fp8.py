"""The W8A8 fused kernel, :class:`MegaMoESm90W8A8`: the bf16 kernel
(:class:`~megamoe_interleave.kernel_sm90.MegaMoESm90`) with the recipe of
:mod:`~megamoe_interleave.quant` -- E4M3 operands and their scales through Dispatch, FP8 WGMMA with
per-128-K promotion, and the Linear-1 epilogue that quantizes h per token and 128 columns in
registers. It overrides the consumers' fragments, MMA and L1 staging, the Dispatch addressing, the h
stores and the register split; everything else (roles, schedule, ring, Combine) is the base's.

Promotion (DeepSeek-V3 report Section 3.3.2; DeepGEMM ``sm90_fp8_gemm_1d2d``): a ring stage is one
128-deep K block; its WGMMAs accumulate into a zeroed FP32 fragment, which is then added to the
tile's FP32 sums scaled by ``sa[row, kb] * sb[n block, kb]``, so the tensor core's limited
accumulation precision never spans more than 128 products. A 128 x 256 tile's sums take 128
registers per thread; the block's WGMMAs run in two 128-column batches (one per weight scale block
of w2; w1's gate and up scale blocks alternate every 8 columns, as its interleaved rows do) through
one 64-register fragment, each promoted after ``wait_group(0)`` while the other warpgroup's
WGMMAs run (DeepGEMM's scheme; 4 x 64-column slices in ping-pong before). A 64-row half tile (a warpgroup per 128 columns) runs one
128-column batch per warpgroup through its own 64 registers (the full tile's upper sums are dead
there).

h quantization: an L1 tile of 256 interleaved w1 rows holds 128 h columns of its rows, one 1x128
group; a row's amax comes from the four lanes that hold it (two shuffles), and in a 64-row half
tile, where each warpgroup holds 64 of the columns, from shared memory across the warpgroups.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float8E4M3FN, Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import warpgroup
from quack import sm90_utils

from xstage import device as xdev

from .activation import swiglu_tanh
from .config import BLOCK_K_FP8, BLOCK_M, QUANT_BLOCK
from .kernel_sm90 import MegaMoESm90
from .scheduler import tile_pool_row
from .sm90_mainloop import ConsumerMixin

SLICE_N = 128  # columns per WGMMA slice of a full tile (see the module docstring)
E4M3_MAX = 448.0  # quant.E4M3_MAX
AMAX_FLOOR = 1e-4  # quant.AMAX_FLOOR


class MegaMoESm90W8A8(MegaMoESm90):
    """The fused kernel in W8A8 (``MegaMoEConfig(precision="w8a8")``; BN = 256, BK = 128)."""

    precision = "w8a8"
    # One ring stage is a 128-byte swizzle row either way: 128 E4M3 of K = one scale block.
    ab_dtype, ab_bytes, block_k = Float8E4M3FN, 1, BLOCK_K_FP8
    # The consumers' promoted sums (128) and two ping-pong slice fragments (2 x 32) need 216 registers
    # (at 208 ptxas spilled inside the mainloop); at 216 the tile loop's state spilled around each tile
    # (5.8-7.6 % of the time between tiles; at 224 1.6 %, the layer 2 % faster). The aux warps fit 56
    # (256 x 224 + 128 x 56 = 64512) with a shallower Dispatch unroll.
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

    # -- consumers
    @cute.jit
    def tile_mma(self, ab_pipe, state, ok: Boolean, gm, frags, half: Boolean, num_k: cutlass.Constexpr, tile,
                 l1: cutlass.Constexpr):
        """:meth:`mma_tile_fp8` (which reads ``tile``'s scales) with the full or (``half``) the 64-row
        fragments."""
        full_f, half_f = frags
        t1 = Int64(0)
        if half:
            state, t1, ok = self.mma_tile_fp8(ab_pipe, state, ok, gm, half_f, num_k, tile, l1, True)
        else:
            state, t1, ok = self.mma_tile_fp8(ab_pipe, state, ok, gm, full_f, num_k, tile, l1, False)
        return state, t1, ok

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

    def consumer_fragments(self, tiled_mma, tidx, sm):
        """``(full, half)``, each (tiled_mma of a slice, promoted sums, tCrA, tCrB, tCcC, slice
        fragment). ``full``: the 128 x 256 tile's sums (``tiled_mma``'s layout, 128 registers) and
        a 128 x 64 slice MMA (a warpgroup per 64 rows), tCrB per slice. ``half``: 64 x 256, a
        warpgroup per 128 columns (one slice each): the sums are the first 64 of ``full``'s
        registers, the slice fragment its own."""
        BN, BK, S = self.block_n, self.block_k, self.stages
        thr = tiled_mma.get_slice(tidx)
        acc = cute.make_rmem_tensor(thr.partition_shape_C((BLOCK_M, BN)), Float32)
        tCcC = thr.partition_C(cute.make_identity_tensor((BLOCK_M, BN)))
        mma_s = sm90_utils.make_tiled_mma(Float8E4M3FN, "K", "K", SLICE_N, atom_layout_mnk=(2, 1, 1))
        thr_s = mma_s.get_slice(tidx)
        sB = [cute.local_tile(sm.sB, (SLICE_N, BK, S), (j, 0, 0)) for j in range(BN // SLICE_N)]
        part, tCrA, tCrB0 = sm90_utils.partition_fragment_ABC(thr_s, (BLOCK_M, SLICE_N, BK), sm.sA, sB[0])
        tCrB = (tCrB0,) + tuple(thr_s.make_fragment_B(thr_s.partition_B(b)) for b in sB[1:])
        full = (mma_s, acc, tCrA, tCrB, tCcC, (part,))
        mma_h = sm90_utils.make_tiled_mma(Float8E4M3FN, "K", "K", QUANT_BLOCK, atom_layout_mnk=(1, 2, 1))
        thr_h = mma_h.get_slice(tidx)
        sA_h = cute.local_tile(sm.sA, (64, BK, S), (0, 0, 0))
        acc_h_own, tCrA_h, tCrB_h = sm90_utils.partition_fragment_ABC(thr_h, (64, BN, BK), sA_h, sm.sB)
        part_h = cute.make_rmem_tensor(acc_h_own.layout, Float32)
        half = (mma_h, cute.make_tensor(acc.iterator, acc_h_own.layout), tCrA_h, tCrB_h,
                thr_h.partition_C(cute.make_identity_tensor((64, BN))), part_h)
        return full, half

    @cute.jit
    def mma_tile_fp8(self, ab_pipe, state, ok: Boolean, gm, frags, num_k: cutlass.Constexpr, tile,
                     l1: cutlass.Constexpr, half: cutlass.Constexpr):
        """The tile's promoted sums over num_k ring stages (one 128-K block each). L1: A = pool x
        with ``mPoolXScale``, B = w1 with ``mW1Scale``; L2: A = h with ``mHScale``, B = w2 with
        ``mW2Scale``. The weights' scales of the whole tile are loaded at its start, one K block per
        lane (:meth:`weight_scale`), the rows' scales two K blocks ahead. Returns (state, time the
        first stage had landed, ok)."""
        mma, acc, tCrA, tCrB, tCcC, part = frags
        timeout = Int64(self.ring_timeout_ns)
        err = gm.mCounters.iterator + self.COUNTER_ERROR
        k_dim = self.hidden if const_expr(l1) else self.intermediate
        n_dim = 2 * self.intermediate if const_expr(l1) else self.hidden
        ks = k_dim // QUANT_BLOCK
        a_scale = gm.mPoolXScale if const_expr(l1) else gm.mHScale
        b_scale = gm.mW1Scale if const_expr(l1) else gm.mW2Scale
        r0, _ = tCcC[0]  # this thread's two rows (v1 = 0, 1)
        r1, _ = tCcC[2]
        # rows past the expert's tokens read its last row's scales (the pool ends one block later)
        # the rows as 32-bit element offsets: two registers fewer than 64-bit row pointers
        pa = Int64(a_scale.iterator.toint())
        oa0 = tile_pool_row(tile, r0, BLOCK_M) * ks
        oa1 = tile_pool_row(tile, r1, BLOCK_M) * ks
        # w1: N tile n's gate and up scales (w1_s rows 2n, 2n + 1: quant.kernel_w1_scales), applied by
        # the columns' 8-group (gate / up alternate every 8 interleaved rows), full and half tiles
        # alike; w2: the tile's two 128-column blocks, warpgroup w of a half tile holding block w
        b_block = tile.expert * (n_dim // QUANT_BLOCK) + 2 * tile.n_block
        if const_expr(half and not l1):
            b_block = b_block + cute.arch.make_warp_uniform(cute.arch.warp_idx()) // 4
        pb = Int64(b_scale.iterator.toint()) + Int64(b_block) * (ks * 4)
        # Weights need no ordering: their scales load before the first wait. (A uniform load of
        # block kt + 1's, the obvious prefetch, made ptxas move it into a uniform register right
        # away, stalling every K block on the L2 round trip at its top.)
        one_block = half and not l1  # one weight scale block per K block
        sbv0 = self.weight_scales(pb, ks)
        sbv1 = sbv0
        if const_expr(not one_block):
            sbv1 = self.weight_scales(pb + ks * 4, ks)
        acc.fill(0.0)
        # The rows' scales: none before the tile's first wait (that stage orders them after Dispatch
        # (x_ready) for an L1 tile, after the L1 epilogues (l2_full) for an L2 tile, both acquired
        # by the producer), then two K blocks ahead, and each block's scale products formed while
        # the block before it runs (loaded at use, their L2 round trip stalled every promotion; no
        # predicated loads in the loop: those wait on their registers' loads in flight).
        ok = ab_pipe.consumer_wait_bounded(state, ok, timeout, err)
        t1 = self.timestamp()
        sa0, sa1 = self.row_scales(pa, oa0, oa1, 0)
        na0, na1 = self.row_scales(pa, oa0, oa1, min(1, num_k - 1))
        c0, c1, c2, c3 = self.scale_products(sa0, sa1, sbv0, sbv1, 0, one_block)
        if const_expr(half):
            state, ok = self.half_k_pairs(ab_pipe, state, ok, timeout, err, frags, num_k, (pa, oa0, oa1), (sbv0, sbv1),
                                          (na0, na1, c0, c1, c2, c3), one_block)
            return state, t1, ok
        for kt in cutlass.range(num_k, unroll=1):
            if kt > 0:
                ok = ab_pipe.consumer_wait_bounded(state, ok, timeout, err)
            nxt = cutlass.min(kt + 1, num_k - 1)
            # one 128-column batch per weight scale block, each promoted after wait 0
            p = part[0]
            for j in cutlass.range_constexpr(len(tCrB)):
                self.take_turn()
                sm90_utils.gemm_w_idx(mma, p, tCrA, tCrB[j], True, A_idx=state.index, B_idx=state.index,
                                      wg_wait=-1)
                self.pass_turn()
                if const_expr(j == 0):
                    d0, d1, d2, d3 = self.scale_products(na0, na1, sbv0, sbv1, nxt, one_block)
                    na0, na1 = self.row_scales(pa, oa0, oa1, cutlass.min(kt + 2, num_k - 1))
                warpgroup.wait_group(0)
                if const_expr(l1 or j == 0):
                    self.promote(acc, p, j * cute.size(p), c0, c1, c2, c3, l1)
                else:
                    self.promote(acc, p, j * cute.size(p), c2, c3, c2, c3, False)
            ab_pipe.consumer_release(state)
            state.advance()
            c0, c1, c2, c3 = d0, d1, d2, d3
        return state, t1, ok

    @cute.jit
    def consumers_start(self):
        """``consumer_turns``: warpgroup 1 hands warpgroup 0 the first turn. From then on each full
        tile batch of one warpgroup waits for the other's previous batch to be issued (FA4's warp
        scheduler barriers), so the two alternate and one promotes while the other's WGMMAs run.
        Both walk the same tiles with two batches per K block of a full tile and none elsewhere, so
        the turns stay paired; one arrive is left pending at the end."""
        if const_expr(self.config.consumer_turns):
            if cute.arch.make_warp_uniform(cute.arch.warp_idx()) // 4 == 1:
                cute.arch.barrier_arrive(barrier_id=int(self.NamedBarrier.ConsumerTurn0),
                                         number_of_threads=self.num_mma_threads)

    @cute.jit
    def take_turn(self):
        if const_expr(self.config.consumer_turns):
            wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) // 4
            cute.arch.barrier(barrier_id=int(self.NamedBarrier.ConsumerTurn0) + wg,
                              number_of_threads=self.num_mma_threads)

    @cute.jit
    def pass_turn(self):
        if const_expr(self.config.consumer_turns):
            wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) // 4
            cute.arch.barrier_arrive(barrier_id=int(self.NamedBarrier.ConsumerTurn1) - wg,
                                     number_of_threads=self.num_mma_threads)

    @cute.jit
    def half_k_pairs(self, ab_pipe, state, ok: Boolean, timeout, err, frags, num_k: cutlass.Constexpr, rows, weights,
                     ahead, one_block: cutlass.Constexpr):
        """A 64-row half tile's K loop, two K blocks per iteration (its first stage already waited
        for): block kt + 1's batch is issued before block kt's promotion, so the tensor pipe works
        while the sums are scaled (one batch and then its promotion left it idle for most of each
        stage at decode batches, where every tile is a half tile). The second fragment is the upper
        64 registers of the full tile's sums, which a half tile does not use; the promotion order is
        unchanged, so the sums are bitwise the one-block loop's. (A batch left in flight across the
        back edge made ptxas serialize every WGMMA: C7514.) ``rows``: :meth:`row_scales`' (base,
        offset 0, offset 1); ``weights``: the two :meth:`weight_scales`; ``ahead``: block 1's row
        scales and block 0's scale products, as :meth:`mma_tile_fp8` leaves them."""
        mma, acc, tCrA, tCrB, _, part = frags
        pa, oa0, oa1 = rows
        sbv0, sbv1 = weights
        na0, na1, c0, c1, c2, c3 = ahead
        part_b = cute.make_tensor(acc.iterator + cute.size(part), part.layout)
        l1 = not one_block
        for kp in cutlass.range(num_k // 2, unroll=1):
            kt = 2 * kp
            if kp > 0:
                ok = ab_pipe.consumer_wait_bounded(state, ok, timeout, err)
            sm90_utils.gemm_w_idx(mma, part, tCrA, tCrB, True, A_idx=state.index, B_idx=state.index, wg_wait=-1)
            d0, d1, d2, d3 = self.scale_products(na0, na1, sbv0, sbv1, kt + 1, one_block)
            na0, na1 = self.row_scales(pa, oa0, oa1, cutlass.min(kt + 2, num_k - 1))
            second = state.clone()
            second.advance()
            ok = ab_pipe.consumer_wait_bounded(second, ok, timeout, err)
            sm90_utils.gemm_w_idx(mma, part_b, tCrA, tCrB, True, A_idx=second.index, B_idx=second.index,
                                  wg_wait=-1)
            warpgroup.wait_group(1)
            self.promote(acc, part, 0, c0, c1, c2, c3, l1)
            ab_pipe.consumer_release(state)
            c0, c1, c2, c3 = self.scale_products(na0, na1, sbv0, sbv1, cutlass.min(kt + 2, num_k - 1), one_block)
            na0, na1 = self.row_scales(pa, oa0, oa1, cutlass.min(kt + 3, num_k - 1))
            warpgroup.wait_group(0)
            self.promote(acc, part_b, 0, d0, d1, d2, d3, l1)
            ab_pipe.consumer_release(second)
            state.advance()
            state.advance()
        if const_expr(num_k % 2 == 1):  # the last block alone
            if const_expr(num_k > 1):
                ok = ab_pipe.consumer_wait_bounded(state, ok, timeout, err)
            sm90_utils.gemm_w_idx(mma, part, tCrA, tCrB, True, A_idx=state.index, B_idx=state.index, wg_wait=0)
            self.promote(acc, part, 0, c0, c1, c2, c3, l1)
            ab_pipe.consumer_release(state)
            state.advance()
        return state, ok

    @cute.jit
    def scale_products(self, sa0, sa1, sbv0, sbv1, kt: Int32, one_block: cutlass.Constexpr):
        """K block ``kt``'s promotion factors: (row 0, row 1) x the first weight scale block, then
        (unless ``one_block``) x the second."""
        sb0 = self.weight_scale(sbv0, kt)
        if const_expr(one_block):
            return sa0 * sb0, sa1 * sb0, sa0 * sb0, sa1 * sb0
        sb1 = self.weight_scale(sbv1, kt)
        return sa0 * sb0, sa1 * sb0, sa0 * sb1, sa1 * sb1

    @cute.jit
    def row_scales(self, pa, oa0, oa1, kt: Int32):
        """K block ``kt``'s scales of this thread's two A rows (element offsets ``oa0``, ``oa1``)."""
        return xdev.load_f32_cg(pa + Int64(oa0 + kt) * 4), xdev.load_f32_cg(pa + Int64(oa1 + kt) * 4)

    @cute.jit
    def weight_scales(self, pb, ks: cutlass.Constexpr):
        """One weight scale block's ``ks`` K-block scales, K block 32 j + lane in register j (the
        last lanes repeat the last block)."""
        lane = cute.arch.lane_idx()
        return [xdev.load_f32_cg(pb + cutlass.min(32 * j + lane, ks - 1) * 4) for j in range((ks + 31) // 32)]

    @cute.jit
    def weight_scale(self, regs, kt: Int32):
        """K block ``kt``'s weight scale from :meth:`weight_scales`' registers (a warp shuffle)."""
        v = regs[0]
        for j in cutlass.range_constexpr(1, len(regs)):
            if kt >= 32 * j:
                v = regs[j]
        return cute.arch.shuffle_sync(v, kt % 32)

    @cute.jit
    def promote(self, acc, part, offset: cutlass.Constexpr, c0: Float32, c1: Float32, c2: Float32, c3: Float32,
                by_group: cutlass.Constexpr):
        """``acc[offset + i] += part[i] * c`` with ``c`` the scale product of element i's row (v1 =
        (i // 2) % 2 of the (2, 2, N/8) fragment: row r or r + 8), c0 / c1; with ``by_group`` (w1)
        c2 / c3 where element i's 8-column group (i // 4, every slice starts at an even group) is odd,
        an up column."""
        for i in cutlass.range_constexpr(cute.size(part)):
            up = by_group and (i // 4) % 2 == 1
            acc[offset + i] = acc[offset + i] + part[i] * (c0, c1, c2, c3)[(i // 2) % 2 + 2 * up]

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
