"""Shared machinery of the multi-GPU suite (issue 6; scripts/multigpu_suite.sh, docs/multigpu.md).

Every entry point of the suite (``lab.multigpu_envcheck``, ``lab.calibration.peer``,
``lab.fa4_a2a.multigpu_sweep``, ``lab.megamoe.multigpu_ep``, ``scripts/multigpu/correctness.py``)
runs in one of two worlds:

``torch-symm``
    one process per GPU under ``torchrun``; ``torch.distributed`` (NCCL for
    device collectives, plus a gloo group for host-side barriers and result
    gathering, so an idle rank never spins a GPU kernel while another rank
    measures) and torch symmetric memory through :func:`xstage.world.make_world`.
``loopback``
    ``P`` simulated ranks in one process on one GPU (the single-GPU dry run of
    the same code paths: every per-rank callable runs once per simulated rank).

Here: the world request and its checks (:func:`add_world_args`, :func:`check_world_request`,
:func:`setup`, :class:`Ctx`, :func:`run_entry`), the timing protocol (:func:`time_variants`,
:func:`reduce_trials`, :func:`reduce_gathered`), symmetric-memory peer views, the common
result header (environment and topology, :func:`header`) and the correctness step's frame
(:func:`check_close`, :func:`run_checks`). Result files: :func:`lab.bench.write_result`.

Timing protocol (both worlds): per trial and variant, every local rank is
aligned (torch-symm: host barrier, then a one-element NCCL all-reduce on the
timing stream right before the start event, so all ranks' start events fire
together), runs ``replays`` back-to-back calls between two CUDA events, and
records its per-call time.  Per-rank samples are gathered to rank 0, reduced
with :func:`reduce_trials`: max across ranks of every trial (a collective step
is as slow as its slowest rank), then the median over trials.

The pure-python parts (argument checks, reductions, result layout) are
CPU-tested in ``tests/test_multigpu_suite.py``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, Mapping, Optional, Sequence

from lab import bench, paired

WORLDS = ("torch-symm", "loopback")
# NVLink multicast (NVLS) stays off in every multi-GPU run (issue 6; see docs/multigpu.md).
MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
# The paper's headline numbers (arXiv:2607.23264), quoted next to ours in every report.
PAPER = {
    "R_GBps": 717.0,  # X-Stage drain rate on the paper's platform (B200, NVLink)
    "fa_speedup_max": 1.43,  # FA3/FA4 + post-A2A: best Serial / Fused speedup (Table 3)
    "megamoe_geomean": 1.18,  # MegaMoE interleaved vs expert-wave, geometric mean
}
RESULT_FORMAT = "xstage-multigpu/1"


class WorldArgsError(ValueError):
    """Bad world request (world kind, world size, GPU count, environment): raised before any launch."""


# --------------------------------------------------------------------------- arguments


def add_world_args(p: argparse.ArgumentParser, *, default_out: str, trials: int = 21) -> argparse.ArgumentParser:
    """The arguments every entry point shares."""
    p.add_argument("--world", choices=WORLDS, required=True,
                   help="torch-symm: one process per GPU under torchrun; loopback: P simulated ranks on one GPU")
    p.add_argument("--P", type=int, default=None,
                   help="world size; loopback: required; torch-symm: optional, must equal torchrun's WORLD_SIZE")
    p.add_argument("--out", default=default_out, help="output directory (created by rank 0)")
    p.add_argument("--trials", type=int, default=trials, help="timed trials (median over trials)")
    p.add_argument("--quick", action="store_true", help="small grids (smoke test)")
    return p


def parse_with_quick_grid(p: argparse.ArgumentParser, argv, grid: str, full: Sequence, quick: Sequence,
                          quick_trials: int) -> argparse.Namespace:
    """Parse ``argv`` with ``p`` (built on :func:`add_world_args`); the grid argument ``grid``
    (default None) becomes ``quick`` with ``--quick``, else ``full``, and ``--quick`` lowers the
    trials to ``quick_trials`` unless ``--trials`` was given."""
    args = p.parse_args(argv)
    if getattr(args, grid) is None:
        setattr(args, grid, list(quick if args.quick else full))
    if args.quick and args.trials == p.get_default("trials"):
        args.trials = quick_trials
    return args


def check_world_request(world: str, P: Optional[int], env: Mapping[str, str], device_count: int,
                        *, require_multicast_off: bool = True) -> int:
    """Validate a world request before anything is initialized; return the world size.

    Pure function of its arguments (tests pass a fake ``env`` and ``device_count``).
    """
    if world not in WORLDS:
        raise WorldArgsError(f"--world must be one of {WORLDS}, got {world!r}")
    if P is not None and (isinstance(P, bool) or not isinstance(P, int) or P < 1):
        raise WorldArgsError(f"--P must be a positive int, got {P!r}")
    if world == "loopback":
        if P is None:
            raise WorldArgsError("--world loopback needs --P (number of simulated ranks)")
        if device_count < 1:
            raise WorldArgsError("--world loopback needs one CUDA GPU (none visible)")
        return P
    missing = [k for k in TORCHRUN_ENV if k not in env]
    if missing:
        raise WorldArgsError(
            f"--world torch-symm must run under torchrun (one process per GPU); missing {missing}. "
            "Use: torchrun --nproc-per-node=<GPUs> <entry> --world torch-symm ... (docs/multigpu.md)")
    try:
        ws, rank, local = (int(env[k]) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"))
    except ValueError:
        raise WorldArgsError(f"non-integer torchrun variables: { {k: env[k] for k in TORCHRUN_ENV} }") from None
    if device_count < 2:
        raise WorldArgsError(f"--world torch-symm needs >= 2 GPUs on this host, found {device_count} "
                             "(use --world loopback --P N on a single GPU)")
    if ws < 2:
        raise WorldArgsError(f"--world torch-symm needs >= 2 ranks, torchrun started WORLD_SIZE={ws}")
    if P is not None and P != ws:
        raise WorldArgsError(f"--P {P} does not match torchrun's WORLD_SIZE={ws}")
    if not 0 <= rank < ws:
        raise WorldArgsError(f"RANK={rank} out of range for WORLD_SIZE={ws}")
    if ws > device_count and int(env.get("LOCAL_WORLD_SIZE", ws)) > device_count:
        raise WorldArgsError(f"{ws} ranks on this host but only {device_count} GPUs: one process per GPU")
    if local >= device_count:
        raise WorldArgsError(f"LOCAL_RANK={local} but only {device_count} GPUs are visible")
    if require_multicast_off:
        bad = {k: env.get(k) for k, v in MULTICAST_ENV.items() if env.get(k) != v}
        if bad:
            want = " ".join(f"{k}={v}" for k, v in MULTICAST_ENV.items())
            raise WorldArgsError(f"NVLink multicast must stay disabled: export {want} (now: {bad})")
    return ws


# --------------------------------------------------------------------------- reductions


def median(xs: Sequence[float]) -> float:
    """Median (mean of the two middle values for an even count)."""
    if not xs:
        raise ValueError("median of an empty sequence")
    return float(statistics.median(xs))


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile, q in [0, 1]."""
    if not xs:
        raise ValueError("quantile of an empty sequence")
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return float(s[lo] + (s[hi] - s[lo]) * (pos - lo))


