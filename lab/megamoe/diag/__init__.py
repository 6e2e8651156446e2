"""MegaMoE diagnostics; each module but ``no_dispatch_copy`` is the ``main`` of one script under
``scripts/diag/``.

no_dispatch_copy  the fused kernel without its Dispatch copy (imports the CuTe DSL)
dispatch_cost     what the Dispatch copy costs (scripts/diag/megamoe_dispatch_cost.py)
energy            energy per call from NVML (scripts/diag/megamoe_energy.py)
ncu_driver        a problem for ncu to profile (scripts/diag/megamoe_ncu_driver.py)
pm_phases         DRAM bytes per phase from ncu PM sampling (scripts/diag/megamoe_pm_phases.py)
trace_clock       the SM clock inside the kernel from its trace (scripts/diag/megamoe_trace_clock.py)
trace_timeline    mainloop cycles over time from a trace (scripts/diag/megamoe_trace_timeline.py)
api_profile       host time of MegaMoE.forward outside the kernels (scripts/diag/profile_megamoe_api.py)
ncu_source        warp stalls by role and instruction from an ncu source export (scripts/diag/megamoe_ncu_source.py)
ncu_metrics       kernels side by side from ncu details exports (scripts/diag/megamoe_ncu_metrics.py)
sass_report       a build's registers, stack, local accesses, WGMMA waits, K-loop moves (scripts/diag/megamoe_sass.py)
wgmma_rate        the W8A8 mainloop's WGMMA batch shapes alone (scripts/diag/wgmma_rate.py)
tile_budget       where each tile's time goes, from the trace (scripts/diag/megamoe_tile_budget.py)
ab_trees          tile_budget of several source trees on one host, alternating (scripts/diag/megamoe_ab_trees.py)
"""


def config_options(items) -> dict:
    """``NAME=VALUE`` items (``--option``) -> MegaMoEConfig fields: integers as int, anything else as a
    string. Raises ValueError on an item without ``=``."""
    options = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--option {item!r}: expected NAME=VALUE")
        try:
            options[name] = int(value)
        except ValueError:
            options[name] = value
    return options
