"""The FA4 + Ulysses post-attention All-to-All benchmark (paper Section 5.3, Table 3, Fig. 11).

The library part of ``scripts/bench_fa_a2a.py`` (its command line: :func:`parse_args`, :func:`main`).

One rank's sender-visible time for DiT shapes (B = 1, head_dim 128, H heads, sequence M,
Hl = H / P heads per rank):

  stock          flash_attn.cute.flash_attn_func on the rank's [1, M, Hl, 128] (reference point)
  fa_only        the same kernel class with the stock epilogue (local output)      [T_FA]
  fa_only_pers   ... static persistent tile order (own O staging buffer)
  a2a_only       the post-attention volume moved without attention: torch device copies into the
                 P destination buffers (loopback/host); all_to_all_single with yunchang's
                 permutes (torch-symm)
  serial         fa_only, then a2a_only                                              [T_serial]
  a2a_symm       the same volume by the symmetric-memory copy kernel (fa4_a2a.a2a_copy: 16-byte
                 stores through the fused kernel's own peer table, one CTA per SM)
  serial_symm    fa_only, then a2a_symm
  fused          FA4 whose epilogue stores every tile at its Ulysses destination    [T_fused]
  fused_pers     ... static persistent tile order, own O staging buffer in smem
  fused_pers_dq  ... static persistent, sO aliasing sQ with Q's release deferred past the epilogue

Method: every variant is captured once in a CUDA graph; a trial times ``replays`` back-to-back
replays between two CUDA events (sender-side boundary, paper Section 5.1: in multi-process worlds
one world barrier after the replays, none per iteration); trials of all variants are interleaved
with a rotated order (DVFS drift hits every variant alike); median of >= 21 trials.  The SM clock
(NVML, ``torch.cuda.clock_rate``) is read after every trial (and before it with ``--stabilize``).
E_res = T_fused - T_FA, hiding ratio H = 1 - E_res / (T_serial - T_FA) (eq. 21), speedup =
T_serial / T_fused.

Acceptance "T_fused < T_serial at every M" is decided per M on the *paired, matched-clock*
statistic: per trial the difference serial_i - fused_i (same trial, rotated order), kept only for
trials whose serial and fused clocks are both within ``--clock-tol-mhz`` of the row's reference
clock (median of all clock readings of the row); pass when that median difference is > 0 over at
least ``--min-matched`` trials (the one-sided sign-test p-value is reported with it).

``--stabilize`` (paper Section 5.3: "We monitor clocks and repeat affected points in short,
clock-stabilized runs"): before each variant's timed replays the host synchronizes and sleeps
``--cooldown-s`` (the GPU leaves its power limit), and replays per trial are kept short
(``--target-trial-us`` / ``--max-replays`` default to 2000 us / 4 there, at least one replay).
GPU clocks are never changed by this script.

Worlds: ``loopback`` (all P destination buffers in this GPU's HBM: the fused stores are local
stores, a control for issue cost), ``host`` (destinations in pinned host memory: the stores drain
over PCIe, a real X-Stage path on one GPU) and ``torch-symm`` (one process per GPU under torchrun,
NVLink peer stores into torch symmetric memory; times are the per-trial maximum over ranks).

  python scripts/bench_fa_a2a.py                       # full sweep, loopback, P = 8
  python scripts/bench_fa_a2a.py --world host --seqs 8192 16384 32768
  python scripts/bench_fa_a2a.py --stabilize --seqs 49152 65536 --variants fa_only serial serial_symm fused
  torchrun --nproc-per-node 8 scripts/bench_fa_a2a.py --world torch-symm
  python scripts/bench_fa_a2a.py --plot results/h200/fa4_a2a/bench_loopback.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

from lab import bench
from lab.paired import acceptance, matched_medians, paired_stats, reference_clock
from xstage.world import single_process

VARIANTS = ("stock", "fa_only", "fa_only_pers", "a2a_only", "serial", "a2a_symm", "serial_symm", "fused",
            "fused_pers", "fused_pers_dq")
FUSED = ("fused", "fused_pers", "fused_pers_dq")
SERIALS = ("serial", "serial_symm")
TILE_M = TILE_N = 128


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", choices=("loopback", "host", "loopback+host", "torch-symm"), default="loopback",
                   help="loopback+host: the fused kernel's destinations in pinned host memory, inputs on the GPU")
    p.add_argument("--P", type=int, default=8, help="world size (torch-symm: must equal the process count)")
    p.add_argument("--heads", type=int, nargs="+", default=[24, 40])
    p.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384, 32768, 49152, 65536])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--trials", type=int, default=21)
    p.add_argument("--target-trial-us", type=float, default=None,
                   help="replays per trial ~ this / T (default 3000; 2000 with --stabilize)")
    p.add_argument("--max-replays", type=int, default=None, help="default 20; 4 with --stabilize")
    p.add_argument("--min-replays", type=int, default=None, help="default 3; 1 with --stabilize")
    p.add_argument("--stabilize", action="store_true",
                   help="clock-stabilised mode: idle cool-down before every variant's timed replays, short trials")
    p.add_argument("--cooldown-s", type=float, default=0.25, help="--stabilize: host sleep before each timed burst")
    p.add_argument("--clock-tol-mhz", type=float, default=30.0,
                   help="matched-clock window around the row's reference clock (H200 DVFS steps are 15 MHz)")
    p.add_argument("--min-matched", type=int, default=5, help="fewest matched paired trials for a verdict")
    p.add_argument("--alpha", type=float, default=0.05, help="sign-test level for a 'pass'")
    p.add_argument("--profile", default=None, help="xstage.profiles name/path for the model prediction")
    p.add_argument("--out", default="results/h200/fa4_a2a")
    p.add_argument("--tag", default=None, help="output file stem (default bench_<world>[_stabilized])")
    p.add_argument("--plot", default=None, help="only draw the figure (and tables) from this JSON")
    p.add_argument("--reanalyse", action="store_true",
                   help="with --plot: recompute paired/matched-clock statistics and verdicts (CPU)")
    args = p.parse_args(argv)
    defaults = {"target_trial_us": (2000.0, 3000.0), "max_replays": (4, 20), "min_replays": (1, 3)}
    for name, (stab, plain) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, stab if args.stabilize else plain)
    if args.min_replays < 1 or args.max_replays < args.min_replays:
        p.error("need 1 <= --min-replays <= --max-replays")
    if args.trials < 1 or args.cooldown_s < 0 or args.clock_tol_mhz < 0:
        p.error("--trials >= 1, --cooldown-s >= 0 and --clock-tol-mhz >= 0 required")
    return args


# ----------------------------------------------------------------------------- timing


class WorldSync:
    """What the timing loop needs from the world: a barrier and (multi-process) agreement.

    Single process (loopback/host): nothing to agree on; multi-process (torch-symm): every rank
    must replay the same graphs the same number of times (NCCL graphs would hang otherwise), so
    replay counts are agreed by an all-reduce MAX, and trials start barrier-aligned.
    """

    def __init__(self, world=None, dist=None):
        self.world = world
        self.multi = world is not None and not single_process(world)
        self.dist = dist

    def barrier(self):
        if self.multi:
            self.world.barrier()

    def agree_max(self, values: dict) -> dict:
        if not self.multi:
            return values
        import torch

        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self.world.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=getattr(self.world, "group", None))
        return {k: type(values[k])(v) for k, v in zip(keys, t.tolist())}


def _capture(fn):
    """One CUDA graph of ``fn`` (lab.timing.capture_graph); a seam the CPU tests replace."""
    from lab.timing import capture_graph

    return capture_graph(fn, warmup=2)


def time_interleaved(fns: dict, trials: int, target_us: float, max_replays: int, *, min_replays: int = 3,
                     cooldown_s: float = 0.0, sync: WorldSync = None):
    """Per-call time of each fn, interleaved + rotated over ``trials`` (lab.bench.paired_trials).

    Returns (samples_us, replays, clocks_after, clocks_before): dicts name -> list per trial
    (clocks_before only when ``cooldown_s`` > 0, i.e. stabilised).  Each trial of each variant is
    [optional barrier + cool-down] -> event -> ``replays`` graph replays -> event -> sync ->
    clock read -> [world barrier: remote visibility once after the replays, Section 5.1].
    """
    sync = sync or WorldSync()
    graphs = {k: _capture(f) for k, f in fns.items()}
    est = {}
    for k, g in graphs.items():  # size each variant's trial from one untimed burst
        est[k] = bench.event_timed(g.replay, calls=3, warmup=0)()
        sync.barrier()
    replays = sync.agree_max({k: bench.replays_for(est[k], target_us, min_replays, max_replays) for k in graphs})
    timed = {k: bench.event_timed(g.replay, calls=replays[k], warmup=0) for k, g in graphs.items()}
    clocks_before = {k: [] for k in graphs} if cooldown_s > 0 else None
    samples, clocks = bench.paired_trials(timed, trials, cooldown_s, barrier=sync.barrier,
                                          clocks_before=clocks_before)
    del graphs, timed
    return samples, replays, clocks, clocks_before


# ----------------------------------------------------------------------------- statistics (CPU-testable)
# (the generic paired / clock-matched statistics live in lab.paired)


def analyse_row(row: dict, samples: dict, clocks: dict, tol_mhz: float, min_matched: int,
                alpha: float = 0.05) -> dict:
    """Medians, paired statistics, matched-clock medians and the acceptance verdicts of one row."""
    from lab.timing import Timing

    timings = {n: Timing(v) for n, v in samples.items()}
    med = {n: t.median_us for n, t in timings.items()}
    row.update(timings={n: t.as_dict() for n, t in timings.items()}, median_us=med, sm_clock_mhz=clocks)
    have_clocks = reference_clock(clocks) is not None
    row["reference_clock_mhz"] = reference_clock(clocks)
    row["matched_median_us"] = matched_medians(samples, clocks, tol_mhz) if have_clocks else None
    row["acceptance"] = {}
    for serial in SERIALS:
        for fused in FUSED:
            if fused in med and serial in med:
                row[f"paired_{serial}_minus_{fused}"] = paired_stats(timings, serial, fused)
        if "fused" in med and serial in med:
            row["acceptance"][f"fused_lt_{serial}"] = acceptance(samples, clocks, serial, "fused", tol_mhz,
                                                                 min_matched, alpha)
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
                if "serial_symm" in med:
                    row[f"speedup_{fused}_vs_serial_symm"] = med["serial_symm"] / med[fused]
    return row


# ----------------------------------------------------------------------------- model


def load_platform(name):
    from xstage import profiles

    candidates = [name] if name else ["h200-nvlink-peer", "h200-pcie-host", "paper-b200-nvlink"]
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


def init_world(args):
    """The world, this process's rank and the torch.distributed module (torch-symm only)."""
    import torch

    from xstage.world import make_world

    if args.world != "torch-symm":
        return make_world(args.world, args.P), 0, None
    import torch.distributed as dist

    if not dist.is_initialized():
        if "LOCAL_RANK" not in os.environ:
            raise SystemExit("--world torch-symm runs one process per GPU: start it with torchrun")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    if dist.get_world_size() != args.P:
        raise SystemExit(f"--P {args.P} but torchrun started {dist.get_world_size()} processes")
    world = make_world("torch-symm", args.P)
    return world, world.rank, dist


