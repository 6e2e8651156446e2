"""``xstage`` command line: list platform profiles and run the design-test planner.

    xstage profiles [--json]
    xstage plan fa-a2a  --platform NAME|FILE --seq M --heads H --head-dim D --world P [...]
    xstage plan megamoe --platform NAME|FILE --hidden --intermediate --experts --topk --tokens --world [...]

    xstage --version

Bad arguments print one line ``xstage: error: ...`` and exit with code 2.
Every numeric flag is checked here, before the model runs, and errors name
the flag and the value as given (in the flag's unit): positive, within the
int32 range of the kernels' sizes, tile sizes on the Hopper MMA grid, and no
tensor of the planned layer over 1 TiB (planner.MAX_TENSOR_BYTES).

If stdout is closed early (``xstage profiles | head -1``) the command stops
quietly with exit code 141 (128 + SIGPIPE, what a Unix tool killed by SIGPIPE
reports), without a traceback; under ``set -o pipefail`` that status shows
that the output was cut short.  (``--help`` and ``--version`` still exit 0:
argparse drops their failed write itself.)  Any other failed write (a full
disk, ``> /dev/full``, a stdout closed before the start, ``>&-``) prints one
``xstage: error: ...`` line and exits with code 1.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path

from . import __version__, planner, profiles

__all__ = ["main"]


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors as one line (no usage dump) with exit code 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        raise _UsageError(message)


EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE
EXIT_WRITE_ERROR = 1

# --out-bytes: bytes per output element (fp8, bf16/fp16, fp32), and the 16-byte remote
# stores (st.global.v4.b32) an output tile row must be a whole number of.
OUT_BYTES, STORE_BYTES = planner.OUT_BYTES, planner.STORE_BYTES


def _version() -> str:
    """The installed package's version; the checkout's pyproject.toml if not installed."""
    from importlib import metadata

    try:
        return metadata.version("xstage")
    except metadata.PackageNotFoundError:
        pass
    try:
        text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    except OSError:
        return __version__
    m = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M)
    return m.group(1) if m else __version__


def _table(rows: list[tuple[str, str]], title: str) -> str:
    w = max(len(k) for k, _ in rows)
    lines = [title, "-" * len(title)]
    lines += [f"{k.ljust(w)}  {v}" for k, v in rows]
    return "\n".join(lines)


def _us(s: float | None) -> str:
    return "n/a" if s is None else f"{s * 1e6:.3f} us"


def _mib(b: float) -> str:
    return f"{b / 2**20:.3f} MiB"


def _fmt_fa(p: planner.FAPlan) -> str:
    rows = [
        ("platform", p.platform),
        ("shape", f"M={p.seq_len} H={p.heads} d={p.head_dim} P={p.world} B={p.batch} (H/P={p.local_heads} heads per rank)"),
        ("tile", f"b_m={p.tile_m} b_n={p.tile_n}, {p.out_bytes}-byte outputs"),
        ("producers K", _producers(p.producers, p.producer_limit, p.tiles_per_rank, "output tiles")),
        ("output tiles per rank", f"{p.tiles_per_rank} in {_waves(p.burst_waves, p.tiles_per_rank, p.producer_limit)}"),
        ("burst volume V", f"{_mib(p.volume_bytes)} ({p.volume_bytes} B = K x {p.volume_bytes // p.producers} B)"),
        ("T_iss0", _us(p.t_iss0_s)),
        ("G* (eq. 5)", _us(p.recovery_gap_s)),
        ("V - R*T_iss0 (eq. 6)", f"{_mib(p.peak_outstanding_bytes)} vs Q {_mib(p.capacity_bytes)}"
                                 f" -> {'holds' if p.capacity_ok else 'FAILS'}"),
    ]
    no_sigma = f"not evaluated: {p.sigma_source}; give --sigma-us"
    sigma_rows = [
        ("sigma", no_sigma if p.sigma_s is None else f"{_us(p.sigma_s)} per KV tile ({p.sigma_source})"),
        ("G_Qloop(M) >= sigma*M/b_n", "not evaluated (no sigma)" if p.qloop_gap_s is None else _us(p.qloop_gap_s)),
        ("M*_ub (eq. 20)", "not evaluated (no sigma)" if p.m_star_ub is None else f"{p.m_star_ub:.0f} tokens"),
    ]
    if p.burst_waves == 1:  # one burst into an empty X-Stage: eq. 7, no eq. 18
        stall_rows = [("rate bound (eq. 10)", p.rate_bound),
                      ("predicted stall (eq. 7)", _us(p.drain_stall_s))]
    else:
        stall_rows = [("rate bound (eq. 10)", p.rate_bound),
                      ("predicted dt(M) (eq. 18)", "not evaluated (no sigma)" if p.drain_stall_s is None
                       else _us(p.drain_stall_s)),
                      ("predicted E_drain(M)", "not evaluated (no sigma)" if p.drain_residual_s is None
                       else _us(p.drain_residual_s))]
    rows += sigma_rows + stall_rows + [("verdict", p.verdict)]
    return _table(rows, "FA-A2A design test") + "\n" + "\n".join(f"  - {r}" for r in p.reasons)


def _producers(k: int, limit: int, tiles: int, what: str) -> str:
    if k < limit:
        return f"{k} (aligned worst case: every one of the {what} that exist, fewer than the {limit} producer CTAs)"
    return f"{k} (aligned worst case)"


def _waves(waves: int, tiles: int, limit: int) -> str:
    if tiles < limit:
        return "1 partial burst wave"
    return f"{waves} burst wave{'s' if waves > 1 else ''}"


def _fmt_moe(p: planner.MoEPlan) -> str:
    rows = [
        ("platform", p.platform),
        ("shape", f"hidden={p.hidden} inter={p.intermediate} experts={p.experts} top-k={p.topk}"),
        ("tokens", f"{p.tokens_per_rank} per rank, P={p.world}, ~{p.rows_per_expert:.1f} rows per expert"),
        ("tiles", f"b_m={p.block_m} b_n={p.block_n}; per row n1={p.n1} L1, n2={p.n2} L2"),
        ("producers K", _producers(p.producers, p.producer_limit, p.l2_tiles, "Linear-2 tiles")),
        ("Linear-2 tiles per rank", f"{p.l2_tiles} in {_waves(p.burst_waves, p.l2_tiles, p.producer_limit)}"),
        ("burst volume V", f"{_mib(p.volume_bytes)} (V_t = {p.tile_volume_bytes} B)"),
        ("T_iss0", _us(p.t_iss0_s)),
        ("T_L1^mma / T_L2^mma", f"{_us(p.t_l1_mma_s)} / {_us(p.t_l2_mma_s)} ({p.mma_source})"),
        ("G* (eq. 5)", _us(p.recovery_gap_s)),
        ("expert-wave gap, dT_iss (eq. 9)", f"{_us(p.wave_gap_s)}, {_us(p.wave_overhead_s)}"
                                            f" (rate {p.wave_rate_ratio:.2f}x R)"),
        ("interleaved gap (eq. 12)", _us(p.interleaved_gap_s)),
        ("interleaved dT_iss (eq. 13)", _us(p.interleaved_overhead_s)),
        ("eq. 14", f"{'holds' if p.interleave_sufficient else 'FAILS'} (rate {p.interleaved_rate_ratio:.2f}x R)"),
        ("D_knee (eq. 16)", f"{p.d_knee_rows:.2f} scheduler rows"),
        ("kernel: L1 + L2 compute, V/R", f"{_us(p.kernel_l1_s)} + {_us(p.kernel_l2_s)}, {_us(p.drain_s)} "
                                         f"({_mib(p.combine_bytes)} Combine)"),
        ("kernel: expert-wave / interleaved",
         f"{_us(p.kernel_wave_s)} / {_us(p.kernel_interleaved_s)} "
         f"({p.kernel_wave_s / p.kernel_interleaved_s:.2f}x; eq. 11 over the kernel)"),
        ("verdict", p.verdict),
        ("schedule=\"auto\" picks", f"{p.schedule} (balanced routing, {p.expert_waves} expert waves:"
                                   f" {p.schedule_reason})"),
    ]
    return _table(rows, "MegaMoE design test") + "\n" + "\n".join(f"  - {r}" for r in p.reasons)


def _add_int(p, checks, flag, **kw):
    """A flag that must be a positive integer (checked by :func:`_check_numbers`)."""
    a = p.add_argument(flag, type=int, metavar="N", **kw)
    checks.append((a.dest, flag, "int"))


def _add_pos(p, checks, flag, metavar, **kw):
    """A flag that must be a finite number > 0, in the unit its name and help give."""
    a = p.add_argument(flag, type=float, metavar=metavar, **kw)
    checks.append((a.dest, flag, "pos"))


_OUT_BYTES_HELP = ("bytes per output element s_out: 1, 2 or 4 (fp8, bf16/fp16, fp32; the shipped kernels"
                   " store 2-byte bf16/fp16). An output tile row ({row}) must be a multiple of 16 bytes: the"
                   " epilogue writes 16-byte vector stores")
_PRODUCERS_HELP = "aligned producer CTAs K, at most the platform's SM count (default: num SMs)"
_PLATFORM_HELP = "shipped profile name (see 'xstage profiles') or a profile JSON file"


def _build_parser() -> _Parser:
    ap = _Parser(prog="xstage", description="X-Stage Burst-Gap model: profiles and design-test planner")
    ap.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    pr = sub.add_parser("profiles", help="list shipped platform profiles")
    pr.add_argument("--json", action="store_true")

    plan = sub.add_parser("plan", help="run the design test for a kernel")
    psub = plan.add_subparsers(dest="kernel", required=True, parser_class=_Parser)

    fa, c = _plan_parser(psub, "fa-a2a", "FlashAttention + Ulysses post All-to-All (Section 4.3)")
    _add_int(fa, c, "--seq", required=True, help="global sequence length M (tokens)")
    _add_int(fa, c, "--heads", required=True, help="total attention heads H")
    _add_int(fa, c, "--head-dim", required=True, help="head dimension d")
    _add_int(fa, c, "--world", required=True, help="Ulysses degree P")
    _add_int(fa, c, "--batch", default=1)
    _add_int(fa, c, "--tile-m", default=128, help="output (Q) tile rows b_m")
    _add_int(fa, c, "--tile-n", default=128, help="KV tile b_n")
    _add_int(fa, c, "--out-bytes", default=2, help=_OUT_BYTES_HELP.format(row="--head-dim x --out-bytes"))
    _add_int(fa, c, "--producers", default=None, help=_PRODUCERS_HELP)
    _add_pos(fa, c, "--sigma-us", "US", default=None,
             help="Q-loop time per KV tile, microseconds > 0 (default: profile's)")
    fa.add_argument("--json", action="store_true")

    moe, c = _plan_parser(psub, "megamoe", "MegaMoE Combine bursts (Section 4.2)")
    _add_int(moe, c, "--hidden", required=True, help="hidden size h")
    _add_int(moe, c, "--intermediate", required=True, help="expert intermediate size")
    _add_int(moe, c, "--experts", required=True, help="routed experts (all ranks)")
    _add_int(moe, c, "--topk", required=True, help="experts per token, at most --experts")
    _add_int(moe, c, "--tokens", required=True, help="tokens per rank")
    _add_int(moe, c, "--world", required=True, help="expert-parallel degree P")
    _add_int(moe, c, "--block-m", default=128, help="tile rows b_m")
    _add_int(moe, c, "--block-n", default=128, help="tile columns b_n (divides --hidden and 2 x --intermediate)")
    _add_int(moe, c, "--out-bytes", default=2, help=_OUT_BYTES_HELP.format(row="--block-n x --out-bytes"))
    _add_int(moe, c, "--producers", default=None, help=_PRODUCERS_HELP)
    _add_pos(moe, c, "--t-l1-us", "US", default=None,
             help="Linear-1 tile mainloop time, microseconds > 0 (default: from the dense rate)")
    _add_pos(moe, c, "--t-l2-us", "US", default=None,
             help="Linear-2 tile mainloop time, microseconds > 0 (default: from the dense rate)")
    _add_pos(moe, c, "--dense-tflops", "TFLOPS", default=None,
             help="dense bf16 rate in TFLOP/s > 0, to estimate the mainloop times (default: profile's)")
    moe.add_argument("--json", action="store_true")
    return ap


def _plan_parser(psub, name: str, help: str):
    """A ``plan`` subcommand with its --platform flag and the list its numeric checks go into."""
    sub = psub.add_parser(name, help=help)
    checks: list = []
    sub.set_defaults(checks=checks)
    sub.add_argument("--platform", required=True, help=_PLATFORM_HELP)
    return sub, checks


def _fail(msg: str):
    raise _UsageError(msg)


def _check_numbers(args) -> None:
    """Every numeric flag: positive integers, or finite numbers > 0 (value shown as given)."""
    for dest, flag, kind in args.checks:
        v = getattr(args, dest)
        if v is None:
            continue
        if kind == "int":
            if v <= 0:
                _fail(f"{flag} must be a positive integer, got {v}")
            if v > planner.INT32_MAX:
                _fail(f"{flag} {v} is past the int32 range of the kernels' sizes (max {planner.INT32_MAX})")
        elif not math.isfinite(v):
            _fail(f"{flag} must be a finite number, got {v:g}")
        elif v <= 0:
            _fail(f"{flag} must be > 0, got {v:g}")


def _check_out_bytes(out_bytes: int, width: int, width_flag: str) -> None:
    if out_bytes not in OUT_BYTES:
        _fail(f"--out-bytes must be 1, 2 or 4 (bytes per output element: fp8, bf16/fp16, fp32), got {out_bytes}")
    row = width * out_bytes
    if row % STORE_BYTES:
        _fail(f"{width_flag} {width} x --out-bytes {out_bytes} = {row}-byte output rows:"
              f" not a multiple of the kernels' {STORE_BYTES}-byte stores")


def _check_tile(flag: str, v: int, multiple: int, what: str) -> None:
    if v % multiple:
        _fail(f"{flag} {v} is not a multiple of {multiple} ({what})")


_MMA_ROWS = f"the rows of one Hopper WGMMA, m{planner.MMA_M}nNk{planner.MMA_K}"
_MMA_K = f"the k step of a 16-bit Hopper WGMMA, m{planner.MMA_M}nNk{planner.MMA_K}"


def _check_tensor_sizes(tensors: dict) -> None:
    for what, nbytes in tensors.items():
        if nbytes > planner.MAX_TENSOR_BYTES:
            _fail(f"this shape gives {what} of {nbytes / 2**40:.3g} TiB, over the"
                  f" {planner.MAX_TENSOR_BYTES // 2**40} TiB sanity limit for one tensor (an H200 has 141 GB)")


def _check_plan(args):
    """Check a plan command's flags, then load its platform (errors name the flags)."""
    _check_numbers(args)
    if args.kernel == "fa-a2a":
        _check_out_bytes(args.out_bytes, args.head_dim, "--head-dim")
        _check_tile("--tile-m", args.tile_m, planner.MMA_M, _MMA_ROWS)
        _check_tile("--tile-n", args.tile_n, planner.MMA_K, _MMA_K + ": the KV tile is the reduction of P x V")
        if args.heads % args.world:
            _fail(f"--heads {args.heads} is not divisible by --world {args.world}"
                  " (Ulysses splits the heads across ranks)")
        if args.seq % args.world:
            _fail(f"--seq {args.seq} is not divisible by --world {args.world}"
                  " (Ulysses splits the sequence across ranks)")
        _check_tensor_sizes(planner.fa_tensor_bytes(seq_len=args.seq, heads=args.heads, head_dim=args.head_dim,
                                                    world=args.world, batch=args.batch, out_bytes=args.out_bytes))
    else:
        _check_out_bytes(args.out_bytes, args.block_n, "--block-n")
        _check_tile("--block-m", args.block_m, planner.MMA_M, _MMA_ROWS)
        _check_tile("--block-n", args.block_n, planner.MMA_K, _MMA_K)
        if args.experts % args.world:
            _fail(f"--experts {args.experts} is not divisible by --world {args.world} (expert parallelism)")
        if args.topk > args.experts:
            _fail(f"--topk {args.topk} exceeds --experts {args.experts}")
        if (2 * args.intermediate) % args.block_n:
            _fail(f"2 x --intermediate {args.intermediate} is not a multiple of --block-n {args.block_n}"
                  " (Linear-1 tiles)")
        if args.hidden % args.block_n:
            _fail(f"--hidden {args.hidden} is not a multiple of --block-n {args.block_n} (Linear-2 tiles)")
        _check_tensor_sizes(planner.moe_tensor_bytes(hidden=args.hidden, intermediate=args.intermediate,
                                                     experts=args.experts, topk=args.topk, tokens=args.tokens,
                                                     world=args.world, out_bytes=args.out_bytes))
    platform = profiles.load(args.platform)
    if args.producers is not None and args.producers > platform.num_sms:
        _fail(f"--producers {args.producers} exceeds the {platform.num_sms} SMs of platform {platform.name!r}"
              " (one aligned producer CTA per SM)")
    return platform


