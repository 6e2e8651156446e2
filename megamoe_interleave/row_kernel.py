"""What the small per-row kernels around the fused one share (the top-k reduction, the W8A8 input
staging): one thread per 8 consecutive bf16 of a row (one 16-byte access), 128 threads per CTA,
compiled once per hidden size on any host."""
from __future__ import annotations

import sys

import cutlass.cute as cute
from cutlass import Int32

VEC = 8  # bf16 per 16-byte access
THREADS = 128


class RowChunkKernel:
    """A kernel over ``rows x hidden / VEC`` chunks; a subclass sets ``multiple`` (what ``hidden``
    must divide into, and ``why``) and launches through :meth:`launch_chunks`."""

    multiple, why = VEC, "16-byte accesses"

    def __init__(self, hidden: int):
        if hidden % self.multiple:
            raise ValueError(f"hidden {hidden} must be a multiple of {self.multiple} ({self.why})")
        self.hidden = hidden

    def launch_chunks(self, launchable, rows, stream) -> None:
        work = rows * (self.hidden // VEC)
        launchable.launch(grid=[(work + THREADS - 1) // THREADS, 1, 1], block=[THREADS, 1, 1], stream=stream)

    def thread_chunk(self):
        """(row, chunk) of this thread; the row may be past the last one."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        chunks = self.hidden // VEC
        i = Int32(bidx) * THREADS + Int32(tidx)
        t = i // chunks
        return t, i - t * chunks


def compile_row_kernel(cls, hidden: int, fake_arguments, *, keep_ptx: bool = False):
    """``cls(hidden)`` compiled for CUTE_DSL_ARCH with ``fake_arguments(hidden)`` (no GPU needed);
    returns xstage's Compiled."""
    from xstage.cute_compile import compile_hopper

    return compile_hopper(cls(hidden), *fake_arguments(hidden), keep_ptx=keep_ptx)


def compiled_row_kernel(cls, hidden: int, fake_arguments):
    """:func:`compile_row_kernel`'s function, compiled once (on any host) and kept on disk with its
    module's source (xstage.cute_compile.cached)."""
    from xstage.cute_compile import cached

    return cached((cls.__name__, hidden), lambda: compile_row_kernel(cls, hidden, fake_arguments).fn,
                  sources=(sys.modules[cls.__module__], sys.modules[__name__]))
