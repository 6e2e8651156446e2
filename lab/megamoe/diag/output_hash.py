"""The SHA-256 of a fused MegaMoE's outputs on one fixed small problem, so that two source trees which must compute
the same bits (a K-loop reordering, a new descriptor path) can be compared on a GPU without a reference:
``ab_trees --bits`` runs this file in each tree's environment (the tree first on ``PYTHONPATH``), so it imports
nothing but ``megamoe_interleave``'s public API and torch, which every tree since the first redesign has.

The problem has full and half tiles in both phases: 16 experts, H 1024, I 512, top-4, loopback P = 2, 384 tokens
per rank (192 rows per expert: one 128-row and one 64-row m-block each). Inputs come from seeded generators.

    python lab/megamoe/diag/output_hash.py --precision w8a8     # one JSON line: {"sha256": ..., ...}
"""
from __future__ import annotations

import argparse
import hashlib
import json

EXPERTS, HIDDEN, INTERMEDIATE, TOPK = 16, 1024, 512, 4
RANKS, TOKENS = 2, 384


def output_hash(precision: str, schedule: str = "interleaved", seed: int = 0, device: str = "cuda",
                backend: str = "fused") -> dict:
    """Build the layer, run one forward on the fixed problem and hash every rank's output bytes, in rank order
    (``device`` / ``backend``: the CPU test runs the torch backend)."""
    import torch

    from megamoe_interleave import MegaMoE, MegaMoEConfig, make_world

    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).bfloat16()

    w1 = randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, scale=HIDDEN ** -0.5)
    w2 = randn(EXPERTS, HIDDEN, INTERMEDIATE, scale=INTERMEDIATE ** -0.5)
    xs = [randn(TOKENS, HIDDEN) for _ in range(RANKS)]
    picks = [torch.rand(TOKENS, EXPERTS, generator=g, device=device).topk(TOPK, dim=1) for _ in range(RANKS)]
    idx = [p.indices for p in picks]
    wts = [torch.softmax(p.values, dim=1) for p in picks]
    moe = MegaMoE(make_world("loopback", world_size=RANKS, device=device), EXPERTS, HIDDEN, INTERMEDIATE, TOPK,
                  TOKENS, MegaMoEConfig(schedule, precision=precision), backend=backend)
    moe.load_weights(w1, w2)
    ys = moe.forward(xs, idx, wts)
    if device == "cuda":
        torch.cuda.synchronize()
    h = hashlib.sha256()
    for y in ys:
        h.update(y.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    finite = all(bool(torch.isfinite(y).all()) for y in ys)
    return {"sha256": h.hexdigest(), "finite": finite, "precision": precision, "schedule": schedule,
            "config": repr(moe.config)}


def compile_layer(precision: str, schedule: str = "interleaved") -> dict:
    """The layer's kernels compiled on any host (into ``XSTAGE_KERNEL_CACHE`` for the GPU run)."""
    from megamoe_interleave import MegaMoE, MegaMoEConfig, make_world

    moe = MegaMoE(make_world("loopback", world_size=RANKS, device="cpu"), EXPERTS, HIDDEN, INTERMEDIATE, TOPK,
                  TOKENS, MegaMoEConfig(schedule, precision=precision), backend="fused")
    moe.compile()
    return {"compiled": True, "precision": precision, "schedule": schedule}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", default="w8a8", choices=["bf16", "w8a8", "w4a8"])
    ap.add_argument("--schedule", default="interleaved", choices=["interleaved", "expert_wave"])
    ap.add_argument("--compile-only", action="store_true", help="compile the layer's kernels (no GPU) and exit")
    args = ap.parse_args(argv)
    run = compile_layer if args.compile_only else output_hash
    print(json.dumps(run(args.precision, args.schedule)), flush=True)


if __name__ == "__main__":
    main()
