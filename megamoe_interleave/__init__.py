"""megamoe_interleave: Hopper fused MoE mega-kernel with expert-wave and interleaved schedules.

    from megamoe_interleave import MegaMoE, MegaMoEConfig, make_world

Modules
-------
api             ``MegaMoE`` (the layer: weights, forward, enqueue, capture)
host_plan       ``HostPlanner``: one forward's pool, scheduler rows and schedule (auto's choice)
launcher        ``FusedLauncher``: scratch, launch arguments, launches and error words
arguments       ``MegaMoEArguments``: the fused kernel's typed launch arguments and their spec
inputs          the checks and copies of a call's inputs
trace           decoding the per-tile trace
workspace       ``MegaMoEBuffer`` (the symmetric buffers) and the counter words' layout
weights         ``transform_weights``: the kernel's gate/up interleaved w1 layout
config          ``MegaMoEConfig`` and its tuned defaults (``resolve``), tile and trace constants
kernel          the fused kernel of a precision (``kernel_class``, ``compile_megamoe_sm90``)
kernel_sm90     ``MegaMoESm90``: the persistent fused kernel in BF16; its roles in ``sm90_mainloop``
                (TMA producer, WGMMA consumers), ``sm90_epilogue`` (h publish, Combine remote
                stores) and ``sm90_dispatch`` (row pull); ``named_barrier``, ``activation`` (SwiGLU)
sm90_fp8        ``MegaMoESm90W8A8``: the W8A8 precision class (h quantization, the scales' Dispatch);
                its mainloop in ``sm90_fp8_mainloop`` (FP8 fragments, MMA with promotion)
scheduler       tile schedulers (pure functions: the Python reference and the kernel's trace-time
                arithmetic share one definition), deadlock-freedom proof; ``int_ops`` their arithmetic;
                ``sm90_schedule`` their loop on the device (``walk_tiles``, every role's)
row_grid        the schedulers' host side: the row grid, balanced L2 starts, schedule table, eq. 16
                lead, the CPU enumeration of every CTA's tiles
torch_backend   the kernel's data flow with torch ops (``backend="torch"``)
reference       float32 reference, the unfused torch pipeline baseline, the W8A8 / W4A8 recipes' emulation
quant           E4M3 quantization of the W8A8 recipe (1x128 activations, 128x128 weights), kernel layout
quant_fp4       W4A8's FP4 weights (E2M1, a power-of-two scale per 32 K) and their exact widening to
                the W8A8 weight format; ``sm90_fp4`` the W4A8 precision class (``fp4_widen``: the widening)
shapes          MoE shapes of the paper's models (with sources; unknown ones marked)

Benchmarks, the X-Stage sweep and its evaluation, the multi-GPU steps, the diagnostics, the
routing generators of tests and benchmarks and the schedule-trace kernel (device order ==
reference): ``lab.megamoe``.

Importing the package does not import the CuTe DSL; ``kernel_sm90`` does.
"""
from .api import MegaMoE, MegaMoEBuffer, make_world, transform_weights
from .config import MegaMoEConfig

__all__ = ["MegaMoE", "MegaMoEBuffer", "MegaMoEConfig", "make_world", "transform_weights"]
