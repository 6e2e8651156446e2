#!/usr/bin/env python
"""Benchmark the MoE layer on one GPU (loopback world): fused kernel (both schedulers)
vs the unfused torch pipeline vs the two torch._grouped_mm GEMMs alone.

Per (shape, routing, P, tokens per rank): median per-call time over trials (xstage.timing),
TFLOP/s = 2 * picks * H * I * 3 / t, against the measured dense bf16 matmul rate.
In the loopback/host worlds one "call" runs every simulated rank one after another, so
times are for the whole world (P ranks) on one GPU. The baselines always run on device
memory; ``--world host`` only moves the fused kernel's symmetric buffers to pinned host
memory (Dispatch reads and Combine stores then cross PCIe).

Fused-kernel mainloops (``--mma``, see megamoe_interleave/kernel_sm90.py): ``wgmma``
(single-stage), ``wgmma_cpasync`` (multistage cp.async), ``tma_ws`` (TMA + mbarrier ring +
producer warp + epilogue warps), ``tma_ws_mcast`` (``tma_ws`` with the CTA pair as a 2-CTA
cluster multicasting the shared A tile), ``tma_ws_mcast_b`` (the pair takes two M blocks of
one expert and multicasts the shared B tile, the expert's weights; the default), ``fma``.
Several ``--mma`` values run side by side.
Tile defaults: megamoe_interleave.api.default_tiles (128 x 256, 4 stages for DeepSeek-V4-Flash). "fused[...] api" is the whole
MegaMoE.forward (host planning, input copies, poison, top-k reduction included);
"fused[...] kernels" is the device time of the fused kernels alone (CUDA events around the
back-to-back launches of every rank). ``--api-poison`` picks whether the "api" rows NaN-poison the
Combine slots before each call (MegaMoE(poison_combine=...), the correctness-test setting, default
on): "api" = poison on, "api,no-poison" = poison off (one k*T*H bf16 fill per rank less per call).
Every timed fused variant's output is checked against the unfused pipeline's (the last timed
call of the "api" rows, the first call of the paired comparison): a number only counts for a
kernel that computes the right thing at the benched shape.

    python scripts/bench_megamoe.py --shape deepseek-v4-flash --P 1 8 --tokens 8192 --out results/h200/megamoe
"""
from __future__ import annotations

import argparse
import copy
import csv
import inspect
import itertools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from megamoe_interleave.api import (MegaMoE, decode_trace, default_tiles, make_world,  # noqa: E402
                                    trace_mainloop_cycles)
from megamoe_interleave.reference import grouped_mm, permute_for_rank, unfused_pipeline  # noqa: E402
from megamoe_interleave.routing import make_routing  # noqa: E402
from megamoe_interleave.shapes import get_shape  # noqa: E402
from xstage import paired, provenance, timing  # noqa: E402


def dense_bf16_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = timing.bench(lambda: a @ b, warmup=3, iters=10, trials=5)
    return 2 * n ** 3 / (t.median_us * 1e-6) / 1e12


def add_one_problem_args(ap) -> None:
    """``--shape``, ``--P``, ``--tokens``, ``--schedules`` of the scripts that study one problem
    (megamoe_energy, megamoe_trace_clock): DeepSeek-V4-Flash, loopback P = 8, 8192 tokens."""
    ap.add_argument("--shape", default="deepseek-v4-flash")
    ap.add_argument("--P", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--schedules", nargs="+", default=["expert_wave", "interleaved"],
                    choices=["expert_wave", "interleaved"])


def make_problem(shape, kind, P, tokens, strength=1.0):
    """The benchmark's MoE problem on the GPU: global weights w1 [E, 2I, H], w2 [E, H, I] (seed 0),
    random x and routing (seed = rank) per source rank. Returns (w1, w2, xs, idx, wts)."""
    E, H, I, k = shape.num_experts, shape.hidden, shape.intermediate, shape.topk
    g = torch.Generator().manual_seed(0)
    # One expert at a time (the same numbers as one randn of the whole tensor): a float32
    # w1 of DeepSeek-V4-Pro alone is 68 GB, and the host ran out of memory on it.
    w1 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device="cuda")
    w2 = torch.empty(E, H, I, dtype=torch.bfloat16, device="cuda")
    for w, fan_in in ((w1, H), (w2, I)):
        for e in range(E):
            w[e] = (torch.randn(w.shape[1:], generator=g) / fan_in ** 0.5).bfloat16()
    xs = [torch.randn(tokens, H, device="cuda").bfloat16() for _ in range(P)]
    routes = [make_routing(kind, tokens, E, k, seed=r, strength=strength) for r in range(P)]
    return w1, w2, xs, [r[0].cuda() for r in routes], [r[1].cuda() for r in routes]


