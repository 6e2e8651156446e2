"""CPU tests of the multi-GPU suite (issue 6): argument checks, the max-across-ranks/median
reduction, result summaries, report generation on synthetic data and the suite's dry run.

The library modules (lab.multigpu, lab.multigpu_report, lab.calibration.peer,
lab.fa4_a2a.multigpu_sweep, lab.fa4_a2a.multigpu_checks) are imported; the command lines under
scripts/multigpu only run as subprocesses. The megamoe modules (lab.megamoe.multigpu_ep,
lab.megamoe.multigpu_checks): tests/test_megamoe_multigpu.py. The GPU parts run on a multi-GPU host
(scripts/multigpu_suite.sh) or in the loopback world (``--loopback``);
tests/test_multigpu_gpu.py covers those where a GPU is present."""
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lab.calibration import peer
from lab.fa4_a2a import multigpu_checks, multigpu_sweep
from lab import multigpu as mg
from lab import multigpu_report

ROOT = Path(__file__).resolve().parents[1]
MG = ROOT / "scripts" / "multigpu"
SUITE = ROOT / "scripts" / "multigpu_suite.sh"
# the command lines import the packages from this checkout: nothing else puts it on their path
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + ([os.environ["PYTHONPATH"]]
                                                                   if os.environ.get("PYTHONPATH") else []))}
TORCHRUN_ENV = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", **mg.MULTICAST_ENV}


# --------------------------------------------------------------------------- world requests


def test_world_request_valid():
    assert mg.check_world_request("torch-symm", None, TORCHRUN_ENV, 4) == 4
    assert mg.check_world_request("torch-symm", 4, TORCHRUN_ENV, 8) == 4
    assert mg.check_world_request("loopback", 8, {}, 1) == 8


@pytest.mark.parametrize("world,P,env,gpus,match", [
    ("loopback", None, {}, 1, "needs --P"),
    ("loopback", 4, {}, 0, "one CUDA GPU"),
    ("loopback", 0, {}, 1, "positive int"),
    ("torch-symm", None, {}, 8, "must run under torchrun"),
    ("torch-symm", None, {**TORCHRUN_ENV, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}, 8, ">= 2 ranks"),
    ("torch-symm", None, TORCHRUN_ENV, 1, ">= 2 GPUs"),
    ("torch-symm", 8, TORCHRUN_ENV, 8, "does not match"),
    ("torch-symm", None, {**TORCHRUN_ENV, "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"}, 2, "LOCAL_RANK=3"),
    ("torch-symm", None, TORCHRUN_ENV, 2, "4 ranks on this host but only 2 GPUs"),
    ("torch-symm", None, {**TORCHRUN_ENV, "RANK": "x"}, 4, "non-integer"),
    ("torch-symm", None, {k: v for k, v in TORCHRUN_ENV.items() if k != "NCCL_NVLS_ENABLE"}, 4, "multicast"),
    ("torch-symm", None, {**TORCHRUN_ENV, "TORCH_SYMM_MEM_DISABLE_MULTICAST": "0"}, 4, "multicast"),
    ("nvshmem", 2, {}, 2, "--world must be"),
])
def test_world_request_errors(world, P, env, gpus, match):
    with pytest.raises(mg.WorldArgsError, match=match):
        mg.check_world_request(world, P, env, gpus)


def test_world_request_multicast_check_can_be_waived():
    env = {k: v for k, v in TORCHRUN_ENV.items() if k not in mg.MULTICAST_ENV}
    assert mg.check_world_request("torch-symm", None, env, 4, require_multicast_off=False) == 4


# --------------------------------------------------------------------------- reductions


def test_reduce_trials_max_across_ranks_then_median():
    per_rank = {0: [1.0, 5.0, 3.0, 2.0, 9.0], 1: [2.0, 2.0, 4.0, 2.5, 1.0], 2: [0.5, 0.5, 0.5, 0.5, 0.5]}
    red = mg.reduce_trials(per_rank)
    assert red["trial_max_us"] == [2.0, 5.0, 4.0, 2.5, 9.0]
    assert red["median_us"] == 4.0  # not the median of any one rank (0: 3, 1: 2, 2: 0.5)
    assert red["rank_median_us"] == {"0": 3.0, "1": 2.0, "2": 0.5}
    assert red["slowest_rank_count"] == {"0": 2, "1": 3, "2": 0}
    assert red["rank_spread"] == pytest.approx(4.0 / 0.5)
    assert red["ranks"] == 3 and red["trials"] == 5
    assert red["p10_us"] <= red["median_us"] <= red["p90_us"]


