"""GPU tests (Hopper) of the MoE kernels in the loopback world against float32 references."""
import pytest
import torch

import dataclasses

from megamoe_interleave.scheduler import Schedule, balanced_l2_start, enumerate_all, make_row_grid, schedule_table

pytestmark = pytest.mark.gpu

E, H, I = 16, 256, 128
BLOCK_M, BLOCK_N = 64, 64


@pytest.mark.parametrize("schedule", [Schedule("expert_wave"), Schedule("expert_wave", l2_columns=True),
                                      Schedule("interleaved", lead=2), Schedule("interleaved", lead=2, balance_l2=True)],
                         ids=["expert_wave", "expert_wave_l2_columns", "interleaved", "interleaved_balanced"])
def test_device_schedule_equals_python_reference(schedule):
    from megamoe_interleave.schedule_trace import compile_schedule_trace

    counts = [0, 65, 1, 300, 128, 0, 7, 64]
    grid = make_row_grid(counts, block_m=64, n_blocks_l1=8, n_blocks_l2=4, experts_per_wave=3)
    num_ctas = 6
    grid = dataclasses.replace(grid, l2_start=balanced_l2_start(grid, num_ctas // 2, block_m=64, hidden=H,
                                                                intermediate=I, split_tail=False))
    ref = enumerate_all(schedule, grid, num_ctas)
    max_tiles = max(len(s) for s in ref) + 4
    dev = torch.device("cuda")
    out = torch.full((num_ctas, max_tiles, 7), -7, dtype=torch.int32, device=dev)
    cnt = torch.full((num_ctas,), -7, dtype=torch.int32, device=dev)
    t = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
    fn = compile_schedule_trace(schedule, grid.pairs_l1, grid.pairs_l2, grid.row_block)
    fn(t(grid.row_record), t(schedule_table(schedule, grid)), grid.num_rows, out, cnt)
    torch.cuda.synchronize()
    for c in range(num_ctas):
        assert cnt[c].item() == len(ref[c])
        got = out[c, : len(ref[c])].cpu().tolist()
        want = [[x.phase, x.row, x.expert, x.m_block, x.n_block, x.tok0, x.count] for x in ref[c]]
        assert got == want


def _problem(P, tokens, k, kind, mask, seed, hidden=H, inter=I):
    from megamoe_interleave.routing import make_routing

    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(E, 2 * inter, hidden, generator=g) / hidden ** 0.5).bfloat16()
    w2 = (torch.randn(E, hidden, inter, generator=g) / inter ** 0.5).bfloat16()
    xs = [torch.randn(t, hidden, generator=g).bfloat16().cuda() for t in tokens]
    routes = [make_routing(kind, t, E, k, seed=seed * 31 + r, mask_ratio=mask, strength=2.0) for r, t in enumerate(tokens)]
    return w1.cuda(), w2.cuda(), xs, [r[0].cuda() for r in routes], [r[1].cuda() for r in routes]


def _make(P, k, schedule, mma="wgmma", **kw):
    from megamoe_interleave.api import MegaMoE, make_world

    world = make_world(kw.pop("world", "loopback"), world_size=P, device="cuda")
    return MegaMoE(world, num_experts=E, hidden=kw.pop("hidden", H), intermediate=kw.pop("inter", I), topk=k,
                   max_tokens_per_rank=256,
                   schedule=schedule, lead=kw.pop("lead", 2), block_m=kw.pop("block_m", BLOCK_M),
                   block_n=kw.pop("block_n", BLOCK_N),
                   backend="fused", experts_per_wave=kw.pop("experts_per_wave", 2), mma=mma, **kw)


def _check_both_schedules(problem, P, k, mma, **kw):
    """Both schedulers' fused outputs match the fp32 reference and are bitwise equal."""
    from megamoe_interleave.reference import reference_moe_fp32

    w1, w2, xs, idx, w = problem
    refs = reference_moe_fp32(xs, idx, w, w1, w2)
    outs = []
    for schedule in ("expert_wave", "interleaved"):
        moe = _make(P, k, schedule, mma, **kw)
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


