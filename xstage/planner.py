"""Design-test planner (Section 4.1): audit a kernel's burst volume and gap
against a platform profile and pick an action — piggyback or reshape.

Two audits, one per kernel of the paper:

* :func:`plan_fa_a2a` — FlashAttention fused with the Ulysses post-attention
  All-to-All (Section 4.3): V = K·b_m·d·s_out, gap = the next Q-loop.
* :func:`plan_megamoe` — MegaMoE Combine bursts under the expert-wave and
  interleaved schedules (Section 4.2): eq. 9, 12–14, 16.

Both return plain dataclasses whose ``as_dict()`` is what ``xstage plan
--json`` prints. The worst aligned case is used by default: every producer
CTA reaches its tile boundary together (the paper's conservative audit).
The producers of one aligned burst are at most the SMs (``producers``
overrides that limit) and at most the output tiles that exist: a shape with
fewer tiles than SMs runs one partial wave whose burst is those tiles.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from . import model
from .model import Platform

__all__ = ["FAPlan", "MoEPlan", "OUT_BYTES", "STORE_BYTES", "INT32_MAX", "MAX_TENSOR_BYTES", "MMA_M", "MMA_K",
           "SIGMA_REFERENCE_TILE", "EXPERT_WAVES", "fa_tensor_bytes", "moe_tensor_bytes", "plan_fa_a2a",
           "plan_megamoe"]


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return v


# Bytes per output element (out_bytes = s_out): fp8, bf16/fp16, fp32.
OUT_BYTES = (1, 2, 4)
# The kernels' remote stores are 16-byte vectors (st.global.v4.b32, xstage.device.store_v4):
# an output tile row must be a whole number of them.
STORE_BYTES = 16


def _check_out_bytes(out_bytes: int, row_elems: int, row_name: str) -> None:
    if out_bytes not in OUT_BYTES:
        raise ValueError(f"out_bytes must be one of {OUT_BYTES} (bytes per output element), got {out_bytes!r}")
    if (row_elems * out_bytes) % STORE_BYTES:
        raise ValueError(f"{row_name}*out_bytes = {row_elems * out_bytes} bytes per output row is not a multiple"
                         f" of the {STORE_BYTES}-byte stores")


# Sanity limits on a planned shape. The kernels take sizes as 32-bit integers (CuTe DSL Int32
# dynamic shapes; MegaMoE also indexes its dispatched rows in int32), and no single tensor of a
# real layer comes near 1 TiB (an H200 holds 141 GB): past either, the input is a typo, not a layer.
INT32_MAX = 2**31 - 1
MAX_TENSOR_BYTES = 2**40
# Tile granularity of a Hopper WGMMA (m64nNk16 for 16-bit inputs): an output tile's rows are a
# multiple of MMA_M (one warpgroup's M), a tile that is the reduction of a GEMM (FlashAttention's
# KV tile b_n in P·V) a multiple of MMA_K; a tile's columns (b_n of MegaMoE) a multiple of MMA_K too.
MMA_M, MMA_K = 64, 16
# expert_wave's waves per rank that the planner's schedule="auto" line assumes (the layer passes
# its own: MegaMoEConfig.auto_model).
EXPERT_WAVES = 4
# The FlashAttention tile a profile's Q-loop slope sigma was measured with (b_m, b_n, d), as in
# the paper (Section 4.3: FA4, b_m = d = 128, KV tile 128) and in fa4_a2a.
SIGMA_REFERENCE_TILE = (128, 128, 128)


def _tiles(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _check_tile(name: str, v: int, multiple: int) -> None:
    if v % multiple:
        raise ValueError(f"{name}={v} is not a multiple of {multiple} (Hopper WGMMA tile granularity)")


def _check_sizes(sizes: dict[str, int], tensors: dict[str, int]) -> None:
    """ValueError past the int32 range (every size) or over MAX_TENSOR_BYTES (any one tensor)."""
    for name, v in sizes.items():
        if v > INT32_MAX:
            raise ValueError(f"{name}={v} is past the int32 range of the kernels' sizes (max {INT32_MAX})")
    for what, nbytes in tensors.items():
        if nbytes > MAX_TENSOR_BYTES:
            raise ValueError(f"{what} would hold {nbytes / 2**40:.3g} TiB, over the {MAX_TENSOR_BYTES // 2**40} TiB"
                             " sanity limit for one tensor (an H200 has 141 GB)")


def fa_tensor_bytes(*, seq_len: int, heads: int, head_dim: int, world: int, batch: int, out_bytes: int) -> dict:
    """Bytes of the largest tensors of one rank of the FA-A2A layer: its attention output
    [B, M, H/P, d] (the same size as each of its q, k, v after the pre-attention All-to-All)."""
    return {"one rank's attention output [B, M, H/P, d]": batch * seq_len * (heads // world) * head_dim * out_bytes}


def moe_tensor_bytes(*, hidden: int, intermediate: int, experts: int, topk: int, tokens: int, world: int,
                     out_bytes: int) -> dict:
    """Bytes of the largest tensors of one rank of the MegaMoE layer (bf16 inputs and weights)."""
    return {"one rank's Combine buffer [top-k, tokens, hidden]": topk * tokens * hidden * out_bytes,
            "one rank's tokens [tokens, hidden]": tokens * hidden * 2,
            "one rank's expert weights [E/P, 3 x intermediate, hidden]": (experts // world) * 3 * intermediate * hidden * 2}


def _positive_time(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
    return float(v)


@dataclass
class FAPlan:
    platform: str
    seq_len: int
    heads: int
    head_dim: int
    world: int
    batch: int
    tile_m: int
    tile_n: int
    out_bytes: int
    producers: int  # aligned producers of one burst: min(producer_limit, tiles_per_rank)
    producer_limit: int  # the SMs (or --producers)
    local_heads: int
    tiles_per_rank: int
    burst_waves: int
    volume_bytes: int
    t_iss0_s: float
    recovery_gap_s: float
    peak_outstanding_bytes: float
    capacity_bytes: float
    capacity_ok: bool
    sigma_s: float | None
    sigma_source: str
    qloop_gap_s: float | None
    m_star_ub: float | None
    drain_stall_s: float | None
    drain_residual_s: float | None
    rate_ok: bool | None
    rate_bound: str  # "holds", "fails", "not applicable (one burst wave)" or "not evaluated (...)"
    verdict: str
    reasons: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def _fa_sigma(platform: Platform, sigma: float | None, tile_m: int, tile_n: int,
              head_dim: int) -> tuple[float | None, str]:
    """(sigma in seconds per KV tile or None, where it comes from).

    A profile's sigma holds for SIGMA_REFERENCE_TILE. A KV step does C_FA = 4·b_m·b_n·d FLOPs
    (Section 4.3); with T = a + b·C (a >= 0: the fixed per-step cost), T(r·C) >= min(1, r)·T(C),
    so sigma · min(1, C/C_ref) stays a lower bound of the step time of another tile, which is all
    the conservative bound G_Qloop(M) >= sigma·M/b_n needs."""
    if sigma is not None:
        return _positive_time("sigma", sigma), "given (--sigma-us)"
    if platform.sigma is None:
        return None, f"profile {platform.name!r} has no sigma_us_per_kv_tile"
    ref_m, ref_n, ref_d = SIGMA_REFERENCE_TILE
    ratio = (tile_m * tile_n * head_dim) / (ref_m * ref_n * ref_d)
    if ratio >= 1.0:
        return platform.sigma, f"profile {platform.name!r}"
    return platform.sigma * ratio, (f"profile {platform.name!r} x {ratio:.3g}: this KV step does that share of the"
                                    f" work of the measured {ref_m}x{ref_n}x{ref_d} step (b_m x b_n x d; a lower bound)")


def plan_fa_a2a(
    platform: Platform,
    *,
    seq_len: int,
    heads: int,
    head_dim: int,
    world: int,
    batch: int = 1,
    tile_m: int = 128,
    tile_n: int = 128,
    out_bytes: int = 2,
    producers: int | None = None,
    sigma: float | None = None,
) -> FAPlan:
    """Audit the piggybacked FA–A2A design (Section 4.3, eq. 10, 18–20).

    ``seq_len`` is the global sequence length M and ``heads`` the total head
    count H; each rank computes full-sequence attention for H/P heads, in
    N = B·(H/P)·⌈M/b_m⌉ output tiles. ``sigma`` (seconds per KV tile) defaults to
    the platform's (:func:`_fa_sigma`).

    The aligned burst is V = K·B_t (Section 4.3) with K = min(SMs or ``producers``, N): no
    more producers than tiles. The tiles run in ⌈N/K⌉ burst waves. With one wave no burst
    follows another, so eq. 10's rate bound (accumulation across periods) does not apply: the
    single burst meets an empty X-Stage and its capacity bound (eq. 6-7) alone decides.
    """
    for name, v in (("seq_len", seq_len), ("heads", heads), ("head_dim", head_dim), ("world", world),
                    ("batch", batch), ("tile_m", tile_m), ("tile_n", tile_n), ("out_bytes", out_bytes)):
        _positive_int(name, v)
    _check_out_bytes(out_bytes, head_dim, "head_dim")
    _check_tile("tile_m", tile_m, MMA_M)
    _check_tile("tile_n", tile_n, MMA_K)
    if heads % world:
        raise ValueError(f"heads={heads} is not divisible by world={world} (Ulysses splits heads across ranks)")
    if seq_len % world:
        raise ValueError(f"seq_len={seq_len} is not divisible by world={world} (Ulysses splits the sequence)")
    _check_sizes({"seq_len": seq_len, "heads": heads, "head_dim": head_dim, "world": world, "batch": batch},
                 fa_tensor_bytes(seq_len=seq_len, heads=heads, head_dim=head_dim, world=world, batch=batch,
                                 out_bytes=out_bytes))
    k_limit = platform.num_sms if producers is None else _positive_int("producers", producers)
    sigma, sigma_source = _fa_sigma(platform, sigma, tile_m, tile_n, head_dim)

    local_heads = heads // world
    tiles = batch * local_heads * math.ceil(seq_len / tile_m)
    k = min(k_limit, tiles)  # a burst is at most the tiles that exist
    waves = math.ceil(tiles / k)
    v = model.fa_burst_volume(k, tile_m, head_dim, out_bytes)
    t0 = platform.t_iss0_at(k, v)
    q = platform.q_at(k)
    g_star = model.recovery_gap(v, platform.R, t0)
    q_peak = model.peak_outstanding(v, platform.R, t0)
    cap_ok = q_peak <= q
    reasons = []
    if tiles < k_limit:
        reasons.append(f"{_tiles(tiles, 'output tile')} for {k_limit} producer CTAs: one partial wave, the aligned"
                       f" burst is {_tiles(tiles, 'tile')} x B_t")
    if not cap_ok:
        reasons.append(f"capacity bound fails: peak outstanding {q_peak / 2**20:.2f} MiB > Q {q / 2**20:.2f} MiB"
                       f" (eq. 6, K = {k}); reduce the aligned burst (fewer aligned producers or smaller output tiles)")
    gap = m_ub = stall = resid = None
    rate_ok = None
    if sigma is not None:
        gap = model.qloop_gap(seq_len, tile_n, sigma)
        m_ub = model.m_star_ub(v, platform.R, t0, sigma, tile_n)
    if waves == 1:
        # One burst into an empty X-Stage: its issue time is eq. 7's, its overhead past T_iss0
        # the stall; nothing is left for a later burst to meet.
        rate_bound = "not applicable (one burst wave)"
        stall = resid = model.isolated_issue_time(v, platform.R, t0, q) - t0
        reasons.append("one burst wave: no burst follows it, so eq. 10's rate bound does not apply;"
                       " eq. 6-7's capacity bound decides")
        verdict = "piggyback" if cap_ok else "reshape"
    elif sigma is None:
        rate_bound = (f"not evaluated (profile {platform.name!r} has no sigma_us_per_kv_tile, the Q-loop time"
                      " per KV tile; give --sigma-us)")
        reasons.append(f"rate bound not evaluated: {platform.name!r} has no Q-loop slope sigma;"
                       " give --sigma-us (microseconds per KV tile)")
        verdict = "unknown: give --sigma-us" if cap_ok else "reshape"
    else:
        stall = model.drain_stall(v, platform.R, t0, gap)
        resid = model.drain_residual(waves, v, platform.R, t0, gap)
        rate_ok = model.design_test(v, gap, platform.R, t0, q).rate_ok
        rate_bound = "holds" if rate_ok else "fails"
        if not rate_ok:
            reasons.append(f"rate bound fails: Q-loop gap {gap * 1e6:.2f} us < G* {g_star * 1e6:.2f} us"
                           f" (M < M*_ub = {m_ub:.0f})")
        verdict = "piggyback" if (cap_ok and rate_ok) else "reshape"
    if verdict == "piggyback":
        reasons.append("the bounds of eq. 10 that apply hold: the output-owning role can issue and resume;"
                       + (" the next Q-loop drains the burst" if waves > 1 else " X-Stage absorbs the burst"))
    return FAPlan(
        platform=platform.name, seq_len=seq_len, heads=heads, head_dim=head_dim, world=world, batch=batch,
        tile_m=tile_m, tile_n=tile_n, out_bytes=out_bytes, producers=k, producer_limit=k_limit,
        local_heads=local_heads, tiles_per_rank=tiles, burst_waves=waves, volume_bytes=v, t_iss0_s=t0,
        recovery_gap_s=g_star, peak_outstanding_bytes=q_peak, capacity_bytes=q, capacity_ok=cap_ok, sigma_s=sigma,
        sigma_source=sigma_source, qloop_gap_s=gap, m_star_ub=m_ub, drain_stall_s=stall, drain_residual_s=resid,
        rate_ok=rate_ok, rate_bound=rate_bound, verdict=verdict, reasons=reasons,
    )


@dataclass
class MoEPlan:
    platform: str
    hidden: int
    intermediate: int
    experts: int
    topk: int
    tokens_per_rank: int
    world: int
    block_m: int
    block_n: int
    out_bytes: int
    producers: int  # aligned producers of one Combine burst: min(producer_limit, l2_tiles)
    rows_per_expert: float
    n1: int
    n2: int
    tile_volume_bytes: int
    volume_bytes: int
    t_iss0_s: float
    t_l1_mma_s: float
    t_l2_mma_s: float
    mma_source: str
    recovery_gap_s: float
    wave_gap_s: float
    wave_overhead_s: float
    wave_rate_ratio: float
    interleaved_gap_s: float
    interleaved_overhead_s: float
    interleaved_rate_ratio: float
    interleave_sufficient: bool
    capacity_ok: bool
    d_knee_rows: float
    combine_bytes: int
    kernel_l1_s: float
    kernel_l2_s: float
    drain_s: float
    kernel_wave_s: float
    kernel_interleaved_s: float
    verdict: str
    reasons: list[str] = field(default_factory=list)
    rate_bytes_s: float = 0.0  # the platform's R and Q(K) the plan used (schedule_choice_of)
    capacity_bytes: float = 0.0
    producer_limit: int = 0  # the SMs (or --producers)
    l2_tiles: int = 0  # Linear-2 tiles of one rank's kernel (balanced routing)
    burst_waves: int = 0  # ceil(l2_tiles / producers)
    expert_waves: int = EXPERT_WAVES  # expert_wave's waves per rank for the schedule choice
    schedule: str = ""  # what schedule="auto" picks for this plan (schedule_choice_of); the verdict follows it
    schedule_reason: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def _phase_time(tiles: int, t_tile: float, sms: int) -> float:
    """Compute time of one GEMM phase of the kernel: its tiles spread over the SMs, but never
    faster than one tile's mainloop per SM that has one (fewer tiles than SMs: one partial wave)."""
    return tiles * t_tile / min(sms, tiles) if tiles else 0.0


