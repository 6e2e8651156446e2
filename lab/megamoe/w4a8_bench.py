"""The fused W4A8 kernel against our W8A8 and BF16 fused kernels on the same weights (each quantized
from the same BF16) and against what a Hopper user runs for FP4 experts today, paired and
clock-matched: the library part of ``scripts/bench_megamoe_w4a8.py`` (issue 42's speed bounds).

Per (shape, routing, P, tokens per rank), in one paired run (:func:`lab.bench.paired_trials`,
baseline "fused w4a8"):

* ``fused w4a8`` / ``fused w8a8`` / ``fused bf16``: the fused kernels of every rank
  (``MegaMoE.rerun``'s ``last_kernel_us``), the interleaved schedule unless ``--schedule``;
* ``unfused bf16 pipeline, fp4 dequantized``: the FP4 weights dequantized to BF16 once, then the
  unfused torch pipeline (permute, grouped GEMM, SwiGLU x weight, grouped GEMM, scatter, top-k
  reduction): vLLM's route on Hopper;
* ``DeepGEMM fp8 GEMMs x2 only``, where DeepGEMM imports: its two SM90 FP8 grouped GEMMs of every
  rank on the same BF16 weights (:mod:`lab.megamoe.deepgemm`).

Before timing, the W4A8 layer's y must equal the W8A8 layer's on the widened weights
(:func:`quant_fp4.widen_weights`) bit for bit, and be within W4A8_FP32_REL_ERROR's upper bound
(plus the BF16 pipeline's rounding) of the BF16 pipeline on the dequantized weights.
"""
from __future__ import annotations

import argparse
import os

import torch

from lab import bench
from lab.megamoe import deepgemm
from lab.megamoe.bench import (add_output_arguments, add_problem_arguments, build_moe, kernel_time_call, make_problem,
                               problem_cases, rank_weight_views, report_or_gpu_run)
from megamoe_interleave import quant_fp4
from megamoe_interleave.config import MegaMoEConfig
from megamoe_interleave.reference import W4A8_FP32_REL_ERROR, relative_error, unfused_pipeline

BASELINE = "fused w4a8"
UNFUSED = "unfused bf16 pipeline, fp4 dequantized"


def weight_bytes(moe) -> int:
    """Bytes of the fused kernel's weight operands over every local rank (codes or values, scales, shifts)."""
    tensors = [*moe.w1.values(), *moe.w2.values()]
    if moe.config.precision == "w8a8":
        tensors += [*moe.w1_scales.values(), *moe.w2_scales.values()]
    tensors += [t for ops in moe.fp4_operands.values() for t in ops.values()]
    return sum(t.numel() * t.element_size() for t in tensors)


def run_case(shape, kind, P, tokens, args) -> dict:
    w1, w2, xs, idx, wts = make_problem(shape, kind, P, tokens, args.strength)
    fp4 = quant_fp4.quantize_weights(w1, w2)
    fns, checks = {}, {}
    moes = {}
    for prec in ("w4a8", "w8a8", "bf16"):
        moes[prec] = build_moe(shape, P, tokens, MegaMoEConfig(args.schedule, precision=prec), w1, w2,
                               poison_combine=True)
    y4 = [y.clone() for y in moes["w4a8"].forward(xs, idx, wts)]
    moes["w4a8"].poison_combine = False
    widened = build_moe(shape, P, tokens, MegaMoEConfig(args.schedule, precision="w8a8"), w1, w2, poison_combine=True)
    widened.load_quantized_weights(*quant_fp4.widen_weights(*fp4))
    if not all(torch.equal(a, b) for a, b in zip(y4, widened.forward(xs, idx, wts))):
        raise RuntimeError(f"{shape.name} P={P} T={tokens}: fused W4A8 != fused W8A8 on the widened weights")
    del widened
    deq = quant_fp4.dequantize_weights(*fp4, dtype=torch.bfloat16)
    w1_t, w2_t = rank_weight_views(shape, P, *deq)
    ref = unfused_pipeline(xs, idx, wts, w1_t, w2_t)
    checks["fused w4a8 rel err vs bf16 pipeline on the dequantized weights"] = max(
        relative_error(y, r) for y, r in zip(y4, ref))
    bound = W4A8_FP32_REL_ERROR[1] + 0.01
    for name, err in checks.items():
        if err > bound:
            raise RuntimeError(f"{shape.name} P={P} T={tokens}: {name} = {err:.4f} > {bound:.4f}")
    del ref, y4
    for prec, moe in moes.items():
        moe.forward(xs, idx, wts)  # stage this problem (the W8A8 / BF16 layers ran none yet)
        moe.poison_combine = False
        fns[f"fused {prec}"] = kernel_time_call(moe, rerun=True)
        fns[f"fused {prec}"]()
    fns[UNFUSED] = bench.event_timed(lambda: unfused_pipeline(xs, idx, wts, w1_t, w2_t))
    dg_run, dg_note = deepgemm.paired_variant(shape, P, w1, w2, idx)
    if dg_run is not None:
        fns[deepgemm.VARIANT] = bench.event_timed(dg_run)
    samples, clocks = bench.paired_trials(fns, args.trials, 0.0)
    row = dict(shape=shape.name, routing=kind, world="loopback", P=P, tokens_per_rank=tokens,
               **bench.paired_verdicts(samples, clocks, BASELINE, args.clock_tol_mhz))
    bench.print_paired(row, label=f"{shape.name}, P={P}, T={tokens}")
    return dict(checks=checks, weight_bytes={p: weight_bytes(m) for p, m in moes.items()}, paired=row, deepgemm=dg_note)


