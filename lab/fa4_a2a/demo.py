"""The fa4_a2a half of ``scripts/run`` on a Hopper GPU: one representative Ulysses shape (loopback
world, P = 8, 24 heads, 8K tokens, head_dim 128, bf16), the fused kernel checked end to end against
the fp32 reference, then timed next to its baselines (FA-only, and Serial = FA-only + the
symmetric-memory A2A copy kernel) in paired, rotated trials of CUDA-graph replays (lab.fa4_a2a.bench).
"""
from __future__ import annotations


def run(*, P: int = 8, heads: int = 24, seq: int = 8192, head_dim: int = 128, trials: int = 11) -> dict:
    import torch

    from fa4_a2a import ulysses_attention
    from lab.fa4_a2a.bench import analyse_row, time_interleaved, variant_fns
    from fa4_a2a.reference import seq_to_head_shards, ulysses_reference
    from xstage.world import make_world

    world = make_world("loopback", world_size=P, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    C, Hl = seq // P, heads // P
    qs, ks, vs = ([torch.randn(1, C, heads, head_dim, generator=g, device="cuda").bfloat16() for _ in range(P)]
                  for _ in range(3))
    outs = ulysses_attention(qs, ks, vs, world)  # pre-A2A, then the fused kernel, every rank
    refs = ulysses_reference(qs, ks, vs)
    err = max((o.float() - r).abs().max().item() for o, r in zip(outs, refs))
    unwritten = sum(int(torch.isnan(o).sum()) for o in outs)
    # time rank 0's kernels (every rank runs the same shapes)
    q, k, v = (seq_to_head_shards(x)[0].contiguous() for x in (qs, ks, vs))
    o_local = torch.empty_like(q)
    dest = world.alloc((1, C, heads, head_dim), q.dtype, remote=True)
    table = (dest.peer_table(0)).contiguous()
    names = ("fa_only", "serial_symm", "fused")
    fns = {n: f for n, f in variant_fns(world, 0, q, k, v, o_local, dest, table, P).items() if n in names}
    samples, replays, clocks, _ = time_interleaved(fns, trials, 2000.0, 200)
    row = analyse_row({"P": P, "H": heads, "M": seq, "head_dim": head_dim, "replays": replays}, samples, clocks,
                      30.0, 5)
    med = row["median_us"]
    return {
        "shape": f"Ulysses attention, loopback P = {P}, H = {heads} (Hl = {Hl}), M = {seq}, d = {head_dim}, bf16",
        "max_abs_err_vs_fp32": err, "unwritten_elements": unwritten, "ok": err <= 2e-2 and unwritten == 0,
        "median_us": med, "fused_vs_fa_only": med["fused"] / med["fa_only"],
        "serial_symm_vs_fused": med["serial_symm"] / med["fused"],
        "fused_lt_serial_symm": row["acceptance"].get("fused_lt_serial_symm", {}).get("verdict"),
        "row": row,
    }
