"""Ulysses sequence-parallel attention for DiT stacks, with the post-attention A2A fused.

``ulysses_attention(q, k, v, world)`` takes sequence-sharded ``[B, S/P, H, D]`` tensors
(yunchang / xDiT layout), does the pre-attention All-to-All, then one fused FlashAttention +
post-All-to-All launch per local rank, and returns ``[B, S/P, H, D]``.

World backends (``xstage.world``):
  * ``loopback`` / ``host``: all P ranks live in this process; ``q, k, v`` are sequences of P
    tensors (one per rank) and the result is a list of P tensors.  Launches run in rank order on
    the current stream, so stream order completes every rank's output (no cross-rank wait).
  * ``torch-symm``: one rank per process (``world.local_ranks == [rank]``); ``q, k, v`` are
    tensors; the pre-A2A is ``all_to_all_single`` on ``world.group`` (default group if absent) and
    a ``world.barrier()`` after the launch makes the peers' stores visible before anyone reads its
    output.  Under CUDA-graph capture the barrier (a host sync + ``dist.barrier``) cannot be
    recorded: it is skipped, and the caller calls ``world.barrier()`` once after the replay (the
    paper's Section 5.1 boundary; ``barrier=False`` does the same outside capture).

The outputs are views of a per-shape destination workspace (symmetric memory in multi-process
worlds): they stay valid until the next call that uses the same workspace.  Everything is
asynchronous and CUDA-graph capturable once a shape has been seen (the first call compiles and
allocates; capture after a warm-up call).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
from torch import nn

from fa4_a2a import ops  # noqa: F401  (registers torch.ops.fa4_a2a.*)
from fa4_a2a.baselines import a2a_all_to_all_single_pre
from fa4_a2a.reference import seq_to_head_shards
from fa4_a2a.validate import Fa4A2AInputError, check_sequence_sharded
from xstage.world import make_world, single_process

Tensors = Union[torch.Tensor, Sequence[torch.Tensor]]


class UlyssesWorkspace:
    """Destination buffers [B, S/P, H, D] (one per rank, world-allocated) + per-rank peer tables."""

    def __init__(self, world, shape: Sequence[int], dtype: torch.dtype):
        B, C, H, D = shape
        P = world.world_size
        self.world = world
        self.shape = tuple(shape)
        self.dtype = dtype
        self.dest = world.alloc(tuple(shape), dtype, remote=True)  # the fused epilogue's remote stores land here
        head_bytes = (H // P) * D * torch.empty((), dtype=dtype).element_size()
        # Fold this rank's head offset into its table: the kernel needs no rank (see kernel.py).
        self.tables = {r: (self.dest.peer_table(r) + r * head_bytes).contiguous() for r in world.local_ranks}

    def out(self, rank: int) -> torch.Tensor:
        return self.dest.local(rank)


_workspaces: dict = {}


def get_workspace(world, shape, dtype) -> UlyssesWorkspace:
    key = (id(world), tuple(shape), dtype)
    ws = _workspaces.get(key)
    if ws is None or ws.world is not world:
        ws = UlyssesWorkspace(world, shape, dtype)
        _workspaces[key] = ws
    return ws


def _launch_fused(q, k, v, out, table, num_ranks, scale, causal, persistent) -> None:
    """One rank's fused launch (a seam for CPU tests of the multi-process path)."""
    torch.ops.fa4_a2a.attention_a2a_(q, k, v, out, table, None, num_ranks, scale, causal, persistent)


def _world_dist(world):
    """The torch.distributed the world uses (TorchSymmWorld may carry an injected one)."""
    d = getattr(world, "_dist", None)
    if d is None:
        import torch.distributed as d
    return d


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _as_rank_list(x: Tensors, world, name: str) -> list[torch.Tensor]:
    P = world.world_size
    multi = len(world.local_ranks) > 1 or world.backend in ("loopback", "host")
    if isinstance(x, torch.Tensor):
        if multi and P > 1:
            raise Fa4A2AInputError(
                f"{name}: the {world.backend} world holds all {P} ranks in this process; pass a "
                f"sequence of {P} tensors [B, S/P, H, D]"
            )
        return [x]
    xs = list(x)
    if len(xs) != len(world.local_ranks):
        raise Fa4A2AInputError(f"{name}: expected {len(world.local_ranks)} tensors (one per local rank), got {len(xs)}")
    return xs


