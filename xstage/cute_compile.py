"""One way to compile CuTe DSL kernels for Hopper, with or without a GPU.

``compile_hopper`` wraps ``cute.compile`` with the TVM-FFI calling
convention (torch tensors and the current stream at call time) and, on
request, returns the PTX so tests on a CPU-only machine can check which
instructions a kernel uses. ``CUTE_DSL_ARCH`` defaults to ``sm_90a`` so that
a CPU machine (CI) targets Hopper; a GPU host may set it too. :func:`cached`
keeps one compiled kernel per configuration key for the whole process
(calibration, fa4_a2a and megamoe_interleave compile through it); with ``XSTAGE_KERNEL_CACHE=DIR``
it also keeps each kernel whose call names its ``sources`` as an object file in DIR, so another
process -- or another machine: compile on a CPU host, carry DIR to the GPU host -- loads it
instead of compiling (about 20 s per fused MoE kernel).
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["HOPPER_ARCH", "ensure_hopper_target", "Compiled", "compile_hopper", "cached", "fake_tensor",
           "fake_stream", "cuobjdump"]

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
KERNEL_CACHE_ENV = "XSTAGE_KERNEL_CACHE"
_EXPORTED_NAME = "xstage_kernel"


def cached(key, build: Callable[[], Any], *, sources: tuple = ()) -> Any:
    """The compiled kernel of ``key`` (hashable: class, shapes, compile-time options), built by
    ``build()`` on first use. Thread-safe: concurrent first calls compile once.

    ``sources``: the modules whose code decides the compiled program (the kernel's own files). With
    them and ``XSTAGE_KERNEL_CACHE`` set, the kernel is also kept on disk (:func:`disk_cache_path`:
    ``repr(key)``, the sources' text, the DSL version and compile environment name the file) and
    later processes load it instead of compiling. ``build()`` must then return the TVM-FFI function
    itself (``cute.compile``'s result), which is what a loaded object file gives back."""
    fn = _CACHE.get(key)
    if fn is None:
        with _CACHE_LOCK:
            fn = _CACHE.get(key)
            if fn is None:
                path = disk_cache_path(key, sources) if sources else None
                fn = _load_object(path) if path is not None and os.path.exists(path) else None
                if fn is None:  # not on disk, or not loadable here: compile (and replace the file)
                    fn = build()
                    if path is not None:
                        _export_object(fn, path)
                _CACHE[key] = fn
    return fn


def disk_cache_path(key, sources: tuple) -> str | None:
    """Where :func:`cached` keeps ``key``'s object file, or None without ``XSTAGE_KERNEL_CACHE``.
    The name hashes everything the PTX depends on besides the key: the sources' text (any edit
    makes a new file), the CuTe DSL / quack / flash-attn versions and the compile environment
    variables. Not the DSL's CUDA-toolkit flavor (:func:`dsl_toolkit`): a file compiled with the other
    one loads, but its PTX and SASS are that flavor's compiler's -- fine for correctness runs; time
    kernels with files of the GPU host's flavor (cu13, which a CPU host also uses when both are
    installed, as pyproject.toml asks)."""
    root = os.environ.get(KERNEL_CACHE_ENV)
    if not root:
        return None
    from importlib import metadata

    h = hashlib.sha256(repr(key).encode())
    for dist in ("nvidia-cutlass-dsl", "quack-kernels", "flash-attn-4"):
        try:
            h.update(f"{dist}={metadata.version(dist)}".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{dist}=none".encode())
    for var in ("CUTE_DSL_ARCH", "CUTE_DSL_LINEINFO", "FLASH_ATTENTION_ARCH"):
        h.update(f"{var}={os.environ.get(var, '')}".encode())
    for module in sources:
        with open(module.__file__, "rb") as f:
            h.update(f.read())
    name = str(key[0]) if isinstance(key, tuple) and key else "kernel"
    return os.path.join(root, f"{''.join(c for c in name if c.isalnum())}-{h.hexdigest()[:24]}.o")


def _load_object(path: str):
    """The kernel in ``path``, or None (with a warning) when this host cannot load it."""
    ensure_hopper_target()
    import cutlass.cute as cute

    try:
        return getattr(cute.runtime.load_module(path, enable_tvm_ffi=True), _EXPORTED_NAME)
    except Exception as e:  # e.g. a file from an incompatible DSL runtime
        import warnings

        warnings.warn(f"{KERNEL_CACHE_ENV}: cannot load {path} ({type(e).__name__}: {e}); compiling instead")
        return None


def _export_object(fn, path: str) -> None:
    """Write ``fn`` to ``path`` atomically (concurrent processes may share the folder)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    fn.export_to_c(tmp, function_name=_EXPORTED_NAME)
    os.replace(tmp, path)


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


def dsl_toolkit() -> str:
    """The CUDA toolkit flavor of the CuTe DSL compiler in use ("cu12" or "cu13"). With both
    installed the DSL takes the newest one the driver supports, or the newest without a driver;
    the flavors carry different ptxas builds, so a kernel's SASS (registers, spills) and the
    DSL's PTX depend on it."""
    import re

    import cutlass._mlir._mlir_libs as libs

    m = re.search(r"\.(cu\d+)\.", os.path.basename(libs._cutlass_ir.__file__))
    return m.group(1) if m else "unknown"


def cuobjdump() -> str | None:
    """cuobjdump (to read a compiled kernel's SASS) from the CUDA toolkit or the one triton ships
    (installed with quack), or None."""
    import shutil

    path = shutil.which("cuobjdump")
    if path:
        return path
    try:
        import triton
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return path if os.path.exists(path) else None


def compiled_sass(compile_fn):
    """``(sass, res_usage)`` text of the kernel ``compile_fn(options)`` builds (``options``: DSL
    compiler options that keep its cubin), or None without cuobjdump. The SASS is the active DSL
    flavor's (:func:`dsl_toolkit`)."""
    import glob
    import subprocess
    import tempfile

    tool = cuobjdump()
    if tool is None:
        return None
    with tempfile.TemporaryDirectory(prefix="sass-") as d:
        compile_fn(f"--keep-cubin --dump-dir={d}")
        (cubin,) = glob.glob(os.path.join(d, "*.cubin"))
        return tuple(subprocess.run([tool, flag, cubin], capture_output=True, text=True, check=True).stdout
                     for flag in ("-sass", "-res-usage"))
