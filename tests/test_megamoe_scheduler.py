"""CPU tests of the MoE tile schedulers (Python reference of megamoe_interleave.scheduler)."""
import dataclasses
from collections import Counter

import pytest
from hypothesis import given, settings, strategies as st

from megamoe_interleave.row_grid import (
    balanced_l2_start,
    default_lead,
    enumerate_all,
    enumerate_order,
    make_row_grid,
    tile_key,
)
from megamoe_interleave.scheduler import (
    PHASE_L1,
    PHASE_L2,
    ExpertWaveSchedule,
    InterleavedSchedule,
    l1_tiles_of_row,
    row_splits_n,
    schedule_of,
    tile_pool_row,
)

grids = st.builds(
    lambda counts, bm, p1, p2, epw, row_split_n: make_row_grid(
        counts, block_m=bm, n_blocks_l1=2 * p1, n_blocks_l2=2 * p2, experts_per_wave=epw, row_split_n=row_split_n),
    st.lists(st.integers(0, 300), min_size=1, max_size=12),
    st.sampled_from([16, 64, 128]),
    st.integers(1, 6),
    st.integers(1, 6),
    st.integers(1, 5),
    # the pair splits every row along M, or rows of <= BM rows along N (row_split_n)
    st.booleans(),
)
schedules = st.one_of(
    st.just(ExpertWaveSchedule()),
    st.just(ExpertWaveSchedule(l2_columns=True)),
    st.integers(1, 6).map(lambda d: InterleavedSchedule(lead=d)),
    st.integers(1, 6).map(lambda d: InterleavedSchedule(lead=d, balance_l2=True)),
)
cta_counts = st.sampled_from([2, 4, 6, 10])


def _balanced(grid, G):
    """``grid`` with the balance_l2 table for G pairs (the correctness properties hold for any
    permutation; this is the one the API uses)."""
    return dataclasses.replace(grid, l2_start=balanced_l2_start(grid, G, block_m=64, hidden=256, intermediate=128))


