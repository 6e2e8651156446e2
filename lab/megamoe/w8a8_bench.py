"""The fused W8A8 kernel against the FP8 baselines torch has on SM90 and against our BF16 fused
kernel, paired and clock-matched: the library part of ``scripts/bench_megamoe_w8a8.py``.

Per (shape, routing, P, tokens per rank) and cooldown protocol, in one paired run
(:func:`lab.bench.paired_trials`, baseline "fused w8a8"):

* ``fused w8a8`` / ``fused bf16``: the fused kernels of every rank (``MegaMoE.rerun``'s
  ``last_kernel_us``), both schedules' default (interleaved) unless ``--schedule``;
* ``scaled_grouped_mm x2 only``: per destination rank the two FP8 grouped GEMMs alone,
  ``torch._scaled_grouped_mm`` with rowwise scales (the one FP8 grouped GEMM torch has on SM90;
  a per-row, not block-scaled, recipe) on pre-permuted random E4M3 rows;
* ``unfused fp8 pipeline``: quantize x per token, permute, scaled grouped GEMM, SwiGLU x weight
  + quantize per token, scaled grouped GEMM, weighted scatter into the Combine slots and the
  top-k reduction (:func:`unfused_fp8_pipeline`).

Before timing, the fused W8A8 and the unfused FP8 outputs are checked against the unfused BF16
pipeline (relative error within W8A8_FP32_REL_ERROR's upper bound plus the BF16 pipeline's own
rounding). TFLOP/s of every variant are set against the dense FP8 rate measured in the same
process (``torch._scaled_mm``, 8192^3, rowwise scales).
"""
from __future__ import annotations

import argparse
import os

import torch

from lab import bench
from lab.megamoe.bench import add_output_arguments, report_or_gpu_run, add_problem_arguments, problem_cases, build_moe, kernel_time_call, make_problem, rank_weight_views
from megamoe_interleave.config import MegaMoEConfig
from megamoe_interleave.reference import (
    W8A8_FP32_REL_ERROR, gather_rows, permute_for_rank, relative_error, slot_rows, swiglu, topk_reduce,
    unfused_pipeline,
)
from megamoe_interleave.shapes import get_shape

BASELINE = "fused w8a8"
E4M3 = torch.float8_e4m3fn


def rowwise_quantize(x: torch.Tensor, dim: int = -1):
    """E4M3 with one FP32 scale per row (amax over ``dim``) -> (q, scale without ``dim``)."""
    s = x.float().abs().amax(dim=dim, keepdim=True).clamp(min=1e-4) / 448.0
    return (x.float() / s).clamp(-448.0, 448.0).to(E4M3), s.squeeze(dim)


def scaled_grouped_mm(a_q, a_s, b_q_t, b_s, counts):
    """``out[rows of e] = (a_q[rows] * a_s) @ (b_q_t[e] * b_s[e])`` in BF16: torch._scaled_grouped_mm,
    rowwise scales; ``b_q_t`` [E, K, N] column-major (a transposed view of [E, N, K])."""
    offs = torch.cumsum(counts.to(torch.int64), 0).to(torch.int32).to(a_q.device)
    return torch._scaled_grouped_mm(a_q, b_q_t, a_s, b_s, offs=offs, out_dtype=torch.bfloat16)


def fp8_rank_weights(shape, P, w1, w2):
    """Each rank's rowwise-quantized weights as the scaled grouped GEMMs take them: lists of
    (w1_q_t [E/P, H, 2I], w1_s [E/P, 2I], w2_q_t [E/P, I, H], w2_s [E/P, H])."""
    el = shape.num_experts // P
    out = []
    for r in range(P):
        q1, s1 = rowwise_quantize(w1[r * el:(r + 1) * el])
        q2, s2 = rowwise_quantize(w2[r * el:(r + 1) * el])
        out.append((q1.transpose(1, 2), s1, q2.transpose(1, 2), s2))
    return out


def fp8_grouped_gemms(shape, P, fp8_w, idx, wts):
    """() -> runs the two FP8 grouped GEMMs alone per destination rank on random E4M3 rows."""
    H, I = shape.hidden, shape.intermediate
    el = shape.num_experts // P
    perms = {d: permute_for_rank(idx, wts, d, el) for d in range(P)}
    dev = idx[0].device
    a1 = {d: rowwise_quantize(torch.randn(p.src_rank.numel(), H, device=dev)) for d, p in perms.items()}
    a2 = {d: rowwise_quantize(torch.randn(p.src_rank.numel(), I, device=dev)) for d, p in perms.items()}

    def run():
        for d, p in perms.items():
            w1q, w1s, w2q, w2s = fp8_w[d]
            scaled_grouped_mm(*a1[d], w1q, w1s, p.counts)
            scaled_grouped_mm(*a2[d], w2q, w2s, p.counts)
    return run


