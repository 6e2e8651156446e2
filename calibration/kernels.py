"""Remote-store burst microbenchmark kernel (paper Section 3.1), CuTe DSL.

One kernel class, :class:`BurstKernel`, with compile-time switches:

* ``gap_mode``: what a producer does between bursts (no stores in it):
  ``"spin"`` (poll ``%globaltimer`` until ``gap_ns`` has passed since the
  burst's issue end), ``"mma"`` (``mma_iters`` iterations of warp-level
  ``mma.sync.m16n8k16`` BF16->FP32 Tensor Core work on register operands,
  two independent accumulators per warp; the length is calibrated on the host
  against the measured gap), or ``"none"``.
* ``cache``: store cache hint (``None``, ``"cs"``, ``"no_allocate"``).
* ``align_bursts``: start every burst on all producers together (a relaxed
  grid counter barrier before the burst).  Independent producers otherwise
  drift apart and a "burst" stops being one event; with alignment a burst's
  issue time is well defined as its slowest producer's issue interval.

Producers are CTAs (``K`` = grid size, every CTA co-resident: K <= #SMs).
Burst ``n`` of producer ``k`` writes ``B`` bytes as 16-byte
``st.global.v4.b32`` stores, coalesced across the CTA's threads, to
``dst_table[dst] + slot_n + k*B + i*(threads*16) + t*16`` where
``slot_n = (n * K * B) mod region_bytes``: consecutive bursts rotate through a
destination region (host picks it several times the 60 MB L2, a multiple of
V = K*B), so the path, not the cache, is measured.  Each 16-byte chunk holds
``(chunk index, burst, producer, MAGIC)`` so a test can check every byte.

The local-memory control is this same kernel with a table that points at a
device buffer: same producers, store width, address generation and loop.

Per producer and per burst, thread 0 records in ``timestamps`` (int64,
flattened ``[K, N, 4]``): ``globaltimer`` at issue start and at issue end
(after a CTA barrier: all threads' stores accepted), and ``clock64`` at the
same two points (precise per-SM durations; the host converts cycles to ns
with the per-CTA clock rate fitted over the whole launch).

``sync`` (int32 ``[2]``, zeroed by the host before each launch): word 0 is the
grid barrier counter, word 1 the error word (see ``xstage.device``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import cutlass
import cutlass.memory
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import warp
from quack.cute_dsl_utils import mlir_namedtuple

from xstage import device as xd

__all__ = ["BurstKernel", "BurstConfig", "BurstTensors", "MAGIC", "TS_FIELDS", "GAP_MODES", "MAX_BURSTS", "validate_launch"]

MAGIC = 0x5A17C0DE  # < 2**31: fits an int32 word; marks chunks written by this kernel
TS_FIELDS = ("gt_start", "gt_end", "clk_start", "clk_end")
MAX_BURSTS = 1024  # per-launch burst records kept in shared memory (32 KiB per CTA)
GAP_MODES = ("spin", "mma", "none")
STORE_BYTES = 16


@dataclass(frozen=True)
class BurstConfig:
    """Compile-time switches of :class:`BurstKernel`."""

    threads: int = 128
    gap_mode: str = "spin"
    cache: Optional[str] = None
    align_bursts: bool = True

    def __post_init__(self):
        if self.threads % 32 != 0 or not 32 <= self.threads <= 1024:
            raise ValueError(f"threads must be a multiple of 32 in [32, 1024], got {self.threads}")
        if self.gap_mode not in GAP_MODES:
            raise ValueError(f"gap_mode must be one of {GAP_MODES}, got {self.gap_mode!r}")
        if self.cache not in xd.STORE_CACHE_HINTS:
            raise ValueError(f"cache must be one of {xd.STORE_CACHE_HINTS}, got {self.cache!r}")

    @property
    def chunk_bytes(self) -> int:
        """Bytes one CTA writes per store instruction step (B must be a multiple)."""
        return self.threads * STORE_BYTES


def validate_launch(
    cfg: BurstConfig,
    *,
    num_producers: int,
    bytes_per_producer: int,
    num_bursts: int,
    region_bytes: int,
    dst_buffer_bytes: int,
    gap_ns: int = 0,
    mma_iters: int = 0,
    num_sms: Optional[int] = None,
) -> None:
    """Check a launch's parameters on the host (raises ValueError before any launch)."""
    K, B, N = num_producers, bytes_per_producer, num_bursts
    if K < 1:
        raise ValueError(f"num_producers must be >= 1, got {K}")
    if num_sms is not None and K > num_sms:
        raise ValueError(
            f"num_producers={K} > {num_sms} SMs: producers must be co-resident for the per-burst grid barrier"
        )
    if B < cfg.chunk_bytes or B % cfg.chunk_bytes != 0:
        raise ValueError(
            f"bytes_per_producer={B} must be a positive multiple of threads*16={cfg.chunk_bytes}"
        )
    if not 1 <= N <= MAX_BURSTS:
        raise ValueError(f"num_bursts must be in [1, {MAX_BURSTS}], got {N}")
    V = K * B
    if region_bytes < V or region_bytes % V != 0:
        raise ValueError(f"region_bytes={region_bytes} must be a positive multiple of the burst volume V={V}")
    if region_bytes > dst_buffer_bytes:
        raise ValueError(f"region_bytes={region_bytes} exceeds the destination buffer ({dst_buffer_bytes} bytes)")
    if region_bytes // STORE_BYTES >= 2**32:
        raise ValueError("region too large: chunk indices are stored as 32-bit words")
    if gap_ns < 0 or gap_ns > 10**9:
        raise ValueError(f"gap_ns must be in [0, 1e9], got {gap_ns}")
    if mma_iters < 0 or mma_iters >= 2**31:
        raise ValueError(f"mma_iters must be a non-negative int32, got {mma_iters}")
    if cfg.gap_mode == "spin" and mma_iters:
        raise ValueError("mma_iters given to a spin-gap kernel")
    if cfg.gap_mode == "mma" and gap_ns:
        raise ValueError("gap_ns given to an MMA-gap kernel (give mma_iters)")


