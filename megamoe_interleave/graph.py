"""The whole MegaMoE layer as one CUDA graph, replayed with new tokens and routing written in place.

::

    moe = MegaMoE(world, ..., max_tokens_per_rank=T)    # backend "fused", a single-process world
    moe.load_weights(w1, w2)
    layer = moe.capture(num_tokens=T)                    # warm-up, then one capture
    for step in steps:
        for r in world.local_ranks:                      # new inputs, in place
            layer.x[r].copy_(x_r); layer.topk_idx[r].copy_(idx_r); layer.topk_weights[r].copy_(w_r)
        ys = layer.replay()                              # one graph launch; ys are the graph's outputs
    layer.check()                                        # device errors of the replays (one sync)

What is captured is :meth:`MegaMoE.enqueue` on the symmetric buffers' leading rows (so its input
copies are skipped): the Combine-slot preparation (poison when ``poison_combine``, the expert-id
range check into the error word), the device-side plan of every rank,
the fused kernels on the fixed grid, the top-k reduction. Nothing is read back; the outputs are
overwritten by the next replay (clone what must outlive it). The Combine poison is captured when
the layer has ``poison_combine`` on (MegaMoE's default, for tests): one k x T x H fill per rank and
replay, so build serving layers with ``poison_combine=False``.
"""
from __future__ import annotations

from typing import List, Sequence, Union

import torch

from xstage.world import single_process


class MegaMoEGraph:
    """A captured :meth:`MegaMoE.enqueue` for fixed token counts (``num_tokens``: an int for every
    local rank, or one per local rank, each in [1, max_tokens_per_rank]).

    ``x`` / ``topk_idx`` / ``topk_weights``: per local rank, the tensors a replay reads (views of
    the layer's symmetric buffers; write new values in place; W8A8: ``x`` is a bf16 tensor of the
    graph's own, quantized into the E4M3 buffer by every replay). They start as a valid dummy
    problem (zero activations, expert ids spread over every expert, zero weights) for the warm-up
    and capture.
    ``warmup``: eager calls on a side stream before the capture (compile, allocator).
    ``capture_error_mode``: :class:`torch.cuda.graph`'s."""

    def __init__(self, moe, num_tokens: Union[int, Sequence[int]], *, warmup: int = 1,
                 capture_error_mode: str = "global"):
        if moe.backend != "fused" or moe.world.device.type != "cuda":
            raise ValueError("capture() needs backend='fused' on a CUDA world")
        if not single_process(moe.world):
            raise NotImplementedError("capture() needs a single-process world (the device-side plan reads every "
                                      "source's routing in one process)")
        if not moe.w1:
            raise RuntimeError("call load_weights() before capture()")
        ranks = moe.world.local_ranks
        counts = [num_tokens] * len(ranks) if isinstance(num_tokens, int) else [int(t) for t in num_tokens]
        if len(counts) != len(ranks):
            raise ValueError(f"num_tokens: one count per local rank ({len(ranks)}), got {len(counts)}")
        buf = moe.buffer
        for T in counts:
            if not 1 <= T <= buf.max_tokens:
                raise ValueError(f"num_tokens {T} outside [1, max_tokens_per_rank={buf.max_tokens}]")
        if warmup < 1:
            raise ValueError("warmup must be >= 1 (the first call compiles and allocates; capture cannot)")
        self.moe, self.num_tokens = moe, counts
        if moe.config.fp8:
            self.x: List[torch.Tensor] = [torch.zeros(T, moe.hidden, dtype=buf.dtype, device=moe.world.device)
                                          for T in counts]
        else:
            self.x = [buf.x.local(r)[:T] for r, T in zip(ranks, counts)]
        self.topk_idx: List[torch.Tensor] = [buf.topk_idx.local(r)[:T] for r, T in zip(ranks, counts)]
        self.topk_weights: List[torch.Tensor] = [buf.topk_weights.local(r)[:T] for r, T in zip(ranks, counts)]
        dev = moe.world.device
        for x, idx, w in zip(self.x, self.topk_idx, self.topk_weights):
            x.zero_()
            idx.copy_(torch.arange(idx.numel(), device=dev).view(idx.shape) % moe.num_experts)
            w.zero_()
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                moe.enqueue(self.x, self.topk_idx, self.topk_weights)
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode=capture_error_mode):
            self.y: List[torch.Tensor] = moe.enqueue(self.x, self.topk_idx, self.topk_weights)
        moe.check()  # the warm-up's error words (the dummy problem must run clean)

    def replay(self) -> List[torch.Tensor]:
        """Launch the graph on the current stream; returns ``y`` per local rank (the graph's own
        output tensors: overwritten by the next replay)."""
        self.graph.replay()
        return self.y

    def check(self) -> None:
        """:meth:`MegaMoE.check`: raise the device errors of the replays since the last check."""
        self.moe.check()
