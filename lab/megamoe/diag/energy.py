#!/usr/bin/env python3
"""Energy per call of the fused MoE kernels and of the two grouped GEMMs, from NVML's energy
counter, with the power, SM clock and clock-event reasons NVML reports while they run.

Why: inside a call the kernel clocks well below what NVML's clock reading says
(results/h200/megamoe/trace_clock/), which points at a power cap. Under a cap, the run time
follows the energy each call needs, so J per call is the number to compare.

Per variant, rotated over ``--rounds``: a host sleep (``--cooldown-s``), then back-to-back calls
(each synchronised) for ``--burst-s``. The energy counter's delta over the burst gives J/call and
the mean power. A sampler thread meanwhile reads NVML's instantaneous power field, the SM clock
and the clock-event reasons every ``--sample-ms``. The variants are "fused[<schedule>]"
(``MegaMoE.rerun``: the kernels of every rank and the top-k reductions on the staged inputs,
no host planning; its output is first checked equal to ``forward``'s), "reduce" (the top-k
reductions alone, to subtract), "grouped_mm x2" (the bench's baseline) and "idle" (the sleep
alone, the idle power). The summary's "fused[<schedule>] - reduce" rows take the reductions
out, but every row still holds the host time between and inside calls (launch preparation, the
error read, the grouped GEMMs' offset uploads), at a lower power and of different lengths per
variant (wall ms/call minus device time: ~6 ms for fused, ~5 ms for the GEMMs at P = 8;
results/h200/megamoe/README.md, "Power cap"). So the J/call ratios bound the kernels' energy ratio
only loosely; what the rows show firmly is the mean power and clock under sustained load.

    python scripts/diag/megamoe_energy.py --P 8 --tokens 8192 --out results/h200/megamoe/energy
"""
import argparse
import os
import statistics
import threading
import time

import torch

from lab import paired
from lab.megamoe import bench
from megamoe_interleave.config import MegaMoEConfig
from megamoe_interleave.shapes import get_shape
from xstage import provenance

