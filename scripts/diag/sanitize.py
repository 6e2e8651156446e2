#!/usr/bin/env python
"""compute-sanitizer (memcheck, racecheck) over a small configuration of every shipped kernel.

    python scripts/diag/sanitize.py                 # every case x tool; a table and sanitize.json
    python scripts/diag/sanitize.py --case megamoe_interleaved   # one case, no sanitizer (what it runs)

Cases: calibration (burst kernel, device and pinned-host destinations), fa4_a2a (fused Ulysses
attention, loopback P = 2, non-causal and causal), fa4_a2a_copy (the A2A-only baseline's copy
kernel, against torch copies), megamoe_expert_wave / megamoe_interleaved (P = 2,
E = 16, H = 1024, I = 512, top-4, 100 / 37 tokens, the default configuration). Each case checks its
output against the fp32 reference, so a run under the sanitizer is also a correctness run.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time

CASES = ("calibration", "fa4_a2a", "fa4_a2a_copy", "megamoe_expert_wave", "megamoe_interleaved")
TOOLS = ("memcheck", "racecheck")
KERNEL_FILTER = {"calibration": "BurstKernel", "fa4_a2a": "FlashAttentionUlyssesSm90", "fa4_a2a_copy": "UlyssesA2ACopy",
                 "megamoe_expert_wave": "MegaMoESm90", "megamoe_interleaved": "MegaMoESm90"}


def run_calibration():
    import torch

    from calibration.kernels import BurstConfig, BurstKernel
    from xstage.world import make_world

    K, B, N = 7, 4096, 8
    region = 8 * K * B
    for backend in ("loopback", "host"):
        w = make_world(backend, 1)
        buf = w.alloc((region,), torch.uint8)
        ts = torch.full((K * N * 4,), -1, dtype=torch.int64, device="cuda")
        sync = torch.zeros(2, dtype=torch.int32, device="cuda")
        sink = torch.zeros(K * 128, dtype=torch.float32, device="cuda")
        BurstKernel(BurstConfig(gap_mode="spin"))(buf.peer_table(0), 0, ts, sync, sink, num_producers=K,
                                                  bytes_per_producer=B, num_bursts=N, region_bytes=region,
                                                  dst_buffer_bytes=region, gap_ns=2000)
        torch.cuda.synchronize()
        assert (ts >= 0).all(), "timestamps not written"


def run_fa4_a2a():
    import torch

    from fa4_a2a import ulysses_attention
    from fa4_a2a.reference import ulysses_reference
    from xstage.world import make_world

    P, B, C, H, D = 2, 1, 128, 4, 128
    world = make_world("loopback", world_size=P, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = ([torch.randn(B, C, H, D, generator=g, device="cuda").bfloat16() for _ in range(P)] for _ in range(3))
    for causal in (False, True):
        outs = ulysses_attention(q, k, v, world, causal=causal)
        refs = ulysses_reference(q, k, v, causal=causal)
        err = max((o.float() - r).abs().max().item() for o, r in zip(outs, refs))
        assert err < 2e-2, f"fa4_a2a causal={causal}: max error {err}"


def run_fa4_a2a_copy():
    import torch

    from fa4_a2a.baselines import a2a_copy, a2a_symm
    from xstage.world import make_world

    P, B, S, Hl, D = 2, 1, 256, 2, 128
    world = make_world("loopback", world_size=P, device="cuda")
    outs, want = world.alloc((B, S // P, Hl * P, D), torch.bfloat16), world.alloc((B, S // P, Hl * P, D), torch.bfloat16)
    for r in range(P):
        o = torch.randn(B, S, Hl, D, device="cuda").bfloat16()
        a2a_symm(o, outs.local(r), outs.peer_table(r) + r * Hl * D * 2, num_ranks=P)
        a2a_copy(o, [want.local(j) for j in range(P)], r)
    torch.cuda.synchronize()
    assert all(torch.equal(outs.local(j), want.local(j)) for j in range(P)), "a2a_symm differs from torch copies"


def run_megamoe(schedule):
    import torch

    from megamoe_interleave import MegaMoE, MegaMoEConfig, make_world
    from megamoe_interleave.reference import reference_moe_fp32
    from megamoe_interleave.routing import make_routing

    E, H, I, k, P, tokens = 16, 1024, 512, 4, 2, [100, 37]
    g = torch.Generator().manual_seed(0)
    w1 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).bfloat16().cuda()
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).bfloat16().cuda()
    xs = [torch.randn(t, H, generator=g).bfloat16().cuda() for t in tokens]
    routes = [make_routing("balanced", t, E, k, seed=r) for r, t in enumerate(tokens)]
    idx, wts = [r[0].cuda() for r in routes], [r[1].cuda() for r in routes]
    moe = MegaMoE(make_world("loopback", world_size=P, device="cuda"), E, H, I, k, 128, MegaMoEConfig(schedule))
    moe.load_weights(w1, w2)
    ys = moe(xs, idx, wts)
    refs = reference_moe_fp32(xs, idx, wts, w1, w2)
    err = max((y.float() - r).abs().max().item() for y, r in zip(ys, refs))
    assert err < 0.05, f"megamoe {schedule}: max error {err}"


def run_case(case):
    if case == "calibration":
        run_calibration()
    elif case == "fa4_a2a":
        run_fa4_a2a()
    elif case == "fa4_a2a_copy":
        run_fa4_a2a_copy()
    else:
        run_megamoe(case.removeprefix("megamoe_"))


def sanitize(case, tool, log_dir, timeout_s):
    """One case under one tool: (errors or None when the run failed, seconds, log path)."""
    log = os.path.join(log_dir, f"{case}.{tool}.log")
    cmd = ["compute-sanitizer", "--tool", tool, "--print-limit", "20", "--kernel-name", f"kns={KERNEL_FILTER[case]}"]
    # Host API error returns (cuda-python probes driver entry points with cuGetProcAddress and
    # gets INVALID_VALUE for ones this driver lacks) are not kernel errors: leave them out.
    cmd += ["--report-api-errors", "no"]
    if tool == "racecheck":
        cmd += ["--racecheck-report", "all"]
    cmd += [sys.executable, os.path.abspath(__file__), "--case", case]
    t0 = time.time()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = None
    text = open(log).read()
    m = re.search(r"(ERROR|RACECHECK) SUMMARY: (\d+) (errors|hazards displayed \((\d+) errors)", text)
    errors = None if rc is None or m is None else int(m.group(4) or m.group(2))
    if rc not in (0, None) and errors == 0:
        errors = None  # the case itself failed
    return errors, round(time.time() - t0, 1), log


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=CASES, help="run one case without a sanitizer (the sanitizer's child)")
    ap.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    ap.add_argument("--tools", nargs="+", choices=TOOLS, default=list(TOOLS))
    ap.add_argument("--out", default="results/h200/sanitizers")
    ap.add_argument("--timeout-s", type=float, default=300)
    args = ap.parse_args()
    if args.case:
        run_case(args.case)
        print(f"{args.case}: ok")
        return
    if shutil.which("compute-sanitizer") is None:
        sys.exit("compute-sanitizer not found (CUDA toolkit)")
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for case in args.cases:
        for tool in args.tools:
            errors, secs, log = sanitize(case, tool, args.out, args.timeout_s)
            rows.append(dict(case=case, tool=tool, errors=errors, seconds=secs, log=os.path.basename(log)))
            print(f"{case:22s} {tool:10s} {'run failed' if errors is None else f'{errors} errors':>12s} {secs:7.1f} s",
                  flush=True)
    from xstage import provenance

    provenance.write_json(os.path.join(args.out, "sanitize.json"), {"rows": rows})
    sys.exit(0 if all(r["errors"] == 0 for r in rows) else 1)


if __name__ == "__main__":
    main()
