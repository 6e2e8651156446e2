"""The host side of the tile schedulers (:mod:`.scheduler` holds what the kernel runs): the row
grid built from the tokens per expert, the balanced L2 starts and the schedule table the kernel
reads, the default wave size and lead, and the CPU enumeration of every CTA's tiles that the
references and tests walk."""
from __future__ import annotations

import itertools
import math
from typing import List, Sequence, Tuple

import numpy as np

from xstage import model

from .scheduler import RowGrid, Schedule, Tile


def make_row_grid(
    tokens_per_expert: Sequence[int],
    *,
    block_m: int,
    n_blocks_l1: int,
    n_blocks_l2: int,
    experts_per_wave: int | None = None,
    row_split_n: bool = False,
) -> RowGrid:
    """Host-side row layout from the number of tokens each local expert received: rows of 2 * block_m
    pool rows, which the CTA pair splits along M (``row_split_n``: rows of at most block_m of them
    along N; see :class:`RowGrid`)."""
    check_experts_per_wave(experts_per_wave)
    if row_split_n and (n_blocks_l1 % 2 or n_blocks_l2 % 2):
        raise ValueError(f"row_split_n needs even N-block counts (two per pair tile): L1 {n_blocks_l1}, L2 {n_blocks_l2}")
    if block_m <= 0:
        raise ValueError("block_m must be positive")
    num_experts = len(tokens_per_expert)
    row_block = 2 * block_m
    m_blocks = [(int(c) + row_block - 1) // row_block for c in tokens_per_expert]
    if any(c < 0 for c in tokens_per_expert):
        raise ValueError("negative token count")
    # (itertools: this runs on the host before every fused launch)
    offsets = [0, *itertools.accumulate(m_blocks)]
    num_rows = offsets[-1]
    row_expert = list(itertools.chain.from_iterable(itertools.repeat(e, mb) for e, mb in enumerate(m_blocks)))
    token_offsets = [0, *itertools.accumulate(int(c) for c in tokens_per_expert)]
    row_record = [(e, i, token_offsets[e], int(tokens_per_expert[e]))
                  for e, mb in enumerate(m_blocks) for i in range(mb)]
    epw = experts_per_wave or default_experts_per_wave(num_experts)
    num_waves = (num_experts + epw - 1) // epw if num_experts else 0
    wave_row_start = [offsets[min(w * epw, num_experts)] for w in range(num_waves)]
    wave_row_start += [num_rows, num_rows]
    return RowGrid(
        num_rows=num_rows,
        pairs_l1=n_blocks_l1,
        pairs_l2=n_blocks_l2,
        row_expert=row_expert,
        expert_row_offset=offsets,
        wave_row_start=wave_row_start,
        num_waves=num_waves,
        row_record=row_record,
        row_block=row_block,
        row_split_n=row_split_n,
    )


def check_experts_per_wave(experts_per_wave) -> None:
    """``experts_per_wave`` is None (the default) or >= 1."""
    if experts_per_wave is not None and experts_per_wave < 1:
        raise ValueError(f"experts_per_wave must be >= 1 (or None for the default), got {experts_per_wave}")


def default_experts_per_wave(num_local_experts: int) -> int:
    """Experts per wave when the caller does not choose: a quarter of the local
    experts (at least 1), so there are ~4 waves and hence wave boundaries at which
    the expert-wave schedule shows its L2 bursts, as in upstream's multi-wave runs."""
    return max(1, num_local_experts // 4)


def default_lead(block_n: int, k_sm: int, intermediate: int) -> int:
    """Integer lead D >= 1 at the knee: the ceiling of D_knee (paper eq. 16, ``xstage.model.d_knee``)."""
    return max(1, int(math.ceil(model.d_knee(block_n, k_sm, intermediate) - 1e-9)))


def balanced_l2_start(grid: RowGrid, num_pairs: int, *, block_m: int, hidden: int, intermediate: int) -> List[int]:
    """``RowGrid.l2_start`` for ``num_pairs`` pairs (host side): pair g keeps L1 residue class g;
    the L2 classes are assigned so that the dearest L1 classes get the cheapest L2 classes
    (sorted pairing, which minimises the largest sum of two assigned costs). A pair tile costs
    its WGMMA work: K (L1 H, L2 I) times its rows -- 64 for a half tile (the kernel runs a CTA's
    m-block of <= 64 valid rows as one; here: the pair's fuller member holds <= 64 rows), else
    ``block_m``."""
    G = num_pairs
    records = np.asarray(grid.row_record, dtype=np.int64).reshape(-1, 4)
    left = records[:, 3] - records[:, 1] * grid.row_block  # rows of each scheduler row
    most = np.clip(left, 0, block_m)  # the fuller member's rows: member 0 takes the first block_m of them
    rows_cost = np.where(most <= 64, 64, block_m).astype(np.float64)

    def class_costs(pairs_per_row, k_dim):
        k = np.arange(len(rows_cost) * pairs_per_row)
        return np.bincount(k % G, weights=np.repeat(rows_cost * k_dim, pairs_per_row), minlength=G)

    c1 = class_costs(grid.pairs_l1, hidden)
    c2 = class_costs(grid.pairs_l2, intermediate)
    l2_start = [0] * G
    for g, residue in zip(np.argsort(-c1, kind="stable"), np.argsort(c2, kind="stable")):
        l2_start[int(g)] = int(residue)
    return l2_start


def schedule_table(schedule: "Schedule", grid: RowGrid) -> List[int]:
    """The schedule's small int32 table for the kernel (one argument serves both): expert_wave
    reads it as ``wave_row_start``, interleaved with ``balance_l2`` as ``l2_start``."""
    if schedule.name == "expert_wave":
        return list(grid.wave_row_start)
    return list(grid.l2_start) if schedule.balance_l2 else [0]


def enumerate_order(schedule: Schedule, grid: RowGrid, g: int, G: int, r: int) -> List[Tile]:
    """Python reference: the full tile sequence of CTA (g, r)."""
    if not (0 <= g < G) or r not in (0, 1):
        raise ValueError(f"bad instance g={g} G={G} r={r}")
    if schedule.balance_l2 and (grid.l2_start is None or len(grid.l2_start) != G):
        raise ValueError(f"balance_l2 needs grid.l2_start for {G} pairs (balanced_l2_start)")
    return list(schedule.tiles(grid, g, G, r))


def enumerate_all(schedule: Schedule, grid: RowGrid, num_ctas: int) -> List[List[Tile]]:
    """Sequences of every CTA; CTA c = pair g = c // 2, role r = c % 2."""
    if num_ctas % 2:
        raise ValueError("number of CTAs must be even (pairs)")
    G = num_ctas // 2
    return [enumerate_order(schedule, grid, c // 2, G, c % 2) for c in range(num_ctas)]


def tile_key(t: Tile) -> Tuple[int, int, int, int]:
    return (int(t.phase), int(t.row), int(t.m_block), int(t.n_block))