def ulysses_attention(
    q: Tensors,
    k: Tensors,
    v: Tensors,
    world,
    *,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    persistent: bool = False,
    workspace: Optional[UlyssesWorkspace] = None,
    barrier: bool = True,
) -> Tensors:
    """Ulysses attention: pre-A2A, then fused FA4 + post-A2A. See the module docstring.

    ``barrier`` (multi-process worlds): call ``world.barrier()`` after the launch so that the
    returned output is complete; skipped automatically under CUDA-graph capture.
    """
    if not _is_world(world):
        raise Fa4A2AInputError(
            f"world must be an xstage.world World (from xstage.world.make_world), got {type(world).__name__}"
        )
    qs, ks, vs = (_as_rank_list(t, world, n) for t, n in ((q, "q"), (k, "k"), (v, "v")))
    P = world.world_size
    for r, (qr, kr, vr) in enumerate(zip(qs, ks, vs)):
        check_sequence_sharded(qr, kr, vr, P, name_prefix=f"rank {world.local_ranks[r]} ")
        if qr.shape != qs[0].shape or qr.dtype != qs[0].dtype:
            raise Fa4A2AInputError(f"all ranks must pass the same shape/dtype, got {tuple(qr.shape)} vs {tuple(qs[0].shape)}")
    B, C, H, D = qs[0].shape
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    ws = workspace or get_workspace(world, (B, C, H, D), qs[0].dtype)
    if ws.shape != (B, C, H, D) or ws.dtype != qs[0].dtype:
        raise Fa4A2AInputError(f"workspace is for {ws.shape} {ws.dtype}, inputs are {(B, C, H, D)} {qs[0].dtype}")

    # Pre-attention All-to-All: sequence shards -> head shards [B, S, H/P, D].
    if single_process(world):
        qh, kh, vh = seq_to_head_shards(qs), seq_to_head_shards(ks), seq_to_head_shards(vs)
    else:
        if len(qs) != 1:
            raise Fa4A2AInputError(f"{world.backend} world: {len(world.local_ranks)} local ranks of {P} per "
                                   "process is not supported (one rank per process, or all of them)")
        group, dist = getattr(world, "group", None), _world_dist(world)
        qh, kh, vh = ([a2a_all_to_all_single_pre(x[0], group, dist=dist)] for x in (qs, ks, vs))

    # Fused attention + post-attention All-to-All, one launch per local rank.
    for i, r in enumerate(world.local_ranks):
        _launch_fused(qh[i], kh[i], vh[i], ws.out(r), ws.tables[r], P, scale, causal, persistent)
    # Multi-process: the peers' stores into our buffer must be complete before we return it.
    # Single-process worlds: stream order already completes every rank's launch.
    if not single_process(world) and barrier and not _capturing():
        world.barrier()
    outs = [ws.out(r) for r in world.local_ranks]
    return outs if not isinstance(q, torch.Tensor) else outs[0]


# yunchang AttnType values (enum .value) that select exact softmax attention: the fused FA4
# kernel computes the same function. The others (SageAttention's quantized kernels, sparse, NPU)
# are different numerics or hardware and are refused.
EXACT_ATTN_TYPES = ("fa", "fa3", "flashinfer", "aiter", "torch_math", "torch_flash", "torch_efficient", "torch_cudnn")

_group_worlds: dict = {}


