#!/usr/bin/env python
"""Is a slow fused variant slow because of its MegaMoE object (where its buffers landed) or
because of its compiled kernel? DeepSeek-V4-Flash, loopback P = 8, 8192 tokens/rank, balanced:
two objects per schedule, plus one object of each schedule running on the other schedule's
weights, all timed side by side against the two grouped GEMMs (clock-matched paired trials,
bench_megamoe.paired_trials). Prints per-object ratios and the buffers' offsets in their 2 MB
pages; writes placement.json (samples, clocks) to $OUT or the working directory.

    python scripts/megamoe_object_check.py [trials]

Used once (2026-11-29, commit 5f6b2bc): objects of one schedule agreed to 0.1 %, weights swapped
between schedules changed nothing -- the slow mode followed the schedule's build (ptxas had
serialized its WGMMAs), see results/h200/megamoe/README.md."""
import os, sys, json
sys.path.insert(0, os.path.dirname(__file__)); sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import torch
import bench_megamoe as bm
from megamoe_interleave.api import MegaMoE, make_world
from megamoe_interleave.shapes import get_shape

P, T = 8, 8192
sh = get_shape("deepseek-v4-flash")
w1, w2, xs, idx, wts = bm.make_problem(sh, "balanced", P, T)
_, gemms = bm.grouped_gemms(sh, P, w1, w2, idx, wts)
def make(sched, weights_from=None):
    moe = MegaMoE(make_world("loopback", world_size=P, device="cuda"), poison_combine=False,
                  **bm.fused_kwargs(sh, P, T, sched))
    if weights_from is None:
        moe.load_weights(w1, w2)
    else:
        moe.w1, moe.w2 = weights_from.w1, weights_from.w2
    moe.forward(xs, idx, wts)
    return moe
objs = {"il_a": make("interleaved"), "il_b": make("interleaved"), "ew_a": make("expert_wave"), "ew_b": make("expert_wave")}
# weights swapped: ew object running on il_a's weights, il object on ew_a's weights
objs["ew_wIlA"] = make("expert_wave", objs["il_a"])
objs["il_wEwA"] = make("interleaved", objs["ew_a"])
print("allocated GB", torch.cuda.memory_allocated() / 1e9, flush=True)
def timed(m):
    def f():
        m.forward(xs, idx, wts); return m.last_kernel_us
    f(); return f
fns = {"grouped": bm.event_timed(gemms)}
fns.update({n: timed(m) for n, m in objs.items()})
samples, clocks = bm.paired_trials(fns, int(sys.argv[1]) if len(sys.argv) > 1 else 7, 0.25)
v = bm.paired_verdicts(samples, clocks, "grouped", 30.0)
for n, r in v["variants"].items():
    print(f"{n:10s} ratio {r.get('median_ratio', float('nan')):.3f} n={r['n_matched']} per-trial "
          + " ".join(f"{s / b:.3f}" for s, b in zip(samples[n], samples['grouped'])))
MB2 = 2 << 20
for n, m in objs.items():
    d = 0
    sc = m._scratch.get(d, {})
    print(n, "w1", hex(m.w1[d].data_ptr() % MB2), "w2", hex(m.w2[d].data_ptr() % MB2),
          {k2: hex(t.data_ptr() % MB2) for k2, t in sc.items()},
          "x", hex(m.buffer.x.local(d).data_ptr() % MB2) if hasattr(m.buffer.x, "local") else "")
json.dump({"samples": samples, "clocks": clocks}, open(os.path.join(os.environ.get("OUT", "."), "placement.json"), "w"))
