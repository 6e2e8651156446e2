"""Python API in the spirit of ``deep_gemm.mega``: symmetric buffer, weight transform, forward.

::

    world = make_world("loopback", world_size=P)
    moe = MegaMoE(world, num_experts=E, hidden=H, intermediate=I, topk=k,
                  max_tokens_per_rank=T, schedule="interleaved", lead=None)
    moe.load_weights(w1, w2)          # global [E, 2I, H] (gate | up) and [E, H, I]
    ys = moe.forward(xs, topk_idx, topk_weights)   # per local rank lists

Data flow per call (the fused kernel's contract; the ``torch`` backend executes the
same flow with torch ops so the buffer layout and the Combine slot protocol are tested
everywhere):

1. each rank copies its tokens / routing into its symmetric ``x``, ``topk_idx``,
   ``topk_weights`` and poisons its ``combine`` slots;
2. Dispatch: rank d pulls the rows routed to its experts from every source rank's
   symmetric ``x`` (via the peer table), expert-major;
3. L1 grouped GEMM + SwiGLU x routing weight, L2 grouped GEMM, in the scheduler's
   tile order (kernel only);
4. Combine: each L2 output row is written to ``combine[pick, token]`` on its source rank;
5. after all ranks' stores are visible, every rank reduces its own ``combine`` over
   the valid picks into ``y``.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch

from . import reference
from .scheduler import SCHEDULES, Schedule, default_lead
from xstage.world import make_world  # noqa: F401  (re-export for callers)

INTERLEAVE_GRANULARITY = 8
BACKENDS = ("torch", "fused")
_COMPILED = {}  # compiled fused kernels by configuration (see MegaMoE._kernel)


def transform_weights(w1: torch.Tensor, w2: torch.Tensor, granularity: int = INTERLEAVE_GRANULARITY):
    """Kernel weight layout.

    ``w1`` [E, 2I, H] (gate rows then up rows) -> gate/up interleaved in chunks of
    ``granularity`` rows (``[g0..g7, u0..u7, g8..g15, ...]``) so an L1 N-tile holds
    matching gate and up columns and SwiGLU is tile-local. ``w2`` [E, H, I] is returned
    contiguous. Returns (w1_interleaved, w2)."""
    if w1.dim() != 3 or w2.dim() != 3:
        raise ValueError("w1 must be [E, 2I, H] and w2 [E, H, I]")
    E, two_i, H = w1.shape
    if two_i % 2 or w2.shape != (E, H, two_i // 2):
        raise ValueError(f"shape mismatch: w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}")
    inter = two_i // 2
    if inter % granularity:
        raise ValueError(f"intermediate {inter} must be a multiple of {granularity}")
    g = w1[:, :inter].reshape(E, inter // granularity, granularity, H)
    u = w1[:, inter:].reshape(E, inter // granularity, granularity, H)
    return torch.stack([g, u], dim=2).reshape(E, two_i, H).contiguous(), w2.contiguous()


def untransform_w1(w1_il: torch.Tensor, granularity: int = INTERLEAVE_GRANULARITY) -> torch.Tensor:
    """Inverse of the w1 part of :func:`transform_weights`."""
    E, two_i, H = w1_il.shape
    v = w1_il.reshape(E, two_i // (2 * granularity), 2, granularity, H)
    return torch.cat([v[:, :, 0].reshape(E, two_i // 2, H), v[:, :, 1].reshape(E, two_i // 2, H)], dim=1)


class MegaMoEBuffer:
    """Symmetric per-rank buffers, sized from ``max_tokens_per_rank``.

    ``x`` [T, H] bf16, ``topk_idx`` [T, k] int64, ``topk_weights`` [T, k] f32 (inputs, read
    remotely by Dispatch), ``combine`` [k, T, H] bf16 (written remotely by Combine),
    ``counters[r]`` int32 workspace of rank r (kernel: error word, grid-barrier counter,
    per-row L1->L2 readiness counters; row counters are reset in-kernel so repeated calls
    need no host memset). Only rank r's own kernel touches it, so it is plain device memory,
    not symmetric (in the ``host`` world the symmetric buffers live in pinned host memory,
    where the counters' atomics would cross PCIe)."""

    def __init__(self, world, *, hidden: int, topk: int, max_tokens_per_rank: int, num_counters: int = 1024,
                 dtype=torch.bfloat16):
        if max_tokens_per_rank <= 0 or hidden <= 0 or topk <= 0:
            raise ValueError("hidden, topk and max_tokens_per_rank must be positive")
        if (hidden * torch.tensor([], dtype=dtype).element_size()) % 16:
            raise ValueError(f"hidden*{dtype} row must be a multiple of 16 bytes (16-byte remote stores)")
        self.world = world
        self.hidden, self.topk, self.max_tokens = hidden, topk, max_tokens_per_rank
        self.dtype = dtype
        T = max_tokens_per_rank
        self.x = world.alloc((T, hidden), dtype)
        self.topk_idx = world.alloc((T, topk), torch.int64)
        self.topk_weights = world.alloc((T, topk), torch.float32)
        self.combine = world.alloc((topk, T, hidden), dtype)
        self.counters = {r: torch.zeros(num_counters, dtype=torch.int32, device=world.device)
                         for r in world.local_ranks}
        self.num_tokens = [0] * world.world_size


class MegaMoE:
    """Expert-parallel MoE layer over ``world`` (``E / P`` experts per rank).

    ``schedule``: "expert_wave" (``experts_per_wave``, default E_local/4) or "interleaved"
    (Algorithm 1, ``lead`` D; default ceil(eq. 16) = ceil(block_n * num_sms / (2 I))).
    ``backend``: "fused" (the CuTe DSL kernel, CUDA only) or "torch" (same data flow with
    torch ops, any device, loopback/host worlds). Fused-kernel options: ``mma`` ("wgmma"
    GPU-validated, "wgmma_cpasync" multistage, "tma_ws" TMA + mbarrier ring + producer warp and
    "tma_ws_mcast" (the same, CTA pairs as clusters multicasting A) -- both UNTESTED ON GPU,
    "fma"), ``block_m`` (64 or 128 = one or two
    consumer warpgroups), ``block_n``, ``stages``, ``timeout_ns`` of every bounded spin,
    ``trace`` (per-tile timelines in ``last_trace``; decode with :func:`decode_trace`).
    """

    def __init__(self, world, *, num_experts: int, hidden: int, intermediate: int, topk: int,
                 max_tokens_per_rank: int, schedule: str = "interleaved", lead: Optional[int] = None,
                 experts_per_wave: Optional[int] = None, block_m: int = 64, block_n: int = 128,
                 num_sms: int = 132, backend: str = "torch", timeout_ns: int = 2_000_000_000,
                 mma: str = "wgmma", stages: int = 4, trace: bool = False):
        P = world.world_size
        if num_experts % P:
            raise ValueError(f"num_experts {num_experts} not divisible by world size {P}")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if (2 * intermediate) % (2 * block_n) or hidden % (2 * block_n):
            raise ValueError(f"2I={2*intermediate} and H={hidden} must be multiples of 2*block_n={2*block_n} (CTA pairs)")
        if topk > num_experts:
            raise ValueError("topk > num_experts")
        self.world = world
        self.num_experts, self.hidden, self.intermediate, self.topk = num_experts, hidden, intermediate, topk
        self.experts_per_rank = num_experts // P
        self.block_m, self.block_n, self.num_sms = block_m, block_n, num_sms
        self.lead = lead if lead is not None else default_lead(block_n, num_sms, intermediate)
        self.schedule = Schedule(schedule, lead=self.lead)
        self.experts_per_wave = experts_per_wave
        self.backend = backend
        self.timeout_ns = timeout_ns
        # fused kernel tile math: "wgmma" (single-stage WGMMA), "wgmma_cpasync" (multistage
        # cp.async + WGMMA) or "fma" (CUDA cores)
        self.mma = mma
        self.stages = stages  # smem pipeline depth of mma="wgmma_cpasync" / "tma_ws*"
        self.trace = trace  # record per-tile timelines (fused backend) into last_trace
        self.last_trace = {}  # rank -> int64 [num_ctas, max_tiles, 6] (kernel_sm90.TRACE_FIELDS)
        self.last_kernel_us = None  # device time of the last fused call (all local ranks)
        if backend == "fused":  # validate the kernel configuration now (no compile, no launch)
            from .kernel_sm90 import MegaMoESm90

            MegaMoESm90(hidden, intermediate, self.schedule, block_m=block_m, block_n=block_n, mma=mma, stages=stages,
                        trace=trace)
        # Worst-case scheduler rows of one rank: every pick of every source lands here, plus
        # one partial M block per local expert.
        max_rows = -(-P * max_tokens_per_rank * min(topk, self.experts_per_rank) // block_m) + self.experts_per_rank
        self.buffer = MegaMoEBuffer(world, hidden=hidden, topk=topk, max_tokens_per_rank=max_tokens_per_rank,
                                    num_counters=2 + max_rows)
        self.w1 = {}
        self.w2 = {}

    # -- weights -----------------------------------------------------------
    def load_weights(self, w1: torch.Tensor, w2: torch.Tensor) -> None:
        """Global weights ``w1`` [E, 2I, H] (gate | up), ``w2`` [E, H, I]; each local rank keeps
        its slice in the kernel layout (:func:`transform_weights`)."""
        E, H, inter = self.num_experts, self.hidden, self.intermediate
        if w1.shape != (E, 2 * inter, H) or w2.shape != (E, H, inter):
            raise ValueError(f"expected w1 {(E, 2*inter, H)} and w2 {(E, H, inter)}, got {tuple(w1.shape)}, {tuple(w2.shape)}")
        if w1.dtype != self.buffer.dtype or w2.dtype != self.buffer.dtype:
            raise ValueError(f"weights must be {self.buffer.dtype}")
        el = self.experts_per_rank
        for r in self.world.local_ranks:
            sl = slice(r * el, (r + 1) * el)
            w1_il, w2_c = transform_weights(w1[sl], w2[sl])
            self.w1[r] = w1_il.to(self.world.device)
            self.w2[r] = w2_c.to(self.world.device)

    # -- forward -----------------------------------------------------------
    def _as_rank_list(self, v) -> List[torch.Tensor]:
        if isinstance(v, torch.Tensor):
            return [v]
        return list(v)

    def forward(self, x: Union[torch.Tensor, Sequence[torch.Tensor]], topk_idx, topk_weights):
        """``x`` [T_r, H] bf16, ``topk_idx`` [T_r, k] (global expert ids, -1 = masked),
        ``topk_weights`` [T_r, k] f32, one per local rank (a list in the loopback world,
        tensors in the torch-symm world). Returns y with x's shape per local rank."""
        xs, idxs, ws = self._as_rank_list(x), self._as_rank_list(topk_idx), self._as_rank_list(topk_weights)
        ranks = self.world.local_ranks
        self.stage_inputs(xs, idxs, ws)
        if self.backend == "fused":
            self._run_fused()
        else:
            self._run_torch_dataflow()
        self.world.barrier()
        return [self._reduce(r) for r in ranks]

    __call__ = forward

    def stage_inputs(self, xs, idxs, ws) -> None:
        """Validate every rank's inputs, copy them into its symmetric buffers, poison the
        Combine slots and synchronize the world (sources publish before anyone pulls)."""
        ranks = self.world.local_ranks
        if not (len(xs) == len(idxs) == len(ws) == len(ranks)):
            raise ValueError(f"need one input per local rank ({len(ranks)}), got {len(xs)}/{len(idxs)}/{len(ws)}")
        if not self.w1:
            raise RuntimeError("call load_weights() first")
        buf = self.buffer
        for r, xr, ir, wr in zip(ranks, xs, idxs, ws):
            if xr.dtype != buf.dtype:
                raise ValueError(f"x must be {buf.dtype}, got {xr.dtype}")
            reference.check_routing(xr, ir, wr, self.num_experts)
            if xr.shape[1] != self.hidden or ir.shape[1] != self.topk:
                raise ValueError(f"x must be [T, {self.hidden}] and topk_idx [T, {self.topk}]")
            if xr.shape[0] > buf.max_tokens:
                raise ValueError(f"{xr.shape[0]} tokens > max_tokens_per_rank {buf.max_tokens}")
            T = xr.shape[0]
            buf.x.local(r)[:T].copy_(xr)
            buf.topk_idx.local(r)[:T].copy_(ir)
            buf.topk_weights.local(r)[:T].copy_(wr)
            buf.combine.local(r).fill_(float("nan"))  # poison: every read slot must be written
            buf.num_tokens[r] = T
        # Sources must have published x before any rank pulls it (kernel Dispatch).
        self.world.barrier()

    def _run_torch_dataflow(self) -> None:
        """Dispatch + L1 + SwiGLU + L2 + Combine of every local rank with torch ops on the
        symmetric buffers (loopback: all ranks in this process)."""
        if self.world.backend == "torch-symm":
            # A rank can only reach peers through the peer table: that is the kernel path.
            raise NotImplementedError("backend='torch' emulates the dataflow in one process (loopback/host worlds)")
        buf, P = self.buffer, self.world.world_size
        T = buf.num_tokens
        idxs = [buf.topk_idx.local(s)[: T[s]] for s in range(P)]
        ws = [buf.topk_weights.local(s)[: T[s]] for s in range(P)]
        xs = [buf.x.local(s)[: T[s]] for s in range(P)]
        for d in range(P):
            perm = reference.permute_for_rank(idxs, ws, d, self.experts_per_rank)
            dev = self.world.device
            rows = reference._gather_rows(xs, perm, dev)
            w1_t = _w1_t_gate_up(self.w1[d])
            out = reference.unfused_expert_compute(rows, perm.weights.to(dev), perm.counts, w1_t, self.w2[d].transpose(1, 2))
            for s in range(P):
                sel = (perm.src_rank == s).nonzero(as_tuple=True)[0]
                buf.combine.local(s)[perm.src_pick[sel].to(dev), perm.src_token[sel].to(dev)] = out[sel.to(dev)]

    # -- fused kernel (kernel_sm90.MegaMoESm90) ---------------------------------
    def _kernel(self):
        key = (self.hidden, self.intermediate, self.schedule, self.block_m, self.block_n, self.timeout_ns, self.mma,
               self.stages, self.trace)
        if key not in _COMPILED:
            from .kernel_sm90 import compile_megamoe_sm90

            _COMPILED[key] = compile_megamoe_sm90(self.hidden, self.intermediate, self.schedule,
                                                  block_m=self.block_m, block_n=self.block_n,
                                                  timeout_ns=self.timeout_ns, mma=self.mma, stages=self.stages,
                                                  trace=self.trace)
        return _COMPILED[key]

    def plan_rank(self, d: int):
        """Host part of Dispatch for destination rank ``d``: the expert-major pool and the
        scheduler tables (the kernel does the row pull, both GEMMs and Combine)."""
        from .scheduler import make_row_grid

        idxs, ws = self._all_routing()
        perm = reference.permute_for_rank(idxs, ws, d, self.experts_per_rank)
        grid = make_row_grid(perm.counts.tolist(), block_m=self.block_m,
                             n_blocks_l1=2 * self.intermediate // self.block_n,
                             n_blocks_l2=self.hidden // self.block_n, experts_per_wave=self.experts_per_wave)
        return perm, grid

    def _all_routing(self):
        """Every source rank's routing (the host part of Dispatch needs all of them):
        read from the local buffers in one-process worlds, all-gathered in torch-symm."""
        buf, P = self.buffer, self.world.world_size
        if self.world.backend != "torch-symm":
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
        return ([i[: int(n)] for i, n in zip(idx_all, ts)], [w[: int(n)] for w, n in zip(w_all, ts)])

    def launch_arguments(self, d: int):
        """Host planning for rank ``d``: (num_ctas, tensor args, scalar args w/o barrier_base
        and num_ctas) of :class:`kernel_sm90.MegaMoESm90`. Works on any device (CPU tests
        check the arguments against the kernel's signature)."""
        buf, dev = self.buffer, self.world.device
        i32 = dict(dtype=torch.int32, device=dev)
        perm, grid = self.plan_rank(d)
        n_pool = perm.src_rank.numel()
        if 2 + grid.num_rows > buf.counters[d].numel():
            raise ValueError(f"{grid.num_rows} scheduler rows exceed the counter workspace")
        pool_src = torch.stack([perm.src_rank, perm.src_token, perm.src_pick], 1).to(**i32).contiguous()
        pool_w = perm.weights.to(device=dev, dtype=torch.float32).contiguous()
        if n_pool == 0:  # keep every tensor non-empty
            pool_src = torch.zeros(1, 3, **i32)
            pool_w = torch.zeros(1, dtype=torch.float32, device=dev)
        # block_m rows of padding: the multistage mainloop reads whole M tiles (rows past an
        # expert's tokens feed accumulator rows that are never stored).
        pool_x = torch.empty(n_pool + self.block_m, self.hidden, dtype=buf.dtype, device=dev)
        h = torch.empty(n_pool + self.block_m, self.intermediate, dtype=buf.dtype, device=dev)
        row_expert = torch.tensor(grid.row_expert or [0], **i32)
        exp_row_off = torch.tensor(grid.expert_row_offset, **i32)
        exp_tok_off = torch.tensor([0] + torch.cumsum(perm.counts, 0).tolist(), **i32)
        wave_start = torch.tensor(grid.wave_row_start, **i32)
        # Persistent grid: at most one CTA per SM so every CTA is resident (the
        # dependency waits and grid barriers rely on it); even for the CTA pairs.
        num_ctas = max(2, min(self.num_sms - self.num_sms % 2,
                              2 * max(grid.num_rows, 1) * max(grid.pairs_l1, grid.pairs_l2)))
        if self.trace:
            # Tiles per CTA <= ceil(all pair tiles / pairs) (+1 for safety).
            per_cta = -(-grid.num_rows * (grid.pairs_l1 + grid.pairs_l2) // (num_ctas // 2)) + 1
            trace = torch.full((num_ctas, per_cta, 6), -1, dtype=torch.int64, device=dev)
            self.last_trace[d] = trace
        else:
            trace = torch.zeros(1, 1, 6, dtype=torch.int64, device=dev)
        tensors = (buf.x.peer_table(d), buf.combine.peer_table(d), pool_src, pool_w, pool_x, h,
                   self.w1[d], self.w2[d], row_expert, exp_row_off, exp_tok_off, wave_start, buf.counters[d],
                   trace)
        from .kernel_sm90 import check_launch_arguments

        check_launch_arguments(self.hidden, self.intermediate, tensors)
        return num_ctas, tensors, (grid.num_rows, n_pool, buf.max_tokens, self.topk)

    def _run_fused(self) -> None:
        dev = self.world.device
        if dev.type != "cuda":
            raise RuntimeError("backend='fused' needs a CUDA device")
        kernel = self._kernel()
        if not hasattr(self, "_barrier_base"):
            self._barrier_base = {r: 0 for r in self.world.local_ranks}
        launches = []
        for d in self.world.local_ranks:  # host planning of every rank first ...
            num_ctas, tensors, scalars = self.launch_arguments(d)
            launches.append((d, num_ctas, tensors + scalars))
        # ... then every rank's kernel back to back, timed with CUDA events (kernel-only time).
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for d, num_ctas, args in launches:
            kernel(*args, self._barrier_base[d], num_ctas)
            self._barrier_base[d] += 2 * num_ctas
        end.record()
        for d, _, args in launches:
            if self._barrier_base[d] > 2 ** 30:  # keep the int32 barrier counter far from overflow
                args[12][1:2].zero_()  # stream-ordered after this call's kernel
                self._barrier_base[d] = 0
        torch.cuda.synchronize(dev)
        self.last_kernel_us = start.elapsed_time(end) * 1e3
        from xstage.device import raise_on_device_error

        buf = self.buffer
        for d in self.world.local_ranks:
            if int(buf.counters[d][0].item()) != 0:
                # The counter state is unusable after a timeout: reset it, then raise.
                err = buf.counters[d][0:1].clone()
                for r in self.world.local_ranks:
                    buf.counters[r].zero_()
                    self._barrier_base[r] = 0
                raise_on_device_error(err, f"MegaMoESm90 rank {d}")

    def _reduce(self, r: int) -> torch.Tensor:
        T = self.buffer.num_tokens[r]
        combine = self.buffer.combine.local(r)[:, :T]
        idx = self.buffer.topk_idx.local(r)[:T]
        return reference.weighted_combine(combine, idx)


def _w1_t_gate_up(w1_il: torch.Tensor) -> torch.Tensor:
    """Interleaved w1 [E, 2I, H] -> [E, H, 2I] with gate columns then up columns (grouped_mm B)."""
    return untransform_w1(w1_il).transpose(1, 2)


def decode_trace(trace: torch.Tensor):
    """Per-tile records of one rank's trace tensor (see ``kernel_sm90.TRACE_FIELDS``):
    list per CTA of dicts with phase, row, n_block, timestamps (ns) and smid, in execution order."""
    out = []
    for cta_rows in trace.cpu().tolist():
        recs = []
        for key, t0, t1, t2, t3, smid in cta_rows:
            if key < 0:
                break
            recs.append(dict(phase=key >> 40, row=(key >> 16) & 0xFFFFFF, n_block=key & 0xFFFF, t_start=t0,
                             t_ready=t1, t_mainloop=t2, t_epilogue=t3, smid=smid))
        out.append(recs)
    return out
