"""A call's inputs into the layer's symmetric buffers: every check that needs no device read (before
any launch), then the copies (W8A8: bf16 x quantized on the way in, on a GPU by one kernel). ``layer`` is a
:class:`~megamoe_interleave.api.MegaMoE`."""
from __future__ import annotations

from typing import List

import torch

from . import act_quant, quant, reference
from .config import QUANT_BLOCK


def check_inputs(layer, xs, idxs, ws, x_scales) -> None:
    """Every check of the staged inputs that needs no device read (count, dtypes, shapes)."""
    ranks = layer.world.local_ranks
    if not (len(xs) == len(idxs) == len(ws) == len(ranks)):
        raise ValueError(f"need one input per local rank ({len(ranks)}), got {len(xs)}/{len(idxs)}/{len(ws)}")
    if not layer.w1:
        raise RuntimeError("call load_weights() first")
    buf = layer.buffer
    fp8 = layer.config.fp8
    if x_scales is not None and (not fp8 or len(x_scales) != len(xs)):
        raise ValueError("x_scales (one per local rank) go with E4M3 x and precision='w8a8' / 'w4a8' only")
    for i, (xr, ir, wr) in enumerate(zip(xs, idxs, ws)):
        want = buf.x.dtype if x_scales is not None else buf.dtype
        if xr.dtype != want:
            raise ValueError(f"x must be {want}, got {xr.dtype}"
                             + (" (E4M3 x comes with x_scales)" if fp8 and x_scales is None else ""))
        reference.check_routing_shapes(xr, ir, wr)
        if xr.shape[1] != layer.hidden or ir.shape[1] != layer.topk:
            raise ValueError(f"x must be [T, {layer.hidden}] and topk_idx [T, {layer.topk}]")
        if x_scales is not None and (x_scales[i].dtype != torch.float32
                                     or x_scales[i].shape != (xr.shape[0], layer.hidden // QUANT_BLOCK)):
            raise ValueError(f"x_scales must be float32 [T, {layer.hidden // QUANT_BLOCK}], got "
                             f"{x_scales[i].dtype} {tuple(x_scales[i].shape)}")
        if xr.shape[0] > buf.max_tokens:
            raise ValueError(f"{xr.shape[0]} tokens > max_tokens_per_rank {buf.max_tokens}")


def copy_inputs(layer, xs, idxs, ws, x_scales) -> List[torch.Tensor]:
    """Copy each rank's inputs into its symmetric buffers (skipping inputs that are those
    buffers' leading rows; W8A8 quantizes bf16 x); returns the staged topk_idx views."""
    buf, ranks = layer.buffer, layer.world.local_ranks
    fp8 = layer.config.fp8
    staged_idx = []
    for i, (r, xr, ir, wr) in enumerate(zip(ranks, xs, idxs, ws)):
        T = xr.shape[0]
        if not fp8:
            rows = [(buf.x.local(r)[:T], xr)]
        elif x_scales is None and xr.is_cuda and xr.device == buf.x.local(r).device:
            act_quant.quantize_act_into(xr, buf.x.local(r)[:T], buf.x_scales.local(r)[:T])  # one kernel
            rows = []
        else:  # E4M3 rows and their scales, given or quantized here by the torch recipe
            x_q, x_s = quant.quantize_act(xr) if x_scales is None else (xr, x_scales[i])
            rows = [(buf.x.local(r)[:T], x_q), (buf.x_scales.local(r)[:T], x_s)]
        for dst, src in rows + [(buf.topk_idx.local(r)[:T], ir), (buf.topk_weights.local(r)[:T], wr)]:
            if not same_memory(dst, src):
                dst.copy_(src)
        staged_idx.append(buf.topk_idx.local(r)[:T])
    return staged_idx


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` are the same view of the same memory (a copy would be a no-op)."""
    return (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.data_ptr() == b.data_ptr())
