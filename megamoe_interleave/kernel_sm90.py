"""Persistent fused MoE kernel for one expert-parallel rank (CuTe DSL, sm_90a).

STATUS -- a *functional subset*, honestly labelled:

* done, in ONE persistent kernel (one CTA per SM at most, all resident):
  Dispatch row pull (16-byte loads from the source ranks' symmetric ``x`` through the
  peer table; tma_ws*: overlapped with the tiles -- the rows the first tiles may read by all
  threads, the rest by a dispatch warp while the tiles run, per-row ``x_ready`` counters the
  L1 producer waits on; other kinds: before a grid barrier), a mixed Linear-1 / Linear-2 tile stream ordered by the
  scheduler (``expert_wave`` or ``interleaved`` -- a compile-time switch, the SAME step
  functions as the Python reference in :mod:`megamoe_interleave.scheduler`), L1 +
  SwiGLU x routing weight epilogue, L2 tiles waiting for their row's L1 tiles through
  ``l2_full[row]`` release/acquire counters with bounded spins (timeout -> error word
  -> host raises), L2 epilogue sending each output row with 16-byte remote stores to
  the source rank's ``combine[pick, token]`` slot (Combine), in-kernel counter reset,
  optional per-tile ``%globaltimer`` trace (``trace=True``).
* tile math, compile-time ``mma``:
  ``"tma_ws_mcast_b"`` (the API default, fastest), ``"tma_ws_mcast"`` and ``"tma_ws"`` --
  warp-specialized, GPU-validated (tests/test_megamoe_gpu.py + test_megamoe_host_overhead.py
  on the H200).
  Warp roles: ``block_m / 64`` consumer warpgroups, one producer warpgroup whose first warp
  walks the same schedule and TMA-loads A (dispatched rows / h) and B (expert weights) into
  a ``stages``-deep smem ring guarded by mbarriers (quack ``PipelineTmaAsync``, every wait
  bounded: :class:`BoundedPipelineTmaAsync`, timeout -> error word -> host raises), and
  whose other three warps are **epilogue warps**. The consumers run WGMMA from smem with
  the accumulators in registers, apply SwiGLU x routing weight in registers (L1; gate/up
  interleaved by 8 columns, so each thread holds matching pairs), write the bf16 output tile
  into a staging tile next to the ring and go on with the next tile's mainloop; the
  epilogue warps copy the staged rows out with 16-byte stores (h, or the Combine remote
  stores to the source ranks) and publish h (proxy fence + release of the row counter).
  ``split_tail`` runs an m-block with <= 64 valid rows as a 64 x block_n tile, N split over
  the two consumer warpgroups. ``"tma_ws_mcast"`` launches the two CTAs of a scheduler pair
  (same row, adjacent N blocks) as a 2-CTA cluster: each TMA-loads half of the shared A tile
  and multicasts it into both CTAs' stage; consumers release a stage on both CTAs' empty
  barriers. ``"tma_ws_mcast_b"`` pairs the CTAs along M instead (scheduler rows of 2 x
  block_m, :attr:`RowGrid.pair_splits_m`): adjacent M blocks of one expert, same N block, so
  the pair shares B -- the expert's weights -- and multicasts it; ncu showed tma_ws_mcast
  L2-bound (91 % L2 throughput, 59 % SM) and re-reading weights from DRAM. Both cluster kinds
  drain their full barriers and cluster-sync before exit, so a CTA never leaves while its
  peer may still write into its shared memory (also after a timeout). Assumes all clusters
  of 2 are co-resident (an H200 TPC holds 2 SMs); if not, the bounded grid barrier reports a
  timeout. Tiles 128x256 (default; 4 ring stages with the L2 output staged in two halves,
  or 3 with one -- api.default_tiles picks by rows per expert), 128x128 (4), 64x256 (4).
  ``"wgmma"`` -- one warpgroup, WGMMA (SS) M64 x block_n, K blocks of 64 staged through
  registers into 128-B-swizzled smem, single stage (GPU-validated, ~66-75 TFLOP/s);
  ``"wgmma_cpasync"`` -- the same with a ``stages``-deep cp.async pipeline (GPU tests pass);
  ``"fma"`` -- CUDA-core dot products (GPU-validated reference path, slow).
  The producer warpgroup hands registers to the consumers (setmaxnreg 88 / 208: at the
  launch's 168 ptxas serialized the WGMMAs of some builds). The L1 epilogue's SwiGLU takes one
  tanh.approx per output (``silu="tanh"``). A schedule step costs one 16-byte
  row-record load (:class:`DeviceRowRecords`), which the consumers issue one tile ahead; the
  staging stores are ``stmatrix.x4``. The dispatch warp moves rows with bulk copies where
  their bounce buffers fit (``dispatch_copy``, api.default_dispatch_copy); expert_wave paces
  them a few rows behind the L1 tiles (``dispatch_window``, api.default_dispatch_window).
  Measured (H200, DeepSeek-V4-Flash, 8192 tokens/rank, clock-matched paired trials,
  results/h200/megamoe/final4 and final5): at P = 1 (4 stages) 0.95-0.96x the time of the two
  torch grouped GEMMs alone (faster in every trial), 2.3x faster than the unfused pipeline; at
  loopback P = 8 (3 stages, bulk Dispatch) 1.007x (expert_wave, windowed) / 1.028x
  (interleaved) their time (slower), 2.75x faster than unfused.
* NOT done yet: the dispatch *index* computation (counting / prefix sums of the routed tokens)
  runs on the host (:func:`megamoe_interleave.reference.permute_ranks`); the final top-k
  reduction runs after all ranks (torch), as the loopback world requires anyway.

Counter word layout (``mCounters`` int32, one per rank, in the symmetric buffer):
``[0]`` error word, ``[1]`` grid-barrier counter (monotonic: each call adds 2 * grid to it;
the host passes its value before the call as ``barrier_base``, so the grid may vary per call),
``[2 + row]`` ``l2_full`` of scheduler row ``row``, ``[2 + num_rows + row]`` ``x_ready`` of that
row (overlapped Dispatch: one increment per CTA once its slice of the row has landed); both
zeroed at the end of each call.
"""
from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float32, Int8, Int32, Int64, const_expr

from cutlass.utils import LayoutEnum
from cutlass.cute.nvgpu import cpasync, warpgroup
from quack import sm90_utils
from cutlass.pipeline import Agent, CooperativeGroup, PipelineUserType
from quack.pipeline import PipelineTmaAsync, make_pipeline_state
from quack.activation import swiglu, tanh
from xstage import device as xdev

from .kernel_config import MMA_KINDS, TRACE_FIELDS, WS_KINDS, pair_tiles_per_row, resolve_split_tail  # noqa: F401 (re-exported)
from .scheduler import PHASE_L1, RowGrid, Schedule, Tile, pool_rows_per_row

COUNTER_ERROR = 0
COUNTER_BARRIER = 1
COUNTER_L2_FULL = 2
ERR_DEPENDENCY_TIMEOUT = xdev.ERR_SPIN_TIMEOUT
ERR_RING_TIMEOUT = xdev.ERR_MBARRIER_TIMEOUT  # tma_ws: a full/empty barrier of the A/B ring
INTERLEAVE = 8  # gate/up interleave granularity (api.transform_weights)
MULTISTAGE_KINDS = ("wgmma_cpasync",) + WS_KINDS
CONSUMER_BARRIER_ID = 1  # named barrier of the tma_ws consumer warpgroups (0 = __syncthreads)
EPI_FULL_BARRIER_ID = 2  # tma_ws: staged output tile ready (consumers -> epilogue warps)
EPI_EMPTY_BARRIER_ID = 3  # tma_ws: staging tile free + row metadata in smem (epilogue warps -> consumers)
EPI_BARRIER_ID = 4  # tma_ws: the epilogue warps among themselves
DISPATCH_UNROLL = 8  # 16-byte chunks in flight per thread in the Dispatch row pull (all threads)
DISPATCH_WARP_UNROLL = 12  # the same for the dispatch warps (see AUX_WARPGROUP_REGS)
NUM_AUX_THREADS = 96  # tma_ws: warps 1-3 of the producer warpgroup: epilogue warps, then dispatch warps
DISPATCH_BARRIER_ID = 5  # tma_ws: the dispatch warps among themselves
BLOCK_K = 64  # one 128-byte swizzle row of bf16
DISPATCH_COPIES = ("lsu", "bulk")  # how the dispatch warp copies rows (see dispatch_rows_bulk)
BULK_PIECE_BYTES = 8192  # largest bulk-copy piece of a dispatched row (two bounce buffers in smem)
BULK_WAIT_TRIES = 1 << 20  # try_waits before a bulk load counts as lost (error word, host raises)
DISPATCH_POLL_NS = 256  # windowed Dispatch: sleep between polls of a row counter (counted bound, no timer)
# tma_ws with two consumer warpgroups (384 threads): the launch gives every thread 168 registers
# (64512 / 384). At that cap ptxas serialized the consumers' WGMMAs in some builds (C7511
# "insufficient register resources for the wgmma pipeline": a wait after every WGMMA, ~25 %
# slower mainloops, which build depended on unrelated code such as the scheduler). So the
# producer warpgroup (TMA, epilogue and dispatch warps) gives registers back and the consumers
# take them (setmaxnreg, as quack's GemmSm90 / CUTLASS): 128 * AUX + 256 * MMA <= 64512 (the
# launch's pool; 80 / 216 would ask for more and fails at run time). At 96 / 200 ptxas still
# serialized some builds (the tanh SwiGLU flipped which ones); 88 / 208 keeps the timed builds
# pipelined (not expert_wave's trace build), with the dispatch warps' loads in flight cut to
# DISPATCH_WARP_UNROLL = 12 so the aux warps fit 88 registers without spilling.
AUX_WARPGROUP_REGS = 88
MMA_WARPGROUP_REGS = 208
SMEM_BYTES = 227 * 1024  # sm_90 opt-in shared memory per block
DRAIN_SLACK_NS = 10_000_000  # tma_ws producer waits for loads to land: beyond the peer's ring bound


def swiglu_tanh(gate, up):
    """SwiGLU with sigmoid(g) = 0.5 + 0.5 tanh(g / 2), i.e. silu(g) = g/2 + g/2 tanh(g/2)
    (quack ``tanh``): one MUFU op (tanh.approx, abs. error ~2^-11, below the bf16 rounding of
    h) per output instead of quack ``swiglu``'s two (ex2 + rcp). The consumers' L1 handoff --
    64 outputs per thread, 256 threads, MUFU at 16 ops/clock/SM -- is MUFU-bound."""
    half = gate * 0.5
    return (half + half * tanh(half)) * up


# ``silu`` switch of the L1 epilogue: "exp2" = quack swiglu (ex2.approx + rcp.approx)
SILU_KINDS = {"exp2": swiglu, "tanh": swiglu_tanh}


def tile_fields(tile: Tile):
    """A tile's fields as Int32 values (loop-carried state of a software-pipelined loop)."""
    return tuple(Int32(getattr(tile, f.name)) for f in dataclasses.fields(Tile))


class DeviceRowRecords:
    """:attr:`RowGrid.row_record` in a kernel: ``records[row]`` is the row's (expert, block
    index in the expert, first pool row of the expert, tokens of the expert) in ONE 16-byte
    load from the ``(rows, 4)`` int32 tensor (the host checks its 16-byte alignment), so a
    tile's lookups cost one dependent global load instead of a chain of three
    (row -> expert -> block offset -> token offsets). With the consumers' step issued one tile
    ahead, their gap + wait between tiles fell from ~0.9 to ~0.4 us (H200 traces, P = 8)."""

    def __init__(self, records: cute.Tensor):
        self.base = Int64(records.iterator.toint())

    def __getitem__(self, row):
        src = cute.make_tensor(cute.make_ptr(Int32, self.base + Int64(row) * 16, cute.AddressSpace.gmem,
                                             assumed_align=16), cute.make_layout(4))
        rec = cute.make_rmem_tensor((4,), Int32)
        rec.store(src.load())
        return rec[0], rec[1], rec[2], rec[3]


