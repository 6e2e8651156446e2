"""The MegaMoE layer as a serving stack runs it: one CUDA-graph replay of
:meth:`MegaMoE.capture` (staging, device-side plan, kernels, reduction) against the fused kernels'
own time, the eager calls, and the two grouped GEMMs alone / the unfused torch pipeline, paired
and clock-matched; small batches (decode-like) as first-class points. The library part of
``scripts/bench_megamoe_graph.py``.

Per (shape, routing, P, tokens per rank), in one paired run (:func:`lab.bench.paired_trials`,
baseline "fused kernels"):

* ``graph replay``: ``layer.replay()`` between two CUDA events (the whole layer, every rank);
* ``fused kernels``: the fused kernels of every rank alone (``MegaMoE.rerun``'s
  ``last_kernel_us``: events around the back-to-back launches, host-planned);
* ``grouped_mm x2 only`` / ``unfused torch pipeline``: as in :mod:`lab.megamoe.bench` (with
  ``--precision w8a8`` the GEMMs are torch's rowwise FP8 ``_scaled_grouped_mm``,
  :func:`lab.megamoe.w8a8_bench.fp8_grouped_gemms`);
* ``DeepGEMM fp8 GEMMs x2 only`` (``--precision w8a8``, where DeepGEMM imports): its two SM90 FP8
  grouped GEMMs of every rank, the same 1x128 / 128x128 recipe (:mod:`lab.megamoe.deepgemm`);
* ``streaming read``: ``torch.sum`` over a 4 GiB tensor, the plain read bandwidth this GPU reaches
  in the same trials. The expert weights' bytes over it is the layer's floor where the weights
  dominate the traffic (small batches): ``replay_over_stream_bound``.

Outside the paired run: the eager ``enqueue`` and ``forward`` (CUDA events around one call:
``forward`` includes its host planning and syncs), ``enqueue``'s host time alone, and a profiler
trace of one replay: its CUDA runtime calls (a replay must be one ``cudaGraphLaunch``, no
synchronisation) and its kernels' device times.
Before timing, the replay's y is checked bitwise against ``forward``'s and against the unfused
pipeline (:func:`bench.check_against`).
"""
from __future__ import annotations

import argparse
import os

import torch

from lab import bench, timing
from lab.megamoe import deepgemm
from lab.megamoe.bench import add_output_arguments, report_or_gpu_run, add_problem_arguments, problem_cases, build_moe, check_against, check_w8a8_against, grouped_gemms, kernel_time_call, make_problem
from lab.megamoe.w8a8_bench import fp8_grouped_gemms, fp8_rank_weights
from megamoe_interleave.config import MegaMoEConfig
from megamoe_interleave.reference import unfused_pipeline

BASELINE = "fused kernels"
STREAM_BYTES = 4 << 30  # the streaming-read reference's tensor
GEMMS = {"bf16": "grouped_mm x2 only", "w8a8": "scaled_grouped_mm x2 only"}  # the GEMMs-alone variant per precision
SYNC_CALLS = ("Synchronize", "cudaMemcpy ", "cudaMemcpy(")  # runtime calls that would block the host


