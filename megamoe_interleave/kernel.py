"""The fused kernel of each precision, in the manner of DeepGEMM's thin ``deep_gemm/mega``: the class
of a config's precision (:mod:`.kernel_sm90` BF16, :mod:`.sm90_fp8` W8A8), its compile, and the source
files that make its program (the disk key of :func:`xstage.cute_compile.cached`)."""
from __future__ import annotations

import sys

import cutlass.cute as cute
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Int64, Uint8

from .arguments import NUM_SCALAR_ARGS, arguments_class, tensor_argument_spec
from .config import MegaMoEConfig
from .kernel_sm90 import MegaMoESm90
from .sm90_fp4 import MegaMoESm90W4A8
from .sm90_fp8 import MegaMoESm90W8A8

KERNELS = {cls.precision: cls for cls in (MegaMoESm90, MegaMoESm90W8A8, MegaMoESm90W4A8)}


def kernel_class(precision: str) -> type:
    if precision not in KERNELS:
        raise ValueError(f"no fused kernel for precision {precision!r} yet (fused: {sorted(KERNELS)}); "
                         "backend='torch' runs every precision")
    return KERNELS[precision]


def make_kernel(hidden: int, intermediate: int, config: MegaMoEConfig) -> MegaMoESm90:
    """The kernel object of ``config`` (a resolved config; raises on what the kernel cannot run)."""
    return kernel_class(config.precision)(hidden, intermediate, config)


def compile_megamoe_sm90(hidden: int, intermediate: int, config: MegaMoEConfig, *, options: str = ""):
    """Compile for CUTE_DSL_ARCH (no GPU needed); ``options`` go to the DSL compiler (e.g.
    ``--keep-ptx --dump-dir=DIR``)."""
    from xstage.cute_compile import compile_hopper

    return compile_hopper(make_kernel(hidden, intermediate, config),
                          *fake_launch_arguments(hidden, intermediate, config.precision), options=options).fn


def compiled_megamoe_sm90(hidden: int, intermediate: int, config: MegaMoEConfig):
    """The fused kernel of a resolved ``config``, compiled once per process and, with
    ``XSTAGE_KERNEL_CACHE``, kept on disk under a key of its program's sources (a GPU host given a
    cache filled on a CPU loads it instead of compiling)."""
    from xstage.cute_compile import cached

    key = ("MegaMoESm90", hidden, intermediate, config.kernel_key())
    return cached(key, lambda: compile_megamoe_sm90(hidden, intermediate, key[-1]), sources=kernel_sources())


def fake_launch_arguments(hidden: int, intermediate: int, precision: str = "bf16"):
    """Fake arguments, scalars and stream for compiling without a GPU (:func:`.arguments.tensor_argument_spec`)."""
    from quack.compile_utils import make_fake_tensor

    from xstage.cute_compile import fake_stream

    dsl = {"int64": Int64, "int32": Int32, "float32": Float32, "bfloat16": BFloat16, "float8_e4m3fn": Float8E4M3FN,
           "uint8": Uint8}
    div = {"bfloat16": 8, "float8_e4m3fn": 16, "uint8": 16}  # 16-byte rows
    syms = {}
    fake = [make_fake_tensor(dsl[dtype], tuple(syms.setdefault(d, cute.sym_int()) if isinstance(d, str) else d
                                               for d in shape), divisibility=div.get(dtype, 1))
            for _, dtype, shape in tensor_argument_spec(hidden, intermediate, precision)]
    return (arguments_class(precision)(*fake), *([Int32(0)] * NUM_SCALAR_ARGS), fake_stream())


def kernel_sources():
    """The modules whose code is the fused kernels' program."""
    from xstage import device, pipeline

    from . import activation, arguments, config, fp4_widen, int_ops, kernel_sm90, named_barrier, row_grid, \
        scheduler, sm90_dispatch, sm90_epilogue, sm90_fp4, sm90_fp8, sm90_fp8_mainloop, sm90_mainloop, sm90_schedule

    return (sys.modules[__name__], activation, arguments, config, fp4_widen, int_ops, kernel_sm90, named_barrier,
            row_grid, scheduler, sm90_dispatch, sm90_epilogue, sm90_fp4, sm90_fp8, sm90_fp8_mainloop, sm90_mainloop,
            sm90_schedule, device, pipeline)
