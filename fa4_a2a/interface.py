"""Thin compile/launch wrapper for ``FlashAttentionUlyssesSm90`` (one rank's launch).

Mirrors the small part of flash-attn-4's ``_flash_attn_fwd`` the SM90 non-varlen path needs
(tile config, dlpack conversion, positional compile list) with its own cache, keyed on the kernel
class and every compile-time switch.  flash-attn's interface is imported, never patched.

The rank is not a compile-time constant: its head offset is folded into the peer table
(``ulysses_peer_table``), so one compiled kernel serves every rank of a world of size P.  Shapes
(B, S, H) are dynamic; only dtype, head_dim, P, the variant flags and whether LSE is written are
part of the key.
"""

from __future__ import annotations

import math
import warnings
import os
from dataclasses import dataclass, asdict
from typing import Optional, Sequence

import torch

import cutlass
import cutlass.cute as cute

from flash_attn.cute.cute_dsl_utils import to_cute_tensor
from flash_attn.cute.interface import _tile_size_fwd_sm90
from flash_attn.cute.utils import AuxData

from fa4_a2a.kernel import FlashAttentionUlyssesSm90, UlyssesAux
from fa4_a2a.validate import check_attention_a2a

_TORCH_TO_CUTLASS = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}
LAYOUT = "bshd-contiguous"


@dataclass(frozen=True)
class KernelConfig:
    """Every compile-time choice of one kernel build (the cache key, with the class and layout)."""

    dtype: torch.dtype
    head_dim: int
    num_ranks: int
    ulysses: bool = True
    persistent: bool = False
    causal: bool = False
    has_lse: bool = False
    num_sms: int = 132
    o_staging: str = "own"  # persistent only: "own" O buffer or "defer_q" (see kernel.py)
    trace: bool = False  # per-tile timestamps (kernel.TRACE_FIELDS; lab.fa4_a2a.trace)

    def key(self) -> tuple:
        return (FlashAttentionUlyssesSm90.__qualname__, LAYOUT) + tuple(sorted(asdict(self).items(), key=lambda kv: kv[0]))


def default_num_sms(device: Optional[torch.device] = None) -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(device or torch.cuda.current_device()).multi_processor_count
    return int(os.environ.get("FLASH_ATTENTION_NUM_SMS", "132"))


def build_kernel(cfg: KernelConfig) -> FlashAttentionUlyssesSm90:
    """The kernel object for ``cfg`` with flash-attn-4's own SM90 tile choice for that head_dim."""
    if cfg.persistent and cfg.causal:
        raise NotImplementedError("the persistent variant is non-causal only")
    tile = _tile_size_fwd_sm90(cfg.head_dim, cfg.head_dim, cfg.causal, False)
    return FlashAttentionUlyssesSm90(
        _TORCH_TO_CUTLASS[cfg.dtype],
        cfg.head_dim,
        cfg.head_dim,
        1,
        is_causal=cfg.causal,
        is_local=False,
        pack_gqa=False,
        tile_m=tile.m_block_size,
        tile_n=tile.n_block_size,
        num_stages=2,
        num_threads=384,
        Q_in_regs=False,
        intra_wg_overlap=tile.intra_wg_overlap,
        mma_pv_is_rs=tile.mma_pv_is_rs,
        num_ranks=cfg.num_ranks,
        ulysses=cfg.ulysses,
        persistent=cfg.persistent,
        o_staging=cfg.o_staging,
        num_sms=cfg.num_sms,
        trace=cfg.trace,
    )


