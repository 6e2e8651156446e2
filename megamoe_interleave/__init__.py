"""megamoe_interleave: Hopper fused MoE mega-kernel with expert-wave and interleaved schedulers.

Modules
-------
scheduler       tile schedulers (pure functions; Python reference and CuTe DSL trace-time
                arithmetic share one definition), deadlock-freedom proof, eq. 16 lead
schedule_trace  tiny device kernel that evaluates the schedulers (device order == reference)
kernel_sm90     ``MegaMoESm90``: the persistent fused kernel (status in its docstring)
api             ``MegaMoE`` / ``MegaMoEBuffer`` / ``transform_weights`` (deep_gemm.mega-like API)
reference       float32 reference and the unfused torch pipeline baseline
routing         balanced / skewed (Zipf) routing generators, masking
shapes          MoE shapes of the paper's models (with sources; unknown ones marked)

Importing the package does not import the CuTe DSL; ``kernel_sm90`` and
``schedule_trace`` do.
"""
