"""Kernels side by side from ncu ``--csv --page details`` exports: one row per metric (section, name,
unit), one column per profiled launch, as a markdown table and a JSON file. ``scripts/gpu_calls.sh ncu``
profiles our W8A8 kernel and DeepGEMM's two GEMMs on the same problem; this sets them next to each other.

    python scripts/diag/megamoe_ncu_metrics.py ours.csv deepgemm.csv [--out DIR]
"""
from __future__ import annotations

import argparse
import csv
import json
import os
from typing import Dict, List, Sequence, Tuple

Column = Tuple[str, str]  # (file label, launch ID)


def read_details(path: str) -> Dict[str, Dict[Tuple[str, str, str], str]]:
    """{launch label: {(section, metric, unit): value}} of one details export (rows before the CSV
    header, such as the profiled program's own output, are skipped)."""
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID",')), None)
    if start is None:
        raise ValueError(f"{path}: no ncu details header (an export of `ncu --csv --page details`?)")
    launches: Dict[str, Dict[Tuple[str, str, str], str]] = {}
    for row in csv.DictReader(lines[start:]):
        if not row.get("Metric Name"):
            continue  # a section's rule rows
        label = f"{row['ID']} {row['Kernel Name'][:40]}"
        launches.setdefault(label, {})[(row["Section Name"], row["Metric Name"], row["Metric Unit"])] = row["Metric Value"]
    return launches


def side_by_side(paths: Sequence[str]) -> Tuple[List[Column], List[Tuple[Tuple[str, str, str], List[str]]]]:
    """(columns, rows): every launch of every file, and each metric's value per column ("" where a
    launch lacks it), metrics in first-seen order."""
    columns, values = [], []
    for path in paths:
        stem = os.path.splitext(os.path.basename(path))[0]
        for label, metrics in read_details(path).items():
            columns.append((stem, label))
            values.append(metrics)
    order = list(dict.fromkeys(k for metrics in values for k in metrics))
    return columns, [(k, [metrics.get(k, "") for metrics in values]) for k in order]


def markdown(columns: List[Column], rows) -> str:
    head = "| section | metric | unit | " + " | ".join(f"{s}: {label}" for s, label in columns) + " |"
    lines = [head, "| --- | --- | --- | " + " | ".join("---:" for _ in columns) + " |"]
    lines += [f"| {sec} | {name} | {unit} | " + " | ".join(v) + " |" for (sec, name, unit), v in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("exports", nargs="+", help="ncu --csv --page details outputs")
    ap.add_argument("--out", default=None, help="folder for ncu_metrics.md and ncu_metrics.json")
    args = ap.parse_args(argv)
    columns, rows = side_by_side(args.exports)
    table = markdown(columns, rows)
    print(table, end="")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "ncu_metrics.md"), "w") as f:
            f.write(table)
        with open(os.path.join(args.out, "ncu_metrics.json"), "w") as f:
            json.dump({"columns": [list(c) for c in columns],
                       "rows": [{"section": s, "metric": m, "unit": u, "values": v} for (s, m, u), v in rows]}, f, indent=1)