def grouped_gemms(shape, P, w1, w2, idx, wts, ranks=None):
    """The two grouped GEMMs alone, per destination rank on pre-permuted (random) inputs: returns
    (the global-weight views each rank's GEMMs use as (w1_t, w2_t), a callable running the GEMMs
    of ``ranks``, default all)."""
    E, H, I = shape.num_experts, shape.hidden, shape.intermediate
    el = E // P
    w1_t = [w1[r * el:(r + 1) * el].transpose(1, 2) for r in range(P)]
    w2_t = [w2[r * el:(r + 1) * el].transpose(1, 2) for r in range(P)]
    ranks = range(P) if ranks is None else ranks
    perms = {d: permute_for_rank(idx, wts, d, el) for d in ranks}
    a1 = {d: torch.randn(p.src_rank.numel(), H, device="cuda").bfloat16() for d, p in perms.items()}
    a2 = {d: torch.randn(p.src_rank.numel(), I, device="cuda").bfloat16() for d, p in perms.items()}

    def run():
        for d, p in perms.items():
            grouped_mm(a1[d], w1_t[d], p.counts)
            grouped_mm(a2[d], w2_t[d], p.counts)
    return (w1_t, w2_t), run


def fused_kwargs(shape, P, tokens, schedule, *, mma="tma_ws_mcast_b", stages=None, block_m=None, block_n=None,
                 **options):
    """MegaMoE kwargs of the fused kernel for ``shape`` at P ranks x ``tokens`` (tiles resolved
    by api.default_tiles, so callers can label variants with them); ``options`` with value None
    are left to the API's defaults. Shared by the bench and the megamoe_* diagnostic scripts."""
    E, H, I, k = shape.num_experts, shape.hidden, shape.intermediate, shape.topk
    bm, bn, stages = default_tiles(mma, H, I, block_m, block_n, stages, rows_per_expert=P * tokens * k / E)
    kw = dict(num_experts=E, hidden=H, intermediate=I, topk=k, max_tokens_per_rank=tokens, schedule=schedule,
              backend="fused", block_m=bm, block_n=bn, mma=mma, stages=stages)
    kw.update({name: v for name, v in options.items() if v is not None})
    return kw


def loopback_moe(kwargs, w1, w2, P, *, world="loopback", poison_combine=False, weight_cache=None, **api_options):
    """A MegaMoE of ``kwargs`` (:func:`fused_kwargs`) on a fresh ``world`` of P ranks on this
    GPU, its weights loaded from ``w1`` / ``w2``; ``api_options`` (e.g. trace=True) go to the
    constructor. The bench's and the diagnostic scripts' one way to build the object they time
    or profile. ``weight_cache`` (a dict per problem): the MegaMoEs of one problem share one
    copy of the kernel-layout weights (12 GB at DeepSeek-V4-Flash, P = 8: one copy per
    variant ran out of memory at 14 variants)."""
    moe = MegaMoE(make_world(world, world_size=P, device="cuda"), poison_combine=poison_combine,
                  **api_options, **kwargs)
    if weight_cache is None or "w" not in weight_cache:
        moe.load_weights(w1, w2)
        if weight_cache is not None:
            weight_cache["w"] = (moe.w1, moe.w2)
    else:
        moe.w1, moe.w2 = (copy.copy(w) for w in weight_cache["w"])
    return moe


