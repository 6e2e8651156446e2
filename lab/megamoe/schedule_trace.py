"""Device-side evaluation of the tile schedulers (CuTe DSL).

``ScheduleTrace`` runs the *same* step functions as the fused kernel's scheduler
(``megamoe_interleave.scheduler``) in a tiny kernel: one thread per CTA walks its
sequence and records ``(phase, row, expert, m_block, n_block, tok0, count)`` per tile. It proves
that the scheduler definition traces to DSL index arithmetic (compile test on CPU)
and, on a GPU, that the device order equals the Python reference bit for bit.
"""
from __future__ import annotations

from functools import partial

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from megamoe_interleave.sm90_schedule import DeviceRowRecords, tile_fields, walk_tiles
from megamoe_interleave.scheduler import RowGrid, Schedule


class ScheduleTrace:
    """One kernel class for both schedulers; ``schedule`` is a compile-time switch."""

    def __init__(self, schedule: Schedule, pairs_l1: int, pairs_l2: int, row_block: int, row_split_n: bool = False):
        self.schedule = schedule
        self.row_block = row_block  # pool rows per scheduler row (RowGrid.row_block)
        self.row_split_n = row_split_n
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
            row_split_n=self.row_split_n,
        )
        if tidx == 0:
            g, r, G = Int32(cta) // 2, Int32(cta) % 2, Int32(num_ctas) // 2
            mCount[cta] = walk_tiles(self.schedule, g, G, r, grid, partial(self.record, Int32(cta), mOut),
                                     lambda: Int32(0))

    @cute.jit
    def record(self, cta: Int32, mOut: cute.Tensor, tile, n: Int32):
        """Tile ``n`` of this CTA's sequence into ``mOut`` (if it fits); returns n + 1."""
        if n < cute.size(mOut, mode=[1]):
            fields = tile_fields(tile)[1:]  # the Tile's fields after ``valid``, in mOut's column order
            for i in cutlass.range_constexpr(len(fields)):
                mOut[cta, n, i] = fields[i]
        return n + 1


def compile_schedule_trace(schedule: Schedule, pairs_l1: int, pairs_l2: int, row_block: int, row_split_n: bool = False):
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
    return compile_hopper(ScheduleTrace(schedule, pairs_l1, pairs_l2, row_block, row_split_n), *args).fn
