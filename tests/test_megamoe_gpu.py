"""GPU tests (Hopper) of the MoE kernels in the loopback world against float32 references."""
import pytest
import torch

import dataclasses

from megamoe_interleave.config import BLOCK_M
from megamoe_interleave.row_grid import balanced_l2_start, enumerate_all, make_row_grid, schedule_table
from megamoe_interleave.scheduler import ExpertWaveSchedule, InterleavedSchedule

pytestmark = pytest.mark.gpu

E, H, I = 16, 256, 128


@pytest.mark.parametrize("schedule", [ExpertWaveSchedule(), ExpertWaveSchedule(l2_columns=True),
                                      InterleavedSchedule(lead=2), InterleavedSchedule(lead=2, balance_l2=True)],
                         ids=["expert_wave", "expert_wave_l2_columns", "interleaved", "interleaved_balanced"])
@pytest.mark.parametrize("row_split_n", [False, True], ids=["m_split", "row_split_n"])
def test_device_schedule_equals_python_reference(schedule, row_split_n):
    from lab.megamoe.schedule_trace import compile_schedule_trace

    counts = [0, 65, 1, 300, 128, 0, 7, 64]
    grid = make_row_grid(counts, block_m=64, n_blocks_l1=8, n_blocks_l2=4, experts_per_wave=3, row_split_n=row_split_n)
    num_ctas = 6
    grid = dataclasses.replace(grid, l2_start=balanced_l2_start(grid, num_ctas // 2, block_m=64, hidden=H,
                                                                intermediate=I))
    ref = enumerate_all(schedule, grid, num_ctas)
    max_tiles = max(len(s) for s in ref) + 4
    dev = torch.device("cuda")
    out = torch.full((num_ctas, max_tiles, 7), -7, dtype=torch.int32, device=dev)
    cnt = torch.full((num_ctas,), -7, dtype=torch.int32, device=dev)
    t = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
    fn = compile_schedule_trace(schedule, grid.pairs_l1, grid.pairs_l2, grid.row_block, row_split_n)
    fn(t(grid.row_record), t(schedule_table(schedule, grid)), grid.num_rows, out, cnt)
    torch.cuda.synchronize()
    for c in range(num_ctas):
        assert cnt[c].item() == len(ref[c])
        got = out[c, : len(ref[c])].cpu().tolist()
        want = [[x.phase, x.row, x.expert, x.m_block, x.n_block, x.tok0, x.count] for x in ref[c]]
        assert got == want


def _problem(P, tokens, k, kind, mask, seed, hidden=H, inter=I):
    from lab.megamoe.routing import make_routing

    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(E, 2 * inter, hidden, generator=g) / hidden ** 0.5).bfloat16()
    w2 = (torch.randn(E, hidden, inter, generator=g) / inter ** 0.5).bfloat16()
    xs = [torch.randn(t, hidden, generator=g).bfloat16().cuda() for t in tokens]
    routes = [make_routing(kind, t, E, k, seed=seed * 31 + r, mask_ratio=mask, strength=2.0) for r, t in enumerate(tokens)]
    return w1.cuda(), w2.cuda(), xs, [r[0].cuda() for r in routes], [r[1].cuda() for r in routes]


def _make(P, k, schedule, *, world="loopback", hidden=H, inter=I, num_sms=None, **config):
    """A fused MegaMoE (max 256 tokens per rank); ``config``: MegaMoEConfig fields (interleaved
    lead 2 and expert_wave 2 experts per wave unless given, the rest resolved)."""
    from megamoe_interleave import MegaMoE, MegaMoEConfig, make_world

    config.setdefault("lead" if schedule == "interleaved" else "experts_per_wave", 2)
    return MegaMoE(make_world(world, world_size=P, device="cuda"), E, hidden, inter, k, 256,
                   MegaMoEConfig(schedule, **config), backend="fused", num_sms=num_sms)