def run_case(shape, kind, P, tokens, args, dense):
    H, I = shape.hidden, shape.intermediate
    w1, w2, xs, idx, wts = make_problem(shape, kind, P, tokens, args.strength)
    picks = sum(int((i >= 0).sum()) for i in idx)
    flops = 2 * picks * H * I * 3
    (w1_t, w2_t), gemms_only = grouped_gemms(shape, P, w1, w2, idx, wts)
    rows = []
    refs = []  # the unfused pipeline's y, computed once per case: every timed fused variant is checked

    def reference():
        if not refs:
            refs.extend(unfused_pipeline(xs, idx, wts, w1_t, w2_t))
        return refs

    def record(name, t):
        tf = flops / (t.median_us * 1e-6) / 1e12
        rows.append(dict(shape=shape.name, routing=kind, world=args.world, P=P, tokens_per_rank=tokens, impl=name,
                         median_us=round(t.median_us, 2), p10_us=round(t.p10_us, 2), p90_us=round(t.p90_us, 2),
                         tflops=round(tf, 2), frac_dense=round(tf / dense, 4)))
        print(f"{shape.name:18s} {kind:8s} P={P} T={tokens:6d} {name:24s} {t.median_us:12.1f} us {tf:8.2f} TFLOP/s",
              flush=True)

    if not args.skip_baselines and not args.paired_only:
        record("grouped_mm x2 only", timing.bench(gemms_only, warmup=2, iters=3, trials=args.trials))
        record("unfused torch pipeline", timing.bench(lambda: unfused_pipeline(xs, idx, wts, w1_t, w2_t),
                                                      warmup=1, iters=1, trials=args.trials))

    def moe_kwargs(sched, axes):
        """MegaMoE kwargs of one fused variant: ``axes`` = this variant's value of every
        side-by-side axis (None = the kernel's default)."""
        options = {name: axes[name] for name in VARIANT_AXES if name not in ("mma", "stages")}
        if axes["balance_l2"] is not None:
            options["balance_l2"] = bool(axes["balance_l2"])
        return fused_kwargs(shape, P, tokens, sched, mma=axes["mma"], stages=axes["stages"], block_m=args.block_m,
                            block_n=args.block_n,
                            split_tail={"auto": None, "on": True, "off": False}[args.split_tail], **options)

    def variant_tag(axes):
        """Short names of the axes that were given on the command line (mma and stages are
        spelled out by the callers)."""
        return "".join(f",{short}{axes[name]}" for name, short in VARIANT_TAGS if axes[name] is not None)

    fused_cases = variant_cases({name: getattr(args, name) for name in VARIANT_AXES}, args.schedules)
    fused_cases = [(axes, sched) for axes, sched in fused_cases if kernel_config_ok(H, I, moe_kwargs(sched, axes))]
    if tokens > args.fused_max_tokens:
        print(f"{shape.name}, P={P}, T={tokens}: fused variants skipped (T > --fused-max-tokens "
              f"{args.fused_max_tokens})", file=sys.stderr)
    else:
        for axes, sched in fused_cases:
            kw = moe_kwargs(sched, axes)
            mma = axes["mma"]
            tag = f"{sched},{mma},{kw['block_m']}x{kw['block_n']}" + (
                f",s{kw['stages']}" if mma != "wgmma" and mma != "fma" else "") + (
                f",split_tail={args.split_tail}" if args.split_tail != "auto" else "") + variant_tag(
                dict(axes, stages=None))
            poisons = {"on": [True], "off": [False], "both": [True, False]}[args.api_poison]
            if args.paired_only:
                poisons = []
            for i, poison in enumerate(poisons):
                moe = loopback_moe(kw, w1, w2, P, world=args.world, poison_combine=poison)
                kernel_us = []
                last = []

                def call():
                    last[:] = moe.forward(xs, idx, wts)
                    kernel_us.append(moe.last_kernel_us)

                label = "api" if poison else "api,no-poison"
                record(f"fused[{tag}] {label}", timing.bench(call, warmup=1, iters=1, trials=args.trials))
                check_against(last, reference(), f"fused[{tag}] {label}")  # the last timed call's y
                if i == 0:
                    samples = sorted(kernel_us[1:])
                    record(f"fused[{tag}] kernels", timing.Timing(samples_us=samples))
                del moe
            if args.trace:
                trace_summaries.append(trace_one_call(kw, w1, w2, xs, idx, wts, P, tag, shape, kind,
                                                      tokens, args))
        if args.paired_trials > 0 and not args.skip_baselines:
            fns = {"grouped_mm x2": event_timed(gemms_only)}
            weight_cache = {}
            for axes, sched in fused_cases:
                name = f"fused[{sched},{axes['mma']}{variant_tag(axes)}]"
                fns[name] = fused_kernel_timed(moe_kwargs(sched, axes), w1, w2, xs, idx, wts, P, args.world,
                                               refs=reference(), name=name, weight_cache=weight_cache,
                                               rerun=args.fused_call == "rerun")
            refs.clear()
            samples, clocks = paired_trials(fns, args.paired_trials, args.cooldown_s)
            case = dict(shape=shape.name, routing=kind, world=args.world, P=P, tokens_per_rank=tokens)
            paired_rows.append(dict(case, **paired_verdicts(samples, clocks, "grouped_mm x2", args.clock_tol_mhz)))
            print_paired(paired_rows[-1])
    return rows


