"""fa4_a2a correctness in a real multi-GPU world (issue 6, step 4; ``scripts/multigpu/correctness.py``).

The checks of tests/test_fa4_a2a_gpu.py across processes: every rank generates the *whole*
problem (all ranks' inputs, same seeds) so it can compute the float32 reference of its own
output locally, poisons its destination (NaN), synchronizes the world, runs its own part of the
real multi-rank kernel path (peer stores over NVLink), synchronizes again and checks every
element of its own output. Cases: ``attention_a2a`` with the rank's peer table (non-persistent,
persistent with both O stagings, bitwise equal across variants; LSE checked), causal, the full
``ulysses_attention`` API (NCCL pre-A2A + fused post-A2A), and ``fa4_a2a.selfcheck.check_world``
(Serial with the symmetric-memory copy kernel, NCCL baseline) when that module exists.
"""
from __future__ import annotations

import traceback

from lab import multigpu as mg

FA_TOL = {"bf16": 2e-2, "fp16": 4e-3}


def fa_cases(P: int, quick: bool = False):
    """(name, B, C rows per rank, Hl, D, dtype, causal) for a world of P ranks (mirrors the loopback tests)."""
    cases = [
        ("bf16-d128", 1, 300, 2, 128, "bf16", False),
        ("fp16-d64-straddle", 1, 200, 2, 64, "fp16", False),  # S/P not a multiple of tile_m
        ("bf16-b2-d64", 2, 96, 3, 64, "bf16", False),
        ("bf16-many-tiles", 2, 1500 // max(1, P // 4), 2, 128, "bf16", False),
        ("bf16-causal", 1, 160, 2, 128, "bf16", True),
    ]
    return cases[:2] if quick else cases


def run_checks(ctx, quick: bool = False) -> list:
    """Every case of :func:`fa_cases` on this process's ranks of ``ctx`` (an
    :class:`lab.multigpu.Ctx`): one record per (case, variant, rank), ``ok`` on a pass; an
    exception is recorded as a failed check and the next case runs (the other ranks do the same)."""
    import torch

    from fa4_a2a import UlyssesWorkspace, attention_a2a, ulysses_attention
    from fa4_a2a.reference import attention_fp32, seq_to_head_shards, ulysses_reference

    P, dev = ctx.P, ctx.device
    results = []
    for name, B, C, Hl, D, dts, causal in fa_cases(P, quick):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dts]
        g = torch.Generator(device=dev).manual_seed(P * 1000 + C)
        mk = lambda: [torch.randn(B, C, Hl * P, D, generator=g, device=dev).to(dtype) for _ in range(P)]  # noqa: E731
        qs, ks, vs = mk(), mk(), mk()
        ref = ulysses_reference(qs, ks, vs, causal=causal)
        qh, kh, vh = seq_to_head_shards(qs), seq_to_head_shards(ks), seq_to_head_shards(vs)
        head_bytes = Hl * D * qs[0].element_size()
        variants = [("fused", False, "own")] if causal else [
            ("fused", False, "own"), ("fused_pers", True, "own"), ("fused_pers_dq", True, "defer_q")]
        outs = {}
        for vname, pers, staging in variants:
            rec = {"kernel": "fa4", "case": name, "variant": vname, "P": P, "B": B, "C": C, "Hl": Hl, "D": D,
                   "dtype": dts, "causal": causal}
            try:
                dest = ctx.world.alloc((B, C, Hl * P, D), dtype, remote=True)
                dest.fill_(float("nan"))
                lses = {}
                ctx.world.barrier()  # every destination poisoned before any peer stores into it
                for r in ctx.local_ranks:
                    lses[r] = (torch.full((B, Hl, C * P), float("nan"), device=dev) if vname == "fused" else None)
                    attention_a2a(qh[r], kh[r], vh[r], dest.local(r), dest.peer_table(r) + r * head_bytes,
                                  num_ranks=P, lse=lses[r], causal=causal, persistent=pers, o_staging=staging)
                ctx.world.barrier()  # peers' stores complete and visible
                for r in ctx.local_ranks:
                    c = mg.check_close(dest.local(r), ref[r], FA_TOL[dts])
                    if lses[r] is not None:
                        _, lse_ref = attention_fp32(qh[r], kh[r], vh[r], causal=causal)
                        lerr = float((lses[r] - lse_ref).abs().max().item())
                        c.update(lse_max_abs_err=lerr, ok=c["ok"] and lerr < 2e-3)
                    outs.setdefault(vname, {})[r] = dest.local(r).clone()
                    if vname != "fused" and "fused" in outs:
                        c["bitwise_equal_to_fused"] = bool(torch.equal(outs["fused"][r], outs[vname][r]))
                        c["ok"] = c["ok"] and c["bitwise_equal_to_fused"]
                    results.append({**rec, "rank": r, **c})
                del dest
            except Exception as e:  # record, keep going (the other ranks do the same case)
                results.append({**rec, "rank": ctx.rank, "ok": False, "error": f"{type(e).__name__}: {e}",
                                "traceback": traceback.format_exc()})
        # The user-facing API: NCCL pre-A2A (torch-symm) / in-process shards (loopback), fused post-A2A.
        if not causal:
            rec = {"kernel": "fa4", "case": name, "variant": "ulysses_attention", "P": P, "B": B, "C": C, "Hl": Hl,
                   "D": D, "dtype": dts, "causal": False}
            try:
                ws = UlyssesWorkspace(ctx.world, (B, C, Hl * P, D), dtype)
                ws.dest.fill_(float("nan"))
                ctx.world.barrier()
                if ctx.backend == "loopback":
                    got = ulysses_attention(qs, ks, vs, ctx.world, workspace=ws)
                else:
                    got = [ulysses_attention(qs[ctx.rank], ks[ctx.rank], vs[ctx.rank], ctx.world, workspace=ws)]
                ctx.world.barrier()
                for r, o in zip(ctx.local_ranks, got):
                    results.append({**rec, "rank": r, **mg.check_close(o, ref[r], FA_TOL[dts])})
            except Exception as e:
                results.append({**rec, "rank": ctx.rank, "ok": False, "error": f"{type(e).__name__}: {e}",
                                "traceback": traceback.format_exc()})
    # The fa4_a2a owner's self-check (ulysses_attention, Serial (symm) with the a2a_symm copy
    # kernel, fused == Serial (symm) bitwise, NCCL baseline), where that module exists.
    rec = {"kernel": "fa4", "case": "fa4_a2a.selfcheck", "variant": "check_world", "P": P}
    try:
        from fa4_a2a.selfcheck import check_world
    except ImportError:
        check_world = None
    if check_world is not None:
        try:
            out = check_world(ctx.world, verbose=False)
            results.append({**rec, "rank": ctx.rank, "ok": True, "max_abs_err": out.get("max_err"),
                            "n_checks": len(out.get("checks", []))})
        except Exception as e:  # AssertionError on a mismatch
            results.append({**rec, "rank": ctx.rank, "ok": False, "error": f"{type(e).__name__}: {e}",
                            "traceback": traceback.format_exc()})
    return results
