"""Run the calibration experiments on a GPU and write raw CSVs (paper Section 3).

Targets (where the bursts go):

* ``host``  — pinned, device-mapped host memory over PCIe (``xstage.world`` "host");
* ``local`` — a device buffer: the local-memory control (same kernel, same
  producers, store width, address generation and loop);
* ``peer``  — another GPU through torch symmetric memory (torchrun, >= 2 ranks;
  rank r writes to rank (r+1) % P).

Experiments, in order (later ones are sized from earlier fits):

1. ``zero_gap``: periodic bursts with no producer gap over a K x B grid -> R.
2. ``isolated``: few bursts separated by a recovery gap of 3 V/R -> T_iss0, Q.
3. ``gap_sweep`` (spin gap) and ``mma_sweep`` (Tensor Core gap, one volume):
   periodic bursts for gaps spanning the predicted recovery gap G*; each run
   long enough for the queue to fill (Q / per-period deficit) and settle.

Every launch writes its per-burst series to ``bursts.csv.gz`` and a
steady-state summary row to ``points.csv``; ``meta.json`` holds provenance,
the configuration and clock readings.
"""
from __future__ import annotations

import csv
import gzip
import math
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from . import analysis
from . import fit as fitmod

__all__ = ["RunConfig", "Calibrator", "POINT_FIELDS", "BURST_FIELDS", "NoGPUError", "check_gpu", "run_targets"]

KiB, MiB, GiB = 1024, 1024**2, 1024**3

POINT_FIELDS = [
    "target", "align", "experiment", "gap_mode", "launch", "K", "B", "V", "N", "gap_ns", "mma_iters",
    "T_iss", "T_iss_p10", "T_iss_p90", "T_period", "G_eff", "transient", "steady", "n_steady",
    "first_issue", "T_iss_span", "clock_ghz", "timer_step_ns", "wall_s",
]
BURST_FIELDS = ["target", "launch", "n", "start_s", "end_s", "issue_s", "span_s", "start_skew_s"]


@dataclass
class RunConfig:
    """What to measure.  Sizes in bytes, gaps in seconds."""

    threads: int = 128
    region_bytes: int = 1 * GiB  # rotation region: >> the 60 MB L2
    zero_gap_K: Sequence[int] = (16, 33, 66, 132)
    zero_gap_B: Sequence[int] = (16 * KiB, 64 * KiB, 256 * KiB)
    isolated_K: Sequence[int] = (33, 66, 132)
    isolated_B: Sequence[int] = tuple(sorted(set(2**e for e in range(11, 20)) | {12 * KiB, 24 * KiB, 48 * KiB}))
    sweep_K: int = 132
    sweep_B: Sequence[int] = (8 * KiB, 16 * KiB, 64 * KiB, 256 * KiB)
    gap_factors: Sequence[float] = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0)
    mma_B: Optional[int] = 64 * KiB  # None: no Tensor Core gap sweep
    fallback_gaps: Sequence[float] = (0, 1e-6, 2e-6, 5e-6, 10e-6, 20e-6, 50e-6, 100e-6)
    zero_gap_bytes: int = 512 * MiB  # volume per zero-gap launch
    min_bursts: int = 64
    max_bursts: int = 1000
    max_launch_s: float = 0.4
    timeout_s: float = 2.0
    cache: Optional[str] = None
    align_bursts: bool = True  # grid barrier before every burst (False: free-running producers)

    def as_dict(self) -> dict:
        d = asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def _nvidia_smi_clocks() -> Optional[dict]:
    q = "clocks.sm,clocks.max.sm,clocks.mem,clocks.applications.graphics,power.draw,temperature.gpu,pcie.link.gen.current,pcie.link.width.current"
    try:
        r = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv"], capture_output=True, text=True,
                           timeout=20)
        return {"query": q, "out": r.stdout.strip()} if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


class NoGPUError(RuntimeError):
    """No GPU the calibration kernels can run on (raised before anything is written)."""


