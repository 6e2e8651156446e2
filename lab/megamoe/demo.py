"""The megamoe_interleave half of ``scripts/run`` on a Hopper GPU, in two parts.

1. **The layer against the GEMMs it replaces.** DeepSeek-V4-Flash (E 256, H 4096, I 2048, top-6),
   loopback P = 1, 8192 tokens, balanced routing. Our fused layer in BF16 and in W8A8 (its kernels
   and the top-k reduction, ``MegaMoE.rerun``) next to the two grouped GEMMs alone: torch's BF16
   ``_grouped_mm``, torch's rowwise FP8 ``_scaled_grouped_mm`` and, where it is importable,
   DeepGEMM's block-scaled FP8 ``m_grouped_fp8_gemm_nt_contiguous`` (:mod:`lab.megamoe.deepgemm`).
   Checked first on a token sample: BF16 against the fp32 reference, W8A8 against the recipe's
   emulation. Paired, rotated trials, each call after a 0.25 s cool-down, clock-matched.
2. **The paper's effect on one GPU.** The same shape at 2048 tokens with the Combine over PCIe
   (world ``loopback+host``: the Combine slots in pinned host memory, the measured
   ``h200-pcie-host`` path) and without it (``loopback``, the control), both schedules: the measured
   speedup T_expert_wave / T_interleaved next to the model's (:func:`xstage.model.kernel_rate_bounds`
   with the control's times as the compute and the profile's drain rate R), and what
   ``schedule="auto"`` picks there.

Weights and inputs are drawn on the GPU (seconds instead of minutes); the kernels' times do not
depend on the values.
"""
from __future__ import annotations

import math

SHAPE = "deepseek-v4-flash"
CHECK_TOKENS = 64
L1_FLOP_SHARE = 2.0 / 3.0  # Linear-1 is 2I x H per row, Linear-2 H x I: the compute split of the model


