"""Dispatch role of :class:`~megamoe_interleave.kernel_sm90.MegaMoESm90`: pull the rows routed to
this rank's experts from every source rank's symmetric ``x`` into the expert-major pool, and
publish each scheduler row once it has landed (``x_ready[row]``, which the L1 producer waits on).

All threads copy the rows the CTAs' first tiles may read (the prologue); the dispatch warp copies
the rest while the tiles run, with 16-byte vector copies ("lsu") or bulk copies through two
shared-memory bounce buffers ("bulk": takes the copy off the load/store pipe the WGMMAs share).
Dispatch waits for nothing but its own copies (and, windowed, for L1 tiles that depend only on
rows already dispatched), which is what the scheduler's deadlock argument assumes.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Int32, Int64, const_expr

from xstage import device as xdev

DISPATCH_UNROLL = 8  # 16-byte chunks in flight per thread in the prologue (all threads)
DISPATCH_WARP_UNROLL = 12  # the same for the dispatch warp (fits the aux warps' 88 registers)
BULK_WAIT_TRIES = 1 << 20  # try_waits before a bulk load counts as lost (error word, host raises)
DISPATCH_POLL_NS = 256  # windowed Dispatch: sleep between polls of a row counter


class DispatchMixin:
    """Dispatch row pull (needs ``hidden``, ``bulk_piece_bytes``, ``dispatch_window``,
    ``dispatch_polls``, ``pairs_l1``, ``pool_rows_per_row`` on the kernel object)."""

    def pool_rows_of(self, grid, row):
        """(first pool row, pool rows) of scheduler row ``row``: its block of the expert's rows."""
        _, m_index, tok0, count = grid.row_record[row]
        p0 = tok0 + m_index * self.pool_rows_per_row
        return p0, cutlass.min(p0 + self.pool_rows_per_row, tok0 + count) - p0

    def prologue_rows(self, grid, nctas):
        """Rows [0, n) every thread copies before the roles split: those the CTAs' first tiles may
        read (a CTA's L1 tile at step s has row <= ((s + 1) * G - 1) // P1, G pairs)."""
        return cutlass.min(grid.num_rows, (nctas // 2 - 1) // self.pairs_l1 + 1)

    def dispatch_chunks_per_row(self):
        """(x chunks, all chunks) of one dispatched row, 16 bytes each: its 2 H bytes of x (a
        precision class adds what travels with a row, e.g. W8A8's scales)."""
        x_chunks = self.hidden * self.ab_bytes // 16
        return x_chunks, x_chunks

    def chunk_source(self, gm, i, x_chunks: int, chunks: int):
        """Address of pool chunk ``i`` in its source rank's x: chunk ``i % chunks`` of pool row ``i // chunks``."""
        row = i // chunks
        return Int64(gm.mPeerX[gm.mPoolSrc[row, 0]]) + (Int64(gm.mPoolSrc[row, 1]) * self.hidden
                                                         + Int64((i % chunks) * 8)) * 2

    def chunk_destination(self, gm, pool_base, i, x_chunks: int, chunks: int):
        """Address of pool chunk ``i`` in this rank's pool (contiguous rows of x)."""
        return pool_base + Int64(i) * 16

    def bulk_row_extras(self, gm, sm, i, j, ok, err):
        """The bulk Dispatch's pieces after pool row ``i``'s x: none (returns (j, ok))."""
        return j, ok

    @cute.jit
    def copy_chunks(self, gm, lo: Int32, hi: Int32, warp: Int32, num_warps: Int32, lane: Int32,
                    unroll: cutlass.Constexpr):
        """Pool chunks [lo, hi) (16 bytes each; bf16: pool row ``i // (H/8)`` from its source
        rank's x: :meth:`chunk_source` / :meth:`chunk_destination`) by ``num_warps`` warps, 32 * unroll
        consecutive chunks per warp-step with every load in flight before the first store (one
        chunk per thread-step left the copy latency-bound)."""
        x_chunks, chunks = self.dispatch_chunks_per_row()
        seg = 32 * unroll
        buf = cute.make_rmem_tensor((8, unroll), BFloat16)  # 16 bytes per chunk, whatever they hold
        pool_base = Int64(gm.mPoolX.iterator.toint())
        i0 = lo + warp * seg + lane
        while i0 < hi:
            for j in cutlass.range_constexpr(unroll):
                i = i0 + j * 32
                if i < hi:
                    addr = self.chunk_source(gm, i, x_chunks, chunks)
                    src_t = cute.make_tensor(
                        cute.make_ptr(BFloat16, addr, cute.AddressSpace.gmem, assumed_align=16), cute.make_layout(8))
                    buf[None, j].store(src_t.load())
            for j in cutlass.range_constexpr(unroll):
                i = i0 + j * 32
                if i < hi:
                    dst = self.chunk_destination(gm, pool_base, i, x_chunks, chunks)
                    dst_t = cute.make_tensor(cute.make_ptr(BFloat16, dst, cute.AddressSpace.gmem,
                                                           assumed_align=16), cute.make_layout(8))
                    dst_t.store(buf[None, j].load())
            i0 = i0 + num_warps * seg

    @cute.jit
    def dispatch_rows(self, gm, ctx, row_begin: Int32, row_end: Int32, warp: Int32, num_warps: cutlass.Constexpr,
                      lane: Int32, unroll: cutlass.Constexpr):
        """Scheduler rows [row_begin, row_end) in row order: this CTA's 1/nctas slice of each row's
        chunks by ``num_warps`` warps, then publish it (proxy fence -- TMA reads the rows --,
        barrier of the copying warps, one release increment of ``x_ready[row]``). A row is
        dispatched once its word reaches nctas."""
        _, chunks = self.dispatch_chunks_per_row()
        ready = gm.mCounters.iterator + self.COUNTER_L2_FULL + ctx.grid.num_rows
        row = row_begin
        while row < row_end:
            p0, n = self.pool_rows_of(ctx.grid, row)
            p0, n = p0 * chunks, n * chunks
            self.copy_chunks(gm, p0 + (ctx.cta * n) // ctx.nctas, p0 + ((ctx.cta + 1) * n) // ctx.nctas,
                             warp, num_warps, lane, unroll)
            cute.arch.fence_proxy("async.global")
            cute.arch.barrier(barrier_id=int(self.NamedBarrier.Dispatch), number_of_threads=32 * num_warps)
            if warp == 0 and lane == 0:
                cute.arch.fence_acq_rel_gpu()
                xdev.red_add_release(ready + row, Int32(1), "gpu")
            row = row + 1

    @cute.jit
    def bulk_piece(self, sm, src: Int64, dst: Int64, nbytes: cutlass.Constexpr, j: Int32, ok: Boolean, err):
        """Piece ``j`` of the bulk Dispatch: ``nbytes`` (<= the bounce buffer) from ``src`` into
        buffer j % 2 (once the store two pieces back has read it), then to ``dst``; returns
        (j + 1, ok)."""
        b = j % 2
        buf = sm.bulk_buf + b * self.bulk_piece_bytes
        cute.arch.cp_async_bulk_wait_group(1, read=True)  # the store from this buffer has read it
        cute.arch.mbarrier_arrive_and_expect_tx(sm.bulk_mbar + b, nbytes)
        xdev.bulk_copy_g2s(buf, src, nbytes, sm.bulk_mbar + b, "evict_first")
        # bounded by a count of try_waits: a %globaltimer loop here made ptxas
        # serialize the consumers' WGMMAs of the interleaved build
        ok = ok & xdev.mbarrier_wait_tries(sm.bulk_mbar + b, (j // 2) % 2, BULK_WAIT_TRIES, err,
                                           self.ERR_RING_TIMEOUT)
        xdev.bulk_copy_s2g(dst, buf, nbytes, "evict_first")
        cute.arch.cp_async_bulk_commit_group()
        return j + 1, ok

    @cute.jit
    def dispatch_rows_bulk(self, gm, ctx, sm, row_begin: Int32):
        """One thread, rows [row_begin, num_rows): this CTA's share of each row's pool rows, each in
        pieces: bulk load into bounce buffer j % 2 (completing on its mbarrier), bulk store into
        the pool; a buffer is reused once the store two pieces back has read it. A row is
        published after all its stores completed (wait_group 0, proxy fence, release increment).
        Loads and stores carry an L2 evict-first policy (each row is read and written once).

        ``dispatch_window`` W >= 1: row r >= W is copied only once row r - W has a finished L1
        tile (``l2_full[r - W] >= 1``). Deadlock-free: take the lowest row r a dispatch thread
        waits at; every dispatch thread is past r - W, so row r - W is dispatched and the tiles
        ahead of its L1 tiles depend on lower rows only (tests/test_megamoe_scheduler.py)."""
        piece = self.bulk_piece_bytes
        row_bytes = self.ab_bytes * self.hidden
        ready = gm.mCounters.iterator + self.COUNTER_L2_FULL + ctx.grid.num_rows
        err = gm.mCounters.iterator + self.COUNTER_ERROR
        pool_base = Int64(gm.mPoolX.iterator.toint())
        for b in cutlass.range_constexpr(2):
            cute.arch.mbarrier_init(sm.bulk_mbar + b, 1)
        cute.arch.mbarrier_init_fence()
        ok = Boolean(True)
        j = Int32(0)  # pieces issued so far: buffer j % 2, its mbarrier phase (j // 2) % 2
        l1_done = gm.mCounters.iterator + self.COUNTER_L2_FULL  # l2_full[row]: finished L1 tiles of the row
        row = row_begin
        while row < ctx.grid.num_rows and ok:
            if const_expr(self.dispatch_window > 0):
                if row >= self.dispatch_window:
                    ok = xdev.spin_wait_ge_tries(l1_done + (row - self.dispatch_window), Int32(1),
                                                 self.dispatch_polls, DISPATCH_POLL_NS, err, self.ERR_DEPENDENCY_TIMEOUT)
            p0, n = self.pool_rows_of(ctx.grid, row)
            i = p0 + (ctx.cta * n) // ctx.nctas
            while i < p0 + ((ctx.cta + 1) * n) // ctx.nctas and ok:
                src = Int64(gm.mPeerX[gm.mPoolSrc[i, 0]]) + Int64(gm.mPoolSrc[i, 1]) * row_bytes
                dst = pool_base + Int64(i) * row_bytes
                for q in cutlass.range_constexpr(row_bytes // piece):
                    j, ok = self.bulk_piece(sm, src + q * piece, dst + q * piece, piece, j, ok, err)
                j, ok = self.bulk_row_extras(gm, sm, i, j, ok, err)
                i = i + 1
            cute.arch.cp_async_bulk_wait_group(0)  # the row's stores are complete
            cute.arch.fence_proxy("async.global")
            cute.arch.fence_acq_rel_gpu()
            xdev.red_add_release(ready + row, Int32(1), "gpu")
            row = row + 1
        cute.arch.cp_async_bulk_wait_group(0)
