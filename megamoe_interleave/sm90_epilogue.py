"""Epilogue role of :class:`~megamoe_interleave.kernel_sm90.MegaMoESm90`: the epilogue warps (two
warps of the producer warpgroup) copy each staged output tile out of shared memory while the
consumers already run the next mainloop.

* L1 tiles: h (SwiGLU x routing weight, bf16) into the pool's h rows, then publish h to the L2
  tiles of every CTA (proxy fence, epilogue barrier, one release increment of ``l2_full[row]``).
* L2 tiles: the **Combine seam** -- :meth:`EpilogueMixin.combine_destination` (where an output row
  goes: ``combine[pick, token]`` on its source rank, through the peer table) and
  :meth:`EpilogueMixin.combine_stores` (the 16-byte remote stores of one staged part). These are
  the X-Stage remote stores: they drain while the issuing SM computes; instrumentation and other
  output precisions hook here.

Handoff with the consumers (named barriers; both sides walk the same tile sequence, so every
barrier phase completes): per staged part, EMPTY (the staging tile is free and the tile's row
metadata is in smem: the epilogue warps arrive, the consumers wait) then FULL (the consumers
arrive once the tile is staged, the epilogue warps wait).
"""
from __future__ import annotations

from functools import partial

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr

from xstage import device as xdev

from .config import BLOCK_M
from .scheduler import PHASE_L1


class EpilogueMixin:
    """h publication and the Combine remote stores (``num_epi_threads`` threads, ``et`` = index)."""

    def epi_sync(self):
        """Barrier of the epilogue warps only."""
        cute.arch.barrier(barrier_id=int(self.NamedBarrier.Epilogue), number_of_threads=self.num_epi_threads)

    def combine_row_offset(self, tok, pick, max_tokens):
        """Byte offset of ``combine[pick, tok, 0]`` in a rank's symmetric combine buffer."""
        return (Int64(pick) * Int64(max_tokens) + Int64(tok)) * (self.hidden * 2)

    def combine_destination(self, gm, prow, max_tokens):
        """Combine seam, metadata: the address of pool row ``prow``'s output row on its source rank."""
        return xdev.peer_address(gm.mPeerCombine, gm.mPoolSrc[prow, 0],
                                 self.combine_row_offset(gm.mPoolSrc[prow, 1], gm.mPoolSrc[prow, 2], max_tokens))

    @cute.jit
    def combine_stores(self, tile, rows: Int32, part: cutlass.Constexpr, sm, et: Int32):
        """Combine seam, stores: staged part ``part`` (BN / l2_handoffs columns) of an L2 tile's
        ``rows`` valid rows, 16 bytes per store, to the addresses in ``sm.row_addr``."""
        chunks = self.stage_words // 4
        col0 = tile.n_block * self.block_n + part * (self.block_n // self.l2_handoffs)
        u = et
        while u < rows * chunks:
            m, c = u // chunks, u % chunks
            k = self.stage_index(m, 4 * c)
            xdev.store_v4(sm.row_addr[m] + Int64(col0 + c * 8) * 2, sm.sC[k], sm.sC[k + 1], sm.sC[k + 2], sm.sC[k + 3])
            u = u + self.num_epi_threads

    @cute.jit
    def epilogue_tiles(self, ctx, et: Int32, gm, sm):
        """Per tile of the schedule: (1) the rows' metadata into smem (L1: routing weight, read by
        the consumers' SwiGLU; L2: the Combine destination), arrive EMPTY; (2) wait FULL, copy the
        staged rows out: h, then publish it; or the Combine stores, part by part. Tracing: thread
        0 records when the stores were issued and their issue span (TRACE_FIELDS t_rs_end, rs_ns)."""
        chunks_l1 = self.block_n * self.ab_bytes // 32  # 16-byte chunks of a staged row: L1, BN/2 h columns
        self.walk_tiles(ctx, partial(self.epilogue_tile, ctx, et, gm, sm, chunks_l1), lambda: Int32(0))  # traced tiles

    @cute.jit
    def epilogue_tile(self, ctx, et: Int32, gm, sm, chunks_l1: cutlass.Constexpr, tile, n_tile: Int32):
        tok0, count = tile.tok0, tile.count
        row0 = tok0 + tile.m_block * BLOCK_M
        rows = cutlass.min(count - tile.m_block * BLOCK_M, BLOCK_M)
        m = et
        while m < rows:
            if tile.phase == PHASE_L1:
                sm.row_w[m] = gm.mPoolWeight[row0 + m]
            else:
                sm.row_addr[m] = self.combine_destination(gm, row0 + m, ctx.max_tokens)
            m = m + self.num_epi_threads
        self.epilogue_handoff()
        t_part = self.barrier_timestamp(sm)
        span = Int64(0)
        t_end = Int64(0)
        if tile.phase == PHASE_L1:
            eb = self.ab_bytes
            h_base = Int64(gm.mH.iterator.toint()) + Int64(tile.n_block * (self.block_n // 2)) * eb
            u = et
            while u < rows * chunks_l1:
                m, c = u // chunks_l1, u % chunks_l1
                k = self.stage_index(m, 4 * c)
                addr = self.h_store_address(h_base, row0 + m, c)
                xdev.store_v4(addr, sm.sC[k], sm.sC[k + 1], sm.sC[k + 2], sm.sC[k + 3])
                u = u + self.num_epi_threads
            self.store_h_scales(gm, sm, tile, row0, rows, et)
            # Publish h: generic stores -> proxy fence (read by TMA) -> barrier -> release.
            cute.arch.fence_proxy("async.global")
            self.epi_sync()
            t_end = self.barrier_timestamp(sm)
            if et == 0:
                cute.arch.fence_acq_rel_gpu()
                xdev.red_add_release(gm.mCounters.iterator + self.COUNTER_L2_FULL + tile.row, Int32(1), "gpu")
        else:
            for part in cutlass.range_constexpr(self.l2_handoffs):
                if const_expr(part > 0):
                    span = span + self.timestamp() - t_part
                    self.epilogue_handoff()  # part 0 read out: the staging tile is free for part 1
                    t_part = self.barrier_timestamp(sm)
                self.combine_stores(tile, rows, part, sm, et)
            self.epi_sync()  # every thread done with row_addr before the next tile's metadata
            t_end = self.barrier_timestamp(sm)
        if const_expr(self.trace):
            if et == 0 and n_tile < cute.size(gm.mTrace, mode=[1]):
                gm.mTrace[ctx.cta, n_tile, 8] = t_end
                gm.mTrace[ctx.cta, n_tile, 9] = span + t_end - t_part
            n_tile = n_tile + 1
        return n_tile

    def h_store_address(self, h_base, row, c):
        """Address of 16-byte chunk ``c`` of h row ``row`` within the tile's columns (``h_base``)."""
        return h_base + (Int64(row) * self.intermediate + c * 8) * 2

    def store_h_scales(self, gm, sm, tile, row0, rows, et):
        """After a tile's h rows: what else the L2 tiles read of them (a precision class's scales)."""

    def epilogue_handoff(self):
        """The epilogue warps' side of one staged part: EMPTY (arrive), then FULL (wait)."""
        cute.arch.barrier_arrive(barrier_id=int(self.NamedBarrier.EpilogueEmpty), number_of_threads=self.handoff_threads)
        cute.arch.barrier(barrier_id=int(self.NamedBarrier.EpilogueFull), number_of_threads=self.handoff_threads)
