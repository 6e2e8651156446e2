"""Python API in the spirit of ``deep_gemm.mega``: symmetric buffer, weight transform, forward.

::

    world = make_world("loopback", world_size=P)
    moe = MegaMoE(world, num_experts=E, hidden=H, intermediate=I, topk=k,
                  max_tokens_per_rank=T, schedule="interleaved", lead=None)
    moe.load_weights(w1, w2)          # global [E, 2I, H] (gate | up) and [E, H, I]
    ys = moe.forward(xs, topk_idx, topk_weights)   # per local rank lists

Data flow per call (the fused kernel's contract; the ``torch`` backend executes the
same flow with torch ops so the buffer layout and the Combine slot protocol are tested
everywhere):

1. each rank copies its tokens / routing into its symmetric ``x``, ``topk_idx``,
   ``topk_weights`` (skipped when the caller passes views of those buffers) and, with
   ``poison_combine``, poisons the ``combine`` slots that step 5 reads;
2. Dispatch: rank d pulls the rows routed to its experts from every source rank's
   symmetric ``x`` (via the peer table), expert-major;
3. L1 grouped GEMM + SwiGLU x routing weight, L2 grouped GEMM, in the scheduler's
   tile order (kernel only);
4. Combine: each L2 output row is written to ``combine[pick, token]`` on its source rank;
5. after all ranks' stores are visible, every rank reduces its own ``combine`` over
   the valid picks into ``y``.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import List, Optional, Sequence, Union

import numpy as np
import torch

from . import reference
from .kernel_config import TRACE_FIELDS, WS_KINDS, pair_tiles_per_row, resolve_split_tail
from .scheduler import (DIVMOD_SMALL_MAX, SCHEDULES, Schedule, balanced_l2_start, check_experts_per_wave, default_lead,
                        pool_rows_per_row, schedule_table)
from xstage.world import make_world  # noqa: F401  (re-export for callers)

INTERLEAVE_GRANULARITY = 8
BACKENDS = ("torch", "fused")
_COMPILED = {}  # compiled fused kernels by configuration (see MegaMoE._kernel)


def transform_weights(w1: torch.Tensor, w2: torch.Tensor, granularity: int = INTERLEAVE_GRANULARITY):
    """Kernel weight layout.

    ``w1`` [E, 2I, H] (gate rows then up rows) -> gate/up interleaved in chunks of
    ``granularity`` rows (``[g0..g7, u0..u7, g8..g15, ...]``) so an L1 N-tile holds
    matching gate and up columns and SwiGLU is tile-local. ``w2`` [E, H, I] is returned
    contiguous. Returns (w1_interleaved, w2)."""
    if w1.dim() != 3 or w2.dim() != 3:
        raise ValueError("w1 must be [E, 2I, H] and w2 [E, H, I]")
    E, two_i, H = w1.shape
    if two_i % 2 or w2.shape != (E, H, two_i // 2):
        raise ValueError(f"shape mismatch: w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}")
    inter = two_i // 2
    if inter % granularity:
        raise ValueError(f"intermediate {inter} must be a multiple of {granularity}")
    g = w1[:, :inter].reshape(E, inter // granularity, granularity, H)
    u = w1[:, inter:].reshape(E, inter // granularity, granularity, H)
    return torch.stack([g, u], dim=2).reshape(E, two_i, H).contiguous(), w2.contiguous()


DEEP_RING_MAX_ROWS = 512  # default_tiles: 4 ring stages below this many rows per local expert, else 3


def default_tiles(mma: str, hidden: int, intermediate: int, block_m=None, block_n=None, stages=None,
                  rows_per_expert=None):
    """Tile defaults (each ``None`` is filled in): the warp-specialized kinds use 128-row tiles
    and the widest N tile the CTA pairs allow (256 when H and 2I are multiples of 512); the
    other kinds keep 64 x 128, 4 stages. Ring depth of the 128 x 256 tiles, by the expected
    rows per local expert (``rows_per_expert``, None = few): 4 stages (226 KB with the
    half-width output staging tile) below DEEP_RING_MAX_ROWS, else 3. Measured on the H200
    (DeepSeek-V4-Flash, 8192 tokens/rank, results/h200/megamoe/stages): at 192 rows per
    expert (P = 1) 4 stages are 9.5 % faster; at 1536 (loopback P = 8) 3 stages are 1-5 %
    faster. Only those two points were measured; the threshold lies between them."""
    ws = mma in WS_KINDS
    if block_m is None:
        block_m = 128 if ws else 64
    if block_n is None:
        block_n = 128
        if ws:
            block_n = next((n for n in (256, 128, 64) if hidden % (2 * n) == 0 and intermediate % n == 0), 64)
    if stages is None:
        wide = ws and block_m == 128 and block_n == 256
        stages = 3 if wide and rows_per_expert is not None and rows_per_expert >= DEEP_RING_MAX_ROWS else 4
    return block_m, block_n, stages


def default_dispatch_copy(hidden: int, intermediate: int, schedule, kernel_options: dict) -> str:
    """``dispatch_copy=None``: "bulk" wherever the kernel takes it (tma_ws* with one dispatch
    warp and room for the two bounce buffers next to the ring: the 3-stage 128 x 256 tiles of
    loopback P = 8, not P = 1's 4 stages), else "lsu". Measured on the H200 (DeepSeek-V4-Flash,
    P = 8, 8192 tokens/rank, results/h200/megamoe/bulk): the bulk copies take the Dispatch off
    the SM's load/store pipe, which the WGMMAs share; paired against the grouped GEMMs
    interleaved 1.044-1.061x -> 1.017-1.031x, 1.014x with the evict-first policy."""
    from .kernel_sm90 import MegaMoESm90

    if kernel_options["mma"] not in WS_KINDS or kernel_options.get("dispatch_warps") not in (None, 1):
        return "lsu"
    try:
        MegaMoESm90(hidden, intermediate, schedule, **dict(kernel_options, dispatch_copy="bulk"))
    except ValueError:  # no room for the bounce buffers
        return "lsu"
    return "bulk"


def default_dispatch_window(dispatch_copy: str, schedule, intermediate: int, kernel_options: dict,
                            num_sms: int) -> int:
    """``dispatch_window=None``: for expert_wave with bulk copies, one row more than the L1 rows
    in flight, (num_sms / 2 CTA pairs) // (L1 pair tiles per row) + 1 = 5 at DeepSeek-V4-Flash
    with 128 x 256 tiles on 132 SMs; else 0 (unpaced). Measured on the H200 (P = 8 loopback,
    8192 tokens/rank, paired vs the grouped GEMMs, results/h200/megamoe/window): expert_wave
    W = 0 / 4 / 5 / 6 / 7 / 8 / 14: 1.048 / 1.088 / 1.009 / 1.017 / 1.033 / 1.044 / 1.050x (W = 4
    <= the rows in flight stalls the L1 stream); interleaved no W in 5..14 beat W = 0 (1.029x)."""
    if dispatch_copy != "bulk" or schedule.name != "expert_wave":
        return 0
    pairs_l1 = pair_tiles_per_row(kernel_options["mma"], 2 * intermediate, kernel_options["block_n"])
    return (num_sms // 2) // pairs_l1 + 1


DISPATCH_OPTIONS = ("dispatch_copy", "dispatch_evict_first", "dispatch_window", "dispatch_keep")


def resolve_l2_columns(schedule: str, l2_columns: Optional[bool], l2_positions: int) -> bool:
    """``MegaMoE(l2_columns=...)``: None = on wherever it applies, i.e. expert_wave with at most
    ``l2_positions`` (L2 pair tiles of the largest expert) in ``scheduler.divmod_small``'s exact
    range (measured 0.1-0.3 % faster than the row order at P = 8 on three hosts, results/h200/megamoe/l2_columns/);
    True past that range is an error."""
    if l2_columns is None:
        return schedule == "expert_wave" and l2_positions < DIVMOD_SMALL_MAX
    if l2_columns and l2_positions >= DIVMOD_SMALL_MAX:
        raise ValueError(f"l2_columns: up to {l2_positions} L2 pair tiles per expert, the order handles "
                         f"< {DIVMOD_SMALL_MAX}; lower max_tokens_per_rank or leave l2_columns off")
    return bool(l2_columns)


def resolve_dispatch_options(hidden: int, intermediate: int, schedule, kernel_options: dict, num_sms: int,
                             fused: bool = True, **given) -> dict:
    """The fused kernel's :data:`DISPATCH_OPTIONS` with the API's defaults for those not given
    (None): :func:`default_dispatch_copy` ("lsu" off the fused backend), evict-first with
    bulk copies, :func:`default_dispatch_window`, no keep (measured slower: with W = 6 expert_wave
    1.017 -> 1.037x, interleaved 1.047 -> 1.044x; W = 10 1.047 -> 1.035x, 1.026 -> 1.035x)."""
    copy = given.get("dispatch_copy")
    if copy is None:
        copy = default_dispatch_copy(hidden, intermediate, schedule, kernel_options) if fused else "lsu"
    evict_first = given.get("dispatch_evict_first")
    window = given.get("dispatch_window")
    if window is None:
        window = default_dispatch_window(copy, schedule, intermediate, kernel_options, num_sms)
    return dict(dispatch_copy=copy, dispatch_evict_first=copy == "bulk" if evict_first is None else evict_first,
                dispatch_window=window, dispatch_keep=bool(given.get("dispatch_keep")))


def untransform_w1(w1_il: torch.Tensor, granularity: int = INTERLEAVE_GRANULARITY) -> torch.Tensor:
    """Inverse of the w1 part of :func:`transform_weights`."""
    E, two_i, H = w1_il.shape
    v = w1_il.reshape(E, two_i // (2 * granularity), 2, granularity, H)
    return torch.cat([v[:, :, 0].reshape(E, two_i // 2, H), v[:, :, 1].reshape(E, two_i // 2, H)], dim=1)


class MegaMoEBuffer:
    """Symmetric per-rank buffers, sized from ``max_tokens_per_rank``.

    ``x`` [T, H] bf16, ``topk_idx`` [T, k] int64, ``topk_weights`` [T, k] f32 (inputs, read
    remotely by Dispatch), ``combine`` [k, T, H] bf16 (written remotely by Combine),
    ``counters[r]`` int32 workspace of rank r (kernel: error word, grid-barrier counter,
    per-row L1->L2 and Dispatch readiness counters; row counters are reset in-kernel so repeated calls
    need no host memset). Only rank r's own kernel touches it, so it is plain device memory,
    not symmetric (in the ``host`` world the symmetric buffers live in pinned host memory,
    where the counters' atomics would cross PCIe)."""

    def __init__(self, world, *, hidden: int, topk: int, max_tokens_per_rank: int, num_counters: int = 1024,
                 dtype=torch.bfloat16):
        if max_tokens_per_rank <= 0 or hidden <= 0 or topk <= 0:
            raise ValueError("hidden, topk and max_tokens_per_rank must be positive")
        if (hidden * torch.tensor([], dtype=dtype).element_size()) % 16:
            raise ValueError(f"hidden*{dtype} row must be a multiple of 16 bytes (16-byte remote stores)")
        self.world = world
        self.hidden, self.topk, self.max_tokens = hidden, topk, max_tokens_per_rank
        self.dtype = dtype
        T = max_tokens_per_rank
        self.x = world.alloc((T, hidden), dtype)
        self.topk_idx = world.alloc((T, topk), torch.int64)
        self.topk_weights = world.alloc((T, topk), torch.float32)
        self.combine = world.alloc((topk, T, hidden), dtype)
        self.counters = {r: torch.zeros(num_counters, dtype=torch.int32, device=world.device)
                         for r in world.local_ranks}
        self.num_tokens = [0] * world.world_size


class MegaMoE:
    """Expert-parallel MoE layer over ``world`` (``E / P`` experts per rank).

    ``schedule``: "expert_wave" (``experts_per_wave``, default E_local/4) or "interleaved"
    (Algorithm 1, ``lead`` D; default ceil(eq. 16) = ceil(block_n * num_sms / (2 I))).
    ``backend``: "fused" (the CuTe DSL kernel, CUDA only) or "torch" (same data flow with
    torch ops, any device, loopback/host worlds). Fused-kernel options: ``mma`` ("wgmma"
    GPU-validated, "wgmma_cpasync" multistage, "tma_ws" TMA + mbarrier ring + producer warp and
    "tma_ws_mcast" (the same, CTA pairs as clusters multicasting A; both GPU-validated, the
    fast paths), "tma_ws_mcast_b" (CTA pairs split M and multicast B, the expert's weights;
    the default, fastest on the H200), "fma"), ``block_m`` (64 or 128 = one or two
    consumer warpgroups), ``block_n``, ``stages`` (``None``: :func:`default_tiles`),
    ``timeout_ns`` of every bounded spin,
    ``trace`` (per-tile timelines in ``last_trace``; decode with :func:`decode_trace`),
    ``split_tail`` (tma_ws* with block_m=128: m-blocks of <= 64 rows as 64-row tiles; None = on),
    ``dispatch_warps`` (tma_ws*: warps that copy Dispatch rows while the tiles run; 0 = Dispatch
    before a grid barrier; None = 1), ``l2_handoffs`` (tma_ws*: the L2 output tile goes to the
    epilogue warps in 1 or 2 parts; None = 1 when the full-width staging tile fits), ``silu``
    ("tanh": sigmoid through one tanh.approx, the default; "exp2": quack's ex2 + rcp),
    ``balance_l2`` (interleaved: pair the CTA pairs' L1 and L2 tile shares so the pairs' work
    evens out, scheduler.balanced_l2_start; default on), ``dispatch_copy`` (tma_ws* with one
    dispatch warp: "lsu", its lanes' 16-byte loads / stores; "bulk", one lane's bulk copies
    through two shared-memory bounce buffers; None = :func:`default_dispatch_copy`),
    ``dispatch_evict_first`` (bulk Dispatch: its loads and stores carry an L2 evict-first
    policy; None = on with "bulk"), ``dispatch_window`` (bulk Dispatch: copy row r only once
    row r - W has a finished L1 tile; 0 = as fast as it can; None = :func:`default_dispatch_window`),
    ``dispatch_keep`` (windowed bulk Dispatch: pool rows stored evict-last and discarded from L2
    once their L1 tiles are done; None = off, measured slower), ``l2_columns`` (expert_wave:
    each expert's L2 tiles column by column, so the CTAs running together share its W2
    columns; scheduler.expert_wave_step; None = on for expert_wave where the order's positions
    fit ``scheduler.divmod_small``, else off).

    ``poison_combine`` (default True): fill the ``combine`` slots that the top-k reduction
    reads (``[:, :T]`` of every rank) with NaN before each call, so a slot the kernel
    failed to write shows up as NaN in ``y``. Correctness tests keep it on; benchmarks
    may turn it off (saves a k*T*H*2-byte fill per rank per call: 400 MB at
    DeepSeek-V4-Flash, T=8192). With it off, masked picks (-1) are still excluded from
    the reduction (where(), not poison-dependent).

    Host work per fused call (single-process worlds): two device->host reads before the
    launch (expert-id bounds of the inputs, per-expert counts of every local rank from one
    sort), one upload of the small scheduler tables per rank, and one read of the error
    words after the launch; the top-k reduction is queued behind the kernels before that
    read. ``pool_x``/``h`` scratch is cached per rank and grows on demand.
    """

    def __init__(self, world, *, num_experts: int, hidden: int, intermediate: int, topk: int,
                 max_tokens_per_rank: int, schedule: str = "interleaved", lead: Optional[int] = None,
                 experts_per_wave: Optional[int] = None, block_m: Optional[int] = None,
                 block_n: Optional[int] = None, num_sms: int = 132, backend: str = "torch",
                 timeout_ns: int = 2_000_000_000, mma: str = "tma_ws_mcast_b", stages: Optional[int] = None,
                 trace: bool = False, poison_combine: bool = True, split_tail: Optional[bool] = None,
                 dispatch_warps: Optional[int] = None, l2_handoffs: Optional[int] = None, silu: str = "tanh",
                 balance_l2: bool = True, dispatch_copy: Optional[str] = None,
                 dispatch_evict_first: Optional[bool] = None, dispatch_window: Optional[int] = None,
                 dispatch_keep: Optional[bool] = None, l2_columns: Optional[bool] = None):
        P = world.world_size
        if num_experts % P:
            raise ValueError(f"num_experts {num_experts} not divisible by world size {P}")
        # balanced routing: P sources x T tokens x k picks over E experts
        rows_per_expert = P * max_tokens_per_rank * topk / num_experts
        block_m, block_n, stages = default_tiles(mma, hidden, intermediate, block_m, block_n, stages,
                                                 rows_per_expert=rows_per_expert)
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        check_experts_per_wave(experts_per_wave)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if (2 * intermediate) % (2 * block_n) or hidden % (2 * block_n):
            raise ValueError(f"2I={2*intermediate} and H={hidden} must be multiples of 2*block_n={2*block_n} (CTA pairs)")
        if topk > num_experts:
            raise ValueError("topk > num_experts")
        self.world = world
        self.num_experts, self.hidden, self.intermediate, self.topk = num_experts, hidden, intermediate, topk
        self.experts_per_rank = num_experts // P
        self.block_m, self.block_n, self.num_sms = block_m, block_n, num_sms
        self.lead = lead if lead is not None else default_lead(block_n, num_sms, intermediate)
        # l2_columns: the order's position within an expert's L2 tiles must suit divmod_small
        l2_positions = ((max_tokens_per_rank * P // pool_rows_per_row(block_m, mma == "tma_ws_mcast_b") + 1)
                        * pair_tiles_per_row(mma, hidden, block_n))
        self.schedule = Schedule(schedule, lead=self.lead, balance_l2=balance_l2 and schedule == "interleaved",
                                 l2_columns=resolve_l2_columns(schedule, l2_columns, l2_positions))
        self.experts_per_wave = experts_per_wave
        self.backend = backend
        self.timeout_ns = timeout_ns
        # fused kernel tile math (kernel_sm90.MMA_KINDS); default the fastest measured on the H200
        self.mma = mma
        self.stages = stages  # smem pipeline depth of mma="wgmma_cpasync" / "tma_ws*"
        self.trace = trace  # record per-tile timelines (fused backend) into last_trace
        self.split_tail = split_tail  # tma_ws* with block_m=128: None = on (kernel_sm90.MegaMoESm90)
        # resolved as the kernel does: the L2 balancing's cost model needs it
        self._split_tail = resolve_split_tail(mma, block_m, split_tail)
        self.dispatch_warps = dispatch_warps  # tma_ws*: overlapped Dispatch; None = 1 (kernel_sm90.MegaMoESm90)
        self.l2_handoffs = l2_handoffs  # tma_ws*: L2 output staged in 1 or 2 parts; None = as smem allows
        self.last_trace = {}  # rank -> int64 [num_ctas, max_tiles, len(TRACE_FIELDS)]
        self.last_kernel_us = None  # device time of the last fused call (all local ranks)
        # compile-time options of the fused kernel (kernel_sm90.MegaMoESm90), also its cache key
        self._kernel_options = dict(block_m=block_m, block_n=block_n, timeout_ns=timeout_ns, mma=mma, stages=stages,
                                    trace=trace, split_tail=split_tail, dispatch_warps=dispatch_warps,
                                    l2_handoffs=l2_handoffs, silu=silu)
        self._kernel_options.update(resolve_dispatch_options(
            hidden, intermediate, self.schedule, self._kernel_options, num_sms, backend == "fused",
            dispatch_copy=dispatch_copy,
            dispatch_evict_first=dispatch_evict_first, dispatch_window=dispatch_window, dispatch_keep=dispatch_keep))
        if backend == "fused":  # validate the kernel configuration now (no compile, no launch)
            from .kernel_sm90 import MegaMoESm90

            MegaMoESm90(hidden, intermediate, self.schedule, **self._kernel_options)
        # Largest pool of one rank (every pick of every source) + the block_m padding rows.
        self._max_pool_rows = P * max_tokens_per_rank * min(topk, self.experts_per_rank) + block_m
        if backend == "fused" and self._max_pool_rows * (hidden // 8) >= 2 ** 31:
            raise ValueError(f"max_tokens_per_rank={max_tokens_per_rank}: the fused kernel indexes the dispatched "
                             f"rows in 16-byte chunks with int32 ({self._max_pool_rows} rows x {hidden // 8} chunks "
                             f">= 2^31); lower max_tokens_per_rank")
        # Worst-case scheduler rows of one rank: every pick of every source lands here, plus
        # one partial M block per local expert.
        max_rows = -(-P * max_tokens_per_rank * min(topk, self.experts_per_rank) // block_m) + self.experts_per_rank
        self.buffer = MegaMoEBuffer(world, hidden=hidden, topk=topk, max_tokens_per_rank=max_tokens_per_rank,
                                    num_counters=2 + 2 * max_rows)
        self.poison_combine = poison_combine
        self._scratch = {}  # rank -> {name: flat device tensor}, reused across calls (see _scratch_rows)
        self._generation = 0  # bumped by stage_inputs; the plan cache is valid for one generation
        self._plans = (-1, {})  # (generation, {rank: (Permutation, RowGrid)})
        self._masked = {}  # rank -> whether any pick of its staged routing is -1
        self._poison_pending = False
        self.w1 = {}
        self.w2 = {}

    # -- weights -----------------------------------------------------------
    def load_weights(self, w1: torch.Tensor, w2: torch.Tensor) -> None:
        """Global weights ``w1`` [E, 2I, H] (gate | up), ``w2`` [E, H, I]; each local rank keeps
        its slice in the kernel layout (:func:`transform_weights`)."""
        E, H, inter = self.num_experts, self.hidden, self.intermediate
        if w1.shape != (E, 2 * inter, H) or w2.shape != (E, H, inter):
            raise ValueError(f"expected w1 {(E, 2*inter, H)} and w2 {(E, H, inter)}, got {tuple(w1.shape)}, {tuple(w2.shape)}")
        if w1.dtype != self.buffer.dtype or w2.dtype != self.buffer.dtype:
            raise ValueError(f"weights must be {self.buffer.dtype}")
        el = self.experts_per_rank
        for r in self.world.local_ranks:
            sl = slice(r * el, (r + 1) * el)
            w1_il, w2_c = transform_weights(w1[sl], w2[sl])
            self.w1[r] = w1_il.to(self.world.device)
            self.w2[r] = w2_c.to(self.world.device)

    # -- forward -----------------------------------------------------------
    def _as_rank_list(self, v) -> List[torch.Tensor]:
        if isinstance(v, torch.Tensor):
            return [v]
        return list(v)

    def forward(self, x: Union[torch.Tensor, Sequence[torch.Tensor]], topk_idx, topk_weights):
        """``x`` [T_r, H] bf16, ``topk_idx`` [T_r, k] (global expert ids, -1 = masked),
        ``topk_weights`` [T_r, k] f32, one per local rank (a list in the loopback world,
        tensors in the torch-symm world). Returns y with x's shape per local rank."""
        xs, idxs, ws = self._as_rank_list(x), self._as_rank_list(topk_idx), self._as_rank_list(topk_weights)
        ranks = self.world.local_ranks
        self.stage_inputs(xs, idxs, ws)
        if self.backend == "fused":
            return self._run_fused()
        self._flush_poison()
        self._run_torch_dataflow()
        self.world.barrier()
        return [self.reduce_rank(r) for r in ranks]

    __call__ = forward

    @property
    def kernel_options(self) -> dict:
        """The fused kernel's compile-time options as resolved from the arguments and the
        defaults (the keywords of kernel_sm90.MegaMoESm90; a copy)."""
        return dict(self._kernel_options)

    def rerun(self) -> List[torch.Tensor]:
        """The fused kernels and the top-k reduction again, on the inputs the last ``forward``
        staged, with its plan (no input copies, no host planning, no Combine poison): the
        device work of one call, for benchmarks that measure it (scripts/megamoe_energy.py).
        Returns y per local rank, equal to that ``forward``'s."""
        if self.backend != "fused":
            raise ValueError("rerun() repeats the fused kernels: backend='fused' only")
        if self._plans[0] != self._generation or not self._plans[1]:
            raise RuntimeError("rerun() needs a forward() first")
        return self._run_fused()

    def _single_process(self) -> bool:
        """Every rank lives in this process (loopback / host worlds): all ranks' work is
        ordered by the one CUDA stream, so no host-side barrier is needed between phases."""
        return len(self.world.local_ranks) == self.world.world_size

    def stage_inputs(self, xs, idxs, ws) -> None:
        """Validate every rank's inputs, copy them into its symmetric buffers, schedule the
        Combine poison and synchronize the world (sources publish before anyone pulls).

        Inputs that already are the leading rows of the rank's symmetric buffers (e.g.
        ``moe.buffer.x.local(r)[:T]`` written by the caller) are not copied. The expert-id
        range of all ranks is checked with one device sync. In multi-process worlds the
        poison is written here, before the world barrier; in single-process worlds stream
        order suffices, so it is deferred to just before the launch (see ``_flush_poison``)."""
        ranks = self.world.local_ranks
        if not (len(xs) == len(idxs) == len(ws) == len(ranks)):
            raise ValueError(f"need one input per local rank ({len(ranks)}), got {len(xs)}/{len(idxs)}/{len(ws)}")
        if not self.w1:
            raise RuntimeError("call load_weights() first")
        buf = self.buffer
        for xr, ir, wr in zip(xs, idxs, ws):
            if xr.dtype != buf.dtype:
                raise ValueError(f"x must be {buf.dtype}, got {xr.dtype}")
            reference.check_routing_shapes(xr, ir, wr)
            if xr.shape[1] != self.hidden or ir.shape[1] != self.topk:
                raise ValueError(f"x must be [T, {self.hidden}] and topk_idx [T, {self.topk}]")
            if xr.shape[0] > buf.max_tokens:
                raise ValueError(f"{xr.shape[0]} tokens > max_tokens_per_rank {buf.max_tokens}")
        self._generation += 1  # the buffers change: any cached plan is stale
        staged_idx = []
        for r, xr, ir, wr in zip(ranks, xs, idxs, ws):
            T = xr.shape[0]
            for dst, src in ((buf.x.local(r)[:T], xr), (buf.topk_idx.local(r)[:T], ir),
                             (buf.topk_weights.local(r)[:T], wr)):
                if not _same_memory(dst, src):
                    dst.copy_(src)
            staged_idx.append(buf.topk_idx.local(r)[:T])
        # Expert ids in range before any launch: one read-back for every local rank.
        bounds = reference.routing_bounds(staged_idx)
        for b in bounds:
            reference.check_expert_range(b, self.num_experts)
        for r, xr, b in zip(ranks, xs, bounds):
            buf.num_tokens[r] = xr.shape[0]
            self._masked[r] = b is not None and b[0] < 0
        self._poison_pending = self.poison_combine
        if not self._single_process():
            self._flush_poison()
            # Sources must have published x (and everyone poisoned) before any rank pulls
            # x or stores into a peer's combine (kernel Dispatch / Combine).
            self.world.barrier()

    def _flush_poison(self) -> None:
        """NaN into the combine slots the reduction reads (``[:, :T]`` per local rank), once
        per staged call when ``poison_combine``: every read slot must then be written."""
        if not self._poison_pending:
            return
        for r in self.world.local_ranks:
            self.buffer.combine.local(r)[:, : self.buffer.num_tokens[r]].fill_(float("nan"))
        self._poison_pending = False

    def _run_torch_dataflow(self) -> None:
        """Dispatch + L1 + SwiGLU + L2 + Combine of every local rank with torch ops on the
        symmetric buffers (loopback: all ranks in this process)."""
        if self.world.backend == "torch-symm":
            # A rank can only reach peers through the peer table: that is the kernel path.
            raise NotImplementedError("backend='torch' emulates the dataflow in one process (loopback/host worlds)")
        buf, P = self.buffer, self.world.world_size
        T = buf.num_tokens
        idxs = [buf.topk_idx.local(s)[: T[s]] for s in range(P)]
        ws = [buf.topk_weights.local(s)[: T[s]] for s in range(P)]
        xs = [buf.x.local(s)[: T[s]] for s in range(P)]
        perms = reference.permute_ranks(idxs, ws, range(P), self.experts_per_rank)
        for d in range(P):
            perm = perms[d]
            dev = self.world.device
            rows = reference.gather_rows(xs, perm, dev)
            w1_t = _w1_t_gate_up(self.w1[d])
            out = reference.unfused_expert_compute(rows, perm.weights.to(dev), perm.counts, w1_t, self.w2[d].transpose(1, 2))
            for s in range(P):
                sel = (perm.src_rank == s).nonzero(as_tuple=True)[0]
                buf.combine.local(s)[perm.src_pick[sel].to(dev), perm.src_token[sel].to(dev)] = out[sel.to(dev)]

    # -- fused kernel (kernel_sm90.MegaMoESm90) ---------------------------------
    def _kernel(self):
        key = (self.hidden, self.intermediate, self.schedule, tuple(sorted(self._kernel_options.items())))
        if key not in _COMPILED:
            from .kernel_sm90 import compile_megamoe_sm90

            _COMPILED[key] = compile_megamoe_sm90(self.hidden, self.intermediate, self.schedule,
                                                  **self._kernel_options)
        return _COMPILED[key]

    def plan_rank(self, d: int):
        """Host part of Dispatch for destination rank ``d``: the expert-major pool and the
        scheduler tables (the kernel does the row pull, both GEMMs and Combine).

        The first call after :meth:`stage_inputs` plans every local rank at once (one sort,
        one device sync); later calls for the same staged inputs return the cached plan."""
        gen, plans = self._plans
        if gen != self._generation or d not in plans:
            plans = self._plan_local_ranks()
            self._plans = (self._generation, plans)
        if d not in plans:
            raise ValueError(f"rank {d} is not a local rank of this process")
        return plans[d]

    def _plan_local_ranks(self):
        from .scheduler import make_row_grid

        idxs, ws = self._all_routing()
        perms = reference.permute_ranks(idxs, ws, self.world.local_ranks, self.experts_per_rank)
        out = {}
        for d, perm in perms.items():
            grid = make_row_grid(perm.counts_host, block_m=self.block_m,
                                 n_blocks_l1=2 * self.intermediate // self.block_n,
                                 n_blocks_l2=self.hidden // self.block_n, experts_per_wave=self.experts_per_wave,
                                 pair_splits_m=self.mma == "tma_ws_mcast_b")
            if self.schedule.balance_l2:
                grid = dataclasses.replace(grid, l2_start=balanced_l2_start(
                    grid, self.num_ctas(grid) // 2, block_m=self.block_m, hidden=self.hidden,
                    intermediate=self.intermediate, split_tail=self._split_tail))
            out[d] = (perm, grid)
        return out

    def num_ctas(self, grid) -> int:
        """Persistent grid of the fused launch: at most one CTA per SM so every CTA is resident
        (the dependency waits and grid barriers rely on it); even for the CTA pairs."""
        return max(2, min(self.num_sms - self.num_sms % 2,
                          2 * max(grid.num_rows, 1) * max(grid.pairs_l1, grid.pairs_l2)))

    def _all_routing(self):
        """Every source rank's routing (the host part of Dispatch needs all of them):
        read from the local buffers in one-process worlds, all-gathered in torch-symm."""
        buf, P = self.buffer, self.world.world_size
        if self.world.backend != "torch-symm":
            T = buf.num_tokens
            return ([buf.topk_idx.local(s)[: T[s]] for s in range(P)],
                    [buf.topk_weights.local(s)[: T[s]] for s in range(P)])
        import torch.distributed as dist  # code path for several GPUs; not exercised on one GPU

        (r,) = self.world.local_ranks
        t = torch.tensor([buf.num_tokens[r]], device=self.world.device)
        ts = [torch.empty_like(t) for _ in range(P)]
        dist.all_gather(ts, t)
        idx_all = [torch.empty_like(buf.topk_idx.local(r)) for _ in range(P)]
        w_all = [torch.empty_like(buf.topk_weights.local(r)) for _ in range(P)]
        dist.all_gather(idx_all, buf.topk_idx.local(r))
        dist.all_gather(w_all, buf.topk_weights.local(r))
        ns = torch.cat(ts).tolist()  # one read-back for every rank's token count
        return ([i[:n] for i, n in zip(idx_all, ns)], [w[:n] for w, n in zip(w_all, ns)])

    def _scratch_rows(self, d: int, name: str, rows: int, cols: int, dtype) -> torch.Tensor:
        """A contiguous [rows, cols] view of rank ``d``'s cached scratch ``name`` (grown
        by 1.25x on demand, capped at the worst-case pool, never shrunk). Stream order makes reuse
        across calls safe: a call's kernel runs after the previous call's on the same stream."""
        cache = self._scratch.setdefault(d, {})
        flat = cache.get(name)
        need = rows * cols
        if flat is None or flat.numel() < need:
            size = need if flat is None else min(need + need // 4, max(need, self._max_pool_rows * cols))
            flat = torch.empty(size, dtype=dtype, device=self.world.device)
            cache[name] = flat
        return flat[:need].view(rows, cols)

    def dispatched_rows(self, d: int) -> torch.Tensor:
        """Rank ``d``'s pool, ``[n_pool, H]``: the rows its Dispatch copies (pool row i =
        x[src rank][src token] of :meth:`plan_rank`'s permutation) and its Linear-1 reads. A view
        of scratch reused by the next call; valid after :meth:`launch_arguments` (a ``forward``)."""
        n = self.plan_rank(d)[0].src_rank.numel()
        flat = self._scratch.get(d, {}).get("pool_x")
        if flat is None or flat.numel() < n * self.hidden:
            raise RuntimeError(f"rank {d} has no pool yet: run forward() (or launch_arguments) first")
        return flat[: n * self.hidden].view(n, self.hidden)

    def launch_arguments(self, d: int):
        """Host planning for rank ``d``: (num_ctas, tensor args, scalar args w/o barrier_base
        and num_ctas) of :class:`kernel_sm90.MegaMoESm90`. Works on any device (CPU tests
        check the arguments against the kernel's signature).

        ``pool_x`` / ``h`` are views of per-rank scratch reused across calls; the trace
        tensor (``trace=True``) is fresh per call so ``last_trace`` survives the next call."""
        buf, dev = self.buffer, self.world.device
        i32 = dict(dtype=torch.int32, device=dev)
        perm, grid = self.plan_rank(d)
        n_pool = perm.src_rank.numel()
        if 2 + 2 * grid.num_rows > buf.counters[d].numel():
            raise ValueError(f"{grid.num_rows} scheduler rows exceed the counter workspace")
        if n_pool == 0:  # keep every tensor non-empty
            pool_src = torch.zeros(1, 3, **i32)
            pool_w = torch.zeros(1, dtype=torch.float32, device=dev)
        else:
            pool_src = torch.stack([perm.src_rank, perm.src_token, perm.src_pick], 1).to(torch.int32)
            pool_w = perm.weights.to(device=dev, dtype=torch.float32).contiguous()
        # block_m rows of padding: the multistage mainloop reads whole M tiles (rows past an
        # expert's tokens feed accumulator rows that are never stored).
        pool_x = self._scratch_rows(d, "pool_x", n_pool + self.block_m, self.hidden, buf.dtype)
        h = self._scratch_rows(d, "h", n_pool + self.block_m, self.intermediate, buf.dtype)
        num_ctas = self.num_ctas(grid)
        # The two small int32 tables in one host->device copy (pinned, asynchronous); the row
        # records first, so they are 16-byte aligned (the kernel loads each with one vector load).
        records = itertools.chain.from_iterable(grid.row_record or [(0, 0, 0, 0)])
        parts = [list(records), schedule_table(self.schedule, grid)]
        lens = [len(p) for p in parts]
        host = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(parts), dtype=np.int32, count=sum(lens)))
        if dev.type == "cuda":
            host = host.pin_memory()  # caching host allocator: safe to reuse once the copy is done
        records, sched_table = host.to(dev, non_blocking=True).split(lens)
        records = records.view(-1, 4)
        if self.trace:
            # Tiles per CTA <= ceil(all pair tiles / pairs) (+1 for safety).
            per_cta = -(-grid.num_rows * (grid.pairs_l1 + grid.pairs_l2) // (num_ctas // 2)) + 1
            trace = torch.full((num_ctas, per_cta, len(TRACE_FIELDS)), -1, dtype=torch.int64, device=dev)
            self.last_trace[d] = trace
        else:
            trace = self._scratch_rows(d, "no_trace", 1, len(TRACE_FIELDS), torch.int64).view(
                1, 1, len(TRACE_FIELDS))  # unused by the kernel
        tensors = (buf.x.peer_table(d), buf.combine.peer_table(d), pool_src, pool_w, pool_x, h,
                   self.w1[d], self.w2[d], records, sched_table, buf.counters[d],
                   trace)
        from .kernel_sm90 import check_launch_arguments

        check_launch_arguments(self.hidden, self.intermediate, tensors)
        return num_ctas, tensors, (grid.num_rows, n_pool, buf.max_tokens, self.topk)

    def _run_fused(self) -> List[torch.Tensor]:
        """Plan, launch every local rank's kernel, reduce; returns y per local rank."""
        dev = self.world.device
        if dev.type != "cuda":
            raise RuntimeError("backend='fused' needs a CUDA device")
        kernel = self._kernel()
        if not hasattr(self, "_barrier_base"):
            self._barrier_base = {r: 0 for r in self.world.local_ranks}
        ranks = self.world.local_ranks
        self.plan_rank(ranks[0])  # every local rank's plan: the one planning sync
        self._flush_poison()  # queued now: the fill overlaps the host work below
        launches = []
        for d in ranks:  # host planning of every rank first ...
            num_ctas, tensors, scalars = self.launch_arguments(d)
            launches.append((d, num_ctas, tensors + scalars))
        # ... then every rank's kernel back to back, timed with CUDA events (kernel-only time).
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for d, num_ctas, args in launches:
            kernel(*args, self._barrier_base[d], num_ctas)
            self._barrier_base[d] += 2 * num_ctas
        end.record()
        for d, _, args in launches:
            if self._barrier_base[d] > 2 ** 30:  # keep the int32 barrier counter far from overflow
                self.buffer.counters[d][1:2].zero_()  # stream-ordered after this call's kernel
                self._barrier_base[d] = 0
        buf = self.buffer
        single = self._single_process()
        # Single process: the reductions are stream-ordered after every rank's kernel, so they
        # are queued before the error read-back (no idle gap); on error their output is dropped.
        ys = [self.reduce_rank(r) for r in ranks] if single else None
        words = buf.counters[ranks[0]][:1] if len(ranks) == 1 else torch.cat([buf.counters[d][:1] for d in ranks])
        errors = words.tolist()  # the one post-launch sync (waits for kernels and reductions)
        self.last_kernel_us = start.elapsed_time(end) * 1e3
        from xstage.device import raise_on_device_error

        for d, code in zip(ranks, errors):
            if code != 0:
                # The counter state is unusable after a timeout: reset it, then raise.
                for r in ranks:
                    buf.counters[r].zero_()
                    self._barrier_base[r] = 0
                raise_on_device_error(code, f"MegaMoESm90 rank {d}")
        if not single:
            self.world.barrier()  # every peer's Combine stores into our slots are complete
            ys = [self.reduce_rank(r) for r in ranks]
        return ys

    def reduce_rank(self, r: int) -> torch.Tensor:
        """y of local rank ``r``: the weighted top-k sum of its Combine slots (the last step of
        ``forward``; valid once every rank's Combine stores are visible)."""
        T = self.buffer.num_tokens[r]
        combine = self.buffer.combine.local(r)[:, :T]
        idx = self.buffer.topk_idx.local(r)[:T]
        return reference.weighted_combine(combine, idx, any_masked=self._masked.get(r, True))


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` are the same view of the same memory (a copy would be a no-op)."""
    return (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.data_ptr() == b.data_ptr())


def _w1_t_gate_up(w1_il: torch.Tensor) -> torch.Tensor:
    """Interleaved w1 [E, 2I, H] -> [E, H, 2I] with gate columns then up columns (grouped_mm B)."""
    return untransform_w1(w1_il).transpose(1, 2)


def trace_mainloop_cycles(cycles: int, t_start: int, t_ready: int, t_mainloop: int):
    """(SM clock in GHz, mainloop in cycles) of one trace row, or None without cycles (older
    traces) or for an empty span: the row's cycles cover tile start -> mainloop end, so its
    clock is cycles / ns over that span, and the mainloop (first stage landed -> last WGMMA
    retired) in cycles is that clock times its ns -- comparable with the tensor pipe's ideal
    (4096 bf16 FLOP per cycle per SM), which the GPU's DVFS clock is not."""
    if cycles <= 0 or t_mainloop <= t_start:
        return None
    clock = cycles / (t_mainloop - t_start)
    return clock, clock * (t_mainloop - t_ready)


def decode_trace(trace: torch.Tensor):
    """Per-tile records of one rank's trace tensor (see ``kernel_config.TRACE_FIELDS``):
    list per CTA of dicts with phase, row, n_block, timestamps (ns), smid and the SM cycles from
    tile start to mainloop end, in execution order."""
    out = []
    for cta_rows in trace.cpu().tolist():
        recs = []
        for key, t0, t1, t2, t3, smid, cycles in cta_rows:
            if key < 0:
                break
            recs.append(dict(phase=key >> 40, row=(key >> 16) & 0xFFFFFF, n_block=key & 0xFFFF, t_start=t0,
                             t_ready=t1, t_mainloop=t2, t_epilogue=t3, smid=smid,
                             cycles=cycles))
        out.append(recs)
    return out