def _enumerate_all(schedule, grid, num_ctas):
    return enumerate_all(schedule, _balanced(grid, num_ctas // 2), num_ctas)


def _splits_n(grid, row):
    """row_split_n: the scheduler row holds at most block_m of its expert's rows."""
    e, m, _, count = grid.row_record[row]
    return grid.row_split_n and row_splits_n(grid, m, count)


def _all_tiles(grid):
    """(phase, row, m_block, n_block) of every tile: a row's two M halves times every N-block
    (row_split_n: a row of <= block_m rows, its first M half times every N-block)."""
    out = set()
    for p in range(grid.num_rows):
        m = p - grid.expert_row_offset[grid.row_expert[p]]
        if _splits_n(grid, p):
            out |= {(PHASE_L1, p, 2 * m, n) for n in range(grid.pairs_l1)}
            out |= {(PHASE_L2, p, 2 * m, n) for n in range(grid.pairs_l2)}
        else:
            for r in (0, 1):
                out |= {(PHASE_L1, p, 2 * m + r, n) for n in range(grid.pairs_l1)}
                out |= {(PHASE_L2, p, 2 * m + r, n) for n in range(grid.pairs_l2)}
    return out


@settings(max_examples=150, deadline=None)
@given(grids, schedules, cta_counts)
def test_every_tile_exactly_once(grid, schedule, num_ctas):
    seqs = _enumerate_all(schedule, grid, num_ctas)
    keys = [tile_key(t) for seq in seqs for t in seq]
    counts = Counter(keys)
    assert all(c == 1 for c in counts.values()), [k for k, c in counts.items() if c > 1][:5]
    assert set(keys) == _all_tiles(grid)
    l1 = Counter(k[1] for k in keys if k[0] == PHASE_L1)  # what an L2 tile's l2_full wait counts
    assert all(l1[p] == _l1_tiles(grid)(p) for p in range(grid.num_rows))


@settings(max_examples=150, deadline=None)
@given(grids, schedules, cta_counts)
def test_tile_fields_consistent(grid, schedule, num_ctas):
    """expert / m_block agree with the row layout; pair members take the same n and M block
    2 (row - O_e) + r (a row split along N: n = 2j + r of M block 2 (row - O_e))."""
    for c, seq in enumerate(_enumerate_all(schedule, grid, num_ctas)):
        for t in seq:
            e = t.expert
            assert grid.expert_row_offset[e] <= t.row < grid.expert_row_offset[e + 1]
            if _splits_n(grid, t.row):
                assert t.m_block == 2 * (t.row - grid.expert_row_offset[e])
                assert t.n_block % 2 == c % 2 and 0 <= t.n_block < max(grid.pairs_l1, grid.pairs_l2)
            else:
                assert t.m_block == 2 * (t.row - grid.expert_row_offset[e]) + c % 2
                assert 0 <= t.n_block < max(grid.pairs_l1, grid.pairs_l2)


@settings(max_examples=100, deadline=None)
@given(grids, schedules, cta_counts)
def test_pair_members_walk_the_same_tiles(grid, schedule, num_ctas):
    """The two CTAs of a pair (one 2-CTA cluster in the tma_ws_mcast* kernels) visit the same
    rows in the same order with the same K loops, and share the multicast operand: the same
    N block (B), or in a row split along N the same M block (A)."""
    seqs = _enumerate_all(schedule, grid, num_ctas)
    for a, b in zip(seqs[0::2], seqs[1::2]):
        assert [(t.phase, t.row) for t in a] == [(t.phase, t.row) for t in b]
        for ta, tb in zip(a, b):
            shared = "m_block" if _splits_n(grid, ta.row) else "n_block"
            assert getattr(ta, shared) == getattr(tb, shared)


@settings(max_examples=150, deadline=None)
@given(grids, schedules, cta_counts)
def test_per_cta_l1_before_l2_for_every_row(grid, schedule, num_ctas):
    """Invariant I of the deadlock-freedom proof."""
    for seq in _enumerate_all(schedule, grid, num_ctas):
        seen_l2_rows = set()
        for t in seq:
            if t.phase == PHASE_L2:
                seen_l2_rows.add(t.row)
            else:
                assert t.row not in seen_l2_rows, "L1 tile after an L2 tile of its row"


def _l1_need(num_l1_per_row):
    """A row's L1 tile count as a function of the row (``num_l1_per_row``: an int or already one)."""
    return num_l1_per_row if callable(num_l1_per_row) else (lambda row: num_l1_per_row)


def _l1_tiles(grid):
    """Row -> the L1 tiles that finish it (scheduler.l1_tiles_of_row: fewer in rows split along N)."""
    return lambda row: l1_tiles_of_row(grid, grid.row_record[row][1], grid.row_record[row][3])


def _simulate_deadlock_free(seqs, num_l1_per_row):
    """Run CTAs in lock-free rounds: a CTA advances if its head is L1 or an L2 whose row's
    L1 tiles are all done. Returns True if every CTA finishes."""
    need = _l1_need(num_l1_per_row)
    heads = [0] * len(seqs)
    l1_done = Counter()
    while True:
        progressed = False
        for c, seq in enumerate(seqs):
            if heads[c] < len(seq):
                t = seq[heads[c]]
                if t.phase == PHASE_L1 or l1_done[t.row] == need(t.row):
                    if t.phase == PHASE_L1:
                        l1_done[t.row] += 1
                    heads[c] += 1
                    progressed = True
        if all(h == len(s) for h, s in zip(heads, seqs)):
            return True
        if not progressed:
            return False


@settings(max_examples=100, deadline=None)
@given(grids, schedules, cta_counts)
def test_no_deadlock_in_dependency_simulation(grid, schedule, num_ctas):
    seqs = _enumerate_all(schedule, grid, num_ctas)
    assert _simulate_deadlock_free(seqs, _l1_tiles(grid))


@settings(max_examples=150, deadline=None)
@given(grids, st.integers(1, 6), cta_counts, st.booleans())
def test_interleaved_lead_respected(grid, lead, num_ctas, balance):
    """An L2 tile of row p is emitted only when the CTA's L1 cursor is at row >= p + D
    or the L1 stream is exhausted."""
    schedule = InterleavedSchedule(lead=lead, balance_l2=balance)
    G = num_ctas // 2
    grid = _balanced(grid, G)
    for c in range(num_ctas):
        g, r = c // 2, c % 2
        cursor = schedule.init(g, grid)
        while not schedule.done(cursor, grid):
            k1, _ = cursor
            tile, cursor = schedule.step(cursor, g, G, r, grid)
            if tile.phase == PHASE_L2 and k1 < grid.num_rows * grid.pairs_l1:
                assert tile.row + lead <= k1 // grid.pairs_l1


def test_lead_zero_rejected():
    with pytest.raises(ValueError):
        InterleavedSchedule(lead=0)
    with pytest.raises(ValueError, match="unknown schedule"):
        schedule_of("bogus")
    with pytest.raises(TypeError):  # an option the schedule does not have
        schedule_of("expert_wave", lead=2)
    assert schedule_of("interleaved", lead=3) == InterleavedSchedule(lead=3)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3000), min_size=1, max_size=40), st.sampled_from([8, 16, 30, 66]), st.booleans())