paired_rows = []
# Side-by-side axes of the fused kernel (argparse dests, each a list; None = the default) and
# the short names that label a variant when the axis was given.
VARIANT_AXES = ("mma", "dispatch_warps", "stages", "l2_handoffs", "silu", "balance_l2", "lead", "dispatch_copy",
               "dispatch_evict_first", "dispatch_window", "dispatch_keep", "experts_per_wave", "l2_columns")
VARIANT_TAGS = (("dispatch_warps", "dw"), ("stages", "s"), ("l2_handoffs", "l2h"), ("silu", "silu="),
                ("balance_l2", "bal"), ("lead", "D"), ("dispatch_copy", "dc="),
                ("dispatch_evict_first", "ef"), ("dispatch_window", "W"), ("dispatch_keep", "keep"),
                ("experts_per_wave", "epw"), ("l2_columns", "l2col"))
INTERLEAVED_AXES = ("balance_l2", "lead")  # switches of the interleaved schedule only
EXPERT_WAVE_AXES = ("experts_per_wave", "l2_columns")  # of the expert_wave schedule only
MEGAMOE_DEFAULT_SMS = inspect.signature(MegaMoE).parameters["num_sms"].default


def variant_cases(axis_values: dict, schedules) -> list:
    """(axes, schedule) of every fused variant: the product of the side-by-side axes, each
    schedule once per combination of the axes it reads (balance_l2 and lead are
    interleaved-only, experts_per_wave expert_wave-only: the other schedule takes the first
    value's run, with those axes None)."""
    own_axes = {"expert_wave": EXPERT_WAVE_AXES, "interleaved": INTERLEAVED_AXES}
    cases = []
    for combo in itertools.product(*axis_values.values()):
        axes = dict(zip(axis_values, combo))
        for sched in schedules:
            foreign = [name for s, names in own_axes.items() if s != sched for name in names]
            if all(axes[name] in (None, axis_values[name][0]) for name in foreign):
                cases.append((dict(axes, **{name: None for name in foreign}), sched))
    return cases


def kernel_config_ok(hidden, intermediate, kw) -> bool:
    """Whether the fused kernel accepts the variant (the side-by-side axes may combine into a
    configuration that does not fit, e.g. 4 stages with one L2 handoff at 128 x 256): skipped
    with a note instead of aborting the run."""
    from megamoe_interleave.api import DISPATCH_OPTIONS, resolve_dispatch_options
    from megamoe_interleave.kernel_sm90 import MegaMoESm90
    from megamoe_interleave.scheduler import Schedule

    accepted = set(inspect.signature(MegaMoESm90).parameters) - {"hidden", "intermediate", "schedule"}
    kernel_options = {name: value for name, value in kw.items() if name in accepted and name not in DISPATCH_OPTIONS}
    schedule = Schedule(kw["schedule"], lead=1)
    try:  # the Dispatch options resolved as the API resolves them
        kernel_options.update(resolve_dispatch_options(hidden, intermediate, schedule, kernel_options,
                                                       kw.get("num_sms", MEGAMOE_DEFAULT_SMS),
                                                       **{name: kw.get(name) for name in DISPATCH_OPTIONS}))
        MegaMoESm90(hidden, intermediate, schedule, **kernel_options)
    except ValueError as e:
        print(f"skipping {kw['schedule']} {kernel_options}: {e}", flush=True)
        return False
    return True


def event_timed(fn):
    """() -> device time of one call of ``fn`` in us (CUDA events, synchronised)."""
    def timed():
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1e3
    timed()  # warm-up
    return timed


def check_against(ys, refs, name):
    """Every element of the fused output ``ys`` finite and within 2 % of the output's range of
    ``refs`` (the unfused torch pipeline, bf16): a bench number only counts for a kernel that
    computes the right thing at the benched shape."""
    for rank, (y, ref) in enumerate(zip(ys, refs)):
        if not torch.isfinite(y).all():
            raise RuntimeError(f"{name}: rank {rank} output has non-finite values")
        err = (y.float() - ref.float()).abs().max().item()
        scale = ref.float().abs().max().item()
        if err > 0.02 * scale + 1e-3:
            raise RuntimeError(f"{name}: rank {rank} max |fused - unfused| = {err:.4g} (output range {scale:.4g})")


