"""Profile loading/validation and the ``xstage`` CLI."""
import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from xstage import cli, profiles
from xstage.cli import main
from xstage.planner import plan_fa_a2a, plan_megamoe


def test_shipped_paper_profile():
    assert "paper-b200-nvlink" in profiles.available()
    p = profiles.load("paper-b200-nvlink")
    assert p.source == "paper" and p.num_sms == 148
    assert p.R == pytest.approx(717e9)
    assert p.t_iss0_at(148, 4.6 * 2**20) == pytest.approx(0.76e-6)
    assert p.q_at(148) / 2**20 == pytest.approx(4.25)
    assert "NOT measured" in p.description


def test_roundtrip(tmp_path):
    p = profiles.load("paper-b200-nvlink")
    f = tmp_path / "p.json"
    f.write_text(json.dumps(profiles.to_dict(p)))
    q = profiles.load(f)
    assert (q.R, q.Q, q.num_sms) == (p.R, p.Q, p.num_sms)
    assert q.t_iss0 == pytest.approx(p.t_iss0, rel=1e-12) and q.sigma == pytest.approx(p.sigma, rel=1e-12)


def test_table_profile(tmp_path):
    d = {"name": "t", "source": "measured", "num_sms": 132, "R_bytes_per_s": 1e10,
         "t_iss0_us": {"K": [66, 132], "V_bytes": [1e5, 1e6], "us": [[1, 2], [3, 4]]},
         "Q_bytes": {"132": 2e6, "66": 1e6}}
    f = tmp_path / "t.json"
    f.write_text(json.dumps(d))
    p = profiles.load(str(f))
    assert p.t_iss0_at(132, 1e6) == pytest.approx(4e-6)
    assert p.q_at(99) == pytest.approx(1.5e6)


BAD = [
    ("{not json", "malformed JSON"),
    ("[1, 2]", "JSON object"),
    ('{"name": "x"}', "missing required key"),
    ('{"name":"x","source":"guess","num_sms":1,"R_bytes_per_s":1,"t_iss0_us":1,"Q_bytes":1}', "'source'"),
    ('{"name":"x","source":"paper","num_sms":1,"R_bytes_per_s":-5,"t_iss0_us":1,"Q_bytes":1}', "R_bytes_per_s"),
    ('{"name":"x","source":"paper","num_sms":0,"R_bytes_per_s":1,"t_iss0_us":1,"Q_bytes":1}', "num_sms"),
    ('{"name":"x","source":"paper","num_sms":1,"R_bytes_per_s":1,"t_iss0_us":"fast","Q_bytes":1}', "t_iss0_us"),
    ('{"name":"x","source":"paper","num_sms":1,"R_bytes_per_s":1,"t_iss0_us":1,"Q_bytes":{"abc":1}}', "Q_bytes"),
    ('{"name":"x","source":"paper","num_sms":1,"R_bytes_per_s":1,"t_iss0_us":{"K":[1]},"Q_bytes":1}', "t_iss0_us"),
    ('{"schema":"v9","name":"x"}', "unsupported schema"),
]


@pytest.mark.parametrize("text,msg", BAD)
def test_malformed_profiles_raise_clear_errors(tmp_path, text, msg):
    f = tmp_path / "bad.json"
    f.write_text(text)
    with pytest.raises(profiles.ProfileError, match=msg):
        profiles.load(f)


def test_unknown_platform_name():
    with pytest.raises(profiles.ProfileError, match="unknown platform 'no-such'"):
        profiles.load("no-such")
    with pytest.raises(profiles.ProfileError, match="not found"):
        profiles.load("/nonexistent/p.json")


def test_planner_rejects_bad_shapes():
    p = profiles.load("paper-b200-nvlink")
    with pytest.raises(ValueError, match="not divisible"):
        plan_fa_a2a(p, seq_len=8192, heads=6, head_dim=128, world=4)
    with pytest.raises(ValueError, match="positive integer"):
        plan_fa_a2a(p, seq_len=-8192, heads=8, head_dim=128, world=8)
    with pytest.raises(ValueError, match="divisible"):
        plan_megamoe(p, hidden=4096, intermediate=2048, experts=250, topk=6, tokens=8192, world=8)