def test_balance_l2_evens_out_the_pairs(counts, G, row_split_n):
    """balanced_l2_start is a permutation of the pairs, and with it the largest per-pair work
    (the cost model's: K x rows of every pair tile) is never above the plain round-robin's
    (sorted pairing minimises the largest sum, and the identity is one of the pairings)."""
    grid = make_row_grid(counts, block_m=128, n_blocks_l1=16, n_blocks_l2=16, row_split_n=row_split_n)
    H, I = 1024, 512
    start = balanced_l2_start(grid, G, block_m=128, hidden=H, intermediate=I)
    assert sorted(start) == list(range(G))

    def pair_work(schedule, grid):
        work = []
        for g in range(G):
            w = 0
            for a in enumerate_order(schedule, grid, g, G, 0):
                w += (H if a.phase == PHASE_L1 else I) * 128
            work.append(w)
        return work

    plain = pair_work(InterleavedSchedule(lead=2), grid)
    balanced = pair_work(InterleavedSchedule(lead=2, balance_l2=True), dataclasses.replace(grid, l2_start=start))
    assert sum(plain) == sum(balanced)
    assert max(balanced) <= max(plain)


def test_balance_l2_needs_the_table():
    grid = make_row_grid([500, 300], block_m=128, n_blocks_l1=4, n_blocks_l2=4)
    with pytest.raises(ValueError, match="l2_start"):
        enumerate_order(InterleavedSchedule(lead=1, balance_l2=True), grid, 0, 3, 0)
    with pytest.raises(TypeError):
        ExpertWaveSchedule(balance_l2=True)


def test_deadlock_possible_with_lead_zero_shows_invariant_matters():
    """Sanity check that the simulation can fail: a hand-built order violating invariant I
    (one CTA emits L2 of row 0 before its own L1 tile of row 0) deadlocks."""
    from megamoe_interleave.scheduler import Tile

    grid = make_row_grid([64], block_m=64, n_blocks_l1=1, n_blocks_l2=1)
    good = [
        [Tile(1, PHASE_L1, 0, 0, 0, 0), Tile(1, PHASE_L2, 0, 0, 0, 0)],
        [Tile(1, PHASE_L1, 0, 0, 1, 0), Tile(1, PHASE_L2, 0, 0, 1, 0)],
    ]
    bad = [good[0][::-1], good[1]]
    assert _simulate_deadlock_free(good, 2 * grid.pairs_l1)
    assert not _simulate_deadlock_free(bad, 2 * grid.pairs_l1)


def _simulate_windowed_dispatch(seqs, num_l1_per_row, num_rows, window, pace):
    """The dependency simulation with Dispatch threads, one per CTA, that copy rows 0, 1, ... in
    order (a row is dispatched once every thread is past it; an L1 tile needs its row
    dispatched) and are paced by the tiles: a thread copies row r only if r < ``window`` or
    row r - window's L1 tiles have ``pace`` = "started" (at least one) or "done" (all). This is
    the windowed Dispatch proposed in docs/status.md, which keeps the pool rows in L2 until
    read. Returns True if every CTA and every Dispatch thread finishes."""
    need = _l1_need(num_l1_per_row)
    heads = [0] * len(seqs)
    disp = [0] * len(seqs)
    started, done = Counter(), Counter()
    while True:
        progressed = False
        for c, seq in enumerate(seqs):
            if heads[c] < len(seq):
                t = seq[heads[c]]
                ready = min(disp) > t.row if t.phase == PHASE_L1 else done[t.row] == need(t.row)
                if ready:
                    if t.phase == PHASE_L1:
                        started[t.row] += 1
                        done[t.row] += 1
                    heads[c] += 1
                    progressed = True
            r = disp[c]
            if r < num_rows:
                q = r - window
                if q < 0 or (started[q] >= 1 if pace == "started" else done[q] == need(q)):
                    disp[c] += 1
                    progressed = True
        if all(h == len(s) for h, s in zip(heads, seqs)) and min(disp) == num_rows:
            return True
        if not progressed:
            return False