def fused_kernel_timed(kwargs, w1, w2, xs, idx, wts, P, world, refs=None, name="fused", weight_cache=None,
                       rerun=False):
    """() -> device time of the fused kernels of one MegaMoE.forward call (``last_kernel_us``);
    the first call's output is checked against ``refs`` when given; ``weight_cache`` as in
    :func:`loopback_moe`. ``rerun``: each call is ``MegaMoE.rerun()`` (the kernels and the
    reduction on the staged inputs), so the GPU idles no longer before the kernels than before
    the GEMMs (``forward``'s input staging and host planning leave it idle for milliseconds,
    which matters without a cooldown: the idle lets the clock rise at the power cap)."""
    moe = loopback_moe(kwargs, w1, w2, P, world=world, poison_combine=True, weight_cache=weight_cache)
    ys = moe.forward(xs, idx, wts)  # compile + warm-up, NaN-poisoned Combine slots
    if refs is not None:
        check_against(ys, refs, name)
    moe.poison_combine = False

    def timed():
        if rerun:
            moe.rerun()
        else:
            moe.forward(xs, idx, wts)
        return moe.last_kernel_us
    return timed


def paired_trials(fns: dict, trials: int, cooldown_s: float = 0.0):
    """One call of every variant per trial, in an order rotated per trial, the SM clock read
    after each (xstage.paired): (samples_us, clocks) as name -> list per trial."""
    samples = {k: [] for k in fns}
    clocks = {k: [] for k in fns}
    for t in range(trials):
        for k in paired.rotated(list(fns), t):
            if cooldown_s > 0:  # let the GPU leave its power limit before each timed call
                torch.cuda.synchronize()
                time.sleep(cooldown_s)
            samples[k].append(fns[k]())
            clocks[k].append(paired.sm_clock_mhz())
    return samples, clocks


def paired_verdicts(samples: dict, clocks: dict, baseline: str, tol_mhz: float, min_matched: int = 5) -> dict:
    """Every other variant against ``baseline`` on the trials where both ran at the reference
    clock: the median per-trial ratio variant / baseline, the share of trials where the variant
    was not slower, and both one-sided sign tests (``faster``: the variant is faster than the
    baseline; ``slower``: it is slower). "no slower than the baseline" = the median paired
    difference variant - baseline is <= 0."""
    out = {"baseline": baseline, "clock_tol_mhz": tol_mhz, "reference_clock_mhz": paired.reference_clock(clocks),
           "samples_us": samples, "clocks_mhz": clocks, "variants": {}}
    for k in samples:
        if k == baseline:
            continue
        idx = paired.matched_trials(clocks, [k, baseline], tol_mhz)
        ratios = [samples[k][i] / samples[baseline][i] for i in idx]
        diffs = [samples[k][i] - samples[baseline][i] for i in idx]
        v = {"n_matched": len(idx),
             "faster": paired.acceptance(samples, clocks, baseline, k, tol_mhz, min_matched),
             "slower": paired.acceptance(samples, clocks, k, baseline, tol_mhz, min_matched)}
        if idx:
            v.update(median_ratio=statistics.median(ratios), frac_not_slower=sum(d <= 0 for d in diffs) / len(diffs),
                     median_us=statistics.median(samples[k][i] for i in idx),
                     baseline_median_us=statistics.median(samples[baseline][i] for i in idx),
                     no_slower=statistics.median(diffs) <= 0)
        out["variants"][k] = v
    return out


def print_paired(row):
    print(f"paired ({row['shape']}, P={row['P']}, T={row['tokens_per_rank']}; reference clock "
          f"{row['reference_clock_mhz']} MHz, +-{row['clock_tol_mhz']} MHz): variant / {row['baseline']}", flush=True)
    for k, v in row["variants"].items():
        if not v["n_matched"]:
            print(f"  {k:40s} no trial at the reference clock", flush=True)
            continue
        print(f"  {k:40s} {v['median_us']:10.1f} vs {v['baseline_median_us']:10.1f} us  ratio {v['median_ratio']:.3f}  "
              f"not slower in {100 * v['frac_not_slower']:.0f}% of {v['n_matched']}  "
              f"faster: {v['faster']['verdict']}  slower: {v['slower']['verdict']}  "
              f"no_slower={v['no_slower']}", flush=True)