def test_reduce_trials_single_rank_is_plain_median():
    red = mg.reduce_trials({0: [3.0, 1.0, 2.0, 10.0]})
    assert red["median_us"] == 2.5 and red["rank_spread"] == 1.0


@pytest.mark.parametrize("bad", [{}, {0: [1.0], 1: [1.0, 2.0]}, {0: []}])
def test_reduce_trials_rejects_bad_input(bad):
    with pytest.raises(ValueError):
        mg.reduce_trials(bad)


def test_merge_rank_samples():
    merged = mg.merge_rank_samples([{"a": {0: [1.0]}, "b": {0: [2.0]}}, {"a": {1: [3.0]}, "b": {1: [4.0]}}])
    assert merged == {"a": {0: [1.0], 1: [3.0]}, "b": {0: [2.0], 1: [4.0]}}
    with pytest.raises(ValueError, match="twice"):
        mg.merge_rank_samples([{"a": {0: [1.0]}}, {"a": {0: [1.0]}}])


def test_quantile_geomean():
    assert mg.quantile([1, 2, 3, 4, 5], 0.5) == 3.0
    assert mg.quantile([1, 2], 0.25) == 1.25
    assert mg.geomean([1.0, 4.0]) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        mg.geomean([1.0, 0.0])
    with pytest.raises(ValueError):
        mg.geomean([])


# --------------------------------------------------------------------------- entry points: arguments, summaries


def test_fa_args_and_shape_checks():
    a = multigpu_sweep.parse_args(["--world", "loopback", "--P", "4", "--quick"])
    assert a.seqs == list(multigpu_sweep.QUICK_SEQS) and a.trials == 7
    a = multigpu_sweep.parse_args(["--world", "torch-symm", "--seqs", "4096", "--trials", "5"])
    assert a.seqs == [4096] and a.trials == 5 and a.P is None
    multigpu_sweep.check_shapes([24, 40], [8192], 8)
    with pytest.raises(mg.WorldArgsError, match="H=24"):
        multigpu_sweep.check_shapes([24, 40], [8192], 16)
    with pytest.raises(mg.WorldArgsError, match="M=1001"):
        multigpu_sweep.check_shapes([24], [1001], 2)
    with pytest.raises(SystemExit):
        multigpu_sweep.parse_args(["--P", "2"])  # --world is required


def test_fa_variants_per_world():
    keep, skipped = multigpu_sweep.active_variants(multigpu_sweep.VARIANTS, "loopback")
    assert skipped == ["a2a_nccl", "serial_nccl"] and "a2a_symm" in keep and "fused" in keep
    keep, skipped = multigpu_sweep.active_variants(multigpu_sweep.VARIANTS, "torch-symm")
    assert keep == list(multigpu_sweep.VARIANTS) and skipped == []
    keep, skipped = multigpu_sweep.active_variants(multigpu_sweep.VARIANTS, "torch-symm", have_a2a_symm=False)
    assert skipped == ["a2a_symm", "serial_symm"] and "a2a_symm_torch" in keep


def test_fa_derive():
    med = {"fa_only": 100.0, "fa_only_pers": 95.0, "serial_nccl": 150.0, "serial_symm": 140.0,
           "serial_symm_torch": 160.0, "fused": 110.0, "fused_pers": 105.0}
    d = multigpu_sweep.derive(med)
    assert d["E_res_fused_us"] == 10.0
    assert d["speedup_fused_vs_serial_nccl"] == pytest.approx(150 / 110)
    assert d["speedup_fused_pers_vs_serial_symm"] == pytest.approx(140 / 105)
    assert d["H_fused_vs_serial_nccl"] == pytest.approx(1 - 10 / 50)
    assert d["E_res_pers_vs_fa_pers_us"] == 10.0
    assert d["speedup_fused_vs_serial_symm_torch"] == pytest.approx(160 / 110)
    assert multigpu_sweep.derive({"fused": 1.0}) == {}


