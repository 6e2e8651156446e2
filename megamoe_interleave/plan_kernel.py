"""The device-side plan's tables in one CuTe DSL kernel (what
:meth:`FusedLauncher.device_plans <megamoe_interleave.launcher.FusedLauncher.device_plans>` runs on CUDA).

:func:`~megamoe_interleave.device_plan.plan_all_ranks` builds every rank's plan from about sixty
torch ops; in a captured layer they are ~140 graph nodes and 275-858 us per replay on the H200
(results/h200/megamoe/graph/). This kernel replaces everything after the one stable sort: given
the slot order (``torch.sort`` of the slots' global expert ids, as there) and the per-expert
counts, one launch of grid (pool blocks, P) writes

* every rank's Dispatch table (``pool_src`` rows = (source, token, pick)) and routing weights,
  zeros past the rank's pool, from the rank's contiguous range of the order;
* in block 0 of each rank: the per-expert counts, the row records, the schedule table (expert_wave
  wave starts, or the interleaved schedule's balanced L2 start: class costs as exact integers,
  stable ranks by counting, as ``row_grid.balanced_l2_start``), and (num_rows, n_pool).

Every value is integer arithmetic, so the result must equal ``plan_all_ranks``'s exactly
(``tests/test_megamoe_plan_kernel.py``: on a GPU, random routings of every kind).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from quack.cute_dsl_utils import mlir_namedtuple

from .device_plan import DevicePlan, plan_sizes, sorted_slots
from .config import BLOCK_M
from .row_grid import default_experts_per_wave
from .scheduler import Schedule

THREADS = 256
SMEM_LIMIT = 200 * 1024  # below sm_90's 227 KB per block, with room for the allocator's alignment


@mlir_namedtuple
class DevicePlanArguments(NamedTuple):
    """The plan kernel's tensors in parameter order (N = P * max_tokens * k slots; E_l experts
    per rank; the sizes are :class:`~megamoe_interleave.device_plan.PlanSizes`')."""

    mOrder: Any  # (N,) int64: the slots sorted by global expert (stable)
    mCounts: Any  # (P * E_l + 1,) int64: slots per global expert, the last the sentinel's
    mWeight: Any  # (N,) f32: the routing weights, flat
    mPoolSrc: Any  # out (P, max_pool, 3) int32: (source rank, token, pick)
    mPoolWeight: Any  # out (P, max_pool) f32
    mRecord: Any  # out (P, max_rows, 4) int32: the row records
    mTable: Any  # out (P, table) int32: the schedule table
    mSizes: Any  # out (P, 2) int32: (num_rows, n_pool)
    mRankCounts: Any  # out (P, E_l) int32: tokens per local expert


