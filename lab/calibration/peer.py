"""Peer (NVLink) X-Stage calibration in a multi-GPU world (issue 6, step 1): bursts to one peer and to all peers.

Drives ``calibration.runner.Calibrator`` (periodic zero-gap bursts -> R; isolated bursts ->
T_iss0, Q; spin- and Tensor-Core-gap sweeps around G* -> model validation) for the ``peer``
target, K producers up to the SM count, plus the local-memory control with the same gaps,
then ``calibration.report`` fits, validates and writes figures + report per mode:

``one-peer``
    rank 0's K producer CTAs store to rank 1 (``Calibrator("peer")``: rank r -> r+1); every
    other rank only takes part in the symmetric allocation and then waits on a host (gloo)
    barrier, so no other GPU traffic disturbs the link.
``all-peers`` (P >= 3; EXPERIMENTAL)
    rank 0's K producers are split evenly over its P-1 peers: one BurstKernel launch per peer
    (K/(P-1) producers each, own grid barrier and timestamps) on P-1 concurrent streams; the
    bursts are merged into one record [K, N, 4] (a burst spans every launch's producers).  The
    launches align their bursts only within each launch, so the merged issue times include the
    launches' drift; the zero-gap drain rate is unaffected.  (A per-producer destination in
    BurstKernel itself would align them: a compile-time switch for the calibration owner.)

Output, per mode, under ``--out/<mode>/``: points.csv, bursts.csv.gz, meta.json (provenance),
summaries.csv, fit.json, validation.csv, profile-peer.json, profile-local.json, report.md,
fig3-*.png; and ``--out/profile-h200-nvlink-peer.json`` (the one-peer fit, renamed; not shipped
in xstage/profiles until reviewed) and ``--out/summary.json`` (headline numbers per mode).

In the loopback world (single-GPU dry run) the "peer" is another device buffer on the same
GPU: the local target stands in for it, so the pipeline runs end to end but the numbers are
the local-memory control's.

  torchrun --nproc-per-node=8 -m lab.calibration.peer --world torch-symm --out results/h200x8/calibration
  python -m lab.calibration.peer --world loopback --P 2 --quick --out results/h200x1-loopback/calibration

(``scripts/multigpu/peer_calibration.py`` is the same command line.)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

from lab import bench
from lab import multigpu as mg

MODES = ("one-peer", "all-peers")
PROFILE_NAME = "h200-nvlink-peer"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mg.add_world_args(p, default_out="results/h200xN/calibration", trials=1)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--region-mib", type=int, default=1024, help="destination rotation region (MiB), >> L2")
    p.add_argument("--no-mma", action="store_true", help="skip the Tensor Core gap sweep")
    p.add_argument("--no-local", action="store_true", help="skip the local-memory control")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def peer_k_list(ks, npeers: int, num_sms: int):
    """Producer counts usable when K producers are split evenly over ``npeers`` launches:
    each K rounded down to a multiple of npeers (at least npeers), at most the SM count. Pure."""
    if npeers < 1:
        raise ValueError("npeers must be >= 1")
    out = []
    for k in ks:
        k = min(int(k), num_sms)
        k = max(npeers, k - k % npeers)
        if k <= num_sms and k not in out:
            out.append(k)
    return tuple(out)


def make_config(args, num_sms: int, npeers: int = 1):
    """calibration RunConfig for a mode (``npeers`` > 1: K lists made divisible by npeers)."""
    from calibration.__main__ import _config

    ns = argparse.Namespace(region_mib=args.region_mib, quick=args.quick, no_mma=args.no_mma, cache=None)
    cfg = _config(ns)
    if npeers > 1:
        import dataclasses

        sweep_k = peer_k_list([cfg.sweep_K], npeers, num_sms)[0]
        cfg = dataclasses.replace(cfg, zero_gap_K=peer_k_list(cfg.zero_gap_K, npeers, num_sms),
                                  isolated_K=peer_k_list(cfg.isolated_K, npeers, num_sms), sweep_K=sweep_k)
    return cfg


def multi_peer_calibrator_class():
    """``Calibrator`` whose launches split the K producers over every peer (see module doc)."""
    from calibration import analysis
    from calibration.runner import Calibrator

    class MultiPeerCalibrator(Calibrator):
        def __init__(self, cfg, **kw):
            super().__init__("peer", cfg, **kw)
            torch = self.torch
            P = self.world.world_size
            self.peers = [(self.rank + 1 + i) % P for i in range(P - 1)]
            n = len(self.peers)
            self.sub_ts = [torch.zeros(self.max_records, dtype=torch.int64, device=self.device) for _ in range(n)]
            self.sub_sync = [torch.zeros(2, dtype=torch.int32, device=self.device) for _ in range(n)]
            self.streams = [torch.cuda.Stream(self.device) for _ in range(n)]

        def warmup(self):
            """Base warm-up with K rounded down to a multiple of the peer count."""
            n = len(self.peers)
            K = min(132, self.num_sms)
            K -= K % n
            B = 256 * 1024
            V = K * B
            self.launch("spin", K, B, max(3, min(self.cfg.max_bursts, self._region(V) // V)))

        def launch(self, gap_mode, K, B, N, gap_s=0.0, mma_iters=0):
            from xstage.device import raise_on_device_error

            torch = self.torch
            n = len(self.peers)
            if K % n:
                raise ValueError(f"K={K} producers do not split evenly over {n} peers")
            Kj = K // n
            kern = self.compiled_kernel(gap_mode)
            V = K * B
            main = torch.cuda.current_stream(self.device)
            t = time.time()
            for j, dst in enumerate(self.peers):
                s = self.streams[j]
                s.wait_stream(main)
                with torch.cuda.stream(s):
                    kern(self.table, dst, self.sub_ts[j], self.sub_sync[j], self.sink,
                         num_producers=Kj, bytes_per_producer=B, num_bursts=N, region_bytes=self._region(V),
                         dst_buffer_bytes=self.cfg.region_bytes,
                         gap_ns=int(round(gap_s * 1e9)) if gap_mode == "spin" else 0, mma_iters=int(mma_iters),
                         timeout_ns=int(self.cfg.timeout_s * 1e9), num_sms=self.num_sms)
            torch.cuda.synchronize(self.device)
            wall = time.time() - t
            for j, dst in enumerate(self.peers):
                raise_on_device_error(self.sub_sync[j][1:2], f"burst kernel (all-peers, dst {dst}, K={Kj}, B={B})")
            ts = torch.cat([self.sub_ts[j][: Kj * N * 4].view(Kj, N, 4) for j in range(n)]).cpu().numpy()
            return analysis.bursts_from_timestamps(ts, aligned=self.cfg.align_bursts), wall

        def meta(self):
            return {**super().meta(), "mode": "all-peers", "peers": self.peers,
                    "producers_per_peer_note": "K split evenly over the peers, one launch per peer"}

    return MultiPeerCalibrator


def run_mode(ctx, args, mode: str, out_dir: Path) -> dict:
    """Measure one mode (sender = rank 0), write the raw files; returns the run's meta (rank 0)."""
    import torch

    from calibration.runner import Calibrator, _nvidia_smi_clocks, write_bursts, write_points

    num_sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count
    npeers = ctx.P - 1 if mode == "all-peers" else 1
    cfg = make_config(args, num_sms, npeers)
    progress = not args.no_progress and ctx.is_root
    meta = {"mode": mode, "config": cfg.as_dict(), "targets": {}, "clocks_before": _nvidia_smi_clocks(),
            "world": {"backend": ctx.backend, "world_size": ctx.P}, "sender": 0}
    points, bursts, errors = [], [], {}
    t_start = time.time()
    cal = None
    try:
        if ctx.backend == "loopback":  # single-GPU stand-in: the "peer" is a buffer on this GPU
            cal = Calibrator("local", cfg, progress=progress) if ctx.is_root else None
            meta["stand_in"] = "loopback world: destination is a device buffer on the same GPU (local control)"
        elif mode == "all-peers":
            cal = multi_peer_calibrator_class()(cfg, progress=progress)  # collective: symmetric alloc
        else:
            cal = Calibrator("peer", cfg, progress=progress)  # collective: symmetric alloc
    except Exception as e:
        errors["setup"] = traceback.format_exc()
        print(f"[rank {ctx.rank}] {mode}: setup failed: {e}", flush=True)
    ok = ctx.all_ok("setup" not in errors)
    hints = None
    if ok and ctx.is_root:
        t = time.time()
        try:
            cal.run_all()
        except Exception as e:
            errors["peer"] = traceback.format_exc()
            print(f"[calibration] {mode} failed: {e}", flush=True)
        points += cal.points
        bursts += cal.bursts
        meta["targets"][cal.label] = {**cal.meta(), "seconds": time.time() - t}
        hints = {tuple(int(x) for x in k.split(",")): v for k, v in cal.gaps_used.items()}
    ctx.host_barrier()  # the receivers stay idle (host barrier) until the sender is done
    del cal
    torch.cuda.empty_cache()
    if ctx.is_root and ctx.backend != "loopback" and not args.no_local:
        t = time.time()
        try:
            ctl = Calibrator("local", cfg, progress=progress, gap_hints=hints)
            try:
                ctl.run_all()
            finally:
                points += ctl.points
                bursts += ctl.bursts
                meta["targets"][ctl.label] = {**ctl.meta(), "seconds": time.time() - t}
            del ctl
        except Exception as e:
            errors["local"] = traceback.format_exc()
            print(f"[calibration] {mode} local control failed: {e}", flush=True)
    if ctx.is_root:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_points(out_dir / "points.csv", points)
        write_bursts(out_dir / "bursts.csv.gz", bursts)
        meta.update(clocks_after=_nvidia_smi_clocks(), errors=errors, seconds=time.time() - t_start,
                    topology=mg.topology_text(), gpu_count=mg.gpu_count())
        bench.write_json(out_dir / "meta.json", meta)
    ctx.host_barrier()
    return meta


