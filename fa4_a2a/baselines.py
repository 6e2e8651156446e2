"""Baselines that share the fused kernel's compute path (Section 5.3).

* FA-only  : ``fa4_a2a.interface.attention_local`` (same kernel class, stock epilogue, local out).
* A2A-only : the same post-attention volume moved without attention.
    - loopback / host worlds: a device copy of each destination chunk into the P destination
      buffers (``a2a_copy``; torch copies, needs every rank's buffer in this process);
    - process-group worlds: ``torch.distributed.all_to_all_single`` with yunchang's permutes
      (``a2a_all_to_all_single``);
    - any world: ``a2a_symm`` (``fa4_a2a.a2a_copy``), a CuTe DSL copy kernel that moves the rank's
      output to the P destination buffers by 16-byte stores through the same peer table the fused
      epilogue uses -- the fused kernel's traffic as a separate kernel (one CTA per SM).
* Serial   : FA-only, then A2A-only (``serial``: torch copies; ``serial_symm``: the copy kernel).

Stable names (scripts/multigpu calls them): ``a2a_copy``, ``a2a_symm``, ``a2a_all_to_all_single``,
``a2a_all_to_all_single_pre``, ``serial``, ``serial_symm``, ``serial_all_to_all``.  None of them
synchronizes: in multi-process worlds call ``world.barrier()`` after them (after a graph replay).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from fa4_a2a.a2a_copy import A2ACopyConfig, a2a_symm
from fa4_a2a.interface import attention_local

__all__ = ["a2a_copy", "a2a_symm", "a2a_all_to_all_single", "a2a_all_to_all_single_pre", "serial", "serial_symm",
           "serial_all_to_all", "A2ACopyConfig"]


def a2a_copy(o_local: torch.Tensor, dest_buffers: Sequence[torch.Tensor], rank: int) -> None:
    """Rank ``rank``'s post-attention A2A by device copies: o_local [B, S, Hl, D] ->
    dest_buffers[j][:, :, rank*Hl:(rank+1)*Hl] = o_local[:, j*S/P:(j+1)*S/P]."""
    P = len(dest_buffers)
    B, S, Hl, D = o_local.shape
    C = S // P
    for j, dst in enumerate(dest_buffers):
        dst[:, :, rank * Hl:(rank + 1) * Hl].copy_(o_local[:, j * C:(j + 1) * C])


def _dist(dist):
    if dist is None:
        import torch.distributed as dist
    return dist


def a2a_all_to_all_single(o_local: torch.Tensor, group=None, *, dist=None) -> torch.Tensor:
    """yunchang's post-attention All-to-All (scatter seq, gather heads) on a process group.

    o_local [B, S, Hl, D] -> [B, S/P, H, D] with the chunk from source rank r at heads r*Hl.
    ``dist``: torch.distributed (default) or a stand-in with the same calls (CPU tests).
    """
    dist = _dist(dist)

    P = dist.get_world_size(group)
    B, S, Hl, D = o_local.shape
    C = S // P
    # (B, S, Hl, D) -> (P, C, B, Hl, D): chunk j of the sequence goes to rank j.
    send = o_local.reshape(B, P, C, Hl, D).permute(1, 2, 0, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[r] = source rank r's chunk for us -> heads r*Hl.
    return recv.permute(2, 1, 0, 3, 4).reshape(B, C, P * Hl, D)


def a2a_all_to_all_single_pre(x: torch.Tensor, group=None, *, dist=None) -> torch.Tensor:
    """yunchang's pre-attention All-to-All: [B, S/P, H, D] -> [B, S, H/P, D]."""
    dist = _dist(dist)

    P = dist.get_world_size(group)
    B, C, H, D = x.shape
    Hl = H // P
    send = x.reshape(B, C, P, Hl, D).permute(2, 1, 0, 3, 4).contiguous()  # (P, C, B, Hl, D)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.reshape(P * C, B, Hl, D).permute(1, 0, 2, 3).contiguous()


def serial(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o_local: torch.Tensor,
    dest_buffers: Sequence[torch.Tensor], rank: int, *, softmax_scale: Optional[float] = None,
    causal: bool = False,
) -> None:
    """FA-only into ``o_local`` [B, S, Hl, D], then the A2A-only device copy."""
    attention_local(q, k, v, o_local, softmax_scale=softmax_scale, causal=causal)
    a2a_copy(o_local, dest_buffers, rank)


def serial_symm(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o_local: torch.Tensor, out: torch.Tensor,
    peer_table: torch.Tensor, *, num_ranks: int, softmax_scale: Optional[float] = None, causal: bool = False,
    config: A2ACopyConfig = A2ACopyConfig(),
) -> None:
    """FA-only into ``o_local`` [B, S, Hl, D], then the symmetric-memory copy kernel (``a2a_symm``).

    ``out`` / ``peer_table``: this rank's destination buffer and its folded table, exactly what
    ``attention_a2a`` takes, so Serial (symm) and Fused move the same bytes to the same places.
    """
    attention_local(q, k, v, o_local, softmax_scale=softmax_scale, causal=causal)
    a2a_symm(o_local, out, peer_table, num_ranks=num_ranks, config=config)


def serial_all_to_all(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o_local: torch.Tensor, group=None, *,
    softmax_scale: Optional[float] = None, causal: bool = False, dist=None,
) -> torch.Tensor:
    """FA-only, then yunchang's ``all_to_all_single`` post-A2A; returns [B, S/P, H, D]."""
    attention_local(q, k, v, o_local, softmax_scale=softmax_scale, causal=causal)
    return a2a_all_to_all_single(o_local, group, dist=dist)
