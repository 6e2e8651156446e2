"""Diagnostic variants of the fused kernel, for scripts/diag (not for production use).

:class:`NoDispatchCopy` is :class:`~megamoe_interleave.kernel_sm90.MegaMoESm90` with the Dispatch
row copy skipped: the prologue's and the LSU dispatch warp's ``copy_chunks`` copy nothing, and the
bulk dispatch thread (``dispatch_rows_bulk``) publishes each row without copying it, after the same
window wait as the shipped kernel (``dispatch_window``), so rows become ready no earlier relative
to the L1 tiles than the window lets them. Rows are published as in the shipped kernel, so
the tiles run in the same order with the same dependency waits; what is gone is the copy's traffic
and its issue. :class:`NoDispatchCopyMoE` is a MegaMoE whose fused kernel is that class (its own
entry in the compile cache). Its pool is whatever its scratch holds: :func:`fill_pool` gathers the
real rows with torch first, so it computes the shipped kernel's y from the same data.

Imports the CuTe DSL (the subclass is a kernel class).
"""
from __future__ import annotations

import cutlass.cute as cute
from cutlass import Boolean, Int32, const_expr

from megamoe_interleave import reference
from megamoe_interleave.api import MegaMoE
from megamoe_interleave.kernel import fake_launch_arguments
from megamoe_interleave.kernel_sm90 import MegaMoESm90
from megamoe_interleave.launcher import FusedLauncher
from megamoe_interleave.sm90_dispatch import DISPATCH_POLL_NS
from xstage import device as xdev


class NoDispatchCopy(MegaMoESm90):
    """The fused kernel with the Dispatch row copy skipped (rows are still published). Its kernel
    is named after this class (ncu: ``--kernel-name regex:NoDispatchCopy``)."""

    def copy_chunks(self, gm, lo, hi, warp, num_warps, lane, unroll):
        """No copy: a plain Python no-op, so tracing :meth:`dispatch_rows` emits no copy code."""
        return None

    @cute.jit
    def dispatch_rows_bulk(self, gm, ctx, sm, row_begin: Int32):
        """Rows [row_begin, num_rows): the window wait of the shipped bulk Dispatch, then one
        release increment of ``x_ready[row]`` per row, without any copy."""
        ready = gm.mCounters.iterator + self.COUNTER_L2_FULL + ctx.grid.num_rows
        err = gm.mCounters.iterator + self.COUNTER_ERROR
        l1_done = gm.mCounters.iterator + self.COUNTER_L2_FULL  # l2_full[row]: finished L1 tiles of the row
        ok = Boolean(True)
        row = row_begin
        while row < ctx.grid.num_rows and ok:
            if const_expr(self.dispatch_window > 0):
                if row >= self.dispatch_window:
                    ok = xdev.spin_wait_ge_tries(l1_done + (row - self.dispatch_window), Int32(1),
                                                 self.dispatch_polls, DISPATCH_POLL_NS, err,
                                                 self.ERR_DEPENDENCY_TIMEOUT)
            cute.arch.fence_acq_rel_gpu()
            xdev.red_add_release(ready + row, Int32(1), "gpu")
            row = row + 1


class NoDispatchCopyLauncher(FusedLauncher):
    """The launcher of :class:`NoDispatchCopyMoE`: the same launch, :class:`NoDispatchCopy`'s program."""

    def kernel(self, config):
        from xstage.cute_compile import cached, compile_hopper

        H, I = self.layer.hidden, self.layer.intermediate
        key = ("NoDispatchCopy", H, I, config.kernel_key())
        return cached(key, lambda: compile_hopper(NoDispatchCopy(H, I, key[-1]), *fake_launch_arguments(H, I)).fn)


class NoDispatchCopyMoE(MegaMoE):
    """A MegaMoE whose fused kernel is :class:`NoDispatchCopy` (same config, same launch)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.launcher = NoDispatchCopyLauncher(self)


def fill_pool(moe, d):
    """Rank ``d``'s dispatched pool, gathered with torch: pool row i = x[src rank][src token]
    (valid after a forward, which sizes the pool)."""
    pool = moe.launcher.dispatched_rows(d)
    xs = [moe.buffer.x.local(r) for r in range(moe.world.world_size)]
    pool.copy_(reference.gather_rows(xs, moe.planner.plan_rank(d)[0], pool.device))  # the torch dataflow's gather
