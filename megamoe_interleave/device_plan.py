"""The fused kernel's plan for one destination rank from device tensors, without a host sync
(the first step of the device-side plan; :class:`~megamoe_interleave.api.MegaMoE` still plans on
the host, and the kernel still takes ``num_rows`` / ``n_pool`` and its grid from the host).

:func:`plan_on_device` computes what the host planner (:func:`reference.permute_ranks`,
:func:`scheduler.make_row_grid`, :func:`scheduler.balanced_l2_start`,
:func:`scheduler.schedule_table`) gives the kernel today -- the Dispatch source table, the
routing weights, the row records, the schedule table -- with torch operations of static shapes
only: no ``.item()``, no ``nonzero`` / boolean indexing, no ``bincount`` (it reads its maximum
back on CUDA). Outputs are sized from ``max_tokens_per_rank`` once (:func:`plan_sizes`); the
counts it produces (``n_pool``, ``num_rows``) stay on the device, and the entries past them
are zero. ``tests/test_megamoe_device_plan.py`` checks it against the host planner exactly for
random routings (masked picks, zero-token experts, empty ranks, every destination rank).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .scheduler import Schedule, default_experts_per_wave, pool_rows_per_row


@dataclass(frozen=True)
class PlanSizes:
    """Static sizes of one rank's plan: pool rows and scheduler rows (upper bounds), schedule
    table entries."""

    max_pool: int
    max_rows: int
    table: int


def plan_sizes(world_size: int, max_tokens: int, topk: int, experts_per_rank: int, *, block_m: int,
               schedule: Schedule, num_pairs: int, experts_per_wave: int | None = None) -> PlanSizes:
    """Every slot of every source may route here; each local expert adds at most one partial row."""
    max_pool = world_size * max_tokens * topk
    row_block = pool_rows_per_row(block_m, True)
    max_rows = -(-max_pool // row_block) + experts_per_rank
    if schedule.name == "expert_wave":
        epw = experts_per_wave or default_experts_per_wave(experts_per_rank)
        table = -(-experts_per_rank // epw) + 2
    else:
        table = num_pairs if schedule.balance_l2 else 1
    return PlanSizes(max_pool, max_rows, table)


@dataclass
class DevicePlan:
    """One destination rank's plan, on the device. ``pool_src`` rows are (source rank, source
    token, pick); ``row_record`` rows are (local expert, m-block in the expert, first pool row of
    the expert, tokens of the expert). ``n_pool`` and ``num_rows`` are 0-dim int32 tensors."""

    counts: torch.Tensor  # [E_local] int32
    n_pool: torch.Tensor
    pool_src: torch.Tensor  # [max_pool, 3] int32
    pool_weight: torch.Tensor  # [max_pool] float32
    num_rows: torch.Tensor
    row_record: torch.Tensor  # [max_rows, 4] int32
    schedule_table: torch.Tensor  # [table] int32


def plan_on_device(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_tokens: torch.Tensor, dst_rank: int, *,
                   experts_per_rank: int, block_m: int, schedule: Schedule, num_pairs: int, pairs_l1: int,
                   pairs_l2: int, hidden: int, intermediate: int,
                   experts_per_wave: int | None = None) -> DevicePlan:
    """The plan of ``dst_rank`` from every source's routing: ``topk_idx`` / ``topk_weights``
    [P, max_tokens, k] (the symmetric buffers; -1 = masked pick), ``num_tokens`` [P] (device).
    Scheduler rows are 2 * block_m pool rows (the CTA pair splits them along M)."""
    P, T, k = topk_idx.shape
    el, dev = experts_per_rank, topk_idx.device
    sizes = plan_sizes(P, T, k, el, block_m=block_m, schedule=schedule, num_pairs=num_pairs,
                       experts_per_wave=experts_per_wave)
    i64 = dict(dtype=torch.int64, device=dev)

    # Slots (source, token, pick) in flat order; the ones for this rank's experts get keys
    # 0..el-1, everything else the sentinel el. A stable sort keeps (source, token, pick) order
    # within an expert, as the host planner's.
    local = topk_idx.to(torch.int64) - dst_rank * el
    live = torch.arange(T, device=dev)[None, :, None] < num_tokens.to(torch.int64)[:, None, None]
    key = torch.where(live & (local >= 0) & (local < el), local, el).reshape(-1)
    counts = torch.zeros(el + 1, **i64).scatter_add_(0, key, torch.ones_like(key))[:el]
    order = torch.sort(key, stable=True).indices
    n_pool = counts.sum()
    in_pool = torch.arange(sizes.max_pool, device=dev) < n_pool
    src = order // (T * k)
    tok = (order % (T * k)) // k
    pick = order % k
    pool_src = torch.where(in_pool[:, None], torch.stack([src, tok, pick], 1), 0).to(torch.int32)
    pool_weight = torch.where(in_pool, topk_weights.reshape(-1)[order].float(), 0.0)

    # Row records: ceil(count / row_block) rows per expert.
    row_block = pool_rows_per_row(block_m, True)
    m_blocks = (counts + row_block - 1) // row_block
    row_ends = torch.cumsum(m_blocks, 0)
    num_rows = row_ends[-1] if el else torch.zeros((), **i64)
    row_starts = row_ends - m_blocks
    tok_starts = torch.cumsum(counts, 0) - counts
    rows = torch.arange(sizes.max_rows, device=dev)
    e = torch.searchsorted(row_ends, rows, right=True).clamp(max=max(el - 1, 0))
    in_grid = rows < num_rows
    record = torch.stack([e, rows - row_starts[e], tok_starts[e], counts[e]], 1)
    row_record = torch.where(in_grid[:, None], record, 0)

    # The schedule table (scheduler.schedule_table).
    if schedule.name == "expert_wave":
        epw = experts_per_wave or default_experts_per_wave(el)
        firsts = torch.arange(sizes.table - 2, device=dev) * epw
        starts = torch.where(firsts > 0, row_ends[(firsts - 1).clamp(min=0, max=max(el - 1, 0))], 0)
        table = torch.cat([starts, num_rows.reshape(1), num_rows.reshape(1)])
    elif schedule.balance_l2:
        table = _balanced_l2_start(row_record, in_grid, num_rows, num_pairs, block_m, pairs_l1, pairs_l2, hidden,
                                   intermediate)
    else:
        table = torch.zeros(1, **i64)
    return DevicePlan(counts.to(torch.int32), n_pool.to(torch.int32), pool_src, pool_weight,
                      num_rows.to(torch.int32), row_record.to(torch.int32), table.to(torch.int32))


def _balanced_l2_start(row_record, in_grid, num_rows, G, block_m, pairs_l1, pairs_l2, hidden, intermediate):
    """scheduler.balanced_l2_start on the device: a pair tile costs K times its rows (64 for a
    half tile, where the pair's fuller member holds <= 64 rows); the dearest L1 residue classes
    get the cheapest L2 classes."""
    dev = row_record.device
    left = row_record[:, 3] - row_record[:, 1] * pool_rows_per_row(block_m, True)
    most = left.clamp(min=0, max=block_m)
    cost = torch.where(in_grid, torch.where(most <= 64, 64.0, float(block_m)), 0.0).to(torch.float64)

    def class_costs(pairs_per_row, k_dim):
        kk = torch.arange(cost.numel() * pairs_per_row, device=dev)
        w = torch.where(kk < num_rows * pairs_per_row, cost.repeat_interleave(pairs_per_row) * k_dim, 0.0)
        return torch.zeros(G, dtype=torch.float64, device=dev).scatter_add_(0, kk % G, w)

    c1, c2 = class_costs(pairs_l1, hidden), class_costs(pairs_l2, intermediate)
    start = torch.empty(G, dtype=torch.int64, device=dev)
    start[torch.argsort(-c1, stable=True)] = torch.argsort(c2, stable=True)
    return start