@settings(max_examples=100, deadline=None)
@given(grids, schedules, cta_counts, st.integers(1, 4), st.sampled_from(["started", "done"]))
def test_windowed_dispatch_cannot_deadlock(grid, schedule, num_ctas, window, pace):
    """A Dispatch that waits for the tiles keeps the schedules deadlock-free as long as it waits
    only on rows it has already dispatched (window >= 1). Take the lowest row at which any
    Dispatch thread waits: every thread is past row r - W, so that row's L1 tiles have their
    input, and the tiles before them in their CTAs depend on lower rows only (invariant I, the
    lead)."""
    seqs = _enumerate_all(schedule, grid, num_ctas)
    assert _simulate_windowed_dispatch(seqs, _l1_tiles(grid), grid.num_rows, window, pace)


def test_windowed_dispatch_waiting_on_its_own_row_deadlocks():
    """The simulation can fail: with window 0 a Dispatch thread waits for the tiles of the row
    it is about to copy."""
    grid = make_row_grid([300, 200], block_m=64, n_blocks_l1=4, n_blocks_l2=4)
    seqs = _enumerate_all(InterleavedSchedule(lead=2), grid, 4)
    assert _simulate_windowed_dispatch(seqs, 2 * grid.pairs_l1, grid.num_rows, 1, "done")
    assert not _simulate_windowed_dispatch(seqs, 2 * grid.pairs_l1, grid.num_rows, 0, "started")


