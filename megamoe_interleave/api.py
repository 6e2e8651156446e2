"""Python API in the spirit of ``deep_gemm.mega``: symmetric buffer, weight transform, forward.

::

    world = make_world("loopback", world_size=P, device="cuda")
    moe = MegaMoE(world, num_experts=E, hidden=H, intermediate=I, topk=k, max_tokens_per_rank=T,
                  config=MegaMoEConfig(schedule="interleaved"))   # None fields: tuned defaults
    moe.load_weights(w1, w2)          # global [E, 2I, H] (gate | up) and [E, H, I]
    ys = moe(xs, topk_idx, topk_weights)   # one tensor per local rank

Data flow per call (the fused kernel's contract; the ``torch`` backend executes the
same flow with torch ops so the buffer layout and the Combine slot protocol are tested
everywhere):

1. each rank copies its tokens / routing into its symmetric ``x``, ``topk_idx``,
   ``topk_weights`` (skipped when the caller passes views of those buffers) and, with
   ``poison_combine``, poisons the ``combine`` slots that step 5 reads;
2. Dispatch: rank d pulls the rows routed to its experts from every source rank's
   symmetric ``x`` (via the peer table), expert-major;
3. L1 grouped GEMM + SwiGLU x routing weight, L2 grouped GEMM, in the scheduler's
   tile order (kernel only);
4. Combine: each L2 output row is written to ``combine[pick, token]`` on its source rank;
5. after all ranks' stores are visible, every rank reduces its own ``combine`` over
   the valid picks into ``y``.

W8A8 (``MegaMoEConfig(precision="w8a8")``; the fused kernel's FP8 parts in
:mod:`~megamoe_interleave.sm90_fp8`, ``backend="torch"`` is the recipe's emulation): ``x`` holds E4M3
rows and ``x_scales`` their per-token 1x128 FP32 scales (step 1 quantizes BF16 inputs), Dispatch
moves both, L1 / L2 run the recipe of :mod:`~megamoe_interleave.quant` (h re-quantized 1x128
between them) and Combine stays BF16, into the same slots.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import List, Optional, Sequence, Union

import numpy as np
import torch

from . import quant, reference, torch_backend
from .config import AUTO, BLOCK_M, QUANT_BLOCK, TRACE_FIELDS, MegaMoEConfig, check_launch_arguments
from .device_plan import DevicePlan, plan_all_ranks, plan_sizes
from .scheduler import balanced_l2_start, make_row_grid, schedule_table
from .shapes import MoEShape
from .weights import transform_weights, untransform_w1  # noqa: F401  (re-exported: the layout is part of the API)
from .workspace import COUNTER_BARRIER, COUNTER_ERROR, MegaMoEBuffer, counter_words
from xstage.world import make_world, single_process  # noqa: F401  (make_world: re-export for callers)

BACKENDS = ("torch", "fused")


class MegaMoE:
    """Expert-parallel MoE layer over ``world`` (``num_experts / P`` experts per rank).

    ``config``: a :class:`~megamoe_interleave.config.MegaMoEConfig` (schedule "interleaved",
    paper Algorithm 1, "expert_wave", or "auto": chosen by the model for the world's remote path,
    :attr:`schedule_choice` says what and why; tiles, ring depth, Dispatch, trace, wait bound); its
    ``None`` fields are resolved once for this layer's shape (:meth:`MegaMoEConfig.resolve`) and
    :attr:`config` holds the result. ``backend``: "fused" (the CuTe DSL kernel; CUDA) or "torch"
    (the same data flow with torch ops, any device, single-process worlds); None = "fused" on a
    CUDA world. ``num_sms``: CTAs of the persistent launch at most (None = the device's SMs).

    ``config.precision`` "w8a8" selects the FP8 recipe (:mod:`~megamoe_interleave.quant`): a
    config field, not an eleventh constructor parameter (the constructor stays at ten), since it
    decides what the kernel is compiled for and which tiles resolve.

    ``poison_combine`` (default True): NaN into the Combine slots the top-k reduction reads before
    each call, so a slot the kernel failed to write shows up as NaN in ``y`` (correctness tests keep
    it on; benchmarks may turn it off: one k x T x H bf16 fill per rank per call). Masked picks (-1)
    are excluded from the reduction either way.

    Host work per fused ``forward`` (single-process worlds): two device->host reads before the
    launch (expert-id bounds, per-expert counts of every local rank from one sort), one upload of
    the scheduler tables per rank, one read of the error words after the launch. :meth:`enqueue`
    plans on the device instead (no host sync; errors via :meth:`check`) and :meth:`capture`
    records it as one CUDA graph (:mod:`~megamoe_interleave.graph`).
    """

    def __init__(self, world, num_experts: int, hidden: int, intermediate: int, topk: int,
                 max_tokens_per_rank: int, config: Optional[MegaMoEConfig] = None, *, backend: Optional[str] = None,
                 num_sms: Optional[int] = None, poison_combine: bool = True):
        # Misuse of the constructor fails here, with what was passed, before anything is resolved or allocated.
        from xstage.world import World

        if not isinstance(world, World):
            raise TypeError(f"world must be an xstage World (make_world('loopback' | 'host' | 'torch-symm' | 'nvshmem',"
                            f" world_size=P)), got {type(world).__name__} {world!r:.80}")
        for name, v in (("num_experts", num_experts), ("hidden", hidden), ("intermediate", intermediate),
                        ("topk", topk), ("max_tokens_per_rank", max_tokens_per_rank), ("num_sms", num_sms)):
            if (v is not None or name != "num_sms") and (isinstance(v, bool) or not isinstance(v, (int, np.integer))):
                raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r:.80}")
        if config is not None and not isinstance(config, MegaMoEConfig):
            raise TypeError(f"config must be a MegaMoEConfig or None, got {type(config).__name__} {config!r:.80}"
                            + ("; backend is a keyword of MegaMoE itself: MegaMoE(..., backend=...)"
                               if isinstance(config, str) else ""))
        if num_sms is not None and num_sms <= 0:
            raise ValueError(f"num_sms must be positive, got {num_sms}")
        P = world.world_size
        if min(num_experts, hidden, intermediate, topk, max_tokens_per_rank) <= 0:
            raise ValueError("num_experts, hidden, intermediate, topk and max_tokens_per_rank must be positive")
        if topk > num_experts:
            raise ValueError(f"topk {topk} > num_experts {num_experts}")
        if backend is None:
            backend = "fused" if world.device.type == "cuda" else "torch"
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(world.device).multi_processor_count \
                if world.device.type == "cuda" else 132
        shape = MoEShape("MegaMoE", hidden, intermediate, num_experts, topk, "caller")
        config = config or MegaMoEConfig()
        # schedule="auto": the model picks the schedule for this world's remote path (host arithmetic):
        # here for balanced routing at max_tokens_per_rank (enqueue / capture keep it), and in each
        # forward again from the call's routing where there is a remote path (_choose_for_call).
        platform = _remote_path(world) if config.schedule == AUTO else None
        self._auto_model = None if platform is None else config.auto_model(shape, P, max_tokens_per_rank, num_sms, platform)
        config, self.schedule_choice = config.choose_schedule(shape, P, max_tokens_per_rank, num_sms, platform)
        self.last_schedule_choice = self.schedule_choice  # the last forward's (per call with a remote path)
        self._configs = {s: dataclasses.replace(config, schedule=s).resolve(shape, P, max_tokens_per_rank, num_sms)
                         for s in ((config.schedule,) if self._auto_model is None else ("interleaved", "expert_wave"))}
        self.world, self.backend, self.num_sms = world, backend, num_sms
        self.num_experts, self.hidden, self.intermediate, self.topk = num_experts, hidden, intermediate, topk
        self.experts_per_rank = num_experts // P
        self._use_schedule(config.schedule)
        if backend == "fused":  # the kernel's own checks now (no compile, no launch)
            from .kernel import make_kernel

            for c in self._configs.values():
                make_kernel(hidden, intermediate, c)
        # Largest pool of one rank (every pick of every source) + the BLOCK_M padding rows.
        self._max_pool_rows = P * max_tokens_per_rank * min(topk, self.experts_per_rank) + BLOCK_M
        if backend == "fused" and self._max_pool_rows * (hidden // 8) >= 2 ** 31:
            raise ValueError(f"max_tokens_per_rank={max_tokens_per_rank}: the fused kernel indexes the dispatched "
                             f"rows in 16-byte chunks with int32 ({self._max_pool_rows} rows x {hidden // 8} chunks "
                             f">= 2^31); lower max_tokens_per_rank")
        # The device-side plan's launch: a fixed grid (the host cannot see the routing) and its static
        # sizes; its worst-case scheduler rows also size the counter workspace of both paths.
        self.device_ctas = max(2, num_sms - num_sms % 2)
        sizes = {s: plan_sizes(P, max_tokens_per_rank, topk, self.experts_per_rank, block_m=BLOCK_M,
                               schedule=c.schedule_spec(), num_pairs=self.device_ctas // 2,
                               experts_per_wave=c.experts_per_wave) for s, c in self._configs.items()}
        self.device_plan_sizes = sizes[config.schedule]
        self.buffer = MegaMoEBuffer(world, hidden=hidden, topk=topk, max_tokens_per_rank=max_tokens_per_rank,
                                    num_counters=counter_words(max(z.max_rows for z in sizes.values())),
                                    precision=self.config.precision)
        self.poison_combine = poison_combine
        self.last_trace = {}  # rank -> int64 [num_ctas, max_tiles, len(TRACE_FIELDS)] (config.trace)
        self.last_kernel_us = None  # device time of the last fused call (all local ranks)
        self._scratch = {}  # rank -> {name: flat device tensor}, reused across calls (see _scratch_rows)
        self._device_scratch = {}  # rank -> (pool_x, h, trace stand-in) of the device-side path's worst case
        self._token_counts = {}  # tokens per rank (tuple) -> int64 [P] device tensor (enqueue)
        self._generation = 0  # bumped by stage_inputs; the plan cache is valid for one generation
        self._plans = (-1, {})  # (generation, {rank: (Permutation, RowGrid)})
        self._poison_pending = False
        self._no_scales = None  # bf16: the kernel's scale arguments' stand-in (_scale_arguments)
        self.w1 = {}
        self.w2 = {}
        self.w1_scales = {}  # w8a8: rank -> FP32 block scales of w1 / w2 (quant.quantize_weights)
        self.w2_scales = {}

    # -- weights -----------------------------------------------------------
    def _check_weight_shapes(self, w1: torch.Tensor, w2: torch.Tensor, dtype) -> None:
        E, H, inter = self.num_experts, self.hidden, self.intermediate
        if w1.shape != (E, 2 * inter, H) or w2.shape != (E, H, inter):
            raise ValueError(f"expected w1 {(E, 2*inter, H)} and w2 {(E, H, inter)}, got {tuple(w1.shape)}, {tuple(w2.shape)}")
        if w1.dtype != dtype or w2.dtype != dtype:
            raise ValueError(f"weights must be {dtype}, got {w1.dtype}, {w2.dtype}")

    def load_weights(self, w1: torch.Tensor, w2: torch.Tensor) -> None:
        """Global bf16 weights ``w1`` [E, 2I, H] (gate | up), ``w2`` [E, H, I]; each local rank keeps
        its slice in the kernel layout (:func:`transform_weights`), for ``precision="w8a8"``
        quantized to it (:func:`quant.quantize_weights`: interleave, then 128x128 blocks)."""
        self._check_weight_shapes(w1, w2, self.buffer.dtype)
        el = self.experts_per_rank
        for r in self.world.local_ranks:
            sl = slice(r * el, (r + 1) * el)
            if self.config.precision == "w8a8":
                self._keep_quantized(r, *quant.quantize_weights(w1[sl], w2[sl]))
            else:
                w1_il, w2_c = transform_weights(w1[sl], w2[sl])
                self.w1[r] = w1_il.to(self.world.device)
                self.w2[r] = w2_c.to(self.world.device)

    def load_quantized_weights(self, w1_q: torch.Tensor, w1_s: torch.Tensor, w2_q: torch.Tensor,
                               w2_s: torch.Tensor) -> None:
        """``precision="w8a8"``: global E4M3 weights already in the kernel layout, as
        :func:`quant.quantize_weights` returns them (``w1_q`` [E, 2I, H] gate/up interleaved with
        ``w1_s`` [E, 2I/128, H/128] over the interleaved rows, ``w2_q`` [E, H, I] with ``w2_s``
        [E, H/128, I/128], FP32 scales), kept bit for bit. A DeepGEMM / DeepSeek FP8 checkpoint
        (w1 blocks over gate | up rows) goes through :func:`quant.from_deepgemm_layout` first."""
        if self.config.precision != "w8a8":
            raise ValueError("load_quantized_weights needs MegaMoEConfig(precision='w8a8')")
        self._check_weight_shapes(w1_q, w2_q, quant.E4M3)
        E, H, inter, b = self.num_experts, self.hidden, self.intermediate, QUANT_BLOCK
        want = ((E, 2 * inter // b, H // b), (E, H // b, inter // b))
        if (w1_s.shape, w2_s.shape) != want or w1_s.dtype != torch.float32 or w2_s.dtype != torch.float32:
            raise ValueError(f"expected float32 scales w1_s {want[0]} and w2_s {want[1]}, got "
                             f"{w1_s.dtype} {tuple(w1_s.shape)}, {w2_s.dtype} {tuple(w2_s.shape)}")
        el = self.experts_per_rank
        for r in self.world.local_ranks:
            sl = slice(r * el, (r + 1) * el)
            self._keep_quantized(r, w1_q[sl], w1_s[sl], w2_q[sl], w2_s[sl])

    def _keep_quantized(self, r: int, w1_q, w1_s, w2_q, w2_s) -> None:
        dev = self.world.device
        self.w1[r], self.w1_scales[r] = w1_q.to(dev).contiguous(), w1_s.to(dev).contiguous()
        self.w2[r], self.w2_scales[r] = w2_q.to(dev).contiguous(), w2_s.to(dev).contiguous()

    # -- forward -----------------------------------------------------------
    def _as_rank_list(self, v) -> List[torch.Tensor]:
        if isinstance(v, torch.Tensor):
            return [v]
        return list(v)

    def forward(self, x: Union[torch.Tensor, Sequence[torch.Tensor]], topk_idx, topk_weights, x_scales=None):
        """``x`` [T_r, H] bf16, ``topk_idx`` [T_r, k] (global expert ids, -1 = masked),
        ``topk_weights`` [T_r, k] f32, one per local rank (a list in the loopback world,
        tensors in the torch-symm world). Returns y with x's shape per local rank, bf16.

        ``precision="w8a8"``: ``x`` bf16 (quantized per token and 128-group on the way in) or
        E4M3 with ``x_scales`` [T_r, H/128] f32 per rank (:func:`quant.quantize_act`'s layout,
        used as given); ``x_scales`` must be None for bf16 ``x`` and in bf16 precision."""
        xs, idxs, ws = self._as_rank_list(x), self._as_rank_list(topk_idx), self._as_rank_list(topk_weights)
        ranks = self.world.local_ranks
        self.stage_inputs(xs, idxs, ws, None if x_scales is None else self._as_rank_list(x_scales))
        if self.backend == "fused":
            return self._run_fused()
        self._flush_poison()
        torch_backend.run_dataflow(self)
        self.world.barrier()
        return [self.reduce_rank(r) for r in ranks]

    __call__ = forward

    def rerun(self) -> List[torch.Tensor]:
        """The fused kernels and the top-k reduction again, on the inputs the last ``forward``
        staged, with its plan (no input copies, no host planning, no Combine poison): the
        device work of one call, for benchmarks that measure it (scripts/diag/megamoe_energy.py).
        Returns y per local rank, equal to that ``forward``'s."""
        if self.backend != "fused":
            raise ValueError("rerun() repeats the fused kernels: backend='fused' only")
        if self._plans[0] != self._generation or not self._plans[1]:
            raise RuntimeError("rerun() needs a forward() first")
        return self._run_fused()

    def set_trace(self, enabled: bool) -> None:
        """Per-tile tracing (``MegaMoEConfig.trace``) on or off for the calls that follow, on this
        object: its buffers, weights, scratch and the staged inputs' plan stay (``rerun()`` still
        applies), so a traced and an untraced call of one problem can alternate (the trace's
        overhead, :mod:`lab.megamoe.sweep`). Only the compiled kernel changes (its own
        compile-cache key; compiled on the first call that uses it). ``last_trace`` keeps the
        last traced call's tensors."""
        self._configs = {s: dataclasses.replace(c, trace=bool(enabled)) for s, c in self._configs.items()}
        self.config = self._configs[self.config.schedule]

    def _use_schedule(self, schedule: str) -> None:
        """Make ``schedule``'s resolved config the one the next plan and launch use."""
        self.config = self._configs[schedule]
        self.schedule = self.config.schedule_spec()
        self.block_n = self.config.block_n

    def _choose_for_call(self, perms) -> None:
        """``schedule="auto"`` with a remote path: the schedule for this call from its routing, the
        rows per local expert of every local rank (``perms``, the host plan's one device read;
        no further sync). The choice is per process: a multi-process world's ranks may differ,
        which the kernels allow (their dependencies are the Dispatch publish and the Combine)."""
        from xstage import planner

        plan, waves = self._auto_model
        rows = [perms[d].counts_host[: self.experts_per_rank] for d in sorted(perms)]
        choice = planner.schedule_choice_of(plan, waves=waves, expert_rows=rows)  # host arithmetic: ~40-50 us at 384 experts
        self.last_schedule_choice = choice
        self._use_schedule(choice.schedule)

    def stage_inputs(self, xs, idxs, ws, x_scales=None) -> None:
        """Validate every rank's inputs, copy them into its symmetric buffers, schedule the
        Combine poison and synchronize the world (sources publish before anyone pulls).

        Inputs that already are the leading rows of the rank's symmetric buffers (e.g.
        ``moe.buffer.x.local(r)[:T]`` written by the caller) are not copied; ``x_scales``: see
        :meth:`forward` (W8A8: bf16 ``x`` is quantized into ``x`` / ``x_scales``). The expert-id
        range of all ranks is checked with one device sync. In multi-process worlds the
        poison is written here, before the world barrier; in single-process worlds stream
        order suffices, so it is deferred to just before the launch (see ``_flush_poison``)."""
        self._check_inputs(xs, idxs, ws, x_scales)
        self._generation += 1  # the buffers change: any cached plan is stale
        staged_idx = self._copy_inputs(xs, idxs, ws, x_scales)
        # Expert ids in range before any launch: one read-back for every local rank.
        buf, ranks = self.buffer, self.world.local_ranks
        bounds = reference.routing_bounds(staged_idx)
        for b in bounds:
            reference.check_expert_range(b, self.num_experts)
        for r, xr in zip(ranks, xs):
            buf.num_tokens[r] = xr.shape[0]
        self._poison_pending = self.poison_combine
        if not single_process(self.world):
            self._flush_poison()
            # Sources must have published x (and everyone poisoned) before any rank pulls
            # x or stores into a peer's combine (kernel Dispatch / Combine).
            self.world.barrier()

    def _check_inputs(self, xs, idxs, ws, x_scales) -> None:
        """Every check of the staged inputs that needs no device read (count, dtypes, shapes)."""
        ranks = self.world.local_ranks
        if not (len(xs) == len(idxs) == len(ws) == len(ranks)):
            raise ValueError(f"need one input per local rank ({len(ranks)}), got {len(xs)}/{len(idxs)}/{len(ws)}")
        if not self.w1:
            raise RuntimeError("call load_weights() first")
        buf = self.buffer
        w8a8 = self.config.precision == "w8a8"
        if x_scales is not None and (not w8a8 or len(x_scales) != len(xs)):
            raise ValueError("x_scales (one per local rank) go with E4M3 x and precision='w8a8' only")
        for i, (xr, ir, wr) in enumerate(zip(xs, idxs, ws)):
            want = buf.x.dtype if x_scales is not None else buf.dtype
            if xr.dtype != want:
                raise ValueError(f"x must be {want}, got {xr.dtype}"
                                 + (" (E4M3 x comes with x_scales)" if w8a8 and x_scales is None else ""))
            reference.check_routing_shapes(xr, ir, wr)
            if xr.shape[1] != self.hidden or ir.shape[1] != self.topk:
                raise ValueError(f"x must be [T, {self.hidden}] and topk_idx [T, {self.topk}]")
            if x_scales is not None and (x_scales[i].dtype != torch.float32
                                         or x_scales[i].shape != (xr.shape[0], self.hidden // QUANT_BLOCK)):
                raise ValueError(f"x_scales must be float32 [T, {self.hidden // QUANT_BLOCK}], got "
                                 f"{x_scales[i].dtype} {tuple(x_scales[i].shape)}")
            if xr.shape[0] > buf.max_tokens:
                raise ValueError(f"{xr.shape[0]} tokens > max_tokens_per_rank {buf.max_tokens}")

    def _copy_inputs(self, xs, idxs, ws, x_scales) -> List[torch.Tensor]:
        """Copy each rank's inputs into its symmetric buffers (skipping inputs that are those
        buffers' leading rows; W8A8 quantizes bf16 x); returns the staged topk_idx views."""
        buf, ranks = self.buffer, self.world.local_ranks
        w8a8 = self.config.precision == "w8a8"
        staged_idx = []
        for i, (r, xr, ir, wr) in enumerate(zip(ranks, xs, idxs, ws)):
            T = xr.shape[0]
            if not w8a8:
                rows = [(buf.x.local(r)[:T], xr)]
            else:  # E4M3 rows and their scales, quantized here from bf16 x
                x_q, x_s = quant.quantize_act(xr) if x_scales is None else (xr, x_scales[i])
                rows = [(buf.x.local(r)[:T], x_q), (buf.x_scales.local(r)[:T], x_s)]
            for dst, src in rows + [(buf.topk_idx.local(r)[:T], ir), (buf.topk_weights.local(r)[:T], wr)]:
                if not _same_memory(dst, src):
                    dst.copy_(src)
            staged_idx.append(buf.topk_idx.local(r)[:T])
        return staged_idx

    def _flush_poison(self) -> None:
        """NaN into the combine slots the reduction reads (``[:, :T]`` per local rank), once
        per staged call when ``poison_combine``: every read slot must then be written."""
        if not self._poison_pending:
            return
        for r in self.world.local_ranks:
            self.buffer.combine_slots(r)[:, : self.buffer.num_tokens[r]].fill_(float("nan"))
        self._poison_pending = False

    # -- fused kernel (kernel_sm90.MegaMoESm90) ---------------------------------
    def _kernel(self, config: Optional[MegaMoEConfig] = None):
        from xstage.cute_compile import cached

        from .kernel import compile_megamoe_sm90, kernel_sources

        key = ("MegaMoESm90", self.hidden, self.intermediate, (config or self.config).kernel_key())
        return cached(key, lambda: compile_megamoe_sm90(self.hidden, self.intermediate, key[-1]),
                      sources=kernel_sources())

    def compile(self, *, device_plan: bool = False) -> None:
        """Compile what this layer launches before its first call, on any host (a CPU machine
        compiles for sm_90a; with ``XSTAGE_KERNEL_CACHE`` the objects are kept for a GPU host,
        :func:`xstage.cute_compile.cached`): the fused kernel of every schedule the layer may run,
        the top-k reduction and, with ``device_plan``, the device-side plan (enqueue / capture)."""
        from .plan_kernel import compiled_device_plan
        from .topk_reduce import compiled_topk_reduce

        if self.backend != "fused":
            raise ValueError("compile() builds the fused kernels: backend='fused' only")
        for c in self._configs.values():
            self._kernel(c)
            if device_plan:
                compiled_device_plan(self.world.world_size, self.buffer.max_tokens, self.topk, self.experts_per_rank,
                                     block_m=BLOCK_M, schedule=c.schedule_spec(), num_pairs=self.device_ctas // 2,
                                     pairs_l1=2 * self.intermediate // c.block_n, pairs_l2=self.hidden // c.block_n,
                                     hidden=self.hidden, intermediate=self.intermediate,
                                     experts_per_wave=c.experts_per_wave)
        compiled_topk_reduce(self.hidden)

    def plan_rank(self, d: int):
        """Host part of Dispatch for destination rank ``d``: the expert-major pool and the
        scheduler tables (the kernel does the row pull, both GEMMs and Combine).

        The first call after :meth:`stage_inputs` plans every local rank at once (one sort,
        one device sync); later calls for the same staged inputs return the cached plan."""
        gen, plans = self._plans
        if gen != self._generation or d not in plans:
            plans = self._plan_local_ranks()
            self._plans = (self._generation, plans)
        if d not in plans:
            raise ValueError(f"rank {d} is not a local rank of this process")
        return plans[d]

    def _plan_local_ranks(self):
        idxs, ws = self._all_routing()
        perms = reference.permute_ranks(idxs, ws, self.world.local_ranks, self.experts_per_rank)
        if self._auto_model is not None:
            self._choose_for_call(perms)
        out = {}
        for d, perm in perms.items():
            grid = make_row_grid(perm.counts_host, block_m=BLOCK_M, n_blocks_l1=2 * self.intermediate // self.block_n,
                                 n_blocks_l2=self.hidden // self.block_n,
                                 experts_per_wave=self.config.experts_per_wave, pair_splits_m=True)
            if self.schedule.balance_l2:
                grid = dataclasses.replace(grid, l2_start=balanced_l2_start(
                    grid, self.num_ctas(grid) // 2, block_m=BLOCK_M, hidden=self.hidden,
                    intermediate=self.intermediate))
            out[d] = (perm, grid)
        return out

    def num_ctas(self, grid) -> int:
        """Persistent grid of the fused launch: at most one CTA per SM so every CTA is resident
        (the dependency waits and grid barriers rely on it); even for the CTA pairs."""
        return max(2, min(self.num_sms - self.num_sms % 2,
                          2 * max(grid.num_rows, 1) * max(grid.pairs_l1, grid.pairs_l2)))

    def _all_routing(self):
        """Every source rank's routing (the host part of Dispatch needs all of them):
        read from the local buffers in one-process worlds, all-gathered in torch-symm."""
        buf, P = self.buffer, self.world.world_size
        if single_process(self.world):
            T = buf.num_tokens
            return ([buf.topk_idx.local(s)[: T[s]] for s in range(P)],
                    [buf.topk_weights.local(s)[: T[s]] for s in range(P)])
        import torch.distributed as dist  # code path for several GPUs; not exercised on one GPU

        (r,) = self.world.local_ranks
        t = torch.tensor([buf.num_tokens[r]], device=self.world.device)
        ts = [torch.empty_like(t) for _ in range(P)]
        dist.all_gather(ts, t)
        idx_all = [torch.empty_like(buf.topk_idx.local(r)) for _ in range(P)]
        w_all = [torch.empty_like(buf.topk_weights.local(r)) for _ in range(P)]
        dist.all_gather(idx_all, buf.topk_idx.local(r))
        dist.all_gather(w_all, buf.topk_weights.local(r))
        ns = torch.cat(ts).tolist()  # one read-back for every rank's token count
        return ([i[:n] for i, n in zip(idx_all, ns)], [w[:n] for w, n in zip(w_all, ns)])

    def _scratch_rows(self, d: int, name: str, rows: int, cols: int, dtype) -> torch.Tensor:
        """A contiguous [rows, cols] view of rank ``d``'s cached scratch ``name`` (grown
        by 1.25x on demand, capped at the worst-case pool, never shrunk). Stream order makes reuse
        across calls safe: a call's kernel runs after the previous call's on the same stream."""
        cache = self._scratch.setdefault(d, {})
        flat = cache.get(name)
        need = rows * cols
        if flat is None or flat.numel() < need:
            size = need if flat is None else min(need + need // 4, max(need, self._max_pool_rows * cols))
            flat = torch.empty(size, dtype=dtype, device=self.world.device)
            cache[name] = flat
        return flat[:need].view(rows, cols)

    def dispatched_rows(self, d: int) -> torch.Tensor:
        """Rank ``d``'s pool, ``[n_pool, H]``: the rows its Dispatch copies (pool row i =
        x[src rank][src token] of :meth:`plan_rank`'s permutation) and its Linear-1 reads. A view
        of scratch reused by the next call; valid after :meth:`launch_arguments` (a ``forward``)."""
        n = self.plan_rank(d)[0].src_rank.numel()
        flat = self._scratch.get(d, {}).get("pool_x")
        if flat is None or flat.numel() < n * self.hidden:
            raise RuntimeError(f"rank {d} has no pool yet: run forward() (or launch_arguments) first")
        return flat[: n * self.hidden].view(n, self.hidden)

    def launch_arguments(self, d: int):
        """Host planning for rank ``d``: (num_ctas, tensor args, scalar args w/o barrier_base
        and num_ctas) of :class:`kernel_sm90.MegaMoESm90`; the last tensor (``mPlan``) holds
        (num_rows, n_pool). Works on any device (CPU tests check the arguments against the
        kernel's signature).

        ``pool_x`` / ``h`` are views of per-rank scratch reused across calls; the trace
        tensor (``trace=True``) is fresh per call so ``last_trace`` survives the next call."""
        buf, dev = self.buffer, self.world.device
        i32 = dict(dtype=torch.int32, device=dev)
        perm, grid = self.plan_rank(d)
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
        ab = buf.x.dtype  # bf16, or E4M3 (W8A8: h too)
        pool_x = self._scratch_rows(d, "pool_x", n_pool + BLOCK_M, self.hidden, ab)
        h = self._scratch_rows(d, "h", n_pool + BLOCK_M, self.intermediate, ab)
        if self.config.precision == "w8a8":
            scale_rows = [self._scratch_rows(d, name, n_pool + BLOCK_M, cols // QUANT_BLOCK, torch.float32)
                          for name, cols in (("pool_x_scale", self.hidden), ("h_scale", self.intermediate))]
        else:
            scale_rows = None
        num_ctas = self.num_ctas(grid)
        # The two small int32 tables in one host->device copy (pinned, asynchronous); the row
        # records first, so they are 16-byte aligned (the kernel loads each with one vector load).
        records = itertools.chain.from_iterable(grid.row_record or [(0, 0, 0, 0)])
        parts = [list(records), schedule_table(self.schedule, grid), [grid.num_rows, n_pool]]
        lens = [len(p) for p in parts]
        host = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(parts), dtype=np.int32, count=sum(lens)))
        if dev.type == "cuda":
            host = host.pin_memory()  # caching host allocator: safe to reuse once the copy is done
        records, sched_table, plan = host.to(dev, non_blocking=True).split(lens)
        records = records.view(-1, 4)
        if self.config.trace:
            # Tiles per CTA <= ceil(all pair tiles / pairs) (+1 for safety).
            per_cta = -(-grid.num_rows * (grid.pairs_l1 + grid.pairs_l2) // (num_ctas // 2)) + 1
            trace = torch.full((num_ctas, per_cta, len(TRACE_FIELDS)), -1, dtype=torch.int64, device=dev)
            self.last_trace[d] = trace
        else:
            trace = self._scratch_rows(d, "no_trace", 1, len(TRACE_FIELDS), torch.int64).view(
                1, 1, len(TRACE_FIELDS))  # unused by the kernel
        tensors = (buf.x.peer_table(d), buf.combine.peer_table(d), pool_src, pool_w, pool_x, h,
                   self.w1[d], self.w2[d], records, sched_table, buf.counters[d],
                   trace, plan) + self._scale_arguments(d, scale_rows)
        check_launch_arguments(self.hidden, self.intermediate, tensors, self.config.precision)
        return num_ctas, tensors, (buf.max_tokens, self.topk)

    def _scale_arguments(self, d: int, scale_rows) -> tuple:
        """The kernel's five W8A8 scale arguments for rank ``d`` (config.tensor_argument_spec):
        every rank's x_scales table, ``scale_rows`` = (pool x, h) scale scratch, w1 / w2 scales;
        bf16: the x table and [1, 1] / [1, 1, 1] stand-ins the kernel never reads."""
        if scale_rows is None:
            if self._no_scales is None:
                self._no_scales = torch.zeros(1, dtype=torch.float32, device=self.world.device)
            z = self._no_scales
            return (self.buffer.x.peer_table(d), z.view(1, 1), z.view(1, 1), z.view(1, 1, 1), z.view(1, 1, 1))
        return (self.buffer.x_scales.peer_table(d), *scale_rows, self.w1_scales[d], self.w2_scales[d])

    def _run_fused(self) -> List[torch.Tensor]:
        """Plan, launch every local rank's kernel, reduce; returns y per local rank."""
        dev = self.world.device
        if dev.type != "cuda":
            raise RuntimeError("backend='fused' needs a CUDA device")
        ranks = self.world.local_ranks
        self.plan_rank(ranks[0])  # every local rank's plan: the one planning sync
        kernel = self._kernel()  # after planning: schedule="auto" may have switched the schedule
        self._flush_poison()  # queued now: the fill overlaps the host work below
        launches = []
        for d in ranks:  # host planning of every rank first ...
            num_ctas, tensors, scalars = self.launch_arguments(d)
            launches.append((d, num_ctas, tensors + scalars))
        # ... then every rank's kernel back to back, timed with CUDA events (kernel-only time).
        self._zero_barrier_counters()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _, num_ctas, args in launches:
            kernel(*args, 0, num_ctas)  # barrier_base 0: the counter was zeroed above
        end.record()
        buf = self.buffer
        single = single_process(self.world)
        # Single process: the reductions are stream-ordered after every rank's kernel, so they
        # are queued before the error read-back (no idle gap); on error their output is dropped.
        ys = [self.reduce_rank(r) for r in ranks] if single else None
        errors = buf.counters_all[:, COUNTER_ERROR].tolist()  # the one post-launch sync (waits for kernels and reductions)
        self.last_kernel_us = start.elapsed_time(end) * 1e3
        self._raise_device_errors(errors)
        if not single:
            self.world.barrier()  # every peer's Combine stores into our slots are complete
            ys = [self.reduce_rank(r) for r in ranks]
        return ys

    def _zero_barrier_counters(self) -> None:
        """The grid-barrier counter of every local rank to 0 before its launch, which then passes
        barrier_base 0: one small op per call, and nothing the host must remember between calls (a
        captured graph replays the same arguments)."""
        self.buffer.counters_all[:, COUNTER_BARRIER].zero_()

    def _raise_device_errors(self, errors: Sequence[int]) -> None:
        """DeviceError for the first non-zero error word of ``errors`` (one per local rank); the
        counter state is unusable after a timeout, so every rank's workspace is reset first."""
        from xstage.device import raise_on_device_error

        for d, code in zip(self.world.local_ranks, errors):
            if code != 0:
                self.buffer.counters_all.zero_()
                raise_on_device_error(code, f"MegaMoESm90 rank {d}")

    def check(self) -> None:
        """Raise the device errors of the calls since the last check (:meth:`enqueue`, graph
        replays): a timed-out wait in the kernel, an expert id out of range found by the device-side
        plan (:data:`xstage.device.ERR_ROUTING`). Reads every local rank's error word: one device
        sync, so call it outside the hot path (after a step, in a debug mode)."""
        self._raise_device_errors(self.buffer.counters_all[:, COUNTER_ERROR].tolist())

    # -- the device-side plan: no host sync, CUDA-graph capturable ----------------------
    def enqueue(self, x, topk_idx, topk_weights) -> List[torch.Tensor]:
        """:meth:`forward` without a host sync: stage the inputs, plan every rank on the device
        (:func:`~megamoe_interleave.device_plan.plan_all_ranks`), launch the fused kernels on a
        fixed grid of ``device_ctas`` CTAs, reduce. Only enqueues work on the current stream, so
        it can be captured in a CUDA graph (:meth:`capture`). Input checks that need no device
        read run first; an expert id out of range and a timed-out wait go to the error word, raised
        by :meth:`check`. Returns y per local rank (valid once the stream reaches it).

        Single-process worlds (loopback, loopback+host, host), ``trace`` off; W8A8 takes bf16 x
        and quantizes it on the device. The first call allocates each rank's worst-case pool
        scratch, (P * max_tokens * k + 128) x (H + I) elements (every pick of every source on one
        rank), since the host does not see the routing."""
        if self.backend != "fused":
            raise ValueError("enqueue() launches the fused kernel: backend='fused' only")
        if not single_process(self.world):
            raise NotImplementedError("the device-side plan reads every source's routing in one process; "
                                      "multi-process worlds (torch-symm, nvshmem) use forward()")
        if self.config.trace:
            raise NotImplementedError("enqueue() runs the kernel without the per-tile trace")
        self._use_schedule(self.schedule_choice.schedule if self._auto_model is not None else self.config.schedule)
        if self.world.device.type != "cuda":
            raise RuntimeError("backend='fused' needs a CUDA device")
        xs, idxs, ws = self._as_rank_list(x), self._as_rank_list(topk_idx), self._as_rank_list(topk_weights)
        self._check_inputs(xs, idxs, ws, None)
        self._copy_inputs(xs, idxs, ws, None)
        buf, ranks = self.buffer, self.world.local_ranks
        counts = tuple(xr.shape[0] for xr in xs)
        for r, T in zip(ranks, counts):
            buf.num_tokens[r] = T
        self._generation += 1  # the host plan cache (forward / rerun) no longer matches the buffers
        P = self.world.world_size
        idx_all = torch.stack([buf.topk_idx.local(s) for s in range(P)])
        w_all = torch.stack([buf.topk_weights.local(s) for s in range(P)])
        num_tokens = self._device_token_counts(counts)
        self._prepare_combine_slots(idx_all, num_tokens)
        kernel = self._kernel()
        plans = self.device_plans(idx_all, w_all, num_tokens)
        args = [self.device_launch_arguments(d, plans) for d in ranks]
        self._zero_barrier_counters()
        for a in args:
            kernel(*a, buf.max_tokens, self.topk, 0, self.device_ctas)
        rows = reference.slot_rows(idx_all, buf.max_tokens, self.num_experts)  # [P, T, k]: every rank at once
        return [reference.topk_reduce(buf.combine.local(r), rows[r, :T]) for r, T in zip(ranks, counts)]

    def _device_token_counts(self, counts) -> torch.Tensor:
        """int64 [P] tokens per rank on the device, one tensor per distinct ``counts`` (kept, so
        a captured graph's copy stays valid and repeated calls need no upload)."""
        cache = self._token_counts
        if counts not in cache:
            host = torch.tensor(counts, dtype=torch.int64)
            cache[counts] = host.pin_memory().to(self.world.device, non_blocking=True)
        return cache[counts]

    def _prepare_combine_slots(self, idx_all: torch.Tensor, num_tokens: torch.Tensor) -> None:
        """Before the kernels: poison every read slot (``poison_combine``) and OR ERR_ROUTING into
        every rank's error word if a live pick's expert id is outside [-1, E) (such a pick is
        dropped by the plan and skipped by the reduction, like a masked one)."""
        from xstage.device import ERR_ROUTING

        buf = self.buffer
        live = torch.arange(buf.max_tokens, device=idx_all.device)[None, :, None] < num_tokens[:, None, None]
        bad = (live & ((idx_all < -1) | (idx_all >= self.num_experts))).any()
        code = bad.to(torch.int32) * ERR_ROUTING
        if self.poison_combine:
            for r in self.world.local_ranks:
                buf.combine_slots(r)[:, : buf.num_tokens[r]].fill_(float("nan"))
        buf.counters_all[:, COUNTER_ERROR].bitwise_or_(code)

    def device_plans(self, idx_all: torch.Tensor, w_all: torch.Tensor, num_tokens: torch.Tensor) -> DevicePlan:
        """Every rank's device-side plan (:func:`~megamoe_interleave.device_plan.plan_all_ranks`)
        from every source's routing, ``idx_all`` / ``w_all`` [P, max_tokens, k] and ``num_tokens``
        [P] on the device, for the fixed grid of ``device_ctas`` CTAs."""
        plan = plan_all_ranks
        if idx_all.is_cuda:  # the tables in one CuTe DSL kernel after the sort (same result)
            from .plan_kernel import plan_all_ranks_kernel as plan
        return plan(idx_all, w_all, num_tokens, experts_per_rank=self.experts_per_rank, block_m=BLOCK_M,
                    schedule=self.schedule, num_pairs=self.device_ctas // 2,
                    pairs_l1=2 * self.intermediate // self.block_n, pairs_l2=self.hidden // self.block_n,
                    hidden=self.hidden, intermediate=self.intermediate, experts_per_wave=self.config.experts_per_wave)

    def device_launch_arguments(self, d: int, plans: DevicePlan):
        """The kernel's tensor arguments for rank ``d`` from :meth:`device_plans`: static shapes,
        ``pool_x`` / ``h`` scratch of the worst case kept per rank (never regrown, so a captured
        graph's pointers stay valid). Works on any device (CPU tests)."""
        buf, sizes = self.buffer, self.device_plan_sizes
        scratch = self._device_scratch
        if d not in scratch:
            n_pad = sizes.max_pool + BLOCK_M
            if n_pad * (self.hidden // 8) >= 2 ** 31:
                raise ValueError(f"the device-side plan's worst-case pool ({n_pad} rows x {self.hidden // 8} 16-byte "
                                 "chunks) exceeds the kernel's int32 indexing; lower max_tokens_per_rank")
            dev = self.world.device
            f32 = dict(dtype=torch.float32, device=dev)
            scales = ((torch.empty(n_pad, self.hidden // QUANT_BLOCK, **f32),
                       torch.empty(n_pad, self.intermediate // QUANT_BLOCK, **f32))
                      if self.config.precision == "w8a8" else None)
            scratch[d] = (torch.empty(n_pad, self.hidden, dtype=buf.x.dtype, device=dev),
                          torch.empty(n_pad, self.intermediate, dtype=buf.x.dtype, device=dev),
                          torch.zeros(1, 1, len(TRACE_FIELDS), dtype=torch.int64, device=dev),  # trace: unused
                          scales)
        pool_x, h, no_trace, scales = scratch[d]
        tensors = (buf.x.peer_table(d), buf.combine.peer_table(d), plans.pool_src[d], plans.pool_weight[d], pool_x, h,
                   self.w1[d], self.w2[d], plans.row_record[d], plans.schedule_table[d], buf.counters[d], no_trace,
                   plans.sizes[d]) + self._scale_arguments(d, scales)  # mPlan, the scales (or their stand-ins)
        check_launch_arguments(self.hidden, self.intermediate, tensors, self.config.precision)
        return tensors

    def capture(self, num_tokens, *, warmup: int = 1):
        """A CUDA graph of the whole layer (input staging, device-side plan, kernels, reduction) for
        ``num_tokens`` tokens per local rank (an int: every rank): see
        :class:`~megamoe_interleave.graph.MegaMoEGraph`."""
        from .graph import MegaMoEGraph

        return MegaMoEGraph(self, num_tokens, warmup=warmup)

    def reduce_rank(self, r: int) -> torch.Tensor:
        """y of local rank ``r``: the weighted top-k sum of its Combine slots (the last step of
        ``forward``; valid once every rank's Combine stores are visible): one
        :func:`reference.topk_reduce` over the slots, masked picks skipped unread."""
        buf = self.buffer
        T = buf.num_tokens[r]
        rows = reference.slot_rows(buf.topk_idx.local(r)[:T], buf.max_tokens, self.num_experts)
        return reference.topk_reduce(buf.combine.local(r), rows)


def _remote_path(world):
    """The calibrated platform of ``world``'s remote stores (xstage.profiles.PROFILE_OF_PLACEMENT),
    or None where it has none (loopback)."""
    from xstage import profiles

    placement = getattr(world, "placement", None)
    if placement not in profiles.PROFILE_OF_PLACEMENT:
        raise ValueError(f"schedule='auto' needs a world with a known remote path; placement {placement!r} is not "
                         f"one of {sorted(profiles.PROFILE_OF_PLACEMENT)}")
    name = profiles.PROFILE_OF_PLACEMENT[placement]
    return profiles.load(name) if name else None


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` are the same view of the same memory (a copy would be a no-op)."""
    return (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.data_ptr() == b.data_ptr())


def trace_mainloop_cycles(cycles: int, t_start: int, t_ready: int, t_mainloop: int):
    """(SM clock in GHz, mainloop in cycles) of one trace row, or None without cycles (older
    traces) or for an empty span: the row's cycles cover tile start -> mainloop end, so its
    clock is cycles / ns over that span, and the mainloop (first stage landed -> last WGMMA
    retired) in cycles is that clock times its ns -- comparable with the tensor pipe's ideal
    (4096 bf16 FLOP per cycle per SM), which the GPU's DVFS clock is not."""
    if cycles <= 0 or t_mainloop <= t_start:
        return None
    clock = cycles / (t_mainloop - t_start)
    return clock, clock * (t_mainloop - t_ready)


def decode_trace(trace: torch.Tensor):
    """Per-tile records of one rank's trace tensor (see ``config.TRACE_FIELDS``): a list per CTA,
    in execution order, of dicts with phase, row, n_block and the other TRACE_FIELDS."""
    out = []
    for cta_rows in trace.cpu().tolist():
        recs = []
        for values in cta_rows:
            key = values[0]
            if key < 0:
                break
            rec = dict(phase=key >> 40, row=(key >> 16) & 0xFFFFFF, n_block=key & 0xFFFF)
            rec.update(zip(TRACE_FIELDS[1:], values[1:]))
            recs.append(rec)
        out.append(recs)
    return out
