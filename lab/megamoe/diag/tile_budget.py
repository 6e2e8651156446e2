#!/usr/bin/env python
"""Where the fused kernel's time goes, tile by tile: rank 0's per-tile trace (``MegaMoEConfig(trace=True)``)
summarized per phase -- the mainloop's cycles (p10 / p50 / p90, against the tile at the tensor pipe's dense
rate), the waits before the first stage and the staging after the mainloop -- and the shares of the CTAs'
time span (wait, mainloop, staging, the gaps between tiles, head, tail), next to the untraced kernel's times.

    python scripts/diag/megamoe_tile_budget.py --precision w8a8 --P 8 1 [--tokens 8192] [--calls 4] --out DIR
    python scripts/diag/megamoe_tile_budget.py --precision w8a8 --trace TRACE.csv [...] --out DIR   # any host
    XSTAGE_KERNEL_CACHE=DIR python scripts/diag/megamoe_tile_budget.py --precision w8a8 --P 8 1 --compile-only --out X

Run it once per source tree to compare two builds on one host (docs/gpu.md). Writes ``tile_budget.json``
(every number, with provenance) and, on the GPU, rank 0's trace per P as CSV (``lab.megamoe.trace.write_trace``),
which ``--trace`` summarizes again.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

from lab.megamoe.trace import TILE_PARTS, read_trace_records, write_trace
from lab.megamoe.diag import config_options

# dense MMA FLOP per cycle and SM (H100 / H200: 1024 bf16 FMA per cycle and SM, twice that in FP8)
FLOP_PER_CYCLE = {"bf16": 4096, "w8a8": 8192, "w4a8": 8192}  # W4A8: the FP8 WGMMA on widened weights


def ideal_mainloop_cycles(shape, precision: str, block_n: int = 256, block_m: int = 128) -> dict:
    """{1: L1, 2: L2}: a full tile's MMA cycles at the dense rate (K = H for L1, I for L2)."""
    per = FLOP_PER_CYCLE[precision]
    return {1: 2 * block_m * block_n * shape.hidden // per, 2: 2 * block_m * block_n * shape.intermediate // per}


def _quantile(sorted_values, q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def phase_summary(recs, phase: int) -> dict:
    """One phase's tiles (1 = L1, 2 = L2) of decoded trace records (``megamoe_interleave.trace.decode_trace``):
    their count, the mainloop in cycles (p10 / p50 / p90; ``trace_mainloop_cycles``), the median SM clock
    (GHz) over those tiles, and the medians (ns) of the wait before the first stage, the staging after the
    mainloop and the slot wait (mainloop end -> staging slot free). Empty without tiles of that phase."""
    from megamoe_interleave.trace import trace_mainloop_cycles

    rows = [r for cta in recs for r in cta if r["phase"] == phase]
    if not rows:
        return {}
    cyc = [m for m in (trace_mainloop_cycles(r["cycles"], r["t_start"], r["t_ready"], r["t_mainloop"])
                       for r in rows) if m]
    out = {"tiles": len(rows)}
    if cyc:
        ml = sorted(c for _, c in cyc)
        out.update({f"mainloop_cycles_p{int(100 * q)}": round(_quantile(ml, q)) for q in (0.1, 0.5, 0.9)})
        out["clock_ghz_median"] = round(statistics.median(k for k, _ in cyc), 3)
    out["wait_ns_median"] = statistics.median(r["t_ready"] - r["t_start"] for r in rows)
    out["staging_ns_median"] = statistics.median(r["t_epilogue"] - r["t_mainloop"] for r in rows)
    out["slot_ns_median"] = statistics.median(r["t_slot"] - r["t_mainloop"] for r in rows)
    return out


def time_shares(recs) -> dict:
    """Percent of (CTAs x the span from the first tile start to the last tile end) spent waiting for the
    first stage, in mainloops, staging, between tiles (gap), before a CTA's first tile (head) and after its
    last (tail); about 100 in all (a tile may start before the previous one's staging ends: no negative
    gaps). Also the span (ns) and the number of CTAs with tiles."""
    ctas = [cta for cta in recs if cta]
    if not ctas:
        return {}
    t0 = min(cta[0]["t_start"] for cta in ctas)
    t1 = max(cta[-1]["t_epilogue"] for cta in ctas)
    ns = {name: sum(r[b] - r[a] for cta in ctas for r in cta) for name, (a, b) in TILE_PARTS.items()}
    ns["gap"] = sum(max(0, b["t_start"] - a["t_epilogue"]) for cta in ctas for a, b in zip(cta, cta[1:]))
    ns["head"] = sum(cta[0]["t_start"] - t0 for cta in ctas)
    ns["tail"] = sum(t1 - cta[-1]["t_epilogue"] for cta in ctas)
    total = len(ctas) * (t1 - t0)
    return {"ctas": len(ctas), "span_ns": t1 - t0,
            **{f"{name}_pct": round(100 * v / total, 2) if total else 0.0 for name, v in ns.items()}}


def summarize(recs, ideal: dict) -> dict:
    """:func:`phase_summary` of L1 and L2 (with the ideal cycles) and :func:`time_shares` of one trace."""
    return {"L1": {**phase_summary(recs, 1), "ideal_cycles": ideal[1]},
            "L2": {**phase_summary(recs, 2), "ideal_cycles": ideal[2]}, "shares": time_shares(recs)}


def measure(shape_name: str, precision: str, schedule: str, P: int, tokens: int, calls: int, out_dir: str,
            options=None, routing: str = "balanced") -> dict:
    """Untraced, then traced: ``calls`` forwards each of a fused layer at loopback P (``routing``: a
    label of :data:`lab.megamoe.sweep.ROUTINGS`), the fused kernel's times of each, and
    :func:`summarize` of rank 0's trace of the last traced call (``options``: more MegaMoEConfig fields)."""
    import torch

    from lab.megamoe.bench import build_moe, make_problem
    from lab.megamoe.sweep import ROUTINGS
    from megamoe_interleave.config import MegaMoEConfig
    from megamoe_interleave.shapes import get_shape
    from megamoe_interleave.trace import decode_trace

    shape = get_shape(shape_name)
    kind, strength = ROUTINGS[routing]
    w1, w2, xs, idx, wts = make_problem(shape, kind, P, tokens, strength or 1.0)
    out = {}
    for trace in (False, True):
        moe = build_moe(shape, P, tokens, MegaMoEConfig(schedule, precision=precision, trace=trace, **(options or {})),
                        w1, w2)
        us = []
        for _ in range(calls):
            moe.forward(xs, idx, wts)
            torch.cuda.synchronize()
            us.append(round(moe.last_kernel_us, 1))
        out["traced_kernel_us" if trace else "kernel_us"] = us
        if trace:
            recs = decode_trace(moe.last_trace[0])
            write_trace(os.path.join(out_dir, f"trace_{precision}_{schedule}_P{P}.csv"), recs)
            out.update(summarize(recs, ideal_mainloop_cycles(shape, precision, moe.config.block_n)))
            out["config"] = repr(moe.config)
        del moe
        torch.cuda.empty_cache()
    return out


def compile_builds(shape_name: str, precision: str, schedule: str, P: int, tokens: int, options=None) -> None:
    """Compile what :func:`measure` launches (the untraced and the traced layer) on any host, into
    ``XSTAGE_KERNEL_CACHE`` for a GPU run (docs/gpu.md, "Compiling ahead of the GPU host")."""
    from megamoe_interleave import MegaMoE, MegaMoEConfig, make_world
    from megamoe_interleave.shapes import get_shape

    shape = get_shape(shape_name)
    for trace in (False, True):
        config = MegaMoEConfig(schedule, precision=precision, trace=trace, **(options or {}))
        MegaMoE(make_world("loopback", world_size=P, device="cpu"), shape.num_experts, shape.hidden,
                shape.intermediate, shape.topk, tokens, config, backend="fused").compile()


def print_row(P: int, r: dict) -> None:
    s, l1, l2 = r["shares"], r["L1"], r["L2"]
    print(f"P={P}: kernel {statistics.median(r['kernel_us'][1:] or r['kernel_us']):.0f} us (median of calls 2+) | "
          f"L1 mainloop p50 {l1.get('mainloop_cycles_p50')} / {l1['ideal_cycles']} cycles, "
          f"L2 {l2.get('mainloop_cycles_p50')} / {l2['ideal_cycles']} | wait {s['wait_pct']} %, "
          f"mainloop {s['mainloop_pct']} %, staging {s['staging_pct']} %, gap {s['gap_pct']} %, "
          f"head {s['head_pct']} %, tail {s['tail_pct']} %", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--P", type=int, nargs="+", default=[8, 1])
    ap.add_argument("--precision", default="w8a8", choices=["bf16", "w8a8", "w4a8"])
    ap.add_argument("--schedule", default="interleaved", choices=["interleaved", "expert_wave"])
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    ap.add_argument("--calls", type=int, default=4, help="forwards per build (the first includes first-launch costs)")
    ap.add_argument("--shape", default="deepseek-v4-flash")
    ap.add_argument("--routing", default="balanced", choices=["balanced", "skewed1", "skewed2"],
                    help="skewed1 / skewed2: Zipf strength 1 / 2, as the sweep's")
    ap.add_argument("--pair-split", default=None, choices=["m", "n"],
                    help="MegaMoEConfig(pair_split=...); default: resolve's choice")
    ap.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                    help="a MegaMoEConfig field, e.g. stages=4 (repeatable; integers as int)")
    ap.add_argument("--out", required=True, help="directory for tile_budget.json and the trace CSVs")
    ap.add_argument("--trace", nargs="+", default=None, metavar="CSV",
                    help="summarize these trace CSVs instead of running (no GPU needed)")
    ap.add_argument("--compile-only", action="store_true",
                    help="compile the builds into XSTAGE_KERNEL_CACHE and exit (no GPU needed)")
    args = ap.parse_args(argv)
    if args.calls < 2 or args.tokens < 1 or any(p < 1 or p > 8 for p in args.P):
        ap.error("--calls >= 2, --tokens >= 1 and --P in 1..8")
    try:
        options = {"pair_split": args.pair_split, **config_options(args.option)}
        from megamoe_interleave.config import MegaMoEConfig

        MegaMoEConfig(args.schedule, precision=args.precision, **options)  # bad fields fail here, before a launch
    except (TypeError, ValueError) as e:
        ap.error(f"--option: {e}")
    if args.compile_only:
        from xstage.cute_compile import KERNEL_CACHE_ENV, ensure_hopper_target

        if not os.environ.get(KERNEL_CACHE_ENV):
            ap.error(f"--compile-only keeps the kernels for a GPU run: set {KERNEL_CACHE_ENV}")
        ensure_hopper_target()
        for P in args.P:
            compile_builds(args.shape, args.precision, args.schedule, P, args.tokens, options)
            print(f"P={P}: compiled into {os.environ[KERNEL_CACHE_ENV]}", flush=True)
        return
    from xstage import provenance

    runs = {}
    if args.trace:
        from megamoe_interleave.shapes import get_shape

        ideal = ideal_mainloop_cycles(get_shape(args.shape), args.precision)
        for path in args.trace:
            runs[path] = summarize(read_trace_records(path), ideal)
            s = runs[path]
            print(f"{path}: L1 mainloop p50 {s['L1'].get('mainloop_cycles_p50')} / {ideal[1]} cycles, L2 "
                  f"{s['L2'].get('mainloop_cycles_p50')} / {ideal[2]}; " +
                  ", ".join(f"{k[:-4]} {v} %" for k, v in s["shares"].items() if k.endswith("_pct")))
    else:
        import torch

        if not torch.cuda.is_available():
            ap.error("running the kernel needs a CUDA GPU (Hopper); --trace summarizes CSVs anywhere")
    os.makedirs(args.out, exist_ok=True)
    for P in ([] if args.trace else args.P):
        runs[f"P{P}"] = measure(args.shape, args.precision, args.schedule, P, args.tokens, args.calls, args.out,
                                options, args.routing)
        print_row(P, runs[f"P{P}"])
    with open(os.path.join(args.out, "tile_budget.json"), "w") as f:
        json.dump({"what": __doc__.splitlines()[0], "args": vars(args), "runs": runs,
                   "provenance": provenance.collect()}, f, indent=1)


if __name__ == "__main__":
    main()