@pytest.mark.parametrize("mma", ["wgmma", "wgmma_cpasync", "fma", "tma_ws", "tma_ws_mcast", "tma_ws_mcast_b"])
@pytest.mark.parametrize("P,tokens,k,kind,mask", CASES)
def test_fused_matches_fp32_and_schedulers_bitwise(P, tokens, k, kind, mask, mma):
    from megamoe_interleave.routing import expert_load

    problem = _problem(P, tokens, k, kind, mask, seed=P * 7 + k)
    load = expert_load(torch.cat(problem[3]).cpu(), E)
    _check_both_schedules(problem, P, k, mma)
    assert (load % BLOCK_M != 0).any()  # partial M blocks are exercised in every case


def test_zero_token_experts_and_partial_blocks_present():
    from megamoe_interleave.routing import expert_load

    _, _, _, idx, _ = _problem(8, [40, 1, 0, 77, 64, 5, 9, 120], 8, "skewed", 0.1, seed=8 * 7 + 8)
    load = expert_load(torch.cat(idx).cpu(), E)
    assert (load % BLOCK_M != 0).any()


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


@pytest.mark.parametrize("mma", ["wgmma", "wgmma_cpasync", "tma_ws", "tma_ws_mcast", "tma_ws_mcast_b"])
def test_fused_100_repeated_calls_reuse_buffer(mma):
    from megamoe_interleave.reference import reference_moe_fp32

    P, k = 2, 6
    moe = _make(P, k, "interleaved", mma)
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


@pytest.mark.parametrize("mma", ["wgmma", "tma_ws", "tma_ws_mcast", "tma_ws_mcast_b"])
def test_fused_timeout_raises(mma):
    """timeout_ns=0: every wait gives up at once. The host raises DeviceError, and the CUDA
    context survives it (no CTA left with loads or remote arrives in flight: a launch failure
    would poison every later call), so a healthy instance then gives correct results."""
    from megamoe_interleave.reference import reference_moe_fp32
    from xstage.device import DeviceError

    w1, w2, xs, idx, w = _problem(1, [200], 6, "balanced", 0.0, seed=3)
    broken = _make(1, 6, "interleaved", mma, timeout_ns=0)
    broken.load_weights(w1, w2)
    for _ in range(3):
        with pytest.raises(DeviceError):
            broken.forward(xs, idx, w)
    healthy = _make(1, 6, "interleaved", mma)
    healthy.load_weights(w1, w2)
    _check(healthy.forward(xs, idx, w), reference_moe_fp32(xs, idx, w, w1, w2))


@pytest.mark.parametrize("mma", ["wgmma_cpasync", "tma_ws", "tma_ws_mcast", "tma_ws_mcast_b"])
@pytest.mark.parametrize("schedule", ["expert_wave", "interleaved"])
def test_fused_trace_follows_scheduler_and_dependencies(schedule, mma):
    """The executed per-CTA tile order is the Python reference order, timestamps are ordered,
    and every L2 tile became ready only after all L1 tiles of its row had finished."""
    from megamoe_interleave.api import decode_trace
    from megamoe_interleave.reference import reference_moe_fp32
    from megamoe_interleave.scheduler import PHASE_L1, PHASE_L2

    P, k = 2, 6
    w1, w2, xs, idx, w = _problem(P, [150, 90], k, "skewed", 0.0, seed=21)
    moe = _make(P, k, schedule, mma, trace=True)
    moe.load_weights(w1, w2)
    _check(moe.forward(xs, idx, w), reference_moe_fp32(xs, idx, w, w1, w2))
    for d in range(P):
        _, grid = moe.plan_rank(d)
        recs = decode_trace(moe.last_trace[d])
        ref = enumerate_all(moe.schedule, grid, len(recs))
        l1_end = {}
        for c, (got, want) in enumerate(zip(recs, ref)):
            assert [(r["phase"], r["row"], r["n_block"]) for r in got] == [(t.phase, t.row, t.n_block) for t in want]
            for r in got:
                assert r["t_start"] <= r["t_ready"] <= r["t_mainloop"] <= r["t_epilogue"]
                # SM cycles over tile start -> mainloop end: a clock between 0.3 and 2.5 GHz
                ns = r["t_mainloop"] - r["t_start"]
                assert r["cycles"] > 0 and (ns < 5000 or 0.3 * ns < r["cycles"] < 2.5 * ns), r
                if r["phase"] == PHASE_L1:
                    l1_end[r["row"]] = max(l1_end.get(r["row"], 0), r["t_epilogue"])
        slack_ns = 2000  # %globaltimer update granularity
        for got in recs:
            for r in got:
                if r["phase"] == PHASE_L2:
                    assert r["t_ready"] + slack_ns >= l1_end[r["row"]]