def world_for_group(group=None, *, device=None):
    """The torch-symm World of a ``torch.distributed`` process group (``None``: the default group,
    as in yunchang), made on first use and cached per (group, rank): one rank per process, its
    symmetric buffers rendezvous over ``group``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("UlyssesAttention with a process group needs torch.distributed initialised "
                           "(torchrun + dist.init_process_group('nccl')), as yunchang's does")
    key = (group, dist.get_rank(group))
    world = _group_worlds.get(key)
    if world is None:
        world = make_world("torch-symm", world_size=dist.get_world_size(group), device=device, group=group)
        _group_worlds[key] = world
    return world


def _is_world(x) -> bool:
    return all(hasattr(x, a) for a in ("world_size", "local_ranks", "backend", "alloc"))


class UlyssesAttention(nn.Module):
    """Drop-in for yunchang's ``UlyssesAttention`` (BSHD in and out), backed by the fused kernel:
    the same constructor and forward signature, so swapping the import is the change.

    ``sequence_process_group``: a ``torch.distributed`` process group (``None``: the default group),
    as in yunchang -- a torch-symm world is built from it on the first forward and cached -- or an
    ``xstage.world`` World (also keyword ``world=``; e.g. the single-process loopback world, whose
    forward takes and returns one tensor per rank). ``attn_type``: ``None`` or a yunchang
    ``AttnType`` (or its string value) of exact attention (``EXACT_ATTN_TYPES``); the kernel is
    FlashAttention-4 whichever. Forward features the fused kernel lacks (dropout, windows, softcap,
    ALiBi, attention probabilities) raise.

    Unlike yunchang, the output is a view of a per-shape workspace, valid until the next call of
    the same shape (``.clone()`` it to keep it longer): the peers store into it directly.
    """

    def __init__(self, sequence_process_group=None, scatter_idx: int = 2, gather_idx: int = 1,
                 use_sync: bool = False, attn_type=None, *, world=None, persistent: bool = False):
        super().__init__()
        if (scatter_idx, gather_idx) != (2, 1):
            raise NotImplementedError("only scatter_idx=2, gather_idx=1 (BSHD) is supported")
        if _is_world(sequence_process_group):
            if world is not None:
                raise ValueError("pass an xstage World either positionally or as world=, not both")
            world, sequence_process_group = sequence_process_group, None
        elif world is not None and not _is_world(world):
            raise ValueError(f"world must be an xstage.world World, got {type(world).__name__}")
        if world is not None and sequence_process_group is not None:
            raise ValueError("pass a process group or an xstage World, not both")
        kind = getattr(attn_type, "value", attn_type)
        if kind is not None and kind not in EXACT_ATTN_TYPES:
            raise NotImplementedError(f"attn_type {attn_type!r}: the fused kernel computes exact attention "
                                      f"(FlashAttention-4); accepted: None or one of {EXACT_ATTN_TYPES}")
        self.spg = sequence_process_group
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx
        self.attn_type = attn_type
        self._world = world
        self.persistent = persistent
        self.use_sync = use_sync

    @property
    def world(self):
        """The xstage World the kernel runs in (built from the process group on first use)."""
        if self._world is None:
            self._world = world_for_group(self.spg)
        return self._world

    def forward(self, query, key, value, dropout_p: float = 0.0, softmax_scale=None, causal: bool = False,
                window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None, deterministic: bool = False,
                return_attn_probs: bool = False, *args):
        if dropout_p != 0.0:
            raise NotImplementedError("dropout is not supported by the fused kernel")
        if tuple(window_size) != (-1, -1):
            raise NotImplementedError("local (windowed) attention is not supported by the fused kernel")
        if softcap != 0.0 or alibi_slopes is not None:
            raise NotImplementedError("softcap / alibi are not supported by the fused kernel")
        if return_attn_probs:
            raise NotImplementedError("return_attn_probs is not supported")
        # *args: accepted and ignored, as yunchang's forward does
        # deterministic: the forward pass is deterministic either way (no atomics in FA4's forward)
        out = ulysses_attention(query, key, value, self.world, softmax_scale=softmax_scale, causal=causal,
                                persistent=self.persistent)
        if self.use_sync:
            torch.cuda.synchronize()
        return out
