#!/usr/bin/env python
"""Correctness of both kernels in a real multi-GPU world (issue 6, step 4).

The checks of tests/test_fa4_a2a_gpu.py and tests/test_megamoe_gpu.py, run across processes:
every rank generates the *whole* problem (all ranks' inputs, same seeds) so it can compute the
float32 reference of its own output locally, poisons its destination (NaN), synchronizes the
world, runs its own part of the real multi-rank kernel path (peer stores / peer loads over
NVLink), synchronizes again and checks every element of its own output.  Per-case results of
every rank are gathered on rank 0 and written to JSON; the exit status is 1 if any check failed.

fa4_a2a cases: ``attention_a2a`` with the rank's peer table (non-persistent, persistent with
both O stagings, bitwise equal across variants; LSE checked), causal, the full
``ulysses_attention`` API (NCCL pre-A2A + fused post-A2A), and ``fa4_a2a.selfcheck.check_world``
(Serial with the symmetric-memory copy kernel, NCCL baseline) when that module exists.
megamoe cases: the fused kernel with both schedules (bitwise equal) for every ``mma`` kind the
kernel has (``kernel_sm90.MMA_KINDS``; ``--mma`` to choose) on irregular token counts,
zero-token ranks, masked picks, skew (64 x 64 tiles); and one case with every option at the
API's default (``api-defaults``: 128 x 256 tiles, 3 stages, the bulk Dispatch from the peers'
``x`` with its L2 policy and, for expert_wave, its window and the L2 column order) at a size
where those defaults apply (H = 1024, I = 512, 768 rows per local expert at P = 2).

  torchrun --nproc-per-node=8 scripts/multigpu/correctness.py --world torch-symm --out results/h200x8/correctness
  python scripts/multigpu/correctness.py --world loopback --P 4 --out results/h200x1-loopback/correctness
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mgcommon as mg  # noqa: E402

KERNELS = ("fa4", "megamoe")
FA_TOL = {"bf16": 2e-2, "fp16": 4e-3}
MOE_E, MOE_H, MOE_I = 16, 256, 128
# api-defaults case: (H, I, tokens per rank before the per-rank trim, top-k); P * T * k / E rows
# per local expert >= api.DEEP_RING_MAX_ROWS (512) selects the 3-stage tiles and the bulk Dispatch
MOE_DEFAULTS = (1024, 512, 1024, 6)
IRREGULAR = (40, 1, 0, 77, 64, 5, 9, 120)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mg.add_world_args(p, default_out="results/h200xN/correctness", trials=1)
    p.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    p.add_argument("--mma", nargs="+", default=None,
                   help="megamoe fused-kernel variants (default: every MegaMoE mma kind; wgmma with --quick)")
    p.add_argument("--stem", default="correctness")
    return p.parse_args(argv)


def moe_mma_kinds(requested=None, quick: bool = False):
    """The megamoe ``mma`` variants to check: ``requested``, else every kind the kernel knows."""
    if requested:
        return tuple(requested)
    if quick:
        return ("wgmma",)
    try:
        from megamoe_interleave.kernel_sm90 import MMA_KINDS
    except ImportError:
        return ("wgmma", "wgmma_cpasync", "fma")
    return tuple(MMA_KINDS)


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


def moe_cases(P: int, quick: bool = False):
    """(name, tokens per rank [P], top-k, routing, mask ratio, config); config: H, I,
    max_tokens (per rank) and api_defaults (no MegaMoE option given, one run at the default
    mma). MOE_E experts must split over P."""
    if MOE_E % P:
        raise mg.WorldArgsError(f"megamoe correctness uses E={MOE_E} experts: P={P} must divide it")
    small = dict(H=MOE_H, I=MOE_I, max_tokens=256)
    cases = [
        ("irregular-skewed-k8", [IRREGULAR[r % 8] for r in range(P)], 8, "skewed", 0.1, small),
        ("uniform-balanced-k6", [32] * P, 6, "balanced", 0.0, small),
        ("mixed-balanced-k2-masked", [(65, 3, 130, 17)[r % 4] for r in range(P)], 2, "balanced", 0.2, small),
        ("one-source-skewed-k1", [100] + [0] * (P - 1), 1, "skewed", 0.0, small),
    ]
    H, I, T, k = MOE_DEFAULTS
    defaults = ("api-defaults-balanced-k6", [T - 37 * (r % 3) for r in range(P)], k, "balanced", 0.0,
                dict(H=H, I=I, max_tokens=T, api_defaults=True))
    return cases[:2] if quick else cases + [defaults]


def check_close(out, ref, tol_abs: float, tol_rel: float = 0.0) -> dict:
    """Every element finite (poison gone) and within tol_abs + tol_rel*max|ref|. Returns a record."""
    import torch

    o = out.float()
    finite = bool(torch.isfinite(o).all().item()) if o.numel() else True
    err = float((o - ref.float()).abs().max().item()) if o.numel() else 0.0
    lim = tol_abs + tol_rel * (float(ref.abs().max().item()) if ref.numel() else 0.0)
    return {"finite": finite, "max_abs_err": err, "tol": lim, "ok": finite and err <= lim}


def _fa(ctx, quick):
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
                dest = ctx.world.alloc((B, C, Hl * P, D), dtype)
                dest.fill_(float("nan"))
                lses = {}
                ctx.world.barrier()  # every destination poisoned before any peer stores into it
                for r in ctx.local_ranks:
                    lses[r] = (torch.full((B, Hl, C * P), float("nan"), device=dev) if vname == "fused" else None)
                    attention_a2a(qh[r], kh[r], vh[r], dest.local(r), dest.peer_table(r) + r * head_bytes,
                                  num_ranks=P, lse=lses[r], causal=causal, persistent=pers, o_staging=staging)
                ctx.world.barrier()  # peers' stores complete and visible
                for r in ctx.local_ranks:
                    c = check_close(dest.local(r), ref[r], FA_TOL[dts])
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
                    results.append({**rec, "rank": r, **check_close(o, ref[r], FA_TOL[dts])})
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


def _moe(ctx, quick, mmas):
    import torch

    from megamoe_interleave.api import MegaMoE
    from megamoe_interleave.reference import reference_moe_fp32
    from megamoe_interleave.routing import make_routing

    P, dev = ctx.P, ctx.device
    results = []
    for name, tokens, k, kind, mask, cfg in moe_cases(P, quick):
        H, I = cfg["H"], cfg["I"]
        seed = P * 7 + k
        g = torch.Generator().manual_seed(seed)
        w1 = (torch.randn(MOE_E, 2 * I, H, generator=g) / H ** 0.5).bfloat16().to(dev)
        w2 = (torch.randn(MOE_E, H, I, generator=g) / I ** 0.5).bfloat16().to(dev)
        xs = [torch.randn(t, H, generator=g).bfloat16().to(dev) for t in tokens]
        routes = [make_routing(kind, t, MOE_E, k, seed=seed * 31 + r, mask_ratio=mask, strength=2.0)
                  for r, t in enumerate(tokens)]
        idx = [r_[0].to(dev) for r_ in routes]
        wts = [r_[1].to(dev) for r_ in routes]
        refs = reference_moe_fp32(xs, idx, wts, w1, w2)
        # the api-defaults case runs the API's default mma once, with no option given
        for mma in ("defaults",) if cfg.get("api_defaults") else mmas:
            outs = {}
            for sched in ("expert_wave", "interleaved"):
                rec = {"kernel": "megamoe", "case": name, "variant": f"{sched},{mma}", "P": P, "tokens": tokens,
                       "topk": k, "routing": kind, "mask": mask}
                try:
                    options = {} if cfg.get("api_defaults") else dict(lead=2, block_m=64, block_n=64,
                                                                      experts_per_wave=2, mma=mma)
                    moe = MegaMoE(ctx.world, num_experts=MOE_E, hidden=H, intermediate=I, topk=k,
                                  max_tokens_per_rank=cfg["max_tokens"], schedule=sched, backend="fused", **options)
                    if cfg.get("api_defaults"):
                        opts = moe.kernel_options
                        rec["kernel_options"] = {key: opts[key] for key in (
                            "block_m", "block_n", "stages", "mma", "dispatch_copy", "dispatch_evict_first",
                            "dispatch_window")}
                        rec["kernel_options"]["l2_columns"] = moe.schedule.l2_columns
                    moe.load_weights(w1, w2)
                    if ctx.backend == "loopback":
                        ys = moe.forward(xs, idx, wts)
                    else:
                        ys = moe.forward(xs[ctx.rank], idx[ctx.rank], wts[ctx.rank])
                    for r, y in zip(ctx.local_ranks, ys):
                        c = check_close(y, refs[r], 0.02, 0.02)
                        c["shape_ok"] = tuple(y.shape) == tuple(refs[r].shape)
                        c["ok"] = c["ok"] and c["shape_ok"]
                        outs.setdefault(sched, {})[r] = y.clone()
                        if sched == "interleaved" and "expert_wave" in outs:
                            c["bitwise_equal_to_expert_wave"] = bool(torch.equal(outs["expert_wave"][r], y))
                            c["ok"] = c["ok"] and c["bitwise_equal_to_expert_wave"]
                        results.append({**rec, "rank": r, **c})
                    del moe
                except Exception as e:
                    results.append({**rec, "rank": ctx.rank, "ok": False, "error": f"{type(e).__name__}: {e}",
                                    "traceback": traceback.format_exc()})
    return results


def save_partial(out_dir, stem: str, rank: int, records) -> Path:
    """Append this rank's records to ``out_dir/ranks/<stem>-rank<r>.jsonl`` (one JSON per line)."""
    import json

    path = Path(out_dir) / "ranks" / f"{stem}-rank{rank}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r, default=str) + "\n")
    return path