def geomean(xs: Sequence[float]) -> float:
    xs = list(xs)
    if not xs:
        raise ValueError("geometric mean of an empty sequence")
    if any(not (x > 0) for x in xs):
        raise ValueError(f"geometric mean needs positive values, got {xs}")
    return float(math.exp(sum(math.log(x) for x in xs) / len(xs)))


def reduce_trials(per_rank: Mapping[int, Sequence[float]]) -> dict:
    """Max-across-ranks per trial, then statistics over trials.

    ``per_rank[r][t]``: rank r's time in trial t (every rank the same number of
    trials, trials aligned across ranks).  Returns ``median_us`` (median over
    trials of the per-trial max), p10/p90 of the per-trial max, the per-trial
    max series, per-rank medians, and which rank was slowest how often.
    """
    if not per_rank:
        raise ValueError("no ranks")
    ranks = sorted(per_rank)
    n = {len(per_rank[r]) for r in ranks}
    if len(n) != 1:
        raise ValueError(f"ranks have different trial counts: { {r: len(per_rank[r]) for r in ranks} }")
    (n,) = n
    if n == 0:
        raise ValueError("no trials")
    trial_max, slowest = [], {r: 0 for r in ranks}
    for t in range(n):
        vals = [(float(per_rank[r][t]), r) for r in ranks]
        m, r_max = max(vals)
        trial_max.append(m)
        slowest[r_max] += 1
    trial_min = [min(float(per_rank[r][t]) for r in ranks) for t in range(n)]
    return {
        "median_us": median(trial_max),
        "p10_us": quantile(trial_max, 0.1),
        "p90_us": quantile(trial_max, 0.9),
        "trial_max_us": trial_max,
        "rank_median_us": {str(r): median(per_rank[r]) for r in ranks},
        "rank_spread": median(trial_max) / median(trial_min) if median(trial_min) > 0 else None,
        "slowest_rank_count": {str(r): c for r, c in slowest.items()},
        "ranks": len(ranks),
        "trials": n,
    }


