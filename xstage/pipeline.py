"""Bounded pipelines for CuTe DSL kernels: quack's ``PipelineTmaAsync`` (a TMA-filled smem ring
with full/empty mbarriers) whose every wait reports into the kernel's error word after a deadline
and gives up after a bounded number of further tries, so a broken run ends in a host-side
``DeviceError`` instead of a hang.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Int64
from quack.pipeline import PipelineTmaAsync

from .device import ERR_MBARRIER_TIMEOUT, mbarrier_wait_in_step

__all__ = ["BoundedPipelineTmaAsync"]


class BoundedPipelineTmaAsync(PipelineTmaAsync):
    """quack ``PipelineTmaAsync`` whose waits are bounded (:func:`xstage.device.mbarrier_wait_in_step`:
    past ``timeout_ns`` it ORs ERR_MBARRIER_TIMEOUT into the error word and ``ok`` turns False).
    ``ok`` carries a thread's health. A thread past a timeout still waits for its ring partners,
    bounded by a count of tries: a CTA pair shares the ring (one CTA multicasts into both), and a
    stage refilled before both CTAs consumed it faults the launch. So the roles run on, in step, on
    stale data, and the host raises. The base class's unbounded waits raise at trace time."""

    @staticmethod
    def create(*args, **kwargs) -> "BoundedPipelineTmaAsync":
        obj = PipelineTmaAsync.create(*args, **kwargs)
        object.__setattr__(obj, "__class__", BoundedPipelineTmaAsync)  # frozen dataclass (as quack)
        return obj

    def producer_acquire(self, *args, **kwargs):
        raise NotImplementedError("unbounded wait: use producer_acquire_bounded")

    def consumer_wait(self, *args, **kwargs):
        raise NotImplementedError("unbounded wait: use consumer_wait_bounded")

    def producer_tail(self, *args, **kwargs):
        raise NotImplementedError("unbounded wait: use producer_tail_bounded")

    @cute.jit
    def wait_bounded(self, barriers, state, ok: Boolean, timeout_ns: Int64, error_word: cute.Pointer) -> Boolean:
        """Wait for phase ``state.phase`` of stage ``state.index`` (:func:`mbarrier_wait_in_step`)."""
        return mbarrier_wait_in_step(barriers.get_barrier(state.index), state.phase, ok, timeout_ns, error_word,
                                     ERR_MBARRIER_TIMEOUT)

    @cute.jit
    def producer_acquire_bounded(self, state, ok: Boolean, timeout_ns: Int64, error_word: cute.Pointer) -> Boolean:
        """Wait until both CTAs' consumers released the stage, then arm its full barrier with the
        stage's bytes."""
        ok = self.wait_bounded(self.sync_object_empty, state, ok, timeout_ns, error_word)
        self.sync_object_full.arrive(state.index, self.producer_mask)
        return ok

    @cute.jit
    def consumer_wait_bounded(self, state, ok: Boolean, timeout_ns: Int64, error_word: cute.Pointer) -> Boolean:
        return self.wait_bounded(self.sync_object_full, state, ok, timeout_ns, error_word)

    @cute.jit
    def producer_tail_bounded(self, state, ok: Boolean, timeout_ns: Int64, error_word: cute.Pointer) -> Boolean:
        """Wait until both CTAs' consumers released every stage: each stage's last load has landed in
        both CTAs, and no arrive is in flight when the CTA exits."""
        for _ in cutlass.range_constexpr(self.num_stages):
            ok = self.wait_bounded(self.sync_object_empty, state, ok, timeout_ns, error_word)
            state.advance()
        return ok