class BoundedPipelineTmaAsync(PipelineTmaAsync):
    """quack ``PipelineTmaAsync`` (the tma_ws A/B ring) whose waits are bounded.

    Each wait is :func:`xstage.device.mbarrier_wait_bounded`: it gives up after ``timeout_ns``
    of ``%globaltimer``, ORs :data:`ERR_RING_TIMEOUT` into the kernel's error word and returns
    False. ``ok`` carries a thread's health through its waits: once one of them failed (or the
    producer's row-counter spin did), the thread stops waiting and falls through -- arrives,
    TMA copies and WGMMAs still run, on stale data; the producer keeps only the wait for a
    stage's previous load (:meth:`producer_acquire_bounded`) -- so every role ends after at
    most one timeout (plus load latencies) and the host raises ``DeviceError`` from the error
    word. The base class's unbounded
    waits raise at trace time, so none can slip into the kernel."""

    @staticmethod
    def create(*args, **kwargs) -> "BoundedPipelineTmaAsync":
        obj = PipelineTmaAsync.create(*args, **kwargs)
        object.__setattr__(obj, "__class__", BoundedPipelineTmaAsync)  # frozen dataclass (as quack)
        return obj

    def producer_acquire(self, *args, **kwargs):
        raise NotImplementedError("unbounded wait: use producer_acquire_bounded")

    def consumer_wait(self, *args, **kwargs):
        raise NotImplementedError("unbounded wait: use consumer_wait_bounded")

    def producer_tail(self, *args, **kwargs):
        raise NotImplementedError("unbounded wait: use producer_tail_bounded")

    @cute.jit
    def wait_bounded(self, barriers, state, ok: Boolean, timeout_ns: Int64, error_word: cute.Pointer) -> Boolean:
        """Bounded wait for phase ``state.phase`` of stage ``state.index`` of ``barriers`` (the
        full or the empty barriers); no wait once ``ok`` is False."""
        if ok:
            ok = xdev.mbarrier_wait_bounded(barriers.get_barrier(state.index), state.phase, timeout_ns, error_word,
                                            ERR_RING_TIMEOUT)
        return ok

    @cute.jit
    def producer_acquire_bounded(self, state, ok: Boolean, timeout_ns: Int64, error_word: cute.Pointer,
                                 drain_ns: Int64) -> Boolean:
        """``producer_acquire``: wait until the stage is empty, then arm its full barrier with
        the stage's transaction bytes. After a failed wait (``ok`` False) the consumers no longer
        release stages in step, so the producer instead waits (bounded by ``drain_ns``) until the
        stage's previous load has landed -- the full barrier's previous phase, whose parity is the
        producer state's phase -- and never arms a phase twice or lets the transaction count
        run away; the loads still complete it (both CTAs of a pair issue every load)."""
        if ok:
            ok = xdev.mbarrier_wait_bounded(self.sync_object_empty.get_barrier(state.index), state.phase, timeout_ns,
                                            error_word, ERR_RING_TIMEOUT)
        else:
            xdev.mbarrier_wait_bounded(self.sync_object_full.get_barrier(state.index), state.phase, drain_ns,
                                       error_word, ERR_RING_TIMEOUT)
        self.sync_object_full.arrive(state.index, self.producer_mask)
        return ok

    @cute.jit
    def consumer_wait_bounded(self, state, ok: Boolean, timeout_ns: Int64, error_word: cute.Pointer) -> Boolean:
        """``consumer_wait``: wait until the stage's TMA bytes have landed."""
        return self.wait_bounded(self.sync_object_full, state, ok, timeout_ns, error_word)

    @cute.jit
    def producer_tail_bounded(self, state, ok: Boolean, timeout_ns: Int64, error_word: cute.Pointer) -> Boolean:
        """``producer_tail``: wait until every stage has been released (empty barriers arrive in
        no guaranteed order), so no arrive is left in flight when the CTA exits."""
        for _ in cutlass.range_constexpr(self.num_stages):
            ok = self.wait_bounded(self.sync_object_empty, state, ok, timeout_ns, error_word)
            state.advance()
        return ok

    @cute.jit
    def producer_drain_bounded(self, state, drain_ns: Int64, error_word: cute.Pointer):
        """Wait until the last armed phase of every stage's full barrier has completed, i.e.
        every TMA byte bound for this CTA's shared memory (its own loads and the cluster peer's
        multicast) has landed. ``state``: the producer's state after its last load (consumed
        here: pass a clone); at a stage's next, never issued, position the producer phase bit
        equals the parity of that stage's last armed full phase. On the healthy path the
        consumers already waited for these phases, so each check passes at once; after a
        timeout they fell through, and without this a CTA could exit with loads still landing
        in its shared memory. Runs even when ``ok`` is False, with its own bound."""
        for _ in cutlass.range_constexpr(self.num_stages):
            xdev.mbarrier_wait_bounded(self.sync_object_full.get_barrier(state.index), state.phase, drain_ns,
                                       error_word, ERR_RING_TIMEOUT)
            state.advance()


