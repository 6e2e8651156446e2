"""``xstage`` command line: list platform profiles and run the design-test planner.

    xstage profiles [--json]
    xstage plan fa-a2a  --platform NAME|FILE --seq M --heads H --head-dim D --world P [...]
    xstage plan megamoe --platform NAME|FILE --hidden --intermediate --experts --topk --tokens --world [...]

Bad arguments print one line ``xstage: error: ...`` and exit with code 2.
"""
from __future__ import annotations

import argparse
import json
import sys

from . import planner, profiles

__all__ = ["main"]


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors as one line (no usage dump) with exit code 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        raise _UsageError(message)


def _table(rows: list[tuple[str, str]], title: str) -> str:
    w = max(len(k) for k, _ in rows)
    lines = [title, "-" * len(title)]
    lines += [f"{k.ljust(w)}  {v}" for k, v in rows]
    return "\n".join(lines)


def _us(s: float | None) -> str:
    return "n/a" if s is None else f"{s * 1e6:.3f} us"


def _mib(b: float) -> str:
    return f"{b / 2**20:.3f} MiB"


def _fmt_fa(p: planner.FAPlan) -> str:
    rows = [
        ("platform", p.platform),
        ("shape", f"M={p.seq_len} H={p.heads} d={p.head_dim} P={p.world} B={p.batch} (H/P={p.local_heads} heads per rank)"),
        ("tile", f"b_m={p.tile_m} b_n={p.tile_n}, {p.out_bytes}-byte outputs"),
        ("producers K", f"{p.producers} (aligned worst case)"),
        ("output tiles per rank", f"{p.tiles_per_rank} in {p.burst_waves} burst wave(s)"),
        ("burst volume V", f"{_mib(p.volume_bytes)} ({p.volume_bytes} B)"),
        ("T_iss0", _us(p.t_iss0_s)),
        ("G* (eq. 5)", _us(p.recovery_gap_s)),
        ("V - R*T_iss0 (eq. 6)", f"{_mib(p.peak_outstanding_bytes)} vs Q {_mib(p.capacity_bytes)}"
                                 f" -> {'holds' if p.capacity_ok else 'FAILS'}"),
        ("sigma", _us(p.sigma_s) + " per KV tile" if p.sigma_s else "n/a"),
        ("G_Qloop(M) >= sigma*M/b_n", _us(p.qloop_gap_s)),
        ("M*_ub (eq. 20)", "n/a" if p.m_star_ub is None else f"{p.m_star_ub:.0f} tokens"),
        ("predicted dt(M) (eq. 18)", _us(p.drain_stall_s)),
        ("predicted E_drain(M)", _us(p.drain_residual_s)),
        ("verdict", p.verdict),
    ]
    return _table(rows, "FA-A2A design test") + "\n" + "\n".join(f"  - {r}" for r in p.reasons)


def _fmt_moe(p: planner.MoEPlan) -> str:
    rows = [
        ("platform", p.platform),
        ("shape", f"hidden={p.hidden} inter={p.intermediate} experts={p.experts} top-k={p.topk}"),
        ("tokens", f"{p.tokens_per_rank} per rank, P={p.world}, ~{p.rows_per_expert:.1f} rows per expert"),
        ("tiles", f"b_m={p.block_m} b_n={p.block_n}; per row n1={p.n1} L1, n2={p.n2} L2"),
        ("producers K", f"{p.producers} (aligned worst case)"),
        ("burst volume V", f"{_mib(p.volume_bytes)} (V_t = {p.tile_volume_bytes} B)"),
        ("T_iss0", _us(p.t_iss0_s)),
        ("T_L1^mma / T_L2^mma", f"{_us(p.t_l1_mma_s)} / {_us(p.t_l2_mma_s)} ({p.mma_source})"),
        ("G* (eq. 5)", _us(p.recovery_gap_s)),
        ("expert-wave gap, dT_iss (eq. 9)", f"{_us(p.wave_gap_s)}, {_us(p.wave_overhead_s)}"
                                            f" (rate {p.wave_rate_ratio:.2f}x R)"),
        ("interleaved gap (eq. 12)", _us(p.interleaved_gap_s)),
        ("interleaved dT_iss (eq. 13)", _us(p.interleaved_overhead_s)),
        ("eq. 14", f"{'holds' if p.interleave_sufficient else 'FAILS'} (rate {p.interleaved_rate_ratio:.2f}x R)"),
        ("D_knee (eq. 16)", f"{p.d_knee_rows:.2f} scheduler rows"),
        ("verdict", p.verdict),
    ]
    return _table(rows, "MegaMoE design test") + "\n" + "\n".join(f"  - {r}" for r in p.reasons)