@pytest.mark.parametrize("mma,block_m,block_n", [("wgmma", 128, 128), ("wgmma_cpasync", 128, 128),
                                                  ("wgmma_cpasync", 64, 128), ("tma_ws", 128, 128),
                                                  ("tma_ws", 64, 128), ("tma_ws_mcast", 128, 128),
                                                  ("tma_ws_mcast_b", 128, 128)])
def test_fused_larger_tiles(mma, block_m, block_n):
    """Two consumer warpgroups (128-row tiles) and 128-column tiles, both schedulers bitwise equal."""
    P, k = 4, 6
    problem = _problem(P, [65, 3, 130, 17], k, "skewed", 0.1, seed=77)
    _check_both_schedules(problem, P, k, mma, block_m=block_m, block_n=block_n)


@pytest.mark.parametrize("mma", ["wgmma", "tma_ws"])
def test_fused_host_world_remote_path(mma):
    """host world: symmetric x / combine in pinned host memory, so Dispatch reads and the
    Combine 16-byte stores cross PCIe; results must not change."""
    from megamoe_interleave.reference import reference_moe_fp32

    P, k = 2, 6
    w1, w2, xs, idx, w = _problem(P, [70, 33], k, "balanced", 0.1, seed=5)
    refs = reference_moe_fp32(xs, idx, w, w1, w2)
    for schedule in ("expert_wave", "interleaved"):
        moe = _make(P, k, schedule, mma, world="host")
        moe.load_weights(w1, w2)
        _check(moe.forward(xs, idx, w), refs)


@pytest.mark.parametrize("mma", ["tma_ws", "tma_ws_mcast", "tma_ws_mcast_b"])
@pytest.mark.parametrize("stages", [2, 3, 7])
def test_tma_ws_ring_depths(stages, mma):
    """mma='tma_ws': ring depths below, between and above the K blocks of a tile (L1 has
    H/64 = 4, L2 I/64 = 2), so stage index/phase wrap across tile and phase boundaries."""
    P, k = 2, 6
    problem = _problem(P, [150, 77], k, "skewed", 0.1, seed=90 + stages)
    _check_both_schedules(problem, P, k, mma, stages=stages)


@pytest.mark.parametrize("mma,block_m,block_n,stages", [("tma_ws", 128, 256, 3), ("tma_ws", 64, 256, 4),
                                                         ("tma_ws_mcast", 128, 256, 3), ("tma_ws_mcast_b", 128, 256, 3)])
def test_tma_ws_wide_tiles(mma, block_m, block_n, stages):
    """mma='tma_ws' with 256-column tiles (H=512, I=256): the bf16 output staging tile next to
    a 3-4 stage ring; 128-row tiles with experts of 65/130 rows also exercise split_tail."""
    hidden, inter = 512, 256
    P, k = 4, 6
    problem = _problem(P, [65, 3, 130, 17], k, "skewed", 0.1, seed=123, hidden=hidden, inter=inter)
    _check_both_schedules(problem, P, k, mma, block_m=block_m, block_n=block_n, stages=stages, hidden=hidden,
                          inter=inter)