def _balanced_m_blocks(tokens: int, topk: int, experts_per_rank: int, block_m: int) -> int:
    """b_m-row blocks of one rank's kernel under balanced routing: the rank receives tokens·topk
    rows (its share of P·tokens·topk picks) over its experts; fewer rows than experts leave
    experts empty rather than giving each a fraction of a row."""
    rows = tokens * topk
    active = min(experts_per_rank, rows)
    return active * math.ceil(math.ceil(rows / active) / block_m)


def plan_megamoe(
    platform: Platform,
    *,
    hidden: int,
    intermediate: int,
    experts: int,
    topk: int,
    tokens: int,
    world: int,
    block_m: int = 128,
    block_n: int = 128,
    out_bytes: int = 2,
    producers: int | None = None,
    t_l1_mma: float | None = None,
    t_l2_mma: float | None = None,
    dense_flops: float | None = None,
    expert_waves: int = EXPERT_WAVES,
) -> MoEPlan:
    """Audit MegaMoE's Combine bursts (Section 4.2).

    Mainloop times per tile, if not given, are estimated as the tile's
    FLOPs over one SM's share of the dense rate (``dense_flops`` or the
    platform's): T_L1 = 2·b_m·b_n·hidden / (F/num_sms), T_L2 likewise with
    the intermediate size as reduction dimension.

    The aligned Combine burst is V = K·V_t with K = min(SMs or ``producers``, Linear-2 tiles of
    the rank's kernel): a burst is at most the L2 tiles that exist. The verdict is the schedule
    that ``schedule="auto"`` picks for this plan (:func:`schedule_choice_of`, balanced routing,
    ``expert_waves`` waves), with eq. 14 saying whether interleaving alone removes the per-burst
    overhead; so the verdict and the auto line never disagree.
    """
    for name, v in (("hidden", hidden), ("intermediate", intermediate), ("experts", experts), ("topk", topk),
                    ("tokens", tokens), ("world", world), ("block_m", block_m), ("block_n", block_n),
                    ("out_bytes", out_bytes), ("expert_waves", expert_waves)):
        _positive_int(name, v)
    _check_out_bytes(out_bytes, block_n, "block_n")
    _check_tile("block_m", block_m, MMA_M)
    _check_tile("block_n", block_n, MMA_K)
    for name, t in (("t_l1_mma", t_l1_mma), ("t_l2_mma", t_l2_mma), ("dense_flops", dense_flops)):
        if t is not None:
            _positive_time(name, t)
    if experts % world:
        raise ValueError(f"experts={experts} is not divisible by world={world} (expert parallelism)")
    if topk > experts:
        raise ValueError(f"topk={topk} exceeds experts={experts}")
    _check_sizes({"hidden": hidden, "intermediate": intermediate, "experts": experts, "tokens": tokens,
                  "world": world},
                 moe_tensor_bytes(hidden=hidden, intermediate=intermediate, experts=experts, topk=topk, tokens=tokens,
                                  world=world, out_bytes=out_bytes))
    k_limit = platform.num_sms if producers is None else _positive_int("producers", producers)
    n1, n2 = model.tile_mix(hidden, intermediate, block_n)

    if t_l1_mma is None or t_l2_mma is None:
        flops = dense_flops if dense_flops is not None else platform.dense_flops
        if flops is None:
            raise ValueError(f"platform {platform.name!r} has no dense_tflops: give the mainloop times"
                             " (--t-l1-us, --t-l2-us) or --dense-tflops")
        per_sm = flops / platform.num_sms
        est_l1 = 2.0 * block_m * block_n * hidden / per_sm
        est_l2 = 2.0 * block_m * block_n * intermediate / per_sm
        mma_source = f"estimated from {flops / 1e12:.0f} TFLOP/s dense over {platform.num_sms} SMs"
        t_l1_mma = est_l1 if t_l1_mma is None else t_l1_mma
        t_l2_mma = est_l2 if t_l2_mma is None else t_l2_mma
    else:
        mma_source = "given"

    # The whole kernel of one rank (balanced routing): tokens·topk rows in b_m-row blocks over the
    # local experts, each block n1 L1 and n2 L2 tiles over K SMs; the Combine sends every row back
    # (model.kernel_rate_bounds).
    rows_per_expert = tokens * world * topk / experts
    m_blocks = _balanced_m_blocks(tokens, topk, experts // world, block_m)
    l2_tiles = m_blocks * n2
    k = min(k_limit, l2_tiles)  # a Combine burst is at most the L2 tiles that exist
    waves = math.ceil(l2_tiles / k)
    vt = block_m * block_n * out_bytes
    v = k * vt
    t0 = platform.t_iss0_at(k, v)
    q = platform.q_at(k)
    g_star = model.recovery_gap(v, platform.R, t0)
    wave_dt = model.wave_overhead(v, platform.R, t0, t_l2_mma)
    wave_test = model.design_test(v, t_l2_mma, platform.R, t0, q)
    g_int = model.interleaved_gap(t_l2_mma, t_l1_mma, n1, n2)
    int_dt = model.interleaved_overhead(v, platform.R, t0, t_l2_mma, t_l1_mma, n1, n2)
    suff, int_ratio = model.interleave_sufficient(v, platform.R, t0, t_l2_mma, t_l1_mma, n1, n2)
    knee = model.d_knee(block_n, k, intermediate)
    t_l1_kernel = _phase_time(m_blocks * n1, t_l1_mma, k_limit)
    t_l2_kernel = _phase_time(m_blocks * n2, t_l2_mma, k_limit)
    combine = tokens * topk * hidden * out_bytes
    t_int_kernel, t_wave_kernel = model.kernel_rate_bounds(t_l1_kernel, t_l2_kernel, combine, platform.R)

    plan = MoEPlan(
        platform=platform.name, hidden=hidden, intermediate=intermediate, experts=experts, topk=topk,
        tokens_per_rank=tokens, world=world, block_m=block_m, block_n=block_n, out_bytes=out_bytes,
        producers=k, rows_per_expert=rows_per_expert, n1=n1, n2=n2, tile_volume_bytes=vt,
        volume_bytes=v, t_iss0_s=t0, t_l1_mma_s=t_l1_mma, t_l2_mma_s=t_l2_mma, mma_source=mma_source,
        recovery_gap_s=g_star, wave_gap_s=t_l2_mma, wave_overhead_s=wave_dt, wave_rate_ratio=wave_test.rate_ratio,
        interleaved_gap_s=g_int, interleaved_overhead_s=int_dt, interleaved_rate_ratio=int_ratio,
        interleave_sufficient=suff, capacity_ok=wave_test.capacity_ok, d_knee_rows=knee, combine_bytes=combine,
        kernel_l1_s=t_l1_kernel, kernel_l2_s=t_l2_kernel, drain_s=combine / platform.R, kernel_wave_s=t_wave_kernel,
        kernel_interleaved_s=t_int_kernel, verdict="", reasons=[], rate_bytes_s=platform.R, capacity_bytes=q,
        producer_limit=k_limit, l2_tiles=l2_tiles, burst_waves=waves, expert_waves=expert_waves,
    )
    choice = schedule_choice_of(plan, waves=expert_waves)
    plan.schedule, plan.schedule_reason = choice.schedule, choice.reason
    plan.verdict, plan.reasons = _moe_verdict(plan, choice, wave_test.rate_ok)
    return plan


def _moe_verdict(plan: MoEPlan, choice: ScheduleChoice, wave_rate_ok: bool) -> tuple[str, list[str]]:
    """The verdict of a plan, from its schedule="auto" choice (never the other way round), and
    the per-burst equations (eq. 9-14) that explain it."""
    reasons = []
    if plan.l2_tiles < plan.producer_limit:
        reasons.append(f"{_tiles(plan.l2_tiles, 'Linear-2 tile')} for {plan.producer_limit} producer CTAs: one partial"
                       f" wave, the aligned Combine burst is {_tiles(plan.l2_tiles, 'tile')} x V_t")
    if choice.schedule == "expert_wave" and choice.wave_backlog_bytes is not None \
            and choice.wave_backlog_bytes <= choice.wave_capacity_bytes:
        verdict = "expert-wave already backpressure-free"
        reasons.append(f"eq. 10 per expert wave holds (backlog {choice.wave_backlog_bytes / 2**20:.2f} MiB <= "
                       f"{plan.expert_waves} x Q): nothing to reshape")
        if not wave_rate_ok:
            reasons.append("one aligned burst alone outruns the drain over one L2 mainloop (eq. 9), but each wave's"
                           " backlog fits in X-Stage and drains under the next wave's Linear-1 work")
    elif choice.schedule == "expert_wave":
        verdict = "expert-wave: interleaving gains less than its locality cost"
        reasons.append("eq. 10 per expert wave fails, but eq. 11 over the kernel with the measured locality ratio"
                       " predicts expert_wave faster")
    elif plan.interleave_sufficient:
        verdict = "interleave"
        reasons.append("expert-wave's Combine backlog overfills X-Stage (eq. 10 per wave); eq. 14 holds:"
                       " interleaving L1 tiles suffices")
    else:
        verdict = "interleave + reduce burst volume"
        reasons.append("expert-wave's Combine backlog overfills X-Stage (eq. 10 per wave); eq. 14 fails:"
                       " interleaving alone leaves residual overhead per burst; also shrink aligned bursts")
    if not plan.capacity_ok:
        reasons.append("capacity bound fails for one aligned burst (eq. 6)")
    return verdict, reasons


# Interleaved over expert_wave kernel time where no remote path exists: the locality term of the
# schedule choice (interleaving mixes experts in time, which could cost weight reuse). Measured,
# not modelled: the loopback control of the MegaMoE X-Stage sweep (results/h200/megamoe/xstage/,
# 60 cells on the H200, 2026-12-02): geometric mean of interleaved / expert_wave = 1 / 1.022.
INTERLEAVED_LOCALITY_RATIO = 1 / 1.022


@dataclass(frozen=True)
class ScheduleChoice:
    """What ``schedule="auto"`` picked for a MegaMoE layer (or one call), and why."""

    schedule: str
    platform: str | None
    predicted_interleaved_s: float | None  # model.kernel_rate_bounds x the locality ratio (slowest rank)
    predicted_wave_s: float | None
    reason: str
    wave_backlog_bytes: float | None = None  # eq. 10 per wave: [V - R T_L2]_+ of the worst rank
    wave_capacity_bytes: float | None = None  # ... against W Q


def choose_megamoe_schedule(platform: Platform | None, *, hidden: int, intermediate: int, experts: int, topk: int,
                            tokens: int, world: int, block_n: int = 256, waves: int = 4,
                            expert_rows: Sequence[Sequence[int]] | None = None,
                            locality_ratio: float = INTERLEAVED_LOCALITY_RATIO) -> ScheduleChoice:
    """expert_wave or interleaved from the model, with no per-shape table (the paper's Section 6
    suggestion). ``platform``: the calibrated remote path of the world the Combine stores cross
    (None: no remote path, e.g. the loopback world). ``waves``: expert_wave's waves per rank.
    ``expert_rows``: the call's routing, rows per local expert of each deciding destination rank
    (None: balanced routing at ``tokens`` per rank, the layer's choice at construction).

    With a remote path, two steps, both host arithmetic (no device sync):

    1. Eq. (10)'s capacity bound per expert wave (:func:`model.expert_wave_absorbs`): where every
       rank's waves absorb their Combine (V - R T_L2 <= W Q), expert_wave has no backpressure and
       wins: interleaving would only move the drain under Linear-1 mainloops, which the sweep
       measures slower while the path drains (interleaved's L1 mainloops 0.96-2.95x their loopback
       time over PCIe, expert_wave's 0.69-1.05x; results/h200/megamoe/xstage/).
    2. Otherwise the whole-kernel drain bound of eq. (11) (:func:`model.kernel_rate_bounds`,
       mainloops from the platform's dense rate, m-blocks from ``expert_rows``) predicts both
       schedules on the slowest rank; interleaved's prediction is scaled by the measured
       locality ratio and the faster one wins. (The bound never prefers expert_wave:
       max(T_L1 + T_L2, V/R) <= T_L1 + max(T_L2, V/R).)

    Without a remote path nothing drains, so the locality ratio alone decides."""
    if platform is None:
        _positive_time("locality_ratio", locality_ratio)
        pick = "interleaved" if locality_ratio <= 1.0 else "expert_wave"
        return ScheduleChoice(pick, None, None, None,
                              f"no remote path: the measured locality ratio {locality_ratio:.3f} decides")
    plan = plan_megamoe(platform, hidden=hidden, intermediate=intermediate, experts=experts, topk=topk,
                        tokens=tokens, world=world, block_n=block_n)
    return schedule_choice_of(plan, locality_ratio, waves=waves, expert_rows=expert_rows)


def _rank_kernel_terms(plan: MoEPlan, rows: Sequence[int]) -> tuple[float, float, float]:
    """(T_L1, T_L2, Combine bytes) of one rank's kernel whose local experts hold ``rows`` rows
    (each expert's rows padded to whole b_m blocks, as :func:`plan_megamoe` does for balanced)."""
    m_blocks = 0
    for r in rows:
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"expert_rows must hold integers >= 0, got {r!r}")
        m_blocks += -(-r // plan.block_m)
    return (_phase_time(m_blocks * plan.n1, plan.t_l1_mma_s, plan.producer_limit),
            _phase_time(m_blocks * plan.n2, plan.t_l2_mma_s, plan.producer_limit),
            float(sum(rows) * plan.hidden * plan.out_bytes))


def schedule_choice_of(plan: MoEPlan, locality_ratio: float = INTERLEAVED_LOCALITY_RATIO, *, waves: int = 4,
                       expert_rows: Sequence[Sequence[int]] | None = None) -> ScheduleChoice:
    """The ``schedule="auto"`` pick from one :class:`MoEPlan` (:func:`choose_megamoe_schedule`):
    eq. (10) per expert wave, then eq. (11) over the kernel with interleaved's bound scaled by
    ``locality_ratio``; ``expert_rows`` as there (None: the plan's balanced kernel)."""
    _positive_time("locality_ratio", locality_ratio)
    if expert_rows is None:
        terms = [(plan.kernel_l1_s, plan.kernel_l2_s, float(plan.combine_bytes))]
    else:
        experts_per_rank = plan.experts // plan.world
        terms = []
        for rows in expert_rows:
            if len(rows) != experts_per_rank:
                raise ValueError(f"expert_rows: {len(rows)} experts for a rank, expected {experts_per_rank}")
            terms.append(_rank_kernel_terms(plan, rows))
        if not terms:
            raise ValueError("expert_rows: no rank")
    rate, q = plan.rate_bytes_s, plan.capacity_bytes
    absorbed = [model.expert_wave_absorbs(v, rate, t2, waves, q) for _, t2, v in terms]
    backlog = max(b for _, b in absorbed)
    bounds = [model.kernel_rate_bounds(t1, t2, v, rate) for t1, t2, v in terms]
    il = max(b[0] for b in bounds) * locality_ratio
    ew = max(b[1] for b in bounds)
    mib = 2.0 ** 20
    if all(ok for ok, _ in absorbed):
        return ScheduleChoice("expert_wave", plan.platform, il, ew,
                              f"eq. 10 per wave on {plan.platform}: expert_wave's backlog {backlog / mib:.1f} MiB "
                              f"<= {waves} waves x Q {q / mib:.1f} MiB = {waves * q / mib:.1f} MiB: no backpressure to remove",
                              backlog, waves * q)
    pick = "interleaved" if il <= ew else "expert_wave"
    return ScheduleChoice(pick, plan.platform, il, ew,
                          f"eq. 10 per wave fails on {plan.platform} (backlog {backlog / mib:.0f} MiB > {waves} x Q); "
                          f"eq. 11 over the kernel: interleaved {il * 1e6:.0f} us (x locality {locality_ratio:.3f}) vs "
                          f"expert_wave {ew * 1e6:.0f} us", backlog, waves * q)
