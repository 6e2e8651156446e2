"""Mainloop roles of :class:`~megamoe_interleave.kernel_sm90.MegaMoESm90`: the TMA producer warp
and the two WGMMA consumer warpgroups, meeting at a ``stages``-deep shared-memory ring of A/B
tiles guarded by full/empty mbarriers (quack ``PipelineTmaAsync`` with bounded waits).

The ring's waits are bounded and stay in step after a timeout
(:class:`xstage.pipeline.BoundedPipelineTmaAsync`). The CTA pair of a scheduler row (a 2-CTA
cluster) splits the row along M: both CTAs need the same B tile (the expert's weights), so each
loads half of it and multicasts it into both CTAs' stage; A (each CTA's own rows) is a plain TMA
load. With ``pair_split="n"`` the roles of A and B swap in the rows of <= 128 rows (the producer
picks the atoms per tile). Consumers release a stage on both CTAs' empty barriers. After the
mainloop the consumers stage the tile's bf16 output (L1: SwiGLU x routing weight in registers)
for the epilogue warps and go on with the next tile.
"""
from __future__ import annotations

from functools import partial

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.pipeline import Agent, CooperativeGroup, PipelineUserType
from quack import sm90_utils
from quack.pipeline import make_pipeline_state

from xstage import device as xdev
from xstage.pipeline import BoundedPipelineTmaAsync

from .config import BLOCK_K, BLOCK_M
from .activation import swiglu_tanh
from .scheduler import PHASE_L1, l1_tiles_of_row, row_splits_n


