"""Per-tile timelines of the fused FA + All-to-All kernel (issue 29, step 1: where the residual
E_res = T_fused - T_FA comes from on a remote path).

:func:`traced_attention_a2a` launches the trace build (``KernelConfig(trace=True)``: the same
kernel plus a few timer reads and reductions into a per-tile row, :data:`fa4_a2a.kernel.TRACE_FIELDS`),
:func:`decode_trace` turns the rows into per-tile records and :func:`trace_statistics` into the
numbers that tell the candidates apart:

* **store-issue span** per tile (first remote store issued -> last one issued, over the epilogue
  threads): it grows when the path's outstanding capacity Q is full (a capacity stall, paper
  eq. 15);
* **burst alignment**: how many tiles' store spans overlap at each tile's start (the producers
  storing at once, i.e. the aggregate V of a burst against Q);
* **retire / launch coupling** (non-persistent grids): per SM, the gap from one tile's last store
  issue to the next CTA's start on that SM;
* **tail**: from the last tile's epilogue entry to the last store issue (what drains after the
  last Q-loop).

Timestamps are ``%globaltimer`` (ns, one clock for every SM). An issued store is not a completed
one: the spans say when the issuing threads got past their stores, which is what the X-Stage
model's T_iss is.
"""
from __future__ import annotations

import math
import statistics
from typing import Dict, List, Optional, Sequence

import torch

from fa4_a2a.interface import KernelConfig, _launch, build_kernel, default_num_sms
from fa4_a2a.kernel import TRACE_FIELDS
from fa4_a2a.validate import check_attention_a2a

UNSET_MIN = torch.iinfo(torch.int64).max  # the min-reduced field before any store (host fill)
# The designs the trace compares: the piggyback epilogue (one CTA per tile) and the static
# persistent order with its own O buffer (both issue 16-byte LSU stores).
DESIGNS = {"piggyback": dict(persistent=False, o_staging="own"),
           "persistent": dict(persistent=True, o_staging="own")}