def _compile_operands(cfg: KernelConfig):
    """Small operands with the right dtype / rank / alignment (the compiled layout is dynamic, the
    addresses do not enter the program): real tensors where a GPU is present, as flash-attn compiles,
    FakeTensors on a CPU host (on a GPU host torch would warn that their data pointer is read)."""
    from contextlib import nullcontext

    from torch._subclasses.fake_tensor import FakeTensorMode

    B, S, Hl, D, P = 1, 256 * cfg.num_ranks, 2, cfg.head_dim, cfg.num_ranks
    with nullcontext() if torch.cuda.is_available() else FakeTensorMode():
        q = torch.empty(B, S, Hl, D, dtype=cfg.dtype, device="cuda")
        out = (
            torch.empty(B, S // P, Hl * P, D, dtype=cfg.dtype, device="cuda")
            if cfg.ulysses
            else torch.empty(B, S, Hl, D, dtype=cfg.dtype, device="cuda")
        )
        lse = torch.empty(B, Hl, S, dtype=torch.float32, device="cuda") if cfg.has_lse else None
        table = torch.empty(P, dtype=torch.int64, device="cuda") if cfg.ulysses else None
        trace = torch.empty(B, Hl, S // 128, 5, dtype=torch.int64, device="cuda") if cfg.trace else None
        return q, out, lse, table, trace


def _compile(cfg: KernelConfig, options: str = ""):
    kernel = build_kernel(cfg)
    q, out, lse, table, trace = _compile_operands(cfg)
    q_t = to_cute_tensor(q)
    out_t = to_cute_tensor(out, assumed_align=16)
    lse_t = to_cute_tensor(lse, assumed_align=4) if lse is not None else None
    aux = AuxData() if table is None else UlyssesAux(
        to_cute_tensor(table, assumed_align=8, leading_dim=0),
        None if trace is None else to_cute_tensor(trace, assumed_align=8)).aux_data()
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    with warnings.catch_warnings():
        # FA-only builds pass FA4's empty AuxData(), a compile-time value with no tensors; the DSL
        # warns that it is no JIT argument, which is what it should be (one warning per build)
        warnings.filterwarnings("ignore", message=r"Argument aux_data .* cannot be converted to a JitArgument",
                                category=UserWarning)
        return cute.compile(
            kernel,
            q_t, q_t, q_t, out_t, lse_t,
            1.0,  # softmax_scale (runtime Float32)
            None, None, None, None, None,  # cu_seqlens_q/k, seqused_q/k, page_table
            None, None,  # window left/right
            None,  # learnable_sink
            None,  # block sparsity
            aux,
            None, None,  # cu_total_m_blocks, cu_total_splits_m_blocks
            stream,
            options=("--enable-tvm-ffi " + options).strip(),
        )


def compile_kernel(cfg: KernelConfig):
    """Compile (once per ``cfg``) and return the TVM-FFI callable. Works on a CPU-only host."""
    import sys

    from xstage import device
    from xstage.cute_compile import cached

    from fa4_a2a import kernel

    return cached(cfg.key(), lambda: _compile(cfg), sources=(sys.modules[__name__], kernel, device))


def compile_ptx(cfg: KernelConfig) -> str:
    """PTX of ``cfg`` (uncached compile; for tests that check the emitted instructions)."""
    import tempfile

    dump = tempfile.mkdtemp(prefix="fa4_a2a-ptx-")
    _compile(cfg, f"--keep-ptx --dump-dir={dump}")
    files = sorted(f for f in os.listdir(dump) if f.endswith(".ptx"))
    return "\n".join(open(os.path.join(dump, f)).read() for f in files)


def _launch(cfg, q, k, v, out, lse, peer_table, softmax_scale, trace=None):
    fn = compile_kernel(cfg)
    aux = UlyssesAux(peer_table, trace if cfg.trace else None).aux_data() if cfg.ulysses else AuxData()
    fn(
        q.detach(), k.detach(), v.detach(), out.detach(), lse, float(softmax_scale),
        None, None, None, None, None, None, None, None, None, aux, None, None,
    )


def attention_a2a(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    peer_table: torch.Tensor,
    *,
    num_ranks: int,
    lse: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    persistent: bool = False,
    o_staging: str = "own",
) -> None:
    """One rank's fused FlashAttention + post-attention All-to-All (launch only, no sync).

    q, k, v: [B, S, Hl, D] this rank's heads over the full sequence.  out: this rank's own
    destination buffer [B, S/P, Hl*P, D] (the layout every peer's buffer shares).  peer_table:
    int64 [P] from ``ulysses_peer_table``.  Completion on the destination ranks needs a world
    barrier (or stream order in the loopback world) after the launch.
    """
    _check_and_launch(q, k, v, out, lse, peer_table, num_ranks, True, softmax_scale, causal, persistent, o_staging)


def attention_local(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    *,
    lse: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    persistent: bool = False,
    o_staging: str = "own",
) -> None:
    """FA-only: the same kernel class with the stock epilogue, writing local out [B, S, Hl, D]."""
    _check_and_launch(q, k, v, out, lse, None, 1, False, softmax_scale, causal, persistent, o_staging)


def _check_and_launch(q, k, v, out, lse, peer_table, num_ranks: int, ulysses: bool, softmax_scale, causal: bool,
                      persistent: bool, o_staging: str) -> None:
    """Validate (before any launch), pick the compiled kernel for the configuration, launch."""
    check_attention_a2a(q, k, v, out, lse, peer_table, num_ranks, ulysses=ulysses)
    D = q.shape[-1]
    cfg = KernelConfig(q.dtype, D, num_ranks, ulysses, persistent, causal, lse is not None,
                       default_num_sms(q.device), o_staging if persistent else "own")
    _launch(cfg, q, k, v, out, lse, peer_table, softmax_scale or 1.0 / math.sqrt(D))


def ulysses_peer_table(
    dest_buffers: Sequence[torch.Tensor] | Sequence[int],
    rank: int,
    heads_local: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """int64 [P] table for ``rank``: entry j = base address of rank j's output + r*Hl*D*elem.

    ``dest_buffers``: every rank's destination buffer [B, S/P, H, D] as seen from ``rank``
    (tensors, or raw device addresses e.g. from a symmetric-memory handle).
    """
    P = len(dest_buffers)
    if not 0 <= rank < P:
        raise ValueError(f"rank {rank} out of range for world size {P}")
    elem = torch.empty((), dtype=dtype).element_size()
    head_offset = rank * heads_local * head_dim * elem
    addrs = []
    for buf in dest_buffers:
        base = buf if isinstance(buf, int) else buf.data_ptr()
        if base % 16:
            raise ValueError(f"destination base address {base:#x} is not 16-byte aligned")
        addrs.append(base + head_offset)
    if device is None and not isinstance(dest_buffers[0], int):
        device = dest_buffers[0].device
    return torch.tensor(addrs, dtype=torch.int64, device=device)