def unfused_fp8_pipeline(xs, topk_idx, topk_weights, fp8_w):
    """The unfused FP8 baseline of the whole world (per destination rank: quantize, permute,
    scaled grouped GEMM, SwiGLU x weight + quantize, scaled grouped GEMM, scatter into the
    sources' Combine slots; then the top-k reduction); y per rank, BF16."""
    P, k, H = len(xs), topk_idx[0].shape[1], xs[0].shape[1]
    el = fp8_w[0][0].shape[0]
    flat = [torch.zeros(k * x.shape[0] + 1, H, dtype=x.dtype, device=x.device) for x in xs]
    combine = [f[:-1].view(k, x.shape[0], H) for f, x in zip(flat, xs)]
    for d in range(P):
        w1q, w1s, w2q, w2s = fp8_w[d]
        perm = permute_for_rank(topk_idx, topk_weights, d, el)
        rows = gather_rows(xs, perm, w1q.device)
        h = scaled_grouped_mm(*rowwise_quantize(rows), w1q, w1s, perm.counts)
        inter = h.shape[1] // 2
        a = swiglu(h[:, :inter].float(), h[:, inter:].float()) * perm.weights.to(h.device)[:, None]
        out = scaled_grouped_mm(*rowwise_quantize(a), w2q, w2s, perm.counts)
        for s in range(P):
            sel = (perm.src_rank == s).nonzero(as_tuple=True)[0]
            combine[s][perm.src_pick[sel].to(h.device), perm.src_token[sel].to(h.device)] = out[sel.to(h.device)]
    return [topk_reduce(f, slot_rows(i.to(f.device), x.shape[0])) for f, x, i in zip(flat, xs, topk_idx)]


def dense_fp8_tflops(n: int = 8192, reps: int = 20) -> float:
    """The dense FP8 rate of this GPU: ``torch._scaled_mm`` n x n x n, rowwise scales, BF16 out."""
    a, sa = rowwise_quantize(torch.randn(n, n, device="cuda"))
    b, sb = rowwise_quantize(torch.randn(n, n, device="cuda"))

    def mm():
        return torch._scaled_mm(a, b.t(), sa[:, None], sb[None, :], out_dtype=torch.bfloat16)
    us = bench.event_timed(mm, calls=reps, warmup=3)()
    return 2 * n ** 3 / us / 1e6


def layer_flops(shape, P, tokens) -> float:
    """The two GEMMs' FLOPs of one call of the world (every pick of every token)."""
    return 2.0 * P * tokens * shape.topk * 3 * shape.hidden * shape.intermediate


def run_case(shape, kind, P, tokens, args) -> dict:
    w1, w2, xs, idx, wts = make_problem(shape, kind, P, tokens, args.strength)
    w1_t, w2_t = rank_weight_views(shape, P, w1, w2)
    ref = unfused_pipeline(xs, idx, wts, w1_t, w2_t)  # the BF16 pipeline's y
    fp8_w = fp8_rank_weights(shape, P, w1, w2)
    bound = W8A8_FP32_REL_ERROR[1] + 0.01
    fns, checks = {}, {}
    for prec in ("w8a8", "bf16"):
        moe = build_moe(shape, P, tokens, MegaMoEConfig(args.schedule, precision=prec), w1, w2,
                        poison_combine=True)
        ys = moe.forward(xs, idx, wts)
        checks[f"fused {prec} rel err vs bf16 pipeline"] = max(relative_error(y, r) for y, r in zip(ys, ref))
        moe.poison_combine = False
        fns[f"fused {prec}"] = kernel_time_call(moe, rerun=True)
        fns[f"fused {prec}"]()
    ys = unfused_fp8_pipeline(xs, idx, wts, fp8_w)
    checks["unfused fp8 rel err vs bf16 pipeline"] = max(relative_error(y, r) for y, r in zip(ys, ref))
    for name, err in checks.items():
        if err > bound:
            raise RuntimeError(f"{shape.name} P={P} T={tokens}: {name} = {err:.4f} > {bound:.4f}")
    del ref, ys
    fns["scaled_grouped_mm x2 only"] = bench.event_timed(fp8_grouped_gemms(shape, P, fp8_w, idx, wts))
    fns["unfused fp8 pipeline"] = bench.event_timed(lambda: unfused_fp8_pipeline(xs, idx, wts, fp8_w))
    out = dict(checks=checks)
    for protocol, cooldown, trials in (("sustained", 0.0, args.trials), ("cooled", args.cooldown_s, args.cooled_trials)):
        samples, clocks = bench.paired_trials(fns, trials, cooldown)
        case = dict(shape=shape.name, routing=kind, world="loopback", P=P, tokens_per_rank=tokens, protocol=protocol)
        row = dict(case, **bench.paired_verdicts(samples, clocks, BASELINE, args.clock_tol_mhz))
        bench.print_paired(row, label=f"{shape.name}, P={P}, T={tokens}, {protocol}")
        out[protocol] = row
    return out