def problem(shape, P: int, tokens: int, seed: int = 0):
    """Weights [E, 2I, H] / [E, H, I] and per-rank inputs and balanced routing, on the GPU."""
    import torch

    from lab.megamoe.routing import make_routing

    E, H, I, k = shape.num_experts, shape.hidden, shape.intermediate, shape.topk
    g = torch.Generator(device="cuda").manual_seed(seed)
    w1 = torch.randn(E, 2 * I, H, generator=g, device="cuda", dtype=torch.bfloat16) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g, device="cuda", dtype=torch.bfloat16) / I ** 0.5
    xs = [torch.randn(tokens, H, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(P)]
    routes = [make_routing("balanced", tokens, E, k, seed=r) for r in range(P)]
    return w1, w2, xs, [r[0].cuda() for r in routes], [r[1].cuda() for r in routes]


def layers_against_gemms(*, P: int = 1, tokens: int = 8192, trials: int = 11, cooldown_s: float = 0.25) -> dict:
    import torch

    from lab import bench
    from lab.megamoe import deepgemm
    from lab.megamoe.bench import build_moe, grouped_gemms
    from lab.megamoe.w8a8_bench import fp8_grouped_gemms, fp8_rank_weights
    from megamoe_interleave import MegaMoEConfig, quant
    from megamoe_interleave.reference import (W8A8_KERNEL_REL_ERROR, reference_moe_fp32, reference_moe_w8a8,
                                              relative_error)
    from megamoe_interleave.shapes import get_shape

    shape = get_shape(SHAPE)
    w1, w2, xs, idx, wts = problem(shape, P, tokens)
    sample = torch.randperm(tokens, generator=torch.Generator().manual_seed(1))[:CHECK_TOKENS].cuda()
    picked = ([x[sample] for x in xs], [i[sample] for i in idx], [w[sample] for w in wts])
    out = {"shape": f"DeepSeek-V4-Flash MoE, loopback P = {P}, {tokens} tokens per rank, balanced routing",
           "checks": {}, "configs": {}}
    fns = {}
    for precision in ("bf16", "w8a8"):
        moe = build_moe(shape, P, tokens, MegaMoEConfig("interleaved", precision=precision), w1, w2,
                        poison_combine=True)
        ys = [y[sample] for y in moe(xs, idx, wts)]
        if precision == "bf16":
            err = relative_error(ys, reference_moe_fp32(*picked, w1, w2))
            ok = err <= 0.01
        else:  # the recipe exactly, on the same quantized weights
            err = relative_error(ys, reference_moe_w8a8(*picked, *quant.quantize_weights(w1, w2)))
            ok = err <= W8A8_KERNEL_REL_ERROR
        out["checks"][precision] = {"relative_error": err, "against": "fp32 reference" if precision == "bf16"
                                    else "the W8A8 recipe's emulation", "ok": ok}
        out["configs"][precision] = str(moe.config)
        moe.poison_combine = False
        fns[f"fused {precision}"] = rerun_time(moe)
    _, gemms = grouped_gemms(shape, P, w1, w2, idx, wts)
    fns["torch bf16 GEMMs"] = bench.event_timed(gemms)
    fns["torch fp8 GEMMs"] = bench.event_timed(fp8_grouped_gemms(shape, P, fp8_rank_weights(shape, P, w1, w2), idx, wts))
    dg_run, note = deepgemm.paired_variant(shape, P, w1, w2, idx)  # None if absent or off by > 1 %
    out["deepgemm"] = note["deepgemm"]
    if "check" in note:
        out["checks"]["deepgemm"] = dict(note["check"], ok=dg_run is not None)
    if dg_run is not None:
        fns["DeepGEMM fp8 GEMMs"] = bench.event_timed(dg_run)
    samples, clocks = bench.paired_trials(fns, trials, cooldown_s)
    fp8_base = "DeepGEMM fp8 GEMMs" if dg_run is not None else "torch fp8 GEMMs"
    out["paired"] = {base: bench.paired_verdicts(samples, clocks, base, 30.0) for base in ("torch bf16 GEMMs", fp8_base)}
    flops = 6 * sum(int((i >= 0).sum()) for i in idx) * shape.hidden * shape.intermediate
    out["median_us"] = {k: _median(v) for k, v in samples.items()}
    out["tflops"] = {k: flops / us / 1e6 for k, us in out["median_us"].items()}
    out["ok"] = all(c["ok"] for c in out["checks"].values())
    return out


def xstage_on_pcie(*, P: int = 1, tokens: int = 2048, trials: int = 11, cooldown_s: float = 0.25) -> dict:
    import torch

    from lab import bench, paired
    from lab.megamoe.bench import build_moe
    from megamoe_interleave import MegaMoE, MegaMoEConfig, make_world
    from megamoe_interleave.reference import reference_moe_fp32, relative_error
    from megamoe_interleave.shapes import get_shape
    from xstage import model, profiles

    shape = get_shape(SHAPE)
    w1, w2, xs, idx, wts = problem(shape, P, tokens, seed=2)
    sample = torch.arange(min(CHECK_TOKENS, tokens), device="cuda")
    ref = reference_moe_fp32([x[sample] for x in xs], [i[sample] for i in idx], [w[sample] for w in wts], w1, w2)
    weights = {}  # the four layers share one copy of the kernel-layout weights
    fns, checks = {}, {}
    for world in ("loopback", "loopback+host"):
        for schedule in ("expert_wave", "interleaved"):
            name = f"{world} {schedule}"
            moe = build_moe(shape, P, tokens, MegaMoEConfig(schedule), w1, w2, world=world, poison_combine=True,
                            weight_cache=weights)
            err = relative_error([y[sample] for y in moe(xs, idx, wts)], ref)
            checks[name] = {"relative_error_vs_fp32": err, "ok": err <= 0.01}
            moe.poison_combine = False
            fns[name] = rerun_time(moe)
    samples, clocks = bench.paired_trials(fns, trials, cooldown_s)
    out = {"shape": f"DeepSeek-V4-Flash MoE, P = {P}, {tokens} tokens per rank, balanced routing", "checks": checks}
    profile = profiles.load("h200-pcie-host")
    volume = P * tokens * shape.topk * shape.hidden * 2  # the Combine's bf16 rows, every rank's on the one path
    for world in ("loopback", "loopback+host"):
        ew, il = f"{world} expert_wave", f"{world} interleaved"
        idx_m = paired.matched_trials(clocks, [ew, il], 30.0)
        out[world] = {"expert_wave_us": _median([samples[ew][i] for i in idx_m]),
                      "interleaved_us": _median([samples[il][i] for i in idx_m]),
                      "speedup": _median([samples[ew][i] / samples[il][i] for i in idx_m]),
                      "matched_trials": len(idx_m)}
    control = out["loopback"]
    pred = {s: model.kernel_rate_bounds(L1_FLOP_SHARE * control[f"{s}_us"] * 1e-6,
                                        (1 - L1_FLOP_SHARE) * control[f"{s}_us"] * 1e-6, volume, profile.R)[pick] * 1e6
            for s, pick in (("expert_wave", 1), ("interleaved", 0))}
    out["model"] = {"platform": profile.name, "R_bytes_per_s": profile.R, "combine_bytes": volume,
                    "expert_wave_us": pred["expert_wave"], "interleaved_us": pred["interleaved"],
                    "speedup": pred["expert_wave"] / pred["interleaved"]}
    auto = MegaMoE(make_world("loopback+host", world_size=P, device="cuda"), shape.num_experts, shape.hidden,
                   shape.intermediate, shape.topk, tokens, MegaMoEConfig("auto"))
    out["auto"] = {"schedule": auto.schedule_choice.schedule, "why": str(auto.schedule_choice)}
    out["samples_us"], out["clocks_mhz"] = samples, clocks
    out["ok"] = all(c["ok"] for c in checks.values())
    return out


def run() -> dict:
    layers = layers_against_gemms()
    pcie = xstage_on_pcie()
    return {"layers": layers, "xstage_pcie": pcie, "ok": layers["ok"] and pcie["ok"]}


def print_summary(moe: dict) -> None:
    layers, pcie = moe["layers"], moe["xstage_pcie"]
    print(f"\n== megamoe_interleave: {layers['shape']}")
    for name, c in layers["checks"].items():
        err = c.get("relative_error", c.get("relative_error_l1_expert0"))
        print(f"   check {name:9s} relative error {err:.2e} ({c.get('against', 'dequantized fp32, L1 of one expert')})"
              f" -> {'ok' if c['ok'] else 'FAILED'}")
    print(f"   {layers['deepgemm']}")
    print("   times: our fused kernel alone (no input staging, planning or top-k reduction) against the "
          "baselines' two grouped GEMMs alone")
    for base, row in layers["paired"].items():
        print(f"   against {base} (paired, {row['reference_clock_mhz']} MHz, cooled):")
        for name, v in row["variants"].items():
            if name.startswith("fused"):
                ratio = f"{v['median_ratio']:.3f}x its time" if v.get("n_matched") else "no clock-matched trial"
                print(f"     {name:10s} {ratio}")
    for name, us in layers["median_us"].items():
        print(f"   {name:20s} {us:9.0f} us {layers['tflops'][name]:6.0f} TFLOP/s")
    print(f"\n== X-Stage on one GPU: {pcie['shape']}, Combine over PCIe vs loopback")
    for world in ("loopback", "loopback+host"):
        w = pcie[world]
        print(f"   {world:14s} expert_wave {w['expert_wave_us']:8.0f} us  interleaved {w['interleaved_us']:8.0f} us  "
              f"expert_wave / interleaved {w['speedup']:.3f} ({w['matched_trials']} matched trials)")
    m = pcie["model"]
    print(f"   model ({m['platform']}, R = {m['R_bytes_per_s'] / 1e9:.1f} GB/s, Combine {m['combine_bytes'] / 2**20:.0f} MiB):"
          f" expert_wave {m['expert_wave_us']:.0f} us, interleaved {m['interleaved_us']:.0f} us, speedup {m['speedup']:.3f}")
    print(f"   schedule='auto' over PCIe picks {pcie['auto']['schedule']}")


def plot(moe: dict, path) -> bool:
    """Both parts as one figure (``path``, PNG); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    layers, pcie = moe["layers"], moe["xstage_pcie"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(layers["median_us"])
    a.barh(names, [layers["median_us"][n] / 1e3 for n in names],
           color=["tab:blue" if n.startswith("fused") else "tab:gray" for n in names])
    a.set_xlabel("ms per call, median of cooled trials\n(our fused kernel; the baselines' two GEMMs alone)")
    a.set_title("DeepSeek-V4-Flash MoE, P = 1, 8192 tokens")
    a.invert_yaxis()
    worlds = ("loopback", "loopback+host")
    x = range(len(worlds))
    for off, sched in ((-0.2, "expert_wave"), (0.2, "interleaved")):
        b.bar([i + off for i in x], [pcie[w][f"{sched}_us"] / 1e3 for w in worlds], width=0.4, label=sched)
    b.scatter([1 - 0.2, 1 + 0.2], [pcie["model"]["expert_wave_us"] / 1e3, pcie["model"]["interleaved_us"] / 1e3],
              marker="_", s=600, color="k", label="model (eq. 11, whole kernel)")
    b.set_xticks(list(x), ["loopback (control)", "Combine over PCIe"])
    b.set_ylabel("ms per fused-kernel call")
    b.set_title(f"P = 1, 2048 tokens; expert_wave / interleaved\nover PCIe {pcie['loopback+host']['speedup']:.2f}x, "
                f"model {pcie['model']['speedup']:.2f}x")
    b.set_ylim(0, 1.35 * max(b.get_ylim()[1], 1e-9))  # room for the legend above the bars
    b.legend(loc="upper left", ncol=2, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def rerun_time(moe):
    """() -> the fused kernels' device time of one call (the staged inputs again: MegaMoE.rerun)."""
    def timed():
        moe.rerun()
        return moe.last_kernel_us
    return timed


def _median(values):
    import statistics

    values = list(values)
    return statistics.median(values) if values else math.nan