def _check_both_schedules(problem, P, k, **kw):
    """Both schedules' fused outputs match the fp32 reference and are bitwise equal."""
    from megamoe_interleave.reference import reference_moe_fp32

    w1, w2, xs, idx, w = problem
    refs = reference_moe_fp32(xs, idx, w, w1, w2)
    outs = []
    for schedule in ("expert_wave", "interleaved"):
        moe = _make(P, k, schedule, **kw)
        moe.load_weights(w1, w2)
        outs.append(moe.forward(xs, idx, w))
        _check(outs[-1], refs)
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def _check(ys, refs):
    for y, ref in zip(ys, refs):
        assert y.shape == ref.shape
        if y.numel() == 0:
            continue
        assert torch.isfinite(y.float()).all()
        err = (y.float() - ref).abs().max().item()
        assert err <= 0.02 + 0.02 * ref.abs().max().item(), err


CASES = [
    # P, tokens per rank, top-k, routing, mask ratio
    (1, [200], 2, "balanced", 0.0),
    (2, [100, 0], 1, "skewed", 0.0),
    (4, [65, 3, 130, 17], 6, "balanced", 0.2),
    (8, [40, 1, 0, 77, 64, 5, 9, 120], 8, "skewed", 0.1),
    (8, [32] * 8, 6, "balanced", 0.0),
]


@pytest.mark.parametrize("P,tokens,k,kind,mask", CASES)
def test_fused_matches_fp32_and_schedules_bitwise(P, tokens, k, kind, mask):
    from lab.megamoe.routing import expert_load

    problem = _problem(P, tokens, k, kind, mask, seed=P * 7 + k)
    load = expert_load(torch.cat(problem[3]).cpu(), E)
    _check_both_schedules(problem, P, k)
    assert (load % BLOCK_M != 0).any()  # partial M blocks are exercised in every case


def test_zero_token_experts_and_partial_blocks_present():
    """The cases exercise both tail kinds of the kernel: last m-blocks of <= 64 rows (run as
    64-row half tiles) and of 65..127 rows (full tiles with masked rows), and empty experts."""
    from lab.megamoe.routing import expert_load

    loads = []
    for P, tokens, k, kind, mask in CASES:
        _, _, _, idx, _ = _problem(P, tokens, k, kind, mask, seed=P * 7 + k)
        loads.append(expert_load(torch.cat(idx).cpu(), E))
    load = torch.cat(loads)
    tails = load % BLOCK_M
    assert (load == 0).any()
    assert ((tails > 0) & (tails <= 64)).any() and (tails > 64).any()


def test_fused_zero_token_expert_explicit():
    """Route every token to experts {0, 1}: experts 2..15 receive nothing."""
    from megamoe_interleave.reference import reference_moe_fp32

    w1, w2, xs, _, _ = _problem(2, [50, 70], 2, "balanced", 0.0, seed=5)
    idx = [torch.tensor([[0, 1]] * x.shape[0], device="cuda") for x in xs]
    w = [torch.rand(x.shape[0], 2, device="cuda") for x in xs]
    refs = reference_moe_fp32(xs, idx, w, w1, w2)
    moe = _make(2, 2, "interleaved")
    moe.load_weights(w1, w2)
    _check(moe.forward(xs, idx, w), refs)


@pytest.mark.parametrize("schedule", ["expert_wave", "interleaved"])
def test_fused_100_repeated_calls_reuse_buffer(schedule):
    from megamoe_interleave.reference import reference_moe_fp32

    P, k = 2, 6
    moe = _make(P, k, schedule)
    w1, w2, _, _, _ = _problem(P, [1, 1], k, "balanced", 0.0, seed=11)
    moe.load_weights(w1, w2)
    first = None
    for it in range(100):
        tokens = [17 + (it * 13) % 100, (it * 7) % 60]
        _, _, xs, idx, w = _problem(P, tokens, k, "balanced" if it % 2 else "skewed", 0.1 * (it % 3), seed=100 + it)
        ys = moe.forward(xs, idx, w)
        if it % 10 == 0:
            _check(ys, reference_moe_fp32(xs, idx, w, w1, w2))
        if it == 0:
            first = (xs, idx, w, [y.clone() for y in ys])
    xs, idx, w, ys0 = first
    for a, b in zip(moe.forward(xs, idx, w), ys0):
        assert torch.equal(a, b)  # deterministic across calls (counters were reset)


