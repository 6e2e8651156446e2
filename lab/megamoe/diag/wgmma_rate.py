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

A variant's rate is MACs per SM cycle: ``128 x tile_n x 128 x k_blocks`` over the CTA's
``%clock64`` span of the loop (the median over CTAs), against 4096 (sm_90's dense FP8 rate). Its
operands are zeros, so the rate is the instruction and operand stream's, not the data's.

    python scripts/diag/wgmma_rate.py                 # every variant: a table and wgmma_rate.json
    python scripts/diag/wgmma_rate.py --compile-only  # no GPU: compile every variant (CI does)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import asdict, dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float8E4M3FN, Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.utils import LayoutEnum
from quack import sm90_utils

from megamoe_interleave.fp4_widen import group_table, shift_factor, widen_e2m1x8
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

    def __post_init__(self):
        if self.tile_n % self.slice_n or self.slice_n not in (64, 128, 192, 256) or self.tile_n > 256:
            raise ValueError(f"tile_n {self.tile_n} must be a multiple of slice_n {self.slice_n} in 64..256")
        if not self.promote and self.slice_n != self.tile_n:
            raise ValueError("without promote the batch is the whole tile (slice_n == tile_n)")
        if self.widen and (self.tile_n != 256 or self.refill):
            raise ValueError("widen is the W4A8 tile's: tile_n 256, no refill")

    @property
    def name(self) -> str:
        how = f"{self.tile_n // self.slice_n} x n{self.slice_n}" + (
            "" if not self.promote else " + promote" + ("" if self.ping_pong else ", 1 fragment")) + (
            " + refill" if self.refill else "") + (" + widen E2M1" if self.widen else "")
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
    Variant(128, 64, True),
    Variant(128, 128, True),  # DeepGEMM-like width per promotion (its tile is 128 x 192 / 2 WGs)
    Variant(256, 256, False, refill=True, stages=2),  # the same with the refills' shared-memory writes
    Variant(256, 64, True, refill=True, stages=2),
    Variant(256, 128, True, ping_pong=False, refill=True, stages=2),
    Variant(256, 256, False, widen=True),  # W4A8: the widening before the plain tile
    Variant(256, 128, True, ping_pong=False, widen=True),  # ... before the shipped W8A8 batches
)
PACKED_WORDS = 256 * BLOCK_K // 8  # a packed E2M1 stage: 256 rows x 64 bytes
BULK_WAIT_TRIES = 1 << 20


class WgmmaRateSm90:
    def __init__(self, variant: Variant):
        self.v = variant

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
        if const_expr(v.refill):
            if tidx == 0:
                for b in cutlass.range_constexpr(2):
                    cute.arch.mbarrier_init(storage.refill_mbar.data_ptr() + b, 1)
                cute.arch.mbarrier_init_fence()
        cute.arch.fence_view_async_shared()
        cute.arch.sync_threads()
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
                    sm90_utils.gemm_w_idx(mma_slice, parts[0], tCrA, tCrB[j], True, A_idx=s, B_idx=s, wg_wait=0)
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
    macs = BLOCK_M * v.tile_n * BLOCK_K * v.k_blocks
    rate = macs / best
    return dict(asdict(v), name=v.name, cycles=best, macs_per_clk=rate, of_peak=rate / FP8_MACS_PER_CLK)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/h200/megamoe/wgmma_rate")
    ap.add_argument("--compile-only", action="store_true", help="compile every variant (no GPU) and exit")
    args = ap.parse_args(argv)
    if args.compile_only:
        print(f"{'variant':52s} {'registers':>9s} {'LDL/STL':>8s} {'WGMMAs':>7s} {'waits':>6s}")
        for v in VARIANTS:
            compile_variant(v)
            u = sass_usage(v)
            print(f"{v.name:52s} " + ("(no cuobjdump)" if u is None else
                  f"{u['registers']:9d} {u['local_memory_instructions']:8d} {u['wgmma']:7d} {u['wgmma_waits']:6d}"))
        return
    import torch

    from xstage import provenance

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit("wgmma_rate needs a Hopper GPU (sm_90); --compile-only does not")
    num_ctas = torch.cuda.get_device_properties(0).multi_processor_count
    rows = [measure(v, num_ctas) for v in VARIANTS]
    print(f"{'variant':52s} {'cycles':>10s} {'MAC/clk/SM':>11s} {'of 4096':>8s}")
    for r in rows:
        print(f"{r['name']:52s} {r['cycles']:10.0f} {r['macs_per_clk']:11.0f} {r['of_peak']:8.1%}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "wgmma_rate.json"), "w") as f:
        json.dump({"rows": rows, "num_ctas": num_ctas, "provenance": provenance.collect()}, f, indent=1)