@mlir_namedtuple
class BurstTensors(NamedTuple):
    """The kernel's tensors, one typed argument (quack's ``mlir_namedtuple``; its scalars stay plain
    parameters, as the fused MoE kernel's do)."""

    dst_table: Any  # [P] int64: every rank's destination base
    timestamps: Any  # [K * N * 4] int64: flattened [K, N, 4] of TS_FIELDS
    sync: Any  # [2] int32: grid barrier counter, error word
    sink: Any  # [K * threads] f32: keeps the MMA gap's results live


class BurstKernel:
    """Periodic/isolated remote-store bursts from K producer CTAs.

    Usage (host)::

        kern = BurstKernel(BurstConfig(gap_mode="spin"))
        kern(dst_table, dst, timestamps, sync, sink, num_producers=K,
             bytes_per_producer=B, num_bursts=N, region_bytes=region, gap_ns=G)

    Isolated bursts are periodic bursts with a gap long enough for full
    recovery (the host chooses it from the fitted drain rate).
    """


    def __init__(self, config: BurstConfig = BurstConfig()):
        self.cfg = config

    # ------------------------------------------------------------------ device

    @cute.jit
    def _gap_spin(self, t_end: Int64, gap_ns: Int64, tidx: Int32):
        """Producer-side gap: thread 0 polls %globaltimer, the CTA waits at a barrier."""
        if tidx == 0:
            deadline = t_end + gap_ns
            now = xd.globaltimer_ns()
            while now < deadline:
                now = xd.globaltimer_ns()
        cute.arch.sync_threads()

    @cute.kernel
    def kernel(
        self,
        tensors: BurstTensors,
        dst: Int32,
        bytes_per_producer: Int32,
        num_bursts: Int32,
        region_bytes: Int64,
        gap_ns: Int64,
        mma_iters: Int32,
        timeout_ns: Int64,
    ):
        dst_table, timestamps, sync, sink = tensors
        threads = self.cfg.threads
        tidx, _, _ = cute.arch.thread_idx()
        k, _, _ = cute.arch.block_idx()
        num_producers, _, _ = cute.arch.grid_dim()

        base = xd.peer_address(dst_table, dst, Int64(0))
        volume = Int64(bytes_per_producer) * Int64(num_producers)
        stores_per_thread = bytes_per_producer // (threads * STORE_BYTES)
        producer_off = Int64(k) * Int64(bytes_per_producer) + Int64(tidx) * STORE_BYTES

        # MMA gap state lives across bursts so the work is never dead code.
        tiled_mma = None
        a = b = acc0 = acc1 = None
        if const_expr(self.cfg.gap_mode == "mma"):
            tiled_mma = cute.make_tiled_mma(warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)), (1, 1, 1))
            a = tiled_mma.make_fragment_A(tiled_mma.partition_shape_A((16, 16)))
            b = tiled_mma.make_fragment_B(tiled_mma.partition_shape_B((8, 16)))
            acc0 = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C((16, 8)))
            acc1 = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C((16, 8)))
            seed = Float32(tidx) * Float32(1.0e-3)
            for i in cutlass.range_constexpr(cute.size(a)):
                a[i] = BFloat16(seed + Float32(i) * Float32(1.0e-2))
            for i in cutlass.range_constexpr(cute.size(b)):
                b[i] = BFloat16(seed - Float32(i) * Float32(1.0e-2))
            acc0.fill(0.0)
            acc1.fill(0.0)

        smem = cutlass.memory.SmemAllocator()
        s_ts = smem.allocate_tensor(Int64, cute.make_layout(MAX_BURSTS * 4), byte_alignment=16)

        slot = Int64(0)
        failed = Int32(0)  # uniform per CTA: set once the error word is non-zero
        for n in cutlass.range(num_bursts):
            if failed == 0:
                if const_expr(self.cfg.align_bursts):
                    xd.grid_arrive_and_wait(
                        sync.iterator, Int32(num_producers) * (n + 1), timeout_ns, sync.iterator + 1, tidx
                    )
                    # A timed-out barrier must not turn into N more timeouts: stop.
                    failed = xd.load_relaxed(sync.iterator + 1, "gpu")
            if failed == 0:
                gt_start = Int64(0)
                clk_start = Int64(0)
                if tidx == 0:
                    gt_start = xd.globaltimer_ns()
                    clk_start = xd.clock64()
                burst_off = slot + producer_off
                for i in cutlass.range(stores_per_thread):
                    off = burst_off + Int64(i) * (threads * STORE_BYTES)
                    xd.store_v4(base + off, Int32(off >> 4), n, k, Int32(MAGIC), self.cfg.cache)
                # Issue ends when every thread of the producer had its stores accepted.
                cute.arch.sync_threads()
                gt_end = Int64(0)
                if tidx == 0:
                    gt_end = xd.globaltimer_ns()
                    clk_end = xd.clock64()
                    # Shared memory, not global: a global store here could wait
                    # behind the burst's outstanding stores and lengthen the gap.
                    rec = n * 4
                    s_ts[rec + 0] = gt_start
                    s_ts[rec + 1] = gt_end
                    s_ts[rec + 2] = clk_start
                    s_ts[rec + 3] = clk_end
                if const_expr(self.cfg.gap_mode == "spin"):
                    self._gap_spin(gt_end, gap_ns, tidx)
                elif const_expr(self.cfg.gap_mode == "mma"):
                    # Tensor Core gap: two independent mma.sync chains per warp.
                    for _ in cutlass.range(mma_iters, unroll=2):
                        cute.gemm(tiled_mma, acc0, a, b, acc0)
                        cute.gemm(tiled_mma, acc1, a, b, acc1)
                slot = slot + volume
                if slot >= region_bytes:
                    slot = Int64(0)

        # Flush the per-burst record after the last burst (outside every gap).
        cute.arch.sync_threads()
        out_base = Int64(k) * Int64(num_bursts) * 4
        for j in cutlass.range(tidx, num_bursts * 4, threads):
            timestamps[out_base + Int64(j)] = s_ts[j]

        if const_expr(self.cfg.gap_mode == "mma"):
            total = Float32(0.0)
            for i in cutlass.range_constexpr(cute.size(acc0)):
                total += acc0[i] + acc1[i]
            # Never true for these inputs; keeps the MMA chains live.
            if total == Float32(-1.0e38):
                sink[Int32(k) * threads + tidx] = total

    @cute.jit
    def launch(
        self,
        tensors: BurstTensors,
        dst: Int32,
        num_producers: Int32,
        bytes_per_producer: Int32,
        num_bursts: Int32,
        region_bytes: Int64,
        gap_ns: Int64,
        mma_iters: Int32,
        timeout_ns: Int64,
        stream,
    ):
        self.kernel(
            tensors, dst, bytes_per_producer, num_bursts, region_bytes, gap_ns, mma_iters, timeout_ns,
        ).launch(grid=[num_producers, 1, 1], block=[self.cfg.threads, 1, 1], stream=stream)

    # -------------------------------------------------------------------- host

    def compile(self, keep_ptx: bool = False):
        """Compile for sm_90a (``CUTE_DSL_ARCH``) with fake tensors; cached per config.

        Returns an ``xstage.cute_compile.Compiled`` (``.ptx`` set when ``keep_ptx``).
        """
        from xstage.cute_compile import cached, compile_hopper

        sym = cute.sym_int
        fake = cute.runtime.make_fake_compact_tensor
        args = (
            BurstTensors(fake(Int64, (sym(),), assumed_align=8), fake(Int64, (sym(),), assumed_align=16),
                         fake(Int32, (2,), assumed_align=8), fake(Float32, (sym(),), assumed_align=16)),
            Int32(0),
            Int32(1), Int32(1), Int32(1), Int64(1), Int64(0), Int32(0), Int64(1),
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
        )
        return cached(("BurstKernel", self.cfg, keep_ptx), lambda: compile_hopper(self.launch, *args, keep_ptx=keep_ptx))

    def __call__(
        self,
        dst_table,
        dst: int,
        timestamps,
        sync,
        sink,
        *,
        num_producers: int,
        bytes_per_producer: int,
        num_bursts: int,
        region_bytes: int,
        dst_buffer_bytes: int,
        gap_ns: int = 0,
        mma_iters: int = 0,
        timeout_ns: int = 2_000_000_000,
        num_sms: Optional[int] = None,
    ) -> None:
        """Validate, zero ``sync`` and launch on the current torch stream (asynchronous)."""
        import torch

        validate_launch(
            self.cfg, num_producers=num_producers, bytes_per_producer=bytes_per_producer,
            num_bursts=num_bursts, region_bytes=region_bytes, dst_buffer_bytes=dst_buffer_bytes,
            gap_ns=gap_ns, mma_iters=mma_iters, num_sms=num_sms,
        )
        P = dst_table.numel()
        if dst_table.dtype != torch.int64 or not dst_table.is_cuda or dst_table.dim() != 1:
            raise ValueError("dst_table must be a 1-D int64 CUDA tensor")
        if not 0 <= dst < P:
            raise ValueError(f"dst={dst} out of range for a table of {P} ranks")
        need = num_producers * num_bursts * 4
        if timestamps.dtype != torch.int64 or not timestamps.is_cuda or timestamps.numel() < need:
            raise ValueError(f"timestamps must be an int64 CUDA tensor with >= {need} elements")
        if not timestamps.is_contiguous():
            raise ValueError("timestamps must be contiguous")
        if sync.dtype != torch.int32 or not sync.is_cuda or sync.numel() != 2:
            raise ValueError("sync must be an int32 CUDA tensor of 2 elements")
        if sink.dtype != torch.float32 or not sink.is_cuda or sink.numel() < num_producers * self.cfg.threads:
            raise ValueError(f"sink must be a float32 CUDA tensor with >= {num_producers * self.cfg.threads} elements")
        compiled = self.compile()
        sync.zero_()
        compiled(
            BurstTensors(dst_table, timestamps.view(-1), sync, sink.view(-1)), dst, num_producers, bytes_per_producer,
            num_bursts, region_bytes, gap_ns, mma_iters, timeout_ns,
        )