def variant_fns(world, rank, q, k, v, o_local, dest, table, P):
    """name -> zero-argument launch of that variant for ``rank`` (every variant of VARIANTS).

    Single-process worlds hold every rank's buffer, so the torch-copy A2A can reach them;
    multi-process worlds use all_to_all_single for the torch baseline.  The symmetric-memory copy
    and the fused kernel take the same (folded) peer table, so they move the same bytes.
    """
    import fa4_a2a
    from fa4_a2a.baselines import a2a_all_to_all_single, a2a_copy, a2a_symm
    from flash_attn.cute import flash_attn_func

    out = dest.local(rank)
    if single_process(world):
        dests = [dest.local(j) for j in range(P)]
        a2a_torch = lambda: a2a_copy(o_local, dests, rank)  # noqa: E731
    else:
        group = getattr(world, "group", None)
        a2a_torch = lambda: a2a_all_to_all_single(o_local, group)  # noqa: E731
    fa = lambda: fa4_a2a.attention_local(q, k, v, o_local)  # noqa: E731
    symm = lambda: a2a_symm(o_local, out, table, num_ranks=P)  # noqa: E731
    return {
        "stock": lambda: flash_attn_func(q, k, v),
        "fa_only": fa,
        "fa_only_pers": lambda: fa4_a2a.attention_local(q, k, v, o_local, persistent=True),
        "a2a_only": a2a_torch,
        "serial": lambda: (fa(), a2a_torch()),
        "a2a_symm": symm,
        "serial_symm": lambda: (fa(), symm()),
        "fused": lambda: fa4_a2a.attention_a2a(q, k, v, out, table, num_ranks=P),
        "fused_pers": lambda: fa4_a2a.attention_a2a(q, k, v, out, table, num_ranks=P, persistent=True),
        "fused_pers_dq": lambda: fa4_a2a.attention_a2a(q, k, v, out, table, num_ranks=P, persistent=True,
                                                       o_staging="defer_q"),
    }


