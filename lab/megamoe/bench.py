"""Benchmark of the MoE layer on one GPU (loopback world): the fused kernel (both schedules,
side-by-side :class:`~megamoe_interleave.config.MegaMoEConfig` variants) vs the unfused torch
pipeline vs the two torch._grouped_mm GEMMs alone. The library part of
``scripts/bench_megamoe.py`` (its command line: :func:`build_parser`, :func:`main`; also
``python -m lab.megamoe.bench``); the paired trials, verdicts and result files are
:mod:`lab.bench`'s. The megamoe diagnostics (scripts/diag/megamoe_*.py) build their problems
and objects here too (:func:`make_problem`, :func:`grouped_gemms`, :func:`build_moe`), and so does
the X-Stage sweep (:mod:`lab.megamoe.sweep`: :func:`make_weights`, :func:`make_inputs`,
:func:`warmed_moe`, :func:`kernel_time_call`).

Per (shape, routing, P, tokens per rank): median per-call time over trials (lab.timing),
TFLOP/s = 2 * picks * H * I * 3 / t, against the measured dense bf16 matmul rate.
In the loopback/host worlds one "call" runs every simulated rank one after another, so
times are for the whole world (P ranks) on one GPU. The baselines always run on device
memory; ``--world host`` only moves the fused kernel's symmetric buffers to pinned host
memory (Dispatch reads and Combine stores then cross PCIe).

Fused variants: every schedule of ``--schedules`` x every value of the MegaMoEConfig axes
``--lead``, ``--experts-per-wave``, ``--block-n``, ``--stages``, ``--dispatch-copy``,
``--dispatch-window``, ``--l2-columns`` (several values run side by side; an axis left out is
None: the tuned default that :meth:`MegaMoEConfig.resolve` fills in). An axis of one schedule
(lead: interleaved; experts_per_wave, l2_columns: expert_wave) multiplies that schedule's runs
only. A variant that does not resolve (e.g. 4 stages with the bulk Dispatch at 128 x 256 tiles:
its bounce buffers do not fit next to the ring) is skipped with a note. The JSON records every
variant's resolved config (``variants``). Variant names: ``fused[<schedule><,axis value...>]``
in the paired rows (``,s4`` = stages 4, ``,dc=lsu``, ``,W5``, ``,D3`` = lead, ``,epw8``,
``,n128`` = block_n, ``,l2col0``); the timing rows spell the resolved tile and ring depth too.

"fused[...] api" is the whole MegaMoE.forward (host planning, input copies, poison, top-k
reduction included); "fused[...] kernels" is the device time of the fused kernels alone (CUDA
events around the back-to-back launches of every rank). ``--api-poison`` picks whether the
"api" rows NaN-poison the Combine slots before each call (MegaMoE(poison_combine=...), the
correctness-test setting, default on): "api" = poison on, "api,no-poison" = poison off (one
k*T*H bf16 fill per rank less per call). Every timed fused variant's output is checked against
the unfused pipeline's (the last timed call of the "api" rows, the first call of the paired
comparison): a number only counts for a kernel that computes the right thing at the benched shape.

    python scripts/bench_megamoe.py --shape deepseek-v4-flash --P 1 8 --tokens 8192
    python scripts/bench_megamoe.py --P 8 --stages 3 4 --dispatch-copy lsu bulk --paired-only --tag _ring
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import os
import sys

import torch

from lab import bench, timing
from lab.megamoe.trace import TILE_PARTS, write_trace
from megamoe_interleave.api import MegaMoE, make_world
from megamoe_interleave.trace import decode_trace, trace_mainloop_cycles
from megamoe_interleave.config import BLOCK_M, BLOCK_NS, DISPATCH_COPIES, MegaMoEConfig
from megamoe_interleave.reference import grouped_mm, permute_for_rank, unfused_pipeline
from lab.megamoe.routing import make_routing
from megamoe_interleave.scheduler import SCHEDULES
from megamoe_interleave.shapes import get_shape

DEFAULT_OUT = "results/h200/megamoe/runs"
BASELINE = "grouped_mm x2"  # the paired comparison's baseline
# Side-by-side axes of the fused variants: MegaMoEConfig fields (argparse dests, each a list;
# None = the resolved default) and the short names that label a variant where the axis was given.
VARIANT_AXES = ("lead", "experts_per_wave", "block_n", "stages", "dispatch_copy", "dispatch_window", "l2_columns")
VARIANT_TAGS = {"lead": "D", "experts_per_wave": "epw", "block_n": "n", "stages": "s", "dispatch_copy": "dc=",
                "dispatch_window": "W", "l2_columns": "l2col"}
SCHEDULE_AXES = {"interleaved": ("lead",), "expert_wave": ("experts_per_wave", "l2_columns")}  # one schedule's own


# ----------------------------------------------------------------------------- the problem


def dense_bf16_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = timing.bench(lambda: a @ b, warmup=3, iters=10, trials=5)
    return 2 * n ** 3 / (t.median_us * 1e-6) / 1e12


def add_one_problem_args(ap) -> None:
    """``--shape``, ``--P``, ``--tokens``, ``--schedules`` of the diagnostics that study one
    problem (scripts/diag/megamoe_energy.py, megamoe_trace_clock.py): DeepSeek-V4-Flash, loopback
    P = 8, 8192 tokens."""
    ap.add_argument("--shape", default="deepseek-v4-flash")
    ap.add_argument("--P", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)


def make_weights(shape, *, device="cuda", rng="cpu", seed=0):
    """Global weights w1 [E, 2I, H], w2 [E, H, I] (bf16 on ``device``), N(0, 1/fan_in), one
    expert at a time (the same numbers as one randn of the whole tensor: a float32 w1 of
    DeepSeek-V4-Pro alone is 68 GB, and the host ran out of memory on it). ``rng="cpu"``: a CPU
    generator seeded ``seed`` (make_problem's numbers); ``rng="cuda"``: a CUDA generator seeded
    ``seed`` on ``device`` (other numbers of the same distribution; seconds instead of minutes
    for the big shapes: DeepSeek-V4-Pro's 25 G elements take minutes on one CPU core)."""
    if rng not in ("cpu", "cuda"):
        raise ValueError(f"rng must be 'cpu' or 'cuda', got {rng!r}")
    if rng == "cuda" and torch.device(device).type != "cuda":
        raise ValueError(f"rng='cuda' needs a CUDA device, got {device!r}")
    E, H, I = shape.num_experts, shape.hidden, shape.intermediate
    g = torch.Generator(device=device if rng == "cuda" else "cpu").manual_seed(seed)
    w1 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device=device)
    w2 = torch.empty(E, H, I, dtype=torch.bfloat16, device=device)
    for w, fan_in in ((w1, H), (w2, I)):
        for e in range(E):
            w[e] = (torch.randn(w.shape[1:], generator=g, device=g.device) / fan_in ** 0.5).bfloat16()
    return w1, w2


def make_inputs(shape, kind, P, tokens, strength=1.0):
    """Random x (on the GPU) and routing (seed = rank, ``make_routing(kind, ..., strength=...)``)
    per source rank: (xs, idx, wts), lists of P tensors on the GPU."""
    xs = [torch.randn(tokens, shape.hidden, device="cuda").bfloat16() for _ in range(P)]
    routes = [make_routing(kind, tokens, shape.num_experts, shape.topk, seed=r, strength=strength) for r in range(P)]
    return xs, [r[0].cuda() for r in routes], [r[1].cuda() for r in routes]


def make_problem(shape, kind, P, tokens, strength=1.0):
    """The benchmark's MoE problem on the GPU: global weights w1 [E, 2I, H], w2 [E, H, I] (seed 0,
    :func:`make_weights`), random x and routing (seed = rank) per source rank
    (:func:`make_inputs`). Returns (w1, w2, xs, idx, wts)."""
    return (*make_weights(shape), *make_inputs(shape, kind, P, tokens, strength))


def reference_weights(precision, w1, w2):
    """The global weights the unfused reference pipeline should use for a layer of ``precision`` built
    from ``w1`` / ``w2``: W4A8's dequantized FP4 weights in BF16 (its error against the BF16 weights is
    the FP4 format's own, not the kernel's), else the weights themselves."""
    if precision != "w4a8":
        return w1, w2
    from megamoe_interleave import quant_fp4

    return tuple(t.bfloat16() for t in quant_fp4.dequantize_weights(*quant_fp4.quantize_weights(w1, w2)))


def rank_weight_views(shape, P, w1, w2):
    """Each destination rank's slice of the global weights as the grouped GEMMs (and the
    unfused pipeline) take them: (w1_t, w2_t), lists of P views [E/P, H, 2I] and [E/P, I, H]."""
    el = shape.num_experts // P
    return ([w1[r * el:(r + 1) * el].transpose(1, 2) for r in range(P)],
            [w2[r * el:(r + 1) * el].transpose(1, 2) for r in range(P)])


def grouped_gemms(shape, P, w1, w2, idx, wts, ranks=None):
    """The two grouped GEMMs alone, per destination rank on pre-permuted (random) inputs: returns
    (the global-weight views each rank's GEMMs use as (w1_t, w2_t), a callable running the GEMMs
    of ``ranks``, default all)."""
    H, I = shape.hidden, shape.intermediate
    el = shape.num_experts // P
    w1_t, w2_t = rank_weight_views(shape, P, w1, w2)
    ranks = range(P) if ranks is None else ranks
    perms = {d: permute_for_rank(idx, wts, d, el) for d in ranks}
    a1 = {d: torch.randn(p.src_rank.numel(), H, device=w1.device).bfloat16() for d, p in perms.items()}
    a2 = {d: torch.randn(p.src_rank.numel(), I, device=w1.device).bfloat16() for d, p in perms.items()}

    def run():
        for d, p in perms.items():
            grouped_mm(a1[d], w1_t[d], p.counts)
            grouped_mm(a2[d], w2_t[d], p.counts)
    return (w1_t, w2_t), run


# ----------------------------------------------------------------------------- the fused layer


def add_problem_arguments(ap, *, tokens) -> None:
    """The problem's command-line options shared by the MegaMoE benches: --shape, --routing,
    --strength (skewed routing's Zipf exponent), --P, --tokens (per rank; default ``tokens``)."""
    ap.add_argument("--shape", nargs="+", default=["deepseek-v4-flash"])
    ap.add_argument("--routing", nargs="+", default=["balanced"])
    ap.add_argument("--strength", type=float, default=1.0)
    ap.add_argument("--P", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, nargs="+", default=list(tokens))


def add_output_arguments(ap, *, out: str, figure: str) -> None:
    """The result options shared by the MegaMoE benches: --clock-tol-mhz (paired matching),
    --out (default ``out``), --tag, --report (no GPU run: summary.csv and ``figure`` in --out)."""
    ap.add_argument("--clock-tol-mhz", type=float, default=30.0)
    ap.add_argument("--out", default=out)
    ap.add_argument("--tag", default="")
    ap.add_argument("--report", nargs="+", metavar="JSON",
                    help=f"no GPU run: summary.csv and {figure} in --out from these result files")


def report_or_gpu_run(args, report) -> bool:
    """The start of a bench's ``main`` with :func:`add_output_arguments`: with --report, print the
    rows ``report(args.report, args.out)`` writes and return False (no GPU run); else exit unless
    a CUDA GPU is present, create --out and return True."""
    if args.report:
        for row in report(args.report, args.out):
            print(row)
        return False
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    return True


def problem_cases(args) -> list:
    """(shape, routing, P, tokens per rank) of every case the options of
    :func:`add_problem_arguments` select, shape-major."""
    return [(get_shape(s), kind, P, T) for s in args.shape for kind in args.routing for P in args.P
            for T in args.tokens]


def build_moe(shape, P, tokens, config, w1, w2, *, world="loopback", poison_combine=False, weight_cache=None,
              moe_class=MegaMoE):
    """A fused MegaMoE of ``shape`` on a fresh ``world`` of P ranks on this GPU, ``tokens`` tokens
    per rank at most, ``config`` a :class:`MegaMoEConfig` (None = every default; MegaMoE resolves
    it: ``moe.config``), its weights loaded from ``w1`` / ``w2``. The bench's and the diagnostics'
    one way to build the object they time or profile (``moe_class``: a MegaMoE subclass, e.g.
    :class:`lab.megamoe.diag.no_dispatch_copy.NoDispatchCopyMoE`). ``weight_cache`` (a dict per problem):
    the MegaMoEs of one problem share one copy of the kernel-layout weights (12 GB at
    DeepSeek-V4-Flash, P = 8: one copy per variant ran out of memory at 14 variants)."""
    moe = moe_class(make_world(world, world_size=P, device="cuda"), shape.num_experts, shape.hidden,
                    shape.intermediate, shape.topk, tokens, config, backend="fused", poison_combine=poison_combine)
    if weight_cache is None or "w" not in weight_cache:
        moe.load_weights(w1, w2)
        if weight_cache is not None:  # W8A8: the block scales too; W4A8: its kernel operands
            weight_cache["w"] = (moe.w1, moe.w2, moe.w1_scales, moe.w2_scales, moe.fp4_operands)
    else:
        moe.w1, moe.w2, moe.w1_scales, moe.w2_scales, moe.fp4_operands = (copy.copy(w) for w in weight_cache["w"])
    return moe


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


def check_w8a8_against(ys, refs, name, precision="w8a8"):
    """:func:`check_against` for an FP8 output: every element finite, and per rank the relative
    error against ``refs`` (the unfused BF16 pipeline; W4A8: on the dequantized FP4 weights,
    :func:`reference_weights`) within the recipe's own bound (reference.W8A8_FP32_REL_ERROR's or
    W4A8_FP32_REL_ERROR's upper end) plus the kernel's tolerance against its emulation
    (W8A8_KERNEL_REL_ERROR): an elementwise bound on a BF16 reference would reject the recipe's
    E4M3 rounding itself."""
    from megamoe_interleave.reference import (W4A8_FP32_REL_ERROR, W8A8_FP32_REL_ERROR, W8A8_KERNEL_REL_ERROR,
                                              relative_error)

    bound = (W4A8_FP32_REL_ERROR if precision == "w4a8" else W8A8_FP32_REL_ERROR)[1] + W8A8_KERNEL_REL_ERROR
    for rank, (y, ref) in enumerate(zip(ys, refs)):
        if not torch.isfinite(y).all():
            raise RuntimeError(f"{name}: rank {rank} output has non-finite values")
        if y.numel() and relative_error(y, ref) > bound:
            raise RuntimeError(f"{name}: rank {rank} relative error {relative_error(y, ref):.4f} against the "
                               f"BF16 pipeline > {bound:.4f}")


def warmed_moe(shape, P, tokens, config, w1, w2, xs, idx, wts, *, world="loopback", refs=None, name="fused",
               weight_cache=None):
    """:func:`build_moe` (Combine slots NaN-poisoned) after its first ``forward`` (compile and
    warm-up), whose output is checked against ``refs`` (the unfused pipeline's y) when given;
    poison off for the calls that follow (timed calls, ``rerun``)."""
    moe = build_moe(shape, P, tokens, config, w1, w2, world=world, poison_combine=True, weight_cache=weight_cache)
    ys = moe.forward(xs, idx, wts)  # compile + warm-up, NaN-poisoned Combine slots
    if refs is not None:
        if moe.config.fp8:
            check_w8a8_against(ys, refs, name, moe.config.precision)
        else:
            check_against(ys, refs, name)
    moe.poison_combine = False
    return moe


def kernel_time_call(moe, xs=None, idx=None, wts=None, *, rerun=False):
    """() -> device time in us of the fused kernels of one call of ``moe`` (``last_kernel_us``):
    ``moe.rerun()`` when ``rerun`` (the kernels and the reduction on the staged inputs), else a
    whole ``moe.forward(xs, idx, wts)``."""
    def timed():
        if rerun:
            moe.rerun()
        else:
            moe.forward(xs, idx, wts)
        return moe.last_kernel_us
    return timed


def fused_kernel_timed(shape, P, tokens, config, w1, w2, xs, idx, wts, *, world="loopback", refs=None, name="fused",
                       weight_cache=None, rerun=False):
    """() -> device time of the fused kernels of one MegaMoE.forward call (``last_kernel_us``);
    the first call's output is checked against ``refs`` when given; ``weight_cache`` as in
    :func:`build_moe`. ``rerun``: each call is ``MegaMoE.rerun()`` (the kernels and the
    reduction on the staged inputs), so the GPU idles no longer before the kernels than before
    the GEMMs (``forward``'s input staging and host planning leave it idle for milliseconds,
    which matters without a cooldown: the idle lets the clock rise at the power cap)."""
    moe = warmed_moe(shape, P, tokens, config, w1, w2, xs, idx, wts, world=world, refs=refs, name=name,
                     weight_cache=weight_cache)
    return kernel_time_call(moe, xs, idx, wts, rerun=rerun)


# ----------------------------------------------------------------------------- variants


def variant_cases(axis_values: dict, schedules) -> list:
    """(axes, schedule) of every fused variant: the product of the side-by-side axes, each
    schedule once per combination of the axes it reads (lead is interleaved-only,
    experts_per_wave and l2_columns expert_wave-only: the other schedule takes the first
    value's run, with those axes None)."""
    cases = []
    for combo in itertools.product(*axis_values.values()):
        axes = dict(zip(axis_values, combo))
        for sched in schedules:
            foreign = [name for s, names in SCHEDULE_AXES.items() if s != sched for name in names if name in axes]
            if all(axes[name] in (None, axis_values[name][0]) for name in foreign):
                cases.append((dict(axes, **{name: None for name in foreign}), sched))
    return cases


def variant_tag(axes, skip=()) -> str:
    """``,<short><value>`` of every axis given (not None), in VARIANT_AXES order."""
    return "".join(f",{VARIANT_TAGS[name]}{axes[name]}" for name in VARIANT_AXES
                   if name not in skip and axes.get(name) is not None)


def variant_name(schedule, axes) -> str:
    """The variant's name in the paired rows: ``fused[<schedule><,axis value...>]``."""
    return f"fused[{schedule}{variant_tag(axes)}]"


def impl_label(config, axes) -> str:
    """The variant's name in the timing rows: the resolved tile and ring depth spelled out."""
    return f"fused[{config.schedule},{BLOCK_M}x{config.block_n},s{config.stages}" \
           f"{variant_tag(axes, skip=('block_n', 'stages'))}]"


def variant_config(schedule, axes) -> MegaMoEConfig:
    """The (unresolved) MegaMoEConfig of one variant: the axes given, the rest None."""
    fields = {name: value for name, value in axes.items() if value is not None}
    if "l2_columns" in fields:
        fields["l2_columns"] = bool(fields["l2_columns"])
    return MegaMoEConfig(schedule=schedule, **fields)


def resolved_variants(shape, P, tokens, axis_values: dict, schedules, num_sms: int) -> list:
    """(name, axes, resolved config) of every variant of :func:`variant_cases` whose config
    resolves for the case (:meth:`MegaMoEConfig.resolve`, as MegaMoE resolves it); the others
    (the axes may combine into a configuration that does not fit or does not apply) are skipped
    with a note instead of aborting the run."""
    out = []
    for axes, sched in variant_cases(axis_values, schedules):
        name = variant_name(sched, axes)
        try:
            config = variant_config(sched, axes).resolve(shape, P, tokens, num_sms)
        except ValueError as e:
            print(f"{shape.name}, P={P}, T={tokens}: skipping {name}: {e}", flush=True)
            continue
        out.append((name, axes, config))
    return out


# ----------------------------------------------------------------------------- traces


def _median(v):
    v = sorted(v)
    return v[len(v) // 2] if v else float("nan")


def trace_file_name(tag, schedule, axes, P, tokens) -> str:
    """``trace<tag>[_<axis><value>...]_<schedule>_P<P>_T<tokens>.csv``."""
    variant = "".join(f"_{VARIANT_TAGS[name].rstrip('=')}{axes[name]}" for name in VARIANT_AXES
                      if axes.get(name) is not None)
    return f"trace{tag}{variant}_{schedule}_P{P}_T{tokens}.csv"


def trace_one_call(shape, kind, P, tokens, config, w1, w2, xs, idx, wts, *, path, label, world="loopback"):
    """One traced call (``config`` with trace=True): rank 0's per-tile timeline to the CSV
    ``path`` (:func:`lab.megamoe.trace.write_trace`), medians of its spans returned."""
    moe = build_moe(shape, P, tokens, dataclasses.replace(config, trace=True), w1, w2, world=world,
                    poison_combine=True)
    moe.forward(xs, idx, wts)
    recs = decode_trace(moe.last_trace[0])
    write_trace(path, recs)
    t_min = min(r["t_start"] for cta in recs for r in cta)
    summary = dict(shape=shape.name, routing=kind, world=world, P=P, tokens_per_rank=tokens, impl=label, rank=0)
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
    out = {f"cta_{name}_ns_median": _median([sum(r[b] - r[a] for r in cta) for cta in ctas])
           for name, (a, b) in TILE_PARTS.items()}
    out["cta_busy_ns_median"] = _median([cta[-1]["t_epilogue"] - cta[0]["t_start"] for cta in ctas])
    out["cta_gap_ns_median"] = _median([sum(max(0, b["t_start"] - a["t_epilogue"]) for a, b in zip(cta, cta[1:]))
                                        for cta in ctas])
    out["cta_start_ns_max"] = max(cta[0]["t_start"] for cta in ctas) - t0
    tails = sorted(end - cta[-1]["t_epilogue"] for cta in ctas)
    out.update(cta_tail_ns_min=tails[0], cta_tail_ns_median=_median(tails), cta_tail_ns_max=tails[-1])
    return out


# ----------------------------------------------------------------------------- one case, the command line


def device_sms() -> int:
    """SMs of the current GPU (MegaMoE's default ``num_sms``: the variants resolve as it does)."""
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def api_timed(moe, xs, idx, wts, trials):
    """Whole ``moe.forward`` calls timed (timing.bench: one warm-up, ``trials`` single calls):
    (their Timing, the Timing of the fused kernels of the timed calls, the last call's y)."""
    kernel_us, last = [], []

    def call():
        last[:] = moe.forward(xs, idx, wts)
        kernel_us.append(moe.last_kernel_us)

    api = timing.bench(call, warmup=1, iters=1, trials=trials)
    return api, timing.Timing(samples_us=sorted(kernel_us[1:])), last


def run_case(shape, kind, P, tokens, args, dense):
    """One (shape, routing, P, tokens per rank) of the bench: ``{"rows": timing rows, "paired":
    the paired row or None, "traces": trace summaries, "variants": [{case keys, name, config}]}``
    (config: the variant's resolved MegaMoEConfig as a dict)."""
    H, I = shape.hidden, shape.intermediate
    w1, w2, xs, idx, wts = make_problem(shape, kind, P, tokens, args.strength)
    picks = sum(int((i >= 0).sum()) for i in idx)
    flops = 2 * picks * H * I * 3
    (w1_t, w2_t), gemms_only = grouped_gemms(shape, P, w1, w2, idx, wts)
    case = dict(shape=shape.name, routing=kind, world=args.world, P=P, tokens_per_rank=tokens)
    out = dict(rows=[], paired=None, traces=[], variants=[])
    refs = []  # the unfused pipeline's y, computed once per case: every timed fused variant is checked

    def reference():
        if not refs:
            refs.extend(unfused_pipeline(xs, idx, wts, w1_t, w2_t))
        return refs

    def record(name, t):
        tf = flops / (t.median_us * 1e-6) / 1e12
        out["rows"].append(dict(case, impl=name, median_us=round(t.median_us, 2), p10_us=round(t.p10_us, 2),
                                p90_us=round(t.p90_us, 2), tflops=round(tf, 2), frac_dense=round(tf / dense, 4)))
        print(f"{shape.name:18s} {kind:8s} P={P} T={tokens:6d} {name:24s} {t.median_us:12.1f} us {tf:8.2f} TFLOP/s",
              flush=True)

    if not args.skip_baselines and not args.paired_only:
        record("grouped_mm x2 only", timing.bench(gemms_only, warmup=2, iters=3, trials=args.trials))
        record("unfused torch pipeline", timing.bench(lambda: unfused_pipeline(xs, idx, wts, w1_t, w2_t),
                                                      warmup=1, iters=1, trials=args.trials))
    if tokens > args.fused_max_tokens:
        print(f"{shape.name}, P={P}, T={tokens}: fused variants skipped (T > --fused-max-tokens "
              f"{args.fused_max_tokens})", file=sys.stderr)
        return out
    variants = resolved_variants(shape, P, tokens, {name: getattr(args, name) for name in VARIANT_AXES},
                                 args.schedules, device_sms())
    out["variants"] = [dict(case, name=name, config=dataclasses.asdict(config)) for name, _, config in variants]
    poisons = [] if args.paired_only else {"on": [True], "off": [False], "both": [True, False]}[args.api_poison]
    for _, axes, config in variants:
        label = impl_label(config, axes)
        for i, poison in enumerate(poisons):
            moe = build_moe(shape, P, tokens, config, w1, w2, world=args.world, poison_combine=poison)
            api, kernels, last = api_timed(moe, xs, idx, wts, args.trials)
            del moe
            row = f"{label} {'api' if poison else 'api,no-poison'}"
            record(row, api)
            check_against(last, reference(), row)  # the last timed call's y
            if i == 0:
                record(f"{label} kernels", kernels)
        if args.trace:
            path = os.path.join(args.out, trace_file_name(args.tag, config.schedule, axes, P, tokens))
            out["traces"].append(trace_one_call(shape, kind, P, tokens, config, w1, w2, xs, idx, wts, path=path,
                                                label=label, world=args.world))
    if args.paired_trials > 0 and not args.skip_baselines:
        fns = {BASELINE: bench.event_timed(gemms_only)}
        weight_cache = {}
        for name, _, config in variants:
            fns[name] = fused_kernel_timed(shape, P, tokens, config, w1, w2, xs, idx, wts, world=args.world,
                                           refs=reference(), name=name, weight_cache=weight_cache,
                                           rerun=args.fused_call == "rerun")
        refs.clear()
        samples, clocks = bench.paired_trials(fns, args.paired_trials, args.cooldown_s)
        out["paired"] = dict(case, **bench.paired_verdicts(samples, clocks, BASELINE, args.clock_tol_mhz))
        bench.print_paired(out["paired"], label=f"{shape.name}, P={P}, T={tokens}")
    return out


def build_parser() -> argparse.ArgumentParser:
    """The bench's command line (one flag per side-by-side axis of VARIANT_AXES)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", nargs="+", default=["deepseek-v4-flash"])
    ap.add_argument("--world", default="loopback", choices=["loopback", "host", "loopback+host"],
                    help="loopback: no remote path (the control); host: every symmetric buffer in pinned host "
                         "memory (Dispatch reads and Combine stores cross PCIe); loopback+host: only the Combine "
                         "destinations in pinned host memory, so the remote stores alone cross PCIe (the "
                         "h200-pcie-host profile's path)")
    ap.add_argument("--routing", nargs="+", default=["balanced"], choices=["balanced", "skewed"])
    ap.add_argument("--strength", type=float, default=1.0)
    ap.add_argument("--P", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--tokens", nargs="+", type=int, default=[8192])
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--fused-max-tokens", type=int, default=8192,
                    help="run the fused variants only up to this many tokens per rank (the baselines run at every "
                         "--tokens); a skip is reported on stderr")
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES,
                    help="fused schedules to run (default: both)")
    axis = "several values run side by side (default: MegaMoEConfig.resolve's)"
    ap.add_argument("--lead", nargs="+", type=int, default=[None],
                    help=f"interleaved: lead D in scheduler rows; {axis}: ceil(eq. 16)")
    ap.add_argument("--experts-per-wave", nargs="+", type=int, default=[None], metavar="N>=1",
                    help=f"expert_wave: local experts per wave; {axis}: a quarter of the local experts")
    ap.add_argument("--block-n", nargs="+", type=int, default=[None], choices=BLOCK_NS,
                    help=f"N tile (M is {BLOCK_M}); {axis}: the widest that tiles H and I")
    ap.add_argument("--stages", nargs="+", type=int, default=[None],
                    help=f"A/B ring depth; {axis}: 4 below 512 rows per local expert, else 3 at 128 x 256")
    ap.add_argument("--dispatch-copy", nargs="+", default=[None], choices=DISPATCH_COPIES,
                    help=f"the dispatch warp's copy (vector loads / stores or bulk copies); {axis}: bulk where its "
                         "bounce buffers fit")
    ap.add_argument("--dispatch-window", nargs="+", type=int, default=[None],
                    help=f"bulk Dispatch: copy row r once row r - W has a finished L1 tile (0 = unpaced); {axis}")
    ap.add_argument("--l2-columns", nargs="+", type=int, default=[None], choices=[0, 1],
                    help=f"expert_wave: each expert's L2 tiles column by column, off / on; {axis}: on where it "
                         "applies")
    ap.add_argument("--api-poison", default="both", choices=["on", "off", "both"],
                    help="NaN-poison the Combine slots before each timed api call (MegaMoE poison_combine): "
                         "'on' = rows 'api', 'off' = rows 'api,no-poison', 'both' = both rows")
    ap.add_argument("--skip-baselines", action="store_true")
    ap.add_argument("--paired-only", action="store_true",
                    help="only the paired fused-vs-grouped comparison (and --trace): no per-variant API timing, "
                         "no unfused pipeline")
    ap.add_argument("--trace", action="store_true", help="also record one per-tile timeline per variant")
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
    ap.add_argument("--out", default=DEFAULT_OUT)
    return ap


def main(argv=None):
    """bench_megamoe{tag}.csv (timing rows), bench_megamoe{tag}_paired.csv (one row per case and
    variant of the paired comparison) and bench_megamoe{tag}.json (everything, the samples, the
    trace summaries and every variant's resolved config) under ``--out``."""
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    dense = dense_bf16_tflops()
    print(f"dense bf16 matmul: {dense:.1f} TFLOP/s")
    rows, paired_rows, traces, variants = [], [], [], []
    for name in args.shape:
        for kind in args.routing:
            for P in args.P:
                for T in args.tokens:
                    res = run_case(get_shape(name), kind, P, T, args, dense)
                    rows += res["rows"]
                    traces += res["traces"]
                    variants += res["variants"]
                    if res["paired"] is not None:
                        paired_rows.append(res["paired"])
    stem = f"bench_megamoe{args.tag}"
    bench.write_csv(os.path.join(args.out, f"{stem}_paired.csv"), bench.paired_table(paired_rows))
    bench.write_result(args.out, stem, {"dense_bf16_tflops": dense, "args": vars(args), "rows": rows,
                                        "trace_summaries": traces, "paired": paired_rows, "variants": variants}, rows)


if __name__ == "__main__":
    main()