trace_summaries = []


def _median(v):
    v = sorted(v)
    return v[len(v) // 2] if v else float("nan")


def trace_one_call(kwargs, w1, w2, xs, idx, wts, P, tag, shape, kind, tokens, args):
    """One traced call: per-tile timeline of rank 0 to CSV, medians of the spans to the JSON."""
    moe = loopback_moe(kwargs, w1, w2, P, world=args.world, poison_combine=True, trace=True)
    moe.forward(xs, idx, wts)
    recs = decode_trace(moe.last_trace[0])
    t_min = min(r["t_start"] for cta in recs for r in cta)
    variant = "".join(f"_{short.rstrip('=')}{kwargs[name]}" for name, short in VARIANT_TAGS
                      if kwargs.get(name) is not None)
    path = os.path.join(args.out, f"trace{args.tag}_{kwargs['mma']}{variant}_{kwargs['schedule']}_P{P}_T{tokens}.csv")
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["cta", "seq", "phase", "row", "n_block", "t_start_ns", "t_ready_ns", "t_mainloop_ns",
                    "t_epilogue_ns", "smid", "cycles"])
        for c, cta in enumerate(recs):
            for i, r in enumerate(cta):
                w.writerow([c, i, r["phase"], r["row"], r["n_block"], r["t_start"] - t_min, r["t_ready"] - t_min,
                            r["t_mainloop"] - t_min, r["t_epilogue"] - t_min, r["smid"], r["cycles"]])
    summary = dict(shape=shape.name, routing=kind, world=args.world, P=P, tokens_per_rank=tokens, impl=tag, rank=0)
    for phase, name in ((1, "l1"), (2, "l2")):
        rs = [r for cta in recs for r in cta if r["phase"] == phase]
        summary[f"{name}_tiles"] = len(rs)
        summary[f"{name}_wait_ns_median"] = _median([r["t_ready"] - r["t_start"] for r in rs])
        summary[f"{name}_mainloop_ns_median"] = _median([r["t_mainloop"] - r["t_ready"] for r in rs])
        summary[f"{name}_epilogue_ns_median"] = _median([r["t_epilogue"] - r["t_mainloop"] for r in rs])
        summary.update(mainloop_cycles(rs, name))
    summary["span_ns"] = max(r["t_epilogue"] for cta in recs for r in cta) - t_min
    summary.update(cta_budget(recs))
    print("trace", summary, flush=True)
    return summary


def mainloop_cycles(rs, name):
    """Median SM clock and mainloop length in cycles of one phase's tiles
    (api.trace_mainloop_cycles per row); nothing for rows without cycles."""
    spans = [m for m in (trace_mainloop_cycles(r.get("cycles", 0), r["t_start"], r["t_ready"], r["t_mainloop"])
                         for r in rs) if m is not None]
    if not spans:
        return {}
    return {f"{name}_clock_mhz_median": round(_median([1e3 * clock for clock, _ in spans]), 1),
            f"{name}_mainloop_cycles_median": _median([round(cycles) for _, cycles in spans])}


def cta_budget(recs):
    """Where each CTA's time goes (medians over CTAs, ns; consumers' timestamps): ``busy`` from
    its first tile start to its last tile end, split into ``mainloop`` (WGMMA, first stage landed
    -> last WGMMA retired), ``wait`` (tile start -> first stage landed: ring / dependency
    waits), ``staging`` (mainloop end -> handoff done) and ``gap`` (between a tile's end and the
    next one's start: schedule step, trace record); ``tail`` = span - the CTA's end (how long it
    idles while the last CTA finishes), as min / median / max over CTAs."""
    ctas = [cta for cta in recs if cta]
    if not ctas:
        return {}
    t0 = min(cta[0]["t_start"] for cta in ctas)
    end = max(cta[-1]["t_epilogue"] for cta in ctas)
    parts = {"mainloop": ("t_ready", "t_mainloop"), "wait": ("t_start", "t_ready"),
             "staging": ("t_mainloop", "t_epilogue")}
    out = {f"cta_{name}_ns_median": _median([sum(r[b] - r[a] for r in cta) for cta in ctas])
           for name, (a, b) in parts.items()}
    out["cta_busy_ns_median"] = _median([cta[-1]["t_epilogue"] - cta[0]["t_start"] for cta in ctas])
    out["cta_gap_ns_median"] = _median([sum(max(0, b["t_start"] - a["t_epilogue"]) for a, b in zip(cta, cta[1:]))
                                        for cta in ctas])
    out["cta_start_ns_max"] = max(cta[0]["t_start"] for cta in ctas) - t0
    tails = sorted(end - cta[-1]["t_epilogue"] for cta in ctas)
    out.update(cta_tail_ns_min=tails[0], cta_tail_ns_median=_median(tails), cta_tail_ns_max=tails[-1])
    return out


