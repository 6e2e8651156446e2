"""The W8A8 consumers' mainloop, :class:`Fp8ConsumerMixin` (the FP8 precision classes put it before
the BF16 kernel: ``class MegaMoESm90W8A8(Fp8ConsumerMixin, MegaMoESm90)``): FP8 WGMMA fragments,
the per-128-K promotion, the scales' loads and the half tiles' K pairs.

Promotion (DeepSeek-V3 report Section 3.3.2; DeepGEMM ``sm90_fp8_gemm_1d2d``): a ring stage is one
128-deep K block; its WGMMAs accumulate into a zeroed FP32 fragment, which is then added to the
tile's FP32 sums scaled by ``sa[row, kb] * sb[n block, kb]``, so the tensor core's limited
accumulation precision never spans more than 128 products. A 128 x 256 tile's sums take 128
registers per thread; the block's WGMMAs run in two 128-column batches (one per weight scale block
of w2; w1's gate and up scale blocks alternate every 8 columns, as its interleaved rows do) through
one 64-register fragment, each promoted after ``wait_group(0)`` (DeepGEMM's scheme). A 64-row half
tile (a warpgroup per 128 columns) runs its K blocks in pairs through two 64-register fragments, its
own and the full tile's upper sums (dead there), the second block's batch in flight while the first
is promoted.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float8E4M3FN, Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import warpgroup
from quack import sm90_utils

from xstage import device as xdev

from .config import BLOCK_M, QUANT_BLOCK
from .scheduler import tile_pool_row

SLICE_N = 128  # columns per WGMMA batch of a full tile (see the module docstring)


class Fp8ConsumerMixin:
    """The consumer warpgroups' FP8 mainloop (overrides :class:`~.sm90_mainloop.ConsumerMixin`'s
    fragments, MMA and start)."""

    # the full tiles' K loop leaner: descriptors from warp-uniform values (consumer_fragments), the next
    # block's ring wait under the last batch (mma_tile_fp8); W4A8's widening spills with either
    lean_k_loop = True
    # a full tile's warpgroups one batch apart from its first K block (stagger)
    stagger_warpgroups = True

    @cute.jit
    def stagger(self, kt, wg: cutlass.Constexpr):
        """A full tile's first K block: warpgroup 1 issues its first batch once warpgroup 0's has completed
        (``wg`` 1, before that batch; ``wg`` 0, after it), so from then on one warpgroup promotes while the
        other's batch runs (issued together, they finished together and both promoted with the tensor pipe
        idle). Once per tile: the offset lasts until the tiles' handoffs line the warpgroups up again."""
        if const_expr(self.stagger_warpgroups):
            if kt == 0:
                if cute.arch.make_warp_uniform(cute.arch.warp_idx()) // 4 == wg:
                    if const_expr(wg == 1):
                        cute.arch.barrier(barrier_id=int(self.NamedBarrier.ConsumerStagger),
                                          number_of_threads=self.num_mma_threads)
                    else:
                        cute.arch.barrier_arrive(barrier_id=int(self.NamedBarrier.ConsumerStagger),
                                                 number_of_threads=self.num_mma_threads)

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

    def consumer_fragments(self, tiled_mma, tidx, sm):
        """``(full, half)``, each (tiled_mma of a batch, promoted sums, tCrA, tCrB, tCcC, batch
        fragment). ``full``: the 128 x 256 tile's sums (``tiled_mma``'s layout, 128 registers) and
        a 128 x 128 batch MMA (a warpgroup per 64 rows), tCrB per 128-column batch. ``half``:
        64 x 256, a warpgroup per 128 columns (one batch each): the sums are the first 64 of
        ``full``'s registers, the batch fragment its own (:meth:`half_k_pairs` adds the sums' upper
        64 as a second)."""
        BN, BK, S = self.block_n, self.block_k, self.stages
        thr = tiled_mma.get_slice(tidx)
        acc = cute.make_rmem_tensor(thr.partition_shape_C((BLOCK_M, BN)), Float32)
        tCcC = thr.partition_C(cute.make_identity_tensor((BLOCK_M, BN)))
        mma_s = sm90_utils.make_tiled_mma(Float8E4M3FN, "K", "K", SLICE_N, atom_layout_mnk=(2, 1, 1))
        # The A/B descriptors depend on the warpgroup only: sliced by a warp-uniform index, ptxas
        # keeps them in uniform registers instead of rebuilding them from %tid every K block
        # (36 fewer instructions per K block; lean_k_loop).
        uniform = cute.arch.make_warp_uniform(cute.arch.warp_idx()) * 32 if const_expr(self.lean_k_loop) else tidx
        thr_s = mma_s.get_slice(uniform)
        SB = cute.size(sm.sB, mode=[2])  # B's stages: the ring's, or W4A8's widened blocks
        sB = [cute.local_tile(sm.sB, (SLICE_N, BK, SB), (j, 0, 0)) for j in range(BN // SLICE_N)]
        part, tCrA, tCrB0 = sm90_utils.partition_fragment_ABC(thr_s, (BLOCK_M, SLICE_N, BK), sm.sA, sB[0])
        tCrB = (tCrB0,) + tuple(thr_s.make_fragment_B(thr_s.partition_B(b)) for b in sB[1:])
        full = (mma_s, acc, tCrA, tCrB, tCcC, (part,))
        mma_h = sm90_utils.make_tiled_mma(Float8E4M3FN, "K", "K", QUANT_BLOCK, atom_layout_mnk=(1, 2, 1))
        thr_h = mma_h.get_slice(uniform)
        sA_h = cute.local_tile(sm.sA, (64, BK, S), (0, 0, 0))
        acc_h_own, tCrA_h, tCrB_h = sm90_utils.partition_fragment_ABC(thr_h, (64, BN, BK), sA_h, sm.sB)
        part_h = cute.make_rmem_tensor(acc_h_own.layout, Float32)
        half = (mma_h, cute.make_tensor(acc.iterator, acc_h_own.layout), tCrA_h, tCrB_h,
                mma_h.get_slice(tidx).partition_C(cute.make_identity_tensor((64, BN))), part_h)
        return full, half

    @cute.jit
    def mma_tile_fp8(self, ab_pipe, state, ok: Boolean, gm, frags, num_k: cutlass.Constexpr, tile,
                     l1: cutlass.Constexpr, half: cutlass.Constexpr):
        """The tile's promoted sums over num_k ring stages (one 128-K block each). L1: A = pool x
        with ``mPoolXScale``, B = w1 with ``mW1Scale``; L2: A = h with ``mHScale``, B = w2 with
        ``mW2Scale``. The weights' scales of the whole tile are loaded at its start, one K block per
        lane (:meth:`weight_scale`), the rows' scales two K blocks ahead. Returns (state, time the
        first stage had landed, ok)."""
        mma, acc, tCrA, tCrB, tCcC, part = frags[:6]
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
            if const_expr(not self.lean_k_loop):
                if kt > 0:
                    ok = ab_pipe.consumer_wait_bounded(state, ok, timeout, err)
            b = self.b_ready(frags, state, kt, False)
            nxt = cutlass.min(kt + 1, num_k - 1)
            # one 128-column batch per weight scale block, each promoted after wait 0
            p = part[0]
            for j in cutlass.range_constexpr(len(tCrB)):
                if const_expr(j == 0):
                    self.stagger(kt, 1)
                sm90_utils.gemm_w_idx(mma, p, tCrA, tCrB[j], True, A_idx=state.index, B_idx=b, wg_wait=-1)
                if const_expr(j == 0):
                    d0, d1, d2, d3 = self.scale_products(na0, na1, sbv0, sbv1, nxt, one_block)
                    na0, na1 = self.row_scales(pa, oa0, oa1, cutlass.min(kt + 2, num_k - 1))
                if const_expr(self.lean_k_loop and j == len(tCrB) - 1):
                    # the next block's ring wait under the last batch, not between it and the next block's
                    if kt + 1 < num_k:
                        ahead = state.clone()
                        ahead.advance()
                        ok = ab_pipe.consumer_wait_bounded(ahead, ok, timeout, err)
                warpgroup.wait_group(0)
                if const_expr(j == 0):
                    self.stagger(kt, 0)
                if const_expr(l1 or j == 0):
                    self.promote(acc, p, j * cute.size(p), c0, c1, c2, c3, l1)
                else:
                    self.promote(acc, p, j * cute.size(p), c2, c3, c2, c3, False)
            ab_pipe.consumer_release(state)
            state.advance()
            c0, c1, c2, c3 = d0, d1, d2, d3
        return state, t1, ok

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
        mma, acc, tCrA, tCrB, _, part = frags[:6]
        pa, oa0, oa1 = rows
        sbv0, sbv1 = weights
        na0, na1, c0, c1, c2, c3 = ahead
        part_b = cute.make_tensor(acc.iterator + cute.size(part), part.layout)
        l1 = not one_block
        for kp in cutlass.range(num_k // 2, unroll=1):
            kt = 2 * kp
            if kp > 0:
                ok = ab_pipe.consumer_wait_bounded(state, ok, timeout, err)
            self.b_free()
            b = self.b_ready(frags, state, 0, True)
            sm90_utils.gemm_w_idx(mma, part, tCrA, tCrB, True, A_idx=state.index, B_idx=b, wg_wait=-1)
            d0, d1, d2, d3 = self.scale_products(na0, na1, sbv0, sbv1, kt + 1, one_block)
            na0, na1 = self.row_scales(pa, oa0, oa1, cutlass.min(kt + 2, num_k - 1))
            second = state.clone()
            second.advance()
            ok = ab_pipe.consumer_wait_bounded(second, ok, timeout, err)
            b = self.b_ready(frags, second, 1, True)
            sm90_utils.gemm_w_idx(mma, part_b, tCrA, tCrB, True, A_idx=second.index, B_idx=b, wg_wait=-1)
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
            self.b_free()
            b = self.b_ready(frags, state, 0, True)
            sm90_utils.gemm_w_idx(mma, part, tCrA, tCrB, True, A_idx=state.index, B_idx=b, wg_wait=0)
            self.promote(acc, part, 0, c0, c1, c2, c3, l1)
            ab_pipe.consumer_release(state)
            state.advance()
        return state, ok

    def b_ready(self, frags, state, kt, half: bool):
        """The B operand of K block ``kt`` (half tiles: 0 / 1 within a pair) at ring ``state``, ready for
        the WGMMAs: its stage index (W4A8 widens it first, :class:`~.sm90_fp4.MegaMoESm90W4A8`)."""
        return state.index

    def b_free(self):
        """Before a half tile's K pair: the pair before it has no WGMMA in flight (W4A8: a barrier)."""

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