# The burst kernels are compiled for sm_90a (xstage.cute_compile.HOPPER_ARCH): Hopper only.
HOPPER_CAPABILITY = (9, 0)


def check_gpu() -> None:
    """Raise :class:`NoGPUError` unless a CUDA GPU of compute capability 9.0 is visible."""
    import torch

    if not torch.cuda.is_available():
        raise NoGPUError("calibration run needs a CUDA GPU, and none is visible")
    cap = tuple(torch.cuda.get_device_capability())
    if cap != HOPPER_CAPABILITY:
        raise NoGPUError(f"calibration run needs a Hopper GPU (compute capability 9.0; the kernels are built for"
                         f" sm_90a), found {torch.cuda.get_device_name()} ({cap[0]}.{cap[1]})")


class Calibrator:
    """Runs the experiments for one target and collects rows."""

    def __init__(self, target: str, cfg: RunConfig, *, progress: bool = True, gap_hints=None):
        import torch

        from xstage.world import make_world

        from .kernels import BurstConfig, BurstKernel

        if target not in ("host", "local", "peer"):
            raise ValueError(f"target must be host, local or peer, got {target!r}")
        if not torch.cuda.is_available():
            raise RuntimeError("calibration needs a CUDA GPU")
        self.torch = torch
        self.target = target
        self.label = target + ("" if cfg.align_bursts else "-free")
        self.cfg = cfg
        self.progress = progress
        self.gap_hints = gap_hints or {}
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        if target == "local":
            self.world = make_world("loopback", 1, self.device)
        elif target == "host":
            self.world = make_world("host", 1, self.device)
        else:
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("nccl")
            self.world = make_world("torch-symm", dist.get_world_size())
            if self.world.world_size < 2:
                raise ValueError("target peer needs >= 2 ranks (torchrun --nproc-per-node 2)")
        self.rank = self.world.local_ranks[0]
        self.dst = (self.rank + 1) % self.world.world_size if target == "peer" else self.rank
        self.buf = self.world.alloc((cfg.region_bytes,), torch.uint8)
        self.table = self.buf.peer_table(self.rank)
        self.kernels = {
            mode: BurstKernel(BurstConfig(threads=cfg.threads, gap_mode=mode, cache=cfg.cache,
                                          align_bursts=cfg.align_bursts))
            for mode in ("spin", "mma")
        }
        self.max_records = 132 * (cfg.max_bursts + 8) * 4
        self.ts = torch.zeros(self.max_records, dtype=torch.int64, device=self.device)
        self.sync = torch.zeros(2, dtype=torch.int32, device=self.device)
        self.sink = torch.zeros(max(self.num_sms, 132) * cfg.threads, dtype=torch.float32, device=self.device)
        self.points: List[dict] = []
        self.bursts: List[list] = []
        self.launch_id = 0
        self.compile_s: Dict[str, float] = {}
        self.R_est: Optional[float] = None
        self.iso_fit: Dict[int, fitmod.IsolatedFit] = {}
        self.iso_T: Dict[tuple, float] = {}
        self.mma_ns_per_iter: Optional[float] = None
        self.mma_intercept_s: Optional[float] = None
        self.gaps_used: Dict[str, list] = {}

    # ------------------------------------------------------------ launches

    def _region(self, V: int) -> int:
        return (self.cfg.region_bytes // V) * V

    def compiled_kernel(self, gap_mode: str):
        """The burst kernel of ``gap_mode``, compiled on first use (compile time kept in compile_s)."""
        kern = self.kernels[gap_mode]
        if gap_mode not in self.compile_s:
            t = time.time()
            kern.compile()
            self.compile_s[gap_mode] = time.time() - t
        return kern

    def launch(self, gap_mode: str, K: int, B: int, N: int, gap_s: float = 0.0, mma_iters: int = 0):
        """One launch; returns the BurstSeries (raises on a device error)."""
        from xstage.device import raise_on_device_error

        torch = self.torch
        if K * N * 4 > self.max_records:
            raise ValueError(f"K*N={K * N} bursts exceed the timestamp buffer")
        kern = self.compiled_kernel(gap_mode)
        V = K * B
        t = time.time()
        kern(
            self.table, self.dst, self.ts, self.sync, self.sink,
            num_producers=K, bytes_per_producer=B, num_bursts=N, region_bytes=self._region(V),
            dst_buffer_bytes=self.cfg.region_bytes, gap_ns=int(round(gap_s * 1e9)) if gap_mode == "spin" else 0,
            mma_iters=int(mma_iters), timeout_ns=int(self.cfg.timeout_s * 1e9), num_sms=self.num_sms,
        )
        torch.cuda.synchronize(self.device)
        wall = time.time() - t
        raise_on_device_error(self.sync[1:2], f"burst kernel (target {self.target}, K={K}, B={B}, N={N})")
        ts = self.ts[: K * N * 4].view(K, N, 4).cpu().numpy()
        series = analysis.bursts_from_timestamps(ts, aligned=self.cfg.align_bursts)
        return series, wall

    def _record(self, experiment: str, gap_mode: str, K: int, B: int, N: int, gap_s: float, mma_iters: int,
                series, wall: float, summary: dict) -> dict:
        lid = self.launch_id
        self.launch_id += 1
        row = {
            "target": self.label, "align": "grid" if self.cfg.align_bursts else "free", "experiment": experiment, "gap_mode": gap_mode, "launch": lid,
            "K": K, "B": B, "V": K * B, "N": N, "gap_ns": int(round(gap_s * 1e9)), "mma_iters": int(mma_iters),
            **{k: summary.get(k) for k in ("T_iss", "T_iss_p10", "T_iss_p90", "T_period", "G_eff", "transient",
                                           "steady", "n_steady", "first_issue", "T_iss_span")},
            "clock_ghz": series.clock_ghz, "timer_step_ns": series.timer_step_ns, "wall_s": wall,
        }
        self.points.append(row)
        for n in range(series.n):
            self.bursts.append([self.label, lid, n, series.start[n], series.end[n], series.issue[n],
                                series.issue_span[n], series.start_skew[n]])
        return row

    def _bar(self, items, desc):
        if not self.progress:
            return items
        try:
            from tqdm import tqdm
        except ImportError:
            return items
        return tqdm(items, desc=f"{self.label}:{desc}", leave=True, mininterval=1.0)

    def _bursts_for(self, V: int, period_s: float, fill_bursts: float = 0.0) -> int:
        N = max(self.cfg.min_bursts, int(math.ceil(2 * fill_bursts)) + 48)
        if period_s > 0:
            N = min(N, max(16, int(self.cfg.max_launch_s / period_s)))
        return int(min(N, self.cfg.max_bursts))

    # --------------------------------------------------------- experiments

    def warmup(self) -> None:
        """Compile and touch the whole region once (page tables, first-touch costs)."""
        K, B = min(132, self.num_sms), 256 * KiB
        V = K * B
        N = max(3, min(self.cfg.max_bursts, self._region(V) // V))
        self.launch("spin", K, B, N)

    def zero_gap(self) -> None:
        cfg = self.cfg
        grid = [(K, B) for K in cfg.zero_gap_K for B in cfg.zero_gap_B if K <= self.num_sms]
        for K, B in self._bar(grid, "zero-gap"):
            V = K * B
            N = int(min(cfg.max_bursts, max(cfg.min_bursts, math.ceil(cfg.zero_gap_bytes / V))))
            series, wall = self.launch("spin", K, B, N)
            s = analysis.summarize(series, abs_tol=2 * _finite(series.timer_step_ns, 0) * 1e-9)
            self._record("zero_gap", "spin", K, B, N, 0.0, 0, series, wall, s.as_dict())
        zg = [p for p in self.points if p["experiment"] == "zero_gap"]
        self.R_est = fitmod.fit_drain_rate([p["V"] for p in zg], [p["T_period"] for p in zg], n_boot=50).R

    def isolated(self) -> None:
        cfg = self.cfg
        grid = [(K, B) for K in cfg.isolated_K for B in cfg.isolated_B if K <= self.num_sms]
        for K, B in self._bar(grid, "isolated"):
            V = K * B
            gap = 3.0 * V / self.R_est + 20e-6
            N = 8
            series, wall = self.launch("spin", K, B, N, gap_s=gap)
            s = analysis.summarize_isolated(series)
            self._record("isolated", "spin", K, B, N, gap, 0, series, wall, s)
            self.iso_T[(K, B)] = s["T_iss"]
        for K in sorted({k for k, _ in self.iso_T}):
            sel = [(k, b) for (k, b) in self.iso_T if k == K]
            if len(sel) >= 2:
                self.iso_fit[K] = fitmod.fit_isolated([k * b for k, b in sel], [self.iso_T[x] for x in sel],
                                                      self.R_est, K=K, n_boot=20)

    def _q_estimate(self, K: int) -> float:
        f = self.iso_fit.get(K)
        if f is None:
            return 64 * MiB
        return f.Q if f.knee_found else max(f.Q, 16 * MiB)

    def _gaps(self, K: int, B: int) -> List[float]:
        hint = self.gap_hints.get((K, B))
        if hint:
            return list(hint)
        V = K * B
        t0 = self.iso_T.get((K, B))
        if t0 is None and K in self.iso_fit:
            t0 = float(self.iso_fit[K].t_iss0(V))
        gstar = V / self.R_est - (t0 or 0.0)
        if gstar <= 1e-6:
            return list(self.cfg.fallback_gaps)
        return [f * gstar for f in self.cfg.gap_factors]

    def _sweep(self, experiment: str, gap_mode: str, B_list: Sequence[int]) -> None:
        K = min(self.cfg.sweep_K, self.num_sms)
        Q = self._q_estimate(K)
        jobs = [(B, g) for B in B_list for g in self._gaps(K, B)]
        for B, g in self._bar(jobs, experiment):
            V = K * B
            t0 = self.iso_T.get((K, B), 0.0)
            period = max(V / self.R_est, t0 + g)
            deficit = V - self.R_est * (t0 + g)
            fill = Q / deficit if deficit > 0 else 0.0
            N = self._bursts_for(V, period, fill)
            iters = 0
            if gap_mode == "mma":
                iters = self._mma_iters_for(g)
                series, wall = self.launch("mma", K, B, N, mma_iters=iters)
            else:
                series, wall = self.launch("spin", K, B, N, gap_s=g)
            s = analysis.summarize(series, abs_tol=2 * _finite(series.timer_step_ns, 0) * 1e-9)
            self._record(experiment, gap_mode, K, B, N, g if gap_mode == "spin" else 0.0, iters, series, wall,
                         s.as_dict())
            if gap_mode == "spin":  # the gap list handed to the next target (local control)
                self.gaps_used.setdefault(f"{K},{B}", []).append(g)

    def gap_sweep(self) -> None:
        self._sweep("gap_sweep", "spin", self.cfg.sweep_B)

    def _calibrate_mma(self) -> None:
        """ns per MMA-loop iteration: two short launches of minimal bursts."""
        K, B = min(self.cfg.sweep_K, self.num_sms), self.cfg.threads * 16
        res = []
        for iters in (2048, 16384):
            series, wall = self.launch("mma", K, B, 32, mma_iters=iters)
            s = analysis.summarize(series)
            res.append((iters, s.G_eff))
            self._record("mma_calibration", "mma", K, B, 32, 0.0, iters, series, wall, s.as_dict())
        (i0, g0), (i1, g1) = res
        self.mma_ns_per_iter = (g1 - g0) / (i1 - i0) * 1e9
        self.mma_intercept_s = g0 - i0 * self.mma_ns_per_iter * 1e-9

    def _mma_iters_for(self, gap_s: float) -> int:
        if not self.mma_ns_per_iter or self.mma_ns_per_iter <= 0:
            return 0
        return max(0, int(round((gap_s - max(self.mma_intercept_s, 0.0)) / (self.mma_ns_per_iter * 1e-9))))

    def mma_sweep(self) -> None:
        if self.cfg.mma_B is None:
            return
        self._calibrate_mma()
        self._sweep("gap_sweep", "mma", [self.cfg.mma_B])

    def run_all(self) -> None:
        self.warmup()
        self.zero_gap()
        self.isolated()
        self.gap_sweep()
        self.mma_sweep()

    def meta(self) -> dict:
        return {
            "target": self.target,
            "label": self.label,
            "align_bursts": self.cfg.align_bursts,
            "world_backend": self.world.backend,
            "world_size": self.world.world_size,
            "rank": self.rank,
            "dst": self.dst,
            "num_sms": self.num_sms,
            "compile_s": self.compile_s,
            "R_estimate_online": self.R_est,
            "mma_ns_per_iter": self.mma_ns_per_iter,
            "mma_intercept_us": None if self.mma_intercept_s is None else self.mma_intercept_s * 1e6,
            "uva_checks": getattr(self.world, "uva_checks", None),
            "host_view_is_cuda": bool(self.buf.local(self.rank).is_cuda),
        }


def _finite(x, default):
    return x if x is not None and math.isfinite(x) else default


def write_points(path: Path, rows: List[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=POINT_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in POINT_FIELDS})


def read_points(path: Path) -> List[dict]:
    ints = {"launch", "K", "B", "V", "N", "gap_ns", "mma_iters", "transient", "n_steady"}
    out = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            row = {}
            for k, v in r.items():
                if k in ("target", "align", "experiment", "gap_mode"):
                    row[k] = v
                elif k == "steady":
                    row[k] = v in ("True", "true", "1")
                elif v in ("", "None", None):
                    row[k] = None
                elif k in ints:
                    row[k] = int(float(v))
                else:
                    row[k] = float(v)
            out.append(row)
    return out


def write_bursts(path: Path, rows: List[list]) -> None:
    with gzip.open(path, "wt", newline="") as f:
        w = csv.writer(f)
        w.writerow(BURST_FIELDS)
        for r in rows:
            w.writerow([r[0], r[1], r[2]] + [f"{x:.9e}" for x in r[3:]])


def run_targets(targets: Sequence[str], out_dir: Path, cfg: RunConfig, *, progress: bool = True,
                aligns: Sequence[bool] = (True,)) -> dict:
    """Run every (alignment mode, target) in order, write outputs.

    Within one alignment mode the local control reuses the first target's
    gaps for the same (K, B), so both sweeps share their x axis.  Without a
    Hopper GPU it raises :class:`NoGPUError` before creating ``out_dir``.
    """
    import dataclasses

    import torch

    check_gpu()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    from xstage import provenance

    meta = {"config": cfg.as_dict(), "targets": {}, "clocks_before": _nvidia_smi_clocks()}
    points: List[dict] = []
    bursts: List[list] = []
    errors = {}
    t_start = time.time()
    for align in aligns:
        c = dataclasses.replace(cfg, align_bursts=bool(align))
        hints = None
        for target in targets:
            label = target + ("" if align else "-free")
            t = time.time()
            try:
                cal = Calibrator(target, c, progress=progress, gap_hints=hints)
                try:
                    cal.run_all()
                finally:
                    points += cal.points
                    bursts += cal.bursts
                    meta["targets"][label] = {**cal.meta(), "seconds": time.time() - t}
                if hints is None:
                    hints = {tuple(int(x) for x in k.split(",")): v for k, v in cal.gaps_used.items()}
                del cal
                torch.cuda.empty_cache()
            except Exception as e:  # keep what was measured; report the failure
                import traceback

                errors[label] = traceback.format_exc()
                print(f"[calibration] {label} failed: {e}", flush=True)
            write_points(out_dir / "points.csv", points)
    write_bursts(out_dir / "bursts.csv.gz", bursts)
    meta["clocks_after"] = _nvidia_smi_clocks()
    meta["errors"] = errors
    meta["seconds"] = time.time() - t_start
    provenance.write_json(out_dir / "meta.json", meta)
    return meta
