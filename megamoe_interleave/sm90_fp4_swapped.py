"""The W4A8 kernel's swapped half tiles, :class:`SwappedHalfTileMixin` (docs/w4a8.md, "The swapped RS half tile"):
an m-block with at most 16 or 32 valid rows runs weights x tokens. Per consumer warpgroup two ``m64nNk32`` RS
WGMMAs (N = 16 or 32 tokens) over its 128 of the tile's 256 weight rows: each thread widens its A fragment straight
from the ring's packed stage (codes in :func:`~.quant_fp4.kernel_codes` order), so there is no widened copy, fence
or widening barrier; B is the first N rows of the ring's A stage. The sums are promoted per 128 K with a scale per
(weight row, token). Then the outputs are written transposed into the same staging tile the other tiles use.

Fragment element e = 4 j + 2 v1 + v0 holds weight row r0 + 8 v1 and token 8 j + 2 q + v0, with r0 =
:func:`fragment_row` (CuTe's layouts; tests/test_wgmma_rate.py). w1's rows interleave gate and up by 8, so a
thread's r0 is a gate row and r0 + 8 its up row: SwiGLU is in-thread, and a token's h amax spans the warps.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import warpgroup
from quack import sm90_utils

from xstage import device as xdev

from .activation import swiglu_tanh
from .config import BLOCK_M, QUANT_BLOCK
from .fp4_widen import MIN_SHIFT, widen_e2m1x8
from .int_ops import select
from .scheduler import tile_pool_row

SWAP_TOKENS = (16, 32)  # the swapped forms' WGMMA N; a half tile with more rows keeps W8A8's form
E4M3_MAX = 448.0  # quant.E4M3_MAX
AMAX_FLOOR = 1e-4  # quant.AMAX_FLOOR


def fragment_row(lt):
    """The first of the two weight rows (r0, r0 + 8) of an m64 tile in thread ``lt``'s (0-127) RS A fragment."""
    return 16 * (lt // 32) + (lt % 32) // 4


def h_column(lane, warp, t):
    """The h column (of the tile's 128) of the gate row r0 that lane ``lane`` of consumer warp ``warp`` (0-7) holds in
    m-tile ``t``: w1's rows interleave gate and up by 8, so row r (r % 16 < 8) is h column r // 16 * 8 + r % 8."""
    return 8 * (4 * (2 * (warp // 4) + t) + warp % 4) + lane // 4


def y_column(lane, warp, t, v1):
    """The output column (of the tile's 256) of the weight row r0 + 8 ``v1`` the lane holds in m-tile ``t``."""
    return 128 * (warp // 4) + 64 * t + 16 * (warp % 4) + lane // 4 + 8 * v1


def column_pair(odd, mine, other, bits: int):
    """Lanes l and l ^ 4 hold neighbouring columns c (the lane with ``odd`` = (l // 4) % 2 = 0) and c + 1, each a pair
    of ``bits``-wide elements of tokens t and t + 1 (``mine``, the other lane's ``other``). The word this lane stores:
    token t + ``odd``'s elements of columns c and c + 1 (c's in the low half). Python ints or DSL Int32."""
    lo = select(odd == 1, other, mine)
    hi = select(odd == 1, mine, other)
    mask = (1 << bits) - 1
    return ((lo >> (bits * odd)) & mask) | (((hi >> (bits * odd)) & mask) << bits)


class SwappedHalfTileMixin:
    """The swapped half tiles of :class:`~.sm90_fp4.MegaMoESm90W4A8`: fragments, mainloop and staging."""

    def swapped_fragments(self, acc, tidx, sm):
        """(the two m-tiles' A fragments, then per N of SWAP_TOKENS (N, tiled MMA, tCrB over the ring's A stage,
        batch fragments, sums)): the sums and batch fragments are views of the full tile's ``acc``."""
        lt = tidx % (self.num_mma_threads // 2)
        forms = []
        frag_a = None
        for n in SWAP_TOKENS:
            mma = sm90_utils.make_tiled_mma(Float8E4M3FN, "K", "K", n, source="RS")
            thr = mma.get_slice(lt)
            tCrB = thr.make_fragment_B(thr.partition_B(cute.local_tile(sm.sA, (n, self.block_k, self.stages),
                                                                       (0, 0, 0))))
            if frag_a is None:  # A's partition does not depend on N
                frag_a = [thr.make_fragment_A(thr.partition_shape_A((64, self.block_k))) for _ in range(2)]
            layout = cute.make_rmem_tensor(thr.partition_shape_C((64, n)), Float32).layout
            size = cute.size(layout)
            views = [cute.make_tensor(acc.iterator + i * size, layout) for i in range(4)]
            forms.append((n, mma, tCrB, views[2:], views[:2]))
        return (frag_a, *forms)

    @cute.jit
    def mma_tile_swapped(self, ab_pipe, state, ok, gm, form, frag_a, num_k: cutlass.Constexpr, tile,
                         l1: cutlass.Constexpr, sm, tidx):
        """The swapped tile's promoted sums over num_k ring stages (W8A8's scales: the rows' scales per
        token, the weights' per 128 rows). Returns (state, time the first stage had landed, ok)."""
        n, mma, tCrB, parts, sums = form
        timeout = Int64(self.ring_timeout_ns)
        err = gm.mCounters.iterator + self.COUNTER_ERROR
        ks = (self.hidden if const_expr(l1) else self.intermediate) // QUANT_BLOCK
        n_dim = 2 * self.intermediate if const_expr(l1) else self.hidden
        wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) // 4
        lt = xdev.pinned(tidx) % (self.num_mma_threads // 2)  # the addresses below are computed per tile
        q = lt % 4
        # w1: N tile n's gate scales (rows r0) and up scales (rows r0 + 8); w2: block 2 n + wg for both rows
        b_block = tile.expert * (n_dim // QUANT_BLOCK) + 2 * tile.n_block
        if const_expr(not l1):
            b_block = b_block + wg
        b_scale = gm.mW1Scale if const_expr(l1) else gm.mW2Scale
        pb = Int64(b_scale.iterator.toint()) + Int64(b_block) * (ks * 4)
        sbv0 = self.weight_scales(pb, ks)
        sbv1 = sbv0
        if const_expr(l1):
            sbv1 = self.weight_scales(pb + ks * 4, ks)
        for t in cutlass.range_constexpr(2):
            sums[t].fill(0.0)
        ok = ab_pipe.consumer_wait_bounded(state, ok, timeout, err)
        t1 = self.timestamp()
        self.stage_token_scales(sm, tidx, gm.mPoolXScale if const_expr(l1) else gm.mHScale, tile, ks, n)
        for kt in cutlass.range(num_k, unroll=1):
            if kt > 0:
                ok = ab_pipe.consumer_wait_bounded(state, ok, timeout, err)
            self.widen_fragment(sm, frag_a[0], wg, lt, 0, state.index)
            sm90_utils.gemm_w_idx(mma, parts[0], frag_a[0], tCrB, True, B_idx=state.index, wg_wait=-1)
            self.widen_fragment(sm, frag_a[1], wg, lt, 1, state.index)
            sm90_utils.gemm_w_idx(mma, parts[1], frag_a[1], tCrB, True, B_idx=state.index, wg_wait=-1)
            sb = (self.weight_scale(sbv0, kt), self.weight_scale(sbv1, kt))
            # the scale products as W8A8 forms them (row scale x weight scale), token 8 j + 2 q + v0
            c = [[sm.scratch[(8 * j + 2 * q + v0) * ks + kt] * sb[v1] for j in range(n // 8) for v0 in range(2)]
                 for v1 in range(2)]
            for t in cutlass.range_constexpr(2):
                warpgroup.wait_group(1 - t)
                for e in cutlass.range_constexpr(cute.size(parts[t])):  # e = 4 j + 2 v1 + v0
                    sums[t][e] = sums[t][e] + parts[t][e] * c[(e // 2) % 2][2 * (e // 4) + e % 2]
            ab_pipe.consumer_release(state)
            state.advance()
        return state, t1, ok

    @cute.jit
    def stage_token_scales(self, sm, tidx, a_scale, tile, ks: cutlass.Constexpr, n: cutlass.Constexpr):
        """The tile's first ``n`` rows' ``ks`` scales into ``sm.scratch`` (token-major; all loads issued before the
        16-byte stores), then the consumers meet. Called after the tile's first ring wait, which orders them after
        Dispatch or the L1 epilogues. The widened buffers under ``scratch`` are idle in a swapped tile: both
        warpgroups finished the tile before (its staging tile's EMPTY barrier), and no tile after it widens
        before both have left this one's mainloop."""
        per, chunks = self.num_mma_threads, n * ks // 4  # 16-byte chunks of the n x ks words (n % 4 == 0)
        base = Int64(a_scale.iterator.toint())
        vals = []
        for it in cutlass.range_constexpr((chunks + per - 1) // per):
            i = cutlass.min(tidx + it * per, chunks - 1)
            v = cute.make_rmem_tensor((4,), Float32)
            for k in cutlass.range_constexpr(4):
                f = 4 * i + k  # word f: token f // ks, K block f % ks
                v[k] = xdev.load_f32_cg(base + (Int64(tile_pool_row(tile, f // ks, BLOCK_M)) * ks + f % ks) * 4)
            vals.append(cute.recast_tensor(v, Int32))
        dst = Int32(sm.scratch.iterator.toint())
        for it in cutlass.range_constexpr((chunks + per - 1) // per):
            if tidx + it * per < chunks:
                w = vals[it]
                xdev.store_shared_v4(dst + (tidx + it * per) * 16, w[0], w[1], w[2], w[3])
        cute.arch.barrier(barrier_id=int(self.NamedBarrier.Consumers), number_of_threads=self.num_mma_threads)

    @cute.jit
    def widen_fragment(self, sm, frag, wg, lt, t: cutlass.Constexpr, stage):
        """Weight m-tile ``t`` of warpgroup ``wg`` widened into this thread's RS A fragment: per row (r0, r0 + 8)
        and 32-group, word q of the codes (K 4q..4q+3 and 16+4q.., :func:`~.quant_fp4.kernel_codes`) from the
        packed stage as the TMA leaves it (64-byte swizzle), its group's table, one :func:`widen_e2m1x8`."""
        packed_k = self.b_ring_k
        r0 = 128 * wg + fragment_row(lt)
        # rows r0 + 64 t + 8 h share r0's 64-byte swizzle ((row / 2) % 4): one address, compile-time offsets
        swz = ((r0 >> 1) & 3) << 4
        src = Int32(sm.sB.iterator.toint()) + stage * (self.block_n * packed_k) + r0 * packed_k + 4 * (lt % 4)
        words = cute.recast_tensor(frag, Int32)
        for h in cutlass.range_constexpr(2):
            row_offset = 64 * t + 8 * h
            word_sh = sm.shifts[0, r0 + row_offset, stage]
            for g in cutlass.range_constexpr(4):
                codes = xdev.load_shared_b32(src + row_offset * packed_k + ((16 * g) ^ swz))
                tb = sm.tables[((word_sh << (24 - 8 * g)) >> 24) - MIN_SHIFT]
                lo, hi = widen_e2m1x8(codes, (Int32(tb), Int32(tb >> 32)))
                words[4 * g + h] = lo  # the fragment's word order (tests/test_wgmma_rate.py)
                words[4 * g + 2 + h] = hi

    @cute.jit
    def stage_swapped(self, form, sm, tidx, swiglu_l1: cutlass.Constexpr, part: cutlass.Constexpr):
        """The swapped tile's outputs into the staging tile: L1 the E4M3 h rows and their scales, L2 bf16 (with
        two handoffs warpgroup ``part`` stages its 128 columns)."""
        if const_expr(swiglu_l1):
            self.stage_h_swapped(form, sm, tidx)
        else:
            if const_expr(self.l2_handoffs == 1):
                self.stage_y_swapped(form, sm, tidx, 0)
            else:
                if cute.arch.make_warp_uniform(cute.arch.warp_idx()) // 4 == part:
                    self.stage_y_swapped(form, sm, tidx, part * (self.block_n // 2))

    @cute.jit
    def stage_h_swapped(self, form, sm, tidx):
        """h = SwiGLU(gate, up) x routing weight per (h column, token); a token's amax over the tile's 128 h
        columns (the thread's two m-tiles, the 8 lanes of its q, then the 8 warps through ``amax_x``); its scale
        ``max(amax, 1e-4) / 448`` and the E4M3 bytes ``e4m3(h * (1 / s))``, stored two h columns at a time
        (lanes l and l ^ 4 hold neighbouring columns) at (token, h column) of the staging tile."""
        n, _, _, _, sums = form
        lane = xdev.pinned(cute.arch.lane_idx())  # the addresses below are computed here, per tile
        q = lane % 4
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())  # 0-7: warpgroup 4 wg + warp in it
        for t in cutlass.range_constexpr(2):
            for e in cutlass.range_constexpr(0, cute.size(sums[t]), 4):
                for v0 in cutlass.range_constexpr(2):
                    w = sm.row_w[8 * (e // 4) + 2 * q + v0]
                    sums[t][e + v0] = swiglu_tanh(sums[t][e + v0], sums[t][e + 2 + v0]) * w
        inv = cute.make_rmem_tensor((n // 4,), Float32)
        for i in cutlass.range_constexpr(n // 4):  # token 8 (i // 2) + 2 q + i % 2: element 4 (i // 2) + i % 2
            e = 4 * (i // 2) + i % 2
            m = cute.arch.fmax(cute.absf(sums[0][e]), cute.absf(sums[1][e]))
            for off in (4, 8, 16):
                m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=off))
            if lane < 4:
                sm.amax_x[warp * n + 8 * (i // 2) + 2 * q + i % 2] = m
        cute.arch.barrier(barrier_id=int(self.NamedBarrier.Consumers), number_of_threads=self.num_mma_threads)
        for i in cutlass.range_constexpr(n // 4):
            tok = 8 * (i // 2) + 2 * q + i % 2
            m = sm.amax_x[tok]
            for wp in cutlass.range_constexpr(1, self.num_mma_threads // 32):
                m = cute.arch.fmax(m, sm.amax_x[wp * n + tok])
            scale = cute.arch.fmax(m, Float32(AMAX_FLOOR)) / Float32(E4M3_MAX)
            inv[i] = Float32(1.0) / scale
            if warp == 0 and lane < 4:
                sm.row_scale[tok] = scale
        # Token 8 j + t' has the swizzle of token t' (rows_per_line 1, 8 swizzle groups: stage_row_step), so
        # each m-tile's stores are one address plus compile-time offsets (few live registers: ptxas hoists them)
        odd = (lane // 4) % 2
        tok0 = 2 * q + odd
        for t in cutlass.range_constexpr(2):
            col = h_column(lane, warp, t) - odd  # the even column of the pair
            addr = Int32(sm.sC.iterator.toint()) + self.stage_index(tok0, col // 4) * 4 + col % 4
            for j in cutlass.range_constexpr(n // 8):
                mine = xdev.cvt_e4m3x2(sums[t][4 * j] * inv[2 * j], sums[t][4 * j + 1] * inv[2 * j + 1])
                other = cute.arch.shuffle_sync_bfly(mine, offset=4)
                pair = column_pair(odd, mine, other, 8)  # token 8 j + 2 q + odd, h columns col, col + 1
                xdev.store_shared_b16(addr + 4 * self.stage_row_step(8 * j), pair)

    @cute.jit
    def stage_y_swapped(self, form, sm, tidx, col0: cutlass.Constexpr):
        """L2: bf16 of the sums at (token, output column - ``col0``), a 32-bit word of two neighbouring columns per
        store (lanes l and l ^ 4)."""
        n, _, _, _, sums = form
        lane = xdev.pinned(cute.arch.lane_idx())  # the addresses below are computed here, per tile
        q = lane % 4
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        odd = (lane // 4) % 2
        vals = cute.make_rmem_tensor((2,), BFloat16)
        word = cute.recast_tensor(vals, Int32)
        tok0 = 2 * q + odd
        for v1 in cutlass.range_constexpr(2):
            # columns 64 t apart are 32 words, a multiple of the swizzled groups; tokens 8 j apart keep the swizzle
            col = y_column(lane, warp, 0, v1) - odd - col0  # the even column of the pair
            base = self.stage_index(tok0, col // 2)
            for t in cutlass.range_constexpr(2):
                for j in cutlass.range_constexpr(n // 8):
                    e = 4 * j + 2 * v1
                    vals[0] = BFloat16(sums[t][e])  # token 8 j + 2 q
                    vals[1] = BFloat16(sums[t][e + 1])  # token 8 j + 2 q + 1
                    mine = word[0]
                    other = cute.arch.shuffle_sync_bfly(mine, offset=4)
                    pair = column_pair(odd, mine, other, 16)  # token 8 j + 2 q + odd, columns col, col + 1
                    sm.sC[base + self.stage_row_step(8 * j) + 32 * t] = pair

    def stage_row_step(self, rows: int) -> int:
        """Staging-tile words from row m to row m + ``rows`` at the same swizzled column (``rows`` a multiple of
        8; the swapped tiles' staging relies on rows_per_line 1 and 8 swizzle groups, W4A8's staging tile)."""
        assert self.stage_words >= 32 and self.swizzle_groups == 8 and rows % 8 == 0
        return rows * self.stage_words