def merge_rank_samples(gathered: Sequence[Mapping[str, Mapping[int, Sequence[float]]]]) -> Dict[str, Dict[int, list]]:
    """Merge per-process ``{variant: {rank: samples}}`` dicts (all_gather_object output)."""
    out: Dict[str, Dict[int, list]] = {}
    for d in gathered:
        for name, by_rank in d.items():
            dst = out.setdefault(name, {})
            for r, s in by_rank.items():
                if int(r) in dst:
                    raise ValueError(f"rank {r} reported twice for {name!r}")
                dst[int(r)] = list(s)
    return out


# --------------------------------------------------------------------------- context


class Ctx:
    """Process-side view of the world: the xstage World plus host-side coordination."""

    def __init__(self, args, world, *, rank: int, nprocs: int, gloo=None, dist=None):
        self.args = args
        self.world = world
        self.backend = world.backend
        self.P = world.world_size
        self.rank = rank  # process rank (0 in loopback)
        self.nprocs = nprocs
        self.local_ranks = list(world.local_ranks)
        self.device = world.device
        self.is_root = rank == 0
        self._gloo = gloo
        self._dist = dist
        self._token = None

    @property
    def distributed(self) -> bool:
        return self._dist is not None

    def host_barrier(self) -> None:
        """CPU-only barrier (gloo): idle ranks wait here without running any GPU kernel."""
        if self._dist is not None:
            self._dist.barrier(group=self._gloo)

    def align(self) -> None:
        """Align the start of a timed region across ranks (see module doc)."""
        import torch

        torch.cuda.synchronize(self.device)
        if self._dist is not None:
            self._dist.barrier(group=self._gloo)
            if self._token is None:
                self._token = torch.zeros(1, device=self.device)
            self._dist.all_reduce(self._token)  # enqueued on the current stream: events follow it

    def gather(self, obj) -> Optional[list]:
        """Every process's ``obj`` on rank 0 (list by process rank); None elsewhere."""
        if self._dist is None:
            return [obj]
        out = [None] * self.nprocs
        self._dist.all_gather_object(out, obj, group=self._gloo)
        return out if self.is_root else None

    def agree_max(self, value: float) -> float:
        """The max of ``value`` over processes (every process gets it)."""
        if self._dist is None:
            return value
        out = [None] * self.nprocs
        self._dist.all_gather_object(out, value, group=self._gloo)
        return max(out)

    def from_root(self, value):
        """Rank 0's ``value`` on every process."""
        if self._dist is None:
            return value
        out = [None] * self.nprocs
        self._dist.all_gather_object(out, value, group=self._gloo)
        return out[0]

    def all_ok(self, ok: bool) -> bool:
        if self._dist is None:
            return bool(ok)
        out = [None] * self.nprocs
        self._dist.all_gather_object(out, bool(ok), group=self._gloo)
        return all(out)

    def log(self, *a) -> None:
        if self.is_root:
            print(*a, flush=True)

    def close(self) -> None:
        """Tear the process group down (no barrier: a failed rank must not hang the others)."""
        if self._dist is not None and self._dist.is_initialized():
            self._dist.destroy_process_group()


def setup(args, *, require_multicast_off: bool = True, timeout_min: float = 9.0) -> Ctx:
    """Check the request, initialize torch.distributed when torch-symm, make the world."""
    import torch

    from xstage.world import make_world

    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    P = check_world_request(args.world, args.P, os.environ, n_gpu, require_multicast_off=require_multicast_off)
    if args.world == "loopback":
        world = make_world("loopback", P)
        return Ctx(args, world, rank=0, nprocs=1)
    import datetime

    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    timeout = datetime.timedelta(minutes=timeout_min)
    if not dist.is_initialized():
        try:
            dist.init_process_group("nccl", device_id=dev, timeout=timeout)
        except TypeError:  # torch without device_id
            dist.init_process_group("nccl", timeout=timeout)
    gloo = dist.new_group(backend="gloo", timeout=timeout)
    try:  # older torch needs this before the first rendezvous; newer ones do it lazily (idempotent)
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.enable_symm_mem_for_group(dist.group.WORLD.group_name)
    except (ImportError, AttributeError):
        pass
    world = make_world("torch-symm", P, device=dev)
    return Ctx(args, world, rank=dist.get_rank(), nprocs=dist.get_world_size(), gloo=gloo, dist=dist)


# --------------------------------------------------------------------------- timing


