"""CPU test of the runner -> CSV -> fit -> profile -> report pipeline with a simulated device.

The GPU launch is replaced by the fluid simulator turned into per-producer
timestamps (same [K, N, 4] record as the kernel), so experiment sequencing,
adaptive sizing, CSV round trips, the fit and the report run end to end.
"""
import json

import numpy as np
import pytest

from calibration import analysis, runner
from calibration.report import fit_directory, make_figures, write_report
from calibration.runner import Calibrator, RunConfig
from xstage import profiles
from xstage.simulate import simulate

KiB = 1024
R_TRUE, Q_TRUE = 40e9, 2 * 2**20


class SimulatedCalibrator(Calibrator):
    """Calibrator whose launches come from xstage.simulate (no GPU)."""

    def __init__(self, target, cfg, gap_hints=None):
        self.target, self.cfg, self.progress, self.gap_hints = target, cfg, False, gap_hints or {}
        self.label = target + ("" if cfg.align_bursts else "-free")
        self.num_sms, self.points, self.bursts, self.launch_id = 132, [], [], 0
        self.compile_s, self.R_est, self.iso_fit, self.iso_T = {}, None, {}, {}
        self.mma_ns_per_iter = self.mma_intercept_s = None
        self.gaps_used = {}
        self.rng = np.random.default_rng(0)
        self.barrier_s = 1.0e-6

    def launch(self, gap_mode, K, B, N, gap_s=0.0, mma_iters=0):
        V = K * B
        if gap_mode == "mma":
            gap_s = 1e-6 + 16e-9 * mma_iters
        t0 = 0.05e-6 + V / 8e12
        sim = simulate(t0, R_TRUE, Q_TRUE, V, gap_s + self.barrier_s, n=N)
        ghz = 1.98
        ts = np.zeros((K, N, 4), dtype=np.int64)
        st = np.round(sim.start * 1e9).astype(np.int64) + 1_000_000
        en = np.round(sim.end * 1e9).astype(np.int64) + 1_000_000
        for k in range(K):
            ts[k, :, 0], ts[k, :, 1] = st // 32 * 32, en // 32 * 32
            ts[k, :, 2], ts[k, :, 3] = np.round(st * ghz), np.round(en * ghz)
        return analysis.bursts_from_timestamps(ts, aligned=self.cfg.align_bursts), 0.0

    def meta(self):
        return {"target": self.target, "num_sms": 132}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cal")
    cfg = RunConfig(zero_gap_K=(33, 132), zero_gap_B=(16 * KiB, 64 * KiB), isolated_K=(132,),
                    isolated_B=(2 * KiB, 4 * KiB, 8 * KiB, 32 * KiB, 64 * KiB, 128 * KiB),
                    sweep_B=(8 * KiB, 64 * KiB, 128 * KiB), max_bursts=400, mma_B=64 * KiB)
    points, bursts, hints = [], [], None
    for target in ("host", "local"):
        cal = SimulatedCalibrator(target, cfg, gap_hints=hints)
        cal.run_all()
        points += cal.points
        bursts += cal.bursts
        if hints is None:
            hints = {tuple(int(x) for x in k.split(",")): v for k, v in cal.gaps_used.items()}
    runner.write_points(d / "points.csv", points)
    runner.write_bursts(d / "bursts.csv.gz", bursts)
    (d / "meta.json").write_text(json.dumps({"provenance": {"gpu": "simulated"}, "targets": {}}))
    return d, points


def test_experiments_and_gap_hints(run_dir):
    _, points = run_dir
    exps = {(p["target"], p["experiment"], p["gap_mode"]) for p in points}
    for t in ("host", "local"):
        assert {(t, "zero_gap", "spin"), (t, "isolated", "spin"), (t, "gap_sweep", "spin"),
                (t, "gap_sweep", "mma")} <= exps
    host = sorted(p["gap_ns"] for p in points if p["target"] == "host" and p["experiment"] == "gap_sweep"
                  and p["gap_mode"] == "spin")
    local = sorted(p["gap_ns"] for p in points if p["target"] == "local" and p["experiment"] == "gap_sweep"
                   and p["gap_mode"] == "spin")
    assert host == local and len(host) == 3 * len(RunConfig().gap_factors)


def test_csv_roundtrip(run_dir):
    d, points = run_dir
    back = runner.read_points(d / "points.csv")
    assert len(back) == len(points)
    for a, b in zip(points, back):
        for k in ("K", "B", "V", "N", "gap_ns"):
            assert a[k] == b[k]
        assert b["T_iss"] == pytest.approx(a["T_iss"], rel=1e-12)


def test_fit_profile_and_report(run_dir, tmp_path):
    d, _ = run_dir
    prof_path = tmp_path / "h200-pcie-host.json"
    out = fit_directory(d, profile_out=prof_path)
    host = out["targets"]["host"]
    assert host["R"]["R_bytes_per_s"] == pytest.approx(R_TRUE, rel=0.05)
    assert host["isolated"]["132"]["Q_bytes"] == pytest.approx(Q_TRUE, rel=0.05)
    assert host["validation"]["spin"]["T_iss"]["median_abs_rel"] < 0.05
    plat = profiles.load(prof_path)
    assert plat.R == pytest.approx(R_TRUE, rel=0.05)
    figs = make_figures(d)
    rep = write_report(d, figs).read_text()
    assert "R** =" in rep and "Prediction of the `spin`-gap sweep" in rep


def _calibration_main(*argv):
    from calibration.__main__ import main

    return main(list(argv))


@pytest.mark.parametrize("cmd", ["run", "all"])
def test_run_without_a_gpu_writes_nothing(tmp_path, monkeypatch, capsys, cmd):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "cal"
    rc = _calibration_main(cmd, "--out", str(out), "--no-progress")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and not out.exists() and list(tmp_path.iterdir()) == []
    assert err == ["calibration: error: calibration run needs a CUDA GPU, and none is visible"]


def test_run_on_a_non_hopper_gpu_writes_nothing(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    out = tmp_path / "cal"
    rc = _calibration_main("run", "--out", str(out), "--no-progress")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and not out.exists()
    assert len(err) == 1 and "needs a Hopper GPU" in err[0] and "NVIDIA A100 (8.0)" in err[0]