@pytest.mark.parametrize("p1,p2", [(8, 16), (4, 4), (16, 8), (6, 14)])
@pytest.mark.parametrize("lead", [1, 3, 8])
def test_interleaved_long_run_ratio_fixed_by_tile_shapes(p1, p2, lead):
    """In the steady state each CTA emits L1 : L2 tiles in the ratio P1 : P2, whatever D."""
    grid = make_row_grid([128 * 2000], block_m=128, n_blocks_l1=2 * p1, n_blocks_l2=2 * p2)
    G = 16
    seq = enumerate_order(InterleavedSchedule(lead=lead), grid, 5, G, 0)
    n = len(seq)
    mid = seq[n // 4 : 3 * n // 4]  # away from the warm-up (L1 only) and the L2-only tail
    n1 = sum(t.phase == PHASE_L1 for t in mid)
    n2 = sum(t.phase == PHASE_L2 for t in mid)
    assert n1 / n2 == pytest.approx(p1 / p2, rel=0.05)
    # Interleaving really interleaves: no long runs of L2 tiles in the steady state.
    longest, run = 0, 0
    for t in mid:
        run = run + 1 if t.phase == PHASE_L2 else 0
        longest = max(longest, run)
    assert longest <= -(-p2 // p1) + 1


def test_expert_wave_runs_l2_in_bursts():
    """Expert-wave emits each wave's L2 tiles consecutively (the bursts the paper fixes)."""
    grid = make_row_grid([512] * 8, block_m=64, n_blocks_l1=16, n_blocks_l2=16, experts_per_wave=2)
    seq = enumerate_order(ExpertWaveSchedule(), grid, 0, 4, 0)
    phases = "".join("1" if t.phase == PHASE_L1 else "2" for t in seq)
    # 4 waves -> exactly 4 L1 runs and 4 L2 runs.
    runs = [c for i, c in enumerate(phases) if i == 0 or phases[i - 1] != c]
    assert runs == ["1", "2"] * 4


def test_empty_grid_and_empty_waves():
    grid = make_row_grid([0, 0, 0], block_m=64, n_blocks_l1=4, n_blocks_l2=4, experts_per_wave=1)
    for s in (ExpertWaveSchedule(), InterleavedSchedule(lead=2)):
        assert all(seq == [] for seq in enumerate_all(s, grid, 4))


def test_bad_grid_inputs():
    with pytest.raises(ValueError, match="even"):  # a row split along N takes two N-blocks per pair tile
        make_row_grid([1], block_m=64, n_blocks_l1=3, n_blocks_l2=4, row_split_n=True)
    with pytest.raises(ValueError):
        make_row_grid([-1], block_m=64, n_blocks_l1=4, n_blocks_l2=4)


def test_default_lead_is_the_ceiling_of_eq16():
    # D_knee = b_n K_SM / (2 h_inter) (xstage.model.d_knee, tested in test_model): 4.125 -> 5
    assert default_lead(128, 132, 2048) == 5
    assert default_lead(128, 2, 4096) == 1


def test_l2_columns_visits_each_experts_l2_tiles_column_by_column():
    """expert_wave with l2_columns: in the grid-wide order each expert's L2 pair tiles run
    column-major (all its rows of one N column, then the next column) and keep the row-major
    order's positions; the L1 tiles and every other position are unchanged."""
    grid = make_row_grid([300, 0, 130, 70], block_m=64, n_blocks_l1=6, n_blocks_l2=4, experts_per_wave=2)
    G = 3

    def global_order(schedule):
        seqs = [enumerate_order(schedule, grid, g, G, 0) for g in range(G)]
        order = [None] * sum(len(s) for s in seqs)
        for g, seq in enumerate(seqs):
            for i, t in enumerate(seq):
                order[i * G + g] = t  # step i of pair g
        return [t for t in order if t is not None]

    rows, cols = global_order(ExpertWaveSchedule()), global_order(ExpertWaveSchedule(l2_columns=True))
    assert len(rows) == len(cols)
    for a, b in zip(rows, cols):
        assert (a.valid, a.phase, a.expert) == (b.valid, b.phase, b.expert)
        if a.phase == PHASE_L1:
            assert tile_key(a) == tile_key(b)
    for e in (0, 2, 3):
        l2 = [(t.m_block // 2, t.n_block) for t in cols if t.valid and t.phase == PHASE_L2 and t.expert == e]
        rows_e = -(-[300, 0, 130, 70][e] // grid.row_block)
        assert l2 == [(m, n) for n in range(grid.pairs_l2) for m in range(rows_e)], e
    with pytest.raises(TypeError):
        InterleavedSchedule(lead=2, l2_columns=True)


def test_divmod_small_float_path_is_exact():
    """int_ops.divmod_small's kernel path, floor((a + 1/2) * rcp(b)) in float32, modelled with
    numpy float32 and a reciprocal off by the worst relative error of rcp.approx (2^-23, both
    signs): exact for every a < 4096 and b < 256 (the L2 stream positions of one expert and
    its rows), and the host path is Python's divmod."""
    import numpy as np

    from megamoe_interleave.int_ops import divmod_small

    a = np.arange(4096, dtype=np.float32)[:, None]
    b = np.arange(1, 256, dtype=np.float32)[None, :]
    want = np.floor_divide(np.arange(4096)[:, None], np.arange(1, 256)[None, :])
    for eps in (-2.0 ** -23, 0.0, 2.0 ** -23):
        rcp = (np.float32(1.0) / b) * np.float32(1.0 + eps)
        got = ((a + np.float32(0.5)) * rcp).astype(np.int32)
        assert (got == want).all(), eps
    assert divmod_small(97, 6) == (16, 1) and divmod_small(0, 1) == (0, 0)


def _rows_read(tile, block_m):
    """The rows of ``tile``'s M block the kernel's W8A8 consumers load scales for: 64 for a half
    tile (<= 64 of its rows hold tokens, sm90_mainloop.consumer_tiles), else block_m."""
    return 64 if tile.count - tile.m_block * block_m <= 64 else block_m


@settings(max_examples=150, deadline=None)
@given(grids, schedules, cta_counts)
def test_tile_pool_rows_stay_inside_the_pool(grid, schedule, num_ctas):
    """Every per-row read of every tile (W8A8 scales) lands on a row of the tile's expert, so inside
    the pool (which ends one block past the last expert's tokens): the kernel reads no further."""
    n_pool = sum(rec[3] for rec in {r[0]: r for r in grid.row_record}.values())
    for seq in _enumerate_all(schedule, grid, num_ctas):
        for t in seq:
            for m in range(_rows_read(t, grid.row_block // 2)):
                row = tile_pool_row(t, m, grid.row_block // 2)
                assert t.tok0 <= row < t.tok0 + t.count <= n_pool


def test_unclamped_rows_of_an_empty_pair_member_ran_past_the_padded_pool():
    """Issue 39's illegal address: an expert whose last scheduler row holds 1-63 tokens gives CTA 1
    of the pair a block with none, which still runs (the pair shares the multicast weights) as a
    half tile; its rows tok0 + 128 + [0, 64) reached up to 63 rows past the pool's one padding
    block. tile_pool_row keeps them on the expert's last row."""
    block_m = 128
    grid = make_row_grid([100, 25], block_m=block_m, n_blocks_l1=2, n_blocks_l2=2)
    n_pad = 125 + block_m
    (seq0, seq1) = enumerate_all(ExpertWaveSchedule(), grid, 2)
    last = [t for t in seq1 if t.expert == 1]
    assert last and all(t.m_block == 1 for t in last)
    unclamped = max(t.tok0 + t.m_block * block_m + m for t in last for m in range(_rows_read(t, block_m)))
    assert unclamped >= n_pad  # what the kernel read before
    assert max(tile_pool_row(t, m, block_m) for t in last for m in range(64)) == 124