@pytest.mark.parametrize("mma", ["tma_ws", "tma_ws_mcast_b"])
def test_l2_columns_bitwise_equal(mma):
    """expert_wave's expert-column L2 order changes no bit of y against the row-major order
    (each output element is one tile's, whatever the order), with masked picks, partial blocks
    and experts of several rows; LSU and windowed bulk Dispatch; three calls each (counters
    reset). At this size tma_ws has one L2 pair tile per row (its order is the row order, only
    the code differs); tma_ws_mcast_b has two, so its rows' tiles really move."""
    from megamoe_interleave.reference import reference_moe_fp32

    P, k, hidden, inter = 2, 6, 256, 128
    w1, w2, xs, idx, w = _problem(P, [250, 170], k, "skewed", 0.1, seed=71, hidden=hidden, inter=inter)
    refs = reference_moe_fp32(xs, idx, w, w1, w2)
    outs = []
    for options in (dict(l2_columns=False), dict(), dict(l2_columns=True, dispatch_copy="bulk", dispatch_window=2)):
        moe = _make(P, k, "expert_wave", mma, block_m=128, block_n=128, stages=2, hidden=hidden, inter=inter,
                    num_sms=8, **options)
        moe.load_weights(w1, w2)
        for _ in range(3):
            y = moe.forward(xs, idx, w)
            _check(y, refs)
        outs.append(y)
        assert any(rec[1] >= 1 for rec in moe.plan_rank(0)[1].row_record), "need an expert of several rows"
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("mma", ["tma_ws", "tma_ws_mcast_b"])
@pytest.mark.parametrize("hidden", [256, 7168])  # one bulk piece per row / two
def test_bulk_dispatch_bitwise_equal(mma, hidden):
    """dispatch_copy="bulk" (with and without the L2 evict-first policy; windowed, W = 1 with
    the pool rows kept in L2 and discarded after their L1 tiles, W = 3 without) changes no bit
    of y against the LSU copy, in both schedules, with masked picks and partial blocks; 8 SMs,
    so the prologue covers few rows and the dispatch warp's bulk copies move nearly all of
    them; repeated calls check that the bounce buffers' mbarrier phases and bulk groups start
    afresh each call, and that the discarded pool lines are rewritten before they are read."""
    P, k, inter = 2, 6, 128
    problem = _problem(P, [250, 170], k, "skewed", 0.1, seed=61, hidden=hidden, inter=inter)
    variants = [dict(dispatch_copy=copy, dispatch_evict_first=ef, dispatch_window=window, dispatch_keep=keep)
                for copy, ef, window, keep in (("lsu", False, 0, False), ("bulk", False, 0, False),
                                               ("bulk", True, 0, False), ("bulk", True, 1, True), ("bulk", True, 3, False))]
    for schedule in ("expert_wave", "interleaved"):
        _variants_bitwise_equal(P, k, schedule, mma, problem, variants, 4, hidden=hidden, inter=inter)


def _variants_bitwise_equal(P, k, schedule, mma, problem, variants, min_rows, **common):
    """Every variant (MegaMoE options on top of ``common`` and 128 x 128 tiles, 2 stages, 8
    SMs): three calls, each checked against the fp32 reference, with more than ``min_rows``
    scheduler rows on rank 0; all variants' y bitwise equal."""
    from megamoe_interleave.reference import reference_moe_fp32

    w1, w2, xs, idx, w = problem
    refs = reference_moe_fp32(xs, idx, w, w1, w2)
    outs = []
    for options in variants:
        moe = _make(P, k, schedule, mma, block_m=128, block_n=128, stages=2, num_sms=8, **common, **options)
        moe.load_weights(w1, w2)
        for _ in range(3):
            y = moe.forward(xs, idx, w)
            _check(y, refs)
        outs.append(y)
        assert moe.plan_rank(0)[1].num_rows > min_rows, f"need more than {min_rows} scheduler rows"
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)


def test_rerun_repeats_forward_bitwise():
    """MegaMoE.rerun() (the kernels and the reduction again on the staged inputs, the
    energy script's call) returns forward()'s y bit for bit, twice."""
    P, k = 2, 6
    w1, w2, xs, idx, w = _problem(P, [90, 41], k, "balanced", 0.1, seed=71)
    moe = _make(P, k, "expert_wave", "tma_ws_mcast_b", block_m=128, block_n=128, stages=2)
    moe.load_weights(w1, w2)
    ys = [y.clone() for y in moe.forward(xs, idx, w)]
    for _ in range(2):
        for a, b in zip(ys, moe.rerun()):
            assert torch.equal(a, b)


