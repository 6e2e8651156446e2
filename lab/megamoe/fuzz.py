"""Seeded GPU fuzz of the fused MoE layer: random problems against the fp32 reference and (W8A8) the
recipe's emulation, in one process, with layers created and destroyed in random order.

    python scripts/fuzz_megamoe.py --cases 500 --seed 0 --out results/h200/megamoe/fuzz
    python scripts/fuzz_megamoe.py --cases 500 --seed 0 --list              # the cases only (CPU)
    XSTAGE_KERNEL_CACHE=.kernel-cache python scripts/fuzz_megamoe.py --cases 500 --seed 0 --compile-only

Each case draws: precision (bf16 / w8a8), schedule (expert_wave / interleaved), P in 1..8, experts,
(H, I), top-k in 1..8, tokens per rank in 0..2048 (some ranks empty), balanced or skewed (Zipf)
routing, masked picks, and how the layer runs: ``forward`` (host plan), ``enqueue`` (device plan)
or a CUDA-graph replay. A case passes when every output is finite (the Combine slots are
poisoned), has the input's shape, is within the kernel tolerance of the references (BF16:
max |y - ref| <= 0.02 + 0.02 max |ref| per rank, as tests/test_megamoe_gpu.py; W8A8: relative error
<= W8A8_KERNEL_REL_ERROR against the emulation and within the recipe's bound of fp32), and for
``enqueue`` / graph is bit for bit the layer's ``forward`` on the same inputs. Layers are kept
between cases with a matching configuration and dropped at random (weights and buffers freed,
sometimes the allocator's cache emptied), so allocations move between calls.

``--compile-only`` builds every kernel the cases need without a GPU (``MegaMoE.compile``): with
``XSTAGE_KERNEL_CACHE`` set a CPU machine fills the cache and the GPU host loads it.

Writes ``fuzz.json`` (the cases, failures, totals, provenance) to ``--out``; exits 1 on any failure.
A device fault aborts the process: ``progress.txt`` then names the case that was running.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import sys
import time
import traceback
from dataclasses import dataclass
from typing import List, Tuple

SHAPES = {"bf16": [(512, 256), (1024, 512), (768, 384)], "w8a8": [(512, 256), (1024, 512)]}
MODES = ("forward", "enqueue", "graph")
BF16_ABS, BF16_REL = 0.02, 0.02  # tests/test_megamoe_gpu.py's bound


@dataclass(frozen=True)
class Layer:
    """What a MegaMoE layer is built for (cases with equal Layers share one)."""

    precision: str
    schedule: str
    world_size: int
    experts: int
    hidden: int
    intermediate: int
    topk: int
    max_tokens: int


@dataclass(frozen=True)
class Case:
    index: int
    layer: Layer
    tokens: Tuple[int, ...]  # per rank
    routing: str  # "balanced" or "skewed"
    strength: float  # skewed: Zipf strength
    mask: float  # share of masked picks
    mode: str  # MODES
    seed: int


# enqueue / graph cases draw their layer from these (P, experts, top-k) at H 512, I 256 and 256
# tokens per rank: the device plan's kernel is compiled per layer configuration, and its scratch is
# sized for the worst case of max_tokens
DEVICE_PLAN_LAYERS = ((1, 8, 2), (2, 8, 4), (4, 16, 6), (8, 16, 8))


def make_cases(n: int, seed: int) -> List[Case]:
    """``n`` random cases, a pure function of ``seed``."""
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        precision = rng.choice(("bf16", "w8a8"))
        mode = rng.choices(MODES, weights=(6, 2, 2))[0]
        if mode == "forward":
            P = rng.randint(1, 8)
            experts = P * rng.choice((1, 2, 4) if P > 2 else (4, 8))
            topk = rng.randint(1, min(8, experts))
            max_tokens = rng.choice((256, 2048))
            hidden, inter = rng.choice(SHAPES[precision])
        else:
            (P, experts, topk), max_tokens, (hidden, inter) = rng.choice(DEVICE_PLAN_LAYERS), 256, (512, 256)

        def rank_tokens():
            u = rng.random()
            if u < 0.15:
                return 0 if mode != "graph" else 1  # a captured layer runs >= 1 token per rank
            if u < 0.5:
                return rng.randint(1, 64)
            if u < 0.85:
                return rng.randint(65, min(512, max_tokens))
            return rng.randint(min(513, max_tokens), max_tokens)

        layer = Layer(precision, rng.choice(("expert_wave", "interleaved")), P, experts, hidden, inter, topk,
                      max_tokens)
        cases.append(Case(i, layer, tuple(rank_tokens() for _ in range(P)), rng.choice(("balanced", "skewed")),
                          rng.choice((1.0, 2.0, 4.0)), rng.choice((0.0, 0.0, 0.1, 0.5)), mode, rng.randrange(2 ** 31)))
    return cases


def build_layer(layer: Layer, device: str, num_sms=None):
    from megamoe_interleave import MegaMoE, MegaMoEConfig, make_world

    world = make_world("loopback", world_size=layer.world_size, device=device)
    config = MegaMoEConfig(layer.schedule, precision=layer.precision)
    return MegaMoE(world, layer.experts, layer.hidden, layer.intermediate, layer.topk, layer.max_tokens, config,
                   backend="fused", num_sms=num_sms)


def compile_cases(cases: List[Case]) -> int:
    """Compile every kernel ``cases`` launch (CPU is fine; the H200's 132 SMs); returns the layers."""
    from tqdm import tqdm

    needs = {}
    for c in cases:
        needs[c.layer] = needs.get(c.layer, False) or c.mode != "forward"
    for layer, device_plan in tqdm(sorted(needs.items(), key=str), desc="compile", unit="layer"):
        build_layer(layer, "cpu", num_sms=132).compile(device_plan=device_plan)
    return len(needs)


class LayerPool:
    """Live layers with their weights; dropped at random so allocations move between cases."""

    def __init__(self, rng: random.Random, max_live: int = 6):
        self.rng, self.max_live, self.live = rng, max_live, {}
        self.created = self.dropped = 0

    def get(self, layer: Layer):
        import torch

        from megamoe_interleave import quant

        if layer not in self.live:
            while len(self.live) >= self.max_live or (self.live and self.rng.random() < 0.2):
                self.drop(self.rng.choice(sorted(self.live, key=str)))
            g = torch.Generator(device="cuda").manual_seed(self.rng.randrange(2 ** 31))
            E, H, inter = layer.experts, layer.hidden, layer.intermediate
            w1 = (torch.randn(E, 2 * inter, H, generator=g, device="cuda") / H ** 0.5).bfloat16()
            w2 = (torch.randn(E, H, inter, generator=g, device="cuda") / inter ** 0.5).bfloat16()
            moe = build_layer(layer, "cuda")
            moe.load_weights(w1, w2)
            wq = quant.quantize_weights(w1, w2) if layer.precision == "w8a8" else None
            self.live[layer] = (moe, w1, w2, wq)
            self.created += 1
        return self.live[layer]

    def drop(self, layer: Layer):
        import torch

        del self.live[layer]
        self.dropped += 1
        gc.collect()
        if self.rng.random() < 0.5:
            torch.cuda.empty_cache()


def case_inputs(case: Case):
    import torch

    from lab.megamoe.routing import make_routing

    g = torch.Generator(device="cuda").manual_seed(case.seed)
    L = case.layer
    xs = [torch.randn(t, L.hidden, generator=g, device="cuda").bfloat16() for t in case.tokens]
    idx, w = [], []
    for r, t in enumerate(case.tokens):
        i, wt = make_routing(case.routing, t, L.experts, L.topk, seed=case.seed + r, mask_ratio=case.mask,
                             strength=case.strength)
        idx.append(i.cuda())
        w.append(wt.cuda())
    return xs, idx, w


def run_case(case: Case, pool: LayerPool) -> List[str]:
    """The failures of one case (empty: it passed)."""
    import torch

    from megamoe_interleave.reference import (W8A8_FP32_REL_ERROR, W8A8_KERNEL_REL_ERROR, reference_moe_fp32,
                                              reference_moe_w8a8, relative_error)

    moe, w1, w2, wq = pool.get(case.layer)
    xs, idx, w = case_inputs(case)
    problems = []
    if case.mode == "forward":
        ys = [y.clone() for y in moe.forward(xs, idx, w)]
    elif case.mode == "enqueue":
        ys = [y.clone() for y in moe.enqueue(xs, idx, w)]
        moe.check()
    else:
        graph = moe.capture(list(case.tokens))
        for x_in, i_in, w_in, x, i, wt in zip(graph.x, graph.topk_idx, graph.topk_weights, xs, idx, w):
            x_in.copy_(x)
            i_in.copy_(i)
            w_in.copy_(wt)
        ys = [y.clone() for y in graph.replay()]
        graph.check()
        del graph
    if case.mode != "forward":
        for r, (a, b) in enumerate(zip(ys, moe.forward(xs, idx, w))):
            if not torch.equal(a, b):
                problems.append(f"rank {r}: {case.mode} differs from forward")
    refs = reference_moe_fp32(xs, idx, w, w1, w2)
    for r, (y, x, ref) in enumerate(zip(ys, xs, refs)):
        if y.shape != x.shape or y.dtype != torch.bfloat16:
            problems.append(f"rank {r}: y {tuple(y.shape)} {y.dtype}")
        elif not torch.isfinite(y.float()).all():
            problems.append(f"rank {r}: non-finite y (a Combine slot never written?)")
        elif case.layer.precision == "bf16" and y.numel():
            err, bound = (y.float() - ref).abs().max().item(), BF16_ABS + BF16_REL * ref.abs().max().item()
            if err > bound:
                problems.append(f"rank {r}: max |y - fp32| {err:.4g} > {bound:.4g}")
    if case.layer.precision == "w8a8" and not problems and sum(case.tokens):
        emu = reference_moe_w8a8(xs, idx, w, *wq)
        e_emu, e_fp32 = relative_error(ys, emu), relative_error(ys, refs)
        if e_emu > W8A8_KERNEL_REL_ERROR:
            problems.append(f"relative error to the emulation {e_emu:.4g} > {W8A8_KERNEL_REL_ERROR}")
        if e_fp32 > W8A8_FP32_REL_ERROR[1] + W8A8_KERNEL_REL_ERROR:
            problems.append(f"relative error to fp32 {e_fp32:.4g}")
    if pool.rng.random() < 0.1:
        pool.drop(case.layer)
    return problems


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/h200/megamoe/fuzz")
    ap.add_argument("--list", action="store_true", help="print the cases and exit")
    ap.add_argument("--compile-only", action="store_true", help="compile the cases' kernels (no GPU) and exit")
    args = ap.parse_args()
    if args.cases < 1:
        ap.error("--cases must be >= 1")
    from xstage.cute_compile import ensure_hopper_target

    ensure_hopper_target()  # sm_90a on a CPU host; one arch for XSTAGE_KERNEL_CACHE's keys on both
    cases = make_cases(args.cases, args.seed)
    if args.list:
        for c in cases:
            print(json.dumps(dataclasses.asdict(c)))
        return
    if args.compile_only:
        t0 = time.time()
        n = compile_cases(cases)
        print(f"compiled the kernels of {n} layers in {time.time() - t0:.0f} s")
        return
    import torch
    from tqdm import tqdm

    from xstage import provenance

    if not torch.cuda.is_available():
        sys.exit("the fuzz runs the fused kernels: it needs a Hopper GPU (--list / --compile-only do not)")
    os.makedirs(args.out, exist_ok=True)
    progress = open(os.path.join(args.out, "progress.txt"), "w")
    pool = LayerPool(random.Random(args.seed + 1))
    failures, t0 = [], time.time()
    for case in tqdm(cases, desc="fuzz", unit="case"):
        progress.write(f"{case.index} {json.dumps(dataclasses.asdict(case))}\n")
        progress.flush()
        try:
            problems = run_case(case, pool)
        except Exception as e:  # a raised device error or a refused input counts as a failure
            problems = [f"{type(e).__name__}: {e}", traceback.format_exc(limit=3)]
            if "CUDA" in str(e) and "error" in str(e).lower():
                raise  # a sticky device fault: the process cannot go on
        if problems:
            failures.append(dict(case=dataclasses.asdict(case), problems=problems))
            tqdm.write(f"case {case.index} FAILED: {problems[0]}")
    torch.cuda.synchronize()
    count = lambda f: {k: sum(1 for c in cases if f(c) == k) for k in sorted({f(c) for c in cases})}  # noqa: E731
    summary = dict(cases=len(cases), seed=args.seed, failures=len(failures), seconds=round(time.time() - t0, 1),
                   layers_created=pool.created, layers_dropped=pool.dropped,
                   by_precision=count(lambda c: c.layer.precision), by_schedule=count(lambda c: c.layer.schedule),
                   by_mode=count(lambda c: c.mode), by_world_size=count(lambda c: c.layer.world_size),
                   empty_ranks=sum(c.tokens.count(0) for c in cases), masked=sum(1 for c in cases if c.mask > 0))
    provenance.write_json(os.path.join(args.out, "fuzz.json"), dict(summary=summary, failures=failures))
    print(json.dumps(summary, indent=1))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
