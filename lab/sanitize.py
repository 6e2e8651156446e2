"""compute-sanitizer (memcheck, racecheck) over a small configuration of every shipped kernel.

    python scripts/diag/sanitize.py                 # every case x tool; a table and sanitize.json
    python scripts/diag/sanitize.py --case megamoe_interleaved   # one case, no sanitizer (what it runs)

Cases: calibration (burst kernel, device and pinned-host destinations), fa4_a2a (fused Ulysses
attention, loopback P = 2, non-causal and causal), fa4_a2a_copy (the A2A-only baseline's copy
kernel, against torch copies), megamoe_expert_wave / megamoe_interleaved (P = 2,
E = 16, H = 1024, I = 512, top-4, 100 / 37 tokens, the default configuration),
megamoe_w8a8_expert_wave / megamoe_w8a8_interleaved (that problem in W8A8, then P = 1, 200 tokens,
top-2, H = 512, I = 256: the case whose empty pair-member tiles read scales past the pool, issue
39), megamoe_w4a8_expert_wave / megamoe_w4a8_interleaved (the W8A8 problems in W4A8, checked bit for
bit against the W8A8 kernel on the widened weights), megamoe_plan (the device-side plan's kernel, equal
to the torch plan, then one enqueue), megamoe_enqueue (one enqueue alone: the device plan, the fused
kernel and the reduction, every kernel instrumented). Each case checks its output against a reference,
so a run under the sanitizer is also a correctness run.

The children run with PyTorch's caching allocator off (PYTORCH_NO_CUDA_MEMORY_CACHING=1): every
tensor is then its own allocation, so memcheck sees a read past a tensor's end, which inside a
cached segment it cannot.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import threading
import time

CASES = ("calibration", "fa4_a2a", "fa4_a2a_copy", "megamoe_expert_wave", "megamoe_interleaved",
         "megamoe_w8a8_expert_wave", "megamoe_w8a8_interleaved", "megamoe_w4a8_expert_wave",
         "megamoe_w4a8_interleaved", "megamoe_plan", "megamoe_enqueue")
TOOLS = ("memcheck", "racecheck")
KERNEL_FILTER = {"calibration": "BurstKernel", "fa4_a2a": "FlashAttentionUlyssesSm90", "fa4_a2a_copy": "UlyssesA2ACopy",
                 "megamoe_expert_wave": "MegaMoESm90", "megamoe_interleaved": "MegaMoESm90",
                 "megamoe_w8a8_expert_wave": "MegaMoESm90", "megamoe_w8a8_interleaved": "MegaMoESm90",
                 "megamoe_w4a8_expert_wave": "MegaMoESm90", "megamoe_w4a8_interleaved": "MegaMoESm90",
                 "megamoe_plan": "DevicePlanSm90", "megamoe_enqueue": None}  # None: every kernel


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


# The megamoe cases' problems: (P, E, H, I, top-k, tokens per rank, max_tokens_per_rank)
MEGAMOE_PROBLEMS = {
    "bf16": [(2, 16, 1024, 512, 4, [100, 37], 128)],
    # the bf16 problem, then issue 39's (P = 1: the last expert's 25 rows leave CTA 1 of its pair a
    # tile without rows, whose scale reads ran past the pool)
    "w8a8": [(2, 16, 1024, 512, 4, [100, 37], 256), (1, 16, 512, 256, 2, [200], 256)],
}
MEGAMOE_PROBLEMS["w4a8"] = MEGAMOE_PROBLEMS["w8a8"]
PLAN_PROBLEM = (2, 16, 512, 256, 4, [64, 37], 64)  # skewed, 20 % masked
PLAN_SCHEDULES = (("expert_wave", dict(experts_per_wave=2)), ("interleaved", dict(lead=2, balance_l2=True)))


# Under a sanitizer the fused kernel runs ~100x slower: the default 2 s bound of its waits expired
# in racecheck's W8A8 runs (an error word, outputs dropped), so the children run with this one
# (another kernel build: its waits compare against a compiled-in constant).
SANITIZED_ENV = "XSTAGE_SANITIZED"
SANITIZED_TIMEOUT_NS = 120_000_000_000


def megamoe_layer(problem, precision, schedule, device):
    from megamoe_interleave import MegaMoE, MegaMoEConfig, make_world

    P, E, H, I, k, _, T = problem
    timeout = dict(timeout_ns=SANITIZED_TIMEOUT_NS) if os.environ.get(SANITIZED_ENV) else {}
    return MegaMoE(make_world("loopback", world_size=P, device=device), E, H, I, k, T,
                   MegaMoEConfig(schedule, precision=precision, **timeout), backend="fused", num_sms=132)


def megamoe_inputs(problem, kind="balanced", mask=0.0, seed=0):
    import torch

    from lab.megamoe.routing import make_routing

    P, E, H, I, k, tokens, _ = problem
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).bfloat16().cuda()
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).bfloat16().cuda()
    xs = [torch.randn(t, H, generator=g).bfloat16().cuda() for t in tokens]
    routes = [make_routing(kind, t, E, k, seed=r, mask_ratio=mask, strength=2.0) for r, t in enumerate(tokens)]
    return w1, w2, xs, [r[0].cuda() for r in routes], [r[1].cuda() for r in routes]


def run_megamoe(precision, schedule):
    from megamoe_interleave import quant
    from megamoe_interleave.reference import (W8A8_KERNEL_REL_ERROR, reference_moe_fp32, reference_moe_w8a8,
                                              relative_error)

    for problem in MEGAMOE_PROBLEMS[precision]:
        w1, w2, xs, idx, wts = megamoe_inputs(problem)
        moe = megamoe_layer(problem, precision, schedule, "cuda")
        moe.load_weights(w1, w2)
        ys = moe(xs, idx, wts)
        if precision == "bf16":
            refs = reference_moe_fp32(xs, idx, wts, w1, w2)
            err = max((y.float() - r).abs().max().item() for y, r in zip(ys, refs))
            assert err < 0.05, f"megamoe {schedule} {problem}: max error {err}"
        elif precision == "w4a8":
            from megamoe_interleave import quant_fp4

            w8 = megamoe_layer(problem, "w8a8", schedule, "cuda")
            w8.load_quantized_weights(*quant_fp4.widen_weights(*quant_fp4.quantize_weights(w1, w2)))
            ys = [y.clone() for y in ys]
            assert all(a.equal(b) for a, b in zip(ys, w8(xs, idx, wts))), f"megamoe w4a8 {schedule} {problem} != w8a8"
        else:
            err = relative_error(ys, reference_moe_w8a8(xs, idx, wts, *quant.quantize_weights(w1, w2)))
            assert err <= W8A8_KERNEL_REL_ERROR, f"megamoe w8a8 {schedule} {problem}: relative error {err}"


def plan_arguments(schedule, options):
    from megamoe_interleave.scheduler import schedule_of

    P, E, H, I, k, tokens, T = PLAN_PROBLEM
    spec = schedule_of(schedule, **{n: v for n, v in options.items() if n != "experts_per_wave"})
    return dict(experts_per_rank=E // P, row_block=256, schedule=spec, num_pairs=66, pairs_l1=2 * I // 256,
                pairs_l2=H // 256, hidden=H, intermediate=I, experts_per_wave=options.get("experts_per_wave"))


def run_megamoe_plan():
    """The device-side plan's kernel equal to the torch plan for both schedules, then one enqueue
    (device plan + fused kernel) against the fp32 reference."""
    import torch

    from megamoe_interleave.device_plan import plan_all_ranks
    from megamoe_interleave.plan_kernel import plan_all_ranks_kernel

    w1, w2, xs, idx, wts = megamoe_inputs(PLAN_PROBLEM, "skewed", 0.2, seed=1)
    T = PLAN_PROBLEM[-1]
    pad = lambda t: torch.cat([t, t.new_full((T - t.shape[0], t.shape[1]), -1 if t.dtype == torch.int64 else 0)])  # noqa: E731
    idx_all, w_all = torch.stack([pad(i) for i in idx]), torch.stack([pad(w) for w in wts])
    num_tokens = torch.tensor(PLAN_PROBLEM[5], device="cuda")
    for schedule, options in PLAN_SCHEDULES:
        kw = plan_arguments(schedule, options)
        got, want = plan_all_ranks_kernel(idx_all, w_all, num_tokens, **kw), plan_all_ranks(idx_all, w_all,
                                                                                            num_tokens, **kw)
        for name in ("counts", "n_pool", "pool_src", "pool_weight", "num_rows", "row_record", "schedule_table"):
            assert torch.equal(getattr(got, name).cpu(), getattr(want, name).cpu()), f"plan kernel {name} differs"
        print(f"plan kernel ({schedule}) equals the torch plan", flush=True)
    run_megamoe_enqueue(w1, w2, xs, idx, wts)


def run_megamoe_enqueue(*inputs):
    """One ``enqueue`` of PLAN_PROBLEM (device plan, fused kernel, reduction) against fp32."""
    from megamoe_interleave.reference import reference_moe_fp32

    w1, w2, xs, idx, wts = inputs or megamoe_inputs(PLAN_PROBLEM, "skewed", 0.2, seed=1)
    moe = megamoe_layer(PLAN_PROBLEM, "bf16", "interleaved", "cuda")
    moe.load_weights(w1, w2)
    ys = moe.enqueue(xs, idx, wts)
    moe.check()
    print("enqueue (device plan + fused kernel) ran", flush=True)
    refs = reference_moe_fp32(xs, idx, wts, w1, w2)
    err = max((y.float() - r).abs().max().item() for y, r in zip(ys, refs))
    assert err < 0.05, f"megamoe enqueue: max error {err}"


def compile_megamoe_cases(cases):
    """Compile the megamoe cases' kernels without a GPU (with XSTAGE_KERNEL_CACHE: for the GPU host),
    the builds the sanitizer's children run (SANITIZED_TIMEOUT_NS)."""
    from megamoe_interleave.plan_kernel import compiled_device_plan

    os.environ[SANITIZED_ENV] = "1"
    for case in cases:
        if case in ("megamoe_plan", "megamoe_enqueue"):
            for schedule, options in PLAN_SCHEDULES:
                P, _, _, _, k, _, T = PLAN_PROBLEM
                compiled_device_plan(P, T, k, **plan_arguments(schedule, options))
            megamoe_layer(PLAN_PROBLEM, "bf16", "interleaved", "cpu").compile(device_plan=True)
        elif case.startswith("megamoe_"):
            precision, schedule = megamoe_precision_schedule(case)
            for problem in MEGAMOE_PROBLEMS[precision]:
                megamoe_layer(problem, precision, schedule, "cpu").compile()


