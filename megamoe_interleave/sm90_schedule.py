"""The tile schedule on the device (the kernel's side of :mod:`.scheduler`): the row records'
16-byte loads and the loop every role of the fused kernel, and the schedule trace, walks."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr

from .scheduler import RowGrid, Schedule, Tile


class DeviceRowRecords:
    """:attr:`RowGrid.row_record` in the kernel: ``records[row]`` = (expert, block index, first pool
    row of the expert, its tokens) in ONE 16-byte load from the ``(rows, 4)`` int32 tensor."""

    def __init__(self, records: cute.Tensor):
        self.base = Int64(records.iterator.toint())

    def __getitem__(self, row):
        src = cute.make_tensor(cute.make_ptr(Int32, self.base + Int64(row) * 16, cute.AddressSpace.gmem,
                                             assumed_align=16), cute.make_layout(4))
        rec = cute.make_rmem_tensor((4,), Int32)
        rec.store(src.load())
        return rec[0], rec[1], rec[2], rec[3]


def tile_fields(tile: Tile):
    """A tile's fields as Int32 values (loop-carried state of a software-pipelined loop)."""
    return tuple(Int32(getattr(tile, f)) for f in Tile.__dataclass_fields__)


@cute.jit
def walk_tiles(schedule: Schedule, g, G, r, grid: RowGrid, body, start, look_ahead: cutlass.Constexpr = False):
    """:meth:`Schedule.tiles` on DSL values, for the fused kernel's roles and the schedule trace: ``state =
    body(tile, state)`` for each valid tile of CTA (g, r), from ``state = start()`` (the role's loop state,
    DSL values) to the returned final state; a DSL ``while`` carries the state and the cursor explicitly.
    ``look_ahead``: every step is taken one tile early, so its row-record load is in flight during the
    tile before. (``start`` runs after the first cursor, as in the roles' former hand-written loops: their
    builds' PTX is unchanged.)"""
    c0, c1 = schedule.init(g, grid)
    c0, c1 = Int32(c0), Int32(c1)
    state = start()
    if const_expr(look_ahead):
        first, nxt = schedule.step((c0, c1), g, G, r, grid)
        cur = tile_fields(first)
        n0, n1 = Int32(nxt[0]), Int32(nxt[1])
        while not schedule.done((c0, c1), grid):
            ahead, nxt = schedule.step((n0, n1), g, G, r, grid)  # may be past the end: idle
            tile = Tile(*cur)
            if tile.valid > 0:
                state = body(tile, state)
            c0, c1 = n0, n1
            cur = tile_fields(ahead)
            n0, n1 = Int32(nxt[0]), Int32(nxt[1])
    else:
        while not schedule.done((c0, c1), grid):
            tile, nxt = schedule.step((c0, c1), g, G, r, grid)
            if tile.valid > 0:
                state = body(tile, state)
            c0 = Int32(nxt[0])
            c1 = Int32(nxt[1])
    return state
