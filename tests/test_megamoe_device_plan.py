"""megamoe_interleave.device_plan against the host planner, exactly: 200 random routings (masked
picks, zero-token experts, empty ranks, every destination rank, both schedules, both pair splits) on the CPU; on a
GPU the same plan once more under torch's sync debug mode (no host sync)."""
import dataclasses

import pytest
import torch

from megamoe_interleave.device_plan import plan_on_device, plan_sizes
from megamoe_interleave.reference import permute_ranks
from megamoe_interleave.row_grid import balanced_l2_start, make_row_grid, schedule_table
from megamoe_interleave.scheduler import ExpertWaveSchedule, InterleavedSchedule

BLOCK_M, HIDDEN, INTER = 128, 512, 256
SCHEDULES = [ExpertWaveSchedule(), InterleavedSchedule(lead=2, balance_l2=True)]


def _routing(g, P, T, k, E, mask, hot):
    """[P, T, k] expert ids (-1 masked; ``hot``: most picks go to a few experts, the rest none)."""
    if hot:
        pool = torch.randperm(E, generator=g)[: max(1, E // 8)]
        idx = pool[torch.randint(len(pool), (P, T, k), generator=g)]
    else:
        idx = torch.randint(E, (P, T, k), generator=g)
    idx = torch.where(torch.rand(P, T, k, generator=g) < mask, -1, idx)
    return idx, torch.rand(P, T, k, generator=g)


def _host_plan(idx, w, num_tokens, d, el, schedule, G, epw):
    perm = permute_ranks([idx[s, : num_tokens[s]] for s in range(idx.shape[0])],
                         [w[s, : num_tokens[s]] for s in range(idx.shape[0])], [d], el)[d]
    grid = make_row_grid(perm.counts_host, block_m=BLOCK_M, n_blocks_l1=2 * INTER // 128, n_blocks_l2=HIDDEN // 128,
                         experts_per_wave=epw)
    if schedule.balance_l2:
        grid = dataclasses.replace(grid, l2_start=balanced_l2_start(grid, G, block_m=BLOCK_M, hidden=HIDDEN,
                                                                    intermediate=INTER))
    return perm, grid, schedule_table(schedule, grid)


def _device_plan(idx, w, num_tokens, d, el, schedule, G, epw, device="cpu"):
    return plan_on_device(idx.to(device), w.to(device), torch.tensor(num_tokens, device=device), d,
                          experts_per_rank=el, row_block=2 * BLOCK_M, schedule=schedule,
                          num_pairs=G, pairs_l1=2 * INTER // 128, pairs_l2=HIDDEN // 128,
                          hidden=HIDDEN, intermediate=INTER, experts_per_wave=epw)


def _check_equal(host, dev):
    perm, grid, table = host
    n = perm.src_rank.numel()
    assert int(dev.n_pool) == n and dev.counts.tolist() == perm.counts_host
    src = torch.stack([perm.src_rank, perm.src_token, perm.src_pick], 1).to(torch.int32)
    assert torch.equal(dev.pool_src[:n].cpu(), src) and not dev.pool_src[n:].any()
    assert torch.equal(dev.pool_weight[:n].cpu(), perm.weights.float()) and not dev.pool_weight[n:].any()
    assert int(dev.num_rows) == grid.num_rows
    assert dev.row_record[: grid.num_rows].tolist() == [list(r) for r in grid.row_record]
    assert not dev.row_record[grid.num_rows:].any()
    assert dev.schedule_table.tolist() == list(table)


def test_the_device_plan_is_the_host_plan_for_200_random_routings():
    g = torch.Generator().manual_seed(2026)
    checked = set()
    for trial in range(200):
        P = [1, 2, 4, 8][trial % 4]
        el = int(torch.randint(1, 9, (1,), generator=g))
        T = int(torch.randint(1, 300, (1,), generator=g))
        k = int(torch.randint(1, min(8, P * el) + 1, (1,), generator=g))
        num_tokens = torch.randint(0, T + 1, (P,), generator=g).tolist()
        if trial % 7 == 0:
            num_tokens[0] = 0  # an empty source rank
        idx, w = _routing(g, P, T, k, P * el, mask=[0.0, 0.1, 0.5][trial % 3], hot=trial % 5 == 0)
        d = trial % P
        schedule = SCHEDULES[trial % 2]
        G = int(torch.randint(1, 66, (1,), generator=g))
        epw = [None, 1, 3][trial % 3]
        host = _host_plan(idx, w, num_tokens, d, el, schedule, G, epw)
        _check_equal(host, _device_plan(idx, w, num_tokens, d, el, schedule, G, epw))
        perm = host[0]
        checked.add(("zero-token expert", 0 in perm.counts_host))
        checked.add(("masked", bool((idx < 0).any())))
        checked.add(("half-tile rows", any(0 < c % 256 <= 64 for c in perm.counts_host)))
        checked.add(("multi-row expert", any(c > 256 for c in perm.counts_host)))
    assert {("zero-token expert", True), ("masked", True), ("half-tile rows", True),
            ("multi-row expert", True)} <= checked


def test_plan_sizes_bound_every_plan():
    s = plan_sizes(8, 256, 6, 4, row_block=2 * BLOCK_M, schedule=SCHEDULES[0], num_pairs=66)
    assert s.max_pool == 8 * 256 * 6 and s.max_rows == -(-s.max_pool // 256) + 4 and s.table == 4 // 1 + 2
    assert plan_sizes(8, 256, 6, 4, row_block=2 * BLOCK_M, schedule=SCHEDULES[1], num_pairs=66).table == 66
    # every slot to one expert: one expert's rows fill the bound's first term
    idx = torch.zeros(8, 256, 6, dtype=torch.int64)
    dev = _device_plan(idx, torch.ones(8, 256, 6), [256] * 8, 0, 4, SCHEDULES[1], 66, None)
    assert int(dev.num_rows) == 8 * 256 * 6 // 256 and dev.row_record.shape[0] == s.max_rows


@pytest.mark.gpu
def test_the_device_plan_needs_no_host_sync():
    g = torch.Generator().manual_seed(7)
    idx, w = _routing(g, 8, 512, 6, 64, mask=0.1, hot=False)
    num_tokens = [512, 300, 0, 512, 17, 512, 256, 511]
    args = (idx, w, num_tokens, 3, 8, SCHEDULES[1], 66, None)
    dev_in = (idx.cuda(), w.cuda(), torch.tensor(num_tokens, device="cuda"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan = plan_on_device(*dev_in, 3, experts_per_rank=8, row_block=2 * BLOCK_M, schedule=SCHEDULES[1],
                              num_pairs=66, pairs_l1=2 * INTER // 128, pairs_l2=HIDDEN // 128, hidden=HIDDEN,
                              intermediate=INTER)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _check_equal(_host_plan(*args), plan)
