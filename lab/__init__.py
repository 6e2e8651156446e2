"""lab: benchmarks, sweeps, evaluation reports, the multi-GPU harness, demos and diagnostics.

It imports the libraries (``xstage``, ``calibration``, ``fa4_a2a``, ``megamoe_interleave``); none of
them imports it (tests/test_static.py checks that). The command lines under ``scripts/`` are thin
front ends of its ``main`` functions.

Shared
------
bench               paired trials, clock-matched verdicts, result files (CSV, JSON with provenance), progress
paired              the paired, clock-matched statistics (rotation, sign test, matched medians)
timing              CUDA events, CUDA-graph replays, medians
multigpu            the multi-GPU suite's world set-up, timing protocol and result header
multigpu_envcheck   its step 0 (environment and topology)
multigpu_correctness its step 4 (both kernels' checks across processes)
multigpu_report     its markdown reports
demo                ``scripts/run``'s main job (GPU: both kernels; CPU: planner and calibration refit)
ceilings            copy bandwidth and dense bf16 rate of the GPU
transients          X-Stage transients in the fluid simulator
report              markdown templates (``templates/``) filled with tables and numbers
sanitize            compute-sanitizer (memcheck, racecheck) over a small case of every shipped kernel

Per library
-----------
calibration.peer    the multi-GPU suite's NVLink peer calibration (step 1)
fa4_a2a             bench (Table 3), dit_block, trace (per-tile timelines), multigpu_sweep (step 2),
                    multigpu_checks (step 4, fa4 half), demo
megamoe             bench, graph_bench, w8a8_bench, sweep (X-Stage cells) and evaluation (its figures,
                    tables and README), trace (per-tile trace files and analyses), multigpu_ep (step 3),
                    multigpu_checks (step 4, megamoe half), demo, fuzz (seeded random problems against the
                    references), diag (diagnostic kernel variants and
                    the ``scripts/diag/megamoe_*`` command lines)
"""
