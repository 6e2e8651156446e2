#!/usr/bin/env python
"""Where a kernel's warps stall, by role and by instruction, from ncu's per-SASS source counters:

    ncu --clock-control none --section WarpStateStats --section SourceCounters \\
        --kernel-name regex:MegaMoE --launch-skip 8 --launch-count 1 -o ours \\
        python scripts/diag/megamoe_ncu_driver.py --P 8 --schedule interleaved --option precision=w8a8
    ncu -i ours.ncu-rep --page source --csv --print-source sass | gzip > ours_src.csv.gz
    python scripts/diag/megamoe_ncu_source.py ours_src.csv.gz [--top 20] [--out DIR]

The fused kernel's consumer warpgroups run the code after ``USETMAXREG.TRY_ALLOC`` (their
setmaxnreg); everything before it is the producer, epilogue and Dispatch warps' and the common
prologue. Stall samples are attributed to the instruction a warp waits at, so a stall on
``FMUL`` that multiplies two loaded scales is the load's latency (``long_sb``). An export of
several kernels (ncu repeats the header per kernel) is split into one summary per kernel.
"""
from __future__ import annotations

import argparse
import collections
import csv
import json
import os
import re

from lab.bench import open_text
from lab.megamoe.diag.sass_report import CONSUMER_START

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read_source_kernels(path):
    """[(kernel name, [row dicts])] of an ``ncu --page source --csv`` export (plain or .gz)."""
    with open_text(path) as f:
        rows = list(csv.reader(f))
    kernels, header, name = [], None, None
    for row in rows:
        if row and row[0] == "Kernel Name":
            name, header = row[1], None
            kernels.append((name, []))
        elif row and row[0] == "Address" and name is not None:
            header = row
        elif header is not None and row:
            kernels[-1][1].append(dict(zip(header, row)))
    return kernels


def _int(value) -> int:
    return int(str(value or "0").replace(",", "") or 0)


def opcode(source: str) -> str:
    """The SASS opcode of a source line without predicate and modifiers (``@!P1 LDG.E ...`` -> LDG)."""
    text = re.sub(r"^@!?U?P\w+\s+", "", source.strip())
    return text.split(" ")[0].split(".")[0]


def summarize(rows, top: int = 20):
    """Samples by role (``aux`` before the consumers' setmaxnreg, ``consumer`` from it; one role
    ``all`` without it), per role the share of each stall reason and opcode, and the ``top``
    instructions by samples with their three main reasons."""
    stalls = [k for k in (rows[0] if rows else {}) if k.startswith("stall_") and "Not Issued" not in k]
    split = next((i for i, r in enumerate(rows) if CONSUMER_START in r.get("Source", "")), None)
    roles = {"all": rows} if split is None else {"aux": rows[:split], "consumer": rows[split:]}
    total = sum(_int(r[SAMPLES]) for r in rows) or 1
    out = {"samples": total, "roles": {}}
    for role, rs in roles.items():
        n = sum(_int(r[SAMPLES]) for r in rs) or 1
        reasons = collections.Counter({s[6:]: sum(_int(r.get(s)) for r in rs) for s in stalls})
        ops, executed = collections.Counter(), collections.Counter()
        for r in rs:
            ops[opcode(r["Source"])] += _int(r[SAMPLES])
            executed[opcode(r["Source"])] += _int(r.get(EXECUTED))
        order = sorted(rs, key=lambda r: -_int(r[SAMPLES]))[:top]
        out["roles"][role] = {
            "share_of_samples": round(n / total, 4),
            "stall_reasons": {k: round(v / n, 4) for k, v in reasons.most_common() if v},
            "opcodes": {k: round(v / n, 4) for k, v in ops.most_common(16) if v},
            "executed_warp_instructions": dict(executed.most_common(12)),
            "top_instructions": [{"source": r["Source"].strip(), "share": round(_int(r[SAMPLES]) / n, 4),
                                  "executed": _int(r.get(EXECUTED)),
                                  "reasons": {k: v for v, k in sorted(((_int(r.get(s)), s[6:]) for s in stalls),
                                                                      reverse=True)[:3] if v}}
                                 for r in order],
        }
    return out


def print_summary(name, summary):
    print(f"{name[:100]}: {summary['samples']} samples")
    for role, s in summary["roles"].items():
        pct = lambda d: ", ".join(f"{k} {100 * v:.1f}" for k, v in list(d.items())[:10])  # noqa: E731
        print(f"  {role}: {100 * s['share_of_samples']:.1f} % of the samples")
        print(f"    stall reasons %: {pct(s['stall_reasons'])}")
        print(f"    by opcode %:     {pct(s['opcodes'])}")
        for t in s["top_instructions"]:
            print(f"    {100 * t['share']:5.1f} %  {t['source'][:64]:64s} {t['reasons']}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source_csv", help="ncu -i REPORT --page source --csv --print-source sass (plain or .gz)")
    ap.add_argument("--top", type=int, default=12, help="instructions listed per role")
    ap.add_argument("--out", default=None, help="directory for ncu_source.json")
    args = ap.parse_args(argv)
    summaries = []
    for name, rows in read_source_kernels(args.source_csv):
        s = summarize(rows, args.top)
        print_summary(name, s)
        summaries.append({"kernel": name, **s})
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "ncu_source.json"), "w") as f:
            json.dump({"source": os.path.basename(args.source_csv), "kernels": summaries}, f, indent=1)


if __name__ == "__main__":
    main()
