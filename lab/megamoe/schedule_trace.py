"""Device-side evaluation of the tile schedulers (CuTe DSL).

``ScheduleTrace`` runs the *same* step functions as the fused kernel's scheduler
(``megamoe_interleave.scheduler``) in a tiny kernel: one thread per CTA walks its
sequence and records ``(phase, row, expert, m_block, n_block, tok0, count)`` per tile. It proves
that the scheduler definition traces to DSL index arithmetic (compile test on CPU)
and, on a GPU, that the device order equals the Python reference bit for bit.
"""
from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32

from megamoe_interleave.kernel_sm90 import DeviceRowRecords
from megamoe_interleave.scheduler import RowGrid, Schedule


class ScheduleTrace:
    """One kernel class for both schedulers; ``schedule`` is a compile-time switch."""

    def __init__(self, schedule: Schedule, pairs_l1: int, pairs_l2: int, row_block: int = 64):
        self.schedule = schedule
        self.row_block = row_block  # pool rows per scheduler row (RowGrid.row_block; l2_columns reads it)
        self.pairs_l1 = pairs_l1
        self.pairs_l2 = pairs_l2

    @cute.jit
    def __call__(
        self,
        mRowRecord: cute.Tensor,  # (max(P,1), 4) int32, 16-byte aligned
        mScheduleTable: cute.Tensor,  # int32 row_grid.schedule_table
        num_rows: Int32,
        mOut: cute.Tensor,  # (num_ctas, max_tiles, 7) int32
        mCount: cute.Tensor,  # (num_ctas,) int32
        stream,
    ):
        num_ctas = cute.size(mCount, mode=[0])
        self.kernel(mRowRecord, mScheduleTable, num_rows, mOut, mCount).launch(
            grid=[num_ctas, 1, 1], block=[32, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mRowRecord: cute.Tensor,
        mScheduleTable: cute.Tensor,
        num_rows: Int32,
        mOut: cute.Tensor,
        mCount: cute.Tensor,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        grid = RowGrid(
            num_rows=num_rows,
            pairs_l1=self.pairs_l1,
            pairs_l2=self.pairs_l2,
            row_record=DeviceRowRecords(mRowRecord),
            wave_row_start=mScheduleTable,
            l2_start=mScheduleTable,
            row_block=self.row_block,
        )
        g = Int32(cta) // 2
        r = Int32(cta) % 2
        G = Int32(num_ctas) // 2
        if tidx == 0:
            c0, c1 = self.schedule.init(g, grid)
            c0 = Int32(c0)
            c1 = Int32(c1)
            n = Int32(0)
            max_tiles = cute.size(mOut, mode=[1])
            while not self.schedule.done((c0, c1), grid):
                tile, nxt = self.schedule.step((c0, c1), g, G, r, grid)
                if tile.valid > 0:
                    if n < max_tiles:
                        mOut[cta, n, 0] = Int32(tile.phase)
                        mOut[cta, n, 1] = Int32(tile.row)
                        mOut[cta, n, 2] = Int32(tile.expert)
                        mOut[cta, n, 3] = Int32(tile.m_block)
                        mOut[cta, n, 4] = Int32(tile.n_block)
                        mOut[cta, n, 5] = Int32(tile.tok0)
                        mOut[cta, n, 6] = Int32(tile.count)
                    n = n + 1
                c0 = Int32(nxt[0])
                c1 = Int32(nxt[1])
            mCount[cta] = n


def compile_schedule_trace(schedule: Schedule, pairs_l1: int, pairs_l2: int, row_block: int = 64):
    """Compile for the current CUTE_DSL_ARCH with fake tensors (no GPU needed)."""
    from quack.compile_utils import make_fake_tensor

    from xstage.cute_compile import compile_hopper, fake_stream

    n_rows, n_table = cute.sym_int(), cute.sym_int()
    n_ctas, max_tiles = cute.sym_int(), cute.sym_int()
    args = (
        make_fake_tensor(Int32, (n_rows, 4)),
        make_fake_tensor(Int32, (n_table,)),
        Int32(0),
        make_fake_tensor(Int32, (n_ctas, max_tiles, 7)),
        make_fake_tensor(Int32, (n_ctas,)),
        fake_stream(),
    )
    return compile_hopper(ScheduleTrace(schedule, pairs_l1, pairs_l2, row_block), *args).fn