@pytest.mark.parametrize("precision,pair_split", [("bf16", "n"), ("bf16", "m"), ("w8a8", "n")])
def test_fused_timeout_raises(precision, pair_split):
    """timeout_ns=1: every wait times out at once. The host raises DeviceError, and the CUDA
    context survives it (no CTA left with loads or remote arrives in flight, no ring stage refilled
    before both CTAs of the pair consumed it: a launch failure would poison every later call), so
    a healthy instance then gives correct results. (Before the ring waits kept the pair in step
    after a timeout, the N split failed the launch here at H 512, I 256: the peer's multicast
    landed in a barrier phase not yet armed.)"""
    from megamoe_interleave.reference import reference_moe_fp32
    from xstage.device import DeviceError

    w1, w2, xs, idx, w = _problem(1, [200], 6, "balanced", 0.0, seed=3, hidden=512, inter=256)
    broken = _make(1, 6, "interleaved", hidden=512, inter=256, timeout_ns=1, precision=precision,
                   pair_split=pair_split)
    broken.load_weights(w1, w2)
    for _ in range(5):
        with pytest.raises(DeviceError):
            broken.forward(xs, idx, w)
    healthy = _make(1, 6, "interleaved", hidden=512, inter=256)
    healthy.load_weights(w1, w2)
    _check(healthy.forward(xs, idx, w), reference_moe_fp32(xs, idx, w, w1, w2))


@pytest.mark.parametrize("schedule", ["expert_wave", "interleaved"])
def test_fused_trace_follows_scheduler_and_dependencies(schedule):
    """The executed per-CTA tile order is the Python reference order, timestamps are ordered,
    and every L2 tile became ready only after all L1 tiles of its row had finished."""
    from megamoe_interleave.trace import decode_trace
    from megamoe_interleave.reference import reference_moe_fp32
    from megamoe_interleave.scheduler import PHASE_L1, PHASE_L2

    P, k = 2, 6
    w1, w2, xs, idx, w = _problem(P, [150, 90], k, "skewed", 0.0, seed=21)
    moe = _make(P, k, schedule, trace=True)
    moe.load_weights(w1, w2)
    _check(moe.forward(xs, idx, w), reference_moe_fp32(xs, idx, w, w1, w2))
    for d in range(P):
        _, grid = moe.planner.plan_rank(d)
        recs = decode_trace(moe.last_trace[d])
        ref = enumerate_all(moe.config.schedule_spec(), grid, len(recs))
        l1_end = {}
        cross_warp_excess, worst = 0, None
        for c, (got, want) in enumerate(zip(recs, ref)):
            assert [(r["phase"], r["row"], r["n_block"]) for r in got] == [(t.phase, t.row, t.n_block) for t in want]
            for r in got:
                assert r["t_start"] <= r["t_ready"] <= r["t_mainloop"] <= r["t_slot"] <= r["t_epilogue"]
                # the epilogue warps' side: their stores end after the tile was staged; their issue
                # span lies inside [slot free, stores issued] (part spans summed). Readings of two
                # warps (consumer thread 0, epilogue thread 0) ordered by the named barriers; the
                # stamps after a barrier wait are barrier_timestamp's (a plain timer read after
                # bar.sync ran up to 5.6 us ahead of the barrier on the H200)
                assert r["rs_ns"] >= 0
                excess = max(r["t_epilogue"] - r["t_rs_end"], r["rs_ns"] - (r["t_rs_end"] - r["t_slot"]))
                if excess > cross_warp_excess:
                    cross_warp_excess, worst = excess, (c, got.index(r), {k: v - r["t_start"] if k.startswith("t_") else v for k, v in r.items()})
                # SM cycles over tile start -> mainloop end: a clock between 0.3 and 2.5 GHz
                ns = r["t_mainloop"] - r["t_start"]
                assert r["cycles"] > 0 and (ns < 5000 or 0.3 * ns < r["cycles"] < 2.5 * ns), r
                if r["phase"] == PHASE_L1:
                    l1_end[r["row"]] = max(l1_end.get(r["row"], 0), r["t_epilogue"])
        slack_ns = 2000  # %globaltimer update granularity
        assert cross_warp_excess <= slack_ns, f"epilogue vs consumer stamps out of order by {cross_warp_excess} ns: {worst}"
        for got in recs:
            for r in got:
                if r["phase"] == PHASE_L2:
                    assert r["t_ready"] + slack_ns >= l1_end[r["row"]]


@pytest.mark.parametrize("block_n,stages,hidden,inter", [(64, 4, H, I), (64, 7, H, I), (128, 2, H, I),
                                                         (128, 3, H, I), (256, 3, 512, 256), (256, 4, 512, 256)])
