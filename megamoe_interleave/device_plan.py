"""The fused kernel's plan for every destination rank from device tensors, without a host sync:
what :meth:`MegaMoE.enqueue <megamoe_interleave.api.MegaMoE.enqueue>` and a captured graph launch
the kernel with (``forward`` still plans on the host).

:func:`plan_all_ranks` computes what the host planner (:func:`reference.permute_ranks`,
:func:`row_grid.make_row_grid`, :func:`row_grid.balanced_l2_start`,
:func:`row_grid.schedule_table`) gives the kernel -- the Dispatch source table, the routing
weights, the row records, the schedule table, the pool and row counts -- with torch operations of
static shapes only: no ``.item()``, no ``nonzero`` / boolean indexing, no ``bincount`` (it reads
its maximum back on CUDA). Outputs are sized from ``max_tokens_per_rank`` once
(:func:`plan_sizes`); the counts (``n_pool``, ``num_rows``) stay on the device, and the entries
past them are zero. ``tests/test_megamoe_device_plan.py`` checks it against the host planner
exactly for random routings (masked picks, zero-token experts, empty ranks, every destination rank).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .config import BLOCK_M
from .row_grid import default_experts_per_wave
from .scheduler import Schedule


@dataclass(frozen=True)
class PlanSizes:
    """Static sizes of one rank's plan: pool rows and scheduler rows (upper bounds), schedule
    table entries."""

    max_pool: int
    max_rows: int
    table: int


def plan_sizes(world_size: int, max_tokens: int, topk: int, experts_per_rank: int, *, row_block: int,
               schedule: Schedule, num_pairs: int, experts_per_wave: int | None = None) -> PlanSizes:
    """Every slot of every source may route here; each local expert adds at most one partial row
    (``row_block``: pool rows per scheduler row, :attr:`~.config.MegaMoEConfig.row_block`)."""
    max_pool = world_size * max_tokens * topk
    max_rows = -(-max_pool // row_block) + experts_per_rank
    if schedule.name == "expert_wave":
        epw = experts_per_wave or default_experts_per_wave(experts_per_rank)
        table = -(-experts_per_rank // epw) + 2
    else:
        table = num_pairs if schedule.balance_l2 else 1
    return PlanSizes(max_pool, max_rows, table)


@dataclass
class DevicePlan:
    """One destination rank's plan, on the device (:func:`plan_all_ranks`: every field with a
    leading [P] dim). ``pool_src`` rows are (source rank, source token, pick); ``row_record`` rows
    are (local expert, m-block in the expert, first pool row of the expert, tokens of the expert).
    ``n_pool`` and ``num_rows`` are 0-dim int32 tensors."""

    counts: torch.Tensor  # [E_local] int32
    n_pool: torch.Tensor
    pool_src: torch.Tensor  # [max_pool, 3] int32
    pool_weight: torch.Tensor  # [max_pool] float32
    num_rows: torch.Tensor
    row_record: torch.Tensor  # [max_rows, 4] int32
    schedule_table: torch.Tensor  # [table] int32
    sizes: torch.Tensor  # [2] int32: (num_rows, n_pool), the kernel's mPlan


def plan_on_device(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_tokens: torch.Tensor, dst_rank: int,
                   **plan_args) -> DevicePlan:
    """The plan of ``dst_rank``: one rank of :func:`plan_all_ranks`, whose keyword arguments
    ``plan_args`` are."""
    plans = plan_all_ranks(topk_idx, topk_weights, num_tokens, **plan_args)
    return DevicePlan(*(getattr(plans, f.name)[dst_rank] for f in dataclasses.fields(DevicePlan)))


def sorted_slots(topk_idx, num_tokens, num_experts: int):
    """The slots (source, token, pick) of ``topk_idx`` [P, T, k] in flat order: their keys (the
    global expert id; the sentinel ``num_experts`` for dead, masked or out-of-range picks), the
    count per key [num_experts + 1] (int64) and the stable sort of the keys (int64 indices).

    The keys are sorted as int16 where they fit (any world of < 32767 experts): CUDA's radix sort
    then runs 2 digit passes instead of the 8 of int64 keys."""
    P, T, k = topk_idx.shape
    ids = topk_idx.to(torch.int64)
    live = torch.arange(T, device=ids.device)[None, :, None] < num_tokens.to(torch.int64)[:, None, None]
    key = torch.where(live & (ids >= 0) & (ids < num_experts), ids, num_experts).reshape(-1)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device).scatter_add_(0, key,
                                                                                         torch.ones_like(key))
    narrow = key.to(torch.int16) if num_experts < 2 ** 15 - 1 else key
    return key, counts, torch.sort(narrow, stable=True).indices


def plan_all_ranks(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_tokens: torch.Tensor, *,
                   experts_per_rank: int, row_block: int, schedule: Schedule, num_pairs: int, pairs_l1: int,
                   pairs_l2: int, hidden: int, intermediate: int,
                   experts_per_wave: int | None = None) -> DevicePlan:
    """Every destination rank's plan at once (each field with a leading [P] dim) from every
    source's routing: ``topk_idx`` / ``topk_weights`` [P, max_tokens, k] (the symmetric buffers;
    -1 = masked pick), ``num_tokens`` [P] (device). Scheduler rows are ``row_block`` pool rows
    (:attr:`~.config.MegaMoEConfig.row_block`: 2 * BLOCK_M, which the CTA pair splits along M).

    One stable sort of all slots by global expert id serves every rank: rank d's experts are
    consecutive ids, so its pool is one contiguous range of that order, in (source, token, pick)
    order within an expert as the host planner's. Everything else is batched over the ranks, so
    the op count does not grow with P (a graph of P = 8 ranks has the nodes of one)."""
    P, T, k = topk_idx.shape
    el, dev = experts_per_rank, topk_idx.device
    E = P * el
    sizes = plan_sizes(P, T, k, el, row_block=row_block, schedule=schedule, num_pairs=num_pairs,
                       experts_per_wave=experts_per_wave)
    i64 = dict(dtype=torch.int64, device=dev)

    # Slots (source, token, pick) in flat order keyed by global expert id; dead or masked slots
    # (and ids out of range, which the caller reports) get the sentinel E and sort last.
    key, counts, order = sorted_slots(topk_idx, num_tokens, E)
    counts = counts[:E].view(P, el)
    n_pool = counts.sum(1)  # [P]
    j = torch.arange(sizes.max_pool, device=dev)
    in_pool = j[None, :] < n_pool[:, None]
    o = order[((torch.cumsum(n_pool, 0) - n_pool)[:, None] + j[None, :]).clamp(max=key.numel() - 1)]
    src, tok, pick = o // (T * k), (o % (T * k)) // k, o % k
    pool_src = torch.where(in_pool[..., None], torch.stack([src, tok, pick], -1), 0).to(torch.int32)
    pool_weight = torch.where(in_pool, topk_weights.reshape(-1)[o].float(), 0.0)

    # Row records: ceil(count / row_block) rows per expert.
    m_blocks = (counts + row_block - 1) // row_block
    row_ends = torch.cumsum(m_blocks, 1)
    num_rows = row_ends[:, -1] if el else torch.zeros(P, **i64)
    rows = torch.arange(sizes.max_rows, device=dev)
    e = torch.searchsorted(row_ends, rows.expand(P, -1).contiguous(), right=True).clamp(max=max(el - 1, 0))
    in_grid = rows[None, :] < num_rows[:, None]
    at = lambda v: torch.gather(v, 1, e)  # noqa: E731  (per row: its expert's value)
    record = torch.stack([e, rows[None, :] - at(row_ends - m_blocks), at(torch.cumsum(counts, 1) - counts),
                          at(counts)], -1)
    row_record = torch.where(in_grid[..., None], record, 0)

    # The schedule table (row_grid.schedule_table).
    if schedule.name == "expert_wave":
        epw = experts_per_wave or default_experts_per_wave(el)
        firsts = torch.arange(sizes.table - 2, device=dev) * epw
        starts = torch.where(firsts[None, :] > 0, row_ends[:, (firsts - 1).clamp(min=0, max=max(el - 1, 0))], 0)
        table = torch.cat([starts, num_rows[:, None], num_rows[:, None]], 1)
    elif schedule.balance_l2:
        table = _balanced_l2_start(row_record, in_grid, num_rows, num_pairs, row_block, pairs_l1, pairs_l2, hidden,
                                   intermediate)
    else:
        table = torch.zeros(P, 1, **i64)
    sizes = torch.stack([num_rows, n_pool], 1).to(torch.int32)
    return DevicePlan(counts.to(torch.int32), sizes[:, 1], pool_src, pool_weight, sizes[:, 0],
                      row_record.to(torch.int32), table.to(torch.int32), sizes)


def _balanced_l2_start(row_record, in_grid, num_rows, G, row_block, pairs_l1, pairs_l2, hidden, intermediate):
    """row_grid.balanced_l2_start on the device, per rank: a pair tile costs K times its rows (64
    for a half tile, where the pair's fuller member holds <= 64 rows); the dearest L1 residue
    classes get the cheapest L2 classes."""
    P, dev = row_record.shape[0], row_record.device
    left = row_record[..., 3] - row_record[..., 1] * row_block
    most = left.clamp(min=0, max=BLOCK_M)
    cost = torch.where(in_grid, torch.where(most <= 64, 64.0, float(BLOCK_M)), 0.0).to(torch.float64)

    def class_costs(pairs_per_row, k_dim):
        kk = torch.arange(cost.shape[1] * pairs_per_row, device=dev)
        w = torch.where(kk[None, :] < (num_rows * pairs_per_row)[:, None],
                        cost.repeat_interleave(pairs_per_row, dim=1) * k_dim, 0.0)
        return torch.zeros(P, G, dtype=torch.float64, device=dev).scatter_add_(1, (kk % G).expand(P, -1), w)

    c1, c2 = class_costs(pairs_l1, hidden), class_costs(pairs_l2, intermediate)
    start = torch.empty(P, G, dtype=torch.int64, device=dev)
    return start.scatter_(1, torch.argsort(-c1, dim=1, stable=True), torch.argsort(c2, dim=1, stable=True))