def trace_rows(batch: int, heads_local: int, seqlen: int, tile_m: int, device) -> torch.Tensor:
    """A fresh trace tensor ``[B, Hl, ceil(S / tile_m), len(TRACE_FIELDS)]`` int64: 0 everywhere
    but the min-reduced ``t_first_store`` (INT64_MAX)."""
    t = torch.zeros(batch, heads_local, -(-seqlen // tile_m), len(TRACE_FIELDS), dtype=torch.int64, device=device)
    t[..., TRACE_FIELDS.index("t_first_store")] = UNSET_MIN
    return t


def traced_attention_a2a(q, k, v, out, peer_table, *, num_ranks: int, softmax_scale: Optional[float] = None,
                         persistent: bool = False, o_staging: str = "own") -> torch.Tensor:
    """:func:`fa4_a2a.attention_a2a` (non-causal, no LSE) on the trace build; returns the trace
    tensor (valid once the stream reaches it)."""
    check_attention_a2a(q, k, v, out, None, peer_table, num_ranks, ulysses=True)
    B, S, Hl, D = q.shape
    cfg = KernelConfig(q.dtype, D, num_ranks, True, persistent, False, False, default_num_sms(q.device),
                       o_staging if persistent else "own", trace=True)
    trace = trace_rows(B, Hl, S, build_kernel(cfg).tile_m, q.device)
    _launch(cfg, q, k, v, out, None, peer_table, softmax_scale or 1.0 / math.sqrt(D), trace=trace)
    return trace


def decode_trace(trace: torch.Tensor) -> List[Dict]:
    """One dict per tile that ran (epilogue entry recorded): batch, head, m_block, the
    :data:`TRACE_FIELDS` and ``store_span_ns`` (first -> last store issue)."""
    rows = []
    t = trace.cpu()
    B, Hl, M, _ = t.shape
    for b in range(B):
        for h in range(Hl):
            for m in range(M):
                r = dict(zip(TRACE_FIELDS, (int(x) for x in t[b, h, m])))
                if r["t_epilogue"] == 0:
                    continue
                if r["t_first_store"] == UNSET_MIN:  # a tile past the sequence end stores nothing
                    r["t_first_store"] = r["t_last_store"] = r["t_epilogue"]
                r.update(batch=b, head=h, m_block=m, store_span_ns=r["t_last_store"] - r["t_first_store"])
                rows.append(r)
    return rows


def _quantiles(xs: Sequence[float]) -> Dict:
    if not xs:
        return dict(n=0, median=None, p10=None, p90=None, max=None)
    s = sorted(xs)
    q = lambda f: s[min(len(s) - 1, int(f * (len(s) - 1) + 0.5))]  # noqa: E731
    return dict(n=len(s), median=statistics.median(s), p10=q(0.1), p90=q(0.9), max=s[-1])


def trace_statistics(rows: Sequence[Dict], *, persistent: bool = False) -> Dict:
    """The numbers of the module docstring over :func:`decode_trace`'s rows (ns):
    ``store_span`` and ``epilogue_to_first_store`` quantiles; ``overlap_at_start`` (tiles whose
    store spans contain another tile's first store, quantiles over tiles); ``retire_to_next_start``
    per SM (non-persistent only: the next CTA's start after a tile's last store issue);
    ``tile_mainloop`` quantiles (a tile's start -> its epilogue entry); ``sm_time_mean_ns``
    (per SM, the sums of mainloop, store-issue and retire-gap time, mean over SMs); ``tail_ns``
    (last store issue - last epilogue entry) and ``kernel_span_ns`` (first CTA start -> last
    store issue)."""
    if not rows:
        return {}
    spans = [r["store_span_ns"] for r in rows]
    starts = sorted(r["t_first_store"] for r in rows)
    intervals = sorted((r["t_first_store"], r["t_last_store"]) for r in rows)
    overlap = []
    for t0 in starts:  # tiles storing when this one starts (itself included)
        overlap.append(sum(1 for a, b in intervals if a <= t0 <= b))
    out = dict(tiles=len(rows), store_span=_quantiles(spans),
               epilogue_to_first_store=_quantiles([r["t_first_store"] - r["t_epilogue"] for r in rows]),
               overlap_at_start=_quantiles(overlap),
               tail_ns=max(r["t_last_store"] for r in rows) - max(r["t_epilogue"] for r in rows),
               kernel_span_ns=max(r["t_last_store"] for r in rows) - min(r["t_cta_start"] for r in rows))
    by_sm: Dict[int, List[Dict]] = {}
    for r in rows:
        by_sm.setdefault(r["smid"], []).append(r)
    gaps, computes, per_sm = [], [], []
    for tiles in by_sm.values():
        tiles.sort(key=lambda r: r["t_epilogue"])
        sm = dict(compute_ns=0, store_ns=0, gap_ns=0)
        for i, r in enumerate(tiles):
            # a tile's mainloop starts at its CTA's start (non-persistent, or a persistent CTA's
            # first tile) or where the same CTA's previous tile finished issuing its stores
            begin = r["t_cta_start"] if not persistent or i == 0 else tiles[i - 1]["t_last_store"]
            computes.append(r["t_epilogue"] - begin)
            sm["compute_ns"] += r["t_epilogue"] - begin
            sm["store_ns"] += r["t_last_store"] - r["t_epilogue"]
            if not persistent and i + 1 < len(tiles):
                gaps.append(tiles[i + 1]["t_cta_start"] - r["t_last_store"])
                sm["gap_ns"] += gaps[-1]
        per_sm.append(sm)
    out["tile_mainloop"] = _quantiles(computes)
    # SM time by phase, mean over SMs: where an SM's time goes (mainloops, store issue incl. any
    # wait for the path, retire -> next CTA start)
    out["sm_time_mean_ns"] = {k: statistics.mean(sm[k] for sm in per_sm) for k in ("compute_ns", "store_ns", "gap_ns")}
    out["sms"] = len(by_sm)
    if not persistent:
        out["retire_to_next_start"] = _quantiles(gaps)
    return out


ROW_CSV_FIELDS = ("head", "m_block", "smid") + TRACE_FIELDS[:4]


def run_points(world_name: str, P: int, heads: Sequence[int], seqs: Sequence[int], *, head_dim: int = 128,
               dtype=torch.bfloat16, designs: Sequence[str] = ("piggyback",), trials: int = 7,
               calls: int = 3) -> List[Dict]:
    """Rank 0's fused kernel of a single-process world (``host``: every destination in pinned host
    memory over PCIe; ``loopback``: the control) per (H, M) and design (:data:`DESIGNS`): the
    trace statistics of the last of ``calls`` eager traced launches (a trace's timeline is the
    device's own, so host launch overhead does not enter it) with its per-tile rows, and the
    CUDA-graph replay times of FA-only, each design and each design's trace build in ``trials``
    paired, rotated trials with the SM clock (so E_res = T_design - T_FA and the trace overhead
    come from the same trials)."""
    import fa4_a2a
    from lab import bench
    from lab.timing import capture_graph
    from xstage.world import make_world

    world = make_world(world_name, P)
    dev = world.device
    out = []
    for H, M in bench.progress([(H, M) for H in heads for M in seqs], desc="fa4_a2a trace"):
        if H % P or M % P:
            raise ValueError(f"H={H} and M={M} must be multiples of P={P}")
        Hl = H // P
        g = torch.Generator(device=dev).manual_seed(M + H)
        q, k, v = (torch.randn(1, M, Hl, head_dim, generator=g, device=dev).to(dtype) for _ in range(3))
        dest = world.alloc((1, M // P, H, head_dim), dtype, remote=True)
        table = dest.peer_table(0).contiguous()  # rank 0: no head offset to fold in
        o_local = torch.empty_like(q)
        fns = {"fa_only": lambda: fa4_a2a.attention_local(q, k, v, o_local)}
        for d in designs:
            kw = DESIGNS[d]
            fns[d] = lambda kw=kw: fa4_a2a.attention_a2a(q, k, v, dest.local(0), table, num_ranks=P, **kw)
            fns[f"{d} traced"] = lambda kw=kw: traced_attention_a2a(q, k, v, dest.local(0), table, num_ranks=P, **kw)
        graphs = {name: capture_graph(fn) for name, fn in fns.items()}
        samples, clocks = bench.paired_trials({n: bench.event_timed(gr.replay, warmup=0) for n, gr in graphs.items()},
                                              trials)
        med = {n: statistics.median(v) for n, v in samples.items()}
        point = dict(world=world_name, P=P, H=H, H_local=Hl, M=M, head_dim=head_dim, median_us=med,
                     samples_us=samples, clocks_mhz=clocks, designs={})
        for d in designs:
            kw = DESIGNS[d]
            for _ in range(calls):
                tr = traced_attention_a2a(q, k, v, dest.local(0), table, num_ranks=P, **kw)
            torch.cuda.synchronize()
            rows = decode_trace(tr)
            stats = trace_statistics(rows, persistent=kw["persistent"])
            point["designs"][d] = dict(e_res_us=med[d] - med["fa_only"], trace_overhead=med[f"{d} traced"] / med[d],
                                       stats=stats, rows=[[r[f] for f in ROW_CSV_FIELDS] for r in rows])
            sm = stats["sm_time_mean_ns"]
            print(f"H={H} M={M} {d}: T {med[d]:.1f} us vs FA {med['fa_only']:.1f} us, E_res "
                  f"{med[d] - med['fa_only']:.1f} us, trace x{med[f'{d} traced'] / med[d]:.3f}; store span p50/p90/max "
                  f"{stats['store_span']['median']}/{stats['store_span']['p90']}/{stats['store_span']['max']} ns, "
                  f"overlap p50 {stats['overlap_at_start']['median']}; per SM us: mainloop {sm['compute_ns'] / 1e3:.1f} "
                  f"store {sm['store_ns'] / 1e3:.1f} gap {sm['gap_ns'] / 1e3:.1f}", flush=True)
        out.append(point)
        dest = fns = graphs = None  # the launches' buffers go before the next shape allocates
        torch.cuda.empty_cache()
    return out


def main(argv=None):
    """``scripts/trace_fa4_a2a.py``: :func:`run_points` into ``--out``/trace_fa4_a2a{tag}.json."""
    import argparse

    from lab import bench

    ap = argparse.ArgumentParser(description="Per-tile timelines of the fused FA + A2A kernel (issue 29, step 1)")
    ap.add_argument("--world", default="host", choices=("host", "loopback", "loopback+host"))
    ap.add_argument("--P", type=int, default=8)
    ap.add_argument("--heads", type=int, nargs="+", default=[24, 40])
    ap.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--designs", nargs="+", default=["piggyback"], choices=sorted(DESIGNS))
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--out", default="results/h200/fa4_a2a/trace")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    points = run_points(args.world, args.P, args.heads, args.seqs, head_dim=args.head_dim, designs=args.designs,
                        trials=args.trials, calls=args.calls)
    flat = []
    for p in points:
        for d, r in p["designs"].items():
            st = r["stats"]
            flat.append({k: p[k] for k in ("world", "P", "H", "H_local", "M", "head_dim")}
                        | dict(design=d, t_us=p["median_us"][d], fa_only_us=p["median_us"]["fa_only"],
                               e_res_us=r["e_res_us"], trace_overhead=r["trace_overhead"],
                               store_span_p50_ns=st["store_span"]["median"], store_span_p90_ns=st["store_span"]["p90"],
                               store_span_max_ns=st["store_span"]["max"], overlap_p50=st["overlap_at_start"]["median"],
                               tile_mainloop_p50_ns=st["tile_mainloop"]["median"], tail_ns=st["tail_ns"],
                               kernel_span_ns=st["kernel_span_ns"])
                        | {f"sm_{k}": v for k, v in st["sm_time_mean_ns"].items()})
    bench.write_result(args.out, f"trace_fa4_a2a{args.tag}",
                       {"args": vars(args), "row_fields": ROW_CSV_FIELDS, "points": points}, flat)