def _run(args) -> str:
    if args.cmd == "profiles":
        rows = []
        for name in profiles.available():
            p = profiles.load(name)
            rows.append({"name": name, "source": p.source, "target": p.target, "gpu": p.gpu,
                         "R_GBps": p.R / 1e9,
                         # T_iss0 at the FA4 worst aligned burst: every SM stores one 32 KiB tile
                         "t_iss0_us": p.t_iss0_at(p.num_sms, p.num_sms * 32768) * 1e6,
                         "Q_MiB": p.q_at(p.num_sms) / 2**20, "num_sms": p.num_sms})
        if args.json:
            return json.dumps(rows, indent=2)
        out = [f"{'name':24} {'source':9} {'R (GB/s)':>9} {'T_iss0@32KiB/SM (us)':>20} {'Q (MiB)':>8}  SMs"]
        out += [f"{r['name']:24} {r['source']:9} {r['R_GBps']:9.1f} {r['t_iss0_us']:20.3f} {r['Q_MiB']:8.3f}"
                f"  {r['num_sms']}" for r in rows]
        return "\n".join(out)
    platform = _check_plan(args)
    if args.kernel == "fa-a2a":
        p = planner.plan_fa_a2a(
            platform, seq_len=args.seq, heads=args.heads, head_dim=args.head_dim, world=args.world,
            batch=args.batch, tile_m=args.tile_m, tile_n=args.tile_n, out_bytes=args.out_bytes,
            producers=args.producers, sigma=None if args.sigma_us is None else args.sigma_us * 1e-6)
        return json.dumps(p.as_dict(), indent=2) if args.json else _fmt_fa(p)
    us = (lambda x: None if x is None else x * 1e-6)
    p = planner.plan_megamoe(
        platform, hidden=args.hidden, intermediate=args.intermediate, experts=args.experts, topk=args.topk,
        tokens=args.tokens, world=args.world, block_m=args.block_m, block_n=args.block_n,
        out_bytes=args.out_bytes, producers=args.producers, t_l1_mma=us(args.t_l1_us), t_l2_mma=us(args.t_l2_us),
        dense_flops=None if args.dense_tflops is None else args.dense_tflops * 1e12)
    return json.dumps(p.as_dict(), indent=2) if args.json else _fmt_moe(p)


