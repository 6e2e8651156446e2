"""Benchmarks and checks of :mod:`fa4_a2a`.

bench            the Table-3 sweep on one GPU (fused vs FA-only / A2A-only / Serial; scripts/bench_fa_a2a.py)
dit_block        one DiT attention block, stock Ulysses vs fused (scripts/bench_dit_block.py)
trace            per-tile timelines of the fused kernel's trace build (scripts/trace_fa4_a2a.py)
multigpu_sweep   the multi-GPU suite's step 2 (``-m lab.fa4_a2a.multigpu_sweep``)
multigpu_checks  the fa4 half of its step 4
demo             ``scripts/run``'s fa4_a2a part
"""