def replay_profile(layer) -> dict:
    """One ``layer.replay()`` under torch.profiler: its CUDA runtime calls [(name, count)] and its
    device kernels [(name, count, total us)], dearest first, and ``span_us``: first node's start to
    the last one's end on the device (the replay's own time, clocks and all, to set against the
    sum of its kernels)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        layer.replay()
        torch.cuda.synchronize()
    calls, kernels, starts, ends = {}, {}, [], []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("cuda"):
            calls[e.name] = calls.get(e.name, 0) + 1
        elif e.device_type == torch.autograd.DeviceType.CUDA:
            n, us = kernels.get(e.name[:80], (0, 0.0))
            kernels[e.name[:80]] = (n + 1, us + e.time_range.elapsed_us())
            starts.append(e.time_range.start), ends.append(e.time_range.end)
    return dict(runtime_calls=sorted(calls.items()), span_us=round(max(ends) - min(starts), 1),
                kernels=sorted(((k, n, round(us, 1)) for k, (n, us) in kernels.items()), key=lambda x: -x[2]))


def host_enqueue_us(fn, trials: int) -> float:
    """Median host time of ``fn()`` (enqueue only, no synchronisation inside the timed span)."""
    import time

    out = []
    for _ in range(trials):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return sorted(out)[len(out) // 2]


def expert_weight_bytes(moe) -> int:
    """Bytes of every rank's kernel-layout expert weights (and block scales): what the layer reads
    at least once per call."""
    tensors = [*moe.w1.values(), *moe.w2.values(), *moe.w1_scales.values(), *moe.w2_scales.values()]
    return sum(t.numel() * t.element_size() for t in tensors)


def streaming_read():
    """A callable summing a :data:`STREAM_BYTES` bf16 tensor (``torch.sum``: the read-bandwidth reference)."""
    buf = torch.ones(STREAM_BYTES // 2, device="cuda", dtype=torch.bfloat16)
    return lambda: buf.sum()


def run_case(shape, kind, P, tokens, args) -> dict:
    """One case: {"paired": the paired row, "eager_us": {...}, "replay_runtime_calls": [...],
    "checks": {...}, "weight_bytes": ...}."""
    w1, w2, xs, idx, wts = make_problem(shape, kind, P, tokens, args.strength)
    (w1_t, w2_t), gemms_only = grouped_gemms(shape, P, w1, w2, idx, wts)
    if args.precision == "w8a8":
        gemms_only = fp8_grouped_gemms(shape, P, fp8_rank_weights(shape, P, w1, w2), idx, wts)
    refs = unfused_pipeline(xs, idx, wts, w1_t, w2_t)
    moe = build_moe(shape, P, tokens, MegaMoEConfig(precision=args.precision), w1, w2, world=args.world)
    layer = moe.capture(tokens)
    for r in range(P):
        layer.x[r].copy_(xs[r]), layer.topk_idx[r].copy_(idx[r]), layer.topk_weights[r].copy_(wts[r])
    ys = [y.clone() for y in layer.replay()]
    layer.check()
    (check_w8a8_against if args.precision == "w8a8" else check_against)(ys, refs, "graph replay")
    eager = moe.forward(xs, idx, wts)  # the host-planned call (and the plan rerun() repeats)
    bitwise = all(torch.equal(a, b) for a, b in zip(ys, eager))
    if not bitwise:
        raise RuntimeError(f"{shape.name} P={P} T={tokens}: graph replay y != forward y")
    del refs, eager
    prof = replay_profile(layer)
    calls = [c for c in prof["runtime_calls"] if c[0] != "cudaDeviceSynchronize"]  # the profile's own sync
    blocking = [n for n, _ in calls if any(s in n for s in SYNC_CALLS)]
    fns = {BASELINE: kernel_time_call(moe, rerun=True), "graph replay": bench.event_timed(layer.replay),
           GEMMS[args.precision]: bench.event_timed(gemms_only),
           "unfused torch pipeline": bench.event_timed(lambda: unfused_pipeline(xs, idx, wts, w1_t, w2_t)),
           "streaming read": bench.event_timed(streaming_read())}
    dg_note = {}
    if args.precision == "w8a8":
        dg_run, dg_note = deepgemm.paired_variant(shape, P, w1, w2, idx)
        if dg_run is not None:
            fns[deepgemm.VARIANT] = bench.event_timed(dg_run)
    fns[BASELINE]()  # warm-up of the rerun path
    samples, clocks = bench.paired_trials(fns, args.trials, args.cooldown_s)
    case = dict(shape=shape.name, routing=kind, world=args.world, P=P, tokens_per_rank=tokens,
                precision=args.precision)
    paired_row = dict(case, **bench.paired_verdicts(samples, clocks, BASELINE, args.clock_tol_mhz))
    bench.print_paired(paired_row, label=f"{shape.name}, P={P}, T={tokens}")
    eager_us = {}
    for name, fn in (("eager enqueue", lambda: moe.enqueue(layer.x, layer.topk_idx, layer.topk_weights)),
                     ("eager forward", lambda: moe.forward(xs, idx, wts))):
        eager_us[name] = timing.bench(fn, warmup=1, iters=1, trials=args.trials).median_us
    eager_us["enqueue host"] = host_enqueue_us(lambda: moe.enqueue(layer.x, layer.topk_idx, layer.topk_weights),
                                               args.trials)
    layer.check()
    print(f"  eager enqueue {eager_us['eager enqueue']:.1f} us (host {eager_us['enqueue host']:.1f} us), eager forward "
          f"{eager_us['eager forward']:.1f} us; replay runtime calls: {calls}; kernels: {prof['kernels'][:8]}",
          flush=True)
    return dict(paired=paired_row, eager_us=eager_us, replay_runtime_calls=calls, replay_kernels=prof["kernels"],
                replay_span_us=prof["span_us"], weight_bytes=expert_weight_bytes(moe), deepgemm=dg_note,
                checks=dict(replay_equals_forward_bitwise=bitwise, replay_blocking_calls=blocking,
                            device_ctas=moe.device_ctas))


def summary_rows(results) -> list:
    """One row per case: medians of every variant at the reference clock, the layer's overhead
    over the kernels (graph replay / fused kernels), against the baselines and against the
    streaming-read floor (expert weight bytes / the streaming read's bandwidth)."""
    rows = []
    for res in results:
        p = res["paired"]
        v = p["variants"]
        med = {k: x.get("median_us") for k, x in v.items()}
        gemms = next((k for k in GEMMS.values() if k in med), None)
        row = {k: p[k] for k in ("shape", "routing", "world", "P", "tokens_per_rank")}
        row["precision"] = p.get("precision", "bf16")  # runs before --precision were bf16
        row.update(fused_kernels_us=v["graph replay"].get("baseline_median_us"), graph_replay_us=med["graph replay"],
                   replay_over_kernels=v["graph replay"].get("median_ratio"),
                   grouped_mm_us=med.get(gemms), unfused_us=med["unfused torch pipeline"],
                   eager_enqueue_us=round(res["eager_us"]["eager enqueue"], 1),
                   eager_forward_us=round(res["eager_us"]["eager forward"], 1),
                   enqueue_host_us=round(res["eager_us"]["enqueue host"], 1),
                   n_matched=v["graph replay"]["n_matched"],
                   replay_blocking_calls=";".join(res["checks"]["replay_blocking_calls"]) or "none")
        if med["graph replay"] and med.get(gemms):
            row["replay_over_grouped_mm"] = round(med["graph replay"] / med[gemms], 4)
            row["replay_over_unfused"] = round(med["graph replay"] / med["unfused torch pipeline"], 4)
        if med["graph replay"] and med.get(deepgemm.VARIANT):
            row.update(deepgemm_us=med[deepgemm.VARIANT],
                       replay_over_deepgemm=round(med["graph replay"] / med[deepgemm.VARIANT], 4),
                       kernels_over_deepgemm=round(v["graph replay"]["baseline_median_us"] / med[deepgemm.VARIANT], 4))
        if med["graph replay"] and med.get("streaming read") and res.get("weight_bytes"):
            gbps = STREAM_BYTES / med["streaming read"] / 1e3
            bound_us = res["weight_bytes"] / gbps / 1e3
            row.update(stream_read_GBps=round(gbps, 1), weight_GB=round(res["weight_bytes"] / 1e9, 3),
                       stream_bound_us=round(bound_us, 1), replay_weight_GBps=round(res["weight_bytes"] / med["graph replay"] / 1e3, 1),
                       replay_over_stream_bound=round(med["graph replay"] / bound_us, 4))
        rows.append(row)
    return rows


def kernel_shares(res) -> dict:
    """The replay's device kernels (profiler) split into the fused kernels, the top-k reduction and
    everything else (the device-side plan, staging, memsets): us each, and the profiled replay's
    device span over their sum (what is left is the gaps between the graph's nodes). Results
    from before the span was recorded fall back to the paired replay median (other clocks)."""
    ks = res["replay_kernels"]
    fused = sum(us for name, _, us in ks if "MegaMoESm90" in name)
    reduce = sum(us for name, _, us in ks if "TopkReduce" in name)
    total = sum(us for _, _, us in ks)
    replay = res.get("replay_span_us") or res["paired"]["variants"]["graph replay"].get("median_us")
    return dict(nodes=sum(n for _, n, _ in ks), fused_us=round(fused, 1), reduce_us=round(reduce, 1),
                plan_and_rest_us=round(total - fused - reduce, 1), kernels_sum_us=round(total, 1),
                replay_over_kernels_sum=round(replay / total, 4) if replay else None,
                replay_over_fused_in_replay=round(replay / fused, 4) if replay and fused else None)


def report(json_paths, out_dir) -> list:
    """Summary rows (:func:`summary_rows` + :func:`kernel_shares`) of the cases in ``json_paths``
    (this bench's result files; a run's ``.csv`` of summary rows stands in for a JSON that did not come
    back, without the kernel shares), as ``out_dir/summary.csv``, ``out_dir/graph_layer.png`` (layer time
    per case against the fused kernels and the baselines) and, for cases with the streaming read,
    ``out_dir/stream_floor.png`` (layer and kernels over the weights' streaming floor); returns the rows."""
    import json

    cases, rows = [], []
    for path in json_paths:
        if str(path).endswith(".csv"):
            rows += bench.read_csv(path)
            continue
        with open(path) as f:
            cases += [c for c in json.load(f)["cases"] if c["paired"]["variants"]["graph replay"]["n_matched"]]
    rows += [dict(row, **kernel_shares(res)) for row, res in zip(summary_rows(cases), cases)]
    rows.sort(key=lambda r: (r["P"], r["tokens_per_rank"]))
    bench.write_csv(os.path.join(out_dir, "summary.csv"), rows)
    if rows:
        series = [("fused kernels", "fused_kernels_us"), ("graph replay (layer)", "graph_replay_us"),
                  ("grouped_mm x2 only", "grouped_mm_us"), ("unfused torch pipeline", "unfused_us")]
        if any(r.get("deepgemm_us") for r in rows):
            series.insert(3, ("DeepGEMM FP8 GEMMs x2 only", "deepgemm_us"))
        bench.ratio_bars(os.path.join(out_dir, "graph_layer.png"),
                         [f"P={r['P']}\nT={r['tokens_per_rank']}" for r in rows],
                         [(name, [(r.get(key) or 0) / r["fused_kernels_us"] for r in rows]) for name, key in series],
                         ylabel="time / fused kernels (paired medians)", ticks=[1, 1.1, 1.25, 1.5, 2, 3, 5, 8],
                         title="MegaMoE layer as one CUDA-graph replay, DeepSeek-V4-Flash, loopback, H200",
                         ref=(1.03, "fused kernels + 3 %", "--"))
    floor = [r for r in rows if r.get("replay_over_stream_bound")]
    if floor:
        bench.ratio_bars(os.path.join(out_dir, "stream_floor.png"),
                         [f"{r['precision']}\nP={r['P']}\nT={r['tokens_per_rank']}" for r in floor],
                         [("graph replay (layer)", [r["replay_over_stream_bound"] for r in floor]),
                          ("fused kernels", [r["fused_kernels_us"] / r["stream_bound_us"] for r in floor])],
                         ylabel="time / (weight bytes / torch.sum's read rate)", ticks=[1, 1.1, 1.25, 1.5],
                         title="MegaMoE against its weights' streaming floor, DeepSeek-V4-Flash, loopback, H200",
                         ref=(1.25, "floor + 25 %", "--"), ylim=(0.9, 1.6))
    return rows


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_problem_arguments(ap, tokens=[256, 1024, 2048, 8192])
    ap.add_argument("--precision", default="bf16", choices=sorted(GEMMS))
    ap.add_argument("--world", default="loopback")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--cooldown-s", type=float, default=0.0)
    add_output_arguments(ap, out="results/h200/megamoe/graph", figure="graph_layer.png")
    return ap


def main(argv=None):
    """bench_megamoe_graph{tag}.json (everything, with provenance), .csv (the summary rows) and
    _paired.csv under ``--out``."""
    args = build_parser().parse_args(argv)
    if not report_or_gpu_run(args, report):
        return
    cases = problem_cases(args)
    results = []
    for case in bench.progress(cases, desc="graph cases"):
        results.append(run_case(*case, args))
        torch.cuda.empty_cache()
    stem = f"bench_megamoe_graph{args.tag}"
    bench.write_csv(os.path.join(args.out, f"{stem}_paired.csv"), bench.paired_table([r["paired"] for r in results]))
    rows = summary_rows(results)
    bench.write_result(args.out, stem, {"args": vars(args), "cases": results, "summary": rows}, rows)
    for row in rows:
        print(row, flush=True)


if __name__ == "__main__":
    main()
