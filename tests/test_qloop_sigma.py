"""The FlashAttention Q-loop slope sigma of the measured H200 profiles (paper Section 4.3): derived
from the shipped FA-only bench data by calibration.qloop, and a lower bound of every measurement."""
import json
import math
import shutil
from pathlib import Path

import pytest

from calibration import qloop
from calibration.__main__ import main as calibration_main
from calibration.report import _keep_unfitted
from xstage import profiles

ROOT = Path(__file__).resolve().parents[1]
STABILIZED = ROOT / "results/h200/fa4_a2a/bench_loopback_stabilized.json"
FA_ONLY_BENCHES = [STABILIZED, ROOT / "results/h200/fa4_a2a/bench_loopback.json",
                   ROOT / "results/h200/fa4_a2a/bench_host_h200-pcie-host.json",
                   ROOT / "results/h200x2/fa4_a2a/sweep_h200-nvlink-peer.json"]
MEASURED = ("h200-pcie-host", "h200-nvlink-peer")


def test_shipped_sigma_is_the_fit_of_the_clock_stabilised_bench():
    fit = qloop.fit_bench_file(STABILIZED)
    assert fit.clock_mhz == 1980 and fit.n == 10 and (fit.head_dim, fit.dtype) == (128, "bf16")
    assert fit.sigma_s == pytest.approx(1.422e-6, rel=1e-3) and fit.sigma_err_s < 0.01 * fit.sigma_s
    assert fit.fixed_s > 0  # the paper's "positive fixed component"
    assert fit.max_abs_rel_residual < 0.02  # a straight line in the KV tiles
    for name in MEASURED:
        p = profiles.load(name)
        assert p.sigma == pytest.approx(fit.sigma_s, rel=1e-12)
        raw = json.loads((ROOT / "xstage/profiles" / f"{name}.json").read_text())
        assert "python -m calibration sigma --bench results/h200/fa4_a2a/bench_loopback_stabilized.json" \
            in raw["notes"]["sigma"]
        assert raw["uncertainty"]["sigma_err_us"] == pytest.approx(fit.sigma_err_s * 1e6, rel=1e-12)


@pytest.mark.parametrize("bench", FA_ONLY_BENCHES, ids=lambda p: p.name)
def test_sigma_bounds_every_measured_fa_only_wave_from_below(bench):
    """G_Qloop(M) >= sigma * M / b_n on both hosts, clock-matched or not, loopback and host world."""
    sigma = profiles.load("h200-pcie-host").sigma
    payload = json.loads(bench.read_text())
    for r in payload["rows"]:
        tiles = r["H_local"] * math.ceil(r["M"] / 128)
        waves = math.ceil(tiles / min(payload["num_sms"], tiles))
        assert r["median_us"]["fa_only"] * 1e-6 / waves >= sigma * r["M"] / 128, (r["H"], r["M"])


def test_unmatched_clocks_are_reported():
    fit = qloop.fit_bench_file(ROOT / "results/h200x2/fa4_a2a/sweep_h200-nvlink-peer.json")
    assert fit.clock_mhz is None and fit.fixed_s < 0  # the power cap at large M steepens the slope


def _rows(sigma_us, fixed_us, ms=(8192, 16384, 32768), h_local=3):
    out = []
    for m in ms:
        waves = math.ceil(h_local * m / 128 / 132)
        out.append({"M": m, "H_local": h_local, "head_dim": 128, "dtype": "bf16",
                    "median_us": {"fa_only": waves * (fixed_us + sigma_us * m / 128)}})
    return out


def test_fit_recovers_slope_and_fixed_component():
    fit = qloop.fit_qloop_slope(_rows(0.79, 5.0), 132)
    assert fit.sigma_s == pytest.approx(0.79e-6) and fit.fixed_s == pytest.approx(5e-6)


@pytest.mark.parametrize("rows,msg", [
    (_rows(1, 1)[:2], "needs >= 3"),
    (_rows(1, 1) + [dict(_rows(1, 1)[0], head_dim=64)], "several"),
    (_rows(1, 1, ms=(8192, 8192, 8192)), "two M or more"),
    (_rows(-0.1, 100), "does not grow"),
])
def test_fit_rejects_unusable_data(rows, msg):
    with pytest.raises(ValueError, match=msg):
        qloop.fit_qloop_slope(rows, 132)


def test_sigma_command_writes_the_profile(tmp_path, capsys):
    prof = tmp_path / "p.json"
    shutil.copy(ROOT / "xstage/profiles/h200-pcie-host.json", prof)
    d = json.loads(prof.read_text())
    del d["sigma_us_per_kv_tile"]
    prof.write_text(json.dumps(d))
    assert calibration_main(["sigma", "--bench", str(STABILIZED), "--profile", str(prof), "--note", "N."]) == 0
    assert "sigma = 1.4219 +- 0.0019 us per KV tile" in capsys.readouterr().out
    out = json.loads(prof.read_text())
    keys = list(out)
    assert keys.index("sigma_us_per_kv_tile") == keys.index("Q_bytes") + 1
    assert out["notes"]["sigma"].endswith(" N.")
    assert profiles.load(prof).sigma == pytest.approx(profiles.load("h200-pcie-host").sigma, rel=1e-12)


def test_a_refit_keeps_what_the_calibration_does_not_fit(tmp_path):
    old = tmp_path / "old.json"
    shutil.copy(ROOT / "xstage/profiles/h200-pcie-host.json", old)
    new = {"name": "h200-pcie-host", "notes": {"R": "refit"}, "uncertainty": {}}
    kept = _keep_unfitted(new, old)
    shipped = json.loads(old.read_text())
    for key in ("sigma_us_per_kv_tile", "dense_tflops"):
        assert kept[key] == shipped[key]
    assert kept["notes"]["sigma"] == shipped["notes"]["sigma"] and kept["notes"]["R"] == "refit"
    assert kept["uncertainty"]["sigma_err_us"] == shipped["uncertainty"]["sigma_err_us"]
    assert _keep_unfitted({"name": "x"}, tmp_path / "missing.json") == {"name": "x"}