@pytest.mark.parametrize("mma", ["tma_ws", "tma_ws_mcast", "tma_ws_mcast_b"])
def test_split_tail_on_off_bitwise(mma):
    """split_tail (<= 64-row m-blocks as 64-row N-split tiles) changes no bit of y: the same
    K-order WGMMA accumulation per element, only the warpgroup tiling differs; nor does
    staging the L2 output in two handoffs (the 4-stage 128 x 256 layout; forced here at
    128 x 128) instead of one. Experts with 1..64 and 65..128 rows in their last m-block are
    both present."""
    from megamoe_interleave.reference import reference_moe_fp32

    P, k = 2, 6
    w1, w2, xs, idx, w = _problem(P, [250, 170], k, "skewed", 0.1, seed=31)
    refs = reference_moe_fp32(xs, idx, w, w1, w2)
    outs = []
    for split, handoffs in ((True, 1), (False, 1), (True, 2), (False, 2)):
        moe = _make(P, k, "interleaved", mma, block_m=128, block_n=128, split_tail=split, l2_handoffs=handoffs)
        moe.load_weights(w1, w2)
        outs.append(moe.forward(xs, idx, w))
        _check(outs[-1], refs)
        tails = set()
        for d in range(P):
            perm, _ = moe.plan_rank(d)
            tails |= {(c - 1) % 128 < 64 for c in perm.counts.tolist() if c > 0}
        assert tails == {True, False}, "need experts whose last m-block has <= 64 and > 64 rows"
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)


def test_cluster_pairings_bitwise_equal():
    """tma_ws (no cluster), tma_ws_mcast (pairs share A: same M block, adjacent N blocks) and
    tma_ws_mcast_b (pairs share B: adjacent M blocks of one expert, same N block; an odd last
    block leaves one CTA of the pair without rows) run the same WGMMAs in the same K order
    per output element, so y is bitwise equal; experts with an odd number of 128-row blocks
    are present."""
    from megamoe_interleave.reference import reference_moe_fp32

    P, k = 2, 6
    w1, w2, xs, idx, w = _problem(P, [250, 170], k, "skewed", 0.1, seed=41)
    refs = reference_moe_fp32(xs, idx, w, w1, w2)
    outs = []
    for mma in ("tma_ws", "tma_ws_mcast", "tma_ws_mcast_b"):
        moe = _make(P, k, "interleaved", mma, block_m=128, block_n=128)
        moe.load_weights(w1, w2)
        outs.append(moe.forward(xs, idx, w))
        _check(outs[-1], refs)
    odd = {(-(-c // 128)) % 2 == 1 for d in range(P) for c in moe.plan_rank(d)[0].counts.tolist() if c > 0}
    assert True in odd, "need an expert with an odd number of 128-row blocks"
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("mma", ["tma_ws", "tma_ws_mcast_b"])
@pytest.mark.parametrize("num_sms", [8, 132])
def test_overlapped_dispatch_bitwise_equal(mma, num_sms):
    """Overlapped Dispatch (dispatch_warps 1, 2: the prologue copies the rows the first tiles
    may read, the dispatch warps the rest while the tiles run, L1 producers wait on per-row
    counters) gives the same y bit for bit as Dispatch before a grid barrier (0), in both
    schedules. With 8 SMs the prologue covers one row, so the dispatch warps copy nearly all
    rows; repeated calls check the x_ready counters are reset."""
    from megamoe_interleave.reference import reference_moe_fp32

    P, k, hidden, inter = 2, 6, 256, 512
    w1, w2, xs, idx, w = _problem(P, [250, 170], k, "balanced", 0.1, seed=53, hidden=hidden, inter=inter)
    refs = reference_moe_fp32(xs, idx, w, w1, w2)
    outs = {}
    for dw in (0, 1, 2):
        for schedule in ("expert_wave", "interleaved"):
            moe = _make(P, k, schedule, mma, block_m=128, block_n=64, hidden=hidden, inter=inter, num_sms=num_sms,
                        dispatch_warps=dw)
            moe.load_weights(w1, w2)
            for _ in range(3):
                outs[dw, schedule] = moe.forward(xs, idx, w)
            _check(outs[dw, schedule], refs)
            rows = moe.plan_rank(0)[1].num_rows
    assert rows > 4, "need more scheduler rows than the prologue covers"
    base = outs[0, "expert_wave"]
    for key, ys in outs.items():
        for a, b in zip(base, ys):
            assert torch.equal(a, b), key