def summarize(results) -> dict:
    """Counts of passed/failed checks per kernel. Pure."""
    out = {}
    for r in results:
        d = out.setdefault(r["kernel"], {"checks": 0, "passed": 0, "failed": []})
        d["checks"] += 1
        if r.get("ok"):
            d["passed"] += 1
        else:
            d["failed"].append({k: r.get(k) for k in ("case", "variant", "rank", "max_abs_err", "error")})
    out["all_ok"] = all(not d["failed"] for k, d in out.items() if isinstance(d, dict)) and bool(results)
    return out


def _run(ctx, args) -> int:
    t0 = time.time()
    results = []
    mmas = moe_mma_kinds(args.mma, args.quick)
    for kname, fn in (("fa4", _fa), ("megamoe", lambda c, q: _moe(c, q, mmas))):
        if kname in args.kernels:
            part = fn(ctx, args.quick)
            results += part
            save_partial(args.out, args.stem, ctx.rank, part)  # survives a later hang or kill
    gathered = ctx.gather(results)
    ok = False
    if ctx.is_root:
        allres = [r for part in gathered for r in part]
        summ = summarize(allres)
        payload = {**mg.header(ctx, "correctness", args), "summary": summ, "results": allres,
                   "seconds": time.time() - t0}
        flat = [{k: v for k, v in r.items() if k != "traceback" and not isinstance(v, (list, dict))}
                for r in allres]
        path = mg.write_result(args.out, args.stem, payload, flat)
        for kname in args.kernels:
            d = summ.get(kname, {"checks": 0, "passed": 0, "failed": []})
            print(f"{kname}: {d['passed']}/{d['checks']} checks passed")
            for f in d["failed"][:20]:
                print(f"  FAILED {f}")
        print(f"wrote {path}")
        ok = summ["all_ok"]
    return 0 if ctx.from_root(ok) else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    return mg.run_entry(args, lambda ctx: _run(ctx, args))


if __name__ == "__main__":
    sys.exit(main())
