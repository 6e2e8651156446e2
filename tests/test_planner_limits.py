"""The planner on small and absurd shapes (issue 43): the aligned burst is capped by the tiles that
exist, one verdict per output (MegaMoE's follows schedule="auto"), sanity limits on sizes, tiles
and --platform, and clean exits when stdout cannot be written."""
import json
import math
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xstage import planner, profiles
from xstage.cli import main
from xstage.planner import plan_fa_a2a, plan_megamoe

KiB, MiB = 1024, 2**20
MEASURED = ("h200-nvlink-peer", "h200-pcie-host")


def _cli(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _fa(capsys, platform="h200-nvlink-peer", seq=8192, heads=8, world=8, *extra):
    rc, out, err = _cli(capsys, "plan", "fa-a2a", "--platform", platform, "--seq", str(seq), "--heads", str(heads),
                        "--head-dim", "128", "--world", str(world), *extra, "--json")
    assert rc == 0, err
    return json.loads(out)


def _moe_argv(platform="h200-nvlink-peer", tokens=8192, *extra):
    return ["plan", "megamoe", "--platform", platform, "--hidden", "4096", "--intermediate", "2048", "--experts", "256",
            "--topk", "6", "--tokens", str(tokens), "--world", "8", *extra]


# ------------------------------------------------------------------ the burst is the tiles that exist

def test_readme_fa_example_bursts_only_its_64_tiles(capsys):
    """README: 8K tokens, 8 heads over P = 8: 64 output tiles per rank, so 64 aligned producers and
    a 2 MiB burst in one partial wave (it printed 64 tiles next to 132 tiles' 4.125 MiB)."""
    d = _fa(capsys)
    assert (d["tiles_per_rank"], d["producers"], d["producer_limit"], d["burst_waves"]) == (64, 64, 132, 1)
    assert d["volume_bytes"] == 64 * 32 * KiB
    assert d["rate_bound"] == "not applicable (one burst wave)" and d["rate_ok"] is None
    # one burst into an empty X-Stage: eq. 7 gives its stall, the capacity bound decides
    nv = profiles.load("h200-nvlink-peer")
    t0, q = nv.t_iss0_at(64, d["volume_bytes"]), nv.q_at(64)
    assert d["capacity_bytes"] == pytest.approx(q)
    assert d["drain_stall_s"] == pytest.approx(max(0.0, (d["volume_bytes"] - q) / nv.R - t0))
    assert d["verdict"] == ("piggyback" if d["capacity_ok"] else "reshape")


def test_one_tile_is_a_one_tile_burst(capsys):
    d = _fa(capsys, "h200-nvlink-peer", 128)
    assert (d["tiles_per_rank"], d["producers"], d["burst_waves"], d["volume_bytes"]) == (1, 1, 1, 32 * KiB)
    assert d["capacity_ok"] and d["verdict"] == "piggyback" and d["drain_stall_s"] == 0.0


def test_many_tiles_keep_the_full_aligned_burst(capsys):
    d = _fa(capsys, "h200-pcie-host", 65536, 40)
    assert (d["tiles_per_rank"], d["producers"], d["burst_waves"]) == (2560, 132, 20)
    assert d["volume_bytes"] == 132 * 32 * KiB and d["rate_bound"] in ("holds", "fails")


@settings(max_examples=60, deadline=None)
@given(seq_tiles=st.integers(1, 600), local_heads=st.integers(1, 6), world=st.sampled_from([1, 2, 8]),
       batch=st.integers(1, 3), producers=st.one_of(st.none(), st.integers(1, 132)))
def test_fa_burst_is_min_of_producers_and_tiles(seq_tiles, local_heads, world, batch, producers):
    plat = profiles.load("h200-pcie-host")
    seq = seq_tiles * 128 * world
    p = plan_fa_a2a(plat, seq_len=seq, heads=local_heads * world, head_dim=128, world=world, batch=batch,
                    producers=producers)
    tiles = batch * local_heads * math.ceil(seq / 128)
    k = min(producers or plat.num_sms, tiles)
    assert (p.tiles_per_rank, p.producers, p.volume_bytes) == (tiles, k, k * 128 * 128 * 2)
    assert p.burst_waves == math.ceil(tiles / k)
    assert p.capacity_bytes == pytest.approx(plat.q_at(k))
    assert p.verdict in ("piggyback", "reshape")  # a measured profile has sigma: never "unknown"


def test_megamoe_burst_is_capped_by_the_linear2_tiles(capsys):
    """1 token per rank, top-6: 6 rows land on 6 of the 32 local experts, one 128-row block each;
    at b_n = 256 that is 6 x 16 = 96 Linear-2 tiles, fewer than the 132 SMs."""
    rc, out, err = _cli(capsys, *_moe_argv("h200-pcie-host", 1, "--block-n", "256", "--json"))
    assert rc == 0, err
    d = json.loads(out)
    assert (d["l2_tiles"], d["producers"], d["producer_limit"], d["burst_waves"]) == (96, 96, 132, 1)
    assert d["volume_bytes"] == 96 * 128 * 256 * 2
    # a phase with fewer tiles than SMs takes one tile's mainloop, not a fraction of it
    assert d["kernel_l2_s"] == pytest.approx(d["t_l2_mma_s"]) and d["kernel_l1_s"] == pytest.approx(d["t_l1_mma_s"])


def test_megamoe_balanced_blocks_unchanged_for_large_shapes(capsys):
    rc, out, _ = _cli(capsys, *_moe_argv("paper-b200-nvlink", 8192, "--json"))
    d = json.loads(out)
    assert d["l2_tiles"] == 32 * 12 * 32 and d["producers"] == 148 and d["volume_bytes"] == 148 * 32 * KiB


# ------------------------------------------------------------------ one verdict, agreeing with auto

def _verdict_matches(verdict: str, schedule: str) -> bool:
    return verdict.startswith("interleave") == (schedule == "interleaved") and \
        verdict.startswith("expert-wave") == (schedule == "expert_wave")


@pytest.mark.parametrize("platform", profiles.available())
@pytest.mark.parametrize("tokens", [1, 16, 256, 2048, 8192])
@pytest.mark.parametrize("block_n", [128, 256])
def test_megamoe_verdict_never_contradicts_auto(capsys, platform, tokens, block_n):
    rc, out, err = _cli(capsys, *_moe_argv(platform, tokens, "--block-n", str(block_n), "--json"))
    assert rc == 0, err
    d = json.loads(out)
    plan = plan_megamoe(profiles.load(platform), hidden=4096, intermediate=2048, experts=256, topk=6, tokens=tokens,
                        world=8, block_n=block_n)
    choice = planner.schedule_choice_of(plan, waves=plan.expert_waves)
    assert d["schedule"] == choice.schedule and _verdict_matches(d["verdict"], d["schedule"]), d["verdict"]
    rc, text, _ = _cli(capsys, *_moe_argv(platform, tokens, "--block-n", str(block_n)))
    verdict = next(line for line in text.splitlines() if line.startswith("verdict"))
    auto = next(line for line in text.splitlines() if line.startswith('schedule="auto" picks'))
    assert d["verdict"] in verdict and auto.split()[2] == choice.schedule


def test_megamoe_one_token_no_longer_says_interleave(capsys):
    """The issue's case: 1 token per rank said "interleave + reduce burst volume" next to an auto
    line picking expert_wave."""
    for platform in profiles.available():
        rc, out, _ = _cli(capsys, *_moe_argv(platform, 1, "--json"))
        d = json.loads(out)
        assert d["schedule"] == "expert_wave" and d["verdict"] == "expert-wave already backpressure-free"


# ------------------------------------------------------------------ sigma in the rows

@pytest.mark.parametrize("platform", MEASURED)
def test_measured_profiles_fill_every_fa_row(capsys, platform):
    rc, text, _ = _cli(capsys, "plan", "fa-a2a", "--platform", platform, "--seq", "8192", "--heads", "24",
                       "--head-dim", "128", "--world", "8")
    assert rc == 0 and "n/a" not in text and "not evaluated" not in text
    assert f"1.422 us per KV tile (profile '{platform}')" in text


def test_profile_without_sigma_says_why(tmp_path, capsys):
    d = profiles.to_dict(profiles.load("h200-pcie-host"))
    del d["sigma_us_per_kv_tile"]
    f = tmp_path / "nosigma.json"
    f.write_text(json.dumps(d))
    rc, text, _ = _cli(capsys, "plan", "fa-a2a", "--platform", str(f), "--seq", "65536", "--heads", "8",
                       "--head-dim", "128", "--world", "8", "--producers", "8")
    assert rc == 0 and "n/a" not in text
    assert "not evaluated: profile 'h200-pcie-host' has no sigma_us_per_kv_tile; give --sigma-us" in text
    assert "unknown: give --sigma-us" in text
    rc, text, _ = _cli(capsys, "plan", "fa-a2a", "--platform", str(f), "--seq", "65536", "--heads", "8",
                       "--head-dim", "128", "--world", "8", "--producers", "8", "--sigma-us", "1.4")
    assert "1.400 us per KV tile (given (--sigma-us))" in text and "unknown" not in text


def test_sigma_scales_down_with_a_smaller_kv_step_only():
    plat = profiles.load("h200-pcie-host")
    small = plan_fa_a2a(plat, seq_len=8192, heads=24, head_dim=64, world=8, tile_m=64)
    assert small.sigma_s == pytest.approx(plat.sigma / 4) and "x 0.25" in small.sigma_source
    big = plan_fa_a2a(plat, seq_len=8192, heads=24, head_dim=128, world=8, tile_m=192, tile_n=256)
    assert big.sigma_s == plat.sigma


# ------------------------------------------------------------------ sanity limits

FA = ["plan", "fa-a2a", "--platform", "h200-nvlink-peer", "--seq", "8192", "--heads", "8", "--head-dim", "128",
      "--world", "8"]


def _error_line(capsys, *argv):
    rc, out, err = _cli(capsys, *argv)
    lines = err.strip().splitlines()
    assert rc == 2 and out == "" and len(lines) == 1 and lines[0].startswith("xstage: error: "), (rc, out, err)
    return lines[0][len("xstage: error: "):]


@pytest.mark.parametrize("argv,msg", [
    (FA[:4] + ["--seq", str(2**31)] + FA[6:], f"--seq {2**31} is past the int32 range of the kernels' sizes"),
    (FA[:4] + ["--seq", "8" + "0" * 26] + FA[6:], "--seq 8" + "0" * 26 + " is past the int32 range"),
    (_moe_argv(tokens=100_000_000_000), "--tokens 100000000000 is past the int32 range"),
    (FA + ["--batch", str(2**31)], "--batch 2147483648 is past the int32 range"),
    (_moe_argv(tokens=100_000_000), "this shape gives one rank's Combine buffer [top-k, tokens, hidden] of 4.47 TiB,"
                                    " over the 1 TiB sanity limit"),
    (FA[:4] + ["--seq", str(2**30), "--heads", "64", "--head-dim", "128", "--world", "1"],
     "this shape gives one rank's attention output [B, M, H/P, d] of 16 TiB"),
    (FA + ["--tile-m", "7"], "--tile-m 7 is not a multiple of 64"),
    (FA + ["--tile-m", "96"], "--tile-m 96 is not a multiple of 64"),
    (FA + ["--tile-n", "8"], "--tile-n 8 is not a multiple of 16"),
    (_moe_argv(tokens=8192) + ["--block-m", "100"], "--block-m 100 is not a multiple of 64"),
    (_moe_argv(tokens=8192) + ["--block-n", "24", "--hidden", "4104", "--intermediate", "2052"],
     "--block-n 24 is not a multiple of 16"),
    (FA[:2] + ["--platform", ""] + FA[4:], "empty platform name; shipped profiles: "),
    (FA[:2] + ["--platform", "  "] + FA[4:], "empty platform name"),
    (FA[:2] + ["--platform", "no-such-gpu"] + FA[4:], "unknown platform 'no-such-gpu'"),
    (FA[:2] + ["--platform", "/nonexistent/p.json"] + FA[4:], "profile file not found: /nonexistent/p.json"),
])
def test_sizes_tiles_and_platform_are_checked(capsys, argv, msg):
    assert _error_line(capsys, *argv).startswith(msg)


def test_planner_functions_check_the_same_limits():
    plat = profiles.load("h200-pcie-host")
    with pytest.raises(ValueError, match="tile_m=7 is not a multiple of 64"):
        plan_fa_a2a(plat, seq_len=8192, heads=8, head_dim=128, world=8, tile_m=7)
    with pytest.raises(ValueError, match="seq_len=2147483648 is past the int32 range"):
        plan_fa_a2a(plat, seq_len=2**31, heads=8, head_dim=128, world=8)
    with pytest.raises(ValueError, match="over the 1 TiB sanity limit"):
        plan_megamoe(plat, hidden=4096, intermediate=2048, experts=256, topk=6, tokens=100_000_000, world=8)
    with pytest.raises(ValueError, match="block_n=8 is not a multiple of 16"):
        plan_megamoe(plat, hidden=4096, intermediate=2048, experts=256, topk=6, tokens=8, world=8, block_n=8,
                     out_bytes=2)
    with pytest.raises(profiles.ProfileError, match="empty platform name"):
        profiles.load("")


# ------------------------------------------------------------------ stdout that cannot be written

def _xstage(*argv, shell_redirect: str) -> subprocess.CompletedProcess:
    """``python -m xstage ARGV`` with its stdout redirected by the shell (``> /dev/full``, ``>&-``)."""
    cmd = " ".join(["\"$0\" -m xstage", *argv, shell_redirect])
    return subprocess.run(["bash", "-c", cmd, sys.executable], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
@pytest.mark.parametrize("argv", [["profiles"], ["profiles", "--json"], FA])
def test_full_stdout_is_an_error_without_traceback(argv):
    p = _xstage(*argv, shell_redirect="> /dev/full")
    assert p.returncode == 1
    assert p.stderr == "xstage: error: cannot write the output: No space left on device\n"


def test_closed_stdout_is_an_error_without_traceback():
    p = _xstage("profiles", shell_redirect=">&-")
    assert (p.returncode, p.stderr) == (1, "xstage: error: cannot write the output: stdout is closed\n")


def test_head_takes_the_first_line_quietly():
    p = subprocess.run(["bash", "-c", "\"$0\" -m xstage profiles | head -1", sys.executable], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("name") and p.stderr == ""