class DevicePlanSm90:
    """Compile-time: the world size, tokens and picks per rank, experts per rank, the row block,
    the schedule and its table, the pair counts. ``mOrder`` int64 [N] (N = P * max_tokens * k),
    ``mCounts`` int64 [E + 1] (slots per global expert; E = sentinel), ``mWeight`` f32 [N]."""

    def __init__(self, world_size: int, max_tokens: int, topk: int, experts_per_rank: int, *, row_block: int,
                 schedule: Schedule, num_pairs: int, pairs_l1: int, pairs_l2: int, hidden: int, intermediate: int,
                 experts_per_wave: int | None = None):
        self.P, self.T, self.k, self.el = world_size, max_tokens, topk, experts_per_rank
        self.sizes = plan_sizes(world_size, max_tokens, topk, experts_per_rank, row_block=row_block, schedule=schedule,
                                num_pairs=num_pairs, experts_per_wave=experts_per_wave)
        self.row_block = row_block
        self.expert_wave = schedule.name == "expert_wave"
        self.balanced = not self.expert_wave and schedule.balance_l2
        self.epw = (experts_per_wave or default_experts_per_wave(experts_per_rank)) if self.expert_wave else 1
        self.G, self.p1, self.p2 = num_pairs, pairs_l1, pairs_l2
        self.hidden, self.inter = hidden, intermediate
        if self.balanced and num_pairs > THREADS:
            raise ValueError(f"num_pairs {num_pairs} > {THREADS}: one thread per residue class")
        smem = 4 * (2 * (THREADS // 32) + 3 * experts_per_rank + self.sizes.max_rows + num_pairs) + 16 * num_pairs
        if smem > SMEM_LIMIT:
            raise ValueError(f"the plan's shared memory ({smem} B: {self.sizes.max_rows} scheduler rows) exceeds "
                             f"{SMEM_LIMIT} B; lower max_tokens_per_rank")

    @cute.jit
    def __call__(self, args: DevicePlanArguments, stream):
        blocks = (self.sizes.max_pool + THREADS - 1) // THREADS
        self.kernel(args).launch(grid=[blocks, self.P, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, args: DevicePlanArguments):
        mOrder, mCounts, mWeight, mPoolSrc, mPoolWeight, mRecord, mTable, mSizes, mRankCounts = args
        tidx, _, _ = cute.arch.thread_idx()
        bx, d, _ = cute.arch.block_idx()
        tidx, bx, d = Int32(tidx), Int32(bx), Int32(d)
        smem = cutlass.memory.SmemAllocator()
        el, G = self.el, max(self.G, 1)
        s_warp = smem.allocate_tensor(Int32, cute.make_layout(2 * (THREADS // 32)), byte_alignment=16)
        s_count = smem.allocate_tensor(Int32, cute.make_layout(el), byte_alignment=16)
        s_row_end = smem.allocate_tensor(Int32, cute.make_layout(el), byte_alignment=16)
        s_tok_start = smem.allocate_tensor(Int32, cute.make_layout(el), byte_alignment=16)
        s_cost = smem.allocate_tensor(Int32, cute.make_layout(self.sizes.max_rows), byte_alignment=16)
        s_c1 = smem.allocate_tensor(Int64, cute.make_layout(G), byte_alignment=16)
        s_c2 = smem.allocate_tensor(Int64, cute.make_layout(G), byte_alignment=16)
        s_r2 = smem.allocate_tensor(Int32, cute.make_layout(G), byte_alignment=16)

        # This rank's first slot in the order and its pool size: sums of the global counts.
        before = Int32(0)
        mine = Int32(0)
        e = tidx
        while e < d * el + el:
            c = Int32(mCounts[e])
            if e < d * el:
                before = before + c
            else:
                mine = mine + c
            e = e + THREADS
        before = cute.arch.warp_reduction_sum(before)
        mine = cute.arch.warp_reduction_sum(mine)
        warp, lane = tidx // 32, tidx % 32
        if lane == 0:
            s_warp[warp] = before
            s_warp[THREADS // 32 + warp] = mine
        cute.arch.sync_threads()
        start = Int32(0)
        n_pool = Int32(0)
        for w in cutlass.range_constexpr(THREADS // 32):
            start = start + s_warp[w]
            n_pool = n_pool + s_warp[THREADS // 32 + w]

        # The Dispatch table: pool row j of rank d is slot order[start + j].
        j = bx * THREADS + tidx
        if j < self.sizes.max_pool:
            src, tok, pick, wgt = Int32(0), Int32(0), Int32(0), Float32(0.0)
            if j < n_pool:
                o = Int64(mOrder[Int64(start) + Int64(j)])
                tk = self.T * self.k
                src = Int32(o // tk)
                tok = Int32((o % tk) // self.k)
                pick = Int32(o % self.k)
                wgt = Float32(mWeight[o])
            mPoolSrc[d, j, 0] = src
            mPoolSrc[d, j, 1] = tok
            mPoolSrc[d, j, 2] = pick
            mPoolWeight[d, j] = wgt

        if bx == 0:
            self.tables(d, n_pool, tidx, mCounts, mRecord, mTable, mSizes, mRankCounts,
                        (s_count, s_row_end, s_tok_start, s_cost), (s_c1, s_c2, s_r2))

    @cute.jit
    def tables(self, d, n_pool, tidx, mCounts, mRecord, mTable, mSizes, mRankCounts, rows_smem, class_smem):
        """Block 0 of rank ``d``: counts, row records, the schedule table, (num_rows, n_pool)."""
        el, rb, max_rows = self.el, self.row_block, self.sizes.max_rows
        s_count, s_row_end, s_tok_start, s_cost = rows_smem
        e = tidx
        while e < el:
            c = Int32(mCounts[d * el + e])
            s_count[e] = c
            mRankCounts[d, e] = c
            e = e + THREADS
        cute.arch.sync_threads()
        if tidx == 0:  # the scans (el entries, one thread)
            rows = Int32(0)
            toks = Int32(0)
            for x in cutlass.range(el):
                c = s_count[x]
                s_tok_start[x] = toks
                toks = toks + c
                rows = rows + (c + rb - 1) // rb
                s_row_end[x] = rows
        cute.arch.sync_threads()
        num_rows = s_row_end[el - 1]
        if tidx == 0:
            mSizes[d, 0] = num_rows
            mSizes[d, 1] = n_pool

        r = tidx
        while r < max_rows:
            rec_e, rec_b, rec_t, rec_c, cost = Int32(0), Int32(0), Int32(0), Int32(0), Int32(0)
            if r < num_rows:
                # The expert of row r: the first whose row end exceeds r (searchsorted, right).
                lo = Int32(0)
                hi = Int32(el - 1)
                while lo < hi:
                    mid = (lo + hi) // 2
                    if s_row_end[mid] > r:
                        hi = mid
                    else:
                        lo = mid + 1
                rec_e = lo
                rec_c = s_count[lo]
                rec_b = r - (s_row_end[lo] - (rec_c + rb - 1) // rb)
                rec_t = s_tok_start[lo]
                left = rec_c - rec_b * rb
                most = cutlass.min(cutlass.max(left, Int32(0)), Int32(BLOCK_M))
                cost = Int32(BLOCK_M)
                if most <= 64:
                    cost = Int32(64)
            mRecord[d, r, 0] = rec_e
            mRecord[d, r, 1] = rec_b
            mRecord[d, r, 2] = rec_t
            mRecord[d, r, 3] = rec_c
            s_cost[r] = cost
            r = r + THREADS
        cute.arch.sync_threads()

        if cutlass.const_expr(self.expert_wave):
            waves = self.sizes.table - 2
            w = tidx
            while w < waves:
                first = w * self.epw
                value = Int32(0)
                if first > 0:
                    value = s_row_end[first - 1]
                mTable[d, w] = value
                w = w + THREADS
            if tidx == 0:
                mTable[d, waves] = num_rows
                mTable[d, waves + 1] = num_rows
        elif cutlass.const_expr(self.balanced):
            self.balanced_l2_start(d, tidx, num_rows, s_cost, mTable, class_smem)
        else:
            if tidx == 0:
                mTable[d, 0] = Int32(0)

    @cute.jit
    def balanced_l2_start(self, d, tidx, num_rows, s_cost, mTable, class_smem):
        """row_grid.balanced_l2_start: class g's L1 cost is the sum of K * rows over the pair tiles
        kk = g (mod G) of the L1 order (kk // P1 = the row), likewise L2; the dearest L1 class
        (stable descending) gets the cheapest L2 class (stable ascending). Exact integers."""
        G = self.G
        s_c1, s_c2, s_r2 = class_smem
        g = tidx
        if g < G:
            c1 = Int64(0)
            kk = g
            while kk < num_rows * self.p1:
                c1 = c1 + Int64(s_cost[kk // self.p1]) * self.hidden
                kk = kk + G
            c2 = Int64(0)
            kk = g
            while kk < num_rows * self.p2:
                c2 = c2 + Int64(s_cost[kk // self.p2]) * self.inter
                kk = kk + G
            s_c1[g] = c1
            s_c2[g] = c2
        cute.arch.sync_threads()
        r1 = Int32(0)
        if g < G:
            r2 = Int32(0)
            for h in cutlass.range(G):
                if s_c1[h] > s_c1[g] or (s_c1[h] == s_c1[g] and h < g):
                    r1 = r1 + 1
                if s_c2[h] < s_c2[g] or (s_c2[h] == s_c2[g] and h < g):
                    r2 = r2 + 1
            s_r2[g] = r2
        cute.arch.sync_threads()
        if g < G:
            for h in cutlass.range(G):
                if s_r2[h] == r1:
                    mTable[d, g] = h


def compile_device_plan(plan: DevicePlanSm90, *, keep_ptx: bool = False):
    """Compile ``plan`` for CUTE_DSL_ARCH with fake tensors (no GPU needed)."""
    from xstage.cute_compile import compile_hopper, fake_stream, fake_tensor

    P, el, s = plan.P, plan.el, plan.sizes
    N = P * plan.T * plan.k
    args = DevicePlanArguments(
        fake_tensor(Int64, (N,), stride=(1,)), fake_tensor(Int64, (P * el + 1,), stride=(1,)),
        fake_tensor(Float32, (N,), stride=(1,)),
        fake_tensor(Int32, (P, s.max_pool, 3), stride=(s.max_pool * 3, 3, 1)),
        fake_tensor(Float32, (P, s.max_pool), stride=(s.max_pool, 1)),
        fake_tensor(Int32, (P, s.max_rows, 4), stride=(s.max_rows * 4, 4, 1)),
        fake_tensor(Int32, (P, s.table), stride=(s.table, 1)),
        fake_tensor(Int32, (P, 2), stride=(2, 1)), fake_tensor(Int32, (P, el), stride=(el, 1)))
    return compile_hopper(plan, args, fake_stream(), keep_ptx=keep_ptx)


def compiled_device_plan(world_size: int, max_tokens: int, topk: int, experts_per_rank: int, *, row_block: int,
                         schedule: Schedule, num_pairs: int, pairs_l1: int, pairs_l2: int, hidden: int,
                         intermediate: int, experts_per_wave: int | None = None):
    """(the plan of :class:`DevicePlanSm90`, its compiled kernel), compiled once per configuration
    (on any host: :meth:`MegaMoE.compile` calls it ahead of a GPU run)."""
    import sys

    from xstage.cute_compile import cached

    from . import device_plan, int_ops, row_grid, scheduler

    spec = (world_size, max_tokens, topk, experts_per_rank, row_block, schedule, num_pairs, pairs_l1, pairs_l2, hidden,
            intermediate, experts_per_wave)
    plan = DevicePlanSm90(world_size, max_tokens, topk, experts_per_rank, row_block=row_block, schedule=schedule,
                          num_pairs=num_pairs, pairs_l1=pairs_l1, pairs_l2=pairs_l2, hidden=hidden,
                          intermediate=intermediate, experts_per_wave=experts_per_wave)
    return plan, cached(("DevicePlanSm90",) + spec, lambda: compile_device_plan(plan).fn,
                        sources=(sys.modules[__name__], device_plan, int_ops, row_grid, scheduler))


def plan_all_ranks_kernel(topk_idx, topk_weights, num_tokens, *, experts_per_rank: int, row_block: int,
                          schedule: Schedule, num_pairs: int, pairs_l1: int, pairs_l2: int, hidden: int,
                          intermediate: int, experts_per_wave: int | None = None) -> DevicePlan:
    """:func:`~megamoe_interleave.device_plan.plan_all_ranks` (same arguments, same result) with
    the keys, counts and the stable sort in torch and everything after them in
    :class:`DevicePlanSm90` (compiled once per configuration). CUDA only."""
    import torch

    P, T, k = topk_idx.shape
    el, dev = experts_per_rank, topk_idx.device
    _, counts, order = sorted_slots(topk_idx, num_tokens, P * el)
    plan, fn = compiled_device_plan(P, T, k, el, row_block=row_block, schedule=schedule, num_pairs=num_pairs,
                                    pairs_l1=pairs_l1, pairs_l2=pairs_l2, hidden=hidden, intermediate=intermediate,
                                    experts_per_wave=experts_per_wave)
    s = plan.sizes
    i32 = dict(dtype=torch.int32, device=dev)
    pool_src = torch.empty(P, s.max_pool, 3, **i32)
    pool_w = torch.empty(P, s.max_pool, dtype=torch.float32, device=dev)
    record = torch.empty(P, s.max_rows, 4, **i32)
    table = torch.empty(P, s.table, **i32)
    sizes = torch.empty(P, 2, **i32)
    rank_counts = torch.empty(P, el, **i32)
    fn(DevicePlanArguments(order, counts, topk_weights.reshape(-1).float().contiguous(), pool_src, pool_w, record,
                           table, sizes, rank_counts))
    return DevicePlan(rank_counts, sizes[:, 1], pool_src, pool_w, sizes[:, 0], record, table, sizes)