def _cli(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_plan_fa_a2a_paper_example(capsys):
    """Section 4.3's worst aligned case, K = 148: a shape with at least 148 output tiles per rank
    (24 heads over P = 8: 3 x 64 = 192 tiles at 8K)."""
    rc, out, _ = _cli(capsys, "plan", "fa-a2a", "--platform", "paper-b200-nvlink", "--seq", "8192",
                      "--heads", "24", "--head-dim", "128", "--world", "8", "--json")
    assert rc == 0
    d = json.loads(out)
    assert d["producers"] == 148 and d["tiles_per_rank"] == 192 and d["burst_waves"] == 2
    assert 5.8e-6 <= d["recovery_gap_s"] <= 6.2e-6
    assert d["verdict"] == "piggyback" and d["rate_bound"] == "holds"
    assert 900 < d["m_star_ub"] < 1100
    rc, text, _ = _cli(capsys, "plan", "fa-a2a", "--platform", "paper-b200-nvlink", "--seq", "8192",
                       "--heads", "24", "--head-dim", "128", "--world", "8")
    assert rc == 0 and "G* (eq. 5)" in text and "6.004 us" in text and "piggyback" in text


def test_cli_plan_fa_a2a_short_sequence_reshapes(capsys):
    """M = 512 with 160 output tiles per rank (batch 40): two burst waves, and a 4-KV-tile Q-loop
    (3.2 us) cannot drain a 148-tile burst (G* = 6 us): the rate bound fails."""
    rc, out, _ = _cli(capsys, "plan", "fa-a2a", "--platform", "paper-b200-nvlink", "--seq", "512",
                      "--heads", "8", "--head-dim", "128", "--world", "8", "--batch", "40", "--json")
    d = json.loads(out)
    assert rc == 0 and d["verdict"] == "reshape" and d["rate_ok"] is False
    assert (d["tiles_per_rank"], d["producers"], d["burst_waves"]) == (160, 148, 2)


def test_cli_plan_megamoe(capsys):
    rc, out, _ = _cli(capsys, "plan", "megamoe", "--platform", "paper-b200-nvlink", "--hidden", "4096",
                      "--intermediate", "2048", "--experts", "256", "--topk", "6", "--tokens", "8192",
                      "--world", "8", "--json")
    assert rc == 0
    d = json.loads(out)
    assert d["n1"] == 32 and d["n2"] == 32
    assert d["d_knee_rows"] == pytest.approx(128 * 148 / 4096)
    assert d["interleaved_overhead_s"] <= d["wave_overhead_s"]
    # the whole kernel of one rank: 8192 tokens x top-6 rows, 32 experts of 1536 rows = 12 m-blocks each
    assert d["combine_bytes"] == 8192 * 6 * 4096 * 2
    m_blocks = 32 * 12
    assert d["kernel_l1_s"] == pytest.approx(m_blocks * 32 * d["t_l1_mma_s"] / 148)
    assert d["kernel_l2_s"] == pytest.approx(m_blocks * 32 * d["t_l2_mma_s"] / 148)
    compute, drain = d["kernel_l1_s"] + d["kernel_l2_s"], d["drain_s"]
    assert d["kernel_interleaved_s"] == pytest.approx(max(compute, drain))
    assert d["kernel_wave_s"] == pytest.approx(d["kernel_l1_s"] + max(d["kernel_l2_s"], drain))
    rc, text, _ = _cli(capsys, "plan", "megamoe", "--platform", "h200-pcie-host", "--hidden", "4096",
                       "--intermediate", "2048", "--experts", "256", "--topk", "6", "--tokens", "4096",
                       "--world", "8", "--block-n", "256")
    assert rc == 0 and "kernel: expert-wave / interleaved" in text and "eq. 11 over the kernel" in text


def test_cli_profiles(capsys):
    rc, out, _ = _cli(capsys, "profiles")
    assert rc == 0 and "paper-b200-nvlink" in out


@pytest.mark.parametrize("argv,msg", [
    (["plan", "fa-a2a", "--platform", "nope", "--seq", "8192", "--heads", "8", "--head-dim", "128",
      "--world", "8"], "unknown platform"),
    (["plan", "fa-a2a", "--platform", "paper-b200-nvlink", "--seq", "-1", "--heads", "8", "--head-dim",
      "128", "--world", "8"], "positive integer"),
    (["plan", "fa-a2a", "--platform", "paper-b200-nvlink", "--seq", "abc"], "invalid int"),
    (["plan", "megamoe", "--platform", "paper-b200-nvlink"], "required"),
    (["bogus"], "invalid choice"),
])
def test_cli_errors_one_line_exit_2(capsys, argv, msg):
    rc, out, err = _cli(capsys, *argv)
    assert rc == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("xstage: error:") and msg in lines[0]


def test_console_entry_runs_as_module():
    r = subprocess.run([sys.executable, "-m", "xstage", "profiles"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "paper-b200-nvlink" in r.stdout


# ---------------------------------------------------------------- CLI papercuts

FA = ["plan", "fa-a2a", "--platform", "paper-b200-nvlink", "--seq", "8192", "--heads", "8", "--head-dim", "128",
      "--world", "8"]
MOE = ["plan", "megamoe", "--platform", "paper-b200-nvlink", "--hidden", "4096", "--intermediate", "2048",
       "--experts", "256", "--topk", "6", "--tokens", "8192", "--world", "8"]


def _error_line(capsys, *argv):
    rc, out, err = _cli(capsys, *argv)
    lines = err.strip().splitlines()
    assert rc == 2 and out == "" and len(lines) == 1 and lines[0].startswith("xstage: error: "), (rc, out, err)
    return lines[0][len("xstage: error: "):]


@pytest.mark.parametrize("argv,rc", [(["profiles"], 141), (["profiles", "--json"], 141), (FA, 141),
                                     (MOE + ["--json"], 141),
                                     # argparse itself drops a failed write of --help / --version
                                     (["--version"], 0), (["plan", "--help"], 0)])
def test_closed_stdout_pipe_exits_quietly(argv, rc):
    """``xstage ... | head``: the reader is gone before the first write; no traceback, status 141."""
    r, w = os.pipe()
    os.close(r)  # every write to w now fails with EPIPE
    try:
        p = subprocess.run([sys.executable, "-m", "xstage", *argv], stdout=w, stderr=subprocess.PIPE, text=True,
                           timeout=120)
    finally:
        os.close(w)
    assert (p.returncode, p.stderr) == (rc, "")


def _numeric_flags(kernel):
    """(flag, type) of every int/float option of ``xstage plan KERNEL``, read from the parser itself."""
    def sub(parser, name):
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return action.choices[name]

    p = sub(sub(cli._build_parser(), "plan"), kernel)
    return [(a.option_strings[0], a.type) for a in p._actions if a.type in (int, float)]


def _numeric_cases():
    for kernel, base in (("fa-a2a", FA), ("megamoe", MOE)):
        flags = _numeric_flags(kernel)
        assert len(flags) >= 10
        for flag, typ in flags:
            for value in ("0", "-1") + (("nan", "inf") if typ is float else ()):
                yield pytest.param(base, flag, typ, value, id=f"{kernel}{flag}={value}")


@pytest.mark.parametrize("base,flag,typ,value", list(_numeric_cases()))
def test_every_numeric_flag_is_checked_and_named(capsys, base, flag, typ, value):
    msg = _error_line(capsys, *base, flag, value)
    want = ("a positive integer" if typ is int else "a finite number" if value in ("nan", "inf") else "> 0")
    assert msg == f"{flag} must be {want}, got {value}"


def test_sigma_error_is_in_the_users_unit(capsys):
    assert _error_line(capsys, *FA, "--sigma-us", "-1") == "--sigma-us must be > 0, got -1"
    assert _error_line(capsys, *FA, "--sigma-us", "-0.5") == "--sigma-us must be > 0, got -0.5"


@pytest.mark.parametrize("base,extra,msg", [
    (FA, ["--heads", "6", "--world", "4"], "--heads 6 is not divisible by --world 4"),
    (FA, ["--seq", "8190"], "--seq 8190 is not divisible by --world 8"),
    (FA, ["--producers", "149"], "--producers 149 exceeds the 148 SMs of platform 'paper-b200-nvlink'"),
    (MOE, ["--experts", "250"], "--experts 250 is not divisible by --world 8"),
    (MOE, ["--topk", "300"], "--topk 300 exceeds --experts 256"),
    (MOE, ["--intermediate", "2056"], "2 x --intermediate 2056 is not a multiple of --block-n 128"),
    (MOE, ["--hidden", "4160"], "--hidden 4160 is not a multiple of --block-n 128"),
    (MOE, ["--producers", "200"], "--producers 200 exceeds the 148 SMs"),
])
def test_cross_flag_errors_name_the_flags(capsys, base, extra, msg):
    assert _error_line(capsys, *base, *extra).startswith(msg)


@pytest.mark.parametrize("base,extra,msg", [
    (FA, ["--out-bytes", "3"], "--out-bytes must be 1, 2 or 4"),
    (FA, ["--out-bytes", "8"], "--out-bytes must be 1, 2 or 4"),
    (FA, ["--head-dim", "4"], "--head-dim 4 x --out-bytes 2 = 8-byte output rows: not a multiple of the"
                              " kernels' 16-byte stores"),
    (MOE, ["--out-bytes", "3"], "--out-bytes must be 1, 2 or 4"),
    (MOE, ["--block-n", "8", "--hidden", "4096", "--out-bytes", "1"], "--block-n 8 x --out-bytes 1 = 8-byte"),
])
def test_out_bytes_must_be_an_element_size_with_16_byte_rows(capsys, base, extra, msg):
    assert _error_line(capsys, *base, *extra).startswith(msg)


def test_out_bytes_fp8_and_fp32_are_accepted(capsys):
    for ob, vt in (("1", 128 * 128), ("4", 128 * 128 * 4)):
        rc, out, _ = _cli(capsys, *MOE, "--out-bytes", ob, "--json")
        assert rc == 0 and json.loads(out)["tile_volume_bytes"] == vt


def test_planner_rejects_unusable_out_bytes_and_times():
    p = profiles.load("paper-b200-nvlink")
    with pytest.raises(ValueError, match="out_bytes must be one of"):
        plan_fa_a2a(p, seq_len=8192, heads=8, head_dim=128, world=8, out_bytes=3)
    with pytest.raises(ValueError, match="16-byte stores"):
        plan_fa_a2a(p, seq_len=8192, heads=8, head_dim=4, world=8)
    moe = dict(hidden=4096, intermediate=2048, experts=256, topk=6, tokens=8192, world=8)
    for kw in ({"t_l1_mma": 0.0}, {"t_l2_mma": -1e-6}, {"dense_flops": 0.0}, {"t_l1_mma": float("nan")}):
        with pytest.raises(ValueError, match=f"{next(iter(kw))} must be a finite number > 0"):
            plan_megamoe(p, **moe, **kw)


def _pyproject_version():
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    return re.search(r'^version\s*=\s*"([^"]+)"', text, re.M).group(1)


def test_version_from_package_metadata(capsys, monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.9.9" if name == "xstage" else None)
    rc, out, err = _cli(capsys, "--version")
    assert (rc, out, err) == (0, "xstage 9.9.9\n", "")


def test_version_falls_back_to_pyproject(capsys, monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    rc, out, _ = _cli(capsys, "--version")
    assert rc == 0 and out == f"xstage {_pyproject_version()}\n"


def test_version_as_module():
    r = subprocess.run([sys.executable, "-m", "xstage", "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and re.fullmatch(r"xstage \d+\.\d+\S*\n", r.stdout)


def test_profile_path_errors_name_the_file(tmp_path, capsys):
    binary = tmp_path / "tool"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)))
    keys = tmp_path / "keys.json"
    keys.write_text('{"name": "x", "source": "paper"}')
    for path, what in ((tmp_path, "is a directory"), (binary, "not a JSON profile (binary data"),
                       (keys, "missing required key(s): num_sms")):
        msg = _error_line(capsys, *FA[:2], "--platform", str(path), *FA[4:])
        assert msg.startswith(f"{path}: {what}"), msg
        with pytest.raises(profiles.ProfileError, match=re.escape(f"{path}: {what}")):
            profiles.load(path)


@pytest.mark.parametrize("name", profiles.available())
def test_plan_megamoe_works_with_every_shipped_profile(capsys, name):
    rc, out, err = _cli(capsys, *MOE[:2], "--platform", name, *MOE[4:], "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert d["platform"] == name and d["mma_source"].startswith("estimated from")
    assert d["t_l1_mma_s"] > 0 and d["t_l2_mma_s"] > 0


def test_measured_h200_profiles_carry_the_measured_dense_rate():
    ceilings = json.loads((Path(__file__).resolve().parents[1] / "results/h200/ceilings.json").read_text())
    measured = [n for n in profiles.available() if profiles.load(n).source == "measured"]
    assert measured and all("H200" in profiles.load(n).gpu for n in measured)
    for n in measured:
        assert profiles.load(n).dense_flops == pytest.approx(ceilings["bf16_dense_tflops"] * 1e12, rel=1e-12)