def summary_rows(results) -> list:
    """One row per case: the W4A8 kernel's median, every variant's median and its time over W4A8's
    (so ``fused_w8a8_over_w4a8`` >= 1.4 is issue 42's small-batch bound), and the weight bytes."""
    rows = []
    for res in results:
        p = res["paired"]
        row = {k: p[k] for k in ("shape", "routing", "world", "P", "tokens_per_rank")}
        first = next(iter(p["variants"].values()))
        row["fused_w4a8_us"] = round(first["baseline_median_us"], 1)
        for name, v in p["variants"].items():
            key = name.replace(" ", "_").replace(",", "")
            row[f"{key}_us"] = round(v["median_us"], 1) if v.get("median_us") else None
            row[f"{key}_over_w4a8"] = round(v["median_ratio"], 4) if v.get("median_ratio") else None
            row[f"{key}_n_matched"] = v.get("n_matched")
        wb = res["weight_bytes"]
        row["w4a8_weight_bytes_over_w8a8"] = round(wb["w4a8"] / wb["w8a8"], 4)
        rows.append(row)
    return rows


def report(json_paths, out_dir) -> list:
    """``out_dir/summary.csv`` and ``out_dir/w4a8.png`` (each variant's time over the fused W4A8
    kernel's, per case) from this bench's result files; returns the rows."""
    import json

    rows = []
    for path in json_paths:
        with open(path) as f:
            rows += summary_rows(json.load(f)["cases"])
    os.makedirs(out_dir, exist_ok=True)
    bench.write_csv(os.path.join(out_dir, "summary.csv"), rows)
    series = [("fused W8A8", "fused_w8a8_over_w4a8"), ("fused BF16", "fused_bf16_over_w4a8"),
              ("unfused BF16, FP4 dequantized", "unfused_bf16_pipeline_fp4_dequantized_over_w4a8")]
    if any(r.get("DeepGEMM_fp8_GEMMs_x2_only_over_w4a8") for r in rows):
        series.append(("DeepGEMM FP8 GEMMs", "DeepGEMM_fp8_GEMMs_x2_only_over_w4a8"))
    bench.ratio_bars(os.path.join(out_dir, "w4a8.png"), [f"P={r['P']} T={r['tokens_per_rank']}" for r in rows],
                     [(name, [r.get(key) or 0 for r in rows]) for name, key in series],
                     ylabel="time / fused W4A8 (paired medians)", ticks=[0.9, 1, 1.2, 1.4, 2, 3, 5],
                     title="MegaMoE W4A8 fused kernel, loopback, H200", ref=(1.4, "issue 42: W8A8 / W4A8 >= 1.4", ":"),
                     figsize=(7, 3.6))
    return rows


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_problem_arguments(ap, tokens=[256, 1024, 2048, 8192])
    ap.add_argument("--schedule", default="interleaved")
    ap.add_argument("--trials", type=int, default=20)
    add_output_arguments(ap, out="results/h200/megamoe/w4a8", figure="w4a8.png")
    return ap


def main(argv=None):
    """bench_megamoe_w4a8{tag}.json (everything, with provenance) and .csv (the summary rows)."""
    args = build_parser().parse_args(argv)
    if not report_or_gpu_run(args, report):
        return
    results = []
    for case in bench.progress(problem_cases(args), desc="w4a8 cases"):
        results.append(run_case(*case, args))
        torch.cuda.empty_cache()
    rows = summary_rows(results)
    for r in rows:
        print(r, flush=True)
    bench.write_result(args.out, f"bench_megamoe_w4a8{args.tag}", {"args": vars(args), "cases": results,
                                                                     "summary": rows}, rows)