def megamoe_precision_schedule(case):
    rest = case.removeprefix("megamoe_")
    for precision in ("w8a8", "w4a8"):
        if rest.startswith(precision + "_"):
            return precision, rest.removeprefix(precision + "_")
    return "bf16", rest


def run_case(case):
    if case == "calibration":
        run_calibration()
    elif case == "fa4_a2a":
        run_fa4_a2a()
    elif case == "fa4_a2a_copy":
        run_fa4_a2a_copy()
    elif case == "megamoe_plan":
        run_megamoe_plan()
    elif case == "megamoe_enqueue":
        run_megamoe_enqueue()
    else:
        run_megamoe(*megamoe_precision_schedule(case))


HAZARD = re.compile(r"Potential (\w+) hazard")
ACCESS = re.compile(r"(Write|Read) Thread .* at \S+?\+(0x[0-9a-f]+)(?: in (\S+))?")
KEEP_LINES = 400  # of the sanitizer's output, in the log; the rest is summarised per site


def summarise_sites(lines):
    """Per hazard site (kind, write pc and line, read pc and line): how many reports. The
    sanitizer's full listing of a racy kernel is hundreds of MB; this table is what a reader needs."""
    sites, kind, access = {}, None, {}
    for line in lines:
        h = HAZARD.search(line)
        if h:
            kind, access = h.group(1), {}
            continue
        a = ACCESS.search(line)
        if a and kind:
            access[a.group(1)] = f"{a.group(3) or '?'} ({a.group(2)})"
            if len(access) == 2:
                key = (kind, access["Write"], access["Read"])
                sites[key] = sites.get(key, 0) + 1
                kind = None
    return sites