def close_world(world_name: str) -> None:
    """torch-symm: a last barrier, then the process group ends (once per process)."""
    if world_name == "torch-symm":
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


def output_dir(out: str) -> Path:
    """Where results go: ``out``, or ``$OUT/out`` when BENCH_TO_OUT is set (remote GPU runs)."""
    return Path(os.environ.get("OUT", "")) / out if os.environ.get("BENCH_TO_OUT") else Path(out)


def reduce_over_ranks(dist, world, samples, clocks):
    """Multi-process: per-trial max time and min clock over ranks (every rank gets the result)."""
    if dist is None:
        return samples, clocks, None
    gathered = [None] * world.world_size
    dist.all_gather_object(gathered, {"samples": samples, "clocks": clocks}, group=getattr(world, "group", None))
    red_s = {k: [max(g["samples"][k][i] for g in gathered) for i in range(len(samples[k]))] for k in samples}
    red_c = {}
    for k in clocks:
        red_c[k] = []
        for i in range(len(clocks[k])):
            cs = [g["clocks"][k][i] for g in gathered]
            red_c[k].append(None if any(c is None for c in cs) else min(cs))
    return red_s, red_c, [g["samples"] for g in gathered]


def run(args):
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    P, D = args.P, args.head_dim
    world, rank, dist = init_world(args)
    device = world.device
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    platform = load_platform(args.profile)
    sync = WorldSync(world, dist)
    rows = []
    for H in args.heads:
        if H % P:
            raise SystemExit(f"heads {H} not divisible by P={P}")
    for M in args.seqs:
        if M % P:
            raise SystemExit(f"M={M} not divisible by P={P}")
    points = [(H, M) for H in args.heads for M in args.seqs]
    for H, M in bench.progress(points, desc="fa4_a2a bench", enabled=None if rank == 0 else False):
        Hl = H // P
        g = torch.Generator(device=device).manual_seed((M + H) * 64 + rank)
        q, k, v = (torch.randn(1, M, Hl, D, generator=g, device=device).to(dtype) for _ in range(3))
        o_local = torch.empty_like(q)
        dest = world.alloc((1, M // P, H, D), dtype, remote=True)
        # This rank's head offset folded into its table (fa4_a2a.interface.ulysses_peer_table).
        table = (dest.peer_table(rank) + rank * Hl * D * q.element_size()).contiguous()
        fns = variant_fns(world, rank, q, k, v, o_local, dest, table, P)
        fns = {n: fns[n] for n in args.variants}
        t0 = time.time()
        samples, replays, clocks, clocks_before = time_interleaved(
            fns, args.trials, args.target_trial_us, args.max_replays, min_replays=args.min_replays,
            cooldown_s=args.cooldown_s if args.stabilize else 0.0, sync=sync)
        samples, clocks, per_rank = reduce_over_ranks(dist, world, samples, clocks)
        row = {"H": H, "H_local": Hl, "M": M, "P": P, "head_dim": D, "dtype": args.dtype,
               "world": args.world, "stabilized": args.stabilize, "replays": replays,
               "time_over_ranks": "max per trial" if dist is not None else f"rank {rank}",
               "wall_s": time.time() - t0}
        if clocks_before is not None:
            row["sm_clock_before_mhz"] = clocks_before
        if per_rank is not None:
            row["per_rank_samples_us"] = per_rank
        analyse_row(row, samples, clocks, args.clock_tol_mhz, args.min_matched, args.alpha)
        if "fa_only" in row["median_us"]:
            row["model"] = model_prediction(platform, M, Hl, row["median_us"]["fa_only"], num_sms,
                                            q.element_size(), D)
        rows.append(row)
        if rank == 0:
            print_row(row)
        fns = None  # drop the graphs' references before the next shape allocates
        del dest
        sync.barrier()
        torch.cuda.empty_cache()
    return {"config": vars(args), "num_sms": num_sms, "rows": rows, "rank": rank,
            "acceptance_fused_lt_serial": acceptance_summary(rows)}


def acceptance_summary(rows) -> dict:
    """Per serial baseline: pass only if every M of every head count passed."""
    out = {}
    for r in rows:
        for key, a in r.get("acceptance", {}).items():
            s = out.setdefault(key, {"all_pass": True, "clock_matched": True, "points": []})
            s["clock_matched"] = s["clock_matched"] and a.get("clock_matched", False)
            s["points"].append({"H": r["H"], "M": r["M"], "verdict": a["verdict"],
                                "median_diff_us": a.get("median_diff_us"), "n_matched": a["n_matched"]})
            s["all_pass"] = s["all_pass"] and a["verdict"] == "pass"
    return out


DERIVED = (
    [("fa_only_vs_stock", "{:.4f}"), ("E_res_pers_vs_fa_pers_us", "{:+.1f}")]
    + [(f"E_res_{f}_us", "{:+.1f}") for f in FUSED]
    + [(f"H_{f}", "{:.0%}") for f in FUSED]
    + [(f"speedup_{f}", "{:.3f}x") for f in FUSED]
    + [(f"speedup_{f}_vs_serial_symm", "{:.3f}x") for f in FUSED]
    + [(f"{f}_vs_fa", "{:.4f}") for f in FUSED]
)


def print_row(r):
    m = r["median_us"]
    cols = " ".join(f"{n}={m[n]:.1f}" for n in VARIANTS if n in m)
    extra = " ".join(
        f"{k}={r[k]:+.1f}" if k.startswith("E_res") else f"{k}={r[k]:.3f}" for k, _ in DERIVED if k in r)
    verdicts = " ".join(f"{k}:{a['verdict']}({a.get('median_diff_us', float('nan')):+.1f}us,n={a['n_matched']})"
                        for k, a in r.get("acceptance", {}).items())
    bench.log(f"H={r['H']:3d} M={r['M']:6d} | {cols} | {extra} | {verdicts}")


def acceptance_table(payload) -> str:
    """Markdown: explicit pass/fail of T_fused < T_serial per point (paired, matched clocks)."""
    lines = []
    for r in payload["rows"]:
        for key, a in r.get("acceptance", {}).items():
            if not lines:
                lines += ["\n### Acceptance: T_fused < T_serial (paired per trial, matched SM clock)\n",
                          "| H | M | baseline | median(serial - fused) us | fused faster in | matched trials | "
                          "ref clock MHz (matched) | sign-test p | verdict |",
                          "|---|---|---|---|---|---|---|---|---|"]
            med = a.get("median_diff_us")
            lines.append(
                f"| {r['H']} | {r['M']} | {a['slow']} | {'' if med is None else f'{med:+.1f}'} | "
                f"{'' if med is None else format(a['frac_positive'], '.0%')} | {a['n_matched']}/{a['n_trials']} | "
                f"{'not recorded' if a['reference_clock_mhz'] is None else format(a['reference_clock_mhz'], '.0f')} | "
                f"{'' if med is None else format(a['sign_test_p'], '.3g')} | **{a['verdict'].upper()}** |")
    for key, s in payload.get("acceptance_fused_lt_serial", {}).items():
        lines.append(f"\n{key}: {'PASS at every point' if s['all_pass'] else 'NOT passed at every point'}"
                     f"{'' if s.get('clock_matched', True) else ' (no clock readings: paired, not clock-matched)'}")
    return "\n".join(lines) + ("\n" if lines else "")


def reanalyse(payload, tol_mhz: float, min_matched: int, alpha: float = 0.05):
    """Recompute statistics and verdicts of a saved JSON (CPU only; rows need per-trial samples)."""
    for r in payload["rows"]:
        samples = {n: t["samples_us"] for n, t in r["timings"].items()}
        clocks = r.get("sm_clock_mhz") or {n: [None] * len(s) for n, s in samples.items()}
        analyse_row(r, samples, clocks, tol_mhz, min_matched, alpha)
    payload["acceptance_fused_lt_serial"] = acceptance_summary(payload["rows"])
    payload.setdefault("reanalysed", []).append({"clock_tol_mhz": tol_mhz, "min_matched": min_matched,
                                                 "alpha": alpha})
    return payload


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
        if any(r.get("matched_median_us") for r in rs):
            lines.append("| reference SM clock (MHz) | " + " | ".join(
                "-" if r.get("reference_clock_mhz") is None else f"{r['reference_clock_mhz']:.0f}" for r in rs) + " |")
            for name in ("fa_only", "serial", "serial_symm", "fused"):
                cells = [(r.get("matched_median_us") or {}).get(name) for r in rs]
                if any(cells):
                    lines.append(f"| {name} @ matched clock (n) | " + " | ".join(
                        "-" if not c or c["median_us"] is None else f"{c['median_us']:.1f} ({c['n']})"
                        for c in cells) + " |")
        if "E_drain_us" in rs[0].get("model", {}):
            lines.append("| model E_drain (us) | " + " | ".join(f"{r['model']['E_drain_us']:.1f}" for r in rs) + " |")
            lines.append("| model E_cc (us) | " + " | ".join(f"{r['model']['E_cc_us']:.1f}" for r in rs) + " |")
            if "E_cap_us" in rs[0]["model"]:
                lines.append("| model E_cap (us) | " + " | ".join(f"{r['model']['E_cap_us']:.1f}" for r in rs) + " |")
            if "E_tail_us" in rs[0]["model"]:
                lines.append("| model E_tail (us) | " + " | ".join(f"{r['model']['E_tail_us']:.1f}" for r in rs) + " |")
            lines.append("| model M*_ub | " + " | ".join(f"{r['model']['M_star_ub']:.0f}" for r in rs) + " |")
    return "\n".join(lines) + "\n" + acceptance_table(payload)


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
        if args.reanalyse:
            payload = reanalyse(payload, args.clock_tol_mhz, args.min_matched, args.alpha)
            stem = Path(f"{stem}_reanalysed")
        if args.profile or args.reanalyse:
            Path(f"{stem}.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
        plot(payload, f"{stem}.png")
        Path(f"{stem}.md").write_text(table3(payload))
        print(acceptance_table(payload))
        return 0
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    payload = run(args)
    close_world(args.world)
    if payload["rank"] != 0:
        return 0
    out = output_dir(args.out)
    stem = out / (args.tag or f"bench_{args.world.replace('+', '_')}{'_stabilized' if args.stabilize else ''}")
    bench.write_json(f"{stem}.json", payload)
    md = table3(payload)
    Path(f"{stem}.md").write_text(md)
    print(md)
    plot(payload, f"{stem}.png")
    return 0
