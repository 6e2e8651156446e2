"""The X-Stage evaluation of MegaMoE on one GPU (paper Section 5.2: Figure 8, Figure 10, Table 2):
a resumable sweep of expert_wave vs interleaved over a grid of cells, with per-tile statistics
and the Burst-Gap model's predictions per cell. The command line is ``scripts/sweep_megamoe.py``
(:func:`main`); the figures, tables and README come from :mod:`lab.megamoe.evaluation`
(``scripts/megamoe_xstage_report.py``).

Cells (:func:`cell_grid`): shape (every :data:`~megamoe_interleave.shapes.SHAPES` entry with known
dimensions) x routing (:data:`ROUTINGS`: balanced, skewed with Zipf strength 1 and 2) x tokens per
rank (2048, 4096, 8192) x world (:data:`WORLDS`) x P (1, 8) x precision ("bf16", "w8a8" / "w4a8": the
fused FP8 kernels; their warm-up output is checked by relative error, :func:`bench.check_w8a8_against`,
W4A8's against the pipeline on its dequantized weights). A cell whose estimated GPU memory (:func:`memory_estimate`) exceeds the budget
(~120 GB) is recorded as skipped with the reason.

Worlds (single process, one GPU, P simulated ranks): ``loopback`` stores the Combine into device
memory (no remote path: the control, no X-Stage prediction); ``loopback+host`` puts only the
Combine destinations in pinned host memory, so the remote stores cross PCIe: the calibrated
``h200-pcie-host`` path (:data:`PLATFORM_OF_WORLD`).

Per cell (:class:`GpuRunner`):

1. inputs (the weights are made once per shape), the unfused pipeline's outputs;
2. per schedule a MegaMoE with ``MegaMoEConfig(schedule)`` (every other field resolved by
   MegaMoE), one untimed warm-up ``forward`` whose output is checked against the unfused
   pipeline (:func:`lab.megamoe.bench.check_against`);
3. ``trials`` paired trials (:func:`lab.bench.paired_trials`): one call of each schedule per
   trial, in an order rotated per cell (its position in the grid) and per trial, the SM clock
   after each; a call's time is ``moe.last_kernel_us`` of ``MegaMoE.rerun()``: the device time
   of the fused kernels of every rank, launched back to back on the one GPU -- the *world's*
   time, not a max over ranks (:data:`TIME_SCOPE`);
4. the paired, clock-matched speedup T_expert_wave / T_interleaved (median of the per-trial
   ratios) and both one-sided sign tests (:func:`compare_schedules`);
5. per schedule the traced kernel (``MegaMoE.set_trace``): one untimed traced call, then
   ``trace_trials`` paired trials traced vs untraced on the same object (the trace's overhead,
   :func:`trace_overhead`); the last traced call's per-tile records of every rank reduced to
   :func:`trace_statistics` (T_RS, mainloops, measured and predicted stall);
6. the model's predictions (:func:`cell_model`: :func:`xstage.planner.plan_megamoe` with the
   measured mainloop medians and the world's platform profile).

Per-tile definitions (trace fields, :data:`megamoe_interleave.config.TRACE_FIELDS`, all ns):
T_RS of an L2 tile = ``rs_ns`` (the epilogue warps' issue span of its Combine stores, paper
Section 5.2.3); its mainloop = ``t_mainloop - t_ready`` (first ring stage landed -> last WGMMA
retired: the paper's full-tile mainloop); its successor = the next tile of the same CTA of the
same rank (L1 or L2: "mixed cycles use the actual successor"); the **measured stall** = the
successor's ``t_slot - t_mainloop``: after its mainloop the consumers wait for the one staging
slot, which the epilogue warps free once the tile's stores are issued (and the successor's row
metadata written) -- the Hopper counterpart of the paper's MMA-side wait for a staging slot at
tile entry (``tmem_empty``); the **predicted stall** = eq. 15, [T_RS - T_mma(successor)]+
(:func:`xstage.model.critical_path_stall`). L2 tiles without a successor (a CTA's last) are not
sampled.

Output: one JSON (every cell's record, keyed by its fields; ``runs`` holds each run's
provenance) and one CSV (a flat row per cell, :func:`flat_row`) written after every cell; a run
with ``resume`` skips the cells the JSON already holds (errors are retried).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import gzip
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional, Sequence

from lab import bench as xbench
from lab import paired
from lab.multigpu import quantile
from megamoe_interleave.config import BLOCK_M, MegaMoEConfig
from megamoe_interleave.scheduler import PHASE_L1, PHASE_L2, SCHEDULES
from megamoe_interleave.shapes import SHAPES, get_shape
from xstage import model, planner, profiles, provenance

SCHEMA = "megamoe-xstage-sweep/1"
DEFAULT_OUT = "results/h200/megamoe/xstage/sweep.json.gz"

# routing label -> (make_routing kind, Zipf strength; None: not used)
ROUTINGS = {"balanced": ("balanced", None), "skewed1": ("skewed", 1.0), "skewed2": ("skewed", 2.0)}
TOKENS = (2048, 4096, 8192)
WORLDS = ("loopback", "loopback+host")
PS = (1, 8)
PRECISIONS = ("bf16", "w8a8", "w4a8")
DEFAULT_PRECISIONS = ("bf16",)  # the default grid; W8A8 / W4A8 cells join with --precision
# the platform profile of each world's remote path (None: no remote path, no prediction)
PLATFORM_OF_WORLD = {w: profiles.PROFILE_OF_PLACEMENT[w] for w in ("loopback", "loopback+host")}
NO_PREDICTION = ("loopback: the Combine stores go to device memory, no remote path -- the control; "
                 "no X-Stage prediction")
TIME_SCOPE = ("world: the fused kernels of all P simulated ranks, launched back to back on one GPU "
              "(MegaMoE.last_kernel_us of one rerun); not a max over ranks")
BASELINE = "interleaved"  # the paired comparison's baseline: speedup = T_expert_wave / T_interleaved
KEY_FIELDS = ("shape", "routing", "tokens", "world", "P", "precision")
QUANTILES = tuple(range(101))  # percent points of the stored T_RS distributions

# Memory (bytes): the budget the brief gives for one H200 (139 GiB), the pinned host memory the
# loopback+host Combine slots may take, and a fixed allowance (CUDA context, allocator slack).
GPU_BUDGET = 120e9
HOST_BUDGET = 64e9
ALLOWANCE = 2e9

# Time estimate: fused-kernel call of DeepSeek-V4-Flash at 8192 tokens per rank, loopback
# (results/h200/megamoe/README.md, kernel rate: 4.77 ms at P = 1, 29.0 ms at P = 8), scaled by
# FLOPs; the loopback+host call is at least the Combine volume over the PCIe drain rate.
REF_SHAPE, REF_TOKENS = "deepseek-v4-flash", 8192
REF_CALL_S = {1: 4.77e-3, 8: 29.0e-3}
REFERENCE_CALLS = 2.5  # the unfused pipeline, in fused calls (10.4 vs 4.77 ms at P = 1, 80 vs 29 at P = 8)
HOST_CALL_S = 1e-3  # host side of a rerun (launches, the error-word read-back) beyond the kernels
COMPILE_S = 5.0  # one CuTe DSL compile of the fused kernel (2-3 s on a CPU here; a guess for the GPU host)
WEIGHTS_S = 3.0  # weights of one shape on the GPU (CUDA generator) and the kernel-layout copy
CELL_S = 1.0  # inputs, builds, clean-up per cell ...
CELL_RANK_S = 0.25  # ... plus per simulated rank (routing, trace decoding)
HOST_PIN_RATE = 4e9  # bytes/s of pinning the loopback+host Combine slots (cudaHostAlloc; a guess)

# A reduced grid, 24 cells per world, estimated ~6.5 minutes of GPU time (:func:`estimate_seconds`;
# ``--preset reduced``): four shapes that differ in H, I, E and k (DeepSeek-V4-Pro: the paper's
# negative control), every routing, P = 8, 2048 and 4096 tokens per rank (DeepSeek-V4-Pro at 8192
# is within 0.5 GB of the memory budget).
REDUCED = dict(shapes=("deepseek-v4-flash", "deepseek-v4-pro", "mimo-v2-flash", "deepseek-r1"),
               routing=tuple(ROUTINGS), tokens=(2048, 4096), P=(8,), worlds=WORLDS)


# ----------------------------------------------------------------------------- cells


@dataclass(frozen=True)
class Cell:
    """One configuration of the sweep; its fields (:data:`KEY_FIELDS`) are its key."""

    shape: str
    routing: str
    tokens: int
    world: str
    P: int
    precision: str = "bf16"

    def __post_init__(self):
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {tuple(ROUTINGS)}, got {self.routing!r}")
        if self.world not in WORLDS:
            raise ValueError(f"world must be one of {WORLDS}, got {self.world!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        for name in ("tokens", "P"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")

    @property
    def kind(self) -> str:
        return ROUTINGS[self.routing][0]

    @property
    def strength(self) -> Optional[float]:
        return ROUTINGS[self.routing][1]

    def key(self) -> tuple:
        return tuple(getattr(self, f) for f in KEY_FIELDS)

    def as_dict(self) -> dict:
        return {f: getattr(self, f) for f in KEY_FIELDS}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Cell":
        return cls(**{f: d[f] for f in KEY_FIELDS})

    @property
    def label(self) -> str:
        return f"{self.shape} {self.routing} T={self.tokens} {self.world} P={self.P} {self.precision}"


def known_shapes() -> list:
    """Names of the shapes with known dimensions, in :data:`SHAPES` order."""
    return [name for name, s in SHAPES.items() if s.known]


def cell_grid(shapes=None, routings=None, tokens=None, worlds=None, Ps=None, precisions=None) -> list:
    """The cells of the product (None = every value: :func:`known_shapes`, :data:`ROUTINGS`,
    :data:`TOKENS`, :data:`WORLDS`, :data:`PS`; precisions :data:`DEFAULT_PRECISIONS`), ordered shape-major (one
    shape's weights serve a run of cells), then P, tokens, routing, world. Unknown shapes (or
    ones without dimensions) raise."""
    shapes = known_shapes() if shapes is None else list(shapes)
    for name in shapes:
        get_shape(name)  # KeyError / ValueError for unknown names or dimensions
    axes = (shapes, PS if Ps is None else Ps, TOKENS if tokens is None else tokens,
            tuple(ROUTINGS) if routings is None else routings, WORLDS if worlds is None else worlds,
            DEFAULT_PRECISIONS if precisions is None else precisions)
    out = [Cell(shape=s, routing=r, tokens=t, world=w, P=p, precision=q)
           for s, p, t, r, w, q in itertools.product(*axes)]
    if len(set(c.key() for c in out)) != len(out):
        raise ValueError("the grid repeats a cell (a value given twice)")
    return out


# ----------------------------------------------------------------------------- memory


def memory_estimate(shape, P: int, tokens: int, world: str, *, n_moes: int = 2) -> dict:
    """Estimated peak memory of one cell in bytes (what :class:`GpuRunner` allocates, in its
    order). Device: the global bf16 weights (3 E H I x 2), the inputs, then

    * reference phase: the unfused pipeline's [k, T, H] slots per rank and one destination
      rank's intermediates (rows, h, the SwiGLU in fp32, the L2 output: (4 H + 22 I) bytes per
      row), bounded by every pick landing on one rank (P T k rows; skewed routing comes close);
    * MegaMoE phase: the kernel-layout w1 copy (2 E I H x 2; w2 is used in place), the unfused
      pipeline's y (kept for the checks), and per MegaMoE (``n_moes``, both schedules alive):
      its symmetric buffers (x, routing; the [k, T, H] Combine slots unless loopback+host puts
      them in pinned host memory), the pool and h scratch ((P T k + P BLOCK_M) (H + I) x 2) and
      its output y.

    ``gpu_bytes`` = the larger phase + :data:`ALLOWANCE`; ``host_pinned_bytes`` = the pinned
    Combine slots (loopback+host)."""
    E, H, I, k = shape.num_experts, shape.hidden, shape.intermediate, shape.topk
    T, bf16 = tokens, 2
    picks = P * T * k
    weights = 3 * E * H * I * bf16
    inputs = P * T * (H * bf16 + k * 12)  # x, int64 ids, fp32 weights
    combine = P * k * T * H * bf16
    out_y = P * T * H * bf16
    reference = combine + picks * (4 * H + 22 * I)
    on_host = world == "loopback+host"
    per_moe = inputs + (0 if on_host else combine) + (picks + P * BLOCK_M) * (H + I) * bf16 + out_y
    kernel_w1 = 2 * E * I * H * bf16
    ref_phase = weights + inputs + reference
    moe_phase = weights + inputs + kernel_w1 + out_y + n_moes * per_moe
    return dict(weights_bytes=weights, kernel_w1_bytes=kernel_w1, inputs_bytes=inputs,
                reference_phase_bytes=ref_phase, per_moe_bytes=per_moe, moe_phase_bytes=moe_phase,
                gpu_bytes=max(ref_phase, moe_phase) + ALLOWANCE,
                host_pinned_bytes=n_moes * combine if on_host else 0)


def skip_reason(cell: Cell, gpu_budget: float = GPU_BUDGET, host_budget: float = HOST_BUDGET,
                n_moes: int = 2) -> Optional[str]:
    """Why ``cell`` cannot run (None: it can): the experts do not split over P, or its
    :func:`memory_estimate` with ``n_moes`` layers alive (3 with ``--with-auto``) exceeds a budget."""
    shape = get_shape(cell.shape)
    if shape.num_experts % cell.P:
        return f"num_experts {shape.num_experts} not divisible by P={cell.P}"
    m = memory_estimate(shape, cell.P, cell.tokens, cell.world, n_moes=n_moes)
    if m["gpu_bytes"] > gpu_budget:
        return (f"estimated GPU memory {m['gpu_bytes'] / 1e9:.1f} GB > budget {gpu_budget / 1e9:.0f} GB "
                f"(weights {m['weights_bytes'] / 1e9:.1f} + kernel-layout w1 {m['kernel_w1_bytes'] / 1e9:.1f} "
                f"+ {n_moes} x {m['per_moe_bytes'] / 1e9:.1f} per MegaMoE; reference phase "
                f"{m['reference_phase_bytes'] / 1e9:.1f})")
    if m["host_pinned_bytes"] > host_budget:
        return f"estimated pinned host memory {m['host_pinned_bytes'] / 1e9:.1f} GB > budget {host_budget / 1e9:.0f} GB"
    return None


# ----------------------------------------------------------------------------- time estimate


def _flops(shape, P: int, tokens: int) -> float:
    return P * tokens * shape.topk * shape.flops_per_token_pick()


def call_seconds(cell: Cell, pcie_rate: Optional[float] = None) -> float:
    """Estimated fused call (every rank's kernels) of ``cell``: :data:`REF_CALL_S` scaled by
    FLOPs (P > 1 at the P = 8 rate); loopback+host at least the Combine volume over the PCIe
    drain rate (``pcie_rate``, default: the h200-pcie-host profile's R)."""
    shape, ref = get_shape(cell.shape), get_shape(REF_SHAPE)
    p_ref = 1 if cell.P == 1 else 8
    t = REF_CALL_S[p_ref] * _flops(shape, cell.P, cell.tokens) / _flops(ref, p_ref, REF_TOKENS)
    if cell.world == "loopback+host":
        rate = pcie_rate if pcie_rate is not None else profiles.load(PLATFORM_OF_WORLD[cell.world]).R
        t = max(t, cell.P * cell.tokens * shape.topk * shape.hidden * 2 / rate)
    return t


def kernel_keys(cell: Cell, trace: bool = True, num_sms: int = 132) -> set:
    """The compile-cache keys of the fused kernels ``cell`` runs (both schedules, traced and
    untraced), as MegaMoE resolves them on ``num_sms`` SMs: each new one costs a compile."""
    shape = get_shape(cell.shape)
    keys = set()
    for sched in SCHEDULES:
        config = MegaMoEConfig(sched, precision=cell.precision).resolve(shape, cell.P, cell.tokens, num_sms)
        for traced in ((False, True) if trace else (False,)):
            keys.add((shape.hidden, shape.intermediate, dataclasses.replace(config, trace=traced).kernel_key()))
    return keys


def compile_cells(cells: Sequence[Cell], trace: bool = True, num_sms: int = 132, file=None) -> int:
    """Compile the fused kernels of ``cells`` (:func:`kernel_keys`) into ``XSTAGE_KERNEL_CACHE``, with
    no GPU: a GPU host given the same cache loads them instead of compiling (scripts/gpu_calls.sh
    precompile). Returns the number of kernels."""
    from megamoe_interleave.kernel import compiled_megamoe_sm90
    from xstage.cute_compile import KERNEL_CACHE_ENV

    if not os.environ.get(KERNEL_CACHE_ENV):
        raise ValueError(f"compiling ahead keeps the kernels for the GPU run: set {KERNEL_CACHE_ENV}")
    keys = sorted(set().union(*(kernel_keys(c, trace, num_sms) for c in cells)), key=repr)
    for i, (hidden, intermediate, config) in enumerate(keys):
        print(f"compile {i + 1}/{len(keys)}: {config.precision} {config.schedule} H {hidden} I {intermediate}"
              f"{' traced' if config.trace else ''}", file=file or sys.stdout, flush=True)
        compiled_megamoe_sm90(hidden, intermediate, config)
    return len(keys)


def calls_per_cell(trials: int, trace_trials: int, trace: bool = True) -> float:
    """Fused calls of one cell: two warm-ups, the unfused reference (:data:`REFERENCE_CALLS`),
    ``trials`` of each schedule and, per schedule, an untraced and a traced warm-up plus
    ``trace_trials`` of each (traced and untraced)."""
    return 2 + REFERENCE_CALLS + 2 * trials + (2 * (2 + 2 * trace_trials) if trace else 0)


def estimate_seconds(cells: Sequence[Cell], trials: int = 20, trace_trials: int = 5, trace: bool = True,
                     pcie_rate: Optional[float] = None) -> dict:
    """Estimated GPU-host time of running ``cells`` in one process: per cell
    :func:`calls_per_cell` x (:func:`call_seconds` + :data:`HOST_CALL_S`) + :data:`CELL_S` +
    :data:`CELL_RANK_S` P (+ the pinned Combine slots at :data:`HOST_PIN_RATE`); :data:`COMPILE_S` per distinct kernel (:func:`kernel_keys`),
    :data:`WEIGHTS_S` per shape. Returns the total and its split per world."""
    if pcie_rate is None and any(c.world == "loopback+host" for c in cells):
        pcie_rate = profiles.load(PLATFORM_OF_WORLD["loopback+host"]).R
    calls = calls_per_cell(trials, trace_trials, trace)
    per_world, keys, shapes = {}, set(), set()
    for c in cells:
        s = calls * (call_seconds(c, pcie_rate) + HOST_CALL_S) + CELL_S + CELL_RANK_S * c.P
        s += memory_estimate(get_shape(c.shape), c.P, c.tokens, c.world)["host_pinned_bytes"] / HOST_PIN_RATE
        w = per_world.setdefault(c.world, {"cells": 0, "seconds": 0.0})
        w["cells"] += 1
        w["seconds"] += s
        keys |= kernel_keys(c, trace)
        shapes.add(c.shape)
    fixed = COMPILE_S * len(keys) + WEIGHTS_S * len(shapes)
    return {"cells": len(cells), "calls_per_cell": calls, "compiles": len(keys), "shapes": len(shapes),
            "fixed_seconds": fixed, "per_world": per_world,
            "total_seconds": fixed + sum(w["seconds"] for w in per_world.values())}


# ----------------------------------------------------------------------------- statistics (CPU)


def distribution(values: Iterable[float], quantiles: bool = False) -> dict:
    """n, median, p10, p90, p99, max, mean of ``values`` (None entries when empty); with
    ``quantiles`` also the :data:`QUANTILES` percent points (the stored T_RS distributions)."""
    v = sorted(float(x) for x in values)
    if not v:
        out = dict(n=0, median=None, p10=None, p90=None, p99=None, max=None, mean=None)
        if quantiles:
            out["quantiles"] = None
        return out
    out = dict(n=len(v), median=statistics.median(v), p10=quantile(v, 0.10), p90=quantile(v, 0.90),
               p99=quantile(v, 0.99), max=v[-1], mean=statistics.fmean(v))
    if quantiles:  # (v is sorted: quantile's own sort is then linear)
        out["quantiles"] = [quantile(v, q / 100) for q in QUANTILES]
    return out


def mainloop_ns(rec: Mapping) -> int:
    """A tile's mainloop: first ring stage landed -> last WGMMA retired."""
    return rec["t_mainloop"] - rec["t_ready"]


def slot_wait_ns(rec: Mapping) -> int:
    """The consumers' wait for the staging slot after a tile's mainloop (its first part)."""
    return rec["t_slot"] - rec["t_mainloop"]


def l2_samples(recs_by_rank: Mapping[int, Sequence[Sequence[Mapping]]]) -> list:
    """Per L2 tile with a successor (the next tile of its CTA on its rank): (T_RS, the
    successor's phase, its mainloop = the cover window T_cover^mma, the measured stall = its
    slot wait, the predicted stall = eq. 15), all ns."""
    out = []
    for ctas in recs_by_rank.values():
        for cta in ctas:
            for tile, succ in zip(cta, cta[1:]):
                if tile["phase"] != PHASE_L2:
                    continue
                t_rs, cover = max(0, tile["rs_ns"]), max(0, mainloop_ns(succ))
                out.append(dict(t_rs=t_rs, successor=succ["phase"], cover=cover, measured=slot_wait_ns(succ),
                                predicted=model.critical_path_stall(float(t_rs), float(cover))))
    return out


def trace_statistics(recs_by_rank: Mapping[int, Sequence[Sequence[Mapping]]]) -> dict:
    """Per-tile statistics of one traced call (``{rank: api.decode_trace(...)}``), ns: tile
    counts; the L1 and L2 mainloop distributions; T_RS of the L2 tiles (with :data:`QUANTILES`:
    Figure 10) and the L1 tiles' h-store span (local stores); over the L2 tiles with a successor
    (:func:`l2_samples`) the measured and the predicted stall (Table 2), the share predicted
    zero, the median overprediction and the medians per successor phase."""
    tiles = [t for ctas in recs_by_rank.values() for cta in ctas for t in cta]
    l1 = [t for t in tiles if t["phase"] == PHASE_L1]
    l2 = [t for t in tiles if t["phase"] == PHASE_L2]
    samples = l2_samples(recs_by_rank)
    by_succ = {}
    for name, phase in (("L1", PHASE_L1), ("L2", PHASE_L2)):
        s = [x for x in samples if x["successor"] == phase]
        by_succ[name] = dict(n=len(s), measured_median=statistics.median([x["measured"] for x in s]) if s else None,
                             predicted_median=statistics.median([x["predicted"] for x in s]) if s else None)
    return dict(
        ranks=len(recs_by_rank), ctas=sum(len(c) for c in recs_by_rank.values()), l1_tiles=len(l1), l2_tiles=len(l2),
        l1_mainloop_ns=distribution(mainloop_ns(t) for t in l1),
        l2_mainloop_ns=distribution(mainloop_ns(t) for t in l2),
        rs_ns=distribution((t["rs_ns"] for t in l2), quantiles=True),
        l1_store_ns=distribution(t["rs_ns"] for t in l1),
        stall=dict(
            sampled=len(samples), without_successor=len(l2) - len(samples),
            measured_ns=distribution(x["measured"] for x in samples),
            predicted_ns=distribution(x["predicted"] for x in samples),
            cover_ns=distribution(x["cover"] for x in samples),
            predicted_zero_frac=(sum(x["predicted"] == 0 for x in samples) / len(samples)) if samples else None,
            overprediction_ns_median=statistics.median([x["predicted"] - x["measured"] for x in samples])
            if samples else None,
            by_successor=by_succ,
        ),
    )


def compare_schedules(samples: Mapping, clocks: Mapping, tol_mhz: float = 30.0, min_matched: int = 5) -> dict:
    """The paired, clock-matched comparison of one cell (``samples``/``clocks``: schedule ->
    list per trial, :func:`lab.bench.paired_trials`): speedup = the median over the matched
    trials of T_expert_wave / T_interleaved (> 1: interleaved faster), the schedules' medians,
    both one-sided sign tests and a verdict: "interleaved faster" / "interleaved slower" (the
    sign test passes at alpha = 0.05), "no significant difference", or "inconclusive" (fewer than
    ``min_matched`` trials at the reference clock). ``paired`` keeps
    :func:`lab.bench.paired_verdicts`'s row (the samples and clocks)."""
    row = xbench.paired_verdicts(dict(samples), dict(clocks), BASELINE, tol_mhz, min_matched)
    v = row["variants"]["expert_wave"]
    il_faster, il_slower = v["slower"], v["faster"]  # expert_wave slower than interleaved = interleaved faster
    if v["n_matched"] < min_matched:
        verdict = "inconclusive"
    elif il_faster["verdict"] == "pass":
        verdict = "interleaved faster"
    elif il_slower["verdict"] == "pass":
        verdict = "interleaved slower"
    else:
        verdict = "no significant difference"
    return dict(speedup=v.get("median_ratio"), verdict=verdict, n_trials=il_faster["n_trials"], n_matched=v["n_matched"],
                expert_wave_median_us=v.get("median_us"), interleaved_median_us=v.get("baseline_median_us"),
                p_interleaved_faster=il_faster.get("sign_test_p"), p_interleaved_slower=il_slower.get("sign_test_p"),
                reference_clock_mhz=row["reference_clock_mhz"], paired=row)


def compare_auto(samples: Mapping, clocks: Mapping, pick: str, tol_mhz: float = 30.0, min_matched: int = 5) -> dict:
    """``schedule="auto"`` measured in a cell (``--with-auto``: a third variant in the same paired
    trials): the schedule it picked, and per fixed schedule the median per-trial ratio auto / that
    schedule over their clock-matched trials; ``over_better`` = the ratio to the faster one
    (> 1.01: auto more than 1 % slower)."""
    out = dict(pick=pick)
    for base in SCHEDULES:
        row = xbench.paired_verdicts({k: samples[k] for k in (base, "auto")}, {k: clocks[k] for k in (base, "auto")},
                                     base, tol_mhz, min_matched)
        v = row["variants"]["auto"]
        out[f"over_{base}"], out[f"n_matched_{base}"] = v.get("median_ratio"), v["n_matched"]
    ratios = [out[f"over_{b}"] for b in SCHEDULES if out[f"over_{b}"] is not None]
    out["over_better"] = max(ratios) if ratios else None
    return out


def trace_overhead(samples: Mapping, clocks: Mapping, tol_mhz: float = 30.0, min_matched: int = 5) -> dict:
    """Traced vs untraced kernel time of one schedule of one cell (paired trials of
    ``untraced`` and ``traced``): ratio = the median per-trial traced / untraced."""
    row = xbench.paired_verdicts(dict(samples), dict(clocks), "untraced", tol_mhz, min_matched)
    v = row["variants"]["traced"]
    return dict(ratio=v.get("median_ratio"), traced_median_us=v.get("median_us"),
                untraced_median_us=v.get("baseline_median_us"), n_matched=v["n_matched"],
                traced_slower=v["slower"]["verdict"], paired=row)


def cell_model(cell: Cell, shape, block_n: int, lead: Optional[int], wave_trace: Optional[Mapping],
               load_profile: Callable = profiles.load) -> dict:
    """The Burst-Gap model's predictions for ``cell``: :func:`xstage.planner.plan_megamoe` on the
    world's platform profile (:data:`PLATFORM_OF_WORLD`; loopback: none, no prediction) with the
    expert_wave trace's mainloop medians (``wave_trace``: :func:`trace_statistics`; without them
    the planner estimates them from the profile's dense rate). n1/n2 (tile mix), the gaps
    G_wave / G_int (eq. 12), the residual overheads ΔT_iss^wave / ΔT_iss^int (eq. 9 / 13), eq. 14,
    D_knee (eq. 16) next to the lead the interleaved config runs, and the spans the model
    predicts, T_RS ≈ T_iss0 + ΔT_iss, per schedule (worst aligned case: K = num_sms)."""
    name = PLATFORM_OF_WORLD[cell.world]
    if name is None:
        return dict(platform=None, note=NO_PREDICTION)
    t1 = t2 = None
    if wave_trace:
        t1, t2 = wave_trace["l1_mainloop_ns"]["median"], wave_trace["l2_mainloop_ns"]["median"]
    measured = bool(t1) and bool(t2)
    plan = planner.plan_megamoe(load_profile(name), hidden=shape.hidden, intermediate=shape.intermediate,
                                experts=shape.num_experts, topk=shape.topk, tokens=cell.tokens, world=cell.P,
                                block_n=block_n, out_bytes=2, t_l1_mma=t1 * 1e-9 if measured else None,
                                t_l2_mma=t2 * 1e-9 if measured else None)
    us = 1e6
    return dict(
        platform=name, producers=plan.producers, n1=plan.n1, n2=plan.n2, block_n=block_n,
        tile_volume_bytes=plan.tile_volume_bytes, volume_bytes=plan.volume_bytes,
        mma_source="measured: expert_wave trace medians" if measured else plan.mma_source,
        t_l1_mma_us=plan.t_l1_mma_s * us, t_l2_mma_us=plan.t_l2_mma_s * us, t_iss0_us=plan.t_iss0_s * us,
        recovery_gap_us=plan.recovery_gap_s * us, wave_gap_us=plan.wave_gap_s * us,
        interleaved_gap_us=plan.interleaved_gap_s * us, wave_overhead_us=plan.wave_overhead_s * us,
        interleaved_overhead_us=plan.interleaved_overhead_s * us, wave_rate_ratio=plan.wave_rate_ratio,
        interleaved_rate_ratio=plan.interleaved_rate_ratio, interleave_sufficient=plan.interleave_sufficient,
        capacity_ok=plan.capacity_ok, d_knee_rows=plan.d_knee_rows, lead_rows=lead,
        predicted_rs_wave_us=(plan.t_iss0_s + plan.wave_overhead_s) * us,
        predicted_rs_interleaved_us=(plan.t_iss0_s + plan.interleaved_overhead_s) * us,
        verdict=plan.verdict, reasons=plan.reasons)


# ----------------------------------------------------------------------------- records, files


def _get(d, *path):
    for p in path:
        if not isinstance(d, Mapping) or d.get(p) is None:
            return None
        d = d[p]
    return d


def flat_row(rec: Mapping) -> dict:
    """One CSV row of a cell's record: its key, status, the paired comparison, per schedule the
    span / mainloop / stall medians (us) and the trace's overhead, the model's predictions."""
    row = dict(rec["cell"])
    row.update(routing_kind=rec.get("routing_kind"), strength=rec.get("strength"), status=rec.get("status"),
               reason=rec.get("reason") or rec.get("error"))
    t = rec.get("timing") or {}
    for k in ("speedup", "verdict", "expert_wave_median_us", "interleaved_median_us", "n_trials", "n_matched",
              "p_interleaved_faster", "p_interleaved_slower", "reference_clock_mhz"):
        row[k] = t.get(k)
    a = rec.get("auto") or {}
    for k in ("pick", "over_expert_wave", "over_interleaved", "over_better", "n_matched_expert_wave",
              "n_matched_interleaved"):
        row[f"auto_{k}"] = a.get(k)
    us = lambda v: None if v is None else v / 1e3  # noqa: E731
    for sched, tag in (("expert_wave", "ew"), ("interleaved", "il")):
        s = _get(rec, "schedules", sched) or {}
        tr = s.get("trace") or {}
        row[f"rs_median_us_{tag}"] = us(_get(tr, "rs_ns", "median"))
        row[f"rs_p90_us_{tag}"] = us(_get(tr, "rs_ns", "p90"))
        row[f"l1_mainloop_us_{tag}"] = us(_get(tr, "l1_mainloop_ns", "median"))
        row[f"l2_mainloop_us_{tag}"] = us(_get(tr, "l2_mainloop_ns", "median"))
        row[f"stall_measured_us_{tag}"] = us(_get(tr, "stall", "measured_ns", "median"))
        row[f"stall_predicted_us_{tag}"] = us(_get(tr, "stall", "predicted_ns", "median"))
        row[f"trace_overhead_{tag}"] = _get(s, "trace_overhead", "ratio")
        for k in ("block_n", "stages", "dispatch_copy"):
            row[f"{k}_{tag}"] = _get(s, "config", k)
    m = rec.get("model") or {}
    row["platform"] = m.get("platform")
    for k in ("n1", "n2", "wave_gap_us", "interleaved_gap_us", "wave_overhead_us", "interleaved_overhead_us",
              "interleave_sufficient", "d_knee_rows", "lead_rows", "predicted_rs_wave_us",
              "predicted_rs_interleaved_us", "verdict"):
        row[f"model_{k}"] = m.get(k)
    gpu = _get(rec, "memory", "gpu_bytes")
    row["gpu_gb_estimate"] = None if gpu is None else round(gpu / 1e9, 1)
    row["wall_s"] = rec.get("wall_s")
    return row


def new_payload(meta: Optional[Mapping] = None) -> dict:
    return {"schema": SCHEMA, "description": "MegaMoE X-Stage sweep: expert_wave vs interleaved per cell "
            "(lab.megamoe.sweep)", "time_scope": TIME_SCOPE, "baseline": BASELINE,
            "meta": dict(meta or {}), "runs": [], "cells": []}


def load_sweep(path) -> dict:
    """A sweep JSON (:func:`run_sweep`'s output; ``.json.gz``: gzip-compressed, as committed)."""
    path = Path(path)
    with xbench.open_text(path) as f:
        data = json.load(f)
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a {SCHEMA} file (schema {data.get('schema')!r})")
    return data


def sweep_csv_path(path) -> Path:
    """The CSV next to a sweep JSON: ``sweep.json`` / ``sweep.json.gz`` -> ``sweep.csv``."""
    path = Path(path)
    stem = path.name[: -len(".gz")] if path.suffix == ".gz" else path.name
    return path.with_name(Path(stem).with_suffix(".csv").name)


def write_sweep(path, payload: Mapping) -> Path:
    """The JSON (with provenance; gzip-compressed when the name ends in ``.gz``; written to a
    temporary file, then renamed: a run killed while writing leaves the previous file) and the
    CSV (:func:`flat_row` per cell) next to it."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    xbench.write_json(tmp, dict(payload))
    if path.suffix == ".gz":
        tmp.write_bytes(gzip.compress(tmp.read_bytes(), mtime=0))
    os.replace(tmp, path)
    xbench.write_csv(sweep_csv_path(path), [flat_row(r) for r in payload["cells"]])
    return path


def run_sweep(cells: Sequence[Cell], out, runner: Callable[[Cell, int], dict], *, resume: bool = True,
              meta: Optional[Mapping] = None, gpu_budget: float = GPU_BUDGET, host_budget: float = HOST_BUDGET,
              stop_on_error: bool = False, bar: Optional[bool] = None, n_moes: int = 2) -> dict:
    """Run ``runner(cell, position)`` for every cell of ``cells`` not yet measured in ``out``
    (with ``resume``; a cell recorded as an error runs again, a skipped one is planned again),
    recording a skip (:func:`skip_reason` with ``n_moes`` layers per cell) instead where it cannot run; ``out`` (JSON and CSV) is written after every cell. ``position``
    is the cell's index in ``cells`` (the paired trials rotate the schedules' order by it). A
    runner's exception is recorded as the cell's error (``stop_on_error``: re-raised after
    recording); ``runner.release()``, when it exists, runs after every cell (memory freed).
    Returns the payload."""
    path = Path(out)
    payload = load_sweep(path) if resume and path.exists() else new_payload(meta)
    if meta is not None:
        payload["meta"] = dict(meta)
    index = {Cell.from_dict(r["cell"]).key(): i for i, r in enumerate(payload["cells"])}
    done = {k for k, i in index.items() if payload["cells"][i]["status"] == "ok"}
    todo = [(i, c) for i, c in enumerate(cells) if c.key() not in done]
    xbench.log(f"sweep: {len(cells)} cells, {len(cells) - len(todo)} already measured in {path}, {len(todo)} to go")
    payload["runs"].append({"provenance": provenance.collect(), "meta": dict(meta or {}), "cells_to_run": len(todo)})
    run = len(payload["runs"]) - 1
    for pos, cell in xbench.progress(todo, desc="megamoe sweep", total=len(todo), enabled=bar):
        rec = {"cell": cell.as_dict(), "routing_kind": cell.kind, "strength": cell.strength, "run": run,
               "position": pos, "memory": memory_estimate(get_shape(cell.shape), cell.P, cell.tokens, cell.world,
                                                          n_moes=n_moes)}
        reason = skip_reason(cell, gpu_budget, host_budget, n_moes)
        error = None
        if reason is not None:
            rec.update(status="skipped", reason=reason)
            xbench.log(f"{cell.label}: skipped: {reason}")
        else:
            t0 = time.monotonic()
            try:
                rec.update(runner(cell, pos))
                rec["status"] = "ok"
                t = rec.get("timing") or {}
                xbench.log(f"{cell.label}: speedup {t.get('speedup')} ({t.get('verdict')})")
            except Exception as e:  # recorded; the sweep goes on (or stops with stop_on_error)
                error = e if stop_on_error else None  # (a kept exception keeps the cell's tensors alive)
                rec.update(status="error", error=f"{type(e).__name__}: {e}",
                           traceback=traceback.format_exc(limit=8))
                xbench.log(f"{cell.label}: error: {type(e).__name__}: {e}")
            finally:
                release = getattr(runner, "release", None)
                if release is not None:
                    release()
                rec["wall_s"] = time.monotonic() - t0  # (calibrates estimate_seconds)
        if cell.key() in index:
            payload["cells"][index[cell.key()]] = rec
        else:
            index[cell.key()] = len(payload["cells"])
            payload["cells"].append(rec)
        write_sweep(path, payload)
        if error is not None and stop_on_error:
            raise error
    return payload


# ----------------------------------------------------------------------------- the GPU runner


class GpuRunner:
    """Measures one cell on the GPU (the module docstring's steps 1-6); the weights of the last
    shape stay on the GPU for the next cell of that shape (:meth:`release` frees the rest)."""

    def __init__(self, *, trials: int = 20, trace: bool = True, trace_trials: int = 5, clock_tol_mhz: float = 30.0,
                 min_matched: int = 5, cooldown_s: float = 0.0, weight_rng: str = "cuda", with_auto: bool = False):
        if trials < 1 or trace_trials < 0:
            raise ValueError("trials must be >= 1 and trace_trials >= 0")
        self.trials, self.trace, self.trace_trials, self.with_auto = trials, trace, trace_trials, with_auto
        self.tol, self.min_matched, self.cooldown_s, self.weight_rng = clock_tol_mhz, min_matched, cooldown_s, weight_rng
        self._weights = None  # (shape name, (w1, w2))

    def settings(self) -> dict:
        return dict(trials=self.trials, trace=self.trace, trace_trials=self.trace_trials, clock_tol_mhz=self.tol,
                    min_matched=self.min_matched, cooldown_s=self.cooldown_s, weight_rng=self.weight_rng,
                    with_auto=self.with_auto)

    def weights(self, shape):
        """The global weights of ``shape`` (made once per run of cells of one shape)."""
        from lab.megamoe import bench

        if self._weights is None or self._weights[0] != shape.name:
            self._weights = None
            self.release()
            self._weights = (shape.name, bench.make_weights(shape, rng=self.weight_rng))
        return self._weights[1]

    def release(self) -> None:
        """Free what the last cell left (the caching allocators' blocks too); the weights stay."""
        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            empty_host = getattr(torch._C, "_host_emptyCache", None)  # the pinned Combine slots
            if empty_host is not None:
                empty_host()

    def __call__(self, cell: Cell, position: int) -> dict:
        from lab.megamoe import bench
        from megamoe_interleave.reference import unfused_pipeline

        shape = get_shape(cell.shape)
        w1, w2 = self.weights(shape)
        xs, idx, wts = bench.make_inputs(shape, cell.kind, cell.P, cell.tokens, cell.strength or 1.0)
        ref_w = bench.reference_weights(cell.precision, w1, w2)
        refs = unfused_pipeline(xs, idx, wts, *bench.rank_weight_views(shape, cell.P, *ref_w))
        del ref_w
        order = paired.rotated(list(SCHEDULES) + (["auto"] if self.with_auto else []), position)
        moes, cache = {}, {}
        for sched in order:
            moes[sched] = bench.warmed_moe(shape, cell.P, cell.tokens, MegaMoEConfig(sched, precision=cell.precision),
                                           w1, w2, xs, idx, wts,
                                           world=cell.world, refs=refs, name=f"{cell.label} {sched}",
                                           weight_cache=cache)
        del refs
        placement = moes[order[0]].world.placement
        if placement != cell.world:
            raise RuntimeError(f"world {cell.world!r} built a world placed as {placement!r}")
        fns = {s: bench.kernel_time_call(moes[s], rerun=True) for s in order}
        samples, clocks = xbench.paired_trials(fns, self.trials, self.cooldown_s)
        fixed = {k: samples[k] for k in SCHEDULES}, {k: clocks[k] for k in SCHEDULES}
        rec = dict(placement=placement, time_scope=TIME_SCOPE, order=order, runner=self.settings(),
                   timing=compare_schedules(*fixed, self.tol, self.min_matched), schedules={})
        if self.with_auto:
            rec["auto"] = compare_auto(samples, clocks, moes["auto"].last_schedule_choice.schedule, self.tol,
                                       self.min_matched)
            rec["auto"]["reason"] = moes["auto"].last_schedule_choice.reason
        for sched in SCHEDULES:
            entry = {"config": dataclasses.asdict(moes[sched].config)}
            if self.trace:
                entry.update(self.traced(moes[sched]))
            rec["schedules"][sched] = entry
        ew, il = moes["expert_wave"].config, moes["interleaved"].config
        rec["model"] = cell_model(cell, shape, ew.block_n, il.lead, _get(rec, "schedules", "expert_wave", "trace"))
        return rec

    def traced(self, moe) -> dict:
        """The trace of one schedule: an untraced call, the traced kernel's first call (compile,
        warm-up; its y compared with the untraced call's, bitwise), ``trace_trials`` paired
        trials traced vs untraced (:func:`trace_overhead`), then the last traced call's
        :func:`trace_statistics` over every rank (and ``trace_full_ctas``: CTAs whose trace rows
        are all used, i.e. possibly truncated; 0 expected)."""
        import torch

        from lab.megamoe import bench
        from megamoe_interleave.trace import decode_trace

        out = {}
        ys = moe.rerun()
        moe.set_trace(True)
        try:
            traced_ys = moe.rerun()
            out["traced_output_equal"] = all(torch.equal(a, b) for a, b in zip(ys, traced_ys))
            del ys, traced_ys
            call = bench.kernel_time_call(moe, rerun=True)

            def traced():
                moe.set_trace(True)
                return call()

            def untraced():
                moe.set_trace(False)
                return call()

            if self.trace_trials > 0:
                samples, clocks = xbench.paired_trials({"untraced": untraced, "traced": traced}, self.trace_trials,
                                                       self.cooldown_s)
                out["trace_overhead"] = trace_overhead(samples, clocks, self.tol, min(self.min_matched,
                                                                                      self.trace_trials))
        finally:
            moe.set_trace(False)
        traces = dict(sorted(moe.last_trace.items()))
        # A CTA whose every trace row is written may have had more tiles than rows (the kernel
        # drops the rest): counted, so that a truncated trace is visible in the record.
        out["trace_full_ctas"] = sum(int((t[:, -1, 0] >= 0).sum()) for t in traces.values())
        out["trace"] = trace_statistics({r: decode_trace(t) for r, t in traces.items()})
        return out


# ----------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=("full", "reduced"), default="full",
                    help="grid defaults: full = every value below; reduced = shapes "
                         f"{' '.join(REDUCED['shapes'])}, tokens {' '.join(map(str, REDUCED['tokens']))}, "
                         f"P {' '.join(map(str, REDUCED['P']))} (~10 GPU-minutes); a grid flag given wins")
    ap.add_argument("--shapes", nargs="+", default=None, choices=known_shapes(), help="default: every known shape")
    ap.add_argument("--routing", nargs="+", default=None, choices=tuple(ROUTINGS),
                    help="balanced; skewed1 / skewed2 = skewed routing of Zipf strength 1 / 2 (default: all)")
    ap.add_argument("--tokens", nargs="+", type=int, default=None, help=f"tokens per rank (default {TOKENS})")
    ap.add_argument("--worlds", nargs="+", default=None, choices=WORLDS,
                    help="loopback: no remote path (the control); loopback+host: the Combine destinations in "
                         "pinned host memory, remote stores over PCIe (h200-pcie-host) (default: both)")
    ap.add_argument("--P", nargs="+", type=int, default=None, help=f"simulated ranks (default {PS})")
    ap.add_argument("--precision", nargs="+", default=None, choices=PRECISIONS)
    ap.add_argument("--trials", type=int, default=20, help="paired trials per cell (one call of each schedule)")
    ap.add_argument("--trace", action=argparse.BooleanOptionalAction, default=True,
                    help="one traced call per schedule and cell (per-tile statistics, the model's inputs)")
    ap.add_argument("--trace-trials", type=int, default=5,
                    help="paired traced-vs-untraced trials per schedule (the trace's overhead; 0 = none)")
    ap.add_argument("--clock-tol-mhz", type=float, default=30.0,
                    help="trials count when both schedules ran this close to the reference clock")
    ap.add_argument("--cooldown-s", type=float, default=0.0, help="host sleep before each timed call")
    ap.add_argument("--with-auto", action="store_true",
                    help='also time schedule="auto" in the same paired trials (its pick and its ratio to each schedule)')
    ap.add_argument("--gpu-memory-gb", type=float, default=GPU_BUDGET / 1e9,
                    help="skip cells whose estimated GPU memory exceeds this")
    ap.add_argument("--host-memory-gb", type=float, default=HOST_BUDGET / 1e9,
                    help="skip cells whose pinned host memory (loopback+host Combine slots) exceeds this")
    ap.add_argument("--weight-rng", choices=("cuda", "cpu"), default="cuda",
                    help="generator of the weights (cpu: the bench's numbers, minutes for the big shapes)")
    ap.add_argument("--out", default=DEFAULT_OUT,
                    help="the sweep JSON, gzip-compressed if it ends in .gz (the CSV is written next to it)")
    ap.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                    help="skip the cells the JSON already holds")
    ap.add_argument("--stop-on-error", action="store_true", help="stop at the first cell that fails")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the cells, the skips and the estimated GPU time; run nothing")
    ap.add_argument("--compile-only", action="store_true",
                    help="compile the cells' fused kernels into XSTAGE_KERNEL_CACHE (no GPU needed) and exit")
    return ap


def grid_from_args(args) -> list:
    """The cells the flags ask for (``--preset`` defaults, a flag given wins)."""
    preset = REDUCED if args.preset == "reduced" else {}
    pick = lambda flag, key: flag if flag is not None else preset.get(key)  # noqa: E731
    return cell_grid(pick(args.shapes, "shapes"), pick(args.routing, "routing"), pick(args.tokens, "tokens"),
                     pick(args.worlds, "worlds"), pick(args.P, "P"), args.precision)


def describe(cells, args, file=None) -> dict:
    """Print the plan: the skips with their reasons and the time estimate of the runnable cells."""
    file = file or sys.stdout
    runnable, skipped = [], []
    for c in cells:
        r = skip_reason(c, args.gpu_memory_gb * 1e9, args.host_memory_gb * 1e9, 3 if args.with_auto else 2)
        (skipped if r else runnable).append((c, r))
    est = estimate_seconds([c for c, _ in runnable], args.trials, args.trace_trials, args.trace)
    print(f"{len(cells)} cells: {len(runnable)} to run, {len(skipped)} skipped", file=file)
    for c, r in skipped:
        print(f"  skip {c.label}: {r}", file=file)
    for w, v in sorted(est["per_world"].items()):
        print(f"  {w}: {v['cells']} cells, ~{v['seconds'] / 60:.1f} min", file=file)
    print(f"  {est['compiles']} kernel compiles, {est['shapes']} shapes: ~{est['fixed_seconds'] / 60:.1f} min", file=file)
    print(f"estimated GPU time: ~{est['total_seconds'] / 60:.1f} min ({est['calls_per_cell']:.1f} fused calls per cell)",
          file=file)
    return est


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.trials < 1 or args.trace_trials < 0:
        sys.exit("--trials must be >= 1 and --trace-trials >= 0")
    if os.path.isdir(args.out):
        sys.exit(f"--out names the sweep's JSON file, and {args.out} is a folder (e.g. {args.out}/sweep.json)")
    cells = grid_from_args(args)
    describe(cells, args)
    if args.dry_run:
        return None
    if args.compile_only:
        return compile_cells(cells, args.trace)
    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (--dry-run plans without one)")
    runner = GpuRunner(trials=args.trials, trace=args.trace, trace_trials=args.trace_trials,
                       clock_tol_mhz=args.clock_tol_mhz, cooldown_s=args.cooldown_s, weight_rng=args.weight_rng,
                       with_auto=args.with_auto)
    meta = dict(args=vars(args), runner=runner.settings())
    return run_sweep(cells, args.out, runner, resume=args.resume, meta=meta, gpu_budget=args.gpu_memory_gb * 1e9,
                     host_budget=args.host_memory_gb * 1e9, stop_on_error=args.stop_on_error,
                     n_moes=3 if args.with_auto else 2)


if __name__ == "__main__":
    main()