def sanitize(case, tool, log_dir, timeout_s, print_limit=20, blocking=False):
    """One case under one tool: (errors or None when the run failed, seconds, log path). The log
    keeps the first KEEP_LINES lines of the output, its last lines, and a table of hazard sites
    over every displayed report (`print_limit` 0: all of them)."""
    log = os.path.join(log_dir, f"{case}.{tool}.log")
    cmd = ["compute-sanitizer", "--tool", tool, "--print-limit", str(print_limit),
           *(["--kernel-name", f"kns={KERNEL_FILTER[case]}"] if KERNEL_FILTER[case] else [])]
    # Host API error returns (cuda-python probes driver entry points with cuGetProcAddress and
    # gets INVALID_VALUE for ones this driver lacks) are not kernel errors: leave them out.
    cmd += ["--report-api-errors", "no"]
    if tool == "racecheck":
        cmd += ["--racecheck-report", "all"]
    cmd += [sys.executable, "-m", "lab.sanitize", "--case", case]
    t0 = time.time()
    # the allocator off: see the module docstring; the repository first on the child's path
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1", PYTHONPATH=path, **{SANITIZED_ENV: "1"})
    if blocking:
        env["CUDA_LAUNCH_BLOCKING"] = "1"  # a fault is reported at the launch that made it
    head, tail, rc = [], [], None
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                            errors="replace")
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()

    def stream():
        for line in proc.stdout:
            if len(head) < KEEP_LINES:
                head.append(line)
            else:
                tail.append(line)
                del tail[:-KEEP_LINES]
            yield line

    sites = summarise_sites(stream())
    rc = proc.wait()
    timed_out = not timer.is_alive()
    timer.cancel()
    text = "".join(head + tail)
    with open(log, "w") as f:
        f.write("".join(head))
        if tail:
            f.write("[... reports left out; the hazard sites below count every displayed one ...]\n")
            f.write("".join(tail))
        if sites:
            f.write("\nhazard sites (kind, write, read): reports\n")
            for (kind, w, r), n in sorted(sites.items(), key=lambda kv: -kv[1]):
                f.write(f"  {kind}  write {w}  read {r}: {n}\n")
    m = re.search(r"(ERROR|RACECHECK) SUMMARY: (\d+) (errors|hazards displayed \((\d+) errors)", text)
    errors = None if timed_out or m is None else int(m.group(4) or m.group(2))
    if rc != 0 and errors == 0:
        errors = None  # the case itself failed
    return errors, round(time.time() - t0, 1), log


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=CASES, help="run one case without a sanitizer (the sanitizer's child)")
    ap.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    ap.add_argument("--tools", nargs="+", choices=TOOLS, default=list(TOOLS))
    ap.add_argument("--out", default="results/h200/sanitizers")
    ap.add_argument("--timeout-s", type=float, default=300)
    ap.add_argument("--print-limit", type=int, default=20,
                    help="reports the sanitizer prints (0: all; the log keeps a table of their sites)")
    ap.add_argument("--blocking", action="store_true",
                    help="CUDA_LAUNCH_BLOCKING=1 in the child: a fault names the launch that made it")
    ap.add_argument("--compile-only", action="store_true",
                    help="compile the megamoe cases' kernels (no GPU; with XSTAGE_KERNEL_CACHE, for the GPU host)")
    args = ap.parse_args()
    from xstage.cute_compile import ensure_hopper_target

    ensure_hopper_target()
    if args.compile_only:
        compile_megamoe_cases(args.cases)
        return
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
            errors, secs, log = sanitize(case, tool, args.out, args.timeout_s, args.print_limit, args.blocking)
            rows.append(dict(case=case, tool=tool, errors=errors, seconds=secs, log=os.path.basename(log)))
            print(f"{case:22s} {tool:10s} {'run failed' if errors is None else f'{errors} errors':>12s} {secs:7.1f} s",
                  flush=True)
    from xstage import provenance

    provenance.write_json(os.path.join(args.out, "sanitize.json"), {"rows": rows})
    sys.exit(0 if all(r["errors"] == 0 for r in rows) else 1)


if __name__ == "__main__":
    main()