def summary_rows(results, dense_tflops) -> list:
    """One row per case and protocol: the medians, the ratios variant / fused w8a8 and the
    TFLOP/s (and share of the dense FP8 rate) of each."""
    rows = []
    for res in results:
        for protocol in ("sustained", "cooled"):
            p = res[protocol]
            base = p["variants"][next(iter(p["variants"]))]["baseline_median_us"]
            row = {k: p[k] for k in ("shape", "routing", "world", "P", "tokens_per_rank", "protocol")}
            flops = layer_flops(get_shape(p["shape"]), p["P"], p["tokens_per_rank"])
            row.update(fused_w8a8_us=round(base, 1), fused_w8a8_tflops=round(flops / base / 1e6, 1),
                       fused_w8a8_of_dense=round(flops / base / 1e6 / dense_tflops, 3))
            for name, v in p["variants"].items():
                key = name.replace(" ", "_").replace("x2_only", "x2")
                row[f"{key}_us"] = round(v["median_us"], 1) if v.get("median_us") else None
                row[f"{key}_over_w8a8"] = round(v["median_ratio"], 4) if v.get("median_ratio") else None
                row[f"{key}_n_matched"] = v.get("n_matched")
            rows.append(row)
    return rows


def report(json_paths, out_dir) -> list:
    """Summary rows of this bench's result files as ``out_dir/summary.csv`` and
    ``out_dir/w8a8.png`` (each variant's time over the fused W8A8 kernel's, per case and
    protocol); returns the rows."""
    import json

    rows = []
    for path in json_paths:
        with open(path) as f:
            payload = json.load(f)
        rows += summary_rows(payload["cases"], payload["dense_fp8_tflops"])
    os.makedirs(out_dir, exist_ok=True)
    bench.write_csv(os.path.join(out_dir, "summary.csv"), rows)
    series = [("fused bf16", "fused_bf16_over_w8a8"), ("FP8 scaled_grouped_mm x2 only", "scaled_grouped_mm_x2_over_w8a8"),
              ("unfused FP8 pipeline", "unfused_fp8_pipeline_over_w8a8")]
    bench.ratio_bars(os.path.join(out_dir, "w8a8.png"),
                     [f"P={r['P']} T={r['tokens_per_rank']}\n{r['protocol']}" for r in rows],
                     [(name, [r[key] or 0 for r in rows]) for name, key in series],
                     ylabel="time / fused W8A8 (paired medians)", ticks=[0.9, 1, 1.1, 1.3, 1.5, 2, 3, 5],
                     title="MegaMoE W8A8 fused kernel, DeepSeek-V4-Flash, loopback, H200", ref=(1.0, "fused W8A8", "-"),
                     figsize=(7, 3.6))
    return rows


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_problem_arguments(ap, tokens=[8192])
    ap.add_argument("--schedule", default="interleaved")
    ap.add_argument("--trials", type=int, default=20, help="sustained protocol (no cooldown)")
    ap.add_argument("--cooled-trials", type=int, default=10)
    ap.add_argument("--cooldown-s", type=float, default=1.0, help="cooled protocol: sleep before each timed call")
    add_output_arguments(ap, out="results/h200/megamoe/w8a8", figure="w8a8.png")
    return ap


def main(argv=None):
    """bench_megamoe_w8a8{tag}.json (everything, with provenance) and .csv (the summary rows)."""
    args = build_parser().parse_args(argv)
    if not report_or_gpu_run(args, report):
        return
    dense = dense_fp8_tflops()
    print(f"dense FP8 rate (torch._scaled_mm 8192^3, rowwise): {dense:.1f} TFLOP/s", flush=True)
    cases = problem_cases(args)
    results = []
    for case in bench.progress(cases, desc="w8a8 cases"):
        results.append(run_case(*case, args))
        torch.cuda.empty_cache()
    rows = summary_rows(results, dense)
    for r in rows:
        print(r, flush=True)
    bench.write_result(args.out, f"bench_megamoe_w8a8{args.tag}",
                       {"args": vars(args), "dense_fp8_tflops": dense, "cases": results, "summary": rows}, rows)