def fit_mode(mode_dir: Path, backend: str) -> dict:
    """Fit + validate + figures + report for one mode directory (CPU); headline numbers."""
    from calibration.report import fit_directory, make_figures, write_report

    fitted = fit_directory(mode_dir, profile_name="h200-nvlink")
    try:
        figs = make_figures(mode_dir)
    except Exception as e:  # figures are optional (matplotlib)
        figs = []
        print(f"figures failed: {e}")
    write_report(mode_dir, figs)
    return headline(fitted, backend)


def headline(fitted: dict, backend: str) -> dict:
    """R, Q(K max), T_iss0 and validation errors of the remote target from fit_directory's output. Pure."""
    key = "local" if backend == "loopback" else "peer"
    s = fitted.get("targets", {}).get(key, {})
    out = {"target": key}
    if "error" in s:
        out["error"] = s["error"]
        return out
    R = s.get("R", {}).get("R_bytes_per_s")
    out["R_GBps"] = None if R is None else R / 1e9
    out["R_vs_paper"] = None if R is None else (R / 1e9) / mg.PAPER["R_GBps"]
    iso = s.get("isolated", {})
    if iso:
        kmax = max(iso, key=int)
        f = iso[kmax]
        out.update(K=int(kmax), Q_MiB=f.get("Q_bytes", float("nan")) / 2**20,
                   Q_is_lower_bound=f.get("Q_is_lower_bound"), t_iss0_a_us=f.get("t_iss0_a_us"),
                   t_iss0_slope_us_per_MiB=f.get("t_iss0_slope_us_per_MiB"))
    out["validation"] = {m: {"T_iss_median_abs_rel": v["T_iss"]["median_abs_rel"],
                             "T_iss_max_abs_rel": v["T_iss"]["max_abs_rel"],
                             "T_period_median_abs_rel": v["T_period"]["median_abs_rel"]}
                         for m, v in s.get("validation", {}).items()}
    return out