class ProducerMixin:
    """The TMA producer warp: this CTA's tiles in schedule order, each tile's K blocks into the ring."""

    def make_ab_pipeline(self, mbar_ptr):
        """The ring: the producer's arrive carries one stage's TMA bytes (A + B, whichever CTA of the
        pair loaded each half of B); one release arrive per consumer warp and per CTA of the pair."""
        return BoundedPipelineTmaAsync.create(
            barrier_storage=mbar_ptr,
            num_stages=self.stages,
            producer_group=CooperativeGroup(Agent.Thread),
            consumer_group=CooperativeGroup(Agent.Thread, 2 * (self.num_mma_threads // 32)),
            tx_count=self.stage_tx_bytes(),
            cta_layout_vmnk=cute.make_layout((1, 1, 2, 1)),
        )

    def stage_tx_bytes(self) -> int:
        """Bytes one ring stage receives (A, and B from both CTAs of the pair)."""
        return self.block_k * (BLOCK_M + self.block_n) * self.ab_bytes

    def make_tma_atoms(self, mPoolX, mH, mW1, mW2, n_split: bool = False):
        """TMA atoms + coordinate tensors of the four GEMM operands, each a compact row-major 2-D
        view: L1 A = dispatched rows (n_pad, H), L1 B = every local expert's w1 rows (E_l * 2I, H),
        L2 A = h (n_pad, I), L2 B = (E_l * H, I); the operand the pair shares multicast (B, or for
        the tiles of a row split along N, ``n_split``, A). (B's columns are its ring tile's:
        ``b_tile_k`` per ``block_k`` of K.)"""
        H, I2, I = self.hidden, 2 * self.intermediate, self.intermediate
        n_pad = cute.size(mPoolX, mode=[0])
        n_exp = cute.size(mW1, mode=[0])
        bk = self.b_ring_k
        views = (
            (mPoolX, (n_pad, H), self.sA_layout, (BLOCK_M, self.block_k)),
            (mW1, (n_exp * I2, H * bk // self.block_k), self.sB_layout, (self.block_n, bk)),
            (mH, (n_pad, I), self.sA_layout, (BLOCK_M, self.block_k)),
            (mW2, (n_exp * H, I * bk // self.block_k), self.sB_layout, (self.block_n, bk)),
        )
        out = []
        for i, (t, shape, smem_layout, box) in enumerate(views):
            compact = cute.make_tensor(t.iterator, cute.make_layout(shape, stride=(shape[1], 1)))
            mcast = i % 2 == int(not n_split)  # B (odd views) where the pair splits M
            atom, coords = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SMulticastOp() if mcast else cpasync.CopyBulkTensorTileG2SOp(),
                compact, cute.slice_(smem_layout, (None, None, 0)), box, num_multicast=2 if mcast else 1)
            out += [atom, coords]
        return tuple(out)

    @cute.jit
    def producer_tiles(self, ctx, gm, sm, ops, ab_pipe):
        """Per tile (L1: after the rows are dispatched; L2: after a bounded acquire wait on the row's
        L1 counter) the K blocks' TMA loads. After a failed dependency wait this lane waits on no row
        counter, but its ring waits still keep step with the consumers of both CTAs."""
        cute.arch.fence_proxy("async.global")  # dispatched rows: generic stores -> TMA reads
        # (ok, rows [0, rows_ok) known dispatched, ring state)
        ok, _, state = self.walk_tiles(ctx, partial(self.producer_tile, ctx, gm, sm, ops, ab_pipe), lambda: (
            Boolean(True), Int32(0), make_pipeline_state(PipelineUserType.Producer, self.stages)))
        # Every stage consumed by both CTAs: every load bound for this CTA has landed.
        ab_pipe.producer_tail_bounded(state, ok, Int64(self.ring_timeout_ns),
                                      gm.mCounters.iterator + self.COUNTER_ERROR)

    @cute.jit
    def producer_tile(self, ctx, gm, sm, ops, ab_pipe, tile, carry):
        ok, rows_ok, state = carry
        e = tile.expert
        a_row0 = tile.tok0 + tile.m_block * BLOCK_M
        if tile.phase == PHASE_L1:
            rows_ok, ok = self.wait_dispatched(tile.row, rows_ok, ok, ctx, gm)
            state, ok = self.load_split_tile(ab_pipe, state, ok, gm, ops, tile, ctx.grid, True,
                                             (a_row0, e * (2 * self.intermediate) + tile.n_block * self.block_n),
                                             self.hidden // self.block_k, sm)
        else:
            # Every lane acquires (the TMA issue lane is elected inside cute.copy).
            if ok:
                ok = xdev.spin_wait_ge(gm.mCounters.iterator + self.COUNTER_L2_FULL + tile.row,
                                       Int32(l1_tiles_of_row(ctx.grid, tile.m_block // 2, tile.count)),
                                       ctx.timeout, gm.mCounters.iterator + self.COUNTER_ERROR,
                                       self.ERR_DEPENDENCY_TIMEOUT, True, "gpu")
            cute.arch.sync_warp()
            cute.arch.fence_proxy("async.global")  # h: other CTAs' generic stores -> TMA reads
            state, ok = self.load_split_tile(ab_pipe, state, ok, gm, ops, tile, ctx.grid, False,
                                             (a_row0, e * self.hidden + tile.n_block * self.block_n),
                                             self.intermediate // self.block_k, sm)
        return ok, rows_ok, state

    @cute.jit
    def wait_dispatched(self, row: Int32, rows_ok: Int32, ok: Boolean, ctx, gm):
        """Before an L1 tile's loads: unless ``row`` < ``rows_ok``, one acquire load of the last
        row's word (once it is published every row is; lane 0's value decides, so the branch is
        warp-uniform), else a bounded acquire spin on ``x_ready[row]``; then the proxy fence."""
        ready = gm.mCounters.iterator + self.COUNTER_L2_FULL + ctx.grid.num_rows
        if row >= rows_ok:
            last = xdev.load_acquire(ready + (ctx.grid.num_rows - 1), "gpu")
            if cute.arch.shuffle_sync(last, 0) >= ctx.nctas:
                rows_ok = ctx.grid.num_rows
            else:
                if ok:
                    ok = xdev.spin_wait_ge(ready + row, ctx.nctas, ctx.timeout, gm.mCounters.iterator + self.COUNTER_ERROR,
                                           self.ERR_DEPENDENCY_TIMEOUT, True, "gpu")
                rows_ok = row + 1
            cute.arch.sync_warp()
            cute.arch.fence_proxy("async.global")
        return rows_ok, ok

    def stage_extras(self, ops, tile, l1: bool, sm):
        """What a precision loads into each ring stage besides A and B (W4A8: the shift words)."""
        return ()

    @cute.jit
    def load_split_tile(self, ab_pipe, state, ok: Boolean, gm, ops, tile, grid, l1: cutlass.Constexpr, rows,
                        num_k: cutlass.Constexpr, sm):
        """:meth:`load_tile` of an L1 or L2 tile with the atoms of its row's split: B shared, or, in a
        row split along N (``pair_split="n"``, :func:`~.scheduler.row_splits_n`), A."""
        atoms = (ops.tma_a1, ops.mA1, ops.tma_b1, ops.mB1) if l1 else (ops.tma_a2, ops.mA2, ops.tma_b2, ops.mB2)
        extras = self.stage_extras(ops, tile, l1, sm)
        if const_expr(self.row_split_n):
            if row_splits_n(grid, tile.m_block // 2, tile.count):
                atoms_n = (ops.tma_a1_n, ops.mA1_n, ops.tma_b1_n, ops.mB1_n) if l1 else (
                    ops.tma_a2_n, ops.mA2_n, ops.tma_b2_n, ops.mB2_n)
                state, ok = self.load_tile(ab_pipe, state, ok, gm, atoms_n, rows, num_k, sm, extras, True)
            else:
                state, ok = self.load_tile(ab_pipe, state, ok, gm, atoms, rows, num_k, sm, extras, False)
        else:
            state, ok = self.load_tile(ab_pipe, state, ok, gm, atoms, rows, num_k, sm, extras, False)
        return state, ok

    @cute.jit
    def load_tile(self, ab_pipe, state, ok: Boolean, gm, atoms, rows, num_k: cutlass.Constexpr, sm, extras,
                  a_shared: cutlass.Constexpr):
        """TMA loads of a tile's K blocks (``atoms``: A's and B's TMA atom and coordinates): A rows
        [a_row0, +BM), B rows [b_row0, +BN) (``rows``; our half of the shared operand multicast into
        both CTAs' stage: B, or A if ``a_shared``), and a precision's ``extras`` (:meth:`load_extras`).
        Returns (state, ok)."""
        tma_a, mA, tma_b, mB = atoms
        a_row0, b_row0 = rows
        gA = cute.local_tile(cute.domain_offset((a_row0, 0), mA), (BLOCK_M, self.block_k), (0, None))
        gB = cute.local_tile(cute.domain_offset((b_row0, 0), mB), (self.block_n, self.b_ring_k), (0, None))
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        a_rank, a_ctas, b_rank, b_ctas = 0, 1, rank, 2  # the multicast operand: each CTA loads its half
        if const_expr(a_shared):
            a_rank, a_ctas, b_rank, b_ctas = rank, 2, 0, 1
        tAsA, tAgA = cpasync.tma_partition(tma_a, a_rank, cute.make_layout(a_ctas), cute.group_modes(sm.sA, 0, 2),
                                           cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cpasync.tma_partition(tma_b, b_rank, cute.make_layout(b_ctas), cute.group_modes(sm.sB, 0, 2),
                                           cute.group_modes(gB, 0, 2))
        for kt in cutlass.range(num_k, unroll=1):
            ok = ab_pipe.producer_acquire_bounded(state, ok, Int64(self.ring_timeout_ns),
                                                  gm.mCounters.iterator + self.COUNTER_ERROR)
            bar = ab_pipe.producer_get_barrier(state)
            if const_expr(not a_shared):
                cute.copy(tma_a, tAgA[None, kt], tAsA[None, state.index], tma_bar_ptr=bar)
                cute.copy(tma_b, tBgB[None, kt], tBsB[None, state.index], tma_bar_ptr=bar,
                          mcast_mask=cutlass.Int16(0b11))
            else:
                cute.copy(tma_a, tAgA[None, kt], tAsA[None, state.index], tma_bar_ptr=bar,
                          mcast_mask=cutlass.Int16(0b11))
                cute.copy(tma_b, tBgB[None, kt], tBsB[None, state.index], tma_bar_ptr=bar)
            if const_expr(len(extras) > 0):
                self.load_extras(extras, sm, kt, state.index, bar)
            ab_pipe.producer_commit(state)
            state.advance()
        return state, ok


class ConsumerMixin:
    """The consumer warpgroups: WGMMA over the ring, then the output staged for the epilogue warps."""

    @cute.jit
    def consumer_tiles(self, ctx, tidx: Int32, gm, sm, ab_pipe, tiled_mma):
        """Per tile: the mainloop (accumulators in registers), then wait until the staging tile is
        free (EMPTY), write the bf16 output into it, arrive on FULL and go to the next tile while
        the epilogue warps store it. The next tile's schedule step (its row-record load) is issued
        one tile ahead, so its latency does not sit between tiles."""
        frags = self.consumer_fragments(tiled_mma, tidx, sm)
        # (ring state, ok, traced tiles)
        self.walk_tiles(ctx, partial(self.consumer_tile, ctx, tidx, gm, sm, ab_pipe, frags), lambda: (
            make_pipeline_state(PipelineUserType.Consumer, self.stages), Boolean(True), Int32(0)), True)

    @cute.jit
    def consumer_tile(self, ctx, tidx: Int32, gm, sm, ab_pipe, frags, tile, carry):
        state, ok, n_tile = carry
        t0 = self.timestamp()
        k0 = self.cycle_stamp()
        # an m-block with <= 64 valid rows (an expert's last) runs as a 64 x BN tile, N split
        # over the two warpgroups: half the WGMMA work from the same ring stages
        half = tile.count - tile.m_block * BLOCK_M <= 64
        t1 = Int64(0)
        t2 = Int64(0)
        k2 = Int64(0)
        t_slot = Int64(0)
        if tile.phase == PHASE_L1:
            state, t1, ok = self.tile_mma(ab_pipe, state, ok, gm, frags, half, self.hidden // self.block_k,
                                          tile, True)
            t2 = self.timestamp()
            k2 = self.cycle_stamp()
            t_slot = self.hand_off(frags, half, sm, True, 0)
        else:
            state, t1, ok = self.tile_mma(ab_pipe, state, ok, gm, frags, half,
                                          self.intermediate // self.block_k, tile, False)
            t2 = self.timestamp()
            k2 = self.cycle_stamp()
            for part in cutlass.range_constexpr(self.l2_handoffs):
                t_part = self.hand_off(frags, half, sm, False, part)
                if const_expr(part == 0):
                    t_slot = t_part
        if const_expr(self.trace):
            self.record_trace(gm.mTrace, ctx.cta, n_tile, tidx, tile,
                              (t0, t1, t2, xdev.globaltimer_ns(), Int64(xdev.smid()), k2 - k0, t_slot))
        n_tile = n_tile + 1
        return state, ok, n_tile

    def consumer_fragments(self, tiled_mma, tidx, sm):
        """This thread's WGMMA fragments ``(full, half)``, each (tiled_mma, acc, tCrA, tCrB, tCcC):
        ``full`` for the BLOCK_M x BN tile (one warpgroup per 64 rows), ``half`` for the 64 x BN tile
        of the ring stages' first 64 A rows (one warpgroup per BN/2 columns). The half tile's
        accumulator is, at BN = 256, a view of the first half of ``acc``'s registers (its own would
        not fit the consumers' budget), else its own registers (ptxas serialized every WGMMA when the
        64 x 64 half tiles of BN = 128 accumulated into such a view: C7511)."""
        BN = self.block_n
        thr_mma = tiled_mma.get_slice(tidx)
        acc, tCrA, tCrB = sm90_utils.partition_fragment_ABC(thr_mma, (BLOCK_M, BN, BLOCK_K), sm.sA, sm.sB)
        full = (tiled_mma, acc, tCrA, tCrB, thr_mma.partition_C(cute.make_identity_tensor((BLOCK_M, BN))))
        tiled_mma_h = sm90_utils.make_tiled_mma(BFloat16, "K", "K", BN // 2, atom_layout_mnk=(1, 2, 1))
        thr_mma_h = tiled_mma_h.get_slice(tidx)
        sA_h = cute.local_tile(sm.sA, (64, BLOCK_K, self.stages), (0, 0, 0))
        acc_h_own, tCrA_h, tCrB_h = sm90_utils.partition_fragment_ABC(thr_mma_h, (64, BN, BLOCK_K), sA_h, sm.sB)
        acc_h = cute.make_tensor(acc.iterator, acc_h_own.layout) if BN == 256 else acc_h_own
        half = (tiled_mma_h, acc_h, tCrA_h, tCrB_h, thr_mma_h.partition_C(cute.make_identity_tensor((64, BN))))
        return full, half

    @cute.jit
    def tile_mma(self, ab_pipe, state, ok: Boolean, gm, frags, half: Boolean, num_k: cutlass.Constexpr, tile,
                 l1: cutlass.Constexpr):
        """:meth:`mma_tile` with the full or (``half``) the 64-row fragments (a precision class
        overrides it: W8A8 also reads ``tile``'s scales)."""
        full_f, half_f = frags
        t1 = Int64(0)
        if half:
            state, t1, ok = self.mma_tile(ab_pipe, state, ok, gm, half_f, num_k)
        else:
            state, t1, ok = self.mma_tile(ab_pipe, state, ok, gm, full_f, num_k)
        return state, t1, ok

    @cute.jit
    def mma_tile(self, ab_pipe, state, ok: Boolean, gm, frags, num_k: cutlass.Constexpr):
        """acc = A_tile @ B_tile^T over num_k ring stages (as quack GemmSm90.mma: one WGMMA batch in
        flight; stage k-1 released once batch k is issued and k-1 retired). Returns (state, time
        the first stage had landed, ok)."""
        tiled_mma, acc, tCrA, tCrB, _ = frags
        timeout = Int64(self.ring_timeout_ns)
        err = gm.mCounters.iterator + self.COUNTER_ERROR
        release = state.clone()
        ok = ab_pipe.consumer_wait_bounded(state, ok, timeout, err)
        t1 = self.timestamp()
        sm90_utils.gemm_w_idx(tiled_mma, acc, tCrA, tCrB, True, A_idx=state.index, B_idx=state.index, wg_wait=-1)
        state.advance()
        for kt in cutlass.range(1, num_k, unroll=1):
            ok = ab_pipe.consumer_wait_bounded(state, ok, timeout, err)
            sm90_utils.gemm_w_idx(tiled_mma, acc, tCrA, tCrB, False, A_idx=state.index, B_idx=state.index,
                                  wg_wait=1)
            ab_pipe.consumer_release(release)
            release.advance()
            state.advance()
        warpgroup.wait_group(0)
        ab_pipe.consumer_release(release)
        return state, t1, ok

    @cute.jit
    def hand_off(self, frags, half: Boolean, sm, swiglu_l1: cutlass.Constexpr, part: cutlass.Constexpr):
        """Wait until the staging tile is free (EMPTY), stage the output (L1: all BN/2 h columns;
        L2: part ``part`` of l2_handoffs of the BN columns), arrive on FULL. Returns when the slot
        was free (tracing; else a constant)."""
        cute.arch.barrier(barrier_id=int(self.NamedBarrier.EpilogueEmpty), number_of_threads=self.handoff_threads)
        t_slot = self.barrier_timestamp(sm)
        self.stage_output(frags, half, sm, swiglu_l1, part)
        cute.arch.barrier_arrive(barrier_id=int(self.NamedBarrier.EpilogueFull), number_of_threads=self.handoff_threads)
        return t_slot

    @cute.jit
    def stage_output(self, frags, half: Boolean, sm, swiglu_l1: cutlass.Constexpr, part: cutlass.Constexpr):
        """The accumulators of the full or (``half``) the 64-row fragments into the staging tile.
        L1: all h columns. L2: all BN columns, or with two handoffs columns [part, part + 1) * BN/2:
        of the full fragment its elements [part, part + 1) * size/2 (each warpgroup holds all BN
        columns of its 64 rows), of the 64-row fragments warpgroup ``part``'s (each holds BN/2
        columns of all 64 rows)."""
        full_f, half_f = frags
        size = cute.size(full_f[1])
        parts = 1 if swiglu_l1 else self.l2_handoffs
        lo = part * (size // parts)
        hi = (part + 1) * (size // parts)
        col0 = part * (self.block_n // parts)
        if half:
            size_h = cute.size(half_f[1])
            if const_expr(parts == 1):
                self.stage_fragment(half_f[1], half_f[4], sm, swiglu_l1, 0, size_h, 0)
            else:
                if cute.arch.make_warp_uniform(cute.arch.warp_idx()) // 4 == part:
                    self.stage_fragment(half_f[1], half_f[4], sm, False, 0, size_h, col0)
        else:
            self.stage_fragment(full_f[1], full_f[4], sm, swiglu_l1, lo, hi, col0)

    @cute.jit
    def stage_fragment(self, acc, tCcC, sm, swiglu_l1: cutlass.Constexpr, lo: cutlass.Constexpr,
                       hi: cutlass.Constexpr, col0: cutlass.Constexpr):
        """WGMMA accumulator fragment ((2, 2, BN/8), 1, 1): element v0 + 2 v1 + 4 j holds row
        r + 8 v1, column 8 j + 2 q + v0 (q = lane % 4), so per 8-column group a warp holds two 8 x 8
        tiles in the ``stmatrix`` layout once the pairs are packed to bf16x2; one ``stmatrix.x4``
        stores two column groups (lane l points at row l % 16 of the warp's 16 rows, group l // 16).
        L1: gate/up interleaved by 8 columns, so groups 2 jj (gate) and 2 jj + 1 (up) match:
        h = SwiGLU(gate, up) x routing weight in fp32, h column group jj. L2: elements [lo, hi)
        rounded to bf16, output column - col0."""
        lane = cute.arch.lane_idx()
        row0, _ = tCcC[0]  # this lane's first row: the warp's first row + lane // 4
        row = row0 - lane // 4 + lane % 16  # the row whose 16-byte segment this lane stores
        vals = cute.make_rmem_tensor((8,), BFloat16)
        words = cute.recast_tensor(vals, Int32)
        if const_expr(swiglu_l1):
            for jj in cutlass.range_constexpr(0, cute.size(acc) // 8, 2):
                for t in cutlass.range_constexpr(2):
                    for v1 in cutlass.range_constexpr(2):
                        i = 8 * (jj + t) + 2 * v1  # gate element (v0 = 0); up = i + 4
                        mm, _ = tCcC[i]
                        w = sm.row_w[mm]
                        for v0 in cutlass.range_constexpr(2):
                            vals[4 * t + 2 * v1 + v0] = BFloat16(swiglu_tanh(acc[i + v0], acc[i + 4 + v0]) * w)
                _, nn = tCcC[8 * jj]  # gate column 16 jj' + 2 q -> h column group jj'
                group = (nn - 2 * (lane % 4)) // 16 + lane // 16
                xdev.stmatrix_x4(sm.sC.iterator + self.stage_index(row, 4 * group), words[0], words[1], words[2],
                                 words[3])
        else:
            self.stage_l2(acc, tCcC, sm, row, vals, lo, hi, col0)

    @cute.jit
    def stage_l2(self, acc, tCcC, sm, row, vals, lo: cutlass.Constexpr, hi: cutlass.Constexpr,
                 col0: cutlass.Constexpr):
        """L2 staging (:meth:`stage_fragment`): elements [lo, hi) rounded to bf16, an stmatrix.x4
        per 8 of them at output column - col0."""
        lane = cute.arch.lane_idx()
        words = cute.recast_tensor(vals, Int32)
        for i0 in cutlass.range_constexpr(lo, hi, 8):
            for k in cutlass.range_constexpr(8):
                vals[k] = BFloat16(acc[i0 + k])
            _, nn = tCcC[i0]
            group = (nn - 2 * (lane % 4) - col0) // 8 + lane // 16
            xdev.stmatrix_x4(sm.sC.iterator + self.stage_index(row, 4 * group), words[0], words[1], words[2],
                             words[3])

    @cute.jit
    def record_trace(self, mTrace, cta: Int32, n_tile: Int32, tidx: Int32, tile, values):
        """Thread 0 writes the tile's key and ``values`` (TRACE_FIELDS[1:1 + len(values)]) into row
        ``n_tile`` of this CTA's trace, if it fits."""
        if tidx == 0 and n_tile < cute.size(mTrace, mode=[1]):
            mTrace[cta, n_tile, 0] = (Int64(tile.phase) << 40) | (Int64(tile.row) << 16) | Int64(tile.n_block)
            for i in cutlass.range_constexpr(len(values)):
                mTrace[cta, n_tile, 1 + i] = values[i]