def write_csv(path, rows):
    """Rows (dicts with the same keys) to CSV; nothing is written for no rows (--paired-only
    has no per-variant rows)."""
    if not rows:
        return
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def paired_table(paired):
    """One flat row per (case, variant) of the paired comparison (the JSON keeps the samples)."""
    out = []
    for row in paired:
        for name, v in row["variants"].items():
            out.append(dict(shape=row["shape"], routing=row["routing"], world=row["world"], P=row["P"],
                            tokens_per_rank=row["tokens_per_rank"], variant=name, baseline=row["baseline"],
                            reference_clock_mhz=row["reference_clock_mhz"], n_matched=v["n_matched"],
                            median_us=v.get("median_us"), baseline_median_us=v.get("baseline_median_us"),
                            median_ratio=v.get("median_ratio"), frac_not_slower=v.get("frac_not_slower"),
                            no_slower=v.get("no_slower"), faster=v["faster"]["verdict"],
                            slower=v["slower"]["verdict"]))
    return out


def build_parser() -> argparse.ArgumentParser:
    """The bench's command line (one flag per side-by-side axis of VARIANT_AXES)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", nargs="+", default=["deepseek-v4-flash"])
    ap.add_argument("--world", default="loopback", choices=["loopback", "host"],
                    help="host: symmetric buffers in pinned host memory, so Dispatch reads and Combine "
                         "stores cross PCIe (a real drain-limited remote path on one GPU)")
    ap.add_argument("--routing", nargs="+", default=["balanced"], choices=["balanced", "skewed"])
    ap.add_argument("--strength", type=float, default=1.0)
    ap.add_argument("--P", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--tokens", nargs="+", type=int, default=[8192])
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--fused-max-tokens", type=int, default=8192,
                    help="run the fused variants only up to this many tokens per rank (the baselines run at every "
                         "--tokens); a skip is reported on stderr")
    ap.add_argument("--mma", nargs="+", default=["tma_ws_mcast_b"],
                    choices=["wgmma", "wgmma_cpasync", "fma", "tma_ws", "tma_ws_mcast", "tma_ws_mcast_b"],
                    help="fused-kernel mainloops, benchmarked side by side; tma_ws = TMA + mbarrier ring + producer "
                         "warp + epilogue warps, tma_ws_mcast = the same with the CTA pair as a 2-CTA cluster "
                         "multicasting A, tma_ws_mcast_b = the pair split along M multicasting B")
    ap.add_argument("--dispatch-warps", nargs="+", type=int, default=[None],
                    help="tma_ws*: Dispatch overlapped by 1 or 2 warps, 0 = before a grid barrier; several "
                         "values run side by side (default: the kernel's)")
    ap.add_argument("--l2-handoffs", nargs="+", type=int, default=[None],
                    help="tma_ws*: L2 output staged in 1 or 2 parts, side by side (default: as smem allows)")
    ap.add_argument("--silu", nargs="+", default=[None], choices=["tanh", "exp2"],
                    help="L1 epilogue sigmoid: one tanh.approx or ex2 + rcp, side by side (default: the API's)")
    ap.add_argument("--balance-l2", nargs="+", type=int, default=[None], choices=[0, 1],
                    help="interleaved: balance the pairs' L1/L2 shares (scheduler.balanced_l2_start), side by side "
                         "(default: the API's)")
    ap.add_argument("--lead", nargs="+", type=int, default=[None],
                    help="interleaved: lead D in scheduler rows, side by side (default: ceil(eq. 16))")
    ap.add_argument("--dispatch-copy", nargs="+", default=[None], choices=["lsu", "bulk"],
                    help="fused variants side by side: the dispatch warp's copy (vector loads / stores or bulk copies)")
    ap.add_argument("--dispatch-evict-first", nargs="+", type=int, default=[None], choices=[0, 1],
                    help="bulk Dispatch: L2 evict-first policy on its copies, off / on side by side")
    ap.add_argument("--dispatch-window", nargs="+", type=int, default=[None],
                    help="bulk Dispatch: copy row r once row r - W has a finished L1 tile (0 = unpaced), side by "
                         "side (default: api.default_dispatch_window)")
    ap.add_argument("--l2-columns", nargs="+", type=int, default=[None], choices=[0, 1],
                    help="expert_wave: each expert's L2 tiles column by column, off / on side by side "
                         "(default: on where it applies, api.resolve_l2_columns)")
    ap.add_argument("--dispatch-keep", nargs="+", type=int, default=[None], choices=[0, 1],
                    help="windowed bulk Dispatch: pool rows evict-last, discarded from L2 after their L1 tiles, "
                         "off / on side by side (default: off)")
    ap.add_argument("--experts-per-wave", nargs="+", type=int, default=[None], metavar="N>=1",
                    help="expert_wave: local experts per wave, side by side (default: scheduler.default_experts_per_wave)")
    ap.add_argument("--schedules", nargs="+", default=["expert_wave", "interleaved"],
                    choices=["expert_wave", "interleaved"], help="fused schedules to run (default: both)")
    ap.add_argument("--block-m", type=int, default=None, help="default: api.default_tiles")
    ap.add_argument("--block-n", type=int, default=None, help="default: api.default_tiles")
    ap.add_argument("--stages", nargs="+", type=int, default=[None],
                    help="ring depth(s), several run side by side (default: api.default_tiles)")
    ap.add_argument("--api-poison", default="both", choices=["on", "off", "both"],
                    help="NaN-poison the Combine slots before each timed api call (MegaMoE poison_combine): "
                         "'on' = rows 'api', 'off' = rows 'api,no-poison', 'both' = both rows")
    ap.add_argument("--split-tail", default="auto", choices=["auto", "on", "off"],
                    help="tma_ws* with --block-m 128: run m-blocks of <= 64 rows as 64-row tiles (auto = on)")
    ap.add_argument("--skip-baselines", action="store_true")
    ap.add_argument("--paired-only", action="store_true",
                    help="only the paired fused-vs-grouped comparison (and --trace): no per-variant API timing, "
                         "no unfused pipeline")
    ap.add_argument("--trace", action="store_true", help="also record one per-tile timeline per schedule")
    ap.add_argument("--paired-trials", type=int, default=21,
                    help="paired comparison of the fused kernels with the grouped GEMMs: trials of one call of "
                         "every variant in rotated order, SM clock after each (0 = off)")
    ap.add_argument("--cooldown-s", type=float, default=0.0,
                    help="paired comparison: host sleep before each timed call (clock-stabilised, as bench_fa_a2a)")
    ap.add_argument("--fused-call", default="forward", choices=["forward", "rerun"],
                    help="paired comparison: each fused trial is a whole MegaMoE.forward (its host staging and "
                         "planning idle the GPU before the kernels) or MegaMoE.rerun() (kernels and reduction "
                         "only, the GPU as busy before them as before the GEMMs: for --cooldown-s 0)")
    ap.add_argument("--clock-tol-mhz", type=float, default=30.0,
                    help="paired comparison: trials count when both variants ran this close to the reference clock")
    ap.add_argument("--tag", default="", help="suffix of the output file names")
    ap.add_argument("--out", default="results/h200/megamoe")
    return ap


def main():
    args = build_parser().parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    dense = dense_bf16_tflops()
    print(f"dense bf16 matmul: {dense:.1f} TFLOP/s")
    rows = []
    for name in args.shape:
        for kind in args.routing:
            for P in args.P:
                for T in args.tokens:
                    rows += run_case(get_shape(name), kind, P, T, args, dense)
    write_csv(os.path.join(args.out, f"bench_megamoe{args.tag}.csv"), rows)
    write_csv(os.path.join(args.out, f"bench_megamoe{args.tag}_paired.csv"), paired_table(paired_rows))
    provenance.write_json(os.path.join(args.out, f"bench_megamoe{args.tag}.json"),
                          {"dense_bf16_tflops": dense, "args": vars(args), "rows": rows,
                           "trace_summaries": trace_summaries, "paired": paired_rows})


if __name__ == "__main__":
    main()
