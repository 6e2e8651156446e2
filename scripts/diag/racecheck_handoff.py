#!/usr/bin/env python
"""The racecheck finding on MegaMoE's row-metadata handoff, reproducible: one megamoe case of
sanitize.py with the handoff's named barriers made two-sided, to show that racecheck's report
does not depend on them (results/h200/sanitizers/README.md).

    compute-sanitizer --tool racecheck --racecheck-report all --kernel-name kns=MegaMoESm90 \\
        python scripts/diag/racecheck_handoff.py {shipped,epilogue_sync,all_sync} megamoe_expert_wave

shipped: as the kernel is (epilogue warps arrive on EMPTY and wait on FULL, consumers the reverse);
epilogue_sync: the epilogue warps wait on EMPTY too; all_sync: and the consumers wait on FULL.
"""
import runpy
import sys

import cutlass.cute as cute

variant, case = sys.argv[1], sys.argv[2]
if variant not in ("shipped", "epilogue_sync", "all_sync"):
    sys.exit(f"unknown variant {variant!r}")
arrive = cute.arch.barrier_arrive
if variant != "shipped":
    # every named-barrier arrive of the kernel is one of the handoff's: make it a wait as well
    def two_sided(barrier_id, number_of_threads, **kw):
        if variant == "all_sync" or barrier_id == 3:  # 3 = NamedBarrier.EpilogueEmpty
            return cute.arch.barrier(barrier_id=barrier_id, number_of_threads=number_of_threads, **kw)
        return arrive(barrier_id=barrier_id, number_of_threads=number_of_threads, **kw)
    cute.arch.barrier_arrive = two_sided
sys.argv = ["sanitize.py", "--case", case]
runpy.run_module("lab.sanitize", run_name="__main__")
