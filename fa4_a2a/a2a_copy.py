"""Symmetric-memory A2A-only baseline: the fused epilogue's traffic as a separate copy kernel.

``UlyssesA2ACopy`` moves one rank's attention output ``o_local [B, S, Hl, D]`` into the P
destination buffers ``out_j [B, S/P, H, D]`` at their Ulysses positions, with the same 16-byte
stores through the same peer table (``xstage.device.peer_address`` + ``store_v4``) that the fused
FA4 epilogue uses -- only without attention.  In multi-GPU worlds (torch symmetric memory) these
are NVLink peer stores; in the loopback world they are local HBM stores into P separate
allocations; in the host world they cross PCIe.  It is the "A2A-only" column of Section 5.3 for
symmetric memory, and followed by FA-only it is "Serial (symm)".

Mapping (identical to ``fa4_a2a.kernel``): rank ``r``'s row ``s`` of local head ``h`` goes to
rank ``j = s // C`` (``C = S/P``) at ``out_j[b, s - j*C, r*Hl + h, :]``.  The host folds
``r*Hl*D*elem`` into the table (``fa4_a2a.interface.ulysses_peer_table`` or
``UlyssesWorkspace.tables``), so the kernel does not know the rank.  For a fixed source row
``(b, s)`` the Hl*D elements are contiguous in the source and land contiguously in the destination
(heads ``r*Hl .. r*Hl+Hl-1`` are adjacent in ``[.., H, D]``): the kernel works in 16-byte chunks,
chunk ``c`` = byte ``16*c`` of the flattened source, row ``c // chunks_per_row``.

Launch: one CTA per SM (grid = #SMs), ``threads`` threads, grid-stride loop.  Every thread keeps
``unroll`` 16-byte loads in flight before it issues their stores (a memory-bound kernel needs
bytes in flight, not occupancy).  No spin-waits, no flags: a launch only issues stores; in
multi-process worlds ``world.barrier()`` after the launch (or after a CUDA-graph replay) makes
them visible to the peers (the paper's Section 5.1 boundary).

Host API (stable; ``scripts/multigpu`` calls it):
  ``a2a_symm(o_local, out, peer_table, num_ranks=P)``  one rank's launch (no sync)
  ``A2ACopyConfig``, ``compile_a2a_copy(cfg)``, ``compile_a2a_copy_ptx(cfg)``
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass.base_dsl.typing import Vector
from cutlass.cute import FastDivmodDivisorV2

from xstage import device as xd

from fa4_a2a.validate import Fa4A2AInputError, check_a2a_copy

__all__ = ["A2ACopyConfig", "UlyssesA2ACopy", "a2a_symm", "compile_a2a_copy", "compile_a2a_copy_ptx"]

CHUNK_BYTES = 16
_WORDS = CHUNK_BYTES // 4


@dataclass(frozen=True)
class A2ACopyConfig:
    """Compile-time switches of :class:`UlyssesA2ACopy` (the cache key)."""

    threads: int = 512
    unroll: int = 4
    cache: Optional[str] = None  # store cache hint, see xstage.device.STORE_CACHE_HINTS

    def __post_init__(self):
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError(f"threads must be a multiple of 32 in [32, 1024], got {self.threads}")
        if not 1 <= self.unroll <= 16:
            raise ValueError(f"unroll must be in [1, 16], got {self.unroll}")
        if self.cache not in xd.STORE_CACHE_HINTS:
            raise ValueError(f"cache must be one of {xd.STORE_CACHE_HINTS}, got {self.cache!r}")


class UlyssesA2ACopy:
    """Grid-stride copy ``o_local [B, S, Hl, D] -> out_j [B, S/P, H, D]`` through a peer table.

    Kernel arguments (see :meth:`launch`): the source as a flat int32 view (16-byte aligned), the
    int64 peer table ``[P]`` (head offset folded in), and the runtime sizes ``total_chunks``,
    ``chunks_per_row`` (= Hl*D*elem/16), ``seq_len`` S, ``shard_len`` C and ``dst_row_bytes``
    (= H*D*elem, the destination's sequence stride in bytes).
    """

    def __init__(self, config: A2ACopyConfig = A2ACopyConfig()):
        self.cfg = config

    # ------------------------------------------------------------------ device
    @cute.jit
    def _load_chunk(self, src_base: Int64, chunk: Int32):
        """16-byte ``ld.global.v4.b32`` of source chunk ``chunk``."""
        ptr = cute.make_ptr(Int32, src_base + Int64(chunk) * CHUNK_BYTES, cute.AddressSpace.gmem, assumed_align=16)
        return cute.arch.load(ptr.llvm_ptr, Vector[Int32, _WORDS].mlir_type)

    @cute.jit
    def _store_chunk(self, peer_table: cute.Tensor, chunk: Int32, words, div_row: FastDivmodDivisorV2,
                     div_seq: FastDivmodDivisorV2, div_shard: FastDivmodDivisorV2, dst_row_bytes: Int64):
        """16-byte store of source chunk ``chunk`` at its Ulysses destination."""
        row, within = divmod(chunk, div_row)  # row = b * S + s
        b, s = divmod(row, div_seq)
        dst_rank, s_in_shard = divmod(s, div_shard)
        dst_row = b * div_shard.divisor + s_in_shard  # row of the destination's [B * C]
        offset = Int64(dst_row) * dst_row_bytes + Int64(within) * CHUNK_BYTES
        xd.store_v4(xd.peer_address(peer_table, dst_rank, offset), words[0], words[1], words[2], words[3],
                    self.cfg.cache)

    @cute.kernel
    def kernel(
        self,
        src: cute.Tensor,
        peer_table: cute.Tensor,
        total_chunks: Int32,
        div_row: FastDivmodDivisorV2,
        div_seq: FastDivmodDivisorV2,
        div_shard: FastDivmodDivisorV2,
        dst_row_bytes: Int64,
    ):
        threads, unroll = self.cfg.threads, self.cfg.unroll
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        stride = grid * threads
        gtid = bidx * threads + tidx
        src_base = src.iterator.toint()

        # Full super-steps: every one of the thread's `unroll` chunks is in range, so all loads are
        # issued before the first store (no predicates).
        step = stride * unroll
        full_steps = total_chunks // step
        for it in cutlass.range(full_steps):
            first = it * step + gtid
            words = [self._load_chunk(src_base, first + u * stride) for u in range(unroll)]
            for u in cutlass.range_constexpr(unroll):
                self._store_chunk(peer_table, first + u * stride, words[u], div_row, div_seq, div_shard,
                                  dst_row_bytes)
        # Tail: fewer than `step` chunks left, one per thread per iteration.
        for c in cutlass.range(full_steps * step + gtid, total_chunks, stride):
            self._store_chunk(peer_table, c, self._load_chunk(src_base, c), div_row, div_seq, div_shard,
                              dst_row_bytes)

    @cute.jit
    def launch(
        self,
        src: cute.Tensor,
        peer_table: cute.Tensor,
        total_chunks: Int32,
        chunks_per_row: Int32,
        seq_len: Int32,
        shard_len: Int32,
        dst_row_bytes: Int64,
        num_ctas: Int32,
        stream,
    ):
        # Runtime divisors as multiply-shift (FastDivmod): three divmods per 16-byte chunk would
        # otherwise cost ~60 integer instructions in a kernel that should be memory bound.
        self.kernel(src, peer_table, total_chunks, FastDivmodDivisorV2(chunks_per_row), FastDivmodDivisorV2(seq_len),
                    FastDivmodDivisorV2(shard_len), dst_row_bytes).launch(
            grid=[num_ctas, 1, 1], block=[self.cfg.threads, 1, 1], stream=stream
        )

    # -------------------------------------------------------------------- host
    def _compile(self, keep_ptx: bool = False):
        from xstage.cute_compile import compile_hopper

        sym = cute.sym_int
        fake = cute.runtime.make_fake_compact_tensor
        args = (
            fake(Int32, (sym(),), assumed_align=16),  # src (flat int32 view)
            fake(Int64, (sym(),), assumed_align=8),  # peer table [P]
            Int32(1), Int32(1), Int32(1), Int32(1), Int64(16), Int32(1),
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
        )
        return compile_hopper(self.launch, *args, keep_ptx=keep_ptx)


def compile_a2a_copy(cfg: A2ACopyConfig = A2ACopyConfig()):
    """Compile (once per ``cfg``) for sm_90a; works on a CPU-only host. Returns the callable."""
    from xstage.cute_compile import cached

    return cached((UlyssesA2ACopy.__qualname__, cfg), lambda: UlyssesA2ACopy(cfg)._compile())


def compile_a2a_copy_ptx(cfg: A2ACopyConfig = A2ACopyConfig()) -> str:
    """PTX of ``cfg`` (uncached compile; tests check the emitted instructions)."""
    return UlyssesA2ACopy(cfg)._compile(keep_ptx=True).ptx or ""


def _num_sms(device) -> int:
    if torch.cuda.is_available() and device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return int(os.environ.get("FLASH_ATTENTION_NUM_SMS", "132"))


def a2a_symm(
    o_local: torch.Tensor,
    out: torch.Tensor,
    peer_table: torch.Tensor,
    *,
    num_ranks: int,
    config: A2ACopyConfig = A2ACopyConfig(),
    num_ctas: Optional[int] = None,
) -> None:
    """One rank's post-attention All-to-All by the symmetric-memory copy kernel (launch only).

    o_local: this rank's attention output ``[B, S, Hl, D]`` (contiguous, 16-byte aligned).
    out: this rank's own destination buffer ``[B, S/P, Hl*P, D]`` (only its shape/dtype/device are
    used: every rank's buffer has this layout, the data goes to the addresses in ``peer_table``).
    peer_table: int64 ``[P]`` with this rank's head offset folded in (``ulysses_peer_table`` /
    ``UlyssesWorkspace.tables[r]``), the same table the fused kernel takes.
    num_ctas: grid size (default: one CTA per SM).

    Asynchronous and CUDA-graph capturable.  Multi-process worlds: ``world.barrier()`` after it.
    """
    check_a2a_copy(o_local, out, peer_table, num_ranks)
    B, S, Hl, D = o_local.shape
    elem = o_local.element_size()
    total_chunks = o_local.numel() * elem // CHUNK_BYTES
    grid = num_ctas if num_ctas is not None else _num_sms(o_local.device)
    if grid < 1:
        raise Fa4A2AInputError(f"num_ctas must be >= 1, got {grid}")
    fn = compile_a2a_copy(config)
    fn(o_local.detach().view(torch.int32).view(-1), peer_table, total_chunks, Hl * D * elem // CHUNK_BYTES,
       S, S // num_ranks, Hl * num_ranks * D * elem, grid)
