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

from .interface import KernelConfig, _launch, build_kernel, default_num_sms
from .kernel import TRACE_FIELDS
from .validate import check_attention_a2a

UNSET_MIN = torch.iinfo(torch.int64).max  # the min-reduced field before any store (host fill)


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
    per SM (non-persistent only: the next CTA's start after a tile's last store issue); ``tail_ns``
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
    if not persistent:
        gaps = []
        by_sm: Dict[int, List[Dict]] = {}
        for r in rows:
            by_sm.setdefault(r["smid"], []).append(r)
        for tiles in by_sm.values():
            tiles.sort(key=lambda r: r["t_cta_start"])
            gaps += [nxt["t_cta_start"] - cur["t_last_store"] for cur, nxt in zip(tiles, tiles[1:])]
        out["retire_to_next_start"] = _quantiles(gaps)
        out["sms"] = len(by_sm)
    return out


def run_points(world_name: str, P: int, heads: Sequence[int], seqs: Sequence[int], *, head_dim: int = 128,
               dtype=torch.bfloat16, persistent: bool = False, calls: int = 5) -> List[Dict]:
    """Rank 0's fused kernel of a single-process world (``host``: every destination in pinned host
    memory over PCIe; ``loopback``: the control) per (H, M): the trace statistics of ``calls``
    traced launches (the last one's, and its store-span medians per call), and the untraced
    fused / traced fused / FA-only medians (CUDA events, ``calls`` each after a warm-up), so the
    trace's own overhead (the traced call includes its trace tensor's fill) and E_res = T_fused -
    T_FA come from the same run."""
    import fa4_a2a
    from xstage import bench
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
        fns = {"fused": lambda: fa4_a2a.attention_a2a(q, k, v, dest.local(0), table, num_ranks=P,
                                                      persistent=persistent),
               "fused traced": lambda: traced_attention_a2a(q, k, v, dest.local(0), table, num_ranks=P,
                                                            persistent=persistent),
               "fa_only": lambda: fa4_a2a.attention_local(q, k, v, o_local, persistent=persistent)}
        timed = {name: bench.event_timed(fn) for name, fn in fns.items()}  # one warm-up each
        medians = {name: statistics.median(t() for _ in range(calls)) for name, t in timed.items()}
        per_call = []
        for _ in range(calls):
            tr = traced_attention_a2a(q, k, v, dest.local(0), table, num_ranks=P, persistent=persistent)
            torch.cuda.synchronize()
            stats = trace_statistics(decode_trace(tr), persistent=persistent)
            per_call.append(stats["store_span"]["median"])
        out.append(dict(world=world_name, P=P, H=H, H_local=Hl, M=M, head_dim=head_dim, persistent=persistent,
                        median_us=medians, e_res_us=medians["fused"] - medians["fa_only"],
                        trace_overhead=medians["fused traced"] / medians["fused"],
                        store_span_median_per_call_ns=per_call, stats=stats))
        print(f"H={H} M={M}: fused {medians['fused']:.1f} us, FA {medians['fa_only']:.1f} us, E_res "
              f"{out[-1]['e_res_us']:.1f} us, trace overhead {out[-1]['trace_overhead']:.3f}; store span median "
              f"{stats['store_span']['median']} ns, overlap median {stats['overlap_at_start']['median']}, "
              f"tail {stats['tail_ns']} ns", flush=True)
        dest = fns = timed = None  # the launches' buffers go before the next shape allocates
        torch.cuda.empty_cache()
    return out


def main(argv=None):
    """``scripts/trace_fa4_a2a.py``: :func:`run_points` into ``--out``/trace_fa4_a2a{tag}.json."""
    import argparse

    from xstage import bench

    ap = argparse.ArgumentParser(description="Per-tile timelines of the fused FA + A2A kernel (issue 29, step 1)")
    ap.add_argument("--world", default="host", choices=("host", "loopback", "loopback+host"))
    ap.add_argument("--P", type=int, default=8)
    ap.add_argument("--heads", type=int, nargs="+", default=[24, 40])
    ap.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--persistent", action="store_true")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--out", default="results/h200/fa4_a2a/trace")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    rows = run_points(args.world, args.P, args.heads, args.seqs, head_dim=args.head_dim, persistent=args.persistent,
                      calls=args.calls)
    flat = [{k: v for k, v in r.items() if k not in ("stats", "median_us", "store_span_median_per_call_ns")}
            | {f"{n.replace(' ', '_')}_us": t for n, t in r["median_us"].items()}
            | {"store_span_median_ns": r["stats"]["store_span"]["median"],
               "overlap_median": r["stats"]["overlap_at_start"]["median"], "tail_ns": r["stats"]["tail_ns"]}
            for r in rows]
    bench.write_result(args.out, f"trace_fa4_a2a{args.tag}", {"args": vars(args), "points": rows}, flat)