def _moe_row(shape, routing, T, sched, k_us, api_us):
    return {"shape": shape, "routing": routing, "tokens_per_rank": T, "schedule": sched,
            "kernel_median_us": k_us, "api_median_us": api_us}


def test_correctness_cases_and_summary():
    for P in (1, 2, 4, 8):
        for case in multigpu_checks.fa_cases(P):
            assert case[2] > 0
    assert len(multigpu_checks.fa_cases(8, quick=True)) == 2
    res = [{"kernel": "fa4", "case": "x", "variant": "fused", "rank": 0, "ok": True},
           {"kernel": "fa4", "case": "x", "variant": "fused", "rank": 1, "ok": False, "max_abs_err": 1.0},
           {"kernel": "megamoe", "case": "y", "variant": "interleaved,wgmma", "rank": 0, "ok": True}]
    s = mg.summarize_checks(res)
    assert s["fa4"]["checks"] == 2 and s["fa4"]["passed"] == 1 and s["fa4"]["failed"][0]["rank"] == 1
    assert s["megamoe"]["failed"] == [] and s["all_ok"] is False
    assert mg.summarize_checks(res[2:])["all_ok"] is True
    assert mg.summarize_checks([])["all_ok"] is False  # nothing checked is not a pass


def test_correctness_partial_records(tmp_path):
    p = mg.save_partial(tmp_path, "c", 3, [{"ok": True, "case": "a"}])
    mg.save_partial(tmp_path, "c", 3, [{"ok": False, "case": "b"}])
    lines = [json.loads(x) for x in p.read_text().splitlines()]
    assert p.name == "c-rank3.jsonl" and [x["case"] for x in lines] == ["a", "b"]


def test_peer_calibration_config_for_all_peers():
    a = peer.parse_args(["--world", "torch-symm", "--quick"])
    one = peer.make_config(a, 132, 1)
    allp = peer.make_config(a, 132, 7)
    assert one.zero_gap_K == (33, 132) and one.sweep_K == 132
    assert all(k % 7 == 0 and k <= 132 for k in allp.zero_gap_K + allp.isolated_K + (allp.sweep_K,))
    assert allp.sweep_K == 126 and allp.isolated_B == one.isolated_B
    full = peer.make_config(peer.parse_args(["--world", "loopback", "--P", "2", "--no-mma"]),
                                        132, 1)
    assert full.mma_B is None and full.region_bytes == 1024 * 2**20


def test_peer_k_list():
    assert peer.peer_k_list((16, 33, 66, 132), 7, 132) == (14, 28, 63, 126)
    assert peer.peer_k_list((16, 33, 66, 132), 1, 132) == (16, 33, 66, 132)
    assert peer.peer_k_list((4, 200), 3, 132) == (3, 132)
    with pytest.raises(ValueError):
        peer.peer_k_list((16,), 0, 132)


# --------------------------------------------------------------------------- peer calibration pipeline (simulated)


def test_peer_fit_headline_and_named_profile(tmp_path):
    """The peer target through calibration.report (fit, validation, figures, report) with the
    simulated device of tests/test_calibration_runner.py, then the headline and the profile name."""
    from test_calibration_runner import Q_TRUE, R_TRUE, SimulatedCalibrator

    from calibration import runner
    from calibration.runner import RunConfig
    from xstage import profiles

    KiB = 1024
    cfg = RunConfig(zero_gap_K=(33, 132), zero_gap_B=(16 * KiB, 64 * KiB), isolated_K=(132,),
                    isolated_B=(2 * KiB, 4 * KiB, 8 * KiB, 32 * KiB, 64 * KiB, 128 * KiB),
                    sweep_B=(8 * KiB, 64 * KiB), max_bursts=300, mma_B=None)
    mode_dir = tmp_path / "one-peer"
    mode_dir.mkdir()
    points, bursts, hints = [], [], None
    for target in ("peer", "local"):
        cal = SimulatedCalibrator(target, cfg, gap_hints=hints)
        cal.run_all()
        points += cal.points
        bursts += cal.bursts
        hints = hints or {tuple(int(x) for x in k.split(",")): v for k, v in cal.gaps_used.items()}
    runner.write_points(mode_dir / "points.csv", points)
    runner.write_bursts(mode_dir / "bursts.csv.gz", bursts)
    (mode_dir / "meta.json").write_text(json.dumps({"provenance": {"gpu": "simulated"}, "targets": {}}))
    h = peer.fit_mode(mode_dir, "torch-symm")
    assert h["target"] == "peer" and h["K"] == 132
    assert h["R_GBps"] == pytest.approx(R_TRUE / 1e9, rel=0.05)
    assert h["R_vs_paper"] == pytest.approx(R_TRUE / 1e9 / 717.0, rel=0.05)
    assert h["Q_MiB"] == pytest.approx(Q_TRUE / 2**20, rel=0.05)
    assert h["validation"]["spin"]["T_iss_median_abs_rel"] < 0.05
    assert (mode_dir / "report.md").exists() and (mode_dir / "fit.json").exists()
    dst = peer.write_named_profile(tmp_path, mode_dir, "torch-symm", 8)
    assert dst.name == "profile-h200-nvlink-peer.json"
    plat = profiles.load(dst)
    assert plat.name == "h200-nvlink-peer" and plat.R == pytest.approx(R_TRUE, rel=0.05)
    assert peer.write_named_profile(tmp_path, tmp_path / "missing", "torch-symm", 8) is None


