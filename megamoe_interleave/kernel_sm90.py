"""Persistent fused MoE kernel for one expert-parallel rank (CuTe DSL, sm_90a): Dispatch, Linear-1 +
SwiGLU x routing weight, Linear-2 and Combine (remote stores) in ONE launch of at most one CTA per
SM, the tiles in the order of a pure-function scheduler (``expert_wave`` or ``interleaved``, paper
Algorithm 1 -- the same step functions as the Python reference in :mod:`.scheduler`).

Warp roles (384 threads; one class, roles as mixins in the style of quack's ``GemmSm90``):

* warps 0-7, two consumer warpgroups -- :class:`~.sm90_mainloop.ConsumerMixin`: WGMMA 128 x BN
  tiles from the smem ring (an m-block of <= 64 valid rows as a 64 x BN half tile, N split over the
  two warpgroups), output staged in smem (stmatrix).
* warp 8, TMA producer -- :class:`~.sm90_mainloop.ProducerMixin`: A and B into the ring.
* warps 9-10, epilogue -- :class:`~.sm90_epilogue.EpilogueMixin`: h stores and publication, the
  Combine remote stores (the seam where the X-Stage lives).
* warp 11, Dispatch -- :class:`~.sm90_dispatch.DispatchMixin`: row pull while the tiles run.

The two CTAs of a scheduler pair form a 2-CTA cluster. They split the row's 2 x 128 rows along M and
multicast the shared B tile (the expert's weights: read once from DRAM), or (``pair_split="n"``,
rows holding <= 128 of their expert's rows) take two N blocks of the row's first 128 rows and
multicast A. An L2 tile waits
for its row's L1 tiles through ``l2_full[row]`` release/acquire counters, an L1 tile for its rows through
``x_ready[row]``. Every wait is bounded: a timeout sets the error word and the host raises
``DeviceError`` instead of hanging. Deadlock freedom: :mod:`.scheduler` (the ring waits are
between the roles of one cluster, which walk identical tile sequences).

Counter words (``mCounters`` int32, per rank): their layout is :mod:`.workspace`'s (error word,
grid-barrier counter, ``l2_full[row]``, ``x_ready[row]``). Not done in the kernel: the routing's prefix sums (host, :func:`.reference.permute_ranks`)
and the final top-k reduction (torch, after every rank's Combine).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int8, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync
from cutlass.utils import LayoutEnum
from quack import sm90_utils
from quack.cute_dsl_utils import mlir_namedtuple

from xstage import device as xdev

from .arguments import MegaMoEArguments
from .config import BLOCK_K, BLOCK_M, WIDEN_TABLES, MegaMoEConfig, bulk_piece_bytes, smem_plan
from .scheduler import RowGrid
from .sm90_dispatch import DISPATCH_POLL_NS, DISPATCH_UNROLL, DISPATCH_WARP_UNROLL, DispatchMixin
from .sm90_epilogue import EpilogueMixin
from . import workspace
from .named_barrier import NamedBarrier
from .sm90_mainloop import ConsumerMixin, ProducerMixin
from .sm90_schedule import DeviceRowRecords, walk_tiles

ERR_DEPENDENCY_TIMEOUT = xdev.ERR_SPIN_TIMEOUT  # a row counter (l2_full / x_ready) wait
ERR_RING_TIMEOUT = xdev.ERR_MBARRIER_TIMEOUT  # a full/empty barrier of the A/B ring, a bulk copy
# setmaxnreg: at the launch's 168 registers per thread ptxas serialized the consumers' WGMMAs in
# some builds (C7511, ~25 % slower mainloops); the producer warpgroup gives registers to the
# consumers: 128 * 88 + 256 * 208 <= 64512 (the launch's pool; 80 / 216 fails at run time).
AUX_WARPGROUP_REGS = 88
MMA_WARPGROUP_REGS = 208
NUM_AUX_THREADS = 96  # warps 1-3 of the producer warpgroup: two epilogue warps, one dispatch warp


@dataclass(frozen=True)
class CtaContext:
    """Where this CTA is: the row layout, its index, the grid size, the wait bound, and the tokens
    per rank of the symmetric buffers (the Combine rows' stride)."""

    grid: RowGrid
    cta: Any
    nctas: Any
    timeout: Any
    max_tokens: Any


@dataclass(frozen=True)
class SharedTensors:
    """Shared memory: the A/B ring, the output staging tile (32-bit words), row metadata, bulk buffers."""

    sA: Any
    sB: Any
    sC: Any
    row_w: Any
    row_addr: Any
    bulk_buf: Any
    bulk_mbar: Any
    stamp_word: Any  # trace builds: a word holding 1, see MegaMoESm90.barrier_timestamp
    row_scale: Any  # W8A8: the staged L1 tile's h scale per row (consumers -> epilogue warps)
    amax_x: Any  # W8A8 half tiles: (2 warpgroups x 64 rows) partial h amax
    sW: Any = None  # W4A8: the widened E4M3 B blocks (sm90_fp4)
    shifts: Any = None  # W4A8: each ring stage's shift words
    tables: Any = None  # W4A8: the group table of every shift


# The host-built arguments become a JIT argument here, where the DSL is imported (arguments.py).
mlir_namedtuple(MegaMoEArguments)


@mlir_namedtuple
class MmaLayouts(NamedTuple):
    """The tile's MMA and the shared-memory layouts of the A/B ring and the staging tile."""

    tiled_mma: Any
    sA: Any
    sB: Any
    sC: Any


@mlir_namedtuple
class TmaOperands(NamedTuple):
    """TMA atoms and coordinate tensors of L1 (A = pool rows, B = w1) and L2 (A = h, B = w2)."""

    tma_a1: Any
    mA1: Any
    tma_b1: Any
    mB1: Any
    tma_a2: Any
    mA2: Any
    tma_b2: Any
    mB2: Any


def n_split_operands(base: type) -> type:
    """``base`` (an operands tuple) with the N split's four atoms and coordinate tensors added
    (fields ``tma_a1_n`` ... ``mB2_n``: A multicast, B plain), for ``pair_split="n"`` builds."""
    if base not in _N_SPLIT_OPERANDS:
        fields = list(base._fields) + [f + "_n" for f in TmaOperands._fields]
        _N_SPLIT_OPERANDS[base] = mlir_namedtuple(NamedTuple(base.__name__ + "N", [(f, Any) for f in fields]))
    return _N_SPLIT_OPERANDS[base]


_N_SPLIT_OPERANDS: dict = {}


class MegaMoESm90(ConsumerMixin, ProducerMixin, EpilogueMixin, DispatchMixin):
    """The fused kernel for ``hidden`` x ``intermediate`` experts and a resolved :class:`MegaMoEConfig`,
    in BF16; a precision is a subclass (W8A8: :class:`~megamoe_interleave.sm90_fp8.MegaMoESm90W8A8`)
    that sets the class attributes below and overrides the consumers' fragments / MMA / staging,
    the Dispatch addressing and the h stores."""

    precision = "bf16"
    ab_dtype, ab_bytes, block_k = BFloat16, 2, BLOCK_K  # one ring stage: a 128-byte swizzle row of K
    # B in the ring, if not ab_dtype x block_k (W4A8: packed E2M1 codes), and E4M3 B blocks outside it
    b_dtype, b_tile_k, widened_buffers = None, None, 0
    aux_warpgroup_regs, mma_warpgroup_regs, dispatch_warp_unroll = AUX_WARPGROUP_REGS, MMA_WARPGROUP_REGS, \
        DISPATCH_WARP_UNROLL
    row_scale_words, amax_words = 1, 1  # shared words a precision's staging needs (bf16: placeholders)
    NamedBarrier = NamedBarrier
    COUNTER_ERROR = workspace.COUNTER_ERROR
    COUNTER_BARRIER = workspace.COUNTER_BARRIER
    COUNTER_L2_FULL = workspace.COUNTER_ROWS  # l2_full[row], then x_ready[row] (workspace.py)
    ERR_DEPENDENCY_TIMEOUT = ERR_DEPENDENCY_TIMEOUT
    ERR_RING_TIMEOUT = ERR_RING_TIMEOUT

    def __init__(self, hidden: int, intermediate: int, config: MegaMoEConfig):
        if not config.resolved:
            raise ValueError("MegaMoESm90 needs a resolved config (MegaMoEConfig.resolve)")
        if hidden % (2 * config.block_n) or (2 * intermediate) % (2 * config.block_n) or hidden % BLOCK_K \
                or intermediate % BLOCK_K:
            raise ValueError(f"H={hidden} and 2I={2 * intermediate} must be multiples of 2*block_n and of {BLOCK_K}")
        if config.precision != self.precision:
            raise ValueError(f"{type(self).__name__} is the {self.precision} kernel, the config asks for "
                             f"{config.precision!r} (kernel.kernel_class picks the class)")
        self.hidden, self.intermediate, self.config = hidden, intermediate, config
        self.b_ring_dtype, self.b_ring_k = self.b_dtype or self.ab_dtype, self.b_tile_k or self.block_k
        self.schedule = config.schedule_spec()
        self.block_n, self.stages, self.trace = config.block_n, config.stages, config.trace
        self.dispatch_copy, self.dispatch_window = config.dispatch_copy, config.dispatch_window
        self.timeout_ns = config.timeout_ns
        plan = smem_plan(hidden, self.block_n, self.stages, self.dispatch_copy, precision=self.precision)
        self.l2_handoffs, self.stage_words = plan.l2_handoffs, plan.stage_words
        self.bulk_piece_bytes = bulk_piece_bytes(hidden, self.ab_bytes)
        self.num_mma_threads = 2 * BLOCK_M
        self.num_threads = self.num_mma_threads + 128
        self.num_epi_threads = NUM_AUX_THREADS - 32
        self.handoff_threads = self.num_mma_threads + self.num_epi_threads
        # a consumer's wait for an L2 tile's first stage spans the producer's row-counter spin
        # (bounded by timeout_ns), so the ring bound is longer: a timed-out spin is reported alone
        self.ring_timeout_ns = 2 * self.timeout_ns
        self.dispatch_polls = max(1, self.timeout_ns // DISPATCH_POLL_NS)  # counted bound of a window wait
        self.pool_rows_per_row = config.row_block
        self.row_split_n = config.row_split_n
        self.pairs_l1, self.pairs_l2 = config.pair_tiles(hidden, intermediate)

    @cute.jit
    def __call__(self, args, max_tokens: Int32, topk: Int32, barrier_base: Int32, num_ctas: Int32,
                 stream):
        """Launch one rank's tiles on ``num_ctas`` CTAs (``args``: :func:`.arguments.tensor_argument_spec`)."""
        ab = self.ab_dtype
        # W8A8: the tile's accumulator layout (the promoted FP32 sums; its WGMMAs run per 128 columns)
        self.tiled_mma = sm90_utils.make_tiled_mma(ab, "K", "K", self.block_n, atom_layout_mnk=(2, 1, 1))
        self.sA_layout = sm90_utils.make_smem_layout(ab, LayoutEnum.ROW_MAJOR, (BLOCK_M, self.block_k),
                                                     stage=self.stages)
        self.sB_layout = sm90_utils.make_smem_layout(self.b_ring_dtype, LayoutEnum.ROW_MAJOR,
                                                     (self.block_n, self.b_ring_k), stage=self.stages)
        self.sC_layout = cute.make_layout(BLOCK_M * self.stage_words)  # see stage_index
        self.shared_storage = self.make_shared_storage(cute.cosize(self.sA_layout), cute.cosize(self.sB_layout),
                                                       cute.cosize(self.sC_layout))
        self.kernel(
            args, max_tokens, topk, barrier_base, MmaLayouts(self.tiled_mma, self.sA_layout, self.sB_layout,
                                                             self.sC_layout),
            self.tma_operands(args),
        ).launch(grid=[num_ctas, 1, 1], block=[self.num_threads, 1, 1], stream=stream,
                 cluster=[2, 1, 1])  # CTAs 2g, 2g + 1 (a scheduler pair) form one cluster

    def make_shared_storage(self, a_elems: int, b_elems: int, c_words: int):
        """The CTA's shared-memory struct (plain Python, so the W4A8 fields can be conditional)."""
        ab = self.ab_dtype
        bulk_bytes = 2 * self.bulk_piece_bytes if self.dispatch_copy == "bulk" else 16
        fields = dict(
            sA=cute.struct.Align[cute.struct.MemRange[ab, a_elems], 1024],
            sB=cute.struct.Align[cute.struct.MemRange[ab, b_elems], 1024],
            sC=cute.struct.Align[cute.struct.MemRange[Float32, c_words], 128],
            ab_mbar=cute.struct.Align[cute.struct.MemRange[Int64, 2 * self.stages], 8],
            row_w=cute.struct.Align[cute.struct.MemRange[Float32, BLOCK_M], 16],
            row_addr=cute.struct.Align[cute.struct.MemRange[Int64, BLOCK_M], 16],
            bulk_buf=cute.struct.Align[cute.struct.MemRange[Int8, bulk_bytes], 128],
            # + trace builds: a word holding 1 (MegaMoESm90.barrier_timestamp)
            bulk_mbar=cute.struct.Align[cute.struct.MemRange[Int64, 2 + int(self.trace)], 8],
            row_scale=cute.struct.Align[cute.struct.MemRange[Float32, self.row_scale_words], 16],
            amax_x=cute.struct.Align[cute.struct.MemRange[Float32, self.amax_words], 16])
        if self.widened_buffers:
            fields.update(sW=cute.struct.Align[cute.struct.MemRange[ab, self.widened_buffers * self.block_n
                                                                    * self.block_k], 1024],
                          shifts=cute.struct.Align[cute.struct.MemRange[Int32, self.stages * self.block_n], 128],
                          tables=cute.struct.Align[cute.struct.MemRange[Int64, WIDEN_TABLES], 8])
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    def tma_operands(self, args):
        """The kernel's TMA atoms and coordinate tensors (:meth:`make_tma_atoms`)."""
        return self.with_n_split_atoms(TmaOperands, self.make_tma_atoms(args.mPoolX, args.mH, args.mW1, args.mW2), args)

    def with_n_split_atoms(self, base: type, values, args):
        """``base(*values)``; with ``pair_split="n"`` also the N split's atoms (:func:`n_split_operands`)."""
        if not self.row_split_n:
            return base(*values)
        return n_split_operands(base)(*values, *self.make_tma_atoms(args.mPoolX, args.mH, args.mW1, args.mW2,
                                                                    n_split=True))

    @cute.jit
    def walk_tiles(self, ctx, body, start, look_ahead: cutlass.Constexpr = False):
        """The loop of every role: this CTA's tiles (pair g = cta // 2, member r = cta % 2 of G pairs) in
        the schedule's order, ``state = body(tile, state)`` per tile from ``start()`` (:func:`walk_tiles`)."""
        return walk_tiles(self.schedule, ctx.cta // 2, ctx.nctas // 2, ctx.cta % 2, ctx.grid, body, start, look_ahead)

    def timestamp(self):
        """%globaltimer when tracing, else a constant (no instruction emitted)."""
        return xdev.globaltimer_ns() if const_expr(self.trace) else Int64(0)

    def barrier_timestamp(self, sm):
        """%globaltimer after a named-barrier wait when tracing, else a constant. A warp leaving
        ``bar.sync`` may issue a plain timer read before the barrier has resolved (seen on the
        H200: the epilogue's stamp after its FULL wait up to 5.6 us before the consumers had
        arrived), so the read waits for a shared-memory load, which cannot pass the barrier."""
        return xdev.globaltimer_after_shared_load(sm.stamp_word) if const_expr(self.trace) else Int64(0)

    def cycle_stamp(self):
        """%clock64 when tracing, else a constant: with the timestamps it gives the SM clock over a
        tile, hence the mainloop in cycles (comparable with the tensor-pipe peak)."""
        return xdev.clock64() if const_expr(self.trace) else Int64(0)

    def stage_index(self, m, c):
        """Word ``c`` of row ``m`` in the staging tile (BM x stage_words 32-bit words): the 16-byte
        group XOR-swizzled by the row, so a warp's stmatrix (8 rows x 4 words) hits 32 distinct
        banks and an epilogue thread's 16-byte chunk stays contiguous."""
        words = self.stage_words
        rows_per_line = max(1, 32 // words)  # rows sharing one 32-bank line
        return m * words + (c ^ (((m // rows_per_line) % self.swizzle_groups) * 4))

    @property
    def swizzle_groups(self) -> int:
        """16-byte groups per row that the swizzle permutes: adding a multiple of it to a group
        adds the same to its swizzled position."""
        return min(8, self.stage_words // 4)

    @cute.kernel
    def kernel(self, args, max_tokens: Int32, topk: Int32, barrier_base: Int32,
               mma: MmaLayouts, ops):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        nctas, _, _ = cute.arch.grid_dim()
        tidx, cta, nctas = Int32(tidx), Int32(cta), Int32(nctas)
        # The plan's sizes come from device memory (written by the host's upload or a device-side
        # planner), so a launch needs no host-side knowledge of the routing.
        # Warp-uniform: ptxas keeps it out of the consumers' 208 registers (a plain load serialized
        # the interleaved builds' WGMMAs, C7511).
        num_rows = cute.arch.make_warp_uniform(Int32(args.mPlan[0]))
        timeout = Int64(self.timeout_ns)
        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        sm = SharedTensors(
            sA=storage.sA.get_tensor(mma.sA.outer, swizzle=mma.sA.inner),
            sB=storage.sB.get_tensor(mma.sB.outer, swizzle=mma.sB.inner),
            sC=storage.sC.get_tensor(mma.sC, dtype=Int32),
            row_w=storage.row_w.get_tensor(cute.make_layout(BLOCK_M)),
            row_addr=storage.row_addr.get_tensor(cute.make_layout(BLOCK_M)),
            bulk_buf=storage.bulk_buf.data_ptr(), bulk_mbar=storage.bulk_mbar.data_ptr(),
            stamp_word=cute.recast_ptr(storage.bulk_mbar.data_ptr() + 2, dtype=Int32),
            row_scale=storage.row_scale.get_tensor(cute.make_layout(self.row_scale_words)),
            amax_x=storage.amax_x.get_tensor(cute.make_layout(self.amax_words)))
        sm = self.precision_shared_tensors(sm, storage, mma)
        self.precision_prologue(sm, tidx)  # before the CTA sync below
        if const_expr(self.trace):
            if tidx == 0:
                cute.make_tensor(sm.stamp_word, cute.make_layout(1))[0] = Int32(1)  # before the CTA sync below
        if self.producer_warp(tidx):
            for atom in (ops.tma_a1, ops.tma_b1, ops.tma_a2, ops.tma_b2):
                cpasync.prefetch_descriptor(atom)
            if const_expr(self.row_split_n):
                for atom in (ops.tma_a1_n, ops.tma_b1_n, ops.tma_a2_n, ops.tma_b2_n):
                    cpasync.prefetch_descriptor(atom)
        ab_pipe = self.make_ab_pipeline(storage.ab_mbar.data_ptr())  # all threads (inits + CTA sync)
        grid = RowGrid(num_rows=num_rows, pairs_l1=self.pairs_l1, pairs_l2=self.pairs_l2,
                       row_record=DeviceRowRecords(args.mRowRecord), wave_row_start=args.mScheduleTable,
                       l2_start=args.mScheduleTable, row_block=self.pool_rows_per_row,
                       row_split_n=self.row_split_n)
        ctx = CtaContext(grid, cta, nctas, timeout, max_tokens)
        gm = args  # the roles read the global tensors by their argument names
        # Prologue: every thread copies this CTA's share of the rows the first tiles may read; the
        # dispatch warp copies the rest while the tiles run.
        self.dispatch_rows(gm, ctx, Int32(0), self.prologue_rows(grid, nctas), tidx // 32, self.num_threads // 32,
                           tidx % 32, DISPATCH_UNROLL)
        if tidx == 0:  # arrive only: the barrier counter still advances by 2 * grid per call
            xdev.red_add_relaxed(args.mCounters.iterator + self.COUNTER_BARRIER, Int32(1), "gpu")
        self.warp_roles(ctx, tidx, gm, sm, ops, ab_pipe, mma.tiled_mma)
        # Neither CTA of the pair exits while the other may still multicast into its smem or arrive
        # on its barriers. Unbounded but hang-free: every wait before it is bounded.
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        # Every tile of this rank is done: reset the row counters for the next call.
        self.grid_sync(args.mCounters, barrier_base + 2 * nctas, timeout, tidx)
        i = cta * self.num_threads + tidx
        while i < 2 * num_rows:
            args.mCounters[self.COUNTER_L2_FULL + i] = Int32(0)
            i = i + nctas * self.num_threads

    def precision_shared_tensors(self, sm, storage, mma):
        """A precision's own views of shared memory (W4A8: the packed ring, the widened blocks)."""
        return sm

    def precision_prologue(self, sm, tidx):
        """A precision's shared-memory setup before the roles start (W4A8: the group tables)."""

    def producer_warp(self, tidx):
        return tidx // 32 == self.num_mma_threads // 32

    @cute.jit
    def warp_roles(self, ctx, tidx: Int32, gm, sm, ops, ab_pipe, tiled_mma):
        """Each role's code inside its warpgroup's branch, right after that warpgroup's setmaxnreg:
        ptxas gives each region its own register budget only when no code of one is reachable from
        the other."""
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        producer = self.num_mma_threads // 32
        dispatch_warp = producer + 1 + self.num_epi_threads // 32
        if warp >= producer:
            cute.arch.setmaxregister_decrease(self.aux_warpgroup_regs)
            if warp == producer:
                self.producer_tiles(ctx, gm, sm, ops, ab_pipe)
            if warp > producer and warp < dispatch_warp:
                self.epilogue_tiles(ctx, tidx - (self.num_mma_threads + 32), gm, sm)
            if warp >= dispatch_warp:
                if const_expr(self.dispatch_copy == "bulk"):
                    if tidx % 32 == 0:
                        self.dispatch_rows_bulk(gm, ctx, sm, self.prologue_rows(ctx.grid, ctx.nctas))
                    # the other lanes wait for lane 0: the CTA barriers after the roles need the warp converged
                    cute.arch.sync_warp()
                else:
                    self.dispatch_rows(gm, ctx, self.prologue_rows(ctx.grid, ctx.nctas), ctx.grid.num_rows,
                                       warp - dispatch_warp, 1, tidx % 32,
                                       self.dispatch_warp_unroll)
        else:
            cute.arch.setmaxregister_increase(self.mma_warpgroup_regs)
            self.consumer_tiles(ctx, tidx, gm, sm, ab_pipe, tiled_mma)

    @cute.jit
    def grid_sync(self, mCounters, target: Int32, timeout: Int64, tidx: Int32):
        """Grid barrier that also publishes memory (CTA barrier, thread 0 fence + arrive + bounded
        acquire spin until ``target``, fence, CTA barrier); needs every CTA resident."""
        cute.arch.sync_threads()
        if tidx == 0:
            cute.arch.fence_acq_rel_gpu()
            xdev.red_add_relaxed(mCounters.iterator + self.COUNTER_BARRIER, Int32(1), "gpu")
            xdev.spin_wait_ge(mCounters.iterator + self.COUNTER_BARRIER, target, timeout,
                              mCounters.iterator + self.COUNTER_ERROR, xdev.ERR_BARRIER_TIMEOUT, True, "gpu")
            cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()
