"""One DiT attention block under Ulysses sequence parallelism, the stack's stock path against ours:
the library part of ``scripts/bench_dit_block.py``.

Per rank (x: its [B, S/P, hidden] sequence shard):

  block_stock   Q / K / V projections, the pre-attention A2A, FlashAttention-4 into a local
                buffer, the post-attention A2A (torch copies in single-process worlds, yunchang's
                ``all_to_all_single`` in torch-symm), the output projection: what yunchang and
                xDiT run with an FA backend
  block_fused   the same, with the post-attention A2A fused into FA4 (``ulysses_attention``)
  attn_stock / attn_fused   the attention part alone (pre-A2A, attention, post-A2A): the block's
                attention + A2A share is attn_x / block_x

In the single-process worlds (``loopback``, ``host``, ``loopback+host``) a time is the whole
world's: every rank's block back to back on one GPU; in torch-symm (one process per GPU, under
torchrun) it is the per-trial maximum over ranks. Method as ``lab.fa4_a2a.bench``: every variant
captured in a CUDA graph, replays timed between CUDA events, trials interleaved in rotated order,
the SM clock read after each, statistics on the clock-matched trials (``lab.bench``). Before the
timing both blocks are checked on a small problem against a float32 reference of the whole block
(every element, poisoned destinations).

  python scripts/bench_dit_block.py                                  # loopback, P = 8, FLUX.1 and Wan 2.1 14B
  python scripts/bench_dit_block.py --world host --seqs 8192 32768
  torchrun --nproc-per-node 8 scripts/bench_dit_block.py --world torch-symm
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from fa4_a2a import interface
from fa4_a2a.baselines import a2a_all_to_all_single, a2a_all_to_all_single_pre, a2a_copy
from fa4_a2a.reference import attention_fp32, seq_to_head_shards
from fa4_a2a.ulysses import get_workspace, ulysses_attention
from lab import bench
from lab.fa4_a2a.bench import WorldSync, close_world, init_world, output_dir, reduce_over_ranks, time_interleaved
from lab.paired import matched_medians
from xstage.world import single_process

# Attention shapes of public DiT configs: (hidden, heads, head_dim).
MODELS = {
    "flux.1": (3072, 24, 128),      # FLUX.1 [dev]: 24 heads x 128
    "wan2.1-14b": (5120, 40, 128),  # Wan 2.1 T2V 14B: 40 heads x 128
}
VARIANTS = ("block_stock", "block_fused", "attn_stock", "attn_fused")
BASELINE = "block_stock"


@dataclass(frozen=True)
class BlockWeights:
    """Projection weights of one attention block, as nn.Linear stores them ([out, in])."""

    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    heads: int
    head_dim: int


def make_weights(hidden: int, heads: int, head_dim: int, *, device, dtype, seed: int = 0) -> BlockWeights:
    g = torch.Generator(device=device).manual_seed(seed)
    inner = heads * head_dim

    def w(o, i):
        return (torch.randn(o, i, generator=g, device=device) / math.sqrt(i)).to(dtype)

    return BlockWeights(w(inner, hidden), w(inner, hidden), w(inner, hidden), w(hidden, inner), heads, head_dim)


def project_qkv(x: torch.Tensor, blk: BlockWeights):
    """x [B, C, hidden] -> q, k, v [B, C, H, D] (three GEMMs, contiguous: FLUX's to_q/to_k/to_v)."""
    B, C, _ = x.shape
    return tuple(F.linear(x, w).view(B, C, blk.heads, blk.head_dim) for w in (blk.wq, blk.wk, blk.wv))


def project_out(o: torch.Tensor, blk: BlockWeights) -> torch.Tensor:
    """o [B, C, H, D] -> [B, C, hidden]."""
    return F.linear(o.flatten(2), blk.wo)


class StockUlysses:
    """yunchang's Ulysses attention with an FA4 backend, as separate steps: pre-A2A, FA4 into a
    local [B, S, H/P, D] buffer, post-A2A. Buffers made once per shape (graph-capturable)."""

    def __init__(self, world, shape, dtype):
        B, C, H, D = shape
        P = world.world_size
        self.world = world
        self.o_local = [torch.empty(B, C * P, H // P, D, device=world.device, dtype=dtype) for _ in world.local_ranks]
        self.dest = world.alloc((B, C, H, D), dtype, remote=True) if single_process(world) else None

    def __call__(self, qs, ks, vs, softmax_scale=None):
        world = self.world
        if single_process(world):
            qh, kh, vh = seq_to_head_shards(qs), seq_to_head_shards(ks), seq_to_head_shards(vs)
        else:
            group = getattr(world, "group", None)
            qh, kh, vh = ([a2a_all_to_all_single_pre(x[0], group)] for x in (qs, ks, vs))
        for i in range(len(world.local_ranks)):
            interface.attention_local(qh[i], kh[i], vh[i], self.o_local[i], softmax_scale=softmax_scale)
        if single_process(world):
            dests = [self.dest.local(j) for j in range(world.world_size)]
            for i, r in enumerate(world.local_ranks):
                a2a_copy(self.o_local[i], dests, r)
            return dests
        return [a2a_all_to_all_single(self.o_local[0], getattr(world, "group", None))]


class DiTBlock:
    """The block's two paths over one world's local ranks: ``block(xs, fused)`` -> per local rank
    [B, C, hidden]; ``attention(qs, ks, vs, fused)`` -> per local rank [B, C, H, D]."""

    def __init__(self, world, blk: BlockWeights, shape, dtype):
        self.world, self.blk = world, blk
        self.stock = StockUlysses(world, shape, dtype)

    def attention(self, qs, ks, vs, fused: bool):
        if fused:
            # single-process worlds take every rank's tensors, multi-process ones this rank's
            per_rank = (qs, ks, vs) if single_process(self.world) else (qs[0], ks[0], vs[0])
            out = ulysses_attention(*per_rank, self.world)
            return out if isinstance(out, list) else [out]
        return self.stock(qs, ks, vs)

    def block(self, xs: Sequence[torch.Tensor], fused: bool):
        qkv = [project_qkv(x, self.blk) for x in xs]
        os_ = self.attention([t[0] for t in qkv], [t[1] for t in qkv], [t[2] for t in qkv], fused)
        return [project_out(o, self.blk) for o in os_]


def block_reference(xs: Sequence[torch.Tensor], blk: BlockWeights) -> list[torch.Tensor]:
    """float32 block over the whole sequence (all P shards), split back per rank."""
    x = torch.cat([t.float() for t in xs], dim=1)
    f32 = BlockWeights(*(w.float() for w in (blk.wq, blk.wk, blk.wv, blk.wo)), blk.heads, blk.head_dim)
    q, k, v = project_qkv(x, f32)
    o, _ = attention_fp32(q, k, v)
    return list(project_out(o, f32).chunk(len(xs), dim=1))


def check(world, blk: BlockWeights, seq: int, dtype, *, batch: int = 1, seed: int = 7) -> dict:
    """Both blocks against block_reference on a [batch, seq] problem: every element, both paths'
    destination buffers poisoned (NaN) first."""
    P, dev = world.world_size, world.device
    C = seq // P
    g = torch.Generator(device=dev).manual_seed(seed)
    xs_all = [torch.randn(batch, C, blk.wq.shape[1], generator=g, device=dev).to(dtype) for _ in range(P)]
    ref = block_reference(xs_all, blk)
    xs = [xs_all[r] for r in world.local_ranks]
    model = DiTBlock(world, blk, (batch, C, blk.heads, blk.head_dim), dtype)
    fused_ws = get_workspace(world, (batch, C, blk.heads, blk.head_dim), dtype)
    for buf in ([model.stock.dest] if model.stock.dest is not None else []) + [fused_ws.dest]:
        for j in world.local_ranks:
            buf.local(j).fill_(float("nan"))
    out = {}
    for name, fused in (("block_stock", False), ("block_fused", True)):
        ys = model.block(xs, fused)
        if not single_process(world):
            world.barrier()
        err = max((y.float() - ref[r]).abs().max().item() for y, r in zip(ys, world.local_ranks))
        scale = max(ref[r].abs().max().item() for r in world.local_ranks)
        finite = all(bool(torch.isfinite(y).all()) for y in ys)
        out[name] = {"max_abs_err": err, "ref_max_abs": scale, "finite": finite,
                     "ok": finite and err <= 2e-2 * max(scale, 1.0)}
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", choices=("loopback", "host", "loopback+host", "torch-symm"), default="loopback")
    p.add_argument("--P", type=int, default=8, help="world size (torch-symm: the process count)")
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    p.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384, 32768], help="whole sequence S")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--trials", type=int, default=15)
    p.add_argument("--target-trial-us", type=float, default=3000.0)
    p.add_argument("--max-replays", type=int, default=20)
    p.add_argument("--clock-tol-mhz", type=float, default=30.0)
    p.add_argument("--check-seq", type=int, default=1024, help="sequence of the correctness check")
    p.add_argument("--out", default="results/h200/fa4_a2a/dit_block")
    args = p.parse_args(argv)
    for name in args.models:
        heads = MODELS[name][1]
        if heads % args.P:
            p.error(f"{name}: {heads} heads are not divisible by --P {args.P}")
    for S in args.seqs + [args.check_seq]:
        if S % args.P:
            p.error(f"sequence {S} is not divisible by --P {args.P}")
    if args.trials < 1 or args.max_replays < 1:
        p.error("--trials and --max-replays must be >= 1")
    return args


def summarise(samples: dict, clocks: dict, tol_mhz: float) -> dict:
    """Paired verdicts against block_stock, every variant's median over its trials at the
    reference clock, and the attention + A2A share of each block (ratio of those medians)."""
    row = bench.paired_verdicts(samples, clocks, BASELINE, tol_mhz)
    med = {k: v["median_us"] for k, v in matched_medians(samples, clocks, tol_mhz).items()}
    row["median_us"] = med
    row["attn_share"] = {kind: (med[f"attn_{kind}"] / med[f"block_{kind}"])
                         if med.get(f"attn_{kind}") and med.get(f"block_{kind}") else None
                         for kind in ("stock", "fused")}
    return row


def run(args) -> dict:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    world, rank, dist = init_world(args)
    sync = WorldSync(world, dist)
    P, rows, checks = args.P, [], {}
    weights = {name: make_weights(*MODELS[name], device=world.device, dtype=dtype) for name in args.models}
    for name, blk in weights.items():
        checks[name] = check(world, blk, args.check_seq, dtype)
        if not all(c["ok"] for c in checks[name].values()):
            raise SystemExit(f"{name}: block check failed: {checks[name]}")
    points = [(n, S) for n in args.models for S in args.seqs]
    for name, S in bench.progress(points, desc="dit block", enabled=None if rank == 0 else False):
        hidden, heads, head_dim = MODELS[name]
        blk = weights[name]
        C = S // P
        g = torch.Generator(device=world.device).manual_seed(S + rank)
        xs = [torch.randn(1, C, hidden, generator=g, device=world.device).to(dtype) for _ in world.local_ranks]
        model = DiTBlock(world, blk, (1, C, heads, head_dim), dtype)
        qkv = [project_qkv(x, blk) for x in xs]
        qs, ks, vs = ([t[i] for t in qkv] for i in range(3))
        fns = {"block_stock": lambda: model.block(xs, False), "block_fused": lambda: model.block(xs, True),
               "attn_stock": lambda: model.attention(qs, ks, vs, False),
               "attn_fused": lambda: model.attention(qs, ks, vs, True)}
        t0 = time.time()
        samples, replays, clocks, _ = time_interleaved(fns, args.trials, args.target_trial_us, args.max_replays,
                                                       sync=sync)
        samples, clocks, _ = reduce_over_ranks(dist, world, samples, clocks)
        row = dict(model=name, hidden=hidden, heads=heads, head_dim=head_dim, S=S, P=P, world=args.world,
                   replays=replays, wall_s=time.time() - t0, **summarise(samples, clocks, args.clock_tol_mhz))
        rows.append(row)
        if rank == 0:
            print_row(row)
        fns = model = None
        sync.barrier()
        torch.cuda.empty_cache()
    return {"config": vars(args), "checks": checks, "rows": rows, "rank": rank}


def print_row(row: dict) -> None:
    med, share = row["median_us"], row["attn_share"]
    fused = row["variants"].get("block_fused", {})
    ratio = fused.get("median_ratio")
    print(f"{row['model']:11s} S={row['S']:6d} P={row['P']}  block stock {med.get('block_stock') or float('nan'):9.1f} us"
          f"  fused {med.get('block_fused') or float('nan'):9.1f} us  fused/stock "
          f"{ratio if ratio is not None else float('nan'):.3f} ({fused.get('n_matched', 0)} matched)"
          f"  attention+A2A share {share['stock'] or float('nan'):.2f} / {share['fused'] or float('nan'):.2f}",
          flush=True)


def csv_rows(payload: dict) -> list:
    out = []
    for r in payload["rows"]:
        fused = r["variants"].get("block_fused", {})
        out.append({k: r[k] for k in ("model", "S", "P", "world")} | {
            f"{k}_us": r["median_us"].get(k) for k in VARIANTS} | {
            "block_fused_over_stock": fused.get("median_ratio"), "n_matched": fused.get("n_matched"),
            "attn_share_stock": r["attn_share"]["stock"], "attn_share_fused": r["attn_share"]["fused"]})
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (Hopper)")
    payload = run(args)
    close_world(args.world)
    if payload["rank"] == 0:
        path = bench.write_result(output_dir(args.out), f"dit_block_{args.world.replace('+', '_')}", payload,
                                  csv_rows(payload))
        print(f"wrote {path}")
    return 0