def _build_parser() -> _Parser:
    ap = _Parser(prog="xstage", description="X-Stage Burst-Gap model: profiles and design-test planner")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    pr = sub.add_parser("profiles", help="list shipped platform profiles")
    pr.add_argument("--json", action="store_true")

    plan = sub.add_parser("plan", help="run the design test for a kernel")
    psub = plan.add_subparsers(dest="kernel", required=True, parser_class=_Parser)

    fa = psub.add_parser("fa-a2a", help="FlashAttention + Ulysses post All-to-All (Section 4.3)")
    fa.add_argument("--platform", required=True, help="shipped profile name or JSON file")
    fa.add_argument("--seq", type=int, required=True, help="global sequence length M")
    fa.add_argument("--heads", type=int, required=True, help="total attention heads H")
    fa.add_argument("--head-dim", type=int, required=True)
    fa.add_argument("--world", type=int, required=True, help="Ulysses degree P")
    fa.add_argument("--batch", type=int, default=1)
    fa.add_argument("--tile-m", type=int, default=128)
    fa.add_argument("--tile-n", type=int, default=128, help="KV tile b_n")
    fa.add_argument("--out-bytes", type=int, default=2)
    fa.add_argument("--producers", type=int, default=None, help="aligned producers K (default: num SMs)")
    fa.add_argument("--sigma-us", type=float, default=None, help="Q-loop time per KV tile (default: profile's)")
    fa.add_argument("--json", action="store_true")

    moe = psub.add_parser("megamoe", help="MegaMoE Combine bursts (Section 4.2)")
    moe.add_argument("--platform", required=True)
    moe.add_argument("--hidden", type=int, required=True)
    moe.add_argument("--intermediate", type=int, required=True)
    moe.add_argument("--experts", type=int, required=True)
    moe.add_argument("--topk", type=int, required=True)
    moe.add_argument("--tokens", type=int, required=True, help="tokens per rank")
    moe.add_argument("--world", type=int, required=True, help="expert-parallel degree P")
    moe.add_argument("--block-m", type=int, default=128)
    moe.add_argument("--block-n", type=int, default=128)
    moe.add_argument("--out-bytes", type=int, default=2)
    moe.add_argument("--producers", type=int, default=None)
    moe.add_argument("--t-l1-us", type=float, default=None, help="Linear-1 tile mainloop time")
    moe.add_argument("--t-l2-us", type=float, default=None, help="Linear-2 tile mainloop time")
    moe.add_argument("--dense-tflops", type=float, default=None)
    moe.add_argument("--json", action="store_true")
    return ap


def _run(args) -> str:
    if args.cmd == "profiles":
        rows = []
        for name in profiles.available():
            p = profiles.load(name)
            rows.append({"name": name, "source": p.source, "target": p.target, "gpu": p.gpu,
                         "R_GBps": p.R / 1e9,
                         # T_iss0 at the FA4 worst aligned burst: every SM stores one 32 KiB tile
                         "t_iss0_us": p.t_iss0_at(p.num_sms, p.num_sms * 32768) * 1e6,
                         "Q_MiB": p.q_at(p.num_sms) / 2**20, "num_sms": p.num_sms})
        if args.json:
            return json.dumps(rows, indent=2)
        out = [f"{'name':24} {'source':9} {'R (GB/s)':>9} {'T_iss0@32KiB/SM (us)':>20} {'Q (MiB)':>8}  SMs"]
        out += [f"{r['name']:24} {r['source']:9} {r['R_GBps']:9.1f} {r['t_iss0_us']:20.3f} {r['Q_MiB']:8.3f}"
                f"  {r['num_sms']}" for r in rows]
        return "\n".join(out)
    platform = profiles.load(args.platform)
    if args.kernel == "fa-a2a":
        p = planner.plan_fa_a2a(
            platform, seq_len=args.seq, heads=args.heads, head_dim=args.head_dim, world=args.world,
            batch=args.batch, tile_m=args.tile_m, tile_n=args.tile_n, out_bytes=args.out_bytes,
            producers=args.producers, sigma=None if args.sigma_us is None else args.sigma_us * 1e-6)
        return json.dumps(p.as_dict(), indent=2) if args.json else _fmt_fa(p)
    us = (lambda x: None if x is None else x * 1e-6)
    p = planner.plan_megamoe(
        platform, hidden=args.hidden, intermediate=args.intermediate, experts=args.experts, topk=args.topk,
        tokens=args.tokens, world=args.world, block_m=args.block_m, block_n=args.block_n,
        out_bytes=args.out_bytes, producers=args.producers, t_l1_mma=us(args.t_l1_us), t_l2_mma=us(args.t_l2_us),
        dense_flops=None if args.dense_tflops is None else args.dense_tflops * 1e12)
    return json.dumps(p.as_dict(), indent=2) if args.json else _fmt_moe(p)


def main(argv: list[str] | None = None) -> int:
    try:
        args = _build_parser().parse_args(argv)
        print(_run(args))
    except (_UsageError, ValueError) as e:  # ProfileError is a ValueError
        print(f"xstage: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
