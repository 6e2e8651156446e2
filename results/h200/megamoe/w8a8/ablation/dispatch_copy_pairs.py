"""Branch comparison (not library code): fused W8A8 with each Dispatch copy in this tree, paired
with torch's two FP8 grouped GEMMs, sustained + cooled, P = 8 (or --P), DeepSeek-V4-Flash."""
import argparse, json, sys, os
import torch
from xstage import bench
from megamoe_interleave.bench import make_problem, rank_weight_views, build_moe, kernel_time_call, check_w8a8_against
from megamoe_interleave.config import MegaMoEConfig
from megamoe_interleave.reference import unfused_pipeline
from megamoe_interleave.shapes import get_shape
from megamoe_interleave.w8a8_bench import fp8_rank_weights, fp8_grouped_gemms

ap = argparse.ArgumentParser()
ap.add_argument("--P", type=int, default=8); ap.add_argument("--tokens", type=int, default=8192)
ap.add_argument("--copies", nargs="+", default=["lsu"]); ap.add_argument("--label", default="tree")
ap.add_argument("--trials", type=int, default=10); ap.add_argument("--cooled", type=int, default=6)
ap.add_argument("--out", default=None)
a = ap.parse_args()
shape = get_shape("deepseek-v4-flash")
w1, w2, xs, idx, wts = make_problem(shape, "balanced", a.P, a.tokens)
w1_t, w2_t = rank_weight_views(shape, a.P, w1, w2)
ref = unfused_pipeline(xs, idx, wts, w1_t, w2_t)
fns, cache = {}, {}
for c in a.copies:
    moe = build_moe(shape, a.P, a.tokens, MegaMoEConfig("interleaved", precision="w8a8", dispatch_copy=c), w1, w2,
                    poison_combine=True, weight_cache=cache)
    ys = moe.forward(xs, idx, wts)
    check_w8a8_against(ys, ref, f"w8a8 {c}")
    moe.poison_combine = False
    print(a.label, c, moe.config, flush=True)
    fns[f"w8a8 {c}"] = kernel_time_call(moe, rerun=True); fns[f"w8a8 {c}"]()
del ref
fns["sgmm x2"] = bench.event_timed(fp8_grouped_gemms(shape, a.P, fp8_rank_weights(shape, a.P, w1, w2), idx, wts))
res = {}
for proto, cd, n in (("sustained", 0.0, a.trials), ("cooled", 1.0, a.cooled)):
    s, cl = bench.paired_trials(fns, n, cd)
    row = bench.paired_verdicts(s, cl, f"w8a8 {a.copies[0]}", 30.0, min_matched=3)
    bench.print_paired(row, label=f"{a.label} P={a.P} {proto}")
    res[proto] = row
if a.out:
    os.makedirs(a.out, exist_ok=True)
    json.dump(res, open(os.path.join(a.out, f"variants_{a.label}_p{a.P}.json"), "w"))
