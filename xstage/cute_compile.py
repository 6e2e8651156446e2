"""One way to compile CuTe DSL kernels for Hopper, with or without a GPU.

``compile_hopper`` wraps ``cute.compile`` with the TVM-FFI calling
convention (torch tensors and the current stream at call time) and, on
request, returns the PTX so tests on a CPU-only machine can check which
instructions a kernel uses. ``CUTE_DSL_ARCH`` defaults to ``sm_90a`` so that
a CPU machine (CI) targets Hopper; a GPU host may set it too. :func:`cached`
keeps one compiled kernel per configuration key for the whole process
(calibration, fa4_a2a and megamoe_interleave compile through it).
"""
from __future__ import annotations

import os
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["HOPPER_ARCH", "ensure_hopper_target", "Compiled", "compile_hopper", "cached", "fake_tensor",
           "fake_stream"]

HOPPER_ARCH = "sm_90a"


def ensure_hopper_target() -> None:
    """Target sm_90a unless the caller chose an arch (must run before the DSL compiles)."""
    os.environ.setdefault("CUTE_DSL_ARCH", HOPPER_ARCH)


@dataclass
class Compiled:
    fn: Any  # the callable returned by cute.compile
    ptx: str | None  # PTX text when compiled with keep_ptx

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def compile_hopper(jit_fn: Callable, *args: Any, keep_ptx: bool = False, options: str = "") -> Compiled:
    """Compile ``jit_fn`` (a ``@cute.jit`` function) for the arguments given.

    Arguments may be fake tensors/streams (see :func:`fake_tensor`,
    :func:`fake_stream`) so that no GPU is needed.
    """
    ensure_hopper_target()
    import cutlass.cute as cute

    opts = ["--enable-tvm-ffi"]
    dump = None
    if keep_ptx:
        dump = tempfile.mkdtemp(prefix="xstage-ptx-")  # the DSL writes nothing if the folder is missing
        opts += ["--keep-ptx", f"--dump-dir={dump}"]
    if options:
        opts.append(options)
    fn = cute.compile(jit_fn, *args, options=" ".join(opts))
    ptx = None
    if keep_ptx:
        ptx = getattr(getattr(fn, "artifacts", None), "PTX", None)
        if not ptx:
            files = [f for f in os.listdir(dump) if f.endswith(".ptx")]
            ptx = "\n".join(open(os.path.join(dump, f)).read() for f in sorted(files)) or None
    return Compiled(fn, ptx)


_CACHE: dict = {}
_CACHE_LOCK = threading.Lock()


def cached(key, build: Callable[[], Any]) -> Any:
    """The compiled kernel of ``key`` (hashable: class, shapes, compile-time options), built by
    ``build()`` on first use. Thread-safe: concurrent first calls compile once."""
    fn = _CACHE.get(key)
    if fn is None:
        with _CACHE_LOCK:
            fn = _CACHE.get(key)
            if fn is None:
                fn = _CACHE[key] = build()
    return fn


def fake_tensor(dtype, shape, stride=None, assumed_align: int = 16):
    """A shape/stride-only tensor for compiling without data (ints or ``cute.sym_int()``)."""
    ensure_hopper_target()
    import cutlass.cute as cute

    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=assumed_align)


def fake_stream():
    """A stand-in for the current CUDA stream (TVM-FFI env stream at call time)."""
    ensure_hopper_target()
    import cutlass.cute as cute

    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