def test_fused_tiles_and_ring_depths(block_n, stages, hidden, inter):
    """Every N tile; ring depths below, between and above a tile's K blocks (L1 H/64, L2 I/64), so
    stage index and phase wrap across tile and phase boundaries; 128 x 256 tiles with one (3
    stages) and two (4 stages) L2 handoffs; experts of 65 / 130 rows (odd last blocks leave one CTA
    of the pair without rows); both schedules bitwise equal."""
    P, k = 4, 6
    problem = _problem(P, [65, 3, 130, 17], k, "skewed", 0.1, seed=90 + stages + block_n, hidden=hidden, inter=inter)
    _check_both_schedules(problem, P, k, block_n=block_n, stages=stages, hidden=hidden, inter=inter)


def _variants_bitwise_equal(problem, variants, calls=1, check=None):
    """Every MegaMoE of ``variants`` (zero-argument constructors): its weights loaded, ``calls``
    forwards each checked against the fp32 reference (and by ``check(moe)``), the last y of
    every variant bitwise equal, every call of a variant bitwise equal to its first."""
    from megamoe_interleave.reference import reference_moe_fp32

    w1, w2, xs, idx, w = problem
    refs = reference_moe_fp32(xs, idx, w, w1, w2)
    outs = []
    for make in variants:
        moe = make()
        moe.load_weights(w1, w2)
        runs = [moe.forward(xs, idx, w) for _ in range(calls)]
        for ys in runs:
            _check(ys, refs)
            for a, b in zip(ys, runs[0]):
                assert torch.equal(a, b)
        if check is not None:
            check(moe)
        outs.append(runs[-1])
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)


def test_l2_handoffs_bitwise_equal():
    """Staging the L2 output in two handoffs (the 4-stage 128 x 256 ring) or one (3 stages)
    changes no bit of y."""
    from megamoe_interleave.config import smem_plan

    P, k, hidden, inter = 2, 6, 512, 256
    assert [smem_plan(hidden, 256, s, "lsu").l2_handoffs for s in (3, 4)] == [1, 2]
    problem = _problem(P, [250, 170], k, "skewed", 0.1, seed=31, hidden=hidden, inter=inter)
    _variants_bitwise_equal(problem, [
        lambda s=s: _make(P, k, "interleaved", block_n=256, stages=s, dispatch_copy="lsu", hidden=hidden, inter=inter)
        for s in (3, 4)])


def test_fused_remote_paths_bitwise_equal():
    """The worlds with a remote path change no bit of y, both schedules: ``host`` (every symmetric
    buffer in pinned host memory: Dispatch reads and Combine stores cross PCIe) and
    ``loopback+host`` (only the Combine destinations there: the remote stores alone cross PCIe),
    against the plain loopback world."""
    P, k = 2, 6
    problem = _problem(P, [70, 33], k, "balanced", 0.1, seed=5)
    _variants_bitwise_equal(problem, [lambda s=s, w=w: _make(P, k, s, world=w)
                                      for w in ("loopback", "host", "loopback+host")
                                      for s in ("expert_wave", "interleaved")])


def test_l2_columns_bitwise_equal():
    """expert_wave's expert-column L2 order changes no bit of y against the row-major order (each
    output element is one tile's, whatever the order), with masked picks, partial blocks and
    experts of several rows (two L2 pair tiles per row, so the tiles really move); LSU and
    windowed bulk Dispatch; three calls each (counters reset)."""
    P, k, hidden, inter = 2, 6, 256, 128
    problem = _problem(P, [250, 170], k, "skewed", 0.1, seed=71, hidden=hidden, inter=inter)

    def several_rows(moe):
        assert any(rec[1] >= 1 for rec in moe.planner.plan_rank(0)[1].row_record), "need an expert of several rows"
    _variants_bitwise_equal(problem, [
        lambda o=o: _make(P, k, "expert_wave", block_n=128, stages=2, hidden=hidden, inter=inter, num_sms=8, **o)
        for o in (dict(l2_columns=False), dict(), dict(l2_columns=True, dispatch_copy="bulk", dispatch_window=2))],
        calls=3, check=several_rows)


