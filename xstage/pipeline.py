"""Bounded pipelines for CuTe DSL kernels: quack's ``PipelineTmaAsync`` (a TMA-filled smem ring
with full/empty mbarriers) whose every wait gives up after a deadline, reports into the kernel's
error word and lets the thread fall through, so a broken run ends in a host-side ``DeviceError``
instead of a hang.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Int64
from quack.pipeline import PipelineTmaAsync

from .device import ERR_MBARRIER_TIMEOUT, mbarrier_wait_bounded

__all__ = ["BoundedPipelineTmaAsync"]


class BoundedPipelineTmaAsync(PipelineTmaAsync):
    """quack ``PipelineTmaAsync`` whose waits are bounded (:func:`xstage.device.mbarrier_wait_bounded`:
    after ``timeout_ns`` it ORs ERR_MBARRIER_TIMEOUT into the error word and returns False). ``ok``
    carries a thread's health: once a wait failed the thread waits no more and falls through
    (arrives, copies and WGMMAs still run, on stale data), so every role ends after at most one
    timeout and the host raises. The base class's unbounded waits raise at trace time."""

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
        """Bounded wait for phase ``state.phase`` of stage ``state.index``; none once ``ok`` is False."""
        if ok:
            ok = mbarrier_wait_bounded(barriers.get_barrier(state.index), state.phase, timeout_ns, error_word,
                                            ERR_MBARRIER_TIMEOUT)
        return ok

    @cute.jit
    def producer_acquire_bounded(self, state, ok: Boolean, timeout_ns: Int64, error_word: cute.Pointer,
                                 drain_ns: Int64) -> Boolean:
        """Wait until the stage is empty, then arm its full barrier with the stage's bytes. After a
        failed wait the consumers no longer release stages in step, so the producer instead waits
        (bounded by ``drain_ns``) for the stage's previous load to land -- the full barrier's
        previous phase -- and never arms a phase twice."""
        if ok:
            ok = mbarrier_wait_bounded(self.sync_object_empty.get_barrier(state.index), state.phase, timeout_ns,
                                            error_word, ERR_MBARRIER_TIMEOUT)
        else:
            mbarrier_wait_bounded(self.sync_object_full.get_barrier(state.index), state.phase, drain_ns,
                                       error_word, ERR_MBARRIER_TIMEOUT)
        self.sync_object_full.arrive(state.index, self.producer_mask)
        return ok

    @cute.jit
    def consumer_wait_bounded(self, state, ok: Boolean, timeout_ns: Int64, error_word: cute.Pointer) -> Boolean:
        return self.wait_bounded(self.sync_object_full, state, ok, timeout_ns, error_word)

    @cute.jit
    def producer_tail_bounded(self, state, ok: Boolean, timeout_ns: Int64, error_word: cute.Pointer) -> Boolean:
        """Wait until every stage has been released, so no arrive is in flight when the CTA exits."""
        for _ in cutlass.range_constexpr(self.num_stages):
            ok = self.wait_bounded(self.sync_object_empty, state, ok, timeout_ns, error_word)
            state.advance()
        return ok

    @cute.jit
    def producer_drain_bounded(self, state, drain_ns: Int64, error_word: cute.Pointer):
        """Wait until the last armed phase of every stage's full barrier completed: every TMA byte
        bound for this CTA's smem (its own loads and the peer's multicast) has landed, also after
        a timeout. ``state``: the producer's state after its last load (pass a clone)."""
        for _ in cutlass.range_constexpr(self.num_stages):
            mbarrier_wait_bounded(self.sync_object_full.get_barrier(state.index), state.phase, drain_ns,
                                       error_word, ERR_MBARRIER_TIMEOUT)
            state.advance()
