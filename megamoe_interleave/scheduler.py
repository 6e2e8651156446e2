"""Tile schedulers of the fused MoE kernel: ``expert_wave`` and ``interleaved`` (paper Algorithm 1).

A scheduler is a pure function ``step(cursor, g, G, r, grid) -> (tile, cursor')``:

* ``g``  -- instance id (a *pair* of CTAs), ``G`` -- stride (number of pairs),
* ``r``  -- role in the pair (0 or 1); both members walk the same sequence of
  *pair tiles*: both take N-block ``pair`` and member r the r-th BLOCK_M half of the row's
  2 * BLOCK_M rows (or, with ``RowGrid.row_split_n``, in a row of few rows, N-block
  ``2 * pair + r`` of its first half),
* ``cursor`` -- a small tuple of integers (the scheduler's private state),
* ``grid`` -- the row layout (:class:`RowGrid`): ``P`` scheduler rows (one row =
  2 * BLOCK_M pool rows of one local expert; experts are laid out row-contiguously,
  expert ``e`` owns rows ``[O_e, O_e + m_blocks_e)``), ``P1`` / ``P2`` pair tiles
  per row of the Linear-1 / Linear-2 stream, and two lookup tables.

The same code runs in two worlds:

* Python reference (:func:`.row_grid.enumerate_order`): integers, lists; used by the tests
  and to predict what the kernel does.
* CuTe DSL kernel: called at trace time with ``cutlass.Int32`` values and
  ``cute.Tensor`` lookup tables; it emits the index arithmetic. To make that
  possible the step functions use only ``+ - * // %``, comparisons, ``&``/``|``
  on booleans, table indexing and :func:`select` -- no Python ``if`` on values,
  no loops. A step may return an *idle* tile (``valid == 0``) while the cursor
  moves (expert_wave skipping an exhausted wave); callers loop
  ``while not done(cursor)`` and skip idle tiles.

Deadlock freedom (both schedulers)
----------------------------------
Model: every CTA is resident (persistent grid <= #SMs), processes its own tile
sequence strictly in order, an L1 tile depends only on Dispatch (which never waits
on any tile), and an L2 tile of row p waits until *all* L1 tiles of row p (over all
CTAs) have published their outputs (release/acquire counter ``l2_full[p]``).

Invariant I (checked by the tests for every order we generate): in each CTA's
sequence, every L1 tile of row p precedes every L2 tile of row p.

Claim: with I, the kernel cannot deadlock. Suppose it did. Every stuck CTA's
*head* (first unfinished tile) is then an L2 tile (L1 heads always progress). Let
p* be the smallest row among the stuck heads, held by CTA a. Some L1 tile T of row
p* is unfinished; it belongs to a CTA c. T is not before c's head (tiles before the
head are finished), so T comes at or after c's head, an L2 tile of row q >= p*
(minimality of p*). If q == p*, T would follow an L2 tile of its own row in c's
sequence, violating I. If q > p*: for ``interleaved`` the L2 tile of row q was
emitted only when c's L1 cursor row p1 satisfied q + D <= p1 with D >= 1, so the
cursor was already past row p* (L1 rows are visited in increasing order) and T was
emitted earlier -- contradiction. For ``expert_wave`` the per-CTA sequence follows
one global order in which all L1 tiles of wave w precede all L2 tiles of wave w and
rows of later waves are larger; row p* <= q, so T (L1, row p*) is at a smaller
global index than c's head -- contradiction. Hence some head is always runnable.
(D = 0 breaks the argument: an L2 tile of row p could precede the same CTA's L1
tiles of row p; :func:`interleaved_step` therefore requires D >= 1.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .int_ops import is_py, as_int, divmod_small, logical_and, logical_not, logical_or, select

PHASE_L1 = 1
PHASE_L2 = 2
SCHEDULES = ("expert_wave", "interleaved")


# ---------------------------------------------------------------------------
# Row layout
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class RowGrid:
    """Row layout shared by both schedulers.

    ``num_rows`` P, ``pairs_l1`` P1 = L1 N-blocks, ``pairs_l2`` P2 = L2 N-blocks,
    ``row_expert[p]`` = e(p), ``expert_row_offset[e]`` = O_e (length E + 1, last = P),
    ``wave_row_start[w]`` = first row of wave w (length W + 2; the last two are P),
    ``row_record[p]`` = (e(p), p - O_e, first pool row of e(p), tokens of e(p)) -- what the
    step functions read (:func:`_tile`): one 16-byte load per tile in the kernel, where
    ``row_record`` is a :class:`~megamoe_interleave.sm90_schedule.DeviceRowRecords` and
    ``wave_row_start`` a device tensor, filled by the host before the launch;
    ``row_expert`` / ``expert_row_offset`` are host-side only.

    A row is ``row_block`` = 2 * BLOCK_M pool rows and the CTA pair splits it along M: both
    members load the same B tile (the kernel multicasts it), member r computes BLOCK_M block
    ``2 * (p - O_e) + r`` of the expert, which may hold no rows (an expert's odd last block).

    ``row_split_n`` (static): a row holding at most BLOCK_M of the expert's
    rows is split along N instead (:func:`row_splits_n`): pair tile j < P1 / 2 (L2: P2 / 2) has
    both members on the row's first BLOCK_M block, member r on N-block ``2 j + r`` (they share
    A, so the kernel multicasts A for it), and pair tiles j >= P1 / 2 are idle. So a row of few
    rows has no member computing on padding, and an expert of many rows still reads each of its
    weights once per 2 * BLOCK_M rows.
    """

    num_rows: Any
    pairs_l1: int
    pairs_l2: int
    row_expert: Any = None
    expert_row_offset: Any = None
    wave_row_start: Any = None
    num_waves: Any = 0
    row_record: Any = None
    l2_start: Any = None  # interleaved with balance_l2: per pair, the L2 stream's first pair tile
    row_block: int = 0  # pool rows per scheduler row: 2 * BLOCK_M
    row_split_n: bool = False


# ---------------------------------------------------------------------------
# Tiles
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Tile:
    valid: Any  # 1 = a tile, 0 = idle step
    phase: Any  # PHASE_L1 / PHASE_L2
    row: Any  # scheduler row (pool M-block)
    expert: Any  # local expert e(row)
    m_block: Any  # BLOCK_M block within the expert: 2 * (row - O_e) + r (a row split along N: 2 * (row - O_e))
    n_block: Any  # pair (a row split along N: 2 * pair + r)
    tok0: Any = 0  # first pool row of the expert
    count: Any = 0  # tokens of the expert


def tile_pool_row(tile: Tile, m, block_m: int):
    """The pool row whose per-row data (W8A8 scales) row ``m`` of ``tile``'s M block reads: its own
    row while it holds one of the expert's tokens, else the expert's last row. Member 1 of an
    expert's last scheduler row runs a block that may hold no rows
    (or a few): its rows past the expert end. The pool is padded by one block only, so without the
    clamp those reads ran up to 63 rows past the pool's end (the W8A8 illegal address of
    issue 39). The clamped rows feed accumulator rows that are never stored."""
    row = tile.tok0 + tile.m_block * block_m + m
    last = tile.tok0 + tile.count - 1
    return select(row > last, last, row)


def _row_record(grid: RowGrid, row, valid):
    """``grid.row_record[row]`` if valid else zeros; idle steps may carry an out-of-range
    row, so the DSL path clamps it (device tables always hold at least one record)."""
    if is_py(valid):
        return tuple(grid.row_record[row]) if valid else (0, 0, 0, 0)
    rec = grid.row_record[select(valid > 0, row, 0)]
    return tuple(select(valid > 0, f, 0) for f in rec)


def _tile(grid: RowGrid, valid, phase, row, pair, r) -> Tile:
    return _tile_of_record(grid, valid, phase, row, pair, r, _row_record(grid, row, valid))


def row_splits_n(grid: RowGrid, m_index, count):
    """With ``grid.row_split_n``: the scheduler row ``m_index`` of an expert with ``count`` rows holds
    at most BLOCK_M of them, so its CTA pair splits it along N (:class:`RowGrid`)."""
    return count - m_index * grid.row_block <= grid.row_block // 2


def l1_tiles_of_row(grid: RowGrid, m_index, count):
    """The L1 tiles that finish scheduler row ``m_index`` of an expert with ``count`` rows (one per
    CTA of each of its pair tiles): what an L2 tile of the row waits for on ``l2_full[row]``."""
    if grid.row_split_n:
        return select(row_splits_n(grid, m_index, count), grid.pairs_l1, 2 * grid.pairs_l1)
    return 2 * grid.pairs_l1


def _tile_of_record(grid: RowGrid, valid, phase, row, pair, r, record) -> Tile:
    expert, m_index, tok0, count = record
    if grid.row_split_n:
        # pair tile j of a row split along N: m-block 0 of the row, N-blocks 2j and 2j + 1 (j < half
        # the row's pair tiles; the rest are idle)
        split_n = row_splits_n(grid, m_index, count)
        half_pairs = select(phase == PHASE_L2, grid.pairs_l2 // 2, grid.pairs_l1 // 2)
        valid = as_int(logical_and(valid > 0, logical_or(logical_not(split_n), pair < half_pairs)))
        return Tile(valid=valid, phase=phase, row=row, expert=expert,
                    m_block=select(split_n, 2 * m_index, 2 * m_index + r),
                    n_block=select(split_n, 2 * pair + r, pair), tok0=tok0, count=count)
    return Tile(valid=valid, phase=phase, row=row, expert=expert, m_block=2 * m_index + r, n_block=pair,
                tok0=tok0, count=count)


# ---------------------------------------------------------------------------
# interleaved (Algorithm 1)
# ---------------------------------------------------------------------------
def interleaved_init(g, grid: RowGrid | None = None, balance_l2: bool = False):
    """Cursor (k1, k2): pair-tile cursors of the L1 and L2 streams.

    Both streams are dealt round-robin over the G pairs (pair g takes pair tiles k = g (mod G)),
    so without balancing the pairs g < (P * P1) % G get one L1 tile more than the others and
    the pairs g < (P * P2) % G one L2 tile more: the same pairs carry both extras and finish
    last. ``balance_l2`` starts pair g's L2 stream at residue ``grid.l2_start[g]`` instead, a
    permutation of the pairs computed on the host (:func:`.row_grid.balanced_l2_start`) that gives the
    cheapest L2 residue classes to the pairs with the dearest L1 classes. Each pair still owns
    exactly one residue class of each stream, so every tile is emitted once, and the emission
    rule -- hence invariant I and the deadlock argument -- does not depend on where a stream
    starts."""
    if not balance_l2:
        return (g, g)
    return (g, grid.l2_start[g])


def interleaved_done(cursor, grid: RowGrid):
    k1, k2 = cursor
    return logical_and(k1 >= grid.num_rows * grid.pairs_l1, k2 >= grid.num_rows * grid.pairs_l2)


def interleaved_next(cursor, G, grid: RowGrid, lead):
    """One step of Algorithm 1 without the table lookups.

    Returns (is_l2, row, pair, cursor'). Emits L2 iff the L2 stream has tiles left and
    the L1 stream leads by >= D rows (L1 finished counts as +inf lead).
    """
    k1, k2 = cursor
    P, P1, P2 = grid.num_rows, grid.pairs_l1, grid.pairs_l2
    l1_left = k1 < P * P1
    l2_left = k2 < P * P2
    p1 = k1 // P1
    p2 = k2 // P2
    is_l2 = logical_and(l2_left, logical_or(logical_not(l1_left), p2 + lead <= p1))
    row = select(is_l2, p2, p1)
    pair = select(is_l2, k2 % P2, k1 % P1)
    k1n = select(is_l2, k1, k1 + G)
    k2n = select(is_l2, k2 + G, k2)
    return is_l2, row, pair, (k1n, k2n)


def interleaved_step(cursor, g, G, r, grid: RowGrid, lead):
    if is_py(lead) and lead < 1:
        raise ValueError(f"lead D must be >= 1 for deadlock freedom, got {lead}")
    valid = as_int(logical_not(interleaved_done(cursor, grid)))
    is_l2, row, pair, nxt = interleaved_next(cursor, G, grid, lead)
    phase = select(is_l2, PHASE_L2, PHASE_L1)
    return _tile(grid, valid, phase, row, pair, r), nxt


# ---------------------------------------------------------------------------
# expert_wave
# ---------------------------------------------------------------------------
def expert_wave_init(g):
    """Cursor (t, w): global pair-tile index and current wave."""
    return (g, 0)


def expert_wave_done(cursor, grid: RowGrid):
    t, _ = cursor
    return t >= grid.num_rows * (grid.pairs_l1 + grid.pairs_l2)


def expert_wave_step(cursor, g, G, r, grid: RowGrid, l2_columns: bool = False):
    """Global order = concat over waves w of (L1 tiles of w, row-major; L2 tiles of w).

    Wave w occupies global pair indices [(P1+P2)*S_w, (P1+P2)*S_{w+1}) since every row
    contributes P1 + P2 pair tiles. If ``t`` is beyond the current wave the step only
    advances the wave (idle tile); otherwise it emits and advances ``t`` by G.

    ``l2_columns``: the L2 tiles of each expert keep their positions ``[O_e, O_e + R_e) * P2``
    in the wave's L2 stream but are visited column by column (local position
    ``(q - O_e) * P2 + pair`` -> pair ``local // R_e``, row ``O_e + local % R_e``), so the
    pairs running together share one expert's W2 columns. The expert of a position is that
    of its row-major row, so the row's record still serves. Every L2 tile of a wave still
    follows all of the wave's L1 tiles in the order, so the deadlock argument is unchanged.
    """
    t, w = cursor
    P1, P2 = grid.pairs_l1, grid.pairs_l2
    per_row = P1 + P2
    ws = grid.wave_row_start
    done = expert_wave_done(cursor, grid)
    s0 = ws[w]
    s1 = ws[w + 1]
    in_wave = logical_and(logical_not(done), t < per_row * s1)
    local = t - per_row * s0
    rows_in_wave = s1 - s0
    is_l2 = local >= rows_in_wave * P1
    l2_local = local - rows_in_wave * P1
    row = select(is_l2, s0 + l2_local // P2, s0 + local // P1)
    pair = select(is_l2, l2_local % P2, local % P1)
    phase = select(is_l2, PHASE_L2, PHASE_L1)
    valid = as_int(in_wave)
    row = select(in_wave, row, 0)
    t_next = select(in_wave, t + G, t)
    w_next = select(logical_or(in_wave, done), w, w + 1)
    record = _row_record(grid, row, valid)
    if l2_columns:
        if grid.row_block <= 0:
            raise ValueError("l2_columns needs grid.row_block (pool rows per scheduler row; make_row_grid sets it)")
        e, m_q, tok0, count = record
        rows_e = (count + grid.row_block - 1) // grid.row_block
        rows_e = select(rows_e > 0, rows_e, 1)  # idle steps carry a zero record
        col, m_col = divmod_small(m_q * P2 + pair, rows_e)
        row = select(is_l2, row - m_q + m_col, row)
        pair = select(is_l2, col, pair)
        record = (e, select(is_l2, m_col, m_q), tok0, count)
    return _tile_of_record(grid, valid, phase, row, pair, r, record), (t_next, w_next)


# ---------------------------------------------------------------------------
# Uniform front end
# ---------------------------------------------------------------------------
class Schedule:
    """A tile scheduler: ``init(g, grid)`` -> cursor, ``done(cursor, grid)``, ``step(cursor, g, G, r,
    grid)`` -> (tile, next cursor), over the pure step functions above, so the kernel's roles (on DSL
    values, at trace time), the device-side plan and the CPU references (:func:`.row_grid.enumerate_order`)
    walk one definition. A schedule is a subclass; :func:`schedule_of` builds one by name."""

    name = ""
    balance_l2 = False  # options a schedule does not have read as off (its subclass sets them)
    l2_columns = False

    def init(self, g, grid: RowGrid):
        raise NotImplementedError

    def done(self, cursor, grid: RowGrid):
        raise NotImplementedError

    def step(self, cursor, g, G, r, grid: RowGrid):
        raise NotImplementedError

    def tiles(self, grid: RowGrid, g: int, G: int, r: int):
        """The tiles of CTA (g, r) in order (Python ints). The kernel's roles write this loop with
        DSL values (a DSL ``while`` carries its cursor explicitly), over the same ``done`` / ``step``."""
        cursor = self.init(g, grid)
        # Every step either emits or advances a wave, so this bound is never reached by a correct
        # scheduler; it turns a scheduler bug into an error, not a hang.
        for _ in range(grid.num_rows * (grid.pairs_l1 + grid.pairs_l2) + (grid.num_waves or 0) + 2):
            if self.done(cursor, grid):
                return
            tile, cursor = self.step(cursor, g, G, r, grid)
            if tile.valid:
                yield tile
        raise RuntimeError("scheduler did not terminate")


@dataclass(frozen=True)
class InterleavedSchedule(Schedule):
    """Paper Algorithm 1: each pair runs L1 tiles ``lead`` rows ahead of its L2 tiles; ``balance_l2``:
    the pairs' first L2 rows from :func:`.row_grid.balanced_l2_start` (``grid.l2_start``)."""

    name = "interleaved"
    lead: int = 1
    balance_l2: bool = False

    def __post_init__(self):
        if self.lead < 1:
            raise ValueError(f"lead D must be >= 1, got {self.lead}")

    def init(self, g, grid: RowGrid):
        return interleaved_init(g, grid, self.balance_l2)

    def done(self, cursor, grid: RowGrid):
        return interleaved_done(cursor, grid)

    def step(self, cursor, g, G, r, grid: RowGrid):
        return interleaved_step(cursor, g, G, r, grid, self.lead)


@dataclass(frozen=True)
class ExpertWaveSchedule(Schedule):
    """Experts in waves: every L1 tile of a wave, then its L2 tiles; ``l2_columns``: an expert's L2
    tiles column by column (:func:`expert_wave_step`)."""

    name = "expert_wave"
    l2_columns: bool = False

    def init(self, g, grid: RowGrid):
        return expert_wave_init(g)

    def done(self, cursor, grid: RowGrid):
        return expert_wave_done(cursor, grid)

    def step(self, cursor, g, G, r, grid: RowGrid):
        return expert_wave_step(cursor, g, G, r, grid, self.l2_columns)


SCHEDULE_CLASSES = {cls.name: cls for cls in (ExpertWaveSchedule, InterleavedSchedule)}


def schedule_of(name: str, **options) -> Schedule:
    """The schedule called ``name`` with its ``options`` (a TypeError names an option it lacks)."""
    if name not in SCHEDULE_CLASSES:
        raise ValueError(f"unknown schedule {name!r}; expected one of {SCHEDULES}")
    return SCHEDULE_CLASSES[name](**options)
