"""Host-side input checks, run before any compile or launch.

Order matters for the CPU tests: structural checks (rank, shape, dtype, divisibility, layout,
alignment) come before the device check, so every one of them is reachable with CPU tensors.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
SUPPORTED_HEAD_DIMS = (64, 128)


class Fa4A2AInputError(ValueError):
    """Bad input to fa4_a2a (raised before any kernel is compiled or launched)."""


def _fail(msg: str):
    raise Fa4A2AInputError(msg)


def check_world_size(num_ranks: int) -> None:
    if not isinstance(num_ranks, int) or num_ranks < 1:
        _fail(f"world size must be a positive int, got {num_ranks!r}")


def check_bshd(name: str, t: torch.Tensor) -> None:
    """A [B, S, H, D] attention operand: dtype, head_dim, 16-byte rows and 16-byte alignment."""
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        _fail(f"{name} must be 4-D [batch, seq, heads, head_dim], got shape {tuple(t.shape)}")
    if t.dtype not in SUPPORTED_DTYPES:
        _fail(f"{name} dtype {t.dtype} unsupported (bfloat16 or float16)")
    if t.shape[-1] not in SUPPORTED_HEAD_DIMS:
        _fail(f"{name} head_dim {t.shape[-1]} unsupported (one of {SUPPORTED_HEAD_DIMS})")
    if min(t.shape) == 0:
        _fail(f"{name} has an empty dimension: {tuple(t.shape)}")
    if t.stride(-1) != 1:
        _fail(f"{name} must have a contiguous last dimension (stride {t.stride()})")
    elems_16b = 16 // t.element_size()
    if any(s % elems_16b for s in t.stride()[:-1]):
        _fail(f"{name} strides {t.stride()} must be multiples of 16 bytes")
    if t.data_ptr() % 16:
        _fail(f"{name} data pointer is not 16-byte aligned (storage offset {t.storage_offset()})")


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        _fail(f"{name} must be contiguous (shape {tuple(t.shape)}, stride {t.stride()})")


def check_same(names: Sequence[str], tensors: Sequence[torch.Tensor], what: str) -> None:
    vals = [getattr(t, what) for t in tensors]
    if any(v != vals[0] for v in vals):
        desc = ", ".join(f"{n}={v}" for n, v in zip(names, vals))
        _fail(f"{what} mismatch: {desc}")


def check_cuda(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    for n, t in zip(names, tensors):
        if t.device.type != "cuda":
            _fail(f"{n} must be a CUDA tensor, got device {t.device}")
    check_same(names, tensors, "device")


def check_attention_a2a(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: Optional[torch.Tensor],
    peer_table: Optional[torch.Tensor],
    num_ranks: int,
    *,
    ulysses: bool,
) -> None:
    """Checks for one rank's fused launch.

    q, k, v: [B, S, Hl, D] (this rank's heads, full sequence).
    out: ulysses -> this rank's destination buffer [B, S/P, Hl*P, D]; else local [B, S, Hl, D].
    lse: optional float32 [B, Hl, S].  peer_table: int64 [P] (ulysses only).
    """
    check_world_size(num_ranks)
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        check_bshd(name, t)
    check_same(("q", "k", "v", "out"), (q, k, v, out), "dtype")
    if k.shape != q.shape or v.shape != q.shape:
        _fail(f"q, k, v must have the same shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, S, Hl, D = q.shape
    if S % num_ranks:
        _fail(f"sequence length {S} is not divisible by the world size {num_ranks}")
    if ulysses:
        want = (B, S // num_ranks, Hl * num_ranks, D)
        check_contiguous("out", out)
        if peer_table is None:
            _fail("peer_table is required for the Ulysses epilogue")
        if peer_table.dtype != torch.int64 or peer_table.dim() != 1 or peer_table.numel() != num_ranks:
            _fail(f"peer_table must be int64 [{num_ranks}], got {peer_table.dtype} {tuple(peer_table.shape)}")
        check_contiguous("peer_table", peer_table)
    else:
        want = (B, S, Hl, D)
    if tuple(out.shape) != want:
        _fail(f"out must have shape {want}, got {tuple(out.shape)}")
    if lse is not None:
        if lse.dtype != torch.float32 or tuple(lse.shape) != (B, Hl, S):
            _fail(f"lse must be float32 {(B, Hl, S)}, got {lse.dtype} {tuple(lse.shape)}")
        if lse.stride(-1) != 1 or lse.data_ptr() % 4:
            _fail("lse must have a contiguous, 4-byte aligned last dimension")
    tensors = [q, k, v, out] + ([lse] if lse is not None else []) + ([peer_table] if ulysses else [])
    names = ["q", "k", "v", "out"] + (["lse"] if lse is not None else []) + (["peer_table"] if ulysses else [])
    check_cuda(names, tensors)


def check_sequence_sharded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_ranks: int, name_prefix: str = ""
) -> None:
    """Checks for Ulysses inputs [B, S/P, H, D] (sequence-sharded, all heads)."""
    check_world_size(num_ranks)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_bshd(name_prefix + name, t)
    check_same(("q", "k", "v"), (q, k, v), "dtype")
    if k.shape != q.shape or v.shape != q.shape:
        _fail(f"q, k, v must have the same shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    H = q.shape[2]
    if H % num_ranks:
        _fail(f"number of heads {H} is not divisible by the world size {num_ranks}")


# The copy kernel indexes 16-byte chunks with int32 (grid-stride index + one stride of slack).
MAX_COPY_CHUNKS = 2**31 - 2**24


def check_a2a_copy(o_local: torch.Tensor, out: torch.Tensor, peer_table: torch.Tensor, num_ranks: int) -> None:
    """Checks for one rank's symmetric-memory A2A copy (``fa4_a2a.a2a_copy.a2a_symm``).

    o_local: [B, S, Hl, D] contiguous (this rank's attention output).  out: this rank's own
    destination buffer [B, S/P, Hl*P, D] (contiguous; every rank's has this layout).
    peer_table: int64 [P].
    """
    check_world_size(num_ranks)
    check_bshd("o_local", o_local)
    check_bshd("out", out)
    check_same(("o_local", "out"), (o_local, out), "dtype")
    check_contiguous("o_local", o_local)
    check_contiguous("out", out)
    B, S, Hl, D = o_local.shape
    if S % num_ranks:
        _fail(f"sequence length {S} is not divisible by the world size {num_ranks}")
    want = (B, S // num_ranks, Hl * num_ranks, D)
    if tuple(out.shape) != want:
        _fail(f"out must have shape {want}, got {tuple(out.shape)}")
    if not isinstance(peer_table, torch.Tensor) or peer_table.dtype != torch.int64 or peer_table.dim() != 1 \
            or peer_table.numel() != num_ranks:
        _fail(f"peer_table must be int64 [{num_ranks}], got "
              f"{getattr(peer_table, 'dtype', type(peer_table).__name__)} {tuple(getattr(peer_table, 'shape', ()))}")
    check_contiguous("peer_table", peer_table)
    chunks = o_local.numel() * o_local.element_size() // 16
    if chunks > MAX_COPY_CHUNKS:
        _fail(f"o_local has {chunks} 16-byte chunks, more than the copy kernel's int32 index allows "
              f"({MAX_COPY_CHUNKS})")
    check_cuda(("o_local", "out", "peer_table"), (o_local, out, peer_table))