@pytest.mark.parametrize("schedule", ["expert_wave", "interleaved"])
def test_pair_split_n_gives_the_m_splits_bits(schedule):
    """MegaMoEConfig(pair_split="n") (a scheduler row of <= 128 rows split along N: the pair takes two
    N blocks, A multicast; other rows along M) runs every (m-block, n-block) tile as the M split does,
    so y is bitwise the same: rows of both kinds in one launch, experts of several rows, half tiles and
    empty experts, masked picks, three calls each (counters reset); and through the device-side plan
    (enqueue) too."""
    from megamoe_interleave.scheduler import row_splits_n

    P, k, hidden, inter = 2, 6, 512, 256
    problem = _problem(P, [250, 170], k, "skewed", 0.1, seed=81, hidden=hidden, inter=inter)

    def row_layout(moe):  # the variant runs the layout it asks for
        grid = moe.planner.plan_rank(0)[1]
        assert grid.row_block == 2 * BLOCK_M
        assert grid.row_split_n == (moe.config.pair_split == "n")
        if grid.row_split_n:
            assert {bool(row_splits_n(grid, rec[1], rec[3])) for rec in grid.row_record} == {True, False}
    variants = [lambda p=p: _make(P, k, schedule, block_n=128, hidden=hidden, inter=inter, pair_split=p)
                for p in ("m", "n")]
    _variants_bitwise_equal(problem, variants, calls=3, check=row_layout)
    w1, w2, xs, idx, w = problem
    ys = []
    for make in variants:
        moe = make()
        moe.load_weights(w1, w2)
        ys.append([y.clone() for y in moe.enqueue(xs, idx, w)])
        moe.check()
    for a, b in zip(*ys):
        assert torch.equal(a, b)


@pytest.mark.parametrize("hidden", [256, 7168])  # one bulk piece per row / two
@pytest.mark.parametrize("num_sms", [8, 132])
def test_dispatch_variants_bitwise_equal(hidden, num_sms):
    """The bulk Dispatch (unpaced; windowed W = 1 and 3) changes no bit of y against the LSU copy,
    in both schedules, with masked picks and partial blocks. With 8 SMs the prologue covers few
    rows, so the dispatch warp moves nearly all of them (L1 producers wait on the per-row
    counters); repeated calls check that the counters, the bounce buffers' mbarrier phases and
    bulk groups start afresh each call."""
    P, k, inter = 2, 6, 128
    problem = _problem(P, [250, 170], k, "skewed", 0.1, seed=61, hidden=hidden, inter=inter)

    def enough_rows(moe):
        assert moe.planner.plan_rank(0)[1].num_rows > 4, "need more scheduler rows than the prologue covers"
    _variants_bitwise_equal(problem, [
        lambda s=s, c=c, win=win: _make(P, k, s, block_n=128, stages=2, num_sms=num_sms, hidden=hidden, inter=inter,
                                        dispatch_copy=c, dispatch_window=win)
        for s in ("expert_wave", "interleaved") for c, win in (("lsu", 0), ("bulk", 0), ("bulk", 1), ("bulk", 3))],
        calls=3, check=enough_rows)


def test_rerun_repeats_forward_bitwise():
    """MegaMoE.rerun() (the kernels and the reduction again on the staged inputs) returns
    forward()'s y bit for bit, twice."""
    P, k = 2, 6
    w1, w2, xs, idx, w = _problem(P, [90, 41], k, "balanced", 0.1, seed=71)
    moe = _make(P, k, "expert_wave", block_n=128, stages=2)
    moe.load_weights(w1, w2)
    ys = [y.clone() for y in moe.forward(xs, idx, w)]
    for _ in range(2):
        for a, b in zip(ys, moe.rerun()):
            assert torch.equal(a, b)


def test_row_metadata_handoff_with_consecutive_l1_tiles():
    """The epilogue warps write an L1 tile's routing weights into shared memory as soon as the
    previous tile's staged output is read out, while the consumers may still be staging; if that
    handoff raced, a row would take another tile's weight. One CTA pair (num_sms = 2) runs every
    tile of the rank back to back -- long runs of consecutive L1 tiles under expert_wave --, the
    picks' weights spread over three decades, y checked against the fp32 reference and bitwise
    against the 132-SM launch, five calls each. (compute-sanitizer's racecheck flags exactly this
    handoff, also with every barrier of it two-sided: results/h200/sanitizers/README.md.)"""
    P, k = 2, 6
    w1, w2, xs, idx, _ = _problem(P, [250, 170], k, "balanced", 0.0, seed=81)
    g = torch.Generator(device="cuda").manual_seed(5)
    w = [10 ** (3 * torch.rand(i.shape, generator=g, device="cuda") - 2) for i in idx]
    _variants_bitwise_equal((w1, w2, xs, idx, w), [
        lambda n=n: _make(P, k, "expert_wave", num_sms=n, experts_per_wave=8) for n in (2, 132)], calls=5)