POWER_INSTANT_FIELD = 186  # NVML_FI_DEV_POWER_INSTANT (mW)
REASON_BITS = {0x1: "gpu_idle", 0x2: "app_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
               0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake", 0x100: "display_clocks"}


class Nvml:
    """The NVML readings this script needs, for torch's current device (its CUDA index taken
    as the NVML index: run without a CUDA_VISIBLE_DEVICES remapping)."""

    def __init__(self):
        import pynvml

        self.nv = pynvml
        pynvml.nvmlInit()
        self.h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        self._reasons = reasons or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons

    def energy_j(self) -> float:
        return self.nv.nvmlDeviceGetTotalEnergyConsumption(self.h) / 1e3

    def sample(self) -> dict:
        out = {"sm_mhz": self.nv.nvmlDeviceGetClockInfo(self.h, self.nv.NVML_CLOCK_SM),
               "reasons": int(self._reasons(self.h))}
        try:
            v = self.nv.nvmlDeviceGetFieldValues(self.h, [POWER_INSTANT_FIELD])[0]
            out["power_w"] = v.value.uiVal / 1e3 if v.nvmlReturn == 0 else None
        except Exception:
            out["power_w"] = None
        return out

    def limit_w(self) -> float:
        return self.nv.nvmlDeviceGetEnforcedPowerLimit(self.h) / 1e3


class Sampler(threading.Thread):
    """Reads Nvml.sample() every ``period_s`` while ``on`` is set."""

    def __init__(self, nvml: Nvml, period_s: float):
        super().__init__(daemon=True)
        self.nvml, self.period_s = nvml, period_s
        self.on, self.stop, self.samples = threading.Event(), threading.Event(), []

    def run(self):
        while not self.stop.is_set():
            if self.on.is_set():
                self.samples.append(self.nvml.sample())
            time.sleep(self.period_s)

    def take(self) -> list:
        out, self.samples = self.samples, []
        return out


def burst(fn, nvml: Nvml, sampler: Sampler, burst_s: float) -> dict:
    """Back-to-back synchronised calls of ``fn`` for ``burst_s``: energy, time and NVML samples."""
    torch.cuda.synchronize()
    sampler.take()
    sampler.on.set()
    e0, t0, calls = nvml.energy_j(), time.perf_counter(), 0
    while time.perf_counter() - t0 < burst_s:
        fn()
        torch.cuda.synchronize()
        calls += 1
    wall, e1 = time.perf_counter() - t0, nvml.energy_j()
    sampler.on.clear()
    s = sampler.take()
    power = [x["power_w"] for x in s if x["power_w"] is not None]
    reasons = 0
    for x in s:
        reasons |= x["reasons"]
    return {"calls": calls, "wall_s": wall, "energy_j": e1 - e0, "j_per_call": (e1 - e0) / max(calls, 1),
            "mean_w": (e1 - e0) / wall, "ms_per_call": wall * 1e3 / max(calls, 1),
            "instant_w_median": statistics.median(power) if power else None,
            "instant_w_max": max(power) if power else None,
            "sm_mhz_median": statistics.median(x["sm_mhz"] for x in s) if s else None,
            "sm_mhz_min": min(x["sm_mhz"] for x in s) if s else None,
            "reasons": [name for bit, name in REASON_BITS.items() if reasons & bit], "samples": len(s)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_one_problem_args(ap)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--burst-s", type=float, default=2.0)
    ap.add_argument("--cooldown-s", type=float, default=1.0)
    ap.add_argument("--sample-ms", type=float, default=2.0)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default="results/h200/megamoe/energy")
    args = ap.parse_args()
    if min(args.P, args.tokens, args.rounds) < 1 or args.burst_s <= 0:
        raise SystemExit("--P, --tokens, --rounds must be >= 1 and --burst-s > 0")
    nvml = Nvml()
    shape = get_shape(args.shape)
    w1, w2, xs, idx, wts = bench.make_problem(shape, "balanced", args.P, args.tokens)
    fns, moes = {}, {}
    for sched in args.schedules:
        moe = bench.build_moe(shape, args.P, args.tokens, MegaMoEConfig(sched), w1, w2)
        ys = moe.forward(xs, idx, wts)  # compile + warm-up; rerun() repeats its device work
        if not all(torch.equal(a, b) for a, b in zip(ys, moe.rerun())):
            raise SystemExit(f"{sched}: rerun() output differs from forward()'s")
        moes[sched] = moe
        fns[f"fused[{sched}]"] = moe.rerun
    any_moe = next(iter(moes.values()))
    fns["reduce"] = lambda: [any_moe.reduce_rank(r) for r in any_moe.world.local_ranks]
    _, fns[bench.BASELINE] = bench.grouped_gemms(shape, args.P, w1, w2, idx, wts)
    fns["idle"] = lambda: time.sleep(0.05)
    for fn in fns.values():
        fn()
    sampler = Sampler(nvml, args.sample_ms / 1e3)
    sampler.start()
    rows = {k: [] for k in fns}
    for rnd in range(args.rounds):
        for name in paired.rotated(list(fns), rnd):
            time.sleep(args.cooldown_s)
            rows[name].append(burst(fns[name], nvml, sampler, args.burst_s))
            r = rows[name][-1]
            print(f"round {rnd + 1}/{args.rounds} {name:22s} {r['calls']:4d} calls {r['ms_per_call']:8.2f} ms "
                  f"{r['j_per_call']:8.3f} J/call {r['mean_w']:6.0f} W mean, instant median {r['instant_w_median']} W, "
                  f"SM {r['sm_mhz_median']} MHz (min {r['sm_mhz_min']}), {r['reasons']}", flush=True)
    sampler.stop.set()
    summary = {}
    print(f"\npower limit {nvml.limit_w():.0f} W; medians over {args.rounds} rounds")
    print(f"{'variant':22s} {'ms/call':>9s} {'J/call':>9s} {'mean W':>7s} {'inst W':>7s} {'SM MHz':>7s}")
    for name, rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("ms_per_call", "j_per_call", "mean_w")}
        inst = [r["instant_w_median"] for r in rs if r["instant_w_median"] is not None]
        mhz = [r["sm_mhz_median"] for r in rs if r["sm_mhz_median"] is not None]
        med["instant_w_median"] = statistics.median(inst) if inst else None
        med["sm_mhz_median"] = statistics.median(mhz) if mhz else None
        summary[name] = med
        print(f"{name:22s} {med['ms_per_call']:9.2f} {med['j_per_call']:9.3f} {med['mean_w']:7.0f} "
              f"{med['instant_w_median'] or float('nan'):7.0f} {med['sm_mhz_median'] or float('nan'):7.0f}")
    for sched in args.schedules:
        name = f"fused[{sched}]"
        est = {k: summary[name][k] - summary["reduce"][k] for k in ("j_per_call", "ms_per_call")}
        est["vs_grouped_j"] = est["j_per_call"] / summary[bench.BASELINE]["j_per_call"]
        summary[f"{name} - reduce"] = est
        print(f"{name + ' - reduce':22s} {est['ms_per_call']:9.2f} {est['j_per_call']:9.3f}   "
              f"J/call vs grouped_mm x2: {est['vs_grouped_j']:.3f}")
    os.makedirs(args.out, exist_ok=True)
    provenance.write_json(os.path.join(args.out, f"energy{args.tag}.json"),
                          {"args": vars(args), "power_limit_w": nvml.limit_w(), "summary": summary, "rounds": rows})


if __name__ == "__main__":
    main()
