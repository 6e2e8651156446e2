#!/usr/bin/env python
"""FA4 + Ulysses post-attention All-to-All on one H200 (paper Section 5.3, Table 3, Fig. 11).

One rank's sender-visible time (rank 0 of a world of P ranks) for DiT shapes (B = 1, head_dim 128,
H heads, sequence M, Hl = H / P heads per rank):

  stock          flash_attn.cute.flash_attn_func on the rank's [1, M, Hl, 128] (reference point)
  fa_only        the same kernel class with the stock epilogue (local output)      [T_FA]
  fa_only_pers   ... static persistent tile order (own O staging buffer)
  a2a_only       the post-attention volume moved without attention (device copies into the P
                 destination buffers of the world)
  serial         fa_only, then a2a_only                                              [T_serial]
  fused          FA4 whose epilogue stores every tile at its Ulysses destination    [T_fused]
  fused_pers     ... static persistent tile order, own O staging buffer in smem
  fused_pers_dq  ... static persistent, sO aliasing sQ with Q's release deferred past the epilogue

Method: every variant is captured once in a CUDA graph; a trial times ``replays`` back-to-back
replays between two CUDA events (one boundary after the replays, none per iteration); trials of
all variants are interleaved with a rotated order (DVFS drift hits every variant alike); median
of >= 21 trials.  E_res = T_fused - T_FA, hiding ratio H = 1 - E_res / (T_serial - T_FA) (eq. 21),
speedup = T_serial / T_fused.

Worlds: ``loopback`` (all P destination buffers in this GPU's HBM: the fused stores are local
stores, a control for issue cost) and ``host`` (destinations in pinned host memory: the stores
drain over PCIe, a real X-Stage path on one GPU).  The Burst-Gap prediction (eq. 18-20) uses an
``xstage.profiles`` platform and sigma measured from T_FA here.

  python scripts/bench_fa_a2a.py                       # full sweep, loopback, P = 8
  python scripts/bench_fa_a2a.py --world host --seqs 8192 16384 32768
  python scripts/bench_fa_a2a.py --plot results/h200/fa4_a2a/bench_loopback.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = ("stock", "fa_only", "fa_only_pers", "a2a_only", "serial", "fused", "fused_pers", "fused_pers_dq")
TILE_M = TILE_N = 128


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", choices=("loopback", "host"), default="loopback")
    p.add_argument("--P", type=int, default=8)
    p.add_argument("--heads", type=int, nargs="+", default=[24, 40])
    p.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384, 32768, 49152, 65536])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--trials", type=int, default=21)
    p.add_argument("--target-trial-us", type=float, default=3000.0, help="replays per trial ~ this / T")
    p.add_argument("--max-replays", type=int, default=20)
    p.add_argument("--profile", default=None, help="xstage.profiles name/path for the model prediction")
    p.add_argument("--out", default="results/h200/fa4_a2a")
    p.add_argument("--tag", default=None, help="output file stem (default bench_<world>)")
    p.add_argument("--plot", default=None, help="only draw the figure from this JSON")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- timing


def _capture(fn):
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    return g


def time_interleaved(fns: dict, trials: int, target_us: float, max_replays: int):
    """Median-of-trials per-call time of each fn (dict name -> Timing), interleaved + rotated."""
    import torch
    from xstage.timing import Timing

    graphs = {k: _capture(f) for k, f in fns.items()}
    # Size each variant's trial from one untimed replay burst.
    replays = {}
    for k, g in graphs.items():
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(3):
            g.replay()
        b.record()
        b.synchronize()
        est = a.elapsed_time(b) * 1e3 / 3
        replays[k] = int(max(3, min(max_replays, math.ceil(target_us / max(est, 1.0)))))
    samples = {k: [] for k in graphs}
    clocks = {k: [] for k in graphs}  # SM clock (MHz) read right after each trial: DVFS shows up here
    names = list(graphs)
    for t in range(trials):
        order = names[t % len(names):] + names[: t % len(names)]
        for k in order:
            g, n = graphs[k], replays[k]
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(n):
                g.replay()
            b.record()
            b.synchronize()
            samples[k].append(a.elapsed_time(b) * 1e3 / n)
            clocks[k].append(_sm_clock_mhz())
    del graphs
    return {k: Timing(v) for k, v in samples.items()}, replays, clocks


def _sm_clock_mhz():
    """Current SM clock through NVML (None where NVML is unavailable)."""
    import torch

    try:
        return torch.cuda.clock_rate()
    except Exception:
        return None


def paired_stats(timings: dict, a: str, b: str) -> dict:
    """Per-trial differences a - b (same trial, rotated order): robust to slow drift that moves
    both medians. Returns the median difference and the fraction of trials with a > b."""
    sa, sb = timings[a].samples_us, timings[b].samples_us
    d = sorted(x - y for x, y in zip(sa, sb))
    return {"median_diff_us": d[len(d) // 2], "frac_positive": sum(x > 0 for x in d) / len(d)}


# ----------------------------------------------------------------------------- model


def load_platform(name):
    from xstage import profiles

    candidates = [name] if name else ["h200-nvlink", "h200-pcie-host", "paper-b200-nvlink"]
    for c in candidates:
        try:
            return profiles.load(c)
        except Exception:
            continue
    return None


def model_prediction(platform, M, H_local, t_fa_us, num_sms, out_bytes=2, head_dim=128):
    """Burst-Gap prediction (eq. 17-20) for one rank; times in microseconds."""
    from xstage import model

    tiles = math.ceil(M / TILE_M) * H_local
    K = min(num_sms, tiles)
    waves = math.ceil(tiles / K)
    V = model.fa_burst_volume(K, TILE_M, head_dim, out_bytes)
    kv_tiles = math.ceil(M / TILE_N)
    sigma_meas = t_fa_us * 1e-6 / (waves * kv_tiles)  # measured Q-loop time per KV tile
    g_qloop = model.qloop_gap(M, TILE_N, sigma_meas)
    g_qk = sigma_meas / 2  # one QK^T half of a KV-tile step (the local double-buffer cover)
    out = {"tiles": tiles, "K": K, "waves": waves, "V_bytes": V, "sigma_meas_us": sigma_meas * 1e6,
           "G_qloop_us": g_qloop * 1e6}
    if platform is None:
        return out
    t_iss0 = platform.t_iss0_at(K, V)  # V: aggregate burst volume
    out.update(
        platform=platform.name,
        R=platform.R,
        t_iss0_us=t_iss0 * 1e6,
        Q_bytes=platform.q_at(K),
        capacity_ok=(V - platform.R * t_iss0) <= platform.q_at(K),
        G_star_us=model.recovery_gap(V, platform.R, t_iss0) * 1e6,
        M_star_ub=model.m_star_ub(V, platform.R, t_iss0, sigma_meas, TILE_N),
        E_drain_us=model.drain_residual(waves, V, platform.R, t_iss0, g_qloop, g_qk) * 1e6,
        # Capacity-aware steady state (xstage.model.steady_issue_time, not in the paper): when one
        # aligned burst overfills X-Stage (V - R*T_iss0 > Q) every wave stalls ~(V - Q)/R.
        E_cap_us=waves * max(0.0, model.steady_issue_time(g_qloop, V, platform.R, t_iss0, platform.q_at(K))
                             - t_iss0 - g_qk) * 1e6,
        E_cc_us=waves * model.completion_coupled_exposure(V, platform.R, 0.0, g_qk) * 1e6,
        # Not in the paper: a kernel completes only when its stores have drained, so the last
        # wave's burst (no following Q-loop to hide it) is exposed at the kernel boundary.
        E_tail_us=(tiles - (waves - 1) * K) * (V // K) / platform.R * 1e6,
        design_test=model.design_test(V, g_qloop, platform.R, t_iss0, platform.q_at(K)).as_dict(),
    )
    return out


def remodel(payload, profile):
    """Recompute every row's model prediction with another platform profile (CPU only)."""
    platform = load_platform(profile)
    if platform is None:
        raise SystemExit(f"profile {profile!r} not found")
    for r in payload["rows"]:
        if "fa_only" in r["median_us"]:
            r["model"] = model_prediction(platform, r["M"], r["H_local"], r["median_us"]["fa_only"],
                                          payload["num_sms"], 2 if r["dtype"] in ("bf16", "fp16") else 4,
                                          r["head_dim"])
    payload.setdefault("remodelled_with", []).append(platform.name)
    return payload