def time_variants(ctx: Ctx, fns: Mapping[str, Mapping[int, Callable[[], object]]], *, trials: int,
                  target_trial_us: float = 3000.0, max_replays: int = 20, eager: Sequence[str] = (),
                  warmup: int = 2):
    """Per-rank per-call times (us) of every variant: ``({variant: {rank: [trial samples]}}, replays)``.

    ``fns[variant][rank]`` is rank ``rank``'s call.  Variants not in ``eager``
    are captured once in a CUDA graph per rank and replayed; ``eager`` ones
    (process-group collectives) are called directly.  Replays per trial are
    sized from an untimed estimate and agreed across processes (the max), so a
    collective runs the same number of times on every rank.  Trials rotate the
    variant order; every process uses the same order.
    """
    import torch

    from lab.timing import capture_graph

    names = list(fns)
    runners: Dict[str, Dict[int, Callable[[], object]]] = {}
    for name in names:
        runners[name] = {}
        for r in ctx.local_ranks:
            fn = fns[name][r]
            if name in eager:
                for _ in range(warmup):
                    fn()
                runners[name][r] = fn
            else:
                runners[name][r] = capture_graph(fn, warmup=warmup).replay
    torch.cuda.synchronize(ctx.device)
    replays = {}
    for name in names:
        est = 0.0
        for r in ctx.local_ranks:
            ctx.align()
            est = max(est, bench.event_timed(runners[name][r], calls=3, warmup=0)())
        replays[name] = bench.replays_for(ctx.agree_max(est), target_trial_us, 3, max_replays)
    timed = {name: {r: bench.event_timed(runners[name][r], calls=replays[name], warmup=0) for r in ctx.local_ranks}
             for name in names}
    samples: Dict[str, Dict[int, list]] = {n: {r: [] for r in ctx.local_ranks} for n in names}
    for t in range(trials):
        for name in paired.rotated(names, t):
            for r in ctx.local_ranks:
                ctx.align()
                samples[name][r].append(timed[name][r]())
    del runners, timed
    return samples, replays


def reduce_gathered(ctx: Ctx, samples: Dict[str, Dict[int, list]]) -> Optional[Dict[str, dict]]:
    """Gather per-rank samples on rank 0 and reduce each variant (None on other ranks)."""
    gathered = ctx.gather(samples)
    if gathered is None:
        return None
    merged = merge_rank_samples(gathered)
    return {name: reduce_trials(by_rank) for name, by_rank in merged.items()}


# --------------------------------------------------------------------------- symmetric-memory peer views