def test_schedule_auto_per_call_on_the_pcie_path(monkeypatch):
    """schedule="auto" in the loopback+host world: each forward picks from its routing and runs
    that schedule's kernel. On the calibrated PCIe path this small layer's waves absorb the Combine
    (expert_wave). On a path whose rate lets one routing's waves absorb and not another's (capacity
    1 byte), one layer switches per call, both ways. y matches the fp32 reference and the fixed
    schedules' y bitwise; enqueue keeps the pick made at construction."""
    import dataclasses

    from megamoe_interleave import MegaMoE, MegaMoEConfig, api, make_world
    from megamoe_interleave.reference import reference_moe_fp32
    from lab.megamoe.routing import expert_load
    from xstage import planner, profiles

    P, k = 2, 6
    tokens = [120, 77]
    problems = {kind: _problem(P, tokens, k, kind, 0.0, seed=11) for kind in ("balanced", "skewed")}

    def make(schedule):
        moe = MegaMoE(make_world("loopback+host", world_size=P, device="cuda"), E, H, I, k, 256,
                      MegaMoEConfig(schedule), backend="fused")
        moe.load_weights(*problems["balanced"][:2])  # one set of weights for both problems
        return moe

    w1, w2 = problems["balanced"][:2]
    fixed = {}
    for s in ("expert_wave", "interleaved"):
        moe = make(s)
        for kind, (_, _, xs, idx, w) in problems.items():
            fixed[kind, s] = [y.clone() for y in moe.forward(xs, idx, w)]
    pcie = profiles.load("h200-pcie-host")
    monkeypatch.setattr(api, "_remote_path", lambda world: pcie)
    moe = make("auto")
    plan, waves = moe.auto_model

    def rank_terms(kind):  # (T_L2, Combine bytes) of each destination rank for this routing
        load = sum(expert_load(i.cpu(), E) for i in problems[kind][3])
        el = E // P
        return [planner._rank_kernel_terms(plan, load[d * el:(d + 1) * el].tolist())[1:] for d in range(P)]

    # A rate at which every rank of the routing with the longer Linear-2 absorbs its Combine
    # (backlog 0) and some rank of the other does not (backlog > Q = 1 byte).
    (absorbs, spills) = sorted(problems, key=lambda kind: -min(t2 / v for t2, v in rank_terms(kind)))
    rate = 1.001 * max(v / t2 for t2, v in rank_terms(absorbs))
    assert any(v - rate * t2 > 1.0 for t2, v in rank_terms(spills)), "the two routings need different m-blocks"
    for platform, picks in ((pcie, {"balanced": "expert_wave", "skewed": "expert_wave"}),
                            (dataclasses.replace(pcie, R=rate, Q=1.0), {absorbs: "expert_wave", spills: "interleaved"})):
        monkeypatch.setattr(api, "_remote_path", lambda world, p=platform: p)
        moe = make("auto")
        for kind in ("balanced", "skewed", "balanced"):
            _, _, xs, idx, w = problems[kind]
            ys = moe.forward(xs, idx, w)
            want = picks[kind]
            ran = moe.planner.cached.config.schedule  # the call's plan carries the config it ran
            assert moe.last_schedule_choice.schedule == want == ran, moe.last_schedule_choice.reason
            _check(ys, reference_moe_fp32(xs, idx, w, w1, w2))
            for a, b in zip(ys, fixed[kind, want]):
                assert torch.equal(a, b)
        ys = moe.enqueue(xs, idx, w)  # the balanced problem, the construction-time pick
        moe.check()
        assert moe.config.schedule == moe.schedule_choice.schedule
        for a, b in zip(ys, fixed["balanced", moe.schedule_choice.schedule]):
            assert torch.equal(a, b)