class MegaMoESm90:
    """One kernel class; ``schedule`` (name + lead) and ``mma`` are compile-time switches.

    ``mma``: "tma_ws" / "tma_ws_mcast" (warp-specialized TMA + mbarrier pipelines with
    epilogue warps; the fast paths), "wgmma" (single stage), "wgmma_cpasync", "fma"
    (reference); all GPU-validated. ``stages`` is the ring depth of the multistage kinds;
    ``block_m`` 64/128 = one/two consumer warpgroups; ``split_tail`` (tma_ws*, block_m=128;
    None = on): m-blocks with <= 64 valid rows run as 64-row N-split tiles."""

    def __init__(self, hidden: int, intermediate: int, schedule: Schedule, *, block_m: int = 64,
                 block_n: int = 64, num_threads: int | None = None, timeout_ns: int = 2_000_000_000,
                 mma: str = "fma", stages: int = 4, trace: bool = False, split_tail: bool | None = None,
                 dispatch_warps: int | None = None, l2_handoffs: int | None = None, silu: str = "tanh",
                 dispatch_copy: str = "lsu", dispatch_evict_first: bool = False, dispatch_window: int = 0,
                 dispatch_keep: bool = False):
        if mma not in MMA_KINDS:
            raise ValueError(f"mma must be one of {MMA_KINDS}, got {mma!r}")
        if stages < 2:
            raise ValueError("stages must be >= 2")
        if silu not in SILU_KINDS:
            raise ValueError(f"silu must be one of {sorted(SILU_KINDS)}, got {silu!r}")
        self.swiglu = SILU_KINDS[silu]
        self.stages = stages if mma in MULTISTAGE_KINDS else 1
        if mma != "fma":
            # One warpgroup per 64 rows (WGMMA M64 x block_n each), K in 64-element swizzled blocks;
            # tma_ws adds one producer warpgroup (its first warp issues the TMA loads).
            if block_m not in (64, 128) or block_n not in (64, 128, 256):
                raise ValueError(f"mma={mma!r} needs block_m in {{64, 128}} and block_n in {{64, 128, 256}}")
            want = 2 * block_m + (128 if mma in WS_KINDS else 0)
            if num_threads not in (None, want):
                raise ValueError(f"mma={mma!r} uses {want} threads (one warpgroup per 64 rows"
                                 + (" + a producer warpgroup)" if mma in WS_KINDS else ")"))
            num_threads = want
            if hidden % BLOCK_K or intermediate % BLOCK_K:
                raise ValueError(f"mma={mma!r} needs H and I multiples of {BLOCK_K}")
        num_threads = num_threads or 128
        # Threads that run the tile math and the epilogues (tma_ws: all but the producer warpgroup).
        self.num_mma_threads = 2 * block_m if mma in WS_KINDS else num_threads
        self.ws = mma in WS_KINDS
        # tma_ws with 128-row tiles: m-blocks with <= 64 valid rows (an expert's last block)
        # run as 64-row tiles with N split over the two consumer warpgroups (None = on).
        self.split_tail = resolve_split_tail(mma, block_m, split_tail)
        # tma_ws: Dispatch overlapped with the tiles (see dispatch_rows): after a short prologue
        # by all threads, ``dispatch_warps`` of the three auxiliary warps copy the remaining rows
        # while the others run the epilogues; 0 = every thread copies every row before a grid
        # barrier (the only mode of the other kinds). None = 1 for tma_ws*, else 0.
        if dispatch_warps is None:
            dispatch_warps = 1 if self.ws else 0
        if dispatch_warps not in (0, 1, 2) or (dispatch_warps and not self.ws):
            raise ValueError(f"dispatch_warps must be 0 (any mma) or 1, 2 (mma in {WS_KINDS}), got {dispatch_warps!r}")
        self.dispatch_warps = dispatch_warps
        self.num_epi_threads = NUM_AUX_THREADS - 32 * dispatch_warps
        # The dispatch warp's copy: "lsu" = 16-byte vector loads / stores by its 32 lanes; "bulk" =
        # one lane moves each row with bulk copies (global -> smem -> pool) through two bounce
        # buffers. The LSU copy keeps ~24 vector memory instructions per lane in the SM's MIO
        # queue, which the consumers' WGMMAs issue through too (ncu: HGMMA stalls on MIO
        # throttle; the mainloops run ~6 % more cycles while Dispatch runs, P = 8 loopback).
        if dispatch_copy not in DISPATCH_COPIES:
            raise ValueError(f"dispatch_copy must be one of {DISPATCH_COPIES}, got {dispatch_copy!r}")
        if dispatch_copy == "bulk" and dispatch_warps != 1:
            raise ValueError("dispatch_copy='bulk' needs dispatch_warps=1 (one warp, mma in tma_ws*)")
        self.dispatch_copy = dispatch_copy
        # Each source row is read once per pick and each pool row written once; marking them
        # evict-first keeps them from pushing the reused weight / activation tiles out of L2.
        # (Evict-first on the loads alone made ptxas serialize the WGMMAs. With an explicit
        # evict-normal hint on the pool stores it does not, but that read as much DRAM and ran
        # no faster: results/h200/megamoe/pm_phases/pool_normal.)
        if dispatch_evict_first and dispatch_copy != "bulk":
            raise ValueError("dispatch_evict_first applies to dispatch_copy='bulk' only")
        self.dispatch_evict_first = bool(dispatch_evict_first)
        # Windowed Dispatch (bulk): row r is copied only once row r - W has a finished L1 tile,
        # so the copy runs just ahead of the L1 stream instead of finishing early. Measured to
        # help expert_wave only (api.default_dispatch_window). Deadlock-free for W >= 1
        # (dispatch_rows_bulk).
        if dispatch_window < 0 or (dispatch_window and dispatch_copy != "bulk"):
            raise ValueError(f"dispatch_window must be 0, or >= 1 with dispatch_copy='bulk', got {dispatch_window!r}")
        self.dispatch_window = int(dispatch_window)
        # dispatch_keep: the pool stores are evict-last, so the L1 tiles read the rows from L2,
        # and once a row's L1 tiles are all done its pool lines are discarded from L2 (dead
        # scratch: no DRAM write-back, and the pinned lines stay bounded by the window).
        if dispatch_keep and not self.dispatch_window:
            raise ValueError("dispatch_keep needs dispatch_window >= 1 (it bounds the evict-last pool lines)")
        self.dispatch_keep = bool(dispatch_keep)
        self.bulk_load_policy = "evict_first" if self.dispatch_evict_first else None
        self.bulk_store_policy = "evict_last" if self.dispatch_keep else self.bulk_load_policy
        row_bytes = 2 * hidden
        self.bulk_pieces = next(k for k in range(1, row_bytes // 16 + 1)
                                if row_bytes % k == 0 and (row_bytes // k) % 16 == 0
                                and row_bytes // k <= BULK_PIECE_BYTES)
        self.bulk_piece_bytes = row_bytes // self.bulk_pieces  # per bounce buffer
        # tma_ws_mcast: the two CTAs of a scheduler pair (same row, adjacent N blocks, so the
        # same A tile) form a 2-CTA cluster; each loads half of A and multicasts it to both.
        # tma_ws_mcast_b: the pair splits a 2*BM-row scheduler row along M (adjacent M blocks of
        # one expert, same N block, so the same B tile: the expert's weights are read once from
        # DRAM and cross to the SMs once); each loads half of B and multicasts it to both.
        self.mcast_a = mma == "tma_ws_mcast"
        self.mcast_b = mma == "tma_ws_mcast_b"
        self.cluster_pair = self.mcast_a or self.mcast_b
        if num_threads % 128:
            raise ValueError("num_threads must be a multiple of 128")
        self.mma = mma
        # setmaxnreg (see MMA_WARPGROUP_REGS): two consumer warpgroups + the producer warpgroup
        self.rebalance_registers = self.ws and block_m == 128
        self.trace = trace  # per-tile %globaltimer spans into mTrace (see TRACE_FIELDS)
        if hidden % (2 * block_n) or (2 * intermediate) % (2 * block_n):
            raise ValueError("H and 2I must be multiples of 2*block_n (CTA pairs)")
        if block_n % (2 * INTERLEAVE):
            raise ValueError(f"block_n must be a multiple of {2 * INTERLEAVE}")
        self.hidden, self.intermediate = hidden, intermediate
        self.schedule = schedule
        self.block_m, self.block_n, self.num_threads = block_m, block_n, num_threads
        self.timeout_ns = timeout_ns
        # the dispatch thread's row-counter waits: bounded by a count of polls (no timer, see
        # xdev.spin_wait_ge_tries), about timeout_ns in all
        self.dispatch_polls = max(1, timeout_ns // DISPATCH_POLL_NS)
        # tma_ws ring waits: a consumer's wait for an L2 tile's first stage legitimately spans the
        # producer's row-counter spin (bounded by timeout_ns), so the ring bound is longer; a
        # timed-out spin is then reported alone rather than together with a ring timeout.
        self.ring_timeout_ns = 2 * timeout_ns
        self.pool_rows_per_row = pool_rows_per_row(block_m, self.mcast_b)
        self.pairs_l1 = pair_tiles_per_row(mma, 2 * intermediate, block_n)
        self.pairs_l2 = pair_tiles_per_row(mma, hidden, block_n)
        # Shared memory: A/B stages + a staging tile for the epilogues. Non-ws paths: an fp32
        # accumulator tile for the row-wise epilogues; when that would not fit, it aliases the
        # (drained) A/B stages (multistage path only; it re-synchronizes before refilling them).
        # tma_ws: the tile's bf16 *output* (L1: SwiGLU applied in registers, BN/2 columns; L2:
        # BN columns), never aliased with the ring, handed to the epilogue warps (see
        # consumer_tiles / epilogue_tiles), rows swizzled (stage_index), not padded. L2's BN
        # columns go in ``l2_handoffs`` parts: 1 when the BN-wide staging tile fits next to the
        # ring, else 2 (BN/2 wide, as L1's h columns: 128 x 256 with 4 stages); None = auto.
        # The other paths: BN fp32 per row padded by 4 words.
        ab_bytes = self.stages * BLOCK_K * (block_m + block_n) * 2
        extra = 16 * self.stages + 12 * block_m  # ring mbarriers, row weights + Combine addresses
        if dispatch_copy == "bulk":  # two bounce buffers (128-B aligned) + their mbarriers
            extra += 2 * self.bulk_piece_bytes + 128 + 16
        if l2_handoffs is None:
            l2_handoffs = 1 if ab_bytes + block_m * block_n * 2 + extra <= SMEM_BYTES else 2
        if l2_handoffs not in (1, 2):
            raise ValueError(f"l2_handoffs must be 1 or 2, got {l2_handoffs!r}")
        self.l2_handoffs = l2_handoffs
        self.stage_words = block_n // (2 * l2_handoffs)  # per staged row: >= BN/4 (L1's h columns)
        c_bytes = block_m * self.stage_words * 4 if self.ws else block_m * (block_n + 4) * 4
        self.alias_c = mma == "wgmma_cpasync" and ab_bytes + c_bytes > 200 * 1024
        need = (max(ab_bytes, c_bytes) if self.alias_c else ab_bytes + c_bytes) + extra
        if need > SMEM_BYTES or (self.alias_c and c_bytes > ab_bytes):
            raise ValueError(f"shared memory (A/B {ab_bytes} B, staging {c_bytes} B, other {extra} B) does not fit; "
                             "lower stages or block_n" + (", or dispatch_copy='lsu'" if dispatch_copy == "bulk" else ""))

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        mPeerX: cute.Tensor,  # (P,) int64: base of every rank's symmetric x [T_max, H] bf16
        mPeerCombine: cute.Tensor,  # (P,) int64: base of every rank's combine [k, T_max, H] bf16
        mPoolSrc: cute.Tensor,  # (N_pool, 3) int32: (src rank, token, pick), expert-major
        mPoolWeight: cute.Tensor,  # (N_pool,) f32 routing weight
        mPoolX: cute.Tensor,  # (N_pool + BM, H) bf16 scratch: dispatched rows (BM rows of M-tile padding)
        mH: cute.Tensor,  # (N_pool, I) bf16 scratch: L1 output (post SwiGLU, weighted)
        mW1: cute.Tensor,  # (E_l, 2I, H) bf16, gate/up interleaved
        mW2: cute.Tensor,  # (E_l, H, I) bf16
        mRowRecord: cute.Tensor,  # (max(P_rows,1), 4) int32, 16-byte aligned: RowGrid.row_record
        mScheduleTable: cute.Tensor,  # int32 scheduler.schedule_table: wave_row_start / l2_start
        mCounters: cute.Tensor,  # (>= 2 + 2 * P_rows,) int32: see the counter layout above
        mTrace: cute.Tensor,  # (num_ctas, max_tiles, len(TRACE_FIELDS)) int64 when trace, else any (unused)
        num_rows: Int32,
        num_pool: Int32,
        max_tokens: Int32,
        topk: Int32,
        barrier_base: Int32,
        num_ctas: Int32,
        stream,
    ):
        # Shared memory (used by the wgmma path; the fma path allocates it too, unused).
        self.tiled_mma = sm90_utils.make_tiled_mma(BFloat16, "K", "K", self.block_n,
                                                   atom_layout_mnk=(self.block_m // 64, 1, 1))
        # Staged (BM|BN, BK, S) for the multistage paths, plain 2-D for the single-stage path.
        stage = self.stages if self.mma in MULTISTAGE_KINDS else None
        self.sA_layout = sm90_utils.make_smem_layout(BFloat16, LayoutEnum.ROW_MAJOR, (self.block_m, BLOCK_K),
                                                     stage=stage)
        self.sB_layout = sm90_utils.make_smem_layout(BFloat16, LayoutEnum.ROW_MAJOR, (self.block_n, BLOCK_K),
                                                     stage=stage)
        # Staging tile: tma_ws, the bf16 output as 32-bit words (BM x stage_words, swizzled); the
        # other paths, fp32 accumulators for the row-wise epilogues (+4 words of padding per row).
        if const_expr(self.ws):
            self.sC_layout = cute.make_layout(self.block_m * self.stage_words)  # see stage_index
        else:
            self.sC_layout = cute.make_layout((self.block_m, self.block_n), stride=(self.block_n + 4, 1))

        c_size = 1 if self.alias_c else cute.cosize(self.sC_layout)
        bulk_bytes = 2 * self.bulk_piece_bytes if self.dispatch_copy == "bulk" else 16

        @cute.struct
        class SharedStorage:
            sA: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(self.sA_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(self.sB_layout)], 1024]
            sC: cute.struct.Align[cute.struct.MemRange[Float32, c_size], 128]
            # full/empty mbarriers of the tma_ws A/B ring (last: the other paths' layout is unchanged)
            ab_mbar: cute.struct.Align[cute.struct.MemRange[Int64, 2 * self.stages], 8]
            # tma_ws epilogues: per-row routing weight (L1) / Combine destination address (L2),
            # loaded while the tile's mainloop runs (see consumer_tiles)
            row_w: cute.struct.Align[cute.struct.MemRange[Float32, self.block_m], 16]
            row_addr: cute.struct.Align[cute.struct.MemRange[Int64, self.block_m], 16]
            # dispatch_copy="bulk": the dispatch warp's two bounce buffers and their mbarriers
            bulk_buf: cute.struct.Align[cute.struct.MemRange[Int8, bulk_bytes], 128]
            bulk_mbar: cute.struct.Align[cute.struct.MemRange[Int64, 2], 8]

        self.shared_storage = SharedStorage
        tma = (None,) * 8
        if const_expr(self.ws):
            tma = self.make_tma_atoms(mPoolX, mH, mW1, mW2)
        launch = dict(grid=[num_ctas, 1, 1], block=[self.num_threads, 1, 1], stream=stream)
        if const_expr(self.cluster_pair):
            launch["cluster"] = [2, 1, 1]  # CTAs 2g, 2g+1 (a scheduler pair) form one cluster
        self.kernel(
            mPeerX, mPeerCombine, mPoolSrc, mPoolWeight, mPoolX, mH, mW1, mW2, mRowRecord,
            mScheduleTable, mCounters, mTrace, num_rows, num_pool,
            max_tokens, topk, barrier_base, self.tiled_mma, self.sA_layout, self.sB_layout, self.sC_layout,
            *tma,
        ).launch(**launch)

    def make_tma_atoms(self, mPoolX, mH, mW1, mW2):
        """TMA load atoms + coordinate tensors (tma_ws) for the four GEMM operands, each viewed
        as a compact row-major 2-D matrix (the host checks contiguity): A of L1 = dispatched
        rows ``(n_pad, H)``, A of L2 = h ``(n_pad, I)``, B of L1 = all local experts' w1 rows
        ``(E_l * 2I, H)``, B of L2 = ``(E_l * H, I)``. A tile's A rows start at the expert's
        first token + m_block * BM (not BM-aligned: :meth:`load_tile` offsets the coordinate
        tensor); rows past n_pad are zero-filled by TMA."""
        H, I2, I = self.hidden, 2 * self.intermediate, self.intermediate
        n_pad = cute.size(mPoolX, mode=[0])
        n_exp = cute.size(mW1, mode=[0])
        views = (
            (mPoolX, (n_pad, H), self.sA_layout, self.block_m),
            (mW1, (n_exp * I2, H), self.sB_layout, self.block_n),
            (mH, (n_pad, I), self.sA_layout, self.block_m),
            (mW2, (n_exp * H, I), self.sB_layout, self.block_n),
        )
        out = []
        for i, (t, shape, smem_layout, rows) in enumerate(views):
            compact = cute.make_tensor(t.iterator, cute.make_layout(shape, stride=(shape[1], 1)))
            mcast = (self.mcast_a and i % 2 == 0) or (self.mcast_b and i % 2 == 1)  # A / B operands
            atom, coords = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SMulticastOp() if mcast else cpasync.CopyBulkTensorTileG2SOp(),
                compact, cute.slice_(smem_layout, (None, None, 0)), (rows, BLOCK_K),
                num_multicast=2 if mcast else 1)
            out += [atom, coords]
        return tuple(out)

    # ---------------------------------------------------------------- device
    def _schedule_start(self, cta, nctas, grid):
        """Scheduler instance of a CTA: pair id g, role r in the pair, stride G (pairs) and the
        initial cursor (trace time: emits the same index arithmetic for every role)."""
        g = cta // 2
        r = cta % 2
        G = nctas // 2
        c0, c1 = self.schedule.init(g, grid)
        return g, r, G, Int32(c0), Int32(c1)

    @cute.kernel
    def kernel(self, mPeerX, mPeerCombine, mPoolSrc, mPoolWeight, mPoolX, mH, mW1, mW2, mRowRecord,
               mScheduleTable, mCounters, mTrace, num_rows: Int32,
               num_pool: Int32, max_tokens: Int32, topk: Int32, barrier_base: Int32, tiled_mma: cute.TiledMma,
               sA_layout: cute.ComposedLayout, sB_layout: cute.ComposedLayout, sC_layout: cute.Layout,
               tma_a1, mA1, tma_b1, mB1, tma_a2, mA2, tma_b2, mB2):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        nctas, _, _ = cute.arch.grid_dim()
        tidx, cta, nctas = Int32(tidx), Int32(cta), Int32(nctas)
        timeout = Int64(self.timeout_ns)
        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        if const_expr(self.alias_c):
            # sB follows sA directly (both 1024-B aligned, sizes multiples of 1024 B), so the
            # fp32 staging tile may span both ranges.
            sC = storage.sA.get_tensor(sC_layout, dtype=Float32)
        else:
            sC = storage.sC.get_tensor(sC_layout, dtype=Int32 if self.ws else Float32)
        sRowW = storage.row_w.get_tensor(cute.make_layout(self.block_m))
        sRowAddr = storage.row_addr.get_tensor(cute.make_layout(self.block_m))
        ab_pipe = None
        if const_expr(self.ws):
            if self.producer_warp(tidx):
                for atom in (tma_a1, tma_b1, tma_a2, tma_b2):
                    cpasync.prefetch_descriptor(atom)
            ab_pipe = self.make_ab_pipeline(storage.ab_mbar.data_ptr())  # all threads (inits + CTA sync)

        grid = RowGrid(num_rows=num_rows, pairs_l1=self.pairs_l1, pairs_l2=self.pairs_l2,
                       row_record=DeviceRowRecords(mRowRecord),
                       wave_row_start=mScheduleTable, l2_start=mScheduleTable, pair_splits_m=self.mcast_b,
                       row_block=self.pool_rows_per_row)
        if const_expr(self.dispatch_warps == 0):
            self.copy_chunks(mPeerX, mPoolSrc, mPoolX, Int32(0), num_pool * (self.hidden // 8),
                             cta * (self.num_threads // 32) + tidx // 32, nctas * (self.num_threads // 32),
                             tidx % 32, DISPATCH_UNROLL)
            # Dispatched rows are read by other CTAs' L1 tiles: the barrier publishes them.
            self.grid_sync(mCounters, barrier_base + nctas, timeout, tidx)
        else:
            # Prologue: every thread copies this CTA's share of the rows the CTAs' first tiles
            # may read (an L1 tile at a CTA's step s has row <= ((s + 1) * G - 1) // P1, both
            # schedulers), published per row; the dispatch warps copy the rest during the tiles.
            self.dispatch_rows(mPeerX, mPoolSrc, mPoolX, grid, mCounters, Int32(0),
                               self.prologue_rows(grid, nctas), cta, nctas, tidx // 32, self.num_threads // 32,
                               tidx % 32, DISPATCH_UNROLL)
            if tidx == 0:  # arrive only: the barrier counter still advances by 2 * grid per call
                xdev.red_add_relaxed(mCounters.iterator + COUNTER_BARRIER, Int32(1), "gpu")
        if const_expr(self.ws):
            self.warp_specialized_tiles(
                grid, cta, nctas, tidx, timeout, ab_pipe, tma_a1, mA1, tma_b1, mB1, tma_a2, mA2, tma_b2, mB2,
                mPeerX, mPeerCombine, mPoolSrc, mPoolWeight, mPoolX, mH, mW1, mW2, mCounters,
                max_tokens, sA, sB, sC, sRowW, sRowAddr, tiled_mma, mTrace,
                storage.bulk_buf.data_ptr(), storage.bulk_mbar.data_ptr())
        else:
            g, r, G, c0, c1 = self._schedule_start(cta, nctas, grid)
            n_tile = Int32(0)
            while not self.schedule.done((c0, c1), grid):
                tile, nxt = self.schedule.step((c0, c1), g, G, r, grid)
                if tile.valid > 0:
                    if tile.phase == PHASE_L1:
                        self.l1_tile(tile, mPoolX, mPoolWeight, mH, mW1, mCounters, tidx,
                                     sA, sB, sC, tiled_mma, mTrace, cta, n_tile)
                    else:
                        self.l2_tile(tile, mPeerCombine, mPoolSrc, mH, mW2, mCounters,
                                     max_tokens, tidx, timeout, sA, sB, sC, tiled_mma, mTrace, cta, n_tile)
                    n_tile = n_tile + 1
                c0 = Int32(nxt[0])
                c1 = Int32(nxt[1])

        if const_expr(self.cluster_pair):
            # Neither CTA of the pair exits while the other may still multicast into its shared
            # memory or arrive on its barriers (the producers drained their full barriers above).
            # Unbounded but hang-free: every wait before it is bounded, so both CTAs reach it.
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        # Every tile of this rank is done: reset the row counters (l2_full, x_ready) for the next call.
        self.grid_sync(mCounters, barrier_base + 2 * nctas, timeout, tidx)
        i = cta * self.num_threads + tidx
        while i < 2 * num_rows:
            mCounters[COUNTER_L2_FULL + i] = Int32(0)
            i = i + nctas * self.num_threads

    @cute.jit
    def grid_sync(self, mCounters, target: Int32, timeout: Int64, tidx: Int32):
        """Grid barrier that also publishes memory: every thread's prior writes -> CTA barrier
        -> thread 0 fence + arrive, bounded acquire spin until ``target`` arrivals, fence ->
        CTA barrier. Needs all CTAs resident; a timeout sets ERR_BARRIER_TIMEOUT instead of
        hanging."""
        cute.arch.sync_threads()
        if tidx == 0:
            cute.arch.fence_acq_rel_gpu()
            xdev.red_add_relaxed(mCounters.iterator + COUNTER_BARRIER, Int32(1), "gpu")
            xdev.spin_wait_ge(mCounters.iterator + COUNTER_BARRIER, target, timeout,
                              mCounters.iterator + COUNTER_ERROR, xdev.ERR_BARRIER_TIMEOUT, True, "gpu")
            cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()

    def pool_rows_of(self, grid, row):
        """(first pool row, pool rows) of scheduler row ``row``: its block of the expert's rows."""
        _, m_index, tok0, count = grid.row_record[row]
        p0 = tok0 + m_index * self.pool_rows_per_row
        return p0, cutlass.min(p0 + self.pool_rows_per_row, tok0 + count) - p0

    def prologue_rows(self, grid, nctas):
        """Rows [0, n) that every thread copies before the roles split: those the CTAs' first
        tiles may read (a CTA's L1 tile at step s has row <= ((s + 1) * G - 1) // P1, G pairs)."""
        return cutlass.min(grid.num_rows, (nctas // 2 - 1) // self.pairs_l1 + 1)

    @cute.jit
    def copy_chunks(self, mPeerX, mPoolSrc, mPoolX, lo: Int32, hi: Int32, warp: Int32, num_warps: Int32,
                    lane: Int32, unroll: cutlass.Constexpr):
        """Dispatch row pull of pool chunks [lo, hi) (chunk = 16 bytes; pool row ``i // (H/8)``
        from its source rank's symmetric x) by ``num_warps`` warps. A warp copies 32 * unroll
        consecutive chunks per step (each load instruction reads 512 contiguous bytes;
        consecutive chunks mostly share a row, so the row lookups hit L1) with all ``unroll``
        loads in flight before the first store: one chunk per thread-step left the copy
        latency-bound (~0.5 ms for 400 MB at P = 1)."""
        chunks = self.hidden // 8
        seg = 32 * unroll  # chunks per warp-step
        buf = cute.make_rmem_tensor((8, unroll), BFloat16)
        pool_base = Int64(mPoolX.iterator.toint())
        i0 = lo + warp * seg + lane
        while i0 < hi:
            for j in cutlass.range_constexpr(unroll):
                i = i0 + j * 32
                if i < hi:
                    row = i // chunks
                    addr = Int64(mPeerX[mPoolSrc[row, 0]]) + (Int64(mPoolSrc[row, 1]) * self.hidden
                                                               + Int64((i % chunks) * 8)) * 2
                    src_t = cute.make_tensor(
                        cute.make_ptr(BFloat16, addr, cute.AddressSpace.gmem, assumed_align=16), cute.make_layout(8))
                    buf[None, j].store(src_t.load())
            for j in cutlass.range_constexpr(unroll):
                i = i0 + j * 32
                if i < hi:
                    # chunk i of the pool = row * H + (i % chunks) * 8 elements; 16-byte aligned
                    dst_t = cute.make_tensor(cute.make_ptr(BFloat16, pool_base + Int64(i) * 16, cute.AddressSpace.gmem,
                                                           assumed_align=16), cute.make_layout(8))
                    dst_t.store(buf[None, j].load())
            i0 = i0 + num_warps * seg

    @cute.jit
    def dispatch_rows(self, mPeerX, mPoolSrc, mPoolX, grid, mCounters, row_begin: Int32,
                      row_end: Int32, cta: Int32, nctas: Int32, warp: Int32, num_warps: cutlass.Constexpr,
                      lane: Int32, unroll: cutlass.Constexpr):
        """Overlapped Dispatch: scheduler rows [row_begin, row_end) in row order; of each row this
        CTA copies its 1/nctas slice of the pool chunks (contiguous) with ``num_warps`` warps
        (all of the CTA's, or the dispatch warps), then publishes it: each thread's proxy fence
        (the rows are read by TMA), barrier of the copying warps, one fence + release increment
        of ``x_ready[row]`` (counter word 2 + num_rows + row). A row is dispatched once its word
        reaches nctas; since every CTA publishes in row order, so are all rows before it. Waits
        for nothing but its own loads and stores, so Dispatch progress never depends on tiles
        (the scheduler's deadlock argument treats Dispatch exactly so)."""
        chunks = self.hidden // 8
        ready = mCounters.iterator + COUNTER_L2_FULL + grid.num_rows
        row = row_begin
        while row < row_end:
            p0, n = self.pool_rows_of(grid, row)
            p0, n = p0 * chunks, n * chunks  # in 16-byte chunks
            self.copy_chunks(mPeerX, mPoolSrc, mPoolX, p0 + (cta * n) // nctas, p0 + ((cta + 1) * n) // nctas,
                             warp, num_warps, lane, unroll)
            cute.arch.fence_proxy("async.global")
            cute.arch.barrier(barrier_id=DISPATCH_BARRIER_ID, number_of_threads=32 * num_warps)
            if warp == 0 and lane == 0:
                cute.arch.fence_acq_rel_gpu()
                xdev.red_add_release(ready + row, Int32(1), "gpu")
            row = row + 1

    @cute.jit
    def dispatch_rows_bulk(self, mPeerX, mPoolSrc, mPoolX, grid, mCounters, row_begin: Int32, row_end: Int32,
                           cta: Int32, nctas: Int32, bulk_buf, bulk_mbar):
        """Overlapped Dispatch by ONE thread with bulk copies (``dispatch_copy="bulk"``): scheduler
        rows [row_begin, row_end) in row order, of each this CTA's 1/nctas share of its pool rows
        (whole rows), each row in ``bulk_pieces`` pieces: bulk load of the piece from the source
        rank's x into bounce buffer j % 2 (completing on that buffer's mbarrier), then a bulk
        store from the buffer into the pool; the buffer is reused once the store two pieces back
        has read it (``wait_group.read 1``). A row is published like :meth:`dispatch_rows` once
        all its stores are complete (``wait_group 0``, proxy fence, release fence, increment of
        ``x_ready[row]``). Waits for nothing but its own copies (bounded: a load not landed after
        BULK_WAIT_TRIES try_waits sets ERR_RING_TIMEOUT and the thread stops copying; the L1
        producers' bounded waits for the rows then time out too), so the deadlock argument of
        :meth:`dispatch_rows` holds.

        ``dispatch_window`` W >= 1: before copying row r >= W the thread waits (bounded) until row
        r - W has a finished L1 tile (``l2_full[r - W] >= 1``). The deadlock argument extends
        (tests/test_megamoe_scheduler.py, test_windowed_dispatch_cannot_deadlock): take the
        lowest row r at which some dispatch thread waits; every dispatch thread is past r - W,
        so row r - W is dispatched, and the tiles ahead of its L1 tiles in their CTAs' sequences
        depend on rows below it only, which are dispatched too. ``dispatch_keep``: before each
        row, and for the rows still live after the last one, this CTA's share of the pool lines
        of each row whose L1 tiles are all done is discarded from L2 (:meth:`discard_dead_rows`)."""
        piece = self.bulk_piece_bytes
        row_bytes = 2 * self.hidden
        ready = mCounters.iterator + COUNTER_L2_FULL + grid.num_rows
        err = mCounters.iterator + COUNTER_ERROR
        pool_base = Int64(mPoolX.iterator.toint())
        for b in cutlass.range_constexpr(2):
            cute.arch.mbarrier_init(bulk_mbar + b, 1)
        cute.arch.mbarrier_init_fence()
        ok = Boolean(True)
        j = Int32(0)  # pieces issued so far: buffer j % 2, its mbarrier phase (j // 2) % 2
        l1_done = mCounters.iterator + COUNTER_L2_FULL  # l2_full[row]: finished L1 tiles of the row
        dead = Int32(0)  # dispatch_keep: rows [0, dead) have had this CTA's pool lines discarded
        row = row_begin
        while row < row_end and ok:
            if const_expr(self.dispatch_window > 0):
                if row >= self.dispatch_window:
                    ok = xdev.spin_wait_ge_tries(l1_done + (row - self.dispatch_window), Int32(1),
                                                 self.dispatch_polls, DISPATCH_POLL_NS, err, ERR_DEPENDENCY_TIMEOUT)
                if const_expr(self.dispatch_keep):
                    dead = self.discard_dead_rows(grid, mPoolX, mCounters, dead, row, cta, nctas)
            p0, n = self.pool_rows_of(grid, row)
            i = p0 + (cta * n) // nctas
            while i < p0 + ((cta + 1) * n) // nctas and ok:
                src = Int64(mPeerX[mPoolSrc[i, 0]]) + Int64(mPoolSrc[i, 1]) * row_bytes
                dst = pool_base + Int64(i) * row_bytes
                for q in cutlass.range_constexpr(self.bulk_pieces):
                    b = j % 2
                    buf = bulk_buf + b * piece
                    cute.arch.cp_async_bulk_wait_group(1, read=True)  # the store from this buffer has read it
                    cute.arch.mbarrier_arrive_and_expect_tx(bulk_mbar + b, piece)
                    xdev.bulk_copy_g2s(buf, src + q * piece, piece, bulk_mbar + b, self.bulk_load_policy)
                    # bounded by a count of try_waits: the %globaltimer loop of
                    # xdev.mbarrier_wait_bounded here made ptxas serialize the consumers' WGMMAs
                    # of the interleaved build
                    ok = ok & xdev.mbarrier_wait_tries(bulk_mbar + b, (j // 2) % 2, BULK_WAIT_TRIES, err,
                                                       ERR_RING_TIMEOUT)
                    xdev.bulk_copy_s2g(dst + q * piece, buf, piece, self.bulk_store_policy)
                    cute.arch.cp_async_bulk_commit_group()
                    j = j + 1
                i = i + 1
            cute.arch.cp_async_bulk_wait_group(0)  # the row's stores are complete
            cute.arch.fence_proxy("async.global")
            cute.arch.fence_acq_rel_gpu()
            xdev.red_add_release(ready + row, Int32(1), "gpu")
            row = row + 1
        cute.arch.cp_async_bulk_wait_group(0)
        if const_expr(self.dispatch_keep):
            # the rows still live: poll (bounded) until all are discarded
            polls = Int32(0)
            while ok and dead < grid.num_rows:
                dead = self.discard_dead_rows(grid, mPoolX, mCounters, dead, grid.num_rows, cta, nctas)
                xdev.nanosleep(Int32(DISPATCH_POLL_NS))
                polls = polls + 1
                if polls > self.dispatch_polls:
                    xdev.atomic_or_relaxed(err, Int32(ERR_DEPENDENCY_TIMEOUT), "gpu")
                    ok = Boolean(False)

    @cute.jit
    def discard_dead_rows(self, grid, mPoolX, mCounters, dead: Int32, row_end: Int32, cta: Int32, nctas: Int32,
                          ) -> Int32:
        """``dispatch_keep``: rows from ``dead`` on, up to ``row_end`` and up to the first row whose
        L1 tiles are not all done (acquire of ``l2_full[row]``; no waiting): discard this CTA's
        1/nctas share of the row's pool lines (128 B each) from L2. The L1 tiles were the pool
        rows' only readers, so the lines are dead: no DRAM write-back, and they stop pinning L2
        (the stores were evict-last). Returns the new ``dead``. (A variant that spun on each
        row here made ptxas serialize the consumers' WGMMAs; callers poll instead.)"""
        l1_done = mCounters.iterator + COUNTER_L2_FULL
        full = Int32(2 * self.pairs_l1)
        line_base = Int64(mPoolX.iterator.toint()) // 128
        lines_per_pool_row = (2 * self.hidden) // 128
        going = Boolean(True)
        while dead < row_end and going:
            going = xdev.load_acquire(l1_done + dead, "gpu") >= full
            if going:
                p0, n = self.pool_rows_of(grid, dead)
                lines = n * lines_per_pool_row
                line0 = line_base + Int64(p0 * lines_per_pool_row)
                for k in cutlass.range((cta * lines) // nctas, ((cta + 1) * lines) // nctas, unroll=1):
                    xdev.discard_l2((line0 + Int64(k)) * 128)
                dead = dead + 1
        return dead

    @cute.jit
    def l1_tile(self, tile, mPoolX, mPoolWeight, mH, mW1, mCounters, tidx: Int32,
                sA, sB, sC, tiled_mma, mTrace, cta: Int32, n_tile: Int32):
        """L1 tile: block_n interleaved gate/up columns -> block_n/2 SwiGLU columns of h."""
        t0 = self.timestamp()
        k0 = self.cycle_stamp()
        e = tile.expert
        tok0, count = tile.tok0, tile.count
        if const_expr(self.mma != "fma"):
            self.mainloop_wgmma(mPoolX, mW1, e, tok0 + tile.m_block * self.block_m,
                                count - tile.m_block * self.block_m, tile.n_block * self.block_n,
                                self.hidden, 2 * self.intermediate, sA, sB, sC, tiled_mma, tidx)
        t2 = self.timestamp()
        k2 = self.cycle_stamp()
        self.l1_epilogue_rows(tile, e, tok0, count, mPoolX, mPoolWeight, mH, mW1, sC, tidx)
        # Publish: all threads' h stores -> CTA barrier -> one release increment.
        cute.arch.sync_threads()
        if const_expr(self.trace):
            self.record_trace(mTrace, cta, n_tile, tidx, tile, t0, t0, t2, xdev.globaltimer_ns(), k2 - k0)
        if tidx == 0:
            cute.arch.fence_acq_rel_gpu()
            xdev.red_add_release(mCounters.iterator + COUNTER_L2_FULL + tile.row, Int32(1), "gpu")

    @cute.jit
    def l2_tile(self, tile, mPeerCombine, mPoolSrc, mH, mW2, mCounters,
                max_tokens: Int32, tidx: Int32, timeout: Int64, sA, sB, sC, tiled_mma, mTrace, cta: Int32,
                n_tile: Int32):
        """L2 tile: wait for the row's L1 tiles, block_n output columns, 16-B stores to the source rank."""
        t0 = self.timestamp()
        k0 = self.cycle_stamp()
        if tidx == 0:
            xdev.spin_wait_ge(mCounters.iterator + COUNTER_L2_FULL + tile.row, Int32(2 * self.pairs_l1),
                              timeout, mCounters.iterator + COUNTER_ERROR, ERR_DEPENDENCY_TIMEOUT, True, "gpu")
        cute.arch.sync_threads()
        t1 = self.timestamp()
        e = tile.expert
        tok0, count = tile.tok0, tile.count
        if const_expr(self.mma != "fma"):
            self.mainloop_wgmma(mH, mW2, e, tok0 + tile.m_block * self.block_m,
                                count - tile.m_block * self.block_m, tile.n_block * self.block_n,
                                self.intermediate, self.hidden, sA, sB, sC, tiled_mma, tidx)
        t2 = self.timestamp()
        k2 = self.cycle_stamp()
        self.l2_epilogue_rows(tile, e, tok0, count, mPoolSrc, mPeerCombine, mH, mW2, max_tokens, sC, tidx)
        if const_expr(self.trace):
            cute.arch.sync_threads()  # every thread's Combine stores issued
            self.record_trace(mTrace, cta, n_tile, tidx, tile, t0, t1, t2, xdev.globaltimer_ns(), k2 - k0)
        # No trailing barrier otherwise: the next tile's first CTA barrier orders smem reuse,
        # and h is never overwritten within a call.

    @cute.jit
    def group_accumulators(self, sC, m: Int32, grp: Int32, width: cutlass.Constexpr, n_block: Int32, prow: Int32,
                           e: Int32, mA, mW, K: cutlass.Constexpr):
        """fp32 accumulators of output columns ``[grp * width, +width)`` of tile row ``m`` (row
        ``prow`` of the pool): read from the fp32 staging tile sC, or (fma) dot products of
        ``mA[prow, :K]`` with rows ``n_block * BN + grp * width + j`` of ``mW[e]``."""
        acc = cute.make_rmem_tensor((width,), Float32)
        if const_expr(self.mma != "fma"):
            for j in cutlass.range_constexpr(width):
                acc[j] = sC[m, grp * width + j]
        else:
            n0 = n_block * self.block_n + grp * width
            acc.fill(0.0)
            for k in cutlass.range(K, unroll=1):
                av = Float32(mA[prow, k])
                for j in cutlass.range_constexpr(width):
                    acc[j] = acc[j] + av * Float32(mW[e, n0 + j, k])
        return acc

    @cute.jit
    def l1_epilogue_rows(self, tile, e: Int32, tok0: Int32, count: Int32, mPoolX, mPoolWeight, mH, mW1, sC,
                         tidx: Int32):
        """SwiGLU x routing weight of the tile's valid rows into h (bf16, 16-byte stores) for the
        accumulator tile, read from the fp32 staging tile sC (the fma
        path computes them here). Run by the num_mma_threads tile-math threads."""
        groups = self.block_n // (2 * INTERLEAVE)
        u = tidx
        while u < self.block_m * groups:
            m = u // groups
            grp = u % groups
            tok_local = tile.m_block * self.block_m + m
            if tok_local < count:
                prow = tok0 + tok_local
                acc = self.group_accumulators(sC, m, grp, 2 * INTERLEAVE, tile.n_block, prow, e, mPoolX, mW1,
                                              self.hidden)
                w = mPoolWeight[prow]
                out = cute.make_rmem_tensor((INTERLEAVE,), BFloat16)
                for j in cutlass.range_constexpr(INTERLEAVE):
                    out[j] = BFloat16(self.swiglu(acc[j], acc[INTERLEAVE + j]) * w)
                col = tile.n_block * (self.block_n // 2) + grp * INTERLEAVE
                dst = cute.make_tensor(mH.iterator + prow * self.intermediate + col, cute.make_layout(INTERLEAVE))
                dst.store(out.load())
            u = u + self.num_mma_threads

    def combine_row_offset(self, tok, pick, max_tokens):
        """Byte offset of ``combine[pick, tok, 0]`` in a rank's symmetric combine buffer."""
        return (Int64(pick) * Int64(max_tokens) + Int64(tok)) * (self.hidden * 2)

    @cute.jit
    def l2_epilogue_rows(self, tile, e: Int32, tok0: Int32, count: Int32, mPoolSrc, mPeerCombine, mH, mW2,
                         max_tokens: Int32, sC, tidx: Int32):
        """Combine: the tile's valid output rows (bf16) go with
        16-byte stores to their source rank's ``combine[pick, token]`` slot. Run by the
        num_mma_threads tile-math threads."""
        groups = self.block_n // 8
        u = tidx
        while u < self.block_m * groups:
            m = u // groups
            grp = u % groups
            tok_local = tile.m_block * self.block_m + m
            if tok_local < count:
                prow = tok0 + tok_local
                n0 = tile.n_block * self.block_n + grp * 8
                acc = self.group_accumulators(sC, m, grp, 8, tile.n_block, prow, e, mH, mW2, self.intermediate)
                out = cute.make_rmem_tensor((8,), BFloat16)
                out.store(acc.load().to(BFloat16))
                words = cute.recast_tensor(out, Int32)
                src = mPoolSrc[prow, 0]
                tok = mPoolSrc[prow, 1]
                pick = mPoolSrc[prow, 2]
                offset = self.combine_row_offset(tok, pick, max_tokens) + Int64(n0) * 2
                xdev.store_v4_to_peer(mPeerCombine, src, offset, words[0], words[1], words[2], words[3])
            u = u + self.num_mma_threads

    def timestamp(self):
        """%globaltimer when tracing, else a constant (no instruction emitted)."""
        return xdev.globaltimer_ns() if const_expr(self.trace) else Int64(0)

    def cycle_stamp(self):
        """%clock64 when tracing, else a constant: with the %globaltimer stamps it gives the SM
        clock over a tile, hence the mainloop in cycles (comparable with the tensor-pipe peak)."""
        return xdev.clock64() if const_expr(self.trace) else Int64(0)

    @cute.jit
    def record_trace(self, mTrace, cta: Int32, n_tile: Int32, tidx: Int32, tile, t0: Int64, t1: Int64,
                     t2: Int64, t3: Int64, cycles: Int64):
        """Thread 0 writes one TRACE_FIELDS row (if it fits)."""
        if tidx == 0 and n_tile < cute.size(mTrace, mode=[1]):
            key = (Int64(tile.phase) << 40) | (Int64(tile.row) << 16) | Int64(tile.n_block)
            mTrace[cta, n_tile, 0] = key
            mTrace[cta, n_tile, 1] = t0
            mTrace[cta, n_tile, 2] = t1
            mTrace[cta, n_tile, 3] = t2
            mTrace[cta, n_tile, 4] = t3
            mTrace[cta, n_tile, 5] = Int64(xdev.smid())
            mTrace[cta, n_tile, 6] = cycles


    @cute.jit
    def mainloop_wgmma(self, mA, mB, e: Int32, a_row0: Int32, a_rows: Int32, n0: Int32,
                       K: cutlass.Constexpr, NB: cutlass.Constexpr, sA, sB, sC, tiled_mma, tidx: Int32):
        """acc[BM, BN] = A[a_row0 : a_row0 + BM, :K] @ B[e, n0 : n0 + BN, :K]^T into sC (fp32).

        Rows >= a_rows (past the expert's tokens) load zeros. Simple single-stage loop:
        all threads copy one K block of A and B into swizzled smem with 16-byte loads,
        then the warpgroup issues WGMMA (SS) and waits. (``mma="wgmma_cpasync"``: multistage
        cp.async; the TMA + producer-warp pipeline is :meth:`warp_specialized_tiles`.)"""
        BM, BN = self.block_m, self.block_n
        thr_mma = tiled_mma.get_slice(tidx)
        acc, tCrA, tCrB = sm90_utils.partition_fragment_ABC(thr_mma, (BM, BN, BLOCK_K), sA, sB)
        acc.fill(0.0)
        a_base = Int64(mA.iterator.toint())
        b_base = Int64(mB.iterator.toint()) + Int64(e) * (NB * K * 2)
        if const_expr(self.mma == "wgmma_cpasync"):
            self.kloop_cpasync(a_base, b_base, a_row0, n0, K, sA, sB, acc, tCrA, tCrB, tiled_mma, tidx)
        else:
            self.kloop_sync(a_base, b_base, a_rows, a_row0, n0, K, sA, sB, acc, tCrA, tCrB, tiled_mma, tidx)
        cC = cute.make_identity_tensor((BM, BN))
        tCcC = thr_mma.partition_C(cC)
        for i in cutlass.range_constexpr(cute.size(acc)):
            mm, nn = tCcC[i]
            sC[mm, nn] = acc[i]
        cute.arch.sync_threads()

    @cute.jit
    def kloop_cpasync(self, a_base: Int64, b_base: Int64, a_row0: Int32, n0: Int32, K: cutlass.Constexpr,
                      sA, sB, acc, tCrA, tCrB, tiled_mma, tidx: Int32):
        """Multistage K loop: 16-byte cp.async copies of stage kt+S-1 are in flight while the
        warpgroup runs WGMMA on stage kt. A rows past the expert's tokens read the next rows
        of the (padded) pool: they only feed accumulator rows the epilogue never stores."""
        BM, BN, NT, S = self.block_m, self.block_n, self.num_threads, self.stages
        num_k = K // BLOCK_K
        if const_expr(self.alias_c):
            cute.arch.sync_threads()  # the previous tile's epilogue has finished reading sC
        gA = cute.make_tensor(
            cute.make_ptr(BFloat16, a_base + Int64(a_row0) * (K * 2), cute.AddressSpace.gmem, assumed_align=16),
            cute.make_layout((BM, K), stride=(K, 1)))
        gB = cute.make_tensor(
            cute.make_ptr(BFloat16, b_base + Int64(n0) * (K * 2), cute.AddressSpace.gmem, assumed_align=16),
            cute.make_layout((BN, K), stride=(K, 1)))
        # 16-byte cp.async.cg (L2 only, no L1 allocation): rows of h written by other SMs are
        # never served from a stale L1 line. 8 threads per 64-element K row, as tiled_copy_2d.
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), BFloat16,
                                   num_bits_per_copy=128)
        copy = cute.make_tiled_copy_tv(
            atom, cute.make_ordered_layout((NT // (BLOCK_K // 8), BLOCK_K // 8), order=(1, 0)),
            cute.make_layout((1, 8)))
        thr_copy = copy.get_slice(tidx)
        tAgA = thr_copy.partition_S(cute.local_tile(gA, (BM, BLOCK_K), (0, None)))  # (CPY, M, K, k_tiles)
        tAsA = thr_copy.partition_D(sA)  # (CPY, M, K, stages)
        tBgB = thr_copy.partition_S(cute.local_tile(gB, (BN, BLOCK_K), (0, None)))
        tBsB = thr_copy.partition_D(sB)
        for s in cutlass.range_constexpr(S - 1):
            if s < num_k:
                cute.copy(copy, tAgA[None, None, None, s], tAsA[None, None, None, s])
                cute.copy(copy, tBgB[None, None, None, s], tBsB[None, None, None, s])
            cute.arch.cp_async_commit_group()  # one group per stage, even if empty
        for kt in cutlass.range(num_k, unroll=1):
            cute.arch.cp_async_wait_group(S - 2)  # this thread's copies of stage kt landed
            cute.arch.fence_view_async_shared()
            # All threads' stage-kt copies landed and stage (kt-1)'s WGMMA finished everywhere.
            cute.arch.sync_threads()
            nxt = kt + S - 1
            if nxt < num_k:
                cute.copy(copy, tAgA[None, None, None, nxt], tAsA[None, None, None, nxt % S])
                cute.copy(copy, tBgB[None, None, None, nxt], tBsB[None, None, None, nxt % S])
            cute.arch.cp_async_commit_group()
            stage = kt % S
            sm90_utils.gemm_w_idx(tiled_mma, acc, tCrA, tCrB, False, A_idx=stage, B_idx=stage, wg_wait=0)
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()

    @cute.jit
    def kloop_sync(self, a_base: Int64, b_base: Int64, a_rows: Int32, a_row0: Int32, n0: Int32,
                   K: cutlass.Constexpr, sA, sB, acc, tCrA, tCrB, tiled_mma, tidx: Int32):
        """Single-stage K loop (validated first version): registers -> swizzled smem, then WGMMA."""
        BM, BN, NT = self.block_m, self.block_n, self.num_threads
        chunks_k = BLOCK_K // 8
        for kt in cutlass.range(K // BLOCK_K, unroll=1):
            k0 = kt * BLOCK_K
            for i in cutlass.range_constexpr(BM * chunks_k // NT):
                c = tidx + i * NT
                m = c // chunks_k
                kc = c % chunks_k
                frag = cute.make_rmem_tensor((8,), BFloat16)
                if m < a_rows:
                    addr = a_base + (Int64(a_row0 + m) * K + Int64(k0 + kc * 8)) * 2
                    src = cute.make_tensor(cute.make_ptr(BFloat16, addr, cute.AddressSpace.gmem, assumed_align=16),
                                           cute.make_layout(8))
                    frag.store(src.load())
                else:
                    frag.fill(0.0)
                for j in cutlass.range_constexpr(8):
                    sA[m, kc * 8 + j] = frag[j]
            for i in cutlass.range_constexpr(BN * chunks_k // NT):
                c = tidx + i * NT
                n = c // chunks_k
                kc = c % chunks_k
                addr = b_base + (Int64(n0 + n) * K + Int64(k0 + kc * 8)) * 2
                src = cute.make_tensor(cute.make_ptr(BFloat16, addr, cute.AddressSpace.gmem, assumed_align=16),
                                       cute.make_layout(8))
                frag = cute.make_rmem_tensor((8,), BFloat16)
                frag.store(src.load())
                for j in cutlass.range_constexpr(8):
                    sB[n, kc * 8 + j] = frag[j]
            # Generic-proxy smem writes -> visible to the async proxy (WGMMA), then all warps.
            cute.arch.fence_view_async_shared()
            cute.arch.sync_threads()
            sm90_utils.gemm(tiled_mma, acc, tCrA, tCrB, zero_init=False, wg_wait=0)
            cute.arch.sync_threads()  # smem is overwritten by the next K block

    # ------------------------------------------------ mma="tma_ws" (warp-specialized)
    # Roles: threads [0, num_mma_threads) = block_m/64 consumer warpgroups (WGMMA, SwiGLU,
    # output staging); warp num_mma_threads/32 = TMA producer; the other 3 warps of the last
    # warpgroup = epilogue warps (row metadata, h / Combine stores, h publication). All walk
    # the SAME static schedule independently (pure step functions, no smem broadcast).
    # Producer and consumers meet only at the A/B ring's mbarriers, so the producer runs up
    # to ``stages`` K blocks ahead, across tile boundaries. Consumers and epilogue warps meet
    # at two named barriers per tile (EMPTY: staging tile free + metadata ready; FULL: tile
    # staged), so the epilogue warps' stores of tile i overlap the consumers' mainloop of
    # tile i + 1 (one staging buffer: the consumers wait only if the epilogue of tile i is
    # still running when the mainloop of tile i + 1 ends).
    #
    # Deadlock freedom carries over from the scheduler's argument (scheduler.py): the only
    # new waits are the ring's full/empty barriers between the roles of ONE CTA (cluster kinds:
    # of one 2-CTA cluster, whose CTAs walk identical tile sequences, so the pair acts as one
    # unit in that argument). The named-barrier handoff adds no outside wait: consumers and
    # epilogue warps execute one EMPTY and one FULL barrier per valid tile of the same
    # sequence, so every barrier phase completes. The producer blocks (bounded) on an L2
    # tile's row counter only after it has issued every K block of the tiles before it in this CTA's order, and the
    # consumers finish those without further outside waits. So "the first tile whose loads
    # are not all issued" plays the role of the CTA's head in that argument. Overlapped Dispatch
    # adds the L1 producer's wait on ``x_ready[row]``: the warps that copy rows wait for nothing
    # (no tile, no barrier shared with the tile roles), so that wait always ends -- exactly the
    # scheduler's model, where an L1 tile depends only on Dispatch.
    #
    # No hangs: every ring wait is bounded (BoundedPipelineTmaAsync: mbarrier.try_wait.parity
    # retried until a %globaltimer deadline of ring_timeout_ns = 2 * timeout_ns, then
    # ERR_RING_TIMEOUT in the error word). A thread whose wait (ring or row counter) failed
    # waits no more and falls through (the producer only waits, bounded, for each stage's
    # previous load to land before re-arming it, and drains before exit), so a broken run ends
    # with DeviceError, not a hang or a fault.
    #
    # Memory ordering of the L1 -> L2 handoff: h is written by the epilogue warps with generic
    # st.global and read by the L2 producer with TMA (async proxy). Writer: each epilogue
    # thread fence.proxy.async.global after its h stores, epilogue-warp barrier, one thread
    # fence.acq_rel.gpu + red.release.gpu on l2_full[row]. Reader: every producer lane ld.acquire.gpu spins on
    # l2_full[row], then fence.proxy.async.global, then the TMA loads. The dispatched rows
    # (generic stores, published by the grid barrier) get the same reader-side proxy fence.
    def make_ab_pipeline(self, mbar_ptr):
        """Full/empty mbarrier ring (quack PipelineTmaAsync with bounded waits,
        :class:`BoundedPipelineTmaAsync`): the producer's arrive carries the
        TMA transaction bytes of one stage (A + B, whichever CTA of the pair loaded each half);
        one release arrive per consumer warp and per CTA whose stage it frees (cluster kinds:
        both CTAs of the pair, since the peer multicasts its half of A or B into our stage)."""
        cluster_n = 2 if self.cluster_pair else 1
        return BoundedPipelineTmaAsync.create(
            barrier_storage=mbar_ptr,
            num_stages=self.stages,
            producer_group=CooperativeGroup(Agent.Thread),
            consumer_group=CooperativeGroup(Agent.Thread, cluster_n * (self.num_mma_threads // 32)),
            tx_count=BLOCK_K * (self.block_m + self.block_n) * 2,
            cta_layout_vmnk=cute.make_layout((1, 1, cluster_n, 1)),
        )

    def drain_ns(self):
        """Bound of the producer's waits for loads to land (error path, exit drain): the peer's
        ring bound plus slack for TMA in flight."""
        return Int64(self.ring_timeout_ns + DRAIN_SLACK_NS)

    def producer_warp(self, tidx):
        return tidx // 32 == self.num_mma_threads // 32

    def consumer_sync(self):
        """Barrier of the consumer warpgroups only (the producer warp is elsewhere)."""
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER_ID, number_of_threads=self.num_mma_threads)

    # Consumer <-> epilogue-warp handoff of the staged output tile (named barriers, both sides
    # run the same tile sequence so every barrier phase completes; no spin, nothing to bound):
    # EMPTY: epilogue warps arrive when the staging tile is free and the tile's row metadata is
    # in shared memory, consumers sync before staging; FULL: consumers arrive after staging,
    # epilogue warps sync before reading it.
    def handoff_threads(self):
        return self.num_mma_threads + self.num_epi_threads

    def epi_sync(self):
        """Barrier of the epilogue warps only."""
        cute.arch.barrier(barrier_id=EPI_BARRIER_ID, number_of_threads=self.num_epi_threads)

    @cute.jit
    def warp_specialized_tiles(self, grid, cta: Int32, nctas: Int32, tidx: Int32, timeout: Int64, ab_pipe,
                               tma_a1, mA1, tma_b1, mB1, tma_a2, mA2, tma_b2, mB2, mPeerX, mPeerCombine, mPoolSrc,
                               mPoolWeight, mPoolX, mH, mW1, mW2, mCounters,
                               max_tokens: Int32, sA, sB, sC, sRowW, sRowAddr, tiled_mma, mTrace, bulk_buf,
                               bulk_mbar):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        producer = self.num_mma_threads // 32
        first_dispatch_warp = producer + 1 + self.num_epi_threads // 32
        # Each role's code inside its warpgroup's branch, right after that warpgroup's setmaxnreg:
        # ptxas gives each region its own register budget only when no code of one region is
        # reachable from the other (a shared continuation after both setmaxnreg made it drop them).
        if warp >= producer:
            if const_expr(self.rebalance_registers):
                cute.arch.setmaxregister_decrease(AUX_WARPGROUP_REGS)
            if warp == producer:
                self.producer_tiles(grid, cta, nctas, timeout, ab_pipe, tma_a1, mA1, tma_b1, mB1, tma_a2, mA2,
                                    tma_b2, mB2, mCounters, sA, sB)
            if warp > producer and warp < first_dispatch_warp:
                self.epilogue_tiles(grid, cta, nctas, tidx - (self.num_mma_threads + 32), mPeerCombine, mPoolSrc,
                                    mPoolWeight, mH, mCounters, max_tokens, sC, sRowW, sRowAddr)
            if const_expr(self.dispatch_warps > 0):
                if warp >= first_dispatch_warp:
                    if const_expr(self.dispatch_copy == "bulk"):
                        if tidx % 32 == 0:
                            self.dispatch_rows_bulk(mPeerX, mPoolSrc, mPoolX, grid, mCounters,
                                                    self.prologue_rows(grid, nctas), grid.num_rows, cta, nctas,
                                                    bulk_buf, bulk_mbar)
                        # the other lanes wait here for lane 0: the CTA barriers after the roles
                        # (bar.sync, warp-aligned) need the whole warp converged
                        cute.arch.sync_warp()
                    else:
                        self.dispatch_rows(mPeerX, mPoolSrc, mPoolX, grid, mCounters,
                                           self.prologue_rows(grid, nctas), grid.num_rows, cta, nctas,
                                           warp - first_dispatch_warp, self.dispatch_warps, tidx % 32,
                                           DISPATCH_WARP_UNROLL)
        else:
            if const_expr(self.rebalance_registers):
                cute.arch.setmaxregister_increase(MMA_WARPGROUP_REGS)
            self.consumer_tiles(grid, cta, nctas, tidx, ab_pipe, mPeerCombine, mPoolSrc, mPoolWeight, mPoolX,
                                mH, mW1, mW2, mCounters, max_tokens, sA, sB, sC, sRowW,
                                sRowAddr, tiled_mma, mTrace)

    @cute.jit
    def producer_tiles(self, grid, cta: Int32, nctas: Int32, timeout: Int64, ab_pipe, tma_a1, mA1, tma_b1, mB1,
                       tma_a2, mA2, tma_b2, mB2, mCounters, sA, sB):
        """Producer warp: this CTA's tiles in schedule order; per tile (after an L2 tile's
        bounded acquire wait on its row counter) the K blocks' TMA loads into the ring. After a
        failed wait (ring or row counter; the error word is set) this lane waits no more."""
        cute.arch.fence_proxy("async.global")  # dispatched rows: generic stores -> TMA reads
        g, r, G, c0, c1 = self._schedule_start(cta, nctas, grid)
        state = make_pipeline_state(PipelineUserType.Producer, self.stages)
        ok = Boolean(True)
        rows_ok = Int32(0)  # overlapped Dispatch: rows [0, rows_ok) known dispatched
        while not self.schedule.done((c0, c1), grid):
            tile, nxt = self.schedule.step((c0, c1), g, G, r, grid)
            if tile.valid > 0:
                e = tile.expert
                a_row0 = tile.tok0 + tile.m_block * self.block_m
                if tile.phase == PHASE_L1:
                    if const_expr(self.dispatch_warps > 0):
                        rows_ok, ok = self.wait_dispatched(tile.row, rows_ok, ok, grid, nctas, timeout, mCounters)
                    state, ok = self.load_tile(ab_pipe, state, ok, mCounters, tma_a1, mA1, tma_b1, mB1, a_row0,
                                               e * (2 * self.intermediate) + tile.n_block * self.block_n,
                                               self.hidden // BLOCK_K, sA, sB)
                else:
                    # Every lane acquires (the TMA issue lane is elected inside cute.copy).
                    if ok:
                        ok = xdev.spin_wait_ge(mCounters.iterator + COUNTER_L2_FULL + tile.row,
                                               Int32(2 * self.pairs_l1), timeout, mCounters.iterator + COUNTER_ERROR,
                                               ERR_DEPENDENCY_TIMEOUT, True, "gpu")
                    cute.arch.sync_warp()
                    cute.arch.fence_proxy("async.global")  # h: other CTAs' generic stores -> TMA reads
                    state, ok = self.load_tile(ab_pipe, state, ok, mCounters, tma_a2, mA2, tma_b2, mB2, a_row0,
                                               e * self.hidden + tile.n_block * self.block_n,
                                               self.intermediate // BLOCK_K, sA, sB)
            c0 = Int32(nxt[0])
            c1 = Int32(nxt[1])
        # Every load landed (the peer issues the same loads -- identical tile sequence, loads
        # issued even after a failed wait -- but may still sit in one bounded wait of its own:
        # hence the bound), then every stage consumed, before the warp moves on.
        ab_pipe.producer_drain_bounded(state.clone(), self.drain_ns(), mCounters.iterator + COUNTER_ERROR)
        ab_pipe.producer_tail_bounded(state, ok, Int64(self.ring_timeout_ns), mCounters.iterator + COUNTER_ERROR)

    @cute.jit
    def wait_dispatched(self, row: Int32, rows_ok: Int32, ok: Boolean, grid, nctas: Int32, timeout: Int64,
                        mCounters):
        """Producer, before an L1 tile's loads (overlapped Dispatch, see dispatch_rows): unless
        ``row`` < ``rows_ok`` (known dispatched), one acquire load of the last row's word -- once
        it is published every row is (lane 0's value decides, so the branch is warp-uniform) --
        else a bounded acquire spin on ``x_ready[row]``; then the proxy fence (generic stores ->
        TMA reads). Returns (rows_ok, ok)."""
        ready = mCounters.iterator + COUNTER_L2_FULL + grid.num_rows
        if row >= rows_ok:
            last = xdev.load_acquire(ready + (grid.num_rows - 1), "gpu")
            if cute.arch.shuffle_sync(last, 0) >= nctas:
                rows_ok = grid.num_rows
            else:
                if ok:
                    ok = xdev.spin_wait_ge(ready + row, nctas, timeout, mCounters.iterator + COUNTER_ERROR,
                                           ERR_DEPENDENCY_TIMEOUT, True, "gpu")
                rows_ok = row + 1
            cute.arch.sync_warp()
            cute.arch.fence_proxy("async.global")
        return rows_ok, ok

    @cute.jit
    def load_tile(self, ab_pipe, state, ok: Boolean, mCounters, tma_a, mA, tma_b, mB, a_row0: Int32,
                  b_row0: Int32, num_k: cutlass.Constexpr, sA, sB):
        """TMA loads of the tile's K blocks: A rows [a_row0, +BM), B rows [b_row0, +BN).
        Returns (state, ok): ok turns False when a bounded ring wait timed out."""
        gA = cute.local_tile(cute.domain_offset((a_row0, 0), mA), (self.block_m, BLOCK_K), (0, None))
        gB = cute.local_tile(cute.domain_offset((b_row0, 0), mB), (self.block_n, BLOCK_K), (0, None))
        rank = 0  # our CTA in the pair: which half of the multicast operand we load
        if const_expr(self.cluster_pair):
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        tAsA, tAgA = cpasync.tma_partition(tma_a, rank if self.mcast_a else 0,
                                           cute.make_layout(2 if self.mcast_a else 1),
                                           cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cpasync.tma_partition(tma_b, rank if self.mcast_b else 0,
                                           cute.make_layout(2 if self.mcast_b else 1),
                                           cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
        for kt in cutlass.range(num_k, unroll=1):
            # Stage empty (bounded wait); arms the full barrier with the tx bytes.
            ok = ab_pipe.producer_acquire_bounded(state, ok, Int64(self.ring_timeout_ns),
                                                  mCounters.iterator + COUNTER_ERROR, self.drain_ns())
            bar = ab_pipe.producer_get_barrier(state)
            # The multicast operand: our half, into both CTAs' stage (same index).
            if const_expr(self.mcast_a):
                cute.copy(tma_a, tAgA[None, kt], tAsA[None, state.index], tma_bar_ptr=bar,
                          mcast_mask=cutlass.Int16(0b11))
            else:
                cute.copy(tma_a, tAgA[None, kt], tAsA[None, state.index], tma_bar_ptr=bar)
            if const_expr(self.mcast_b):
                cute.copy(tma_b, tBgB[None, kt], tBsB[None, state.index], tma_bar_ptr=bar,
                          mcast_mask=cutlass.Int16(0b11))
            else:
                cute.copy(tma_b, tBgB[None, kt], tBsB[None, state.index], tma_bar_ptr=bar)
            ab_pipe.producer_commit(state)
            state.advance()
        return state, ok

    @cute.jit
    def consumer_tiles(self, grid, cta: Int32, nctas: Int32, tidx: Int32, ab_pipe, mPeerCombine, mPoolSrc,
                       mPoolWeight, mPoolX, mH, mW1, mW2, mCounters, max_tokens: Int32,
                       sA, sB, sC, sRowW, sRowAddr, tiled_mma, mTrace):
        """Consumer warpgroups: WGMMA over the ring's stages (accumulators in registers), then
        hand the tile to the epilogue warps: wait until the staging tile is free (EMPTY), write
        the bf16 output into it (L1: SwiGLU x routing weight computed in registers; L2: the
        rounded accumulators), arrive on FULL and go straight to the next tile's mainloop
        while the epilogue warps store it (h / Combine remote stores). After a timed-out ring
        wait (error word set) a thread waits no more (and still takes part in the handoff)."""
        frags = self.consumer_fragments(tiled_mma, tidx, sA, sB)
        g, r, G, c0, c1 = self._schedule_start(cta, nctas, grid)
        state = make_pipeline_state(PipelineUserType.Consumer, self.stages)
        ok = Boolean(True)
        n_tile = Int32(0)
        # One step ahead: the step of the next tile (its row-record load) is issued before this
        # tile's mainloop and used after it, so the load latency does not sit between tiles.
        first, nxt = self.schedule.step((c0, c1), g, G, r, grid)
        cur = tile_fields(first)
        n0, n1 = Int32(nxt[0]), Int32(nxt[1])
        while not self.schedule.done((c0, c1), grid):
            ahead, nxt = self.schedule.step((n0, n1), g, G, r, grid)  # may be past the end: idle
            tile = Tile(*cur)
            if tile.valid > 0:
                t0 = self.timestamp()
                k0 = self.cycle_stamp()
                count = tile.count
                # split_tail: an m-block with <= 64 valid rows runs as a 64 x BN tile, N split
                # over the two consumer warpgroups (half the WGMMA work; same ring stages).
                half = Boolean(False)
                if const_expr(self.split_tail):
                    half = count - tile.m_block * self.block_m <= 64
                t1 = Int64(0)
                t2 = Int64(0)
                k2 = Int64(0)
                if tile.phase == PHASE_L1:
                    state, t1, ok = self.tile_mma(ab_pipe, state, ok, mCounters, frags, half, self.hidden // BLOCK_K)
                    t2 = self.timestamp()
                    k2 = self.cycle_stamp()
                    self.hand_off(frags, half, sC, sRowW, True, 0)
                else:
                    state, t1, ok = self.tile_mma(ab_pipe, state, ok, mCounters, frags, half,
                                                  self.intermediate // BLOCK_K)
                    t2 = self.timestamp()
                    k2 = self.cycle_stamp()
                    # BN output columns in l2_handoffs parts (2: the staging tile is half as wide,
                    # so the ring can have a fourth stage at 128 x 256)
                    for part in cutlass.range_constexpr(self.l2_handoffs):
                        self.hand_off(frags, half, sC, sRowW, False, part)
                if const_expr(self.trace):
                    self.record_trace(mTrace, cta, n_tile, tidx, tile, t0, t1, t2, xdev.globaltimer_ns(), k2 - k0)
                n_tile = n_tile + 1
            c0, c1 = n0, n1
            cur = tile_fields(ahead)
            n0, n1 = Int32(nxt[0]), Int32(nxt[1])

    def stage_index(self, m, c):
        """Index of word ``c`` of row ``m`` in the staging tile (BM x stage_words 32-bit words,
        no padding): the 16-byte group XOR-swizzled by the row, so a warp's staging stores (8
        rows x 4 consecutive words) hit 32 distinct banks, and the 4 words of an epilogue
        thread's 16-byte chunk stay contiguous."""
        words = self.stage_words
        rows_per_line = max(1, 32 // words)  # rows sharing one 32-bank line
        groups = min(8, words // 4)  # 16-byte groups per row
        return m * words + (c ^ (((m // rows_per_line) % groups) * 4))

    @cute.jit
    def hand_off(self, frags, half: Boolean, sO, sRowW, swiglu_l1: cutlass.Constexpr, part: cutlass.Constexpr):
        """Consumers: wait until the staging tile is free (EMPTY), stage the output (L1: all
        BN/2 h columns; L2: part ``part`` of l2_handoffs of the BN columns), arrive on FULL."""
        cute.arch.barrier(barrier_id=EPI_EMPTY_BARRIER_ID, number_of_threads=self.handoff_threads())
        self.stage_output(frags, half, sO, sRowW, swiglu_l1, part)
        cute.arch.barrier_arrive(barrier_id=EPI_FULL_BARRIER_ID, number_of_threads=self.handoff_threads())

    @cute.jit
    def epilogue_tiles(self, grid, cta: Int32, nctas: Int32, et: Int32, mPeerCombine, mPoolSrc, mPoolWeight,
                       mH, mCounters, max_tokens: Int32, sO, sRowW, sRowAddr):
        """Epilogue warps (``num_epi_threads`` of the producer warpgroup's other threads, ``et`` = index
        among them): per tile of the same schedule, (1) the rows' metadata into shared memory
        (L1: routing weight, used by the consumers' SwiGLU; L2: the Combine destination
        address ``peer[src] + combine[pick, tok]``), arrive EMPTY; (2) sync FULL, copy the staged
        bf16 rows out with 16-byte stores: L1 into h, then publish h (proxy fence, barrier,
        one release increment of the row counter); L2 straight into the source ranks'
        Combine slots (the X-Stage remote stores, issued while the consumers already run the
        next mainloop)."""
        g, r, G, c0, c1 = self._schedule_start(cta, nctas, grid)
        chunks_l1 = self.block_n // 16  # 16-byte chunks of a staged row: L1, BN/2 h columns
        chunks = self.stage_words // 4  # L2, BN / l2_handoffs output columns
        while not self.schedule.done((c0, c1), grid):
            tile, nxt = self.schedule.step((c0, c1), g, G, r, grid)
            if tile.valid > 0:
                tok0, count = tile.tok0, tile.count
                row0 = tok0 + tile.m_block * self.block_m
                rows = cutlass.min(count - tile.m_block * self.block_m, self.block_m)
                m = et
                while m < rows:
                    if tile.phase == PHASE_L1:
                        sRowW[m] = mPoolWeight[row0 + m]
                    else:
                        sRowAddr[m] = xdev.peer_address(
                            mPeerCombine, mPoolSrc[row0 + m, 0],
                            self.combine_row_offset(mPoolSrc[row0 + m, 1], mPoolSrc[row0 + m, 2], max_tokens))
                    m = m + self.num_epi_threads
                cute.arch.barrier_arrive(barrier_id=EPI_EMPTY_BARRIER_ID, number_of_threads=self.handoff_threads())
                cute.arch.barrier(barrier_id=EPI_FULL_BARRIER_ID, number_of_threads=self.handoff_threads())
                if tile.phase == PHASE_L1:
                    h_base = Int64(mH.iterator.toint()) + Int64(tile.n_block * (self.block_n // 2)) * 2
                    u = et
                    while u < rows * chunks_l1:
                        m, c = u // chunks_l1, u % chunks_l1
                        k = self.stage_index(m, 4 * c)
                        xdev.store_v4(h_base + (Int64(row0 + m) * self.intermediate + c * 8) * 2,
                                      sO[k], sO[k + 1], sO[k + 2], sO[k + 3])
                        u = u + self.num_epi_threads
                    # Publish h: generic stores -> proxy fence (read by TMA) -> barrier -> release.
                    cute.arch.fence_proxy("async.global")
                    self.epi_sync()
                    if et == 0:
                        cute.arch.fence_acq_rel_gpu()
                        xdev.red_add_release(mCounters.iterator + COUNTER_L2_FULL + tile.row, Int32(1), "gpu")
                else:
                    for part in cutlass.range_constexpr(self.l2_handoffs):  # the consumers' handoffs
                        if const_expr(part > 0):
                            # part 0 read out: the staging tile is free for part 1
                            cute.arch.barrier_arrive(barrier_id=EPI_EMPTY_BARRIER_ID,
                                                     number_of_threads=self.handoff_threads())
                            cute.arch.barrier(barrier_id=EPI_FULL_BARRIER_ID, number_of_threads=self.handoff_threads())
                        col0 = tile.n_block * self.block_n + part * (self.block_n // self.l2_handoffs)
                        u = et
                        while u < rows * chunks:
                            m, c = u // chunks, u % chunks
                            k = self.stage_index(m, 4 * c)
                            xdev.store_v4(sRowAddr[m] + Int64(col0 + c * 8) * 2, sO[k], sO[k + 1], sO[k + 2], sO[k + 3])
                            u = u + self.num_epi_threads
                    self.epi_sync()  # every thread done with sRowAddr before the next tile's metadata
            c0 = Int32(nxt[0])
            c1 = Int32(nxt[1])

    def consumer_fragments(self, tiled_mma, tidx, sA, sB):
        """This thread's WGMMA fragments: ``full`` = (tiled_mma, acc, tCrA, tCrB, tCcC) of the
        BM x BN tile (one warpgroup per 64 rows); with split_tail also ``half``: the 64 x BN tile
        of the ring stages' first 64 A rows, one warpgroup per BN/2 columns. Its accumulator: at
        BN = 256 a view of the first half of ``acc``'s registers (its own 64 would not fit the
        consumers' 200), else its own registers (ptxas serialized every WGMMA when the 64 x 64
        half tiles of BN = 128 accumulated into such a view: C7511)."""
        BM, BN = self.block_m, self.block_n
        thr_mma = tiled_mma.get_slice(tidx)
        acc, tCrA, tCrB = sm90_utils.partition_fragment_ABC(thr_mma, (BM, BN, BLOCK_K), sA, sB)
        full = (tiled_mma, acc, tCrA, tCrB, thr_mma.partition_C(cute.make_identity_tensor((BM, BN))))
        half = None
        if const_expr(self.split_tail):
            tiled_mma_h = sm90_utils.make_tiled_mma(BFloat16, "K", "K", BN // 2, atom_layout_mnk=(1, 2, 1))
            thr_mma_h = tiled_mma_h.get_slice(tidx)
            sA_h = cute.local_tile(sA, (64, BLOCK_K, self.stages), (0, 0, 0))
            acc_h_own, tCrA_h, tCrB_h = sm90_utils.partition_fragment_ABC(thr_mma_h, (64, BN, BLOCK_K), sA_h, sB)
            acc_h = cute.make_tensor(acc.iterator, acc_h_own.layout) if BN == 256 else acc_h_own
            half = (tiled_mma_h, acc_h, tCrA_h, tCrB_h, thr_mma_h.partition_C(cute.make_identity_tensor((64, BN))))
        return full, half

    @cute.jit
    def tile_mma(self, ab_pipe, state, ok: Boolean, mCounters, frags, half: Boolean, num_k: cutlass.Constexpr):
        """:meth:`mma_tile` with the full or (split_tail, ``half``) the 64-row fragments."""
        full_f, half_f = frags
        t1 = Int64(0)
        if const_expr(self.split_tail):
            if half:
                state, t1, ok = self.mma_tile(ab_pipe, state, ok, mCounters, *half_f[:4], num_k)
            else:
                state, t1, ok = self.mma_tile(ab_pipe, state, ok, mCounters, *full_f[:4], num_k)
        else:
            state, t1, ok = self.mma_tile(ab_pipe, state, ok, mCounters, *full_f[:4], num_k)
        return state, t1, ok

    @cute.jit
    def mma_tile(self, ab_pipe, state, ok: Boolean, mCounters, tiled_mma, acc, tCrA, tCrB,
                 num_k: cutlass.Constexpr):
        """acc = A_tile @ B_tile^T over num_k ring stages (as quack GemmSm90.mma, one WGMMA
        batch in flight: stage k-1 is released once batch k has been issued and k-1 retired).
        Returns (state, timestamp when the first stage had landed, ok of the bounded waits)."""
        timeout = Int64(self.ring_timeout_ns)
        err = mCounters.iterator + COUNTER_ERROR
        release = state.clone()
        ok = ab_pipe.consumer_wait_bounded(state, ok, timeout, err)
        t1 = self.timestamp()
        sm90_utils.gemm_w_idx(tiled_mma, acc, tCrA, tCrB, True, A_idx=state.index, B_idx=state.index, wg_wait=-1)
        state.advance()
        for kt in cutlass.range(1, num_k, unroll=1):
            ok = ab_pipe.consumer_wait_bounded(state, ok, timeout, err)
            sm90_utils.gemm_w_idx(tiled_mma, acc, tCrA, tCrB, False, A_idx=state.index, B_idx=state.index,
                                  wg_wait=1)
            ab_pipe.consumer_release(release)
            release.advance()
            state.advance()
        warpgroup.wait_group(0)
        ab_pipe.consumer_release(release)
        return state, t1, ok

    @cute.jit
    def stage_output(self, frags, half: Boolean, sO, sRowW, swiglu_l1: cutlass.Constexpr, part: cutlass.Constexpr):
        """Accumulators -> bf16 output in the staging tile, as 32-bit words of column pairs (full
        or, split_tail, the 64-row fragments). L1: all h columns; L2: all BN columns, or with two
        handoffs output columns [part * BN/2, (part + 1) * BN/2) -- the full fragment's elements
        [part, part + 1) * size/2 (each warpgroup holds all BN columns of its 64 rows), of the
        64-row fragments those of warpgroup ``part`` (each holds BN/2 columns of all 64 rows)."""
        full_f, half_f = frags
        size = cute.size(full_f[1])
        parts = 1 if swiglu_l1 else self.l2_handoffs
        lo = part * (size // parts)
        hi = (part + 1) * (size // parts)
        col0 = part * (self.block_n // parts)
        if const_expr(self.split_tail):
            if half:
                size_h = cute.size(half_f[1])
                if const_expr(parts == 1):
                    self.stage_fragment(half_f[1], half_f[4], sO, sRowW, swiglu_l1, 0, size_h, 0)
                else:
                    if cute.arch.make_warp_uniform(cute.arch.warp_idx()) // 4 == part:
                        self.stage_fragment(half_f[1], half_f[4], sO, sRowW, False, 0, size_h, col0)
            else:
                self.stage_fragment(full_f[1], full_f[4], sO, sRowW, swiglu_l1, lo, hi, col0)
        else:
            self.stage_fragment(full_f[1], full_f[4], sO, sRowW, swiglu_l1, lo, hi, col0)

    @cute.jit
    def stage_fragment(self, acc, tCcC, sO, sRowW, swiglu_l1: cutlass.Constexpr, lo: cutlass.Constexpr,
                       hi: cutlass.Constexpr, col0: cutlass.Constexpr):
        """WGMMA accumulator fragment ((2, 2, BN/8), 1, 1): element v0 + 2 v1 + 4 j holds row
        r + 8 v1, column 8 j + 2 q + v0 (q = lane % 4; tCcC gives (row, column)), so for each
        8-column group j a warp holds two 8 x 8 tiles (v1 = 0, 1) in the ``stmatrix`` layout once
        the pairs are packed to bf16x2. Each ``stmatrix.x4`` stores four such tiles (two column
        groups): lane l points at row ``l % 16`` of the warp's 16 rows, column group ``l // 16``
        of the two. L1 (``swiglu_l1``): gate/up interleaved by 8 columns, so fragment j = 2 jj
        (gate) and j = 2 jj + 1 (up) hold matching columns: h = SwiGLU(gate, up) x weight in
        fp32 registers, bf16, h column group jj; x4 = h groups jj, jj + 1. L2: elements
        [lo, hi) rounded to bf16, output column - col0; x4 = fragment groups j, j + 1."""
        lane = cute.arch.lane_idx()
        row0, _ = tCcC[0]  # this lane's first row: the warp's first row + lane // 4
        row = row0 - lane // 4 + lane % 16  # the row whose 16-byte segment this lane stores
        vals = cute.make_rmem_tensor((8,), BFloat16)
        words = cute.recast_tensor(vals, Int32)
        if const_expr(swiglu_l1):
            for jj in cutlass.range_constexpr(0, cute.size(acc) // 8, 2):
                for t in cutlass.range_constexpr(2):
                    for v1 in cutlass.range_constexpr(2):
                        i = 8 * (jj + t) + 2 * v1  # gate element (v0 = 0); up = i + 4
                        mm, _ = tCcC[i]
                        w = sRowW[mm]
                        for v0 in cutlass.range_constexpr(2):
                            vals[4 * t + 2 * v1 + v0] = BFloat16(self.swiglu(acc[i + v0], acc[i + 4 + v0]) * w)
                _, nn = tCcC[8 * jj]  # gate column 16 jj' + 2 q -> h column group jj'
                group = (nn - 2 * (lane % 4)) // 16 + lane // 16
                xdev.stmatrix_x4(sO.iterator + self.stage_index(row, 4 * group), words[0], words[1], words[2],
                                 words[3])
        else:
            for i0 in cutlass.range_constexpr(lo, hi, 8):
                for k in cutlass.range_constexpr(8):
                    vals[k] = BFloat16(acc[i0 + k])
                _, nn = tCcC[i0]
                group = (nn - 2 * (lane % 4) - col0) // 8 + lane // 16
                xdev.stmatrix_x4(sO.iterator + self.stage_index(row, 4 * group), words[0], words[1], words[2],
                                 words[3])


NUM_SCALAR_ARGS = 6  # num_rows, num_pool, max_tokens, topk, barrier_base, num_ctas


def tensor_argument_spec(hidden: int, intermediate: int):
    """The kernel's tensor arguments as (name, dtype, shape); str dims are dynamic and
    must agree wherever the same name appears. Single source of truth for the compile
    (fake tensors) and for the host-side check of real launch arguments."""
    return [
        ("mPeerX", Int64, ("P",)),
        ("mPeerCombine", Int64, ("P",)),
        ("mPoolSrc", Int32, ("n_pool", 3)),
        ("mPoolWeight", Float32, ("n_pool",)),
        ("mPoolX", BFloat16, ("n_pad", hidden)),  # n_pad = n_pool + block_m (padded M tiles)
        ("mH", BFloat16, ("n_pad", intermediate)),
        ("mW1", BFloat16, ("E_l", 2 * intermediate, hidden)),
        ("mW2", BFloat16, ("E_l", hidden, intermediate)),
        ("mRowRecord", Int32, ("n_rows", 4)),
        ("mScheduleTable", Int32, ("n_s",)),
        ("mCounters", Int32, ("n_c",)),
        ("mTrace", Int64, ("n_tc", "n_tt", len(TRACE_FIELDS))),
    ]


def check_launch_arguments(hidden: int, intermediate: int, tensors) -> None:
    """Raise ValueError unless ``tensors`` (torch) match :func:`tensor_argument_spec`:
    dtype, rank, static dims, consistent dynamic dims, row-major contiguity (the kernel
    does its own address arithmetic on compact rows)."""
    import torch

    to_torch = {Int64: torch.int64, Int32: torch.int32, Float32: torch.float32, BFloat16: torch.bfloat16}
    spec = tensor_argument_spec(hidden, intermediate)
    if len(tensors) != len(spec):
        raise ValueError(f"expected {len(spec)} tensor arguments, got {len(tensors)}")
    bound = {}
    for (name, dtype, shape), t in zip(spec, tensors):
        if t.dtype != to_torch[dtype]:
            raise ValueError(f"{name}: dtype {t.dtype}, expected {to_torch[dtype]}")
        if t.dim() != len(shape):
            raise ValueError(f"{name}: rank {t.dim()}, expected {len(shape)}")
        for i, (want, got) in enumerate(zip(shape, t.shape)):
            if isinstance(want, str):
                if bound.setdefault(want, got) != got:
                    raise ValueError(f"{name}: dim {i} = {got} but {want} = {bound[want]} elsewhere")
            elif want != got:
                raise ValueError(f"{name}: dim {i} = {got}, expected {want}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if name == "mRowRecord" and t.data_ptr() % 16:
            raise ValueError("mRowRecord must be 16-byte aligned (one vector load per record)")
        if name == "mPoolX" and t.is_cuda and t.data_ptr() % 128:
            raise ValueError("mPoolX must be 128-byte aligned (TMA tiles; dispatch_keep discards its 128-B L2 lines)")


def compile_megamoe_sm90(hidden: int, intermediate: int, schedule: Schedule, *, options: str = "", **kw):
    """Compile for the current CUTE_DSL_ARCH with fake tensors (no GPU needed). ``options``
    are appended to the DSL compile options (e.g. ``--keep-ptx --dump-dir=DIR``)."""
    from quack.compile_utils import make_fake_stream, make_fake_tensor

    op = MegaMoESm90(hidden, intermediate, schedule, **kw)
    syms = {}
    tensors = []
    for _, dtype, shape in tensor_argument_spec(hidden, intermediate):
        dims = tuple(syms.setdefault(d, cute.sym_int()) if isinstance(d, str) else d for d in shape)
        div = 8 if dtype is BFloat16 else 1
        tensors.append(make_fake_tensor(dtype, dims, divisibility=div))
    args = (*tensors, *([Int32(0)] * NUM_SCALAR_ARGS), make_fake_stream())
    return cute.compile(op, *args, options=" ".join(["--enable-tvm-ffi", options]).strip())