def write_named_profile(out: Path, mode_dir: Path, backend: str, P: int):
    """Copy the fitted remote-target profile of ``mode_dir`` to ``out/profile-h200-nvlink-peer.json``
    (loopback: ``...-loopback-standin``) with that name; None when the fit wrote no profile."""
    prof = mode_dir / ("profile-local.json" if backend == "loopback" else "profile-peer.json")
    if not prof.exists():
        return None
    d = json.loads(prof.read_text())
    d["name"] = PROFILE_NAME if backend != "loopback" else PROFILE_NAME + "-loopback-standin"
    d["description"] = (d.get("description", "") + f" Sender rank 0 -> rank 1 of a {P}-GPU world "
                        "(torchrun, torch symmetric memory, NVLink multicast disabled).")
    dst = Path(out) / f"profile-{d['name']}.json"
    dst.write_text(json.dumps(d, indent=2) + "\n")
    return dst


def _run(ctx, args) -> None:
    out = Path(args.out)
    summary = {"modes": {}}
    for mode in args.modes:
        if mode == "all-peers" and ctx.P < 3 and ctx.backend != "loopback":
            summary["modes"][mode] = {"skipped": f"needs >= 3 ranks (P={ctx.P}): one peer == all peers"}
            continue
        if mode == "all-peers" and ctx.backend == "loopback":
            summary["modes"][mode] = {"skipped": "loopback world: no peers to split over"}
            continue
        ctx.log(f"== peer calibration: {mode}")
        meta = run_mode(ctx, args, mode, out / mode)
        if ctx.is_root:
            try:
                summary["modes"][mode] = {**fit_mode(out / mode, ctx.backend), "errors": sorted(meta["errors"]),
                                          "seconds": meta["seconds"]}
            except Exception as e:
                summary["modes"][mode] = {"error": f"fit failed: {e}", "traceback": traceback.format_exc()}
            if mode == "one-peer":
                dst = write_named_profile(out, out / mode, ctx.backend, ctx.P)
                if dst is not None:
                    summary["profile"] = str(dst)
    if ctx.is_root:
        bench.write_result(out, "summary", {**mg.header(ctx, "calibration", args), **summary})
        print(json.dumps({m: {k: v for k, v in s.items() if k in ("R_GBps", "skipped", "error")}
                          for m, s in summary["modes"].items()}, default=str))


def main(argv=None) -> int:
    args = parse_args(argv)
    return mg.run_entry(args, lambda ctx: _run(ctx, args))


if __name__ == "__main__":
    sys.exit(main())
