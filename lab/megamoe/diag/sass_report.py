#!/usr/bin/env python
"""What ptxas made of a fused-kernel build, read on a CPU: registers, stack, local-memory accesses
by role and where they sit, WGMMAs and their waits, and the register moves at the K loops' ends.

    python scripts/diag/megamoe_sass.py --P 8 --schedule interleaved --precision w8a8 [--out DIR]

The SASS is the active CuTe DSL flavor's (``xstage.cute_compile.dsl_toolkit``); the H200 hosts
run cu13, which a CPU host uses too when both flavors are installed (pyproject.toml). The
consumers' code is what follows ``USETMAXREG.TRY_ALLOC``; a local access between their first
and last WGMMA is a spill in the mainloop, one after it usually per tile (the tile loop's state
or staging addresses reloaded). A K loop's back edge is a backward branch inside the WGMMA span;
moves (``MOV`` / ``IMAD.MOV``) just before it are loop-carried values that ptxas could not keep
in place, and they wait for whatever produced them (ncu showed one waiting on a load of the same
K block: docs/moe-core.md section 5).
"""
from __future__ import annotations

import argparse
import json
import os
import re

# The consumer warpgroups' setmaxnreg: their code follows it, the aux warps' precedes it.
CONSUMER_START = "SETMAXREG.TRY_ALLOC"
_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
_WGMMA = re.compile(r"\b[HQ]GMMA\.")
_LOCAL = re.compile(r"\b(LDL|STL)(\.\w+)*\b")
_MOVE = re.compile(r"^(?:@!?U?P\w+\s+)?(?:IMAD\.MOV(?:\.U32)?|MOV)\s+(R\d+)")


def instructions(sass: str):
    """[(address, instruction text)] of a ``cuobjdump -sass`` listing, in order."""
    return [(int(a, 16), re.sub(r"\s+", " ", t).strip()) for a, t in _INSN.findall(sass)]


def analyze(sass: str, usage: str = "", tail: int = 8) -> dict:
    """The report of one listing (and its ``cuobjdump -res-usage``): see the module docstring.
    ``tail``: instructions before each back edge searched for moves."""
    ins = instructions(sass)
    alloc = next((k for k, (_, t) in enumerate(ins) if CONSUMER_START in t), 0)
    wgmma = [k for k, (_, t) in enumerate(ins) if _WGMMA.search(t)]
    first, last = (wgmma[0], wgmma[-1]) if wgmma else (len(ins), -1)
    local = [k for k, (_, t) in enumerate(ins) if _LOCAL.search(t)]
    back_edges = []
    for k, (addr, t) in enumerate(ins):
        m = re.search(r"\bBRA\s+(?:`\()?(0x[0-9a-f]+)", t)
        if m and first < k <= last + 400 and int(m.group(1), 16) < addr:
            moves = [ins[j][1] for j in range(max(0, k - tail), k) if _MOVE.match(ins[j][1])]
            back_edges.append({"address": hex(addr), "moves_before": moves})
    out = {
        "instructions": len(ins),
        "wgmma": len(wgmma),
        "wgmma_waits": sum(1 for _, t in ins if "WARPGROUP.DEPBAR" in t),
        "local_accesses": {"aux": sum(1 for k in local if k < alloc),
                           "consumers_mainloop": sum(1 for k in local if alloc <= k and first < k < last),
                           "consumers_other": sum(1 for k in local if alloc <= k and not first < k < last)},
        "k_loop_back_edges": back_edges,
    }
    for name in ("REG", "STACK"):
        m = re.search(rf"\b{name}:(\d+)", usage)
        if m:
            out[name.lower()] = int(m.group(1))
    return out


def build_report(P: int, schedule: str, precision: str, tokens: int = 8192, shape: str = "deepseek-v4-flash"):
    """Compile the build (``MegaMoEConfig(schedule, precision=...).resolve(shape, P, tokens, 132)``)
    and return its report, or None without cuobjdump."""
    from megamoe_interleave.config import MegaMoEConfig
    from megamoe_interleave.kernel import compile_megamoe_sm90
    from megamoe_interleave.shapes import get_shape
    from xstage.cute_compile import compiled_sass, dsl_toolkit

    s = get_shape(shape)
    config = MegaMoEConfig(schedule, precision=precision).resolve(s, P, tokens, 132)
    out = compiled_sass(lambda options: compile_megamoe_sm90(s.hidden, s.intermediate, config, options=options))
    if out is None:
        return None
    sass, usage = out
    return {"build": {"shape": shape, "P": P, "tokens": tokens, "schedule": schedule, "precision": precision,
                      "dsl_toolkit": dsl_toolkit(), "config": repr(config)}, **analyze(sass, usage)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--P", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--schedule", nargs="+", default=["interleaved"], choices=["interleaved", "expert_wave"])
    ap.add_argument("--precision", nargs="+", default=["w8a8"], choices=["bf16", "w8a8", "w4a8"])
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per rank the build is resolved for")
    ap.add_argument("--out", default=None, help="directory for megamoe_sass.json")
    args = ap.parse_args(argv)
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    reports = []
    for precision in args.precision:
        for schedule in args.schedule:
            for P in args.P:
                r = build_report(P, schedule, precision, args.tokens)
                if r is None:
                    raise SystemExit("no cuobjdump (CUDA toolkit or triton)")
                reports.append(r)
                moves = sum(len(e["moves_before"]) for e in r["k_loop_back_edges"])
                print(f"{precision} {schedule} P={P} [{r['build']['dsl_toolkit']}]: {r.get('reg')} registers, "
                      f"{r.get('stack')} B stack, local accesses {r['local_accesses']}, {r['wgmma']} WGMMAs / "
                      f"{r['wgmma_waits']} waits, {len(r['k_loop_back_edges'])} K-loop back edges with {moves} "
                      "moves before them")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "megamoe_sass.json"), "w") as f:
            json.dump(reports, f, indent=1)


if __name__ == "__main__":
    main()