def test_headline_reports_fit_errors():
    assert peer.headline({"targets": {"peer": {"error": "no zero-gap points"}}}, "torch-symm") == {
        "target": "peer", "error": "no zero-gap points"}


# --------------------------------------------------------------------------- reports on synthetic data


def _hdr(step, P=8):
    return {"format": mg.RESULT_FORMAT, "step": step, "gpu_count": P, "topology": "GPU0 X NV18\nGPU1 NV18 X",
            "multicast_env": dict(mg.MULTICAST_ENV), "paper": mg.PAPER,
            "world": {"backend": "torch-symm", "world_size": P, "processes": P}}


def _write(d: Path, rel: str, payload: dict):
    p = d / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload))


def test_reports_on_synthetic_results(tmp_path):
    d = tmp_path / "h200x8"
    _write(d, "topology/env.json", {**_hdr("topology"), "all_ok": True, "ranks": [
        {"rank": 0, "name": "NVIDIA H200", "sms": 132, "peer_access": {"1": True}, "checks": {"hopper": True}},
        {"rank": 1, "name": "NVIDIA H200", "sms": 132, "peer_access": {"0": True}, "checks": {"hopper": False}}]})
    _write(d, "calibration/summary.json", {**_hdr("calibration"), "profile": "x/profile-h200-nvlink-peer.json",
                                           "modes": {
        "one-peer": {"R_GBps": 321.5, "R_vs_paper": 321.5 / 717, "K": 132, "Q_MiB": 12.5, "Q_is_lower_bound": True,
                     "t_iss0_a_us": 0.05, "t_iss0_slope_us_per_MiB": 0.01,
                     "validation": {"spin": {"T_iss_median_abs_rel": 0.012, "T_iss_max_abs_rel": 0.1,
                                             "T_period_median_abs_rel": 0.003}}},
        "all-peers": {"skipped": "needs >= 3 ranks"}}})
    red = {"rank_spread": 1.01}
    _write(d, "fa4_a2a/sweep.json", {**_hdr("fa4_a2a"), "variants": ["fa_only", "serial_nccl", "fused"], "rows": [
        {"H": 24, "H_local": 3, "M": M, "P": 8, "world": "torch-symm", "median_us": {"fa_only": 100.0 * i, "serial_nccl": 160.0 * i,
                                                            "fused": 110.0 * i},
         "timings": {"fused": red}, "E_res_fused_us": 10.0 * i, "speedup_fused_vs_serial_nccl": 160 / 110 + 0.01 * i,
         "model": {"platform": "h200-nvlink-peer", "E_drain_us": 3.0 * i, "E_cc_us": 1.0, "M_star_ub": 900.0}}
        for i, M in ((1, 8192), (2, 16384))]})
    configs = [dict(shape="deepseek-v4-flash", routing=routing, tokens_per_rank=8192, expert_wave_us=ew,
                    interleaved_us=il, speedup=ew / il, speedup_api=api) for routing, ew, il, api in (
        ("balanced", 120.0, 100.0, 200.0 / 180.0), ("skewed", 95.0, 100.0, 1.0))]
    _write(d, "megamoe/ep.json", {**_hdr("megamoe"), "summary": {  # as megamoe_ep.summarize writes it
        "configs": configs, "geomean_speedup": math.sqrt(1.2 * 0.95), "max_speedup": 1.2, "min_speedup": 0.95,
        "regressions": configs[1:]}})
    _write(d, "correctness/correctness-fa4.json", {**_hdr("correctness"), "summary": mg.summarize_checks(
        [{"kernel": "fa4", "case": "c", "variant": "fused", "rank": r, "ok": True} for r in range(8)])})
    _write(d, "correctness/correctness-megamoe.json", {**_hdr("correctness"), "summary": mg.summarize_checks(
        [{"kernel": "megamoe", "case": "c", "variant": "v", "rank": 3, "ok": False, "max_abs_err": 0.5}])})
    written = multigpu_report.write_reports(d, figures={"fa4_a2a": multigpu_sweep.eres_figure})
    names = sorted(p.name for p in written)
    assert names == ["report-calibration.md", "report-correctness.md", "report-fa4_a2a.md", "report-megamoe.md",
                     "report-topology.md", "report.md"]
    cal = (d / "report-calibration.md").read_text()
    assert "321.5" in cal and "717" in cal and "0.45" in cal and "lower bound" in cal and "needs >= 3 ranks" in cal
    fa = (d / "report-fa4_a2a.md").read_text()
    assert "1.475x (H=24, M=16384)" in fa and "up to 1.43x" in fa and "| fused | 110.0 | 220.0 |" in fa
    assert "model E_drain_us" in fa
    moe = (d / "report-megamoe.md").read_text()
    assert f"{math.sqrt(1.2 * 0.95):.3f}x" in moe and "1.18x" in moe and "Regressions (speedup < 1): 1" in moe
    corr = (d / "report-correctness.md").read_text()
    assert "| fa4 | 8 | 8 | 0 |" in corr and "| megamoe | 1 | 0 | 1 |" in corr and "**False**" in corr
    topo = (d / "report-topology.md").read_text()
    assert "NV18" in topo and "GPUs on the host: 8" in topo and "hopper" in topo
    if importlib.util.find_spec("matplotlib") is not None:
        assert (d / "fa4_a2a" / "eres_vs_m.png").stat().st_size > 0 and "eres_vs_m.png" in fa
    combined = (d / "report.md").read_text()
    assert all(s in combined for s in ("Step 0", "Step 1", "Step 2", "Step 3", "Step 4"))
    # the command line draws the same figure (fa4_a2a's, passed by scripts/multigpu/report.py)
    (d / "fa4_a2a" / "eres_vs_m.png").unlink(missing_ok=True)
    r = subprocess.run([sys.executable, str(MG / "report.py"), "--dir", str(d), "--steps", "fa4_a2a"],
                       capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
    assert r.returncode == 0 and "report-fa4_a2a.md" in r.stdout, r.stderr[-2000:]
    assert (d / "fa4_a2a" / "eres_vs_m.png").exists() == (importlib.util.find_spec("matplotlib") is not None)


def test_report_marks_missing_steps(tmp_path):
    multigpu_report.write_reports(tmp_path)
    txt = (tmp_path / "report.md").read_text()
    assert txt.count("not run") == len(multigpu_report.STEP_FILES)
    assert multigpu_report.main(["--dir", str(tmp_path / "absent")]) == 2


# --------------------------------------------------------------------------- the suite script


def _suite(*args, env_extra=None):
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    env = {k: v for k, v in os.environ.items() if k not in ("STEP_TIMEOUT",)}
    env.update(env_extra or {})
    return subprocess.run(["bash", str(SUITE), *args], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)


def test_suite_dry_run_prints_every_step():
    r = _suite("--dry-run", "--gpus", "4")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1" in out
    cmds = [line for line in out.splitlines() if line.startswith("+ ")]
    launched = [c for c in cmds if "torch.distributed.run" in c]
    assert len(launched) == 6  # envcheck, calibration, fa sweep, megamoe, correctness x2
    for c in launched:
        assert "--standalone --nproc-per-node=4" in c and "--world torch-symm --P 4" in c
        assert "results/h200x4/" in c
    for entry in ("-m lab.multigpu_envcheck", "-m lab.calibration.peer", "-m lab.fa4_a2a.multigpu_sweep",
                  "-m lab.megamoe.multigpu_ep", "scripts/multigpu/correctness.py"):
        assert any(f"--nproc-per-node=4 {entry} --world" in c for c in launched), entry
    assert any("nvidia-smi topo -m > results/h200x4/topology/topo.txt" in c for c in cmds)
    assert cmds[-1].endswith("scripts/multigpu/report.py --dir results/h200x4")
    assert not (ROOT / "results" / "h200x4").exists()  # a dry run writes nothing


def test_suite_dry_run_steps_and_loopback():
    r = _suite("--dry-run", "--loopback", "--P", "2", "--steps", "2,3")
    assert r.returncode == 0, r.stderr
    cmds = [line for line in r.stdout.splitlines() if line.startswith("+ ")]
    assert not any("torch.distributed.run" in c for c in cmds)
    entries = [c for c in cmds if "--world" in c]
    assert len(entries) == 2 and all("--world loopback --P 2 --quick" in c for c in entries)
    assert " -m lab.fa4_a2a.multigpu_sweep --world" in entries[0]
    assert " -m lab.megamoe.multigpu_ep --world" in entries[1]
    assert all("results/h200x1-loopback-P2/" in c for c in entries)
    r = _suite("--dry-run", "--loopback", "--full", "--steps", "4", "--out", "/tmp/xx")
    entries = [c for c in r.stdout.splitlines() if c.startswith("+ ") and "--world" in c]
    assert len(entries) == 2 and not any("--quick" in c for c in entries)
    assert all("--out /tmp/xx/correctness" in c for c in entries)


@pytest.mark.parametrize("args,msg", [
    (("--steps", "1,7"), "bad step '7'"),
    (("--bogus",), "unknown argument"),
    (("--loopback", "--P", "x"), "--P must be a positive integer"),
    (("--gpus", "1", "--steps", "0"), "needs >= 2 GPUs (found 1)"),
])
def test_suite_rejects_bad_arguments(args, msg):
    r = _suite(*args)
    assert r.returncode == 2 and msg in r.stderr


def test_entry_points_refuse_torch_symm_outside_torchrun():
    env = {k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    for cmd in ([str(MG / "megamoe_ep.py")], ["-m", "lab.megamoe.multigpu_ep"],
                ["-m", "lab.multigpu_envcheck"]):
        r = subprocess.run([sys.executable, *cmd, "--world", "torch-symm"], capture_output=True, text=True,
                           timeout=120, env=env, cwd=ROOT)
        assert r.returncode == 2 and "must run under torchrun" in r.stderr, cmd


def test_entry_points_help():
    for entry in ("envcheck.py", "peer_calibration.py", "fa_a2a_sweep.py", "megamoe_ep.py", "correctness.py",
                  "report.py"):
        r = subprocess.run([sys.executable, str(MG / entry), "--help"], capture_output=True, text=True, timeout=120,
                           env=ENV, cwd=ROOT)
        assert r.returncode == 0 and "usage" in r.stdout, (entry, r.stderr[-2000:])


# --------------------------------------------------------------------------- host-side coordination across processes


class _FakeWorld:
    backend = "torch-symm"

    def __init__(self, rank, P):
        self.world_size, self.local_ranks, self.device = P, [rank], "cpu"


def _coordination_worker(rank, P, store_path, out_dir):
    import torch.distributed as dist

    from lab import multigpu

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=P)
    try:
        ctx = multigpu.Ctx(None, _FakeWorld(rank, P), rank=rank, nprocs=P, gloo=None, dist=dist)
        samples = {"v": {rank: [float(rank + 1) * (t + 1) for t in range(3)]}}
        red = multigpu.reduce_gathered(ctx, samples)
        ctx.host_barrier()
        agreed = ctx.agree_max(10.0 * rank)
        root_says = ctx.from_root(f"root-{rank}")
        ok = ctx.all_ok(rank != 1)
        with open(os.path.join(out_dir, f"r{rank}.json"), "w") as f:
            json.dump({"red": red, "agreed": agreed, "root": root_says, "all_ok": ok}, f)
    finally:
        dist.destroy_process_group()


def test_gather_and_reductions_across_processes(tmp_path):
    """Ctx's gather / agree / broadcast over a real (gloo, CPU) process group of 2 ranks."""
    import torch.multiprocessing as tmp_mp

    tmp_mp.spawn(_coordination_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    r0 = json.loads((tmp_path / "r0.json").read_text())
    r1 = json.loads((tmp_path / "r1.json").read_text())
    assert r1["red"] is None  # only rank 0 reduces
    v = r0["red"]["v"]
    assert v["trial_max_us"] == [2.0, 4.0, 6.0] and v["median_us"] == 4.0 and v["ranks"] == 2
    assert v["rank_median_us"] == {"0": 2.0, "1": 4.0}
    assert r0["agreed"] == r1["agreed"] == 10.0
    assert r0["root"] == r1["root"] == "root-0"
    assert r0["all_ok"] is False and r1["all_ok"] is False


def test_median_of_trial_max_dominates_every_rank_median():
    import random

    rnd = random.Random(3)
    for _ in range(200):
        P, n = rnd.randint(1, 8), rnd.randint(1, 9)
        per_rank = {r: [rnd.uniform(0.1, 10.0) for _ in range(n)] for r in range(P)}
        red = mg.reduce_trials(per_rank)
        assert red["median_us"] >= max(red["rank_median_us"].values()) - 1e-12
        assert red["median_us"] <= max(max(v) for v in per_rank.values())


def test_suite_failure_path_records_logs_reports_and_tar(tmp_path):
    """Non-dry run on a machine without GPUs: the step fails cleanly (clear error from every rank),
    the suite goes on to the reports, packs the directory and exits 1."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("would start a real run on this GPU host")
    out, tar = tmp_path / "h200x2", tmp_path / "r.tgz"
    r = _suite("--gpus", "2", "--steps", "0", "--out", str(out), "--tar", str(tar))
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "FAILED: step0-envcheck" in r.stderr
    log = (out / "logs" / "step0-envcheck.log").read_text()
    assert "needs >= 2 GPUs on this host, found 0" in log
    assert (out / "report.md").exists() and tar.stat().st_size > 0
    assert "not run" in (out / "report.md").read_text()


def test_suite_dry_run_tar():
    r = _suite("--dry-run", "--gpus", "2", "--steps", "0", "--tar", "/tmp/x.tgz")
    assert r.returncode == 0 and r.stdout.rstrip().endswith("+ tar czf /tmp/x.tgz -C results h200x2")


# --------------------------------------------------------------------------- entry points end to end with a CPU stand-in
# The loopback world on the CPU (addressing only) and timing replaced by synthetic samples: every
# line of run()/main() outside the kernels executes (row building, reductions, model, files).


class _Props:
    multi_processor_count = 132
    name = "cpu-stand-in"


def use_cpu_loopback(monkeypatch):
    """lab.multigpu.setup makes a CPU loopback world (addressing only, no alignment) and the
    device queries answer for an H200 (also used by tests/test_megamoe_multigpu.py)."""
    import torch

    from xstage.world import make_world

    def setup(args, **kw):
        mg.check_world_request(args.world, args.P, {}, 1)
        ctx = mg.Ctx(args, make_world("loopback", args.P, device="cpu"), rank=0, nprocs=1)
        ctx.align = lambda: None
        return ctx

    monkeypatch.setattr(mg, "setup", setup)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: _Props())
    monkeypatch.setattr(mg, "topology_text", lambda: "GPU0 X (stand-in)")


@pytest.fixture
def cpu_loopback(monkeypatch):
    use_cpu_loopback(monkeypatch)


def test_fa_sweep_main_on_cpu_stand_in(cpu_loopback, monkeypatch, tmp_path):
    base = {"fa_only": 100.0, "fa_only_pers": 98.0, "a2a_symm": 30.0, "a2a_symm_torch": 40.0,
            "serial_symm": 131.0, "serial_symm_torch": 141.0, "fused": 104.0, "fused_pers": 103.0}
    calls = []

    def fake_time_variants(ctx, fns, *, trials, eager=(), **kw):
        calls.append((sorted(fns), trials, tuple(eager)))
        assert all(set(by_rank) == set(ctx.local_ranks) for by_rank in fns.values())
        # rank r is (1 + r/100) slower: the max over ranks is the last rank's time
        return ({n: {r: [base[n] * (1 + r / 100) * (1 + t / 1000) for t in range(trials)] for r in ctx.local_ranks}
                 for n in fns}, {n: 3 for n in fns})

    monkeypatch.setattr(mg, "time_variants", fake_time_variants)
    out = tmp_path / "fa"
    rc = multigpu_sweep.main(["--world", "loopback", "--P", "4", "--heads", "8", "--seqs", "1024", "2048",
                            "--trials", "5", "--out", str(out), "--profile", "paper-b200-nvlink"])
    assert rc == 0
    d = json.loads((out / "sweep.json").read_text())
    assert d["format"] == mg.RESULT_FORMAT and d["world"] == {"backend": "loopback", "world_size": 4, "processes": 1}
    assert d["skipped_variants"] == ["a2a_nccl", "serial_nccl"] and "provenance" in d
    assert [c[1] for c in calls] == [5, 5] and all(c[2] == multigpu_sweep.NCCL_VARIANTS for c in calls)
    row = d["rows"][0]
    assert row["H_local"] == 2 and row["timings"]["fused"]["ranks"] == 4
    assert row["median_us"]["fused"] == pytest.approx(104.0 * 1.03 * 1.002)
    assert row["speedup_fused_vs_serial_symm"] == pytest.approx(131 / 104)
    assert row["model"]["platform"] == "paper-b200-nvlink" and "E_drain_us" in row["model"]
    csv_text = (out / "sweep.csv").read_text()
    assert csv_text.count("\n") == 3 and "speedup_fused_vs_serial_symm" in csv_text.splitlines()[0]
    rep = multigpu_report.report_fa(d)
    assert "| fused | 107.3 | 107.3 |" in rep and "up to 1.43x" in rep


def test_fa_sweep_bad_shapes_fail_before_launch(cpu_loopback, tmp_path):
    assert multigpu_sweep.main(["--world", "loopback", "--P", "3", "--heads", "8", "--out", str(tmp_path)]) == 2


def test_correctness_frame_on_cpu_stand_in(cpu_loopback, monkeypatch, tmp_path):
    """The correctness step (lab.multigpu.run_checks) with the fa4 checks and the kernels
    replaced by one that raises: every fa4 case is recorded as failed and the step goes on, the
    per-rank records are written as they come, the exit status is 1."""
    import argparse

    import fa4_a2a

    def broken(*a, **k):
        raise RuntimeError("kernel stand-in: not on a GPU")

    monkeypatch.setattr(fa4_a2a, "attention_a2a", broken)
    monkeypatch.setattr(fa4_a2a, "ulysses_attention", broken)
    out = tmp_path / "c"
    args = argparse.Namespace(world="loopback", P=2, out=str(out), stem="correctness-fa4", quick=True, trials=1)
    checks = {"fa4": lambda ctx: multigpu_checks.run_checks(ctx, args.quick)}
    assert mg.run_entry(args, lambda ctx: mg.run_checks(ctx, args, checks)) == 1
    d = json.loads((out / "correctness-fa4.json").read_text())
    s = d["summary"]
    assert d["step"] == "correctness" and s["all_ok"] is False and s["fa4"]["passed"] == 0
    assert s["fa4"]["checks"] >= 2 * 4  # 2 quick cases x (3 kernel variants + ulysses_attention)
    assert all("not on a GPU" in (f["error"] or "") for f in s["fa4"]["failed"] if f["case"] != "fa4_a2a.selfcheck")
    lines = (out / "ranks" / "correctness-fa4-rank0.jsonl").read_text().splitlines()
    assert len(lines) == len(d["results"]) and (out / "correctness-fa4.csv").exists()
    assert f"| fa4 | {s['fa4']['checks']} | 0 |" in multigpu_report.report_correctness(d)


def test_topology_block_strips_ansi_escapes():
    """nvidia-smi topo -m underlines its header with ANSI escapes (seen on the 2 x H200 host);
    the report's code block carries the table without them."""
    raw = "\x1b[4mGPU0\tGPU1\tCPU Affinity\x1b[0m\nGPU0\t X \tNV18\n"
    block = multigpu_report.report_topology({"topology": raw})
    assert "\x1b" not in block and "GPU0\tGPU1\tCPU Affinity" in block and "NV18" in block
