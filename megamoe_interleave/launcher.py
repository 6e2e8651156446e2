"""One layer's fused kernels: the compiled kernel of a config, the per-rank scratch, the launch
arguments (:class:`~.arguments.MegaMoEArguments`, from the host plan or the device-side plan), the
launches and the error words.

Host path (``forward``): :class:`~.host_plan.HostPlan` -> per-rank arguments -> every rank's kernel
back to back -> top-k reduction -> one read of the error words. Device path (``enqueue``, capturable):
the device-side plan (:func:`~.device_plan.plan_all_ranks` / :mod:`.plan_kernel`) writes the tables
the kernels read on a fixed grid of ``device_ctas`` CTAs; no host sync.
"""
from __future__ import annotations

import itertools
from typing import List, Sequence

import numpy as np
import torch

from . import reference
from .arguments import MegaMoEArguments, arguments_class, check_launch_arguments
from .config import BLOCK_M, QUANT_BLOCK, TRACE_FIELDS, MegaMoEConfig
from .device_plan import DevicePlan, plan_all_ranks
from .host_plan import HostPlan, persistent_ctas
from .row_grid import schedule_table
from .workspace import COUNTER_BARRIER, COUNTER_ERROR, counter_words
from xstage.world import single_process


class FusedLauncher:
    """The fused path of ``layer`` (a :class:`~megamoe_interleave.api.MegaMoE`): it reads the layer's
    shape, world, buffers and weights, and keeps the scratch that lives across calls."""

    def __init__(self, layer):
        self.layer = layer
        self.scratch = {}  # rank -> {name: flat device tensor}, reused across calls (scratch_rows)
        self.device_scratch = {}  # rank -> (pool_x, h, trace stand-in, scales) of the device path's worst case
        self.token_counts = {}  # tokens per rank (tuple) -> int64 [P] device tensor (enqueue)
        self.no_scales = None  # bf16: the stand-in of the scale arguments (scale_arguments)

    # -- kernels ------------------------------------------------------------------------------
    def kernel(self, config: MegaMoEConfig):
        from .kernel import compiled_megamoe_sm90

        return compiled_megamoe_sm90(self.layer.hidden, self.layer.intermediate, config)

    def compile(self, device_plan: bool) -> None:
        from .act_quant import compiled_act_quant
        from .plan_kernel import compiled_device_plan
        from .topk_reduce import compiled_topk_reduce

        layer = self.layer
        for c in layer.configs.values():
            self.kernel(c)
            if device_plan:
                compiled_device_plan(layer.world.world_size, layer.buffer.max_tokens, layer.topk,
                                     **self.device_plan_options(c))
        compiled_topk_reduce(layer.hidden)
        if layer.config.fp8:
            compiled_act_quant(layer.hidden)  # inputs.copy_inputs' staging (W8A8 activations)

    def device_plan_options(self, config: MegaMoEConfig) -> dict:
        layer = self.layer
        pairs_l1, pairs_l2 = config.pair_tiles(layer.hidden, layer.intermediate)
        return dict(experts_per_rank=layer.experts_per_rank, row_block=config.row_block,
                    schedule=config.schedule_spec(), num_pairs=layer.device_ctas // 2, pairs_l1=pairs_l1,
                    pairs_l2=pairs_l2, hidden=layer.hidden, intermediate=layer.intermediate,
                    experts_per_wave=config.experts_per_wave)

    # -- scratch ------------------------------------------------------------------------------
    def scratch_rows(self, d: int, name: str, rows: int, cols: int, dtype) -> torch.Tensor:
        """A contiguous [rows, cols] view of rank ``d``'s scratch ``name`` (grown by 1.25x on demand,
        capped at the worst-case pool, never shrunk). Stream order makes reuse across calls safe: a
        call's kernel runs after the previous call's on the same stream."""
        cache = self.scratch.setdefault(d, {})
        flat = cache.get(name)
        need = rows * cols
        if flat is None or flat.numel() < need:
            size = need if flat is None else min(need + need // 4, max(need, self.layer.max_pool_rows * cols))
            flat = torch.empty(size, dtype=dtype, device=self.layer.world.device)
            cache[name] = flat
        return flat[:need].view(rows, cols)

    def dispatched_rows(self, d: int) -> torch.Tensor:
        """Rank ``d``'s pool ``[n_pool, H]``: the rows its Dispatch copies (pool row i = x[src rank][src
        token] of the plan's permutation) and its Linear-1 reads. A view of scratch reused by the next
        call; valid after :meth:`launch_arguments` (a ``forward``)."""
        H = self.layer.hidden
        n = self.layer.planner.plan_rank(d)[0].src_rank.numel()
        flat = self.scratch.get(d, {}).get("pool_x")
        if flat is None or flat.numel() < n * H:
            raise RuntimeError(f"rank {d} has no pool yet: run forward() (or launch_arguments) first")
        return flat[: n * H].view(n, H)

    def scale_arguments(self, d: int, config: MegaMoEConfig, scale_rows) -> dict:
        """The FP8 scale fields of rank ``d``'s arguments: every rank's x_scales table, ``scale_rows`` =
        (pool x, h) scale scratch, w1 / w2 scales (W4A8: the widened blocks' scales and the shift
        words); bf16: the x table and [1, 1] / [1, 1, 1] stand-ins the kernel never reads."""
        layer = self.layer
        if config.precision == "w4a8":
            return dict(mPeerXScale=layer.buffer.x_scales.peer_table(d), mPoolXScale=scale_rows[0],
                        mHScale=scale_rows[1], **layer.fp4_operands[d])
        if config.precision != "w8a8":
            if self.no_scales is None:
                self.no_scales = torch.zeros(1, dtype=torch.float32, device=layer.world.device)
            z = self.no_scales
            return dict(mPeerXScale=layer.buffer.x.peer_table(d), mPoolXScale=z.view(1, 1), mHScale=z.view(1, 1),
                        mW1Scale=z.view(1, 1, 1), mW2Scale=z.view(1, 1, 1))
        return dict(mPeerXScale=layer.buffer.x_scales.peer_table(d), mPoolXScale=scale_rows[0],
                    mHScale=scale_rows[1], mW1Scale=layer.w1_scales[d], mW2Scale=layer.w2_scales[d])

    # -- host path ----------------------------------------------------------------------------
    def launch_arguments(self, d: int):
        """Rank ``d``'s launch from the host plan: (num_ctas, :class:`MegaMoEArguments`, (max_tokens,
        topk)); ``mPlan`` holds (num_rows, n_pool). Works on any device (CPU tests check it against the
        kernel's spec). ``mPoolX`` / ``mH`` are views of scratch reused across calls; the trace tensor
        (``trace=True``) is fresh per call, so ``last_trace`` survives the next call."""
        layer = self.layer
        plan = layer.planner.plan()
        config, buf, dev = plan.config, layer.buffer, layer.world.device
        i32 = dict(dtype=torch.int32, device=dev)
        perm, grid = layer.planner.plan_rank(d)
        n_pool = perm.src_rank.numel()
        if counter_words(grid.num_rows) > buf.counters[d].numel():
            raise ValueError(f"{grid.num_rows} scheduler rows exceed the counter workspace")
        if n_pool == 0:  # keep every tensor non-empty
            pool_src = torch.zeros(1, 3, **i32)
            pool_w = torch.zeros(1, dtype=torch.float32, device=dev)
        else:
            pool_src = torch.stack([perm.src_rank, perm.src_token, perm.src_pick], 1).to(torch.int32)
            pool_w = perm.weights.to(device=dev, dtype=torch.float32).contiguous()
        # BLOCK_M rows of padding: TMA reads whole M tiles (rows past an expert's tokens feed
        # accumulator rows that are never stored).
        ab, H, I = buf.x.dtype, layer.hidden, layer.intermediate  # bf16, or E4M3 (W8A8: h too)
        pool_x = self.scratch_rows(d, "pool_x", n_pool + BLOCK_M, H, ab)
        h = self.scratch_rows(d, "h", n_pool + BLOCK_M, I, ab)
        scale_rows = [self.scratch_rows(d, name, n_pool + BLOCK_M, cols // QUANT_BLOCK, torch.float32)
                      for name, cols in (("pool_x_scale", H), ("h_scale", I))] if config.fp8 else None
        num_ctas = persistent_ctas(layer.num_sms, grid)
        # The two small int32 tables in one host->device copy (pinned, asynchronous); the row
        # records first, so they are 16-byte aligned (the kernel loads each with one vector load).
        records = itertools.chain.from_iterable(grid.row_record or [(0, 0, 0, 0)])
        parts = [list(records), schedule_table(config.schedule_spec(), grid), [grid.num_rows, n_pool]]
        lens = [len(p) for p in parts]
        host = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(parts), dtype=np.int32, count=sum(lens)))
        if dev.type == "cuda":
            host = host.pin_memory()  # caching host allocator: safe to reuse once the copy is done
        records, sched_table, sizes = host.to(dev, non_blocking=True).split(lens)
        if config.trace:
            # Tiles per CTA <= ceil(all pair tiles / pairs) (+1 for safety).
            per_cta = -(-grid.num_rows * (grid.pairs_l1 + grid.pairs_l2) // (num_ctas // 2)) + 1
            trace = torch.full((num_ctas, per_cta, len(TRACE_FIELDS)), -1, dtype=torch.int64, device=dev)
            layer.last_trace[d] = trace
        else:  # unused by the kernel
            trace = self.scratch_rows(d, "no_trace", 1, len(TRACE_FIELDS), torch.int64).view(1, 1, len(TRACE_FIELDS))
        args = arguments_class(config.precision)(
            mPeerX=buf.x.peer_table(d), mPeerCombine=buf.combine.peer_table(d), mPoolSrc=pool_src, mPoolWeight=pool_w,
            mPoolX=pool_x, mH=h, mW1=layer.w1[d], mW2=layer.w2[d], mRowRecord=records.view(-1, 4),
            mScheduleTable=sched_table, mCounters=buf.counters[d], mTrace=trace, mPlan=sizes,
            **self.scale_arguments(d, config, scale_rows))
        check_launch_arguments(H, I, args, config.precision)
        return num_ctas, args, (buf.max_tokens, layer.topk)

    def run(self, plan: HostPlan) -> List[torch.Tensor]:
        """Launch every local rank's kernel of ``plan``, reduce; returns y per local rank."""
        layer = self.layer
        ranks = layer.world.local_ranks
        kernel = self.kernel(plan.config)
        layer.flush_poison()  # queued now: the fill overlaps the host work below
        launches = [self.launch_arguments(d) for d in ranks]  # host planning of every rank first ...
        # ... then every rank's kernel back to back, timed with CUDA events (kernel-only time).
        self.zero_barrier_counters()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for num_ctas, args, (max_tokens, topk) in launches:
            kernel(args, max_tokens, topk, 0, num_ctas)  # barrier_base 0: the counter was zeroed above
        end.record()
        single = single_process(layer.world)
        # Single process: the reductions are stream-ordered after every rank's kernel, so they
        # are queued before the error read-back (no idle gap); on error their output is dropped.
        ys = [layer.reduce_rank(r) for r in ranks] if single else None
        errors = layer.buffer.counters_all[:, COUNTER_ERROR].tolist()  # the one post-launch sync
        layer.last_kernel_us = start.elapsed_time(end) * 1e3
        self.raise_device_errors(errors)
        if not single:
            layer.world.barrier()  # every peer's Combine stores into our slots are complete
            ys = [layer.reduce_rank(r) for r in ranks]
        return ys

    def zero_barrier_counters(self) -> None:
        """The grid-barrier counter of every local rank to 0 before its launch, which then passes
        barrier_base 0: one small op per call, and nothing the host must remember between calls (a
        captured graph replays the same arguments)."""
        self.layer.buffer.counters_all[:, COUNTER_BARRIER].zero_()

    def raise_device_errors(self, errors: Sequence[int]) -> None:
        """DeviceError for the first non-zero error word of ``errors`` (one per local rank); the
        counter state is unusable after a timeout, so every rank's workspace is reset first."""
        from xstage.device import raise_on_device_error

        for d, code in zip(self.layer.world.local_ranks, errors):
            if code != 0:
                self.layer.buffer.counters_all.zero_()
                raise_on_device_error(code, f"MegaMoESm90 rank {d}")

    # -- device path --------------------------------------------------------------------------
    def enqueue(self, config: MegaMoEConfig, counts) -> List[torch.Tensor]:
        """The device work of ``MegaMoE.enqueue`` once the inputs are staged (``counts``: tokens per
        local rank): device-side plan, every rank's kernel on ``device_ctas`` CTAs, the reduction."""
        layer = self.layer
        buf, ranks, P = layer.buffer, layer.world.local_ranks, layer.world.world_size
        idx_all = torch.stack([buf.topk_idx.local(s) for s in range(P)])
        w_all = torch.stack([buf.topk_weights.local(s) for s in range(P)])
        num_tokens = self.device_token_counts(counts)
        self.prepare_combine_slots(idx_all, num_tokens)
        kernel = self.kernel(config)
        plans = self.device_plans(config, idx_all, w_all, num_tokens)
        args = [self.device_launch_arguments(d, config, plans) for d in ranks]
        self.zero_barrier_counters()
        for a in args:
            kernel(a, buf.max_tokens, layer.topk, 0, layer.device_ctas)
        rows = reference.slot_rows(idx_all, buf.max_tokens, layer.num_experts)  # [P, T, k]: every rank at once
        return [reference.topk_reduce(buf.combine.local(r), rows[r, :T]) for r, T in zip(ranks, counts)]

    def device_token_counts(self, counts) -> torch.Tensor:
        """int64 [P] tokens per rank on the device, one tensor per distinct ``counts`` (kept, so a
        captured graph's copy stays valid and repeated calls need no upload)."""
        if counts not in self.token_counts:
            host = torch.tensor(counts, dtype=torch.int64)
            self.token_counts[counts] = host.pin_memory().to(self.layer.world.device, non_blocking=True)
        return self.token_counts[counts]

    def prepare_combine_slots(self, idx_all: torch.Tensor, num_tokens: torch.Tensor) -> None:
        """Before the kernels: poison every read slot (``poison_combine``) and OR ERR_ROUTING into
        every rank's error word if a live pick's expert id is outside [-1, E) (such a pick is
        dropped by the plan and skipped by the reduction, like a masked one)."""
        from xstage.device import ERR_ROUTING

        layer = self.layer
        buf = layer.buffer
        live = torch.arange(buf.max_tokens, device=idx_all.device)[None, :, None] < num_tokens[:, None, None]
        bad = (live & ((idx_all < -1) | (idx_all >= layer.num_experts))).any()
        if layer.poison_combine:
            for r in layer.world.local_ranks:
                buf.combine_slots(r)[:, : buf.num_tokens[r]].fill_(float("nan"))
        buf.counters_all[:, COUNTER_ERROR].bitwise_or_(bad.to(torch.int32) * ERR_ROUTING)

    def device_plans(self, config: MegaMoEConfig, idx_all: torch.Tensor, w_all: torch.Tensor,
                     num_tokens: torch.Tensor) -> DevicePlan:
        """Every rank's device-side plan for ``config`` from every source's routing, ``idx_all`` /
        ``w_all`` [P, max_tokens, k] and ``num_tokens`` [P] on the device, for the fixed grid of
        ``device_ctas`` CTAs."""
        plan = plan_all_ranks
        if idx_all.is_cuda:  # the tables in one CuTe DSL kernel after the sort (same result)
            from .plan_kernel import plan_all_ranks_kernel as plan
        return plan(idx_all, w_all, num_tokens, **self.device_plan_options(config))

    def device_launch_arguments(self, d: int, config: MegaMoEConfig, plans: DevicePlan) -> MegaMoEArguments:
        """Rank ``d``'s arguments from :meth:`device_plans`: static shapes, ``mPoolX`` / ``mH`` scratch
        of the worst case kept per rank (never regrown, so a captured graph's pointers stay valid).
        Works on any device (CPU tests)."""
        layer = self.layer
        buf, H, I = layer.buffer, layer.hidden, layer.intermediate
        if d not in self.device_scratch:
            n_pad = layer.device_plan_sizes.max_pool + BLOCK_M
            if n_pad * (H // 8) >= 2 ** 31:
                raise ValueError(f"the device-side plan's worst-case pool ({n_pad} rows x {H // 8} 16-byte "
                                 "chunks) exceeds the kernel's int32 indexing; lower max_tokens_per_rank")
            dev = layer.world.device
            f32 = dict(dtype=torch.float32, device=dev)
            scales = ((torch.empty(n_pad, H // QUANT_BLOCK, **f32), torch.empty(n_pad, I // QUANT_BLOCK, **f32))
                      if config.fp8 else None)
            self.device_scratch[d] = (torch.empty(n_pad, H, dtype=buf.x.dtype, device=dev),
                                      torch.empty(n_pad, I, dtype=buf.x.dtype, device=dev),
                                      torch.zeros(1, 1, len(TRACE_FIELDS), dtype=torch.int64, device=dev), scales)
        pool_x, h, no_trace, scales = self.device_scratch[d]
        args = arguments_class(config.precision)(
            mPeerX=buf.x.peer_table(d), mPeerCombine=buf.combine.peer_table(d), mPoolSrc=plans.pool_src[d],
            mPoolWeight=plans.pool_weight[d], mPoolX=pool_x, mH=h, mW1=layer.w1[d], mW2=layer.w2[d],
            mRowRecord=plans.row_record[d], mScheduleTable=plans.schedule_table[d], mCounters=buf.counters[d],
            mTrace=no_trace, mPlan=plans.sizes[d], **self.scale_arguments(d, config, scales))
        check_launch_arguments(H, I, args, config.precision)
        return args
