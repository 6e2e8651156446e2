"""Benchmarks, the X-Stage sweep and its evaluation, and diagnostics of :mod:`megamoe_interleave`.

bench            the one-GPU benchmark (fused variants vs grouped GEMMs vs the unfused pipeline;
                 scripts/bench_megamoe.py) and the problems / objects the diagnostics build
graph_bench      the layer as one CUDA-graph replay (scripts/bench_megamoe_graph.py)
w8a8_bench       the W8A8 kernel against the FP8 baselines (scripts/bench_megamoe_w8a8.py)
trace            per-tile trace files and their analyses (timeline, Dispatch-window waits, ncu PM phases)
sweep            the X-Stage evaluation sweep on one GPU (resumable; scripts/sweep_megamoe.py)
evaluation       its figures, tables and README from the sweep JSON (CPU; scripts/megamoe_xstage_report.py;
                 the README's text: lab/templates/megamoe_xstage_readme.md)
multigpu_ep      the multi-GPU suite's step 3 (``-m lab.megamoe.multigpu_ep``)
multigpu_checks  the megamoe half of its step 4
demo             ``scripts/run``'s MegaMoE part
diag             diagnostic kernel variants and the scripts/diag/megamoe_* command lines
routing          balanced / skewed (Zipf) routing generators of the tests and benchmarks, masking
schedule_trace   a tiny device kernel that runs the schedulers' step functions (device order == reference)
"""
