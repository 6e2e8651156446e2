"""Persistent fused MoE kernel for one expert-parallel rank (CuTe DSL, sm_90a).

STATUS -- a *functional subset*, honestly labelled:

* done, in ONE persistent kernel (one 128-thread CTA per SM at most, all resident):
  Dispatch row pull (16-byte loads from the source ranks' symmetric ``x`` through the
  peer table), grid barrier, a mixed Linear-1 / Linear-2 tile stream ordered by the
  scheduler (``expert_wave`` or ``interleaved`` -- a compile-time switch, the SAME step
  functions as the Python reference in :mod:`megamoe_interleave.scheduler`), L1 +
  SwiGLU x routing weight epilogue, L2 tiles waiting for their row's L1 tiles through
  ``l2_full[row]`` release/acquire counters with bounded spins (timeout -> error word
  -> host raises), L2 epilogue sending each output row with 16-byte remote stores to
  the source rank's ``combine[pick, token]`` slot (Combine), in-kernel counter reset,
  optional per-tile ``%globaltimer`` trace (``trace=True``).
* tile math, compile-time ``mma``:
  ``"wgmma"``  -- one warpgroup, WGMMA (SS) M64 x block_n, K blocks of 64 staged through
  registers into 128-B-swizzled smem, single stage (GPU-validated, ~66-75 TFLOP/s on
  DeepSeek-V4-Flash, results/h200/megamoe);
  ``"wgmma_cpasync"`` -- the same with a ``stages``-deep cp.async pipeline (compiles;
  NOT yet run on a GPU);
  ``"fma"`` -- CUDA-core dot products (GPU-validated reference path, slow).
* NOT done yet: TMA loads + mbarrier pipeline + producer warp / two consumer
  warpgroups (planned from quack ``GemmSm90`` pieces: ``PipelineTmaAsync``,
  ``make_tiled_tma_atom``, ``partition_fragment_ABC``); the dispatch *index* computation
  (counting / prefix sums of the routed tokens) runs on the host
  (:func:`megamoe_interleave.reference.permute_for_rank`); the final top-k reduction runs
  after all ranks (torch), as the loopback world requires anyway. Performance is
  therefore well below the goal (the torch grouped GEMMs are ~7x faster).

Counter word layout (``mCounters`` int32, one per rank, in the symmetric buffer):
``[0]`` error word, ``[1]`` grid-barrier counter (monotonic: each call adds 2 * grid to it;
the host passes its value before the call as ``barrier_base``, so the grid may vary per call),
``[2 + row]`` ``l2_full`` of scheduler row ``row`` (zeroed at the end of each call).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, const_expr

from cutlass.utils import LayoutEnum
from cutlass.cute.nvgpu import cpasync
from quack import sm90_utils
from quack.activation import swiglu
from xstage import device as xdev

from .scheduler import PHASE_L1, RowGrid, Schedule

COUNTER_ERROR = 0
COUNTER_BARRIER = 1
COUNTER_L2_FULL = 2
ERR_DEPENDENCY_TIMEOUT = xdev.ERR_SPIN_TIMEOUT
INTERLEAVE = 8  # gate/up interleave granularity (api.transform_weights)
MMA_KINDS = ("fma", "wgmma", "wgmma_cpasync")
BLOCK_K = 64  # one 128-byte swizzle row of bf16


class MegaMoESm90:
    """One kernel class; ``schedule`` (name + lead) is a compile-time switch."""

    def __init__(self, hidden: int, intermediate: int, schedule: Schedule, *, block_m: int = 64,
                 block_n: int = 64, num_threads: int | None = None, timeout_ns: int = 2_000_000_000,
                 mma: str = "fma", stages: int = 4, trace: bool = False):
        if mma not in MMA_KINDS:
            raise ValueError(f"mma must be one of {MMA_KINDS}, got {mma!r}")
        if stages < 2:
            raise ValueError("stages must be >= 2")
        self.stages = stages if mma == "wgmma_cpasync" else 1
        if mma.startswith("wgmma"):
            # One warpgroup per 64 rows (WGMMA M64 x block_n each), K in 64-element swizzled blocks.
            if block_m not in (64, 128) or block_n not in (64, 128, 256):
                raise ValueError("mma='wgmma*' needs block_m in {64, 128} and block_n in {64, 128, 256}")
            if num_threads not in (None, 2 * block_m):
                raise ValueError(f"mma='wgmma*' uses {2 * block_m} threads (one warpgroup per 64 rows)")
            num_threads = 2 * block_m
            if hidden % BLOCK_K or intermediate % BLOCK_K:
                raise ValueError(f"mma='wgmma*' needs H and I multiples of {BLOCK_K}")
        num_threads = num_threads or 128
        if num_threads % 128:
            raise ValueError("num_threads must be a multiple of 128")
        self.mma = mma
        self.trace = trace  # per-tile %globaltimer spans into mTrace (see TRACE_FIELDS)
        if hidden % (2 * block_n) or (2 * intermediate) % (2 * block_n):
            raise ValueError("H and 2I must be multiples of 2*block_n (CTA pairs)")
        if block_n % (2 * INTERLEAVE):
            raise ValueError(f"block_n must be a multiple of {2 * INTERLEAVE}")
        self.hidden, self.intermediate = hidden, intermediate
        self.schedule = schedule
        self.block_m, self.block_n, self.num_threads = block_m, block_n, num_threads
        self.timeout_ns = timeout_ns
        self.pairs_l1 = (2 * intermediate) // block_n // 2
        self.pairs_l2 = hidden // block_n // 2
        # Shared memory: A/B stages + an fp32 accumulator staging tile for the row-wise
        # epilogues. When that would not fit, the staging tile aliases the (drained) A/B
        # stages (multistage path only; it re-synchronizes before refilling them).
        ab_bytes = self.stages * BLOCK_K * (block_m + block_n) * 2
        c_bytes = block_m * (block_n + 4) * 4
        self.alias_c = mma == "wgmma_cpasync" and ab_bytes + c_bytes > 200 * 1024
        need = max(ab_bytes, c_bytes) if self.alias_c else ab_bytes + c_bytes
        if need > 220 * 1024 or (self.alias_c and c_bytes > ab_bytes):
            raise ValueError(f"shared memory (A/B {ab_bytes} B, staging {c_bytes} B) does not fit; "
                             "lower stages or block_n")

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        mPeerX: cute.Tensor,  # (P,) int64: base of every rank's symmetric x [T_max, H] bf16
        mPeerCombine: cute.Tensor,  # (P,) int64: base of every rank's combine [k, T_max, H] bf16
        mPoolSrc: cute.Tensor,  # (N_pool, 3) int32: (src rank, token, pick), expert-major
        mPoolWeight: cute.Tensor,  # (N_pool,) f32 routing weight
        mPoolX: cute.Tensor,  # (N_pool, H) bf16 scratch: dispatched rows
        mH: cute.Tensor,  # (N_pool, I) bf16 scratch: L1 output (post SwiGLU, weighted)
        mW1: cute.Tensor,  # (E_l, 2I, H) bf16, gate/up interleaved
        mW2: cute.Tensor,  # (E_l, H, I) bf16
        mRowExpert: cute.Tensor,  # (max(P_rows,1),) int32
        mExpertRowOffset: cute.Tensor,  # (E_l+1,) int32
        mExpertTokenOffset: cute.Tensor,  # (E_l+1,) int32
        mWaveRowStart: cute.Tensor,  # (W+2,) int32
        mCounters: cute.Tensor,  # (>= 2 + P_rows,) int32
        mTrace: cute.Tensor,  # (num_ctas, max_tiles, 6) int64 when trace, else any (unused)
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
        # Staged (BM|BN, BK, S) for the multistage path, plain 2-D for the single-stage path.
        stage = self.stages if self.mma == "wgmma_cpasync" else None
        self.sA_layout = sm90_utils.make_smem_layout(BFloat16, LayoutEnum.ROW_MAJOR, (self.block_m, BLOCK_K),
                                                     stage=stage)
        self.sB_layout = sm90_utils.make_smem_layout(BFloat16, LayoutEnum.ROW_MAJOR, (self.block_n, BLOCK_K),
                                                     stage=stage)
        # fp32 accumulator staging for the row-wise epilogues (+4 words of padding per row).
        self.sC_layout = cute.make_layout((self.block_m, self.block_n), stride=(self.block_n + 4, 1))

        c_size = 1 if self.alias_c else cute.cosize(self.sC_layout)

        @cute.struct
        class SharedStorage:
            sA: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(self.sA_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(self.sB_layout)], 1024]
            sC: cute.struct.Align[cute.struct.MemRange[Float32, c_size], 128]

        self.shared_storage = SharedStorage
        self.kernel(
            mPeerX, mPeerCombine, mPoolSrc, mPoolWeight, mPoolX, mH, mW1, mW2, mRowExpert,
            mExpertRowOffset, mExpertTokenOffset, mWaveRowStart, mCounters, mTrace, num_rows, num_pool,
            max_tokens, topk, barrier_base, self.tiled_mma, self.sA_layout, self.sB_layout, self.sC_layout,
        ).launch(grid=[num_ctas, 1, 1], block=[self.num_threads, 1, 1], stream=stream)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, mPeerX, mPeerCombine, mPoolSrc, mPoolWeight, mPoolX, mH, mW1, mW2, mRowExpert,
               mExpertRowOffset, mExpertTokenOffset, mWaveRowStart, mCounters, mTrace, num_rows: Int32,
               num_pool: Int32, max_tokens: Int32, topk: Int32, barrier_base: Int32, tiled_mma: cute.TiledMma,
               sA_layout: cute.ComposedLayout, sB_layout: cute.ComposedLayout, sC_layout: cute.Layout):
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
            sC = storage.sC.get_tensor(sC_layout)

        self.dispatch(mPeerX, mPoolSrc, mPoolX, num_pool, cta, nctas, tidx)
        # Dispatched rows are read by other CTAs' L1 tiles: the barrier publishes them.
        self.grid_sync(mCounters, barrier_base + nctas, timeout, tidx)

        grid = RowGrid(num_rows=num_rows, pairs_l1=self.pairs_l1, pairs_l2=self.pairs_l2,
                       row_expert=mRowExpert, expert_row_offset=mExpertRowOffset,
                       wave_row_start=mWaveRowStart)
        g = cta // 2
        r = cta % 2
        G = nctas // 2
        c0, c1 = self.schedule.init(g)
        c0 = Int32(c0)
        c1 = Int32(c1)
        n_tile = Int32(0)
        while not self.schedule.done((c0, c1), grid):
            tile, nxt = self.schedule.step((c0, c1), g, G, r, grid)
            if tile.valid > 0:
                if tile.phase == PHASE_L1:
                    self.l1_tile(tile, mPoolX, mPoolWeight, mH, mW1, mExpertTokenOffset, mCounters, tidx,
                                 sA, sB, sC, tiled_mma, mTrace, cta, n_tile)
                else:
                    self.l2_tile(tile, mPeerCombine, mPoolSrc, mH, mW2, mExpertTokenOffset, mCounters,
                                 max_tokens, tidx, timeout, sA, sB, sC, tiled_mma, mTrace, cta, n_tile)
                n_tile = n_tile + 1
            c0 = Int32(nxt[0])
            c1 = Int32(nxt[1])

        # Every tile of this rank is done: reset the row counters for the next call.
        self.grid_sync(mCounters, barrier_base + 2 * nctas, timeout, tidx)
        i = cta * self.num_threads + tidx
        while i < num_rows:
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

    @cute.jit
    def dispatch(self, mPeerX, mPoolSrc, mPoolX, num_pool: Int32, cta: Int32, nctas: Int32, tidx: Int32):
        """Pull every routed row from its source rank's symmetric x, 16 bytes per thread-step."""
        chunks = self.hidden // 8
        i = cta * self.num_threads + tidx
        total = num_pool * chunks
        while i < total:
            row = i // chunks
            c = i % chunks
            src = mPoolSrc[row, 0]
            tok = mPoolSrc[row, 1]
            addr = Int64(mPeerX[src]) + (Int64(tok) * self.hidden + Int64(c * 8)) * 2
            src_t = cute.make_tensor(
                cute.make_ptr(BFloat16, addr, cute.AddressSpace.gmem, assumed_align=16), cute.make_layout(8))
            dst_t = cute.make_tensor(mPoolX.iterator + row * self.hidden + c * 8, cute.make_layout(8))
            dst_t.store(src_t.load())
            i = i + nctas * self.num_threads

    @cute.jit
    def l1_tile(self, tile, mPoolX, mPoolWeight, mH, mW1, mExpertTokenOffset, mCounters, tidx: Int32,
                sA, sB, sC, tiled_mma, mTrace, cta: Int32, n_tile: Int32):
        """L1 tile: block_n interleaved gate/up columns -> block_n/2 SwiGLU columns of h."""
        t0 = self.timestamp()
        e = tile.expert
        tok0 = mExpertTokenOffset[e]
        count = mExpertTokenOffset[e + 1] - tok0
        if const_expr(self.mma != "fma"):
            self.mainloop_wgmma(mPoolX, mW1, e, tok0 + tile.m_block * self.block_m,
                                count - tile.m_block * self.block_m, tile.n_block * self.block_n,
                                self.hidden, 2 * self.intermediate, sA, sB, sC, tiled_mma, tidx)
        t2 = self.timestamp()
        groups = self.block_n // (2 * INTERLEAVE)
        u = tidx
        while u < self.block_m * groups:
            m = u // groups
            grp = u % groups
            tok_local = tile.m_block * self.block_m + m
            if tok_local < count:
                prow = tok0 + tok_local
                n0 = tile.n_block * self.block_n + grp * 2 * INTERLEAVE
                acc = cute.make_rmem_tensor((2 * INTERLEAVE,), Float32)
                if const_expr(self.mma != "fma"):
                    for j in cutlass.range_constexpr(2 * INTERLEAVE):
                        acc[j] = sC[m, grp * 2 * INTERLEAVE + j]
                else:
                    acc.fill(0.0)
                    for k in cutlass.range(self.hidden, unroll=1):
                        xv = Float32(mPoolX[prow, k])
                        for j in cutlass.range_constexpr(2 * INTERLEAVE):
                            acc[j] = acc[j] + xv * Float32(mW1[e, n0 + j, k])
                w = mPoolWeight[prow]
                out = cute.make_rmem_tensor((INTERLEAVE,), BFloat16)
                for j in cutlass.range_constexpr(INTERLEAVE):
                    out[j] = BFloat16(swiglu(acc[j], acc[INTERLEAVE + j]) * w)
                col = tile.n_block * (self.block_n // 2) + grp * INTERLEAVE
                dst = cute.make_tensor(mH.iterator + prow * self.intermediate + col, cute.make_layout(INTERLEAVE))
                dst.store(out.load())
            u = u + self.num_threads
        # Publish: all threads' h stores -> CTA barrier -> one release increment.
        cute.arch.sync_threads()
        if const_expr(self.trace):
            self.record_trace(mTrace, cta, n_tile, tidx, tile, t0, t0, t2, xdev.globaltimer_ns())
        if tidx == 0:
            cute.arch.fence_acq_rel_gpu()
            xdev.red_add_release(mCounters.iterator + COUNTER_L2_FULL + tile.row, Int32(1), "gpu")

    @cute.jit
    def l2_tile(self, tile, mPeerCombine, mPoolSrc, mH, mW2, mExpertTokenOffset, mCounters,
                max_tokens: Int32, tidx: Int32, timeout: Int64, sA, sB, sC, tiled_mma, mTrace, cta: Int32,
                n_tile: Int32):
        """L2 tile: wait for the row's L1 tiles, block_n output columns, 16-B stores to the source rank."""
        t0 = self.timestamp()
        if tidx == 0:
            xdev.spin_wait_ge(mCounters.iterator + COUNTER_L2_FULL + tile.row, Int32(2 * self.pairs_l1),
                              timeout, mCounters.iterator + COUNTER_ERROR, ERR_DEPENDENCY_TIMEOUT, True, "gpu")
        cute.arch.sync_threads()
        t1 = self.timestamp()
        e = tile.expert
        tok0 = mExpertTokenOffset[e]
        count = mExpertTokenOffset[e + 1] - tok0
        if const_expr(self.mma != "fma"):
            self.mainloop_wgmma(mH, mW2, e, tok0 + tile.m_block * self.block_m,
                                count - tile.m_block * self.block_m, tile.n_block * self.block_n,
                                self.intermediate, self.hidden, sA, sB, sC, tiled_mma, tidx)
        t2 = self.timestamp()
        groups = self.block_n // 8
        u = tidx
        while u < self.block_m * groups:
            m = u // groups
            grp = u % groups
            tok_local = tile.m_block * self.block_m + m
            if tok_local < count:
                prow = tok0 + tok_local
                n0 = tile.n_block * self.block_n + grp * 8
                acc = cute.make_rmem_tensor((8,), Float32)
                if const_expr(self.mma != "fma"):
                    for j in cutlass.range_constexpr(8):
                        acc[j] = sC[m, grp * 8 + j]
                else:
                    acc.fill(0.0)
                    for k in cutlass.range(self.intermediate, unroll=1):
                        hv = Float32(mH[prow, k])
                        for j in cutlass.range_constexpr(8):
                            acc[j] = acc[j] + hv * Float32(mW2[e, n0 + j, k])
                out = cute.make_rmem_tensor((8,), BFloat16)
                out.store(acc.load().to(BFloat16))
                words = cute.recast_tensor(out, Int32)
                src = mPoolSrc[prow, 0]
                tok = mPoolSrc[prow, 1]
                pick = mPoolSrc[prow, 2]
                offset = ((Int64(pick) * Int64(max_tokens) + Int64(tok)) * self.hidden + Int64(n0)) * 2
                xdev.store_v4_to_peer(mPeerCombine, src, offset, words[0], words[1], words[2], words[3])
            u = u + self.num_threads
        if const_expr(self.trace):
            cute.arch.sync_threads()  # every thread's Combine stores issued
            self.record_trace(mTrace, cta, n_tile, tidx, tile, t0, t1, t2, xdev.globaltimer_ns())
        # No trailing barrier otherwise: the next tile's first CTA barrier orders smem reuse,
        # and h is never overwritten within a call.

    def timestamp(self):
        """%globaltimer when tracing, else a constant (no instruction emitted)."""
        return xdev.globaltimer_ns() if const_expr(self.trace) else Int64(0)

    @cute.jit
    def record_trace(self, mTrace, cta: Int32, n_tile: Int32, tidx: Int32, tile, t0: Int64, t1: Int64,
                     t2: Int64, t3: Int64):
        """Thread 0 writes one TRACE_FIELDS row (if it fits)."""
        if tidx == 0 and n_tile < cute.size(mTrace, mode=[1]):
            key = (Int64(tile.phase) << 40) | (Int64(tile.row) << 16) | Int64(tile.n_block)
            mTrace[cta, n_tile, 0] = key
            mTrace[cta, n_tile, 1] = t0
            mTrace[cta, n_tile, 2] = t1
            mTrace[cta, n_tile, 3] = t2
            mTrace[cta, n_tile, 4] = t3
            mTrace[cta, n_tile, 5] = Int64(xdev.smid())


    @cute.jit
    def mainloop_wgmma(self, mA, mB, e: Int32, a_row0: Int32, a_rows: Int32, n0: Int32,
                       K: cutlass.Constexpr, NB: cutlass.Constexpr, sA, sB, sC, tiled_mma, tidx: Int32):
        """acc[BM, BN] = A[a_row0 : a_row0 + BM, :K] @ B[e, n0 : n0 + BN, :K]^T into sC (fp32).

        Rows >= a_rows (past the expert's tokens) load zeros. Simple single-stage loop:
        all threads copy one K block of A and B into swizzled smem with 16-byte loads,
        then the warpgroup issues WGMMA (SS) and waits. (Planned: TMA + multi-stage
        mbarrier pipeline + producer warp, as in quack's GemmSm90.)"""
        BM, BN, NT = self.block_m, self.block_n, self.num_threads
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


# Per-tile trace row (trace=True): phase<<40 | row<<16 | n_block, then %globaltimer (ns) at
# tile start, after the L1-dependency wait (L2; = start for L1), after the mainloop, after
# the epilogue (L2: every thread's Combine stores issued; L1: h stored, before the release),
# and the SM id.
TRACE_FIELDS = ("key", "t_start", "t_ready", "t_mainloop", "t_epilogue", "smid")
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
        ("mRowExpert", Int32, ("n_rows",)),
        ("mExpertRowOffset", Int32, ("n_e1",)),
        ("mExpertTokenOffset", Int32, ("n_e1",)),
        ("mWaveRowStart", Int32, ("n_w",)),
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


def compile_megamoe_sm90(hidden: int, intermediate: int, schedule: Schedule, **kw):
    """Compile for the current CUTE_DSL_ARCH with fake tensors (no GPU needed)."""
    from quack.compile_utils import make_fake_stream, make_fake_tensor

    op = MegaMoESm90(hidden, intermediate, schedule, **kw)
    syms = {}
    tensors = []
    for _, dtype, shape in tensor_argument_spec(hidden, intermediate):
        dims = tuple(syms.setdefault(d, cute.sym_int()) if isinstance(d, str) else d for d in shape)
        div = 8 if dtype is BFloat16 else 1
        tensors.append(make_fake_tensor(dtype, dims, divisibility=div))
    args = (*tensors, *([Int32(0)] * NUM_SCALAR_ARGS), make_fake_stream())
    return cute.compile(op, *args, options="--enable-tvm-ffi")
