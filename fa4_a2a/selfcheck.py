"""Correctness self-check of every fa4_a2a path on a live world (loopback, host or torch-symm).

For multi-GPU runs (one process per GPU), where the pytest GPU suite (loopback) cannot go:

  torchrun --nproc-per-node 8 -m fa4_a2a.selfcheck --world torch-symm
  python -m fa4_a2a.selfcheck --world loopback --P 4          # the same checks in one process

Every rank draws *all* ranks' sequence shards from one seeded generator (small shapes), so each
process can compute the float32 Ulysses reference of its own output locally.  Checked per local
rank, each into NaN-poisoned symmetric destinations, every element:
  * ``ulysses_attention`` (pre-A2A + fused kernel + barrier),
  * Serial (symm): FA-only + ``a2a_symm`` (the copy kernel through the same peer table),
  * the fused kernel directly, bitwise equal to Serial (symm),
  * multi-process only: FA-only + yunchang's ``all_to_all_single`` (the NCCL baseline).
``check_world(world)`` returns a summary dict, or raises ``AssertionError`` listing every mismatch
after all checks ran (a rank that fails still takes part in every barrier and collective, so its
peers do not hang); scripts call it too (stable name).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
DEFAULT_SHAPES = (
    # B, C (= S/P rows per rank), Hl, D, dtype
    (1, 136, 2, 128, torch.bfloat16),  # C not a multiple of tile_m: tiles straddle ranks
    (2, 96, 1, 64, torch.float16),
)


def _inputs(P, B, C, H, D, dtype, seed, device):
    g = torch.Generator(device=device).manual_seed(seed)
    return [[torch.randn(B, C, H, D, generator=g, device=device).to(dtype) for _ in range(P)] for _ in range(3)]


def _close(got, want, dtype, what, fails: list) -> float:
    """Max abs error; a mismatch is recorded in ``fails`` (not raised: in a multi-process world
    every rank must still reach the remaining barriers/collectives, or its peers would hang)."""
    if torch.isnan(got).any():
        fails.append(f"{what}: unwritten (poisoned) elements")
        return 0.0
    err = (got.float() - want).abs().max().item()
    if err > TOL[dtype]:
        fails.append(f"{what}: max abs error {err:.3e} > {TOL[dtype]}")
    return err


def check_world(world, shapes=DEFAULT_SHAPES, seed: int = 0, verbose: bool = True) -> dict:
    """Run every check for the world's local ranks; returns {"checks": [...], "max_err": ...}."""
    from fa4_a2a import attention_a2a, ulysses_attention
    from fa4_a2a.baselines import a2a_all_to_all_single, serial_symm
    from fa4_a2a.reference import seq_to_head_shards, ulysses_reference

    P, ranks, dev = world.world_size, world.local_ranks, world.device
    multi = len(ranks) < P
    done, fails, max_err = [], [], 0.0
    for i, (B, C, Hl, D, dtype) in enumerate(shapes):
        H = Hl * P
        qs, ks, vs = _inputs(P, B, C, H, D, dtype, seed + i, dev)
        ref = ulysses_reference(qs, ks, vs)
        heads = [seq_to_head_shards(x) for x in (qs, ks, vs)]  # every rank's [B, S, Hl, D] (local math)
        tag = f"P={P} B={B} C={C} Hl={Hl} D={D} {str(dtype).split('.')[-1]}"

        # 1. ulysses_attention end to end (its own workspace; barrier inside for multi-process)
        args = [[x[r] for r in ranks] for x in (qs, ks, vs)]
        if multi:
            args = [a[0] for a in args]
        outs = ulysses_attention(*args, world)
        outs = [outs] if multi else outs
        for r, o in zip(ranks, outs):
            max_err = max(max_err, _close(o, ref[r], dtype, f"ulysses_attention rank {r} {tag}", fails))
        done.append(f"ulysses_attention {tag}")

        # 2./3. Serial (symm) and the fused kernel into poisoned symmetric destinations
        results = {}
        for name in ("serial_symm", "fused"):
            dest = world.alloc((B, C, H, D), dtype, remote=True)
            dest.fill_(float("nan"))
            world.barrier()  # every rank poisoned before anyone stores
            for r in ranks:
                table = (dest.peer_table(r) + r * Hl * D * qs[0].element_size()).contiguous()
                q, k, v = (h[r] for h in heads)
                if name == "fused":
                    attention_a2a(q, k, v, dest.local(r), table, num_ranks=P)
                else:
                    serial_symm(q, k, v, torch.empty_like(q), dest.local(r), table, num_ranks=P)
            world.barrier()  # every rank's stores visible (Section 5.1 boundary)
            results[name] = {r: dest.local(r).clone() for r in ranks}
            for r in ranks:
                max_err = max(max_err, _close(results[name][r], ref[r], dtype, f"{name} rank {r} {tag}", fails))
            world.barrier()  # nobody reuses / frees the buffers while a peer still stores
            del dest
        for r in ranks:
            if not torch.equal(results["serial_symm"][r], results["fused"][r]):
                fails.append(f"serial_symm and fused differ on rank {r} {tag}")
        done += [f"serial_symm {tag}", f"fused {tag}", f"fused == serial_symm {tag}"]

        # 4. the NCCL baseline (multi-process worlds)
        if multi:
            from fa4_a2a.interface import attention_local

            r = ranks[0]
            q, k, v = (h[r] for h in heads)
            o_local = torch.empty_like(q)
            attention_local(q, k, v, o_local)
            o = a2a_all_to_all_single(o_local, getattr(world, "group", None), dist=getattr(world, "_dist", None))
            max_err = max(max_err, _close(o, ref[r], dtype, f"all_to_all_single rank {r} {tag}", fails))
            done.append(f"fa_only + all_to_all_single {tag}")
    if fails:
        raise AssertionError(f"fa4_a2a.selfcheck, ranks {ranks} of {P} ({world.backend}): " + "; ".join(fails))
    if verbose:
        print(f"[fa4_a2a.selfcheck] ranks {ranks} of {P} ({world.backend}): {len(done)} checks passed, "
              f"max abs error {max_err:.2e}", flush=True)
    return {"checks": done, "max_err": max_err, "ranks": ranks, "world_size": P, "backend": world.backend}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", choices=("loopback", "host", "torch-symm"), default="loopback")
    p.add_argument("--P", type=int, default=None, help="world size (default: 4, or the torchrun process count)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from xstage.world import make_world

    if args.world == "torch-symm":
        import torch.distributed as dist

        if "LOCAL_RANK" not in os.environ:
            raise SystemExit("--world torch-symm: start with torchrun (one process per GPU)")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        world = make_world("torch-symm", args.P or dist.get_world_size())
    else:
        world = make_world(args.world, args.P or 4)
    check_world(world, seed=args.seed)
    if args.world == "torch-symm":
        world.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
