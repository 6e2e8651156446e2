"""``MegaMoE(backend="torch")``: the fused kernel's data flow with torch ops, on any device.

It reads the same symmetric buffers and writes the same Combine slots as the kernel
(``combine[pick, token]`` on every source rank), so the buffer layout and the slot protocol are
tested where no Hopper GPU is (CI). Single-process worlds only (loopback, host): a rank reaches
its peers only through the kernel's peer table in multi-process worlds.

``precision="w8a8"``: Dispatch moves the E4M3 rows with their 1x128 scales (``x``, ``x_scales``),
the experts run :func:`reference.w8a8_expert_compute` (the recipe's rounding points) and
Combine stores BF16 into the same slots: bit for bit :func:`reference.reference_moe_w8a8`.
``precision="w4a8"``: the same on the FP4 weights widened per call (:func:`quant_fp4.widen_weights`):
bit for bit :func:`reference.reference_moe_w4a8`.
"""
from __future__ import annotations

from xstage.world import single_process

from . import quant_fp4, reference


def run_dataflow(moe) -> None:
    """Dispatch + L1 + SwiGLU x routing weight + L2 + Combine of every rank of ``moe``'s world."""
    world, buf = moe.world, moe.buffer
    if not single_process(world):
        raise NotImplementedError("backend='torch' runs the data flow in one process (loopback / host worlds)")
    P, T = world.world_size, buf.num_tokens
    xs = [buf.x.local(s)[: T[s]] for s in range(P)]
    idxs = [buf.topk_idx.local(s)[: T[s]] for s in range(P)]
    ws = [buf.topk_weights.local(s)[: T[s]] for s in range(P)]
    perms = reference.permute_ranks(idxs, ws, range(P), moe.experts_per_rank)
    dev = world.device
    fp8 = moe.config.fp8
    if fp8:
        x_scales = [buf.x_scales.local(s)[: T[s]] for s in range(P)]
    for d in range(P):
        perm = perms[d]
        rows = reference.gather_rows(xs, perm, dev)
        if fp8:
            w = (moe.w1[d], moe.w1_scales[d], moe.w2[d], moe.w2_scales[d])
            if moe.config.precision == "w4a8":
                w = quant_fp4.widen_weights(*w)
            out = reference.w8a8_expert_compute(rows, reference.gather_rows(x_scales, perm, dev), perm.weights.to(dev),
                                                perm.counts_host, *w)
        else:
            out = reference.unfused_expert_compute(rows, perm.weights.to(dev), perm.counts, gate_up_w1_t(moe.w1[d]),
                                                   moe.w2[d].transpose(1, 2))
        for s in range(P):
            sel = (perm.src_rank == s).nonzero(as_tuple=True)[0]
            buf.combine_slots(s)[perm.src_pick[sel].to(dev), perm.src_token[sel].to(dev)] = out[sel.to(dev)]


def gate_up_w1_t(w1_il):
    """Kernel-layout w1 [E, 2I, H] (gate/up interleaved) -> [E, H, 2I] with gate columns then up
    columns (``torch._grouped_mm``'s B)."""
    from .weights import untransform_w1

    return untransform_w1(w1_il).transpose(1, 2)
