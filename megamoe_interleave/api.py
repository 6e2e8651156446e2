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
from typing import List, Optional, Sequence, Union

import numpy as np
import torch

from . import inputs, quant, quant_fp4, reference, torch_backend
from .config import AUTO, BLOCK_M, QUANT_BLOCK, MegaMoEConfig
from .device_plan import plan_sizes
from .host_plan import HostPlanner
from .launcher import FusedLauncher
from .shapes import MoEShape
from .weights import transform_weights, untransform_w1  # noqa: F401  (re-exported: the layout is part of the API)
from .workspace import COUNTER_ERROR, MegaMoEBuffer, counter_words
from xstage.world import make_world, single_process  # noqa: F401  (make_world: re-export for callers)

BACKENDS = ("torch", "fused")


class MegaMoE:
    """Expert-parallel MoE layer over ``world`` (``num_experts / P`` experts per rank).

    ``config``: a :class:`~megamoe_interleave.config.MegaMoEConfig` (schedule "interleaved",
    paper Algorithm 1, "expert_wave", or "auto": chosen by the model for the world's remote path,
    :attr:`schedule_choice` says what and why; tiles, ring depth, Dispatch, trace, wait bound,
    ``precision`` "bf16", "w8a8" (the FP8 recipe of :mod:`~megamoe_interleave.quant`) or "w4a8" (FP4
    experts, :mod:`~megamoe_interleave.quant_fp4`; ``backend="torch"`` only so far)); its ``None``
    fields are resolved once for this layer's shape (:meth:`MegaMoEConfig.resolve`): :attr:`config`.
    ``backend``: "fused" (the CuTe DSL kernel; CUDA) or "torch" (the same data flow with torch ops,
    any device, single-process worlds); None = "fused" on a CUDA world. ``num_sms``: CTAs of the
    persistent launch at most (None = the device's SMs).

    ``poison_combine`` (default True): NaN into the Combine slots the top-k reduction reads before
    each call, so a slot the kernel failed to write shows up as NaN in ``y`` (benchmarks may turn it
    off: one k x T x H bf16 fill per rank per call). Masked picks (-1) are never reduced.

    Parts: :attr:`buffer` (:class:`~.workspace.MegaMoEBuffer`), :attr:`planner` (the host plan of a
    ``forward``: :mod:`.host_plan`), :attr:`launcher` (the fused kernels: :mod:`.launcher`). Host work
    per fused ``forward``: two device reads before the launch (expert-id bounds, the plan's counts),
    one table upload per rank, one read of the error words after. :meth:`enqueue` plans on the device
    instead (no host sync; errors via :meth:`check`); :meth:`capture` records it as one CUDA graph.
    """

    def __init__(self, world, num_experts: int, hidden: int, intermediate: int, topk: int,
                 max_tokens_per_rank: int, config: Optional[MegaMoEConfig] = None, *, backend: Optional[str] = None,
                 num_sms: Optional[int] = None, poison_combine: bool = True):
        backend = check_constructor_arguments(world, num_experts, hidden, intermediate, topk, max_tokens_per_rank,
                                              config, backend, num_sms)
        P = world.world_size
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(world.device).multi_processor_count \
                if world.device.type == "cuda" else 132
        shape = MoEShape("MegaMoE", hidden, intermediate, num_experts, topk, "caller")
        config = config or MegaMoEConfig()
        # schedule="auto": the model picks the schedule for this world's remote path (host arithmetic):
        # here for balanced routing at max_tokens_per_rank (enqueue / capture keep it), and in each
        # forward again from the call's routing where there is a remote path (HostPlanner.choose).
        platform = _remote_path(world) if config.schedule == AUTO else None
        self.auto_model = None if platform is None else config.auto_model(shape, P, max_tokens_per_rank, num_sms,
                                                                           platform)
        config, self.schedule_choice = config.choose_schedule(shape, P, max_tokens_per_rank, num_sms, platform)
        self.last_schedule_choice = self.schedule_choice  # the last forward's (per call with a remote path)
        # the resolved config of every schedule this layer may run; self.config: the layer's own
        self.configs = {s: dataclasses.replace(config, schedule=s).resolve(shape, P, max_tokens_per_rank, num_sms)
                        for s in ((config.schedule,) if self.auto_model is None else ("interleaved", "expert_wave"))}
        self.config = self.configs[config.schedule]
        self.world, self.backend, self.num_sms = world, backend, num_sms
        self.num_experts, self.hidden, self.intermediate, self.topk = num_experts, hidden, intermediate, topk
        self.experts_per_rank = num_experts // P
        if backend == "fused":  # the kernel's own checks now (no compile, no launch)
            from .kernel import make_kernel

            for c in self.configs.values():
                make_kernel(hidden, intermediate, c)
        # Largest pool of one rank (every pick of every source) + the BLOCK_M padding rows.
        self.max_pool_rows = P * max_tokens_per_rank * min(topk, self.experts_per_rank) + BLOCK_M
        if backend == "fused" and self.max_pool_rows * (hidden // 8) >= 2 ** 31:
            raise ValueError(f"max_tokens_per_rank={max_tokens_per_rank}: the fused kernel indexes the dispatched "
                             f"rows in 16-byte chunks with int32 ({self.max_pool_rows} rows x {hidden // 8} chunks "
                             f">= 2^31); lower max_tokens_per_rank")
        # The device-side plan's launch: a fixed grid (the host cannot see the routing) and its static
        # sizes; its worst-case scheduler rows also size the counter workspace of both paths.
        self.device_ctas = max(2, num_sms - num_sms % 2)
        sizes = {s: plan_sizes(P, max_tokens_per_rank, topk, self.experts_per_rank,
                               row_block=c.row_block,
                               schedule=c.schedule_spec(), num_pairs=self.device_ctas // 2,
                               experts_per_wave=c.experts_per_wave) for s, c in self.configs.items()}
        self.device_plan_sizes = sizes[self.config.schedule]
        self.buffer = MegaMoEBuffer(world, hidden=hidden, topk=topk, max_tokens_per_rank=max_tokens_per_rank,
                                    num_counters=counter_words(max(z.max_rows for z in sizes.values())),
                                    precision=self.config.precision)
        self.poison_combine = poison_combine
        self.inputs_staged = False  # by forward (stage_inputs); rerun() re-plans from them when needed
        self.planner, self.launcher = HostPlanner(self), FusedLauncher(self)
        self.last_trace = {}  # rank -> int64 [num_ctas, max_tiles, len(TRACE_FIELDS)] (config.trace)
        self.last_kernel_us = None  # device time of the last fused call (all local ranks)
        self._poison_pending = False
        self.w1, self.w2 = {}, {}  # rank -> its experts' weights in the kernel layout
        self.w1_scales, self.w2_scales = {}, {}  # w8a8: FP32 block scales; w4a8: UE8M0 bytes per row and 32 K
        self.fp4_operands = {}  # w4a8, fused: rank -> the kernel's block scales and shift words (kernel_operands)

    # -- weights -----------------------------------------------------------
    def load_weights(self, w1: torch.Tensor, w2: torch.Tensor) -> None:
        """Global bf16 weights ``w1`` [E, 2I, H] (gate | up), ``w2`` [E, H, I]; each local rank keeps
        its slice in the kernel layout (:func:`transform_weights`), for ``precision="w8a8"``
        quantized to it (:func:`quant.quantize_weights`: interleave, then 128x128 blocks), for
        ``"w4a8"`` to FP4 (:func:`quant_fp4.quantize_weights`)."""
        self._check_weight_shapes(w1, w2, self.buffer.dtype)
        el = self.experts_per_rank
        for r in self.world.local_ranks:
            sl = slice(r * el, (r + 1) * el)
            if self.config.precision == "w8a8":
                self._keep_quantized(r, *quant.quantize_weights(w1[sl], w2[sl]))
            elif self.config.precision == "w4a8":
                self._keep_quantized(r, *quant_fp4.quantize_weights(w1[sl], w2[sl]))
            else:
                w1_il, w2_c = transform_weights(w1[sl], w2[sl])
                self.w1[r], self.w2[r] = w1_il.to(self.world.device), w2_c.to(self.world.device)

    def load_quantized_weights(self, w1_q: torch.Tensor, w1_s: torch.Tensor, w2_q: torch.Tensor,
                               w2_s: torch.Tensor) -> None:
        """Global quantized weights already in the kernel layout, kept bit for bit.

        ``precision="w8a8"``: as :func:`quant.quantize_weights` returns them (``w1_q`` [E, 2I, H]
        gate/up interleaved with ``w1_s`` [E, 2I/128, H/128], a gate and an up scale per L1 N tile,
        ``w2_q`` [E, H, I] with ``w2_s`` [E, H/128, I/128], FP32 scales). A DeepGEMM / DeepSeek FP8
        checkpoint (w1 blocks over gate | up rows) goes through :func:`quant.from_deepgemm_layout`,
        which keeps its values bit for bit.

        ``precision="w4a8"``: as :func:`quant_fp4.quantize_weights` returns them (packed E2M1 codes
        ``uint8`` [E, 2I, H/2] / [E, H, I/2], rows interleaved, with UE8M0 bytes ``uint8``
        [E, 2I, H/32] / [E, H, I/32]); DeepGEMM's FP4 layout goes through
        :func:`quant_fp4.from_deepgemm_layout`."""
        E, H, inter = self.num_experts, self.hidden, self.intermediate
        if self.config.precision == "w8a8":
            self._check_weight_shapes(w1_q, w2_q, quant.E4M3)
            b, dtype = QUANT_BLOCK, torch.float32
            want = ((E, 2 * inter // b, H // b), (E, H // b, inter // b))
        elif self.config.precision == "w4a8":
            for name, t, shape in (("w1", w1_q, (E, 2 * inter, H // 2)), ("w2", w2_q, (E, H, inter // 2))):
                if t.shape != shape or t.dtype != torch.uint8:
                    raise ValueError(f"expected {name} packed FP4 uint8 {shape}, got {t.dtype} {tuple(t.shape)}")
            g, dtype = quant_fp4.SCALE_GROUP, torch.uint8
            want = ((E, 2 * inter, H // g), (E, H, inter // g))
        else:
            raise ValueError("load_quantized_weights needs MegaMoEConfig(precision='w8a8' or 'w4a8')")
        if (w1_s.shape, w2_s.shape) != want or w1_s.dtype != dtype or w2_s.dtype != dtype:
            raise ValueError(f"expected {dtype} scales w1_s {want[0]} and w2_s {want[1]}, got "
                             f"{w1_s.dtype} {tuple(w1_s.shape)}, {w2_s.dtype} {tuple(w2_s.shape)}")
        el = self.experts_per_rank
        for r in self.world.local_ranks:
            sl = slice(r * el, (r + 1) * el)
            self._keep_quantized(r, w1_q[sl], w1_s[sl], w2_q[sl], w2_s[sl])

    def _check_weight_shapes(self, w1: torch.Tensor, w2: torch.Tensor, dtype) -> None:
        E, H, inter = self.num_experts, self.hidden, self.intermediate
        if w1.shape != (E, 2 * inter, H) or w2.shape != (E, H, inter):
            raise ValueError(f"expected w1 {(E, 2*inter, H)} and w2 {(E, H, inter)}, got {tuple(w1.shape)}, {tuple(w2.shape)}")
        if w1.dtype != dtype or w2.dtype != dtype:
            raise ValueError(f"weights must be {dtype}, got {w1.dtype}, {w2.dtype}")

    def _keep_quantized(self, r: int, w1_q, w1_s, w2_q, w2_s) -> None:
        dev = self.world.device
        self.w1[r], self.w1_scales[r] = w1_q.to(dev).contiguous(), w1_s.to(dev).contiguous()
        self.w2[r], self.w2_scales[r] = w2_q.to(dev).contiguous(), w2_s.to(dev).contiguous()
        if self.config.precision == "w4a8" and self.backend == "fused":  # w1 / w2: the kernel's (braided) codes
            self.w1[r], s1, sh1, self.w2[r], s2, sh2 = quant_fp4.kernel_operands(self.w1[r], self.w1_scales[r],
                                                                                 self.w2[r], self.w2_scales[r])
            self.fp4_operands[r] = dict(mW1Scale=s1, mW1Shift=sh1, mW2Scale=s2, mW2Shift=sh2)

    # -- forward -----------------------------------------------------------
    def forward(self, x: Union[torch.Tensor, Sequence[torch.Tensor]], topk_idx, topk_weights, x_scales=None):
        """``x`` [T_r, H] bf16, ``topk_idx`` [T_r, k] (global expert ids, -1 = masked),
        ``topk_weights`` [T_r, k] f32, one per local rank (a list in the loopback world,
        tensors in the torch-symm world). Returns y with x's shape per local rank, bf16.

        ``precision="w8a8"`` / ``"w4a8"``: ``x`` bf16 (quantized per token and 128-group on the way in) or
        E4M3 with ``x_scales`` [T_r, H/128] f32 per rank (:func:`quant.quantize_act`'s layout,
        used as given); ``x_scales`` must be None for bf16 ``x`` and in bf16 precision."""
        self.stage_inputs(_ranks(x), _ranks(topk_idx), _ranks(topk_weights),
                          None if x_scales is None else _ranks(x_scales))
        if self.backend == "fused":
            return self._run_fused()
        self.flush_poison()
        torch_backend.run_dataflow(self)
        self.world.barrier()
        return [self.reduce_rank(r) for r in self.world.local_ranks]

    __call__ = forward

    def rerun(self) -> List[torch.Tensor]:
        """The fused kernels and the top-k reduction again, on the inputs the last ``forward``
        staged, with its plan (no input copies, no host planning unless :meth:`set_trace` changed the
        config since, no Combine poison): the device work of one call, for benchmarks that measure it.
        Returns y per local rank, equal to that ``forward``'s."""
        if self.backend != "fused":
            raise ValueError("rerun() repeats the fused kernels: backend='fused' only")
        if not self.inputs_staged:
            raise RuntimeError("rerun() needs a forward() first")
        return self._run_fused()

    def _run_fused(self) -> List[torch.Tensor]:
        if self.world.device.type != "cuda":
            raise RuntimeError("backend='fused' needs a CUDA device")
        plan = self.planner.plan()  # every local rank's plan: the one planning sync; auto picks here
        if plan.choice is not None:
            self.last_schedule_choice = plan.choice
        return self.launcher.run(plan)

    def set_trace(self, enabled: bool) -> None:
        """Per-tile tracing (``MegaMoEConfig.trace``) on or off for the calls that follow, on this
        object: buffers, weights, scratch and the staged inputs stay, so a traced and an untraced
        call of one problem can alternate (the trace's overhead, :mod:`lab.megamoe.sweep`). Only the
        compiled kernel changes (its own compile-cache key). ``last_trace`` keeps the last traced
        call's tensors."""
        self.configs = {s: dataclasses.replace(c, trace=bool(enabled)) for s, c in self.configs.items()}
        self.config = self.configs[self.config.schedule]
        self.planner.invalidate()  # the plan holds the config it runs

    def stage_inputs(self, xs, idxs, ws, x_scales=None) -> None:
        """Validate every rank's inputs, copy them into its symmetric buffers, schedule the
        Combine poison and synchronize the world (sources publish before anyone pulls).

        Inputs that already are the leading rows of the rank's symmetric buffers (e.g.
        ``moe.buffer.x.local(r)[:T]`` written by the caller) are not copied; ``x_scales``: see
        :meth:`forward`. The expert-id range of all ranks is checked with one device sync. In
        multi-process worlds the poison is written here, before the world barrier; in single-process
        worlds stream order suffices, so it is deferred to just before the launch (:meth:`flush_poison`)."""
        inputs.check_inputs(self, xs, idxs, ws, x_scales)
        self.planner.invalidate()  # the buffers change: any plan is stale
        self.inputs_staged = False
        staged_idx = inputs.copy_inputs(self, xs, idxs, ws, x_scales)
        for b in reference.routing_bounds(staged_idx):  # expert ids in range: one read for every rank
            reference.check_expert_range(b, self.num_experts)
        for r, xr in zip(self.world.local_ranks, xs):
            self.buffer.num_tokens[r] = xr.shape[0]
        self._poison_pending = self.poison_combine
        self.inputs_staged = True
        if not single_process(self.world):
            self.flush_poison()
            # Sources must have published x (and everyone poisoned) before any rank pulls
            # x or stores into a peer's combine (kernel Dispatch / Combine).
            self.world.barrier()

    def flush_poison(self) -> None:
        """NaN into the combine slots the reduction reads (``[:, :T]`` per local rank), once
        per staged call when ``poison_combine``: every read slot must then be written."""
        if not self._poison_pending:
            return
        for r in self.world.local_ranks:
            self.buffer.combine_slots(r)[:, : self.buffer.num_tokens[r]].fill_(float("nan"))
        self._poison_pending = False

    def reduce_rank(self, r: int) -> torch.Tensor:
        """y of local rank ``r``: the weighted top-k sum of its Combine slots (valid once every rank's
        Combine stores are visible), masked picks skipped unread."""
        T = self.buffer.num_tokens[r]
        rows = reference.slot_rows(self.buffer.topk_idx.local(r)[:T], self.buffer.max_tokens, self.num_experts)
        return reference.topk_reduce(self.buffer.combine.local(r), rows)

    # -- the fused kernels: compile, errors, the device-side plan --------------------------------
    def compile(self, *, device_plan: bool = False) -> None:
        """Compile what this layer launches before its first call, on any host (a CPU machine
        compiles for sm_90a; with ``XSTAGE_KERNEL_CACHE`` the objects are kept for a GPU host,
        :func:`xstage.cute_compile.cached`): the fused kernel of every schedule the layer may run,
        the top-k reduction and, with ``device_plan``, the device-side plan (enqueue / capture)."""
        if self.backend != "fused":
            raise ValueError("compile() builds the fused kernels: backend='fused' only")
        self.launcher.compile(device_plan)

    def check(self) -> None:
        """Raise the device errors of the calls since the last check (:meth:`enqueue`, graph
        replays): a timed-out wait in the kernel, an expert id out of range found by the device-side
        plan (:data:`xstage.device.ERR_ROUTING`). Reads every local rank's error word: one device
        sync, so call it outside the hot path (after a step, in a debug mode)."""
        self.launcher.raise_device_errors(self.buffer.counters_all[:, COUNTER_ERROR].tolist())

    def enqueue(self, x, topk_idx, topk_weights) -> List[torch.Tensor]:
        """:meth:`forward` without a host sync: stage the inputs, plan every rank on the device
        (:func:`~megamoe_interleave.device_plan.plan_all_ranks`), launch the fused kernels on a
        fixed grid of ``device_ctas`` CTAs, reduce. Only enqueues work on the current stream, so
        it can be captured in a CUDA graph (:meth:`capture`). Input checks that need no device
        read run first; an expert id out of range and a timed-out wait go to the error word, raised
        by :meth:`check`. Returns y per local rank (valid once the stream reaches it).

        Single-process worlds (loopback, loopback+host, host), ``trace`` off, the layer's schedule
        (``auto``: its choice at construction); W8A8 takes bf16 x and quantizes it on the device.
        The first call allocates each rank's worst-case pool scratch, (P * max_tokens * k + 128) x
        (H + I) elements (every pick of every source on one rank), since the host does not see the
        routing."""
        if self.backend != "fused":
            raise ValueError("enqueue() launches the fused kernel: backend='fused' only")
        if not single_process(self.world):
            raise NotImplementedError("the device-side plan reads every source's routing in one process; "
                                      "multi-process worlds (torch-symm, nvshmem) use forward()")
        if self.config.trace:
            raise NotImplementedError("enqueue() runs the kernel without the per-tile trace")
        if self.world.device.type != "cuda":
            raise RuntimeError("backend='fused' needs a CUDA device")
        xs, idxs, ws = _ranks(x), _ranks(topk_idx), _ranks(topk_weights)
        inputs.check_inputs(self, xs, idxs, ws, None)
        inputs.copy_inputs(self, xs, idxs, ws, None)
        counts = tuple(xr.shape[0] for xr in xs)
        for r, T in zip(self.world.local_ranks, counts):
            self.buffer.num_tokens[r] = T
        self.planner.invalidate()  # the host plan (forward / rerun) no longer matches the buffers
        self.inputs_staged = False
        return self.launcher.enqueue(self.config, counts)

    def capture(self, num_tokens, *, warmup: int = 1):
        """A CUDA graph of the whole layer (input staging, device-side plan, kernels, reduction) for
        ``num_tokens`` tokens per local rank (an int: every rank): see
        :class:`~megamoe_interleave.graph.MegaMoEGraph`."""
        from .graph import MegaMoEGraph

        return MegaMoEGraph(self, num_tokens, warmup=warmup)


def check_constructor_arguments(world, num_experts, hidden, intermediate, topk, max_tokens_per_rank, config, backend,
                                num_sms) -> str:
    """Misuse of the constructor fails here, with what was passed, before anything is resolved or
    allocated; returns the backend (None: "fused" on a CUDA world)."""
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
    if min(num_experts, hidden, intermediate, topk, max_tokens_per_rank) <= 0:
        raise ValueError("num_experts, hidden, intermediate, topk and max_tokens_per_rank must be positive")
    if topk > num_experts:
        raise ValueError(f"topk {topk} > num_experts {num_experts}")
    if backend is None:
        backend = "fused" if world.device.type == "cuda" else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def _ranks(v) -> List[torch.Tensor]:
    """One tensor per local rank: a list as given, a tensor as the one rank's (torch-symm)."""
    return [v] if isinstance(v, torch.Tensor) else list(v)


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
