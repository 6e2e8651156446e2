"""What the fused kernel is compiled for: :class:`MegaMoEConfig` and the tuned defaults that
:meth:`MegaMoEConfig.resolve` fills in, plus the facts the host side needs without the CuTe DSL
(tile constants, trace row layout, shared-memory budget). :mod:`kernel_sm90` and :mod:`api`
both take them from here.

Every default cites the H200 measurement that chose it (DeepSeek-V4-Flash, 8192 tokens per rank,
clock-matched paired trials; the folders are indexed in results/h200/megamoe/archive/README.md unless named
otherwise, and are in git history at bedde32).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from .int_ops import DIVMOD_SMALL_MAX
from .row_grid import check_experts_per_wave, default_experts_per_wave, default_lead
from .scheduler import SCHEDULES, ExpertWaveSchedule, InterleavedSchedule, Schedule

BLOCK_M = 128  # rows per CTA tile: two consumer warpgroups of WGMMA M64
BLOCK_K = 64  # one 128-byte swizzle row of bf16
BLOCK_K_FP8 = 128  # W8A8: one 128-byte swizzle row of E4M3 = one scale block along K (QUANT_BLOCK)
BLOCK_NS = (256, 128, 64)  # supported N tiles, widest first
QUANT_BLOCK = 128  # W8A8: FP8 scale granularity along K (1x128 activations, 128x128 weights; quant.py)
PRECISIONS = ("bf16", "w8a8", "w4a8")
# E4M3 activations with 1x128 scales and the FP8 mainloop; W4A8 widens its FP4 weights to it (quant_fp4)
FP8_PRECISIONS = ("w8a8", "w4a8")
AUTO = "auto"  # MegaMoEConfig.schedule: chosen per world by the model (choose_schedule)
SMEM_BYTES = 227 * 1024  # sm_90 opt-in shared memory per block
INTERLEAVE = 8  # gate/up interleave granularity of w1 (api.transform_weights)
DISPATCH_COPIES = ("lsu", "bulk")
BULK_PIECE_BYTES = 8192  # largest bulk-copy piece of a dispatched row (two bounce buffers in smem)
DEEP_RING_MAX_ROWS = 512  # 4 ring stages below this many rows per local expert, else 3
# W4A8: E4M3 B blocks the consumers widen the ring's packed stages into (two: docs/w4a8.md, the
# kernel step by step); with them 3 ring stages fit, 4 do not
WIDENED_BUFFERS = 2
# W4A8 shifts d (a 32-group's exponent over its block scale's): the widening puts a block's largest group at
# WIDEN_MAX_SHIFT; the kernel's group tables cover d down to WIDEN_TABLE_MIN_SHIFT, the smallest with 2^(7 + d) a
# normal FP16 (fp4_widen), one 8-byte table per shift
WIDEN_MAX_SHIFT, WIDEN_TABLE_MIN_SHIFT = 6, -20
WIDEN_TABLES = WIDEN_MAX_SHIFT - WIDEN_TABLE_MIN_SHIFT + 1

# Per-tile trace row (trace=True), both sides of the staging boundary (paper Section 5.2.3).
# Written by consumer thread 0: key = phase<<40 | row<<16 | n_block; %globaltimer (ns) at tile
# start, when the tile's first ring stage had landed (L2: after the producer's dependency wait),
# after the mainloop, after the output was staged; the SM id; the SM cycles (%clock64) from tile
# start to mainloop end; t_slot: when the staging slot was free (the first EMPTY wait returned;
# t_slot - t_mainloop is the consumers' wait for the epilogue warps). Written by epilogue thread 0:
# t_rs_end, when every epilogue thread had issued the tile's stores (L2: the Combine remote stores,
# L1: the h stores), and rs_ns, the stores' issue span (from the FULL wait's return to the end of
# each staged part's stores, summed over parts; backpressure stalls included).
TRACE_FIELDS = ("key", "t_start", "t_ready", "t_mainloop", "t_epilogue", "smid", "cycles", "t_slot", "t_rs_end",
                "rs_ns")


PAIR_SPLITS = ("m", "n")


def pair_tiles_per_row(n_cols: int, block_n: int) -> int:
    """Pair tiles of one scheduler row over ``n_cols`` output columns: one per N block (a row split
    along N by ``pair_split="n"`` uses the first half of them, two N blocks each)."""
    return n_cols // block_n


def bulk_piece_bytes(hidden: int, elem_bytes: int = 2) -> int:
    """Bytes per bounce buffer of the bulk Dispatch: a dispatched row (``elem_bytes`` H bytes: 2
    bf16, 1 E4M3) in the fewest equal pieces of at most BULK_PIECE_BYTES, each a multiple of 16
    bytes. W8A8's scales (H/128 FP32 <= a piece) travel as one more piece."""
    row = elem_bytes * hidden
    pieces = next(k for k in range(1, row // 16 + 1) if row % k == 0 and (row // k) % 16 == 0
                  and row // k <= BULK_PIECE_BYTES)
    return row // pieces


@dataclass(frozen=True)
class SmemPlan:
    """Shared memory of one CTA: the A/B ring, the output staging tile and the rest (ring
    mbarriers, row metadata, the bulk Dispatch's bounce buffers). The L2 output goes to the
    epilogue warps in ``l2_handoffs`` parts: 1 when the BN-wide staging tile fits next to the
    ring, else 2 (BN/2 wide, as L1's h columns)."""

    ring_bytes: int
    staging_bytes: int
    other_bytes: int
    l2_handoffs: int

    @property
    def stage_words(self) -> int:
        return self.staging_bytes // (4 * BLOCK_M)

    @property
    def total_bytes(self) -> int:
        return self.ring_bytes + self.staging_bytes + self.other_bytes


def smem_plan(hidden: int, block_n: int, stages: int, dispatch_copy: str, *, precision: str = "bf16") -> SmemPlan:
    """:class:`SmemPlan` of a configuration; ValueError when it does not fit SMEM_BYTES. W8A8
    stages hold the same bytes (128-byte rows of E4M3, BLOCK_K_FP8 deep) plus two small arrays
    (the rows' h scales, the half tiles' cross-warpgroup amax). W4A8 stages hold packed E2M1 B
    rows (64 bytes) and their shift words (4 bytes), plus WIDENED_BUFFERS E4M3 B blocks outside the ring."""
    fp8 = precision in FP8_PRECISIONS
    ring = stages * BLOCK_K * (BLOCK_M + block_n) * 2
    if precision == "w4a8":
        ring = stages * (BLOCK_K_FP8 * BLOCK_M + block_n * (BLOCK_K_FP8 // 2 + 4)) \
            + WIDENED_BUFFERS * block_n * BLOCK_K_FP8
    other = 16 * stages + 12 * BLOCK_M  # ring mbarriers, row weights + Combine addresses
    if precision == "w4a8":
        other += 8 * WIDEN_TABLES  # the group tables of every shift
    if fp8:
        other += 4 * BLOCK_M + 4 * 2 * 64
    if dispatch_copy == "bulk":  # two bounce buffers (128-B aligned) + their mbarriers
        other += 2 * bulk_piece_bytes(hidden, 1 if fp8 else 2) + 128 + 16
    handoffs = 1 if ring + BLOCK_M * block_n * 2 + other <= SMEM_BYTES else 2
    plan = SmemPlan(ring, BLOCK_M * block_n * 2 // handoffs, other, handoffs)
    if plan.total_bytes > SMEM_BYTES:
        raise ValueError(f"shared memory (A/B ring {ring} B, staging {plan.staging_bytes} B, other {other} B) "
                         f"does not fit {SMEM_BYTES} B; lower stages or block_n"
                         + (", or dispatch_copy='lsu'" if dispatch_copy == "bulk" else ""))
    return plan


@dataclass(frozen=True)
class MegaMoEConfig:
    """Compile-time configuration of the fused kernel plus the schedule's host-side choices.

    Leave a field ``None`` to take the tuned default from :meth:`resolve`; :class:`~api.MegaMoE`
    resolves its config once, and :attr:`MegaMoE.config` shows the result. Fields that do not
    apply to the schedule (``lead`` for expert_wave; ``experts_per_wave``, ``l2_columns`` for
    interleaved) must stay ``None``.

    ``precision``: "bf16" (BF16 x BF16, FP32 accumulate) or "w8a8" (the SM90 FP8 recipe of
    :mod:`~megamoe_interleave.quant`: E4M3 weights with 128x128 block scales, E4M3 activations
    with 1x128 scales, per-128-K FP32 promotion; BF16 output and Combine) or "w4a8" (E2M1 weights
    with a power-of-two scale per row and 32 K, widened exactly to the W8A8 recipe's weight format,
    :mod:`~megamoe_interleave.quant_fp4`; ``backend="torch"`` only so far). It lives here rather
    than as a ``MegaMoE`` argument because it selects what the kernel is compiled for (it is part
    of :meth:`kernel_key`) and constrains the tiles (:meth:`resolve`), and because the
    constructor is kept at ten parameters.
    """

    schedule: str = "interleaved"  # "interleaved" (paper Algorithm 1), "expert_wave", or "auto" (choose_schedule)
    lead: Optional[int] = None  # interleaved: lead D in scheduler rows (>= 1)
    experts_per_wave: Optional[int] = None  # expert_wave: local experts per wave
    block_n: Optional[int] = None  # N tile: 256, 128 or 64 (M is BLOCK_M)
    stages: Optional[int] = None  # A/B ring depth (>= 2)
    dispatch_copy: Optional[str] = None  # how the dispatch warp copies rows: "lsu" or "bulk"
    dispatch_window: Optional[int] = None  # bulk Dispatch: copy row r once row r - W has an L1 tile done
    l2_columns: Optional[bool] = None  # expert_wave: each expert's L2 tiles column by column
    trace: bool = False  # per-tile timelines into MegaMoE.last_trace (TRACE_FIELDS)
    timeout_ns: int = 2_000_000_000  # bound of every device-side wait (then an error word, not a hang)
    precision: str = "bf16"  # "bf16", "w8a8" or "w4a8" (see the class docstring)
    # How a CTA pair shares a scheduler row of 2 x 128 pool rows: "m", split along M with the weights
    # (B) multicast; "n", a row holding <= 128 of its expert's rows split along N instead (two N blocks
    # of its first 128 rows, the rows (A) multicast), so no member computes padding, and any other row
    # along M (docs/moe-core.md section 6). None: resolve's choice.
    pair_split: Optional[str] = None

    def __post_init__(self):
        for name in ("lead", "block_n", "stages", "dispatch_window", "timeout_ns"):
            value = getattr(self, name)
            if (value is not None or name == "timeout_ns") and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if self.schedule not in SCHEDULES + (AUTO,):
            raise ValueError(f"schedule must be one of {SCHEDULES + (AUTO,)}, got {self.schedule!r}")
        if self.schedule == AUTO:
            for name in ("lead", "experts_per_wave", "l2_columns"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} belongs to a fixed schedule; schedule='auto' takes the chosen "
                                     "schedule's defaults")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        ew = self.schedule == "expert_wave"
        for name, applies in (("lead", not ew), ("experts_per_wave", ew), ("l2_columns", ew)):
            if getattr(self, name) is not None and not applies:
                raise ValueError(f"{name} does not apply to schedule={self.schedule!r}")
        if self.lead is not None and self.lead < 1:
            raise ValueError(f"lead must be >= 1 (deadlock freedom), got {self.lead}")
        check_experts_per_wave(self.experts_per_wave)
        if self.block_n is not None and self.block_n not in BLOCK_NS:
            raise ValueError(f"block_n must be one of {BLOCK_NS}, got {self.block_n}")
        if self.stages is not None and self.stages < 2:
            raise ValueError(f"stages must be >= 2, got {self.stages}")
        if self.dispatch_copy is not None and self.dispatch_copy not in DISPATCH_COPIES:
            raise ValueError(f"dispatch_copy must be one of {DISPATCH_COPIES}, got {self.dispatch_copy!r}")
        if self.dispatch_window is not None and (self.dispatch_window < 0 or (
                self.dispatch_window and self.dispatch_copy == "lsu")):
            raise ValueError(f"dispatch_window must be 0, or >= 1 with the bulk Dispatch, got {self.dispatch_window}")
        if self.timeout_ns <= 0:
            raise ValueError(f"timeout_ns must be > 0, got {self.timeout_ns}")
        if self.pair_split is not None and self.pair_split not in PAIR_SPLITS:
            raise ValueError(f"pair_split must be one of {PAIR_SPLITS}, got {self.pair_split!r}")

    def choose_schedule(self, shape, world_size: int, max_tokens: int, num_sms: int, platform, expert_rows=None):
        """``schedule="auto"``: (this config with the schedule the model picks, the
        :class:`xstage.planner.ScheduleChoice`) -- :func:`xstage.planner.choose_megamoe_schedule`
        on ``platform``, the calibrated remote path of the layer's world (None: none), at the
        block_n the config resolves to and expert_wave's wave count (:meth:`auto_model`).
        ``expert_rows``: a call's rows per local expert of each deciding rank (None: balanced at
        ``max_tokens``, the layer's choice at construction). Host arithmetic only. Other
        schedules: (self, None)."""
        if self.schedule != AUTO:
            return self, None
        from xstage import planner

        if platform is None:
            choice = planner.choose_megamoe_schedule(None, hidden=shape.hidden, intermediate=shape.intermediate,
                                                     experts=shape.num_experts, topk=shape.topk, tokens=max_tokens,
                                                     world=world_size)
        else:
            plan, waves = self.auto_model(shape, world_size, max_tokens, num_sms, platform)
            choice = planner.schedule_choice_of(plan, waves=waves, expert_rows=expert_rows)
        return dataclasses.replace(self, schedule=choice.schedule), choice

    def auto_model(self, shape, world_size: int, max_tokens: int, num_sms: int, platform):
        """What ``schedule="auto"`` decides from on a remote path, fixed per layer: the planner's
        :class:`~xstage.planner.MoEPlan` (balanced routing at ``max_tokens``, interleaved's
        block_n) and expert_wave's waves per rank. A call then only adds its rows per expert
        (:func:`xstage.planner.schedule_choice_of`)."""
        from xstage import planner

        resolved = {s: dataclasses.replace(self, schedule=s).resolve(shape, world_size, max_tokens, num_sms)
                    for s in ("interleaved", "expert_wave")}
        local = shape.num_experts // world_size
        plan = planner.plan_megamoe(platform, hidden=shape.hidden, intermediate=shape.intermediate,
                                    experts=shape.num_experts, topk=shape.topk, tokens=max_tokens, world=world_size,
                                    block_n=resolved["interleaved"].block_n)
        return plan, -(-local // resolved["expert_wave"].experts_per_wave)

    @property
    def resolved(self) -> bool:
        return None not in (self.block_n, self.stages, self.dispatch_copy, self.dispatch_window, self.pair_split) and (
            self.lead is not None if self.schedule == "interleaved" else self.l2_columns is not None)

    def schedule_spec(self) -> Schedule:
        """The scheduler (pure step functions) of a resolved config: interleaved always pairs the
        CTA pairs' L1 and L2 shares (row_grid.balanced_l2_start; measured 0.993x at P = 1 and
        0.9995x at P = 8 against unbalanced starts, redesign_switches/)."""
        if self.schedule == "interleaved":
            return InterleavedSchedule(lead=self.lead, balance_l2=True)
        return ExpertWaveSchedule(l2_columns=bool(self.l2_columns))

    @property
    def row_split_n(self) -> bool:
        """A resolved config's CTA pair splits a row holding <= BLOCK_M rows along N (``pair_split="n"``;
        :class:`~.scheduler.RowGrid`'s ``row_split_n``)."""
        return self.pair_split == "n"

    @property
    def row_block(self) -> int:
        """Pool rows per scheduler row: 2 x BLOCK_M, which the CTA pair splits along M (``pair_split="n"``:
        along N where a row holds <= BLOCK_M rows)."""
        return 2 * BLOCK_M

    def pair_tiles(self, hidden: int, intermediate: int) -> tuple:
        """(L1, L2) pair tiles per scheduler row of a resolved config (:func:`pair_tiles_per_row`)."""
        return pair_tiles_per_row(2 * intermediate, self.block_n), pair_tiles_per_row(hidden, self.block_n)

    @property
    def fp8(self) -> bool:
        """E4M3 activations and the FP8 mainloop (W8A8, and W4A8 on its widened weights)."""
        return self.precision in FP8_PRECISIONS

    def kernel_key(self) -> "MegaMoEConfig":
        """The fields that change the compiled kernel (``experts_per_wave`` is host-side only)."""
        return dataclasses.replace(self, experts_per_wave=None)

    def resolve(self, shape, world_size: int, tokens: int, num_sms: int) -> "MegaMoEConfig":
        """Every ``None`` field filled in for ``shape`` (hidden, intermediate, num_experts, topk),
        ``world_size`` ranks of ``tokens`` tokens each (``max_tokens_per_rank``) and a launch of up
        to ``num_sms`` CTAs; raises ValueError when the configuration cannot run.

        * block_n: the widest of 256 / 128 / 64 that tiles H and I (CTA pairs need H % 2 BN).
        * stages: 4 below DEEP_RING_MAX_ROWS rows per local expert (balanced routing), else 3 at
          128 x 256 tiles: 4 are 9.5 % faster at 192 rows per expert (P = 1), 3 are 1-5 % faster
          at 1536 (loopback P = 8) (stages/); only those two points were measured. W4A8: 3 (its
          widened B blocks leave no room for a fourth).
        * dispatch_copy: "bulk" where its bounce buffers fit next to the ring (the 3-stage tiles),
          else "lsu": paired against the grouped GEMMs, interleaved 1.044-1.061x -> 1.017-1.031x,
          1.014x with the copies' L2 evict-first policy (bulk/).
        * dispatch_window: expert_wave with the bulk copy paces it one row beyond the L1 rows in
          flight, (num_sms / 2 pairs) // (L1 pair tiles per row) + 1 (= 5 at DeepSeek-V4-Flash):
          W = 0 / 4 / 5 / 6 / 7 gave 1.048 / 1.088 / 1.009 / 1.017 / 1.033x; interleaved no W in
          5..14 beat W = 0 (window/).
        * l2_columns: on for expert_wave wherever the order's positions fit int_ops.divmod_small
          (0.1-0.3 % faster than the row order on three hosts, l2_columns/ in results/h200/megamoe/archive/README.md).
        * pair_split: "n" at up to BLOCK_M rows per local expert (balanced routing), else "m": at 512
          tokens per rank (12 rows per expert, P = 1) the N split's kernel took 0.81x the M split's time
          in W8A8 and 0.89x in BF16 (ab_trees, same host); above 128 rows it is not measured. "n" splits
          only the rows holding <= BLOCK_M rows along N, so a hot expert's weights are still read once
          per 2 x BLOCK_M rows (not yet measured: the fixed N split was 1.169x the M split under skew).
        * lead: ceil(eq. 16); experts_per_wave: a quarter of the local experts.

        precision="w8a8" (and "w4a8") also needs H and I to be multiples of QUANT_BLOCK (the 1x128 activation
        groups and 128x128 weight blocks tile K and N of both GEMMs: K = H, N = 2I for Linear-1,
        K = I, N = H for Linear-2) and block_n = 256: an L1 tile of block_n interleaved w1 rows
        yields block_n / 2 columns of h, and its epilogue quantizes h per token and 128 columns,
        so a tile must hold whole groups (hence H % 512 and I % 256 with the CTA pairs). Its
        Dispatch is resolved as the bf16 one's (the bulk copy moves the scales as one more piece).
        """
        if self.schedule == AUTO:
            raise ValueError("schedule='auto' is chosen for a world first (choose_schedule; MegaMoE does it)")
        hidden, inter, experts, topk = shape.hidden, shape.intermediate, shape.num_experts, shape.topk
        if experts % world_size:
            raise ValueError(f"num_experts {experts} not divisible by world size {world_size}")
        if hidden % BLOCK_K or inter % BLOCK_K:
            raise ValueError(f"hidden {hidden} and intermediate {inter} must be multiples of {BLOCK_K}")
        fp8 = self.fp8
        if fp8 and (hidden % QUANT_BLOCK or inter % QUANT_BLOCK):
            raise ValueError(f"precision={self.precision!r}: hidden {hidden} and intermediate {inter} must be multiples of "
                             f"{QUANT_BLOCK} (the FP8 scale blocks)")
        block_n = self.block_n
        if block_n is None:
            block_n = next((n for n in BLOCK_NS if hidden % (2 * n) == 0 and inter % n == 0), None)
            if block_n is None:
                raise ValueError(f"no N tile in {BLOCK_NS} tiles hidden {hidden} and intermediate {inter}")
        if fp8 and block_n != 2 * QUANT_BLOCK:
            raise ValueError(f"precision={self.precision!r} needs block_n={2 * QUANT_BLOCK} (an L1 tile must hold whole 1x128 "
                             f"groups of h), so H % 512 == 0 and I % 256 == 0; got block_n={block_n} for "
                             f"H={hidden}, I={inter}")
        if hidden % (2 * block_n) or (2 * inter) % (2 * block_n):
            raise ValueError(f"H={hidden} and 2I={2 * inter} must be multiples of 2*block_n={2 * block_n}")
        rows_per_expert = world_size * tokens * topk / experts
        split = self.pair_split or ("n" if rows_per_expert <= BLOCK_M else "m")
        stages = self.stages
        if stages is None:
            deep = rows_per_expert < DEEP_RING_MAX_ROWS and self.precision != "w4a8"
            stages = 3 if block_n == 256 and not deep else 4
        copy = self.dispatch_copy
        if copy is None:
            copy = "lsu"
            try:
                smem_plan(hidden, block_n, stages, "bulk", precision=self.precision)
                copy = "bulk"
            except ValueError:  # no room for the bounce buffers
                pass
        smem_plan(hidden, block_n, stages, copy, precision=self.precision)
        ew = self.schedule == "expert_wave"
        window = self.dispatch_window
        if window is None:
            window = (num_sms // 2) // pair_tiles_per_row(2 * inter, block_n) + 1 \
                if ew and copy == "bulk" else 0
        if window and copy != "bulk":
            raise ValueError("dispatch_window needs dispatch_copy='bulk'")
        out = dict(block_n=block_n, stages=stages, dispatch_copy=copy, dispatch_window=window, pair_split=split)
        if ew:
            # l2_columns: an expert's L2 positions must stay in divmod_small's exact range
            positions = (tokens * world_size // (2 * BLOCK_M) + 1) \
                * pair_tiles_per_row(hidden, block_n)
            l2_columns = positions < DIVMOD_SMALL_MAX if self.l2_columns is None else self.l2_columns
            if l2_columns and positions >= DIVMOD_SMALL_MAX:
                raise ValueError(f"l2_columns: up to {positions} L2 pair tiles per expert, the order handles "
                                 f"< {DIVMOD_SMALL_MAX}; lower max_tokens_per_rank or set l2_columns=False")
            out.update(l2_columns=l2_columns, experts_per_wave=self.experts_per_wave
                       or default_experts_per_wave(experts // world_size))
        else:
            out.update(lead=self.lead if self.lead is not None else default_lead(block_n, num_sms, inter))
        return dataclasses.replace(self, **out)
