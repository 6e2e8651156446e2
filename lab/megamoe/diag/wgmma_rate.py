"""The FP8 WGMMA rate of the W8A8 mainloop's batch shapes, with shared-memory-resident operands: the
microbenchmark of docs/moe-core.md section 4, which settles difference D1 (64-column slices re-read A
four times per 128 K) before choosing between redesign options 1 (N = 128 batches) and 4.

Each CTA has the consumer side of one 128-row tile only: two warpgroups, one per 64 rows, looping
over ``stages`` ring stages that stay in shared memory (no TMA, no producer). Per stage (128 of K)
a warpgroup issues the tile's ``tile_n`` columns in batches of ``slice_n`` (``m64n{slice_n}k32``
SS FP8 WGMMAs, 4 per batch) and, with ``promote``, folds each finished batch into the tile's FP32
sums as the W8A8 kernel does (``acc += part * c``; two slice fragments, so batch j + 1 runs while
batch j is promoted, the kernel's ping-pong). ``slice_n == tile_n`` without ``promote`` is the
plain accumulate: the tensor pipe's ceiling for the tile. With ``refill`` thread 0 also issues,
per k-block, a bulk copy of one stage's bytes from an L2-resident source into one of two other
shared-memory buffers (two in flight; it waits for the copy two back): the TMA refills'
shared-memory writes that the real ring adds, without a producer warp (one would need setmaxnreg,
which ptxas drops here with C7508, leaving the consumers 168 registers).

With ``widen`` (W4A8, docs/w4a8.md) each k-block first widens a packed E2M1 stage (256 rows x 64
bytes and a shift byte per row and 32 K, resident in shared memory) into the stage's B operand with
:func:`megamoe_interleave.fp4_widen.widen_e2m1x8`, all 256 threads (one 32-weight group each, four
times), then fences and syncs before the WGMMAs: the consumer-side widening's cost next to the same
variant without it.

Half tiles (``half``, the small-batch case: a 64-row M block, a warpgroup per 128 columns) run the shipped
half tile's consumer side, with ``widen`` each warpgroup first widening its own 128 B rows (the kernel's way: the
group tables looked up in shared memory, then a fence and the warpgroup's barrier). ``swap_rs_n`` is the W4A8 half
tile with A and B swapped (docs/w4a8.md): the 256 weight rows are the WGMMA's M side, two ``m64`` tiles per
warpgroup, widened by each thread straight into its RS A fragment from the packed stage (no widened copy in shared
memory, no barrier), and the tile's first ``swap_rs_n`` rows of the A stage (the tokens) are
B; each m-tile's batch is promoted with a scale per (weight row, token). Without ``widen`` the A fragments are
loaded once: the swapped WGMMAs' own rate.

A variant's rate is MACs per SM cycle: ``rows x tile_n x 128 x k_blocks`` (rows: 128, 64 for a half tile, ``swap_rs_n`` swapped) over the CTA's
``%clock64`` span of the loop (the median over CTAs), against 4096 (sm_90's dense FP8 rate). Its
operands are zeros, so the rate is the instruction and operand stream's, not the data's.

    python scripts/diag/wgmma_rate.py                 # every variant: a table and wgmma_rate.json
    python scripts/diag/wgmma_rate.py --compile-only  # no GPU: compile every variant (CI does)
    python scripts/diag/wgmma_rate.py --only "1 fragment" n192   # the variants whose names contain these
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import asdict, dataclass
from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import Float8E4M3FN, Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.utils import LayoutEnum
from quack import sm90_utils

from megamoe_interleave.config import MegaMoEConfig
from megamoe_interleave.fp4_widen import MIN_SHIFT, TABLES, group_table, shift_factor, widen_e2m1x8
from megamoe_interleave.shapes import get_shape
from megamoe_interleave.sm90_fp4 import MegaMoESm90W4A8
from xstage import device as xdev

BLOCK_M, BLOCK_K = 128, 128  # one W8A8 tile's rows, one ring stage's K (one promotion block)
THREADS = 256  # two consumer warpgroups
FP8_MACS_PER_CLK = 4096  # sm_90 dense FP8 per SM


@dataclass(frozen=True)
class Variant:
    tile_n: int  # the tile's columns per stage (the accumulator's width)
    slice_n: int  # columns per WGMMA batch
    promote: bool  # fold each batch into FP32 sums (W8A8), else accumulate in place
    ping_pong: bool = True  # promote: two batch fragments (batch j + 1 runs while j is promoted), else one
    refill: bool = False  # a warpgroup streams one stage's bytes per k-block into shared memory meanwhile
    stages: int = 4
    k_blocks: int = 512
    widen: bool = False  # W4A8: widen a packed E2M1 stage into B before each k-block's WGMMAs
    half: bool = False  # a 64-row half tile: a warpgroup per 128 columns, one batch each
    swap_rs_n: int = 0  # a W4A8 half tile with A and B swapped: the weights (RS A) x this many tokens (B)
    # one fragment: the warpgroups' batches as they come (""), warpgroup 1 one batch behind warpgroup 0 from the
    # start ("stagger"), or each batch issued after the other warpgroup's has completed ("turns")
    order: str = ""

    def __post_init__(self):
        if self.tile_n % self.slice_n or self.slice_n not in (64, 128, 192, 256) or self.tile_n > 256:
            raise ValueError(f"tile_n {self.tile_n} must be a multiple of slice_n {self.slice_n} in 64..256")
        if not self.promote and self.slice_n != self.tile_n:
            raise ValueError("without promote the batch is the whole tile (slice_n == tile_n)")
        if self.widen and (self.tile_n != 256 or self.refill):
            raise ValueError("widen is the W4A8 tile's: tile_n 256, no refill")
        if (self.half or self.swap_rs_n) and (self.tile_n, self.slice_n, self.promote, self.ping_pong, self.refill) != (
                256, 128, True, False, False):
            raise ValueError("a half tile is the kernel's: 256 columns, a 128-column batch per warpgroup, promoted")
        if self.swap_rs_n and (self.half or self.swap_rs_n % 8 or not 8 <= self.swap_rs_n <= 64):
            raise ValueError(f"swap_rs_n: 8..64 tokens in steps of 8, got {self.swap_rs_n}")
        if self.order not in ("", "stagger", "turns") or self.order and (
                not self.promote or self.ping_pong or self.half or self.swap_rs_n or self.widen or self.refill):
            raise ValueError(f"order {self.order!r}: '', 'stagger' or 'turns', for a full tile's single fragment")

    @property
    def rows(self) -> int:
        """The tile's M rows (tokens) per k-block's MACs."""
        return self.swap_rs_n or (64 if self.half else BLOCK_M)

    @property
    def name(self) -> str:
        if self.swap_rs_n:
            return (f"half n256 x {self.swap_rs_n} tokens, A/B swapped, RS" + (" + widen E2M1" if self.widen
                                                                                else " (A preloaded)"))
        if self.half:
            return "half n256: 2 WG x n128 + promote" + (" + widen E2M1" if self.widen else "")
        how = f"{self.tile_n // self.slice_n} x n{self.slice_n}" + (
            "" if not self.promote else " + promote" + ("" if self.ping_pong else ", 1 fragment")) + (
            " + refill" if self.refill else "") + (" + widen E2M1" if self.widen else "") + (
            f", warpgroups {self.order}" if self.order else "")
        return f"tile n{self.tile_n}: {how}"

    @property
    def stage_bytes(self) -> int:
        return (BLOCK_M + self.tile_n) * BLOCK_K  # FP8: one byte per element


VARIANTS = (
    Variant(256, 256, False),  # the ceiling of the 128 x 256 tile
    Variant(128, 128, False),
    Variant(256, 64, True),  # the shipped W8A8 mainloop: 4 slices of 64, ping-pong
    Variant(256, 128, True),  # one batch per 128-column scale block, ping-pong (two 64-register fragments)
    Variant(256, 128, True, ping_pong=False),  # redesign option 1 as docs/moe-core.md has it: one fragment
    # (the shipped W8A8 full tile). Do its warpgroups lose the pipe by finishing their batches together?
    Variant(256, 128, True, ping_pong=False, order="stagger"),
    Variant(256, 128, True, ping_pong=False, order="turns"),
    Variant(192, 192, True, ping_pong=False),  # DeepGEMM's scheme: one n192 batch per 128 K, one fragment
    Variant(128, 64, True),
    Variant(128, 128, True),  # DeepGEMM-like width per promotion (its tile is 128 x 192 / 2 WGs)
    Variant(256, 256, False, refill=True, stages=2),  # the same with the refills' shared-memory writes
    Variant(256, 64, True, refill=True, stages=2),
    Variant(256, 128, True, ping_pong=False, refill=True, stages=2),
    Variant(256, 256, False, widen=True),  # W4A8: the widening before the plain tile
    Variant(256, 128, True, ping_pong=False, widen=True),  # ... before the shipped W8A8 batches
    Variant(256, 128, True, ping_pong=False, half=True),  # the W8A8 half tile (64 rows: every tile at small batches)
    Variant(256, 128, True, ping_pong=False, half=True, widen=True),  # the shipped W4A8 half tile
    Variant(256, 128, True, ping_pong=False, swap_rs_n=16),  # A and B swapped: the RS WGMMAs alone
    Variant(256, 128, True, ping_pong=False, swap_rs_n=64),
    Variant(256, 128, True, ping_pong=False, swap_rs_n=16, widen=True),  # ... widened into the A fragments
    Variant(256, 128, True, ping_pong=False, swap_rs_n=32, widen=True),  # 1024-2048 tokens: 24-48 rows per expert
    Variant(256, 128, True, ping_pong=False, swap_rs_n=64, widen=True),
)
PACKED_WORDS = 256 * BLOCK_K // 8  # a packed E2M1 stage: 256 rows x 64 bytes
BULK_WAIT_TRIES = 1 << 20
TURN_BARRIER = 4  # named barriers 4 and 5: the warpgroups' turns (1: the start, 2-3: a warpgroup's own)


def swapped_fragment_row(lt):
    """Row r0 of an m64 tile whose weights thread ``lt`` (0-127) of a warpgroup holds in its RS A fragment; it
    holds r0 and r0 + 8 (tests/test_wgmma_rate.py checks both helpers against CuTe's fragment layout)."""
    return 16 * (lt // 32) + (lt % 32) // 4


def swapped_fragment_word(g: int, h: int, upper: int) -> int:
    """The RS A fragment's 32-bit word (of 16 per 128-K block) holding row r0 + 8 ``h``'s E4M3 weights at K
    32 g + 16 ``upper`` + 4 q .. + 3 (q = lane % 4)."""
    return 4 * g + 2 * upper + h


class WgmmaRateSm90:
    def __init__(self, variant: Variant):
        self.v = variant
        self.fp4 = None
        if variant.widen and (variant.half or variant.swap_rs_n):  # the W4A8 kernel's widening and tables
            shape = get_shape("deepseek-v4-flash")
            self.fp4 = MegaMoESm90W4A8(shape.hidden, shape.intermediate,
                                       MegaMoEConfig(precision="w4a8").resolve(shape, 1, 512, 132))

    @cute.jit
    def __call__(self, mCycles: cute.Tensor, mSink: cute.Tensor, mSource: cute.Tensor, mError: cute.Tensor, stream):
        v = self.v
        self.sA_layout = sm90_utils.make_smem_layout(Float8E4M3FN, LayoutEnum.ROW_MAJOR, (BLOCK_M, BLOCK_K),
                                                     stage=v.stages)
        self.sB_layout = sm90_utils.make_smem_layout(Float8E4M3FN, LayoutEnum.ROW_MAJOR, (v.tile_n, BLOCK_K),
                                                     stage=v.stages)
        self.mma_tile = sm90_utils.make_tiled_mma(Float8E4M3FN, "K", "K", v.tile_n, atom_layout_mnk=(2, 1, 1))
        self.mma_slice = sm90_utils.make_tiled_mma(Float8E4M3FN, "K", "K", v.slice_n, atom_layout_mnk=(2, 1, 1))

        @cute.struct
        class SharedStorage:
            sA: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(self.sA_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(self.sB_layout)], 1024]
            refill: cute.struct.Align[cute.struct.MemRange[cutlass.Int8, 2 * v.stage_bytes if v.refill else 16], 128]
            refill_mbar: cute.struct.Align[cute.struct.MemRange[Int64, 2], 8]
            packed: cute.struct.Align[cute.struct.MemRange[Int32, PACKED_WORDS if v.widen else 4], 16]
            shifts: cute.struct.Align[cute.struct.MemRange[Int32, 256 if v.widen else 4], 16]
            tables: cute.struct.Align[cute.struct.MemRange[Int64, TABLES], 8]  # half / swapped: looked up
            xscale: cute.struct.Align[cute.struct.MemRange[Float32, v.stages * BLOCK_M], 16]  # swapped: per token

        self.shared_storage = SharedStorage
        self.kernel(mCycles, mSink, mSource, mError, self.mma_tile, self.mma_slice, self.sA_layout,
                    self.sB_layout).launch(grid=[mCycles.shape[0], 1, 1], block=[THREADS, 1, 1],
                                           smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, mCycles: cute.Tensor, mSink: cute.Tensor, mSource: cute.Tensor, mError: cute.Tensor,
               mma_tile: cute.TiledMma, mma_slice: cute.TiledMma, sA_layout: cute.ComposedLayout,
               sB_layout: cute.ComposedLayout):
        v = self.v
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        # zeros (an FP8 NaN pattern would not change the rate, but keep the sums finite)
        words = storage.sA.get_tensor(cute.make_layout(cute.cosize(sA_layout)))
        i = Int32(tidx)
        while i < cute.cosize(sA_layout):
            words[i] = Float8E4M3FN(0.0)
            i = i + THREADS
        words_b = storage.sB.get_tensor(cute.make_layout(cute.cosize(sB_layout)))
        i = Int32(tidx)
        while i < cute.cosize(sB_layout):
            words_b[i] = Float8E4M3FN(0.0)
            i = i + THREADS
        if const_expr(v.widen):  # codes 0 and shift 0 (the rate does not depend on the values)
            packed = storage.packed.get_tensor(cute.make_layout(PACKED_WORDS))
            i = Int32(tidx)
            while i < PACKED_WORDS:
                packed[i] = Int32(0)
                i = i + THREADS
            storage.shifts.get_tensor(cute.make_layout(256))[tidx] = Int32(0)
            if const_expr(v.half or v.swap_rs_n > 0):  # the kernel's group tables, looked up
                self.fp4.precision_prologue(self.fp4_views(storage, sB), Int32(tidx))
        xscale = storage.xscale.get_tensor(cute.make_layout(v.stages * BLOCK_M))
        i = Int32(tidx)
        while i < v.stages * BLOCK_M:
            xscale[i] = Float32(1.0)
            i = i + THREADS
        if const_expr(v.refill):
            if tidx == 0:
                for b in cutlass.range_constexpr(2):
                    cute.arch.mbarrier_init(storage.refill_mbar.data_ptr() + b, 1)
                cute.arch.mbarrier_init_fence()
        cute.arch.fence_view_async_shared()
        cute.arch.sync_threads()
        if const_expr(v.swap_rs_n > 0):
            self.consume_swapped(tidx, bidx, mCycles, mSink, sA, storage)
        elif const_expr(v.half):
            self.consume_half(tidx, bidx, mCycles, mSink, sA, sB, storage)
        else:
            self.consume(tidx, bidx, mCycles, mSink, mma_tile, mma_slice, sA, sB, storage, mSource, mError)

    @cute.jit
    def refill_step(self, storage, src: Int64, kb, mError: cute.Tensor):
        """Block ``kb``'s copy into buffer kb % 2, after the copy two back into it has landed."""
        v = self.v
        mbar = storage.refill_mbar.data_ptr() + kb % 2
        if kb >= 2:
            xdev.mbarrier_wait_tries(mbar, ((kb - 2) // 2) % 2, BULK_WAIT_TRIES, mError.iterator)
        cute.arch.mbarrier_arrive_and_expect_tx(mbar, v.stage_bytes)
        xdev.bulk_copy_g2s(storage.refill.data_ptr() + (kb % 2) * v.stage_bytes, src, v.stage_bytes, mbar)

    @cute.jit
    def widen_stage(self, tidx, storage, sB, s):
        """The packed stage into B stage ``s``: thread t widens groups t + 256 i (row g // 4, K
        32 (g % 4) ...) with its row's shift byte, two 16-byte stores each; then the generic-proxy
        writes are fenced for the WGMMAs and both warpgroups sync. (B stage s was last read 2 or
        more k-blocks ago, behind the sync of the k-block between.)"""
        packed = storage.packed.get_tensor(cute.make_layout((256, BLOCK_K // 8), stride=(BLOCK_K // 8, 1)))
        shifts = storage.shifts.get_tensor(cute.make_layout(256))
        out = cute.make_rmem_tensor((1, 32), Float8E4M3FN)
        words = cute.recast_tensor(out, Int32)
        for i in cutlass.range_constexpr(4):
            g = Int32(tidx) + 256 * i
            row, c = g // 4, g % 4
            codes = cute.make_rmem_tensor((1, 4), Int32)
            codes.store(cute.local_tile(packed, (1, 4), (row, c)).load())
            d = (shifts[row] << (24 - 8 * c)) >> 24  # the row's shift byte c, sign-extended
            table = group_table(shift_factor(d))
            for w in cutlass.range_constexpr(4):
                lo, hi = widen_e2m1x8(codes[0, w], table)
                words[0, 2 * w] = lo
                words[0, 2 * w + 1] = hi
            cute.local_tile(sB[None, None, s], (1, 32), (row, c)).store(out.load())
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=1, number_of_threads=THREADS)

    @cute.jit
    def widen_own_row(self, tidx, storage, sB, s):
        """The shipped half tile's widening, the kernel's own code (:meth:`MegaMoESm90W4A8.widen_stage`): thread t
        widens B row t of the packed stage into B stage ``s``, then the fence and its warpgroup's barrier (a half
        tile's warpgroup reads only its own threads' rows)."""
        self.fp4.widen_stage(self.fp4_views(storage, sB), Int32(tidx), Int32(0), s)
        self.warpgroup_sync(tidx)

    def fp4_views(self, storage, sB):
        """The shared memory the W4A8 kernel's widening reads and writes: the packed stage, the B stages as its
        widened blocks, the shift words (one stage) and the group tables."""
        return SimpleNamespace(sB=storage.packed.get_tensor(cute.make_layout(PACKED_WORDS)), sW=sB,
                               shifts=storage.shifts.get_tensor(cute.make_layout((1, 256, 1), stride=(256, 1, 256))),
                               tables=storage.tables.get_tensor(cute.make_layout(TABLES)))

    @cute.jit
    def warpgroup_sync(self, tidx):
        cute.arch.fence_view_async_shared()
        wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) // 4
        cute.arch.barrier(barrier_id=2 + wg, number_of_threads=THREADS // 2)

    @cute.jit
    def consume_half(self, tidx, bidx, mCycles: cute.Tensor, mSink: cute.Tensor, sA, sB, storage):
        """The shipped half tile (sm90_fp8_mainloop.half_k_pairs): warpgroup w computes columns 128 w .. + 127
        of the stage's first 64 rows, one m64n128k32 batch per k-block, the k-blocks in pairs through two
        fragments (the second's batch issued before the first's promotion); ``widen`` widens each block's B
        rows first, the second block's under the first's batch."""
        v = self.v
        mma = sm90_utils.make_tiled_mma(Float8E4M3FN, "K", "K", v.slice_n, atom_layout_mnk=(1, 2, 1))
        thr = mma.get_slice(tidx)
        sA_h = cute.local_tile(sA, (64, BLOCK_K, v.stages), (0, 0, 0))
        part0, tCrA, tCrB = sm90_utils.partition_fragment_ABC(thr, (64, v.tile_n, BLOCK_K), sA_h, sB)
        part1 = cute.make_rmem_tensor(part0.layout, Float32)
        acc = cute.make_rmem_tensor(part0.layout, Float32)
        acc.fill(0.0)
        c = Float32(1.0) + Float32(tidx) * Float32(1e-30)
        cute.arch.barrier(barrier_id=1, number_of_threads=THREADS)
        t0 = xdev.clock64()
        for kp in cutlass.range(v.k_blocks // 2, unroll=1):
            s0 = (2 * kp) % v.stages
            s1 = (2 * kp + 1) % v.stages
            if const_expr(v.widen):
                self.warpgroup_sync(tidx)  # the kernel's b_free
                self.widen_own_row(tidx, storage, sB, s0)
            sm90_utils.gemm_w_idx(mma, part0, tCrA, tCrB, True, A_idx=s0, B_idx=s0, wg_wait=-1)
            if const_expr(v.widen):
                self.widen_own_row(tidx, storage, sB, s1)
            sm90_utils.gemm_w_idx(mma, part1, tCrA, tCrB, True, A_idx=s1, B_idx=s1, wg_wait=-1)
            warpgroup.wait_group(1)
            for e in cutlass.range_constexpr(cute.size(acc)):
                acc[e] = acc[e] + part0[e] * c
            warpgroup.wait_group(0)
            for e in cutlass.range_constexpr(cute.size(acc)):
                acc[e] = acc[e] + part1[e] * c
        self.finish(tidx, bidx, mCycles, mSink, acc, t0)

    @cute.jit
    def widen_fragment(self, storage, frag, wg, lt, t):
        """Weight m-tile ``t`` of warpgroup ``wg`` into this thread's RS A fragment (16 words: rows r0 and
        r0 + 8, K 4q..4q+3 and 16+4q.. of each 32-group, the PTX fragment's a0-a15 per k32: checked against
        CuTe's layout in tests/test_wgmma_rate.py), from the ring's packed stage as the TMA leaves it (64-byte
        swizzle): word q of each 32-group of its two rows, one 4-byte load each (the codes are zeros here; the fused
        kernel's host orders a group's codes so that word q holds those K, quant_fp4.kernel_codes in ff668d5)."""
        packed = storage.packed.get_tensor(cute.make_layout(PACKED_WORDS))
        q = lt % 4
        r0 = 128 * wg + 64 * t + swapped_fragment_row(lt)
        shifts = storage.shifts.get_tensor(cute.make_layout(256))
        tables = storage.tables.get_tensor(cute.make_layout(TABLES))
        words = cute.recast_tensor(frag, Int32)
        for h in cutlass.range_constexpr(2):  # row r0 + 8 h
            row = r0 + 8 * h
            word_sh = shifts[row]
            swz = (row >> 1) & 3
            for g in cutlass.range_constexpr(4):
                codes = packed[row * (BLOCK_K // 8) + 4 * (g ^ swz) + q]  # 64-byte rows, 16-byte chunks
                tb = tables[((word_sh << (24 - 8 * g)) >> 24) - MIN_SHIFT]
                lo, hi = widen_e2m1x8(codes, (Int32(tb), Int32(tb >> 32)))
                words[swapped_fragment_word(g, h, 0)] = lo
                words[swapped_fragment_word(g, h, 1)] = hi

    @cute.jit
    def consume_swapped(self, tidx, bidx, mCycles: cute.Tensor, mSink: cute.Tensor, sA, storage):
        """A W4A8 half tile with A and B swapped: warpgroup w computes weight rows 128 w .. + 127 as two m64
        tiles against the stage's first ``swap_rs_n`` rows (tokens), RS: each m-tile's A fragment widened in
        registers (:meth:`widen_fragment`), m-tile 1's widened under m-tile 0's batch; each batch promoted with
        a scale per (weight row, token): the tokens' scales of the block from shared memory."""
        v = self.v
        n = v.swap_rs_n
        wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) // 4
        lt = Int32(tidx) % (THREADS // 2)
        mma = sm90_utils.make_tiled_mma(Float8E4M3FN, "K", "K", n, source="RS")
        thr = mma.get_slice(lt)
        sX = cute.local_tile(sA, (n, BLOCK_K, v.stages), (0, 0, 0))
        tCrB = thr.make_fragment_B(thr.partition_B(sX))
        frags = [thr.make_fragment_A(thr.partition_shape_A((64, BLOCK_K))) for _ in range(2)]
        parts = [cute.make_rmem_tensor(thr.partition_shape_C((64, n)), Float32) for _ in range(2)]
        sums = [cute.make_rmem_tensor(thr.partition_shape_C((64, n)), Float32) for _ in range(2)]
        for t in cutlass.range_constexpr(2):
            sums[t].fill(0.0)
            if const_expr(not v.widen):
                cute.recast_tensor(frags[t], Int32).fill(0)
        q = lt % 4
        c = Float32(1.0) + Float32(tidx) * Float32(1e-30)
        sb = ((c, c * Float32(2.0)), (c * Float32(3.0), c * Float32(4.0)))  # per m-tile: rows r0, r0 + 8
        xscale = storage.xscale.get_tensor(cute.make_layout((BLOCK_M, v.stages), stride=(1, BLOCK_M)))
        cute.arch.barrier(barrier_id=1, number_of_threads=THREADS)
        t0 = xdev.clock64()
        for kb in cutlass.range(v.k_blocks, unroll=1):
            s = kb % v.stages
            if const_expr(v.widen):
                self.widen_fragment(storage, frags[0], wg, lt, 0)
            sm90_utils.gemm_w_idx(mma, parts[0], frags[0], tCrB, True, B_idx=s, wg_wait=-1)
            xs = [xscale[8 * j + 2 * q + v0, s] for j in range(n // 8) for v0 in range(2)]
            if const_expr(v.widen):
                self.widen_fragment(storage, frags[1], wg, lt, 1)
            sm90_utils.gemm_w_idx(mma, parts[1], frags[1], tCrB, True, B_idx=s, wg_wait=-1)
            for t in cutlass.range_constexpr(2):
                warpgroup.wait_group(1 - t)
                for e in cutlass.range_constexpr(cute.size(parts[t])):  # e = 4 j + 2 v1 + v0
                    sums[t][e] = sums[t][e] + parts[t][e] * (xs[2 * (e // 4) + e % 2] * sb[t][(e // 2) % 2])
        total = Float32(0.0)
        for e in cutlass.range_constexpr(cute.size(sums[0])):
            total = total + sums[0][e] + sums[1][e]
        self.finish(tidx, bidx, mCycles, mSink, None, t0, total)

    @cute.jit
    def finish(self, tidx, bidx, mCycles: cute.Tensor, mSink: cute.Tensor, acc, t0, total=None):
        """The loop's end: its cycles (thread 0) and the sums into the sink (they keep the WGMMAs live)."""
        t1 = xdev.clock64()
        if const_expr(acc is not None):
            total = Float32(0.0)
            for e in cutlass.range_constexpr(cute.size(acc)):
                total = total + acc[e]
        mSink[bidx, tidx] = total
        if tidx == 0:
            mCycles[bidx] = t1 - t0

    @cute.jit
    def consume(self, tidx, bidx, mCycles: cute.Tensor, mSink: cute.Tensor, mma_tile: cute.TiledMma,
                mma_slice: cute.TiledMma, sA, sB, storage, mSource: cute.Tensor, mError: cute.Tensor):
        """The two consumer warpgroups' loop over the smem-resident stages, timed."""
        v = self.v
        thr_t = mma_tile.get_slice(tidx)
        acc = cute.make_rmem_tensor(thr_t.partition_shape_C((BLOCK_M, v.tile_n)), Float32)
        acc.fill(0.0)
        thr_s = mma_slice.get_slice(tidx)
        n_slices = v.tile_n // v.slice_n
        sBs = [cute.local_tile(sB, (v.slice_n, BLOCK_K, v.stages), (j, 0, 0)) for j in range(n_slices)]
        part0, tCrA, tCrB0 = sm90_utils.partition_fragment_ABC(thr_s, (BLOCK_M, v.slice_n, BLOCK_K), sA, sBs[0])
        tCrB = (tCrB0,) + tuple(thr_s.make_fragment_B(thr_s.partition_B(b)) for b in sBs[1:])
        part1 = cute.make_rmem_tensor(part0.layout, Float32)
        parts = (part0, part1)
        c = Float32(1.0) + Float32(tidx) * Float32(1e-30)  # a scale the compiler cannot fold

        cute.arch.barrier(barrier_id=1, number_of_threads=THREADS)  # the consumers start together
        t0 = xdev.clock64()
        src = Int64(mSource.iterator.toint())
        wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) // 4
        if const_expr(v.order == "turns"):
            if wg == 1:  # warpgroup 0 has the first turn
                cute.arch.barrier_arrive(barrier_id=TURN_BARRIER, number_of_threads=THREADS)
        if const_expr(v.order == "stagger"):
            if wg == 1:
                cute.arch.barrier(barrier_id=TURN_BARRIER, number_of_threads=THREADS)
        for kb in cutlass.range(v.k_blocks, unroll=1):
            s = kb % v.stages
            if const_expr(v.refill):
                if tidx == 0:
                    self.refill_step(storage, src, kb, mError)
            if const_expr(v.widen):
                self.widen_stage(tidx, storage, sB, s)
            if const_expr(not v.promote):
                sm90_utils.gemm_w_idx(mma_tile, acc, tCrA, tCrB[0], False, A_idx=s, B_idx=s, wg_wait=0)
            elif const_expr(not v.ping_pong):
                for j in cutlass.range_constexpr(n_slices):
                    if const_expr(v.order == "turns"):
                        cute.arch.barrier(barrier_id=TURN_BARRIER + wg, number_of_threads=THREADS)
                    sm90_utils.gemm_w_idx(mma_slice, parts[0], tCrA, tCrB[j], True, A_idx=s, B_idx=s, wg_wait=0)
                    if const_expr(v.order == "turns"):
                        cute.arch.barrier_arrive(barrier_id=TURN_BARRIER + 1 - wg, number_of_threads=THREADS)
                    if const_expr(v.order == "stagger" and j == 0):
                        if kb == 0 and wg == 0:  # warpgroup 1 starts once warpgroup 0's first batch is done
                            cute.arch.barrier_arrive(barrier_id=TURN_BARRIER, number_of_threads=THREADS)
                    for e in cutlass.range_constexpr(cute.size(parts[0])):
                        acc[j * cute.size(parts[0]) + e] = acc[j * cute.size(parts[0]) + e] + parts[0][e] * c
            else:
                sm90_utils.gemm_w_idx(mma_slice, parts[0], tCrA, tCrB[0], True, A_idx=s, B_idx=s, wg_wait=-1)
                for j in cutlass.range_constexpr(1, n_slices + 1):
                    if const_expr(j < n_slices):
                        sm90_utils.gemm_w_idx(mma_slice, parts[j % 2], tCrA, tCrB[j], True, A_idx=s, B_idx=s,
                                              wg_wait=1)
                    else:
                        warpgroup.wait_group(0)
                    p = parts[(j - 1) % 2]
                    for e in cutlass.range_constexpr(cute.size(p)):
                        acc[(j - 1) * cute.size(p) + e] = acc[(j - 1) * cute.size(p) + e] + p[e] * c
        t1 = xdev.clock64()
        if const_expr(v.order == "turns"):
            if wg == 0:  # warpgroup 1's last turn handed back: no arrive left pending at exit
                cute.arch.barrier(barrier_id=TURN_BARRIER, number_of_threads=THREADS)
        if const_expr(v.refill):
            if tidx == 0:  # the last two copies land before the CTA exits
                for j in cutlass.range_constexpr(2):
                    last = v.k_blocks - 2 + j
                    xdev.mbarrier_wait_tries(storage.refill_mbar.data_ptr() + last % 2, (last // 2) % 2,
                                             BULK_WAIT_TRIES, mError.iterator)
        total = Float32(0.0)
        for e in cutlass.range_constexpr(cute.size(acc)):
            total = total + acc[e]
        mSink[bidx, tidx] = total  # keeps the sums (and so the WGMMAs) live
        if tidx == 0:
            mCycles[bidx] = t1 - t0


def sass_usage(v: Variant) -> dict | None:
    """Registers per thread, local-memory instructions, HGMMA/QGMMA and their waits in ``v``'s SASS
    (None without cuobjdump): spills rule a batch shape out before any GPU run."""
    import re

    from xstage.cute_compile import compile_hopper, compiled_sass

    out = compiled_sass(lambda options: compile_hopper(WgmmaRateSm90(v), *_fake_args(), options=options))
    if out is None:
        return None
    sass, usage = out
    return {"registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "local_memory_instructions": len(re.findall(r"\b(LDL|STL)\b", sass)),
            "wgmma": len(re.findall(r"\bQGMMA\.", sass)), "wgmma_waits": len(re.findall(r"WARPGROUP\.DEPBAR", sass))}


SOURCE_BYTES = (BLOCK_M + 256) * BLOCK_K  # the largest stage: the refills' L2-resident source


def _fake_args():
    from xstage.cute_compile import fake_stream, fake_tensor

    return (fake_tensor(Int64, (cute.sym_int(),), stride=(1,), assumed_align=8),
            fake_tensor(Float32, (cute.sym_int(), THREADS), stride=(THREADS, 1), assumed_align=4),
            fake_tensor(cutlass.Int8, (SOURCE_BYTES,), stride=(1,), assumed_align=16),
            fake_tensor(Int32, (1,), stride=(1,), assumed_align=4), fake_stream())


def compile_variant(v: Variant):
    """The compiled kernel of ``v`` (no GPU needed; cached per variant)."""
    from xstage.cute_compile import cached, compile_hopper

    return cached(("WgmmaRateSm90", v), lambda: compile_hopper(WgmmaRateSm90(v), *_fake_args()).fn)


def measure(v: Variant, num_ctas: int, repeats: int = 5) -> dict:
    """MACs per SM cycle of ``v`` on ``num_ctas`` CTAs (one per SM): the median over CTAs of the
    best of ``repeats`` launches."""
    import torch

    fn = compile_variant(v)
    cycles = torch.zeros(num_ctas, dtype=torch.int64, device="cuda")
    sink = torch.zeros(num_ctas, THREADS, dtype=torch.float32, device="cuda")
    source = torch.zeros(SOURCE_BYTES, dtype=torch.int8, device="cuda")
    error = torch.zeros(1, dtype=torch.int32, device="cuda")
    best = None
    for _ in range(repeats + 1):  # the first launch warms up
        fn(cycles, sink, source, error)
        torch.cuda.synchronize()
        if int(error.item()):
            raise RuntimeError(f"{v.name}: a refill copy did not land (error word {int(error.item()):#x})")
        med = statistics.median(cycles.tolist())
        best = med if best is None else min(best, med)
    if not torch.isfinite(sink).all():
        raise RuntimeError(f"{v.name}: non-finite sums")
    macs = v.rows * v.tile_n * BLOCK_K * v.k_blocks
    rate = macs / best
    return dict(asdict(v), name=v.name, cycles=best, cycles_per_k_block=best / v.k_blocks, macs_per_clk=rate,
                of_peak=rate / FP8_MACS_PER_CLK)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/h200/megamoe/wgmma_rate")
    ap.add_argument("--compile-only", action="store_true", help="compile every variant (no GPU) and exit")
    ap.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                    help="only the variants whose name contains one of these (default: all)")
    args = ap.parse_args(argv)
    variants = [v for v in VARIANTS if args.only is None or any(t in v.name for t in args.only)]
    if not variants:
        raise SystemExit(f"no variant's name contains any of {args.only}")
    if args.compile_only:
        print(f"{'variant':64s} {'registers':>9s} {'LDL/STL':>8s} {'WGMMAs':>7s} {'waits':>6s}")
        for v in variants:
            compile_variant(v)
            u = sass_usage(v)
            print(f"{v.name:64s} " + ("(no cuobjdump)" if u is None else
                  f"{u['registers']:9d} {u['local_memory_instructions']:8d} {u['wgmma']:7d} {u['wgmma_waits']:6d}"))
        return
    import torch

    from xstage import provenance

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit("wgmma_rate needs a Hopper GPU (sm_90); --compile-only does not")
    num_ctas = torch.cuda.get_device_properties(0).multi_processor_count
    rows = [measure(v, num_ctas) for v in variants]
    print(f"{'variant':64s} {'cycles':>10s} {'per k-block':>11s} {'MAC/clk/SM':>11s} {'of 4096':>8s}")
    for r in rows:
        print(f"{r['name']:64s} {r['cycles']:10.0f} {r['cycles_per_k_block']:11.0f} {r['macs_per_clk']:11.0f} "
              f"{r['of_peak']:8.1%}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "wgmma_rate.json"), "w") as f:
        json.dump({"rows": rows, "num_ctas": num_ctas, "provenance": provenance.collect()}, f, indent=1)