# ----------------------------------------------------------------------------- run


def run(args):
    import torch

    import fa4_a2a
    from fa4_a2a.baselines import a2a_copy
    from flash_attn.cute import flash_attn_func
    from xstage.world import make_world

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    P, D = args.P, args.head_dim
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    platform = load_platform(args.profile)
    world = make_world(args.world, P)
    rows = []
    for H in args.heads:
        if H % P:
            raise SystemExit(f"heads {H} not divisible by P={P}")
        Hl = H // P
        for M in args.seqs:
            if M % P:
                raise SystemExit(f"M={M} not divisible by P={P}")
            g = torch.Generator(device="cuda").manual_seed(M + H)
            q, k, v = (torch.randn(1, M, Hl, D, generator=g, device="cuda").to(dtype) for _ in range(3))
            o_local = torch.empty_like(q)
            dest = world.alloc((1, M // P, H, D), dtype)
            dests = [dest.local(j) for j in range(P)]
            table = (dest.peer_table(0) + 0 * Hl * D * q.element_size()).contiguous()  # rank 0
            fns = {
                "stock": lambda: flash_attn_func(q, k, v),
                "fa_only": lambda: fa4_a2a.attention_local(q, k, v, o_local),
                "fa_only_pers": lambda: fa4_a2a.attention_local(q, k, v, o_local, persistent=True),
                "a2a_only": lambda: a2a_copy(o_local, dests, 0),
                "serial": lambda: (fa4_a2a.attention_local(q, k, v, o_local), a2a_copy(o_local, dests, 0)),
                "fused": lambda: fa4_a2a.attention_a2a(q, k, v, dests[0], table, num_ranks=P),
                "fused_pers": lambda: fa4_a2a.attention_a2a(q, k, v, dests[0], table, num_ranks=P, persistent=True),
                "fused_pers_dq": lambda: fa4_a2a.attention_a2a(q, k, v, dests[0], table, num_ranks=P, persistent=True,
                                                               o_staging="defer_q"),
            }
            fns = {n: fns[n] for n in args.variants}
            t0 = time.time()
            timings, replays, clocks = time_interleaved(fns, args.trials, args.target_trial_us, args.max_replays)
            med = {n: t.median_us for n, t in timings.items()}
            row = {"H": H, "H_local": Hl, "M": M, "P": P, "head_dim": D, "dtype": args.dtype,
                   "world": args.world, "replays": replays,
                   "timings": {n: t.as_dict() for n, t in timings.items()}, "median_us": med,
                   "sm_clock_mhz": clocks, "wall_s": time.time() - t0}
            for fused in FUSED:
                if fused in med and "serial" in med:
                    row[f"paired_serial_minus_{fused}"] = paired_stats(timings, "serial", fused)
            if "fa_only" in med:
                t_fa = med["fa_only"]
                if "stock" in med:
                    row["fa_only_vs_stock"] = t_fa / med["stock"]
                if "fused_pers" in med and "fa_only_pers" in med:
                    # residual of the persistent fused kernel over its own (persistent) FA-only path
                    row["E_res_pers_vs_fa_pers_us"] = med["fused_pers"] - med["fa_only_pers"]
                for fused in FUSED:
                    if fused in med:
                        e_res = med[fused] - t_fa
                        row[f"E_res_{fused}_us"] = e_res
                        row[f"{fused}_vs_fa"] = med[fused] / t_fa
                        if "serial" in med:
                            row[f"H_{fused}"] = 1.0 - e_res / (med["serial"] - t_fa)
                            row[f"speedup_{fused}"] = med["serial"] / med[fused]
                row["model"] = model_prediction(platform, M, Hl, t_fa, num_sms, q.element_size(), D)
            rows.append(row)
            print_row(row)
            fns = timings = None  # drop the graphs' references before the next shape allocates
            torch.cuda.empty_cache()
    return {"config": vars(args), "num_sms": num_sms, "rows": rows}


FUSED = ("fused", "fused_pers", "fused_pers_dq")
DERIVED = (
    [("fa_only_vs_stock", "{:.4f}"), ("E_res_pers_vs_fa_pers_us", "{:+.1f}")]
    + [(f"E_res_{f}_us", "{:+.1f}") for f in FUSED]
    + [(f"H_{f}", "{:.0%}") for f in FUSED]
    + [(f"speedup_{f}", "{:.3f}x") for f in FUSED]
    + [(f"{f}_vs_fa", "{:.4f}") for f in FUSED]
)


def print_row(r):
    m = r["median_us"]
    cols = " ".join(f"{n}={m[n]:.1f}" for n in VARIANTS if n in m)
    extra = " ".join(
        f"{k}={r[k]:+.1f}" if k.startswith("E_res") else f"{k}={r[k]:.3f}" for k, _ in DERIVED if k in r)
    print(f"H={r['H']:3d} M={r['M']:6d} | {cols} | {extra}", flush=True)


def table3(payload):
    """Markdown Table 3 (per head count): rows = methods, columns = M."""
    lines = []
    rows = payload["rows"]
    for H in sorted({r["H"] for r in rows}):
        rs = [r for r in rows if r["H"] == H]
        lines.append(f"\n### H = {H} heads (P = {rs[0]['P']}, Hl = {rs[0]['H_local']}, world {rs[0]['world']}), times in us\n")
        lines.append("| method | " + " | ".join(f"M={r['M']}" for r in rs) + " |")
        lines.append("|---" * (len(rs) + 1) + "|")
        for name in VARIANTS:
            if name in rs[0]["median_us"]:
                lines.append(f"| {name} | " + " | ".join(f"{r['median_us'][name]:.1f}" for r in rs) + " |")
        for key, fmt in DERIVED:
            if key in rs[0]:
                lines.append(f"| {key} | " + " | ".join(fmt.format(r[key]) for r in rs) + " |")
        if "E_drain_us" in rs[0].get("model", {}):
            lines.append("| model E_drain (us) | " + " | ".join(f"{r['model']['E_drain_us']:.1f}" for r in rs) + " |")
            lines.append("| model E_cc (us) | " + " | ".join(f"{r['model']['E_cc_us']:.1f}" for r in rs) + " |")
            if "E_cap_us" in rs[0]["model"]:
                lines.append("| model E_cap (us) | " + " | ".join(f"{r['model']['E_cap_us']:.1f}" for r in rs) + " |")
            if "E_tail_us" in rs[0]["model"]:
                lines.append("| model E_tail (us) | " + " | ".join(f"{r['model']['E_tail_us']:.1f}" for r in rs) + " |")
            lines.append("| model M*_ub | " + " | ".join(f"{r['model']['M_star_ub']:.0f}" for r in rs) + " |")
    return "\n".join(lines) + "\n"


def plot(payload, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not available: no figure")
        return None
    rows = payload["rows"]
    heads = sorted({r["H"] for r in rows})
    fig, axes = plt.subplots(1, len(heads), figsize=(5.5 * len(heads), 4), squeeze=False)
    for ax, H in zip(axes[0], heads):
        rs = sorted((r for r in rows if r["H"] == H), key=lambda r: r["M"])
        Ms = [r["M"] for r in rs]
        for key, label in (("E_res_fused_us", "fused"), ("E_res_fused_pers_us", "fused (persistent, own sO)"),
                           ("E_res_fused_pers_dq_us", "fused (persistent, deferred Q)")):
            if key in rs[0]:
                ax.plot(Ms, [100 * r[key] / r["median_us"]["fa_only"] for r in rs], "o-", label=f"measured {label}")
        mdl = rs[0].get("model", {})
        if "E_drain_us" in mdl:
            ax.plot(Ms, [100 * r["model"]["E_drain_us"] / r["median_us"]["fa_only"] for r in rs], "k--",
                    label=f"X-Stage model E_drain ({mdl['platform']})")
            ax.plot(Ms, [100 * r["model"]["E_cc_us"] / r["median_us"]["fa_only"] for r in rs], "r:",
                    label="completion-coupled E_cc")
            if "E_cap_us" in mdl:
                ax.plot(Ms, [100 * r["model"]["E_cap_us"] / r["median_us"]["fa_only"] for r in rs], "g-.",
                        label="capacity-aware E_cap (V>Q)")
            if "E_tail_us" in mdl:
                ax.plot(Ms, [100 * (r["model"]["E_cap_us"] + r["model"]["E_tail_us"]) / r["median_us"]["fa_only"]
                             for r in rs], "g:", label="E_cap + last-wave drain")
        ax.axhspan(-2, 2, color="tab:blue", alpha=0.08, label="±2% band")
        ax.axhline(0, color="gray", lw=0.5)
        ax.set_xlabel("sequence length M")
        ax.set_ylabel("E_res / T_FA (%)")
        ax.set_title(f"FA4+A2A, H={H}, P={rs[0]['P']}, {rs[0]['world']} world")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    print(f"figure: {path}")
    return path


def main(argv=None):
    args = parse_args(argv)
    if args.plot:
        payload = json.loads(Path(args.plot).read_text())
        stem = Path(args.plot).with_suffix("")
        if args.profile:
            payload = remodel(payload, args.profile)
            stem = Path(f"{stem}_{payload['rows'][0]['model']['platform']}")
            Path(f"{stem}.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
        plot(payload, f"{stem}.png")
        Path(f"{stem}.md").write_text(table3(payload))
        return 0
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    payload = run(args)
    from xstage.provenance import write_json

    out = Path(os.environ.get("OUT", "")) / args.out if os.environ.get("BENCH_TO_OUT") else Path(args.out)
    stem = out / (args.tag or f"bench_{args.world}")
    write_json(f"{stem}.json", payload)
    md = table3(payload)
    Path(f"{stem}.md").write_text(md)
    print(md)
    plot(payload, f"{stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