def symm_peer_views(ctx: Ctx, shape, dtype):
    """Every rank's copy of one symmetric buffer as tensors on this rank's device.

    torch-symm: ``torch.distributed._symmetric_memory`` allocation; peer j's
    copy is ``handle.get_buffer(j, ...)`` (a mapping of j's memory: writes from
    a kernel on this GPU travel over NVLink).  loopback: the P local buffers.
    Returns ``({rank: [P views]}, keepalive)``.
    """
    if ctx.backend == "loopback":
        buf = ctx.world.alloc(shape, dtype)
        views = [buf.local(j) for j in range(ctx.P)]
        return {r: views for r in ctx.local_ranks}, buf
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    t = symm_mem.empty(tuple(shape), dtype=dtype, device=ctx.device)
    hdl = symm_mem.rendezvous(t, dist.group.WORLD)
    el = t.element_size()
    base = int(hdl.buffer_ptrs[ctx.rank])
    offsets = [0]
    if t.data_ptr() != base and (t.data_ptr() - base) % el == 0:
        offsets.insert(0, (t.data_ptr() - base) // el)
    for off in offsets:  # which storage_offset convention this torch uses: check on our own rank
        mine = hdl.get_buffer(ctx.rank, list(shape), dtype, off)
        if mine.data_ptr() == t.data_ptr():
            views = [t if j == ctx.rank else hdl.get_buffer(j, list(shape), dtype, off) for j in range(ctx.P)]
            return {ctx.rank: views}, (t, hdl)
    raise RuntimeError("symmetric memory: get_buffer(rank) does not alias the local tensor; cannot build peer views")


# --------------------------------------------------------------------------- environment, topology, result header


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def run_text(cmd: Sequence[str], timeout: float = 30.0) -> str:
    """stdout of a command, or a one-line note of why there is none."""
    try:
        r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as e:
        return f"<{' '.join(cmd)}: {type(e).__name__}: {e}>"
    if r.returncode != 0:
        return f"<{' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()[:500]}>"
    return r.stdout


def topology_text() -> str:
    return run_text(["nvidia-smi", "topo", "-m"])


def header(ctx: Optional[Ctx], step: str, args=None) -> dict:
    """The common top of every result JSON (provenance is added by xstage.provenance.write_json)."""
    h = {
        "format": RESULT_FORMAT,
        "step": step,
        "gpu_count": gpu_count(),
        "topology": topology_text(),
        "multicast_env": {k: os.environ.get(k) for k in MULTICAST_ENV},
        "paper": PAPER,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if ctx is not None:
        h["world"] = {"backend": ctx.backend, "world_size": ctx.P, "processes": ctx.nprocs}
        try:
            import torch

            h["num_sms"] = torch.cuda.get_device_properties(ctx.device).multi_processor_count
        except Exception:
            pass
    if args is not None:
        h["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return h


# --------------------------------------------------------------------------- the correctness step


def check_close(out, ref, tol_abs: float, tol_rel: float = 0.0) -> dict:
    """Every element finite (poison gone) and within tol_abs + tol_rel*max|ref|. Returns a record."""
    import torch

    o = out.float()
    finite = bool(torch.isfinite(o).all().item()) if o.numel() else True
    err = float((o - ref.float()).abs().max().item()) if o.numel() else 0.0
    lim = tol_abs + tol_rel * (float(ref.abs().max().item()) if ref.numel() else 0.0)
    return {"finite": finite, "max_abs_err": err, "tol": lim, "ok": finite and err <= lim}


def save_partial(out_dir, stem: str, rank: int, records) -> Path:
    """Append this rank's records to ``out_dir/ranks/<stem>-rank<r>.jsonl`` (one JSON per line)."""
    path = Path(out_dir) / "ranks" / f"{stem}-rank{rank}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r, default=str) + "\n")
    return path


def summarize_checks(results) -> dict:
    """Counts of passed/failed checks per kernel. Pure."""
    out = {}
    for r in results:
        d = out.setdefault(r["kernel"], {"checks": 0, "passed": 0, "failed": []})
        d["checks"] += 1
        if r.get("ok"):
            d["passed"] += 1
        else:
            d["failed"].append({k: r.get(k) for k in ("case", "variant", "rank", "max_abs_err", "error")})
    out["all_ok"] = all(not d["failed"] for k, d in out.items() if isinstance(d, dict)) and bool(results)
    return out


def run_checks(ctx: Ctx, args, checks: Mapping[str, Callable[[Ctx], list]]) -> int:
    """The correctness step: every check of ``checks`` (kernel name -> ``check(ctx)`` -> records,
    one dict per rank and case with an ``ok`` key) on every process, each kernel's records
    appended per rank as they come (:func:`save_partial`: they survive a later hang or kill);
    rank 0 gathers them, writes ``args.out/args.stem.json`` (+ .csv) and prints a summary.
    Exit status 0 when every check of every rank passed."""
    t0 = time.time()
    results = []
    for check in checks.values():
        part = check(ctx)
        results += part
        save_partial(args.out, args.stem, ctx.rank, part)
    gathered = ctx.gather(results)
    ok = False
    if ctx.is_root:
        allres = [r for part in gathered for r in part]
        summ = summarize_checks(allres)
        payload = {**header(ctx, "correctness", args), "summary": summ, "results": allres,
                   "seconds": time.time() - t0}
        flat = [{k: v for k, v in r.items() if k != "traceback" and not isinstance(v, (list, dict))}
                for r in allres]
        path = bench.write_result(args.out, args.stem, payload, flat)
        for kname in checks:
            d = summ.get(kname, {"checks": 0, "passed": 0, "failed": []})
            print(f"{kname}: {d['passed']}/{d['checks']} checks passed")
            for f in d["failed"][:20]:
                print(f"  FAILED {f}")
        print(f"wrote {path}")
        ok = summ["all_ok"]
    return 0 if ctx.from_root(ok) else 1


# --------------------------------------------------------------------------- entry frame


def fail(msg: str, code: int = 2) -> int:
    print(f"error: {msg}", file=sys.stderr, flush=True)
    return code


def run_entry(args, body: Callable[["Ctx"], Optional[int]]) -> int:
    """The shared frame of every entry point: set the world up from ``args``, run
    ``body(ctx)`` (its return value is the exit code; None means 0), turn bad world
    arguments and the kernels' input-validation errors (ValueError) into one clear
    error line, and always close the context (process group, barriers)."""
    try:
        ctx = setup(args)
    except WorldArgsError as e:
        return fail(str(e))
    try:
        rc = body(ctx)
    except WorldArgsError as e:
        return fail(str(e))
    except ValueError as e:  # shape, dtype, divisibility checks of the kernels' APIs
        traceback.print_exc()
        return fail(f"{type(e).__name__}: {e}")
    finally:
        ctx.close()
    return 0 if rc is None else rc