def _error(msg: str) -> None:
    """One ``xstage: error:`` line on stderr, if there is a stderr to write to."""
    if sys.stderr is not None:
        try:
            print(f"xstage: error: {msg}", file=sys.stderr, flush=True)
        except OSError:
            pass


def _main(argv) -> int:
    try:
        args = _build_parser().parse_args(argv)
        print(_run(args))
    except SystemExit as e:  # --help / --version printed their text
        return e.code if isinstance(e.code, int) else 0
    except (_UsageError, ValueError) as e:  # ProfileError is a ValueError
        _error(str(e))
        return 2
    return 0


def _stdout_to_devnull() -> None:
    """Point fd 1 at /dev/null so that the interpreter's last flush cannot fail again."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError):  # stdout without a file descriptor (in-process capture)
        pass


def main(argv: list[str] | None = None) -> int:
    if sys.stdout is None:  # started with fd 1 closed (xstage ... >&-): nowhere to print to
        _error("cannot write the output: stdout is closed")
        return EXIT_WRITE_ERROR
    try:
        rc = _main(argv)
        sys.stdout.flush()  # a failed write must show up here, not at interpreter exit
        return rc
    except BrokenPipeError:  # reader went away (xstage ... | head): stop quietly
        _stdout_to_devnull()
        return EXIT_BROKEN_PIPE
    except OSError as e:  # ENOSPC (> /dev/full), EBADF, EIO: the output is lost, say so
        _stdout_to_devnull()
        _error(f"cannot write the output: {e.strerror or e}")
        return EXIT_WRITE_ERROR


if __name__ == "__main__":
    sys.exit(main())
