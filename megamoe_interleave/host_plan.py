"""The host path's plan of a ``forward``: every local rank's expert-major pool and scheduler rows
from one sort and one device read, and the schedule the call runs -- with ``schedule="auto"`` and a
remote path chosen from the call's own routing by the model (:func:`xstage.planner.schedule_choice_of`).
The plan is kept until the staged inputs change; the launcher takes its config from it, so the
schedule is chosen once per call and passed down.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from . import reference
from .config import BLOCK_M, MegaMoEConfig
from .row_grid import balanced_l2_start, make_row_grid
from .scheduler import RowGrid
from xstage.world import single_process


def persistent_ctas(num_sms: int, grid: RowGrid) -> int:
    """CTAs of a fused launch: at most one per SM so every CTA is resident (the dependency waits and
    grid barriers rely on it), no more than the row's pair tiles need, even for the CTA pairs."""
    return max(2, min(num_sms - num_sms % 2, 2 * max(grid.num_rows, 1) * max(grid.pairs_l1, grid.pairs_l2)))


def row_grid(config: MegaMoEConfig, counts_host, *, hidden: int, intermediate: int, num_sms: int) -> RowGrid:
    """The scheduler rows of one rank for ``config`` (with the pairs' balanced L2 starts where the
    schedule asks for them)."""
    grid = make_row_grid(counts_host, block_m=BLOCK_M, n_blocks_l1=2 * intermediate // config.block_n,
                         n_blocks_l2=hidden // config.block_n, experts_per_wave=config.experts_per_wave,
                         row_split_n=config.row_split_n)
    if config.schedule_spec().balance_l2:
        grid = dataclasses.replace(grid, l2_start=balanced_l2_start(
            grid, persistent_ctas(num_sms, grid) // 2, block_m=BLOCK_M, hidden=hidden, intermediate=intermediate))
    return grid


@dataclass(frozen=True)
class HostPlan:
    """One call's plan: the resolved config it runs, each local rank's (Permutation, RowGrid), and
    the model's choice where ``schedule="auto"`` chose per call (else None)."""

    config: MegaMoEConfig
    ranks: Dict[int, Tuple[reference.Permutation, RowGrid]]
    choice: Optional[object] = None


class HostPlanner:
    """The plan of the staged inputs of ``layer`` (a :class:`~megamoe_interleave.api.MegaMoE`), made on
    first use after each :meth:`invalidate` (the layer calls it when it stages new inputs)."""

    def __init__(self, layer):
        self.layer = layer
        self.cached: Optional[HostPlan] = None

    def invalidate(self) -> None:
        self.cached = None

    def plan(self) -> HostPlan:
        if self.cached is None:
            self.cached = self._plan_local_ranks()
        return self.cached

    def plan_rank(self, d: int) -> Tuple[reference.Permutation, RowGrid]:
        """Rank ``d``'s (Permutation, RowGrid): the expert-major pool and the scheduler rows."""
        ranks = self.plan().ranks
        if d not in ranks:
            raise ValueError(f"rank {d} is not a local rank of this process")
        return ranks[d]

    def choose(self, perms) -> Tuple[MegaMoEConfig, Optional[object]]:
        """The config of a call whose routing gave ``perms`` (rank -> Permutation): the layer's, or with
        ``schedule="auto"`` and a remote path the model's choice from the rows per local expert
        (host arithmetic, ~40-50 us at 384 experts; no device read beyond the plan's one). The choice
        is per process: a multi-process world's ranks may differ, which the kernels allow (their
        dependencies are the Dispatch publish and the Combine)."""
        from xstage import planner

        layer = self.layer
        if layer.auto_model is None:
            return layer.config, None
        model, waves = layer.auto_model
        rows = [perms[d].counts_host[: layer.experts_per_rank] for d in sorted(perms)]
        choice = planner.schedule_choice_of(model, waves=waves, expert_rows=rows)
        return layer.configs[choice.schedule], choice

    def _plan_local_ranks(self) -> HostPlan:
        layer = self.layer
        idxs, ws = self._all_routing()
        perms = reference.permute_ranks(idxs, ws, layer.world.local_ranks, layer.experts_per_rank)
        config, choice = self.choose(perms)
        ranks = {d: (perm, row_grid(config, perm.counts_host, hidden=layer.hidden, intermediate=layer.intermediate,
                                    num_sms=layer.num_sms)) for d, perm in perms.items()}
        return HostPlan(config, ranks, choice)

    def _all_routing(self):
        """Every source rank's routing (the host part of Dispatch needs all of them): read from the
        local buffers in one-process worlds, all-gathered in torch-symm."""
        layer = self.layer
        buf, P = layer.buffer, layer.world.world_size
        if single_process(layer.world):
            T = buf.num_tokens
            return ([buf.topk_idx.local(s)[: T[s]] for s in range(P)],
                    [buf.topk_weights.local(s)[: T[s]] for s in range(P)])
        import torch.distributed as dist  # code path for several GPUs; not exercised on one GPU

        (r,) = layer.world.local_ranks
        t = torch.tensor([buf.num_tokens[r]], device=layer.world.device)
        ts = [torch.empty_like(t) for _ in range(P)]
        dist.all_gather(ts, t)
        idx_all = [torch.empty_like(buf.topk_idx.local(r)) for _ in range(P)]
        w_all = [torch.empty_like(buf.topk_weights.local(r)) for _ in range(P)]
        dist.all_gather(idx_all, buf.topk_idx.local(r))
        dist.all_gather(w_all, buf.topk_weights.local(r))
        ns = torch.cat(ts).tolist()  # one read-back for every rank's token count
        return ([i[:n] for i, n in zip(idx_all, ns)], [w[:n] for w, n in zip(w_all, ns)])
