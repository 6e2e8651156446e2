"""CPU checks (sm_90a compiles, PTX / SASS) of the fused MoE kernel and its configuration."""
import re
import subprocess

import pytest
from ptx_utils import try_wait_loops, window_states

from xstage.cute_compile import cuobjdump
from megamoe_interleave.config import BLOCK_M, MegaMoEConfig, smem_plan
from megamoe_interleave.scheduler import ExpertWaveSchedule, InterleavedSchedule
from megamoe_interleave.shapes import get_shape

DSV4 = get_shape("deepseek-v4-flash")


def resolved(schedule="interleaved", *, block_n=256, stages=3, dispatch_copy="lsu", dispatch_window=0, **kw):
    """A resolved config given field by field (interleaved: lead 3; expert_wave: row-order L2; the pair
    splitting M)."""
    kw.setdefault("lead" if schedule == "interleaved" else "l2_columns", 3 if schedule == "interleaved" else False)
    kw.setdefault("pair_split", "m")
    return MegaMoEConfig(schedule, block_n=block_n, stages=stages, dispatch_copy=dispatch_copy,
                         dispatch_window=dispatch_window, **kw)


SCHEDULES = ["expert_wave", "interleaved"]


def _compile(hidden, inter, config, options=""):
    from megamoe_interleave.kernel import compile_megamoe_sm90

    return compile_megamoe_sm90(hidden, inter, config, options=options)


def _ptx(tmp_path, hidden, inter, config):
    d = tmp_path / "ptx"
    d.mkdir()
    _compile(hidden, inter, config, f"--keep-ptx --dump-dir={d}")
    ptx = "\n".join(p.read_text() for p in sorted(d.iterdir()) if p.suffix == ".ptx")
    assert ptx, "no PTX produced"
    return ptx


@pytest.mark.compile
@pytest.mark.parametrize("schedule", SCHEDULES + ["expert_wave_l2_columns"])
def test_schedule_trace_compiles(schedule):
    from lab.megamoe.schedule_trace import compile_schedule_trace

    s = {"expert_wave": ExpertWaveSchedule(), "interleaved": InterleavedSchedule(lead=3, balance_l2=True),
         "expert_wave_l2_columns": ExpertWaveSchedule(l2_columns=True)}[schedule]
    assert compile_schedule_trace(s, 8, 16, 256, row_split_n=schedule == "interleaved") is not None


@pytest.mark.compile
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("block_n,stages,trace", [(64, 4, False), (128, 4, False), (256, 3, True)])
def test_fused_kernel_compiles(schedule, block_n, stages, trace):
    assert _compile(512, 256, resolved(schedule, block_n=block_n, stages=stages, trace=trace)) is not None


def test_config_resolves_the_tuned_defaults():
    """DeepSeek-V4-Flash on 132 SMs: 128 x 256 tiles; 4 stages and the LSU Dispatch at 192 rows per
    expert (P = 1), 3 stages and the bulk Dispatch at 1536 (P = 8); expert_wave paces the bulk
    Dispatch W = 66 // 16 + 1 = 5 rows ahead and orders its L2 tiles by column; interleaved
    takes lead ceil(eq. 16) = 9 and no window."""
    got = {(P, s): MegaMoEConfig(s).resolve(DSV4, P, 8192, 132) for P in (1, 8) for s in SCHEDULES}
    for s in SCHEDULES:
        assert (got[1, s].block_n, got[1, s].stages, got[1, s].dispatch_copy) == (256, 4, "lsu")
        assert (got[8, s].block_n, got[8, s].stages, got[8, s].dispatch_copy) == (256, 3, "bulk")
        assert got[1, s].dispatch_window == 0 and got[1, s].resolved and got[8, s].resolved
    assert got[8, "expert_wave"].dispatch_window == 5 and got[8, "interleaved"].dispatch_window == 0
    assert got[8, "expert_wave"].l2_columns and got[8, "expert_wave"].experts_per_wave == 32 // 4
    assert got[8, "interleaved"].lead == 9 and got[8, "interleaved"].l2_columns is None
    # fields given are kept; a narrow shape takes a narrower tile
    assert MegaMoEConfig("expert_wave", stages=4, dispatch_window=0).resolve(DSV4, 8, 8192, 132).stages == 4
    assert MegaMoEConfig().resolve(get_shape("deepseek-v4-pro"), 1, 8192, 132).block_n == 256
    narrow = MegaMoEConfig().resolve(type(DSV4)("t", 512, 128, 16, 2, ""), 1, 64, 132)
    assert narrow.block_n == 128 and narrow.stages == 4


def test_config_rejects_what_cannot_run():
    with pytest.raises(ValueError, match="schedule"):
        MegaMoEConfig("round_robin")
    with pytest.raises(ValueError, match="lead does not apply"):
        MegaMoEConfig("expert_wave", lead=3)
    with pytest.raises(ValueError, match="l2_columns does not apply"):
        MegaMoEConfig("interleaved", l2_columns=True)
    with pytest.raises(ValueError, match="lead must be"):
        MegaMoEConfig(lead=0)
    with pytest.raises(ValueError, match="block_n"):
        MegaMoEConfig(block_n=96)
    with pytest.raises(ValueError, match="stages"):
        MegaMoEConfig(stages=1)
    for name, value in (("stages", "4"), ("block_n", 256.0), ("lead", True), ("timeout_ns", None)):
        with pytest.raises(ValueError, match=f"{name} must be an int"):
            MegaMoEConfig(**{name: value})
    with pytest.raises(ValueError, match="dispatch_copy"):
        MegaMoEConfig(dispatch_copy="tma")
    with pytest.raises(ValueError, match="pair_split must be one of"):
        MegaMoEConfig(pair_split="k")
    with pytest.raises(ValueError, match="dispatch_window"):
        MegaMoEConfig(dispatch_copy="lsu", dispatch_window=6)
    with pytest.raises(ValueError, match="timeout_ns"):
        MegaMoEConfig(timeout_ns=0)
    shape = type(DSV4)("t", 192, 128, 16, 2, "")
    with pytest.raises(ValueError, match="N tile"):
        MegaMoEConfig().resolve(shape, 1, 64, 132)  # H = 192: no CTA-pair N tile
    with pytest.raises(ValueError, match="multiples of 64"):
        MegaMoEConfig().resolve(type(DSV4)("t", 512, 96, 16, 2, ""), 1, 64, 132)
    with pytest.raises(ValueError, match="does not fit"):
        MegaMoEConfig(stages=5).resolve(DSV4, 1, 8192, 132)  # 5-stage 128 x 256 ring
    with pytest.raises(ValueError, match="does not fit"):
        MegaMoEConfig(stages=4, dispatch_copy="bulk").resolve(DSV4, 1, 8192, 132)  # no room for bounce buffers
    with pytest.raises(ValueError, match="divisible"):
        MegaMoEConfig().resolve(DSV4, 3, 8192, 132)
    with pytest.raises(ValueError, match="resolved"):
        from megamoe_interleave.kernel_sm90 import MegaMoESm90

        MegaMoESm90(4096, 2048, MegaMoEConfig())


def _check_tma_after_proxy_fence(ptx):
    """Every TMA load comes after a fence.proxy.async.global that follows the latest acquire load
    (rows written by generic stores, published by a release). Returns the TMA loads seen."""
    last_acquire = last_fence = -1
    n_checked = 0
    for line_no, line in enumerate(ptx.splitlines()):
        if "ld.acquire.gpu" in line:
            last_acquire = line_no
        elif "fence.proxy.async.global" in line:
            last_fence = line_no
        elif "cp.async.bulk.tensor" in line:
            assert last_fence > last_acquire >= 0, f"TMA load at PTX line {line_no} without a proxy fence after the acquire"
            n_checked += 1
    return n_checked


@pytest.mark.compile
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("block_n,stages", [(128, 4), (256, 3)])
def test_kernel_ptx(tmp_path, schedule, block_n, stages):
    """TMA + mbarrier + WGMMA kernel: B (the expert's weights, shared by the CTA pair) multicast
    half by each CTA, A plain; WGMMA m64nBN from smem; no cp.async; consumers release stages on
    both CTAs' empty barriers (mapa + remote arrive); a cluster barrier after the mbarrier init and
    one before exit; every TMA load after a proxy fence that follows the latest acquire. The
    epilogue handoff (consumers sync EMPTY and arrive FULL, the two epilogue warps the reverse,
    plus their own barrier), the Dispatch barrier of the prologue (all threads) and of the
    dispatch warp; 16-byte Dispatch copies, h and Combine stores; stmatrix staging."""
    from megamoe_interleave.kernel_sm90 import DISPATCH_UNROLL, DISPATCH_WARP_UNROLL, NamedBarrier

    ptx = _ptx(tmp_path, 512, 256, resolved(schedule, block_n=block_n, stages=stages))
    mcast = re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global\.tile\.mbarrier::complete_tx::bytes"
                       r"\.multicast::cluster", ptx)
    plain = re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global\.tile", ptx)
    assert len(mcast) == 2 and len(plain) == 2  # B of L1 and L2 multicast; A of L1 and L2 plain
    handoff, epi = 2 * BLOCK_M + 64, 64
    full, empty = int(NamedBarrier.EpilogueFull), int(NamedBarrier.EpilogueEmpty)
    pats = [rf"wgmma\.mma_async\.sync\.aligned\.m64n{block_n}k16\.f32\.bf16\.bf16", r"mbarrier\.init\.shared",
            r"mbarrier\.arrive\.expect_tx\.shared", r"mbarrier\.try_wait\.parity(\.acquire\.cta)?\.shared",
            r"wgmma\.wait_group\.sync\.aligned\s+1;", r"red\.release\.gpu\.global\.add", r"ld\.acquire\.gpu",
            r"mapa\.shared::cluster", r"mbarrier\.arrive\.shared::cluster", r"%cluster_ctarank",
            rf"bar\.sync\s+{empty}, {handoff};", rf"bar\.arrive\s+{full}, {handoff};",
            rf"bar\.sync\s+{full}, {handoff};", rf"bar\.arrive\s+{empty}, {handoff};",
            rf"bar\.sync\s+{int(NamedBarrier.Epilogue)}, {epi};",
            rf"bar\.sync\s+{int(NamedBarrier.Dispatch)}, 32;", rf"bar\.sync\s+{int(NamedBarrier.Dispatch)}, 384;",
            r"stmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16"]
    for pat in pats:
        assert re.search(pat, ptx), f"PTX lacks {pat}"
    assert len(re.findall(r"barrier\.cluster\.wait", ptx)) >= 2
    assert not re.search(r"cp\.async\.cg\.shared\.global", ptx)
    # 16-byte loads of the unrolled Dispatch copies (a scalar fallback would multiply them), next
    # to the row-record loads; their stores + the epilogue warps' two (h, Combine)
    copies = DISPATCH_UNROLL + DISPATCH_WARP_UNROLL
    assert len(re.findall(r"ld\.global\.v4", ptx)) > copies
    assert not re.search(r"ld\.global(\.nc)?\.(b16|u16)", ptx)
    assert len(re.findall(r"st\.global\.v4", ptx)) >= 2 + copies
    assert _check_tma_after_proxy_fence(ptx) >= 4
    # the L1 epilogue's sigmoid is one tanh.approx per output (no ex2 + rcp)
    assert re.search(r"tanh\.approx\.f32", ptx) and not re.search(r"ex2\.approx", ptx)


def _check_row_metadata_handoff(ptx, empty, full):
    """The row-metadata handoff along every path of the code (ptx_utils.window_states follows the
    branches: the half-tile staging sits after the full tile's in program text): in the epilogue
    warps' code (between the two setmaxnreg) no shared store can run between an arrive on EMPTY
    (the metadata is published) and the next wait on FULL (the consumers are done with it); in
    the consumers' code (after setmaxnreg.inc) every scalar shared load (the routing weights)
    runs between a wait on EMPTY and the next arrive on FULL. Returns (epilogue stores, consumer
    loads) checked."""
    aux, consumers = _role_regions(ptx)
    stores = _count_in_window(aux, rf"bar\.arrive\s+{empty},", rf"bar\.sync\s+{full},", r"\bst\.shared\.(b32|b64|u64|f32)\b",
                              inside=False, what="shared store after publishing the metadata")
    loads = _count_in_window(consumers, rf"bar\.sync\s+{empty},", rf"bar\.arrive\s+{full},", r"\bld\.shared\.(b32|f32)\b",
                             inside=True, what="shared load outside the EMPTY..FULL window")
    return stores, loads


def _role_regions(ptx):
    """(the aux warpgroup's code between the two setmaxnreg, the consumers' code after setmaxnreg.inc)."""
    lines = ptx.splitlines()
    dec = next(i for i, ln in enumerate(lines) if "setmaxnreg.dec" in ln)
    inc = next(i for i, ln in enumerate(lines) if "setmaxnreg.inc" in ln)
    return lines[dec:inc], lines[inc:]


def _count_in_window(lines, opens, closes, pattern, *, inside, what):
    """The lines matching ``pattern``, each asserted inside (on every path) or outside (on every
    path) the window from ``opens`` to ``closes`` (ptx_utils.window_states); returns their count."""
    states = window_states(lines, opens, closes, must=inside)
    count = 0
    for ln, state in zip(lines, states):
        if re.search(pattern, ln):
            assert state == inside, f"{what}: {ln.strip()}"
            count += 1
    return count


@pytest.mark.compile
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_row_metadata_handoff_ptx(tmp_path, schedule):
    """compute-sanitizer's racecheck cannot follow this handoff (results/h200/sanitizers/); the
    program order it relies on is checked here instead, and the check can fail."""
    from megamoe_interleave.kernel_sm90 import NamedBarrier

    empty, full = int(NamedBarrier.EpilogueEmpty), int(NamedBarrier.EpilogueFull)
    ptx = _ptx(tmp_path, 1024, 512, MegaMoEConfig(schedule).resolve(type(DSV4)("t", 1024, 512, 16, 4, ""), 2,
                                                                     128, 132))
    stores, loads = _check_row_metadata_handoff(ptx, empty, full)
    assert stores >= 2 and loads >= 8  # routing weights and Combine addresses; the weights per 8 columns
    broken = ptx.replace(f"bar.sync \t{empty}, 320;", "nop;", 1)  # the consumers' first EMPTY wait gone
    with pytest.raises(AssertionError, match="outside the EMPTY"):
        _check_row_metadata_handoff(broken, empty, full)


def _check_stamps_after_barrier_waits(ptx, barrier_ids):
    """In program order, the first %globaltimer read after every ``bar.sync`` on ``barrier_ids`` is
    barrier_timestamp's: predicated on a volatile shared-memory load, which cannot pass the
    barrier (a plain timer read can). Returns the number of such waits checked."""
    waits = 0
    pending = None
    for ln in ptx.splitlines():
        m = re.search(r"bar\.sync\s+(\d+),", ln)
        if m and int(m.group(1)) in barrier_ids:
            pending, waits = ln.strip(), waits + 1
        elif pending and "%globaltimer" in ln:
            assert re.search(r"ld\.volatile\.shared\.b32 .*@xs_p mov\.u64 %rd\d+, %globaltimer", ln), \
                f"plain timer read after {pending}: {ln.strip()}"
            pending = None
    return waits


@pytest.mark.compile
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_trace_stamps_after_barrier_waits(tmp_path, schedule):
    """Trace builds: the staging-slot stamp (consumers, after EMPTY), the store-span start
    (epilogue, after FULL) and its end (after the epilogue barrier) wait for their barrier."""
    from megamoe_interleave.kernel_sm90 import NamedBarrier

    ids = {int(NamedBarrier.EpilogueEmpty), int(NamedBarrier.EpilogueFull), int(NamedBarrier.Epilogue)}
    ptx = _ptx(tmp_path, 512, 256, resolved(schedule, block_n=256, stages=4, trace=True))  # two L2 hand-offs
    assert _check_stamps_after_barrier_waits(ptx, ids) >= 6
    plain = re.sub(r"\{ \.reg \.b32 xs_v;[^}]*\}", "mov.u64 %rd1, %globaltimer;", ptx, count=1)
    with pytest.raises(AssertionError, match="plain timer read"):
        _check_stamps_after_barrier_waits(plain, ids)


# a drain's count bound (mbarrier_wait_in_step's 1 << 20 tries; the compiler may compare before the increment)
DRAIN_BOUND = re.compile(r"setp\.\w+\.[us]32\s+%p\d+, %r\d+, 104857[56];")


def _check_ring_waits_bounded(ptx, min_waits):
    """Every mbarrier wait loop is bounded: it reads %globaltimer inside the loop, or it is a ring
    wait's drain after a timeout (xstage.device.mbarrier_wait_in_step), bounded by a count of tries;
    each timed ring wait has its drain; none of cute.arch.mbarrier_wait's unbounded inline-asm LAB_WAIT
    loops is left; the ring's error code is OR-ed into the error word."""
    from megamoe_interleave.kernel_sm90 import ERR_RING_TIMEOUT

    assert "LAB_WAIT" not in ptx, "unbounded mbarrier wait loop (cute.arch.mbarrier_wait) in the PTX"
    loops = [body for body in try_wait_loops(ptx) if body is not None]
    timed = [body for body in loops if any("%globaltimer" in ln for ln in body)]
    counted = [body for body in loops if body not in timed and any(DRAIN_BOUND.search(ln) for ln in body)]
    neither = [body for body in loops if body not in timed and body not in counted]
    assert not neither, "mbarrier.try_wait loop bounded by neither %globaltimer nor a count:\n" + "\n".join(neither[0])
    assert len(timed) >= min_waits, f"{len(timed)} bounded ring waits, expected >= {min_waits}"
    assert len(counted) >= min_waits, f"{len(counted)} drains for {len(timed)} timed ring waits"
    assert re.search(rf"atom(\.relaxed\.gpu)?\.global\.or\.b32\s+%r\d+, \[%rd\d+\], {ERR_RING_TIMEOUT};", ptx)


@pytest.mark.compile
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_ring_waits_bounded(tmp_path, schedule):
    """No hangs: every full/empty ring wait is a try_wait loop bounded by %globaltimer that reports
    ERR_RING_TIMEOUT in the error word, then a drain bounded by a count of tries. Wait sites: producer acquire in the L1 and L2 load loops,
    the producer tail (one per stage), consumer first-stage + per-K-block waits of the L1 and L2
    mainloops."""
    stages = 4
    ptx = _ptx(tmp_path, 512, 256, resolved(schedule, block_n=128, stages=stages))
    _check_ring_waits_bounded(ptx, min_waits=2 + stages + 4)


def test_ring_timeout_maps_to_device_error():
    """The ring's error bit is xstage's ERR_MBARRIER_TIMEOUT, distinct from the row-counter spin and
    the grid barrier, and raise_on_device_error (MegaMoE's check after a launch) names it."""
    from megamoe_interleave import kernel_sm90 as k
    from xstage import device as xd

    assert k.ERR_RING_TIMEOUT == xd.ERR_MBARRIER_TIMEOUT
    assert k.ERR_RING_TIMEOUT & (k.ERR_DEPENDENCY_TIMEOUT | xd.ERR_BARRIER_TIMEOUT) == 0
    with pytest.raises(xd.DeviceError, match="MegaMoESm90 rank 0: device error 0x4: shared-memory mbarrier wait"):
        xd.raise_on_device_error(k.ERR_RING_TIMEOUT, "MegaMoESm90 rank 0")
    op = k.MegaMoESm90(512, 256, resolved(timeout_ns=1000))
    assert op.ring_timeout_ns > op.timeout_ns  # a ring wait may span one row-counter spin


def test_bounded_pipeline_refuses_unbounded_waits():
    """The ring's pipeline class keeps no unbounded wait: the base class's waits raise."""
    from xstage.pipeline import BoundedPipelineTmaAsync

    for name in ("producer_acquire", "consumer_wait", "producer_tail"):
        with pytest.raises(NotImplementedError, match="unbounded wait"):
            getattr(BoundedPipelineTmaAsync, name)(None, None)


def test_ring_wait_check_rejects_unbounded_loop():
    """The PTX check of test_ring_waits_bounded can fail: an unbounded try_wait loop (the shape
    cute.arch.mbarrier_wait emits, with and without its inline-asm labels) is caught."""
    unbounded = "\n".join([
        "$L__BB0_7:",
        "\tmbarrier.try_wait.parity.acquire.cta.shared::cta.b64 %p3, [%r1], %r2;",
        "\t@!%p3 bra $L__BB0_7;",
        "\tatom.global.or.b32 \t%r6, [%rd4], 4;",
    ])
    with pytest.raises(AssertionError, match="bounded by neither"):
        _check_ring_waits_bounded(unbounded, min_waits=1)
    with pytest.raises(AssertionError, match="LAB_WAIT"):
        _check_ring_waits_bounded("LAB_WAIT:\n mbarrier.try_wait.parity.shared.b64 P1, [%r1], %r2, 10000000;\n"
                                  "@P1 bra.uni DONE;\n bra.uni LAB_WAIT;\n", min_waits=0)


@pytest.mark.parametrize("block_n,stages", [(64, 4), (128, 4), (256, 3), (256, 4)])
def test_staging_swizzle_is_a_conflict_free_permutation(block_n, stages):
    """Staging tile (BM x BN/(2 l2_handoffs) words, no padding): stage_index is a permutation,
    keeps each 16-byte chunk contiguous (the epilogue's vector reads), and a warp's staging store
    (8 consecutive rows x the 4 words of one 8-column group) hits 32 distinct banks, also within
    the BN/4 words of L1's h columns."""
    from megamoe_interleave.kernel_sm90 import MegaMoESm90

    op = MegaMoESm90(1024, 512, resolved(block_n=block_n, stages=stages))
    W = op.stage_words
    assert W == block_n // (2 * op.l2_handoffs)
    idx = [[op.stage_index(m, c) for c in range(W)] for m in range(BLOCK_M)]
    assert sorted(i for row in idx for i in row) == list(range(BLOCK_M * W))
    for m in range(BLOCK_M):
        for c in range(0, W, 4):
            assert idx[m][c:c + 4] == list(range(idx[m][c], idx[m][c] + 4))
    for r0 in range(0, BLOCK_M, 8):
        for j in range(W // 4):
            banks = {idx[r0 + r][4 * j + q] % 32 for r in range(8) for q in range(4)}
            assert len(banks) == 32, (r0, j)
        assert max(idx[r0 + r][c] - (r0 + r) * W for r in range(8) for c in range(block_n // 4)) < W


@pytest.mark.parametrize("block_n,stages", [(64, 4), (128, 4), (256, 3), (256, 4)])
def test_staging_groups_shift_with_the_swizzle(block_n, stages):
    """The L2 staging addresses its 16-byte groups from ``swizzle_groups`` swizzled bases plus
    compile-time offsets (ConsumerMixin.stage_fragment): group g + k * swizzle_groups of a row lies
    k * swizzle_groups groups after group g, for every row and every group of the tile."""
    from megamoe_interleave.kernel_sm90 import MegaMoESm90

    op = MegaMoESm90(1024, 512, resolved(block_n=block_n, stages=stages))
    sg, groups = op.swizzle_groups, op.stage_words // 4
    assert groups % sg == 0
    for m in range(BLOCK_M):
        for g in range(sg):
            for k in range(groups // sg):
                assert op.stage_index(m, 4 * (g + k * sg)) == op.stage_index(m, 4 * g) + 4 * sg * k, (m, g, k)


def test_smem_plan():
    """One L2 handoff when the BN-wide staging tile fits next to the ring, else two; the bulk
    Dispatch's bounce buffers fit next to the 3-stage 128 x 256 ring, not the 4-stage one; rows
    longer than 8 KB go in equal pieces of multiples of 16 bytes."""
    from megamoe_interleave.config import SMEM_BYTES, bulk_piece_bytes

    assert smem_plan(4096, 256, 3, "lsu").l2_handoffs == 1 and smem_plan(4096, 256, 3, "lsu").stage_words == 128
    assert smem_plan(4096, 256, 4, "lsu").l2_handoffs == 2 and smem_plan(4096, 256, 4, "lsu").stage_words == 64
    assert smem_plan(4096, 128, 4, "lsu").l2_handoffs == 1
    assert smem_plan(4096, 256, 3, "bulk").total_bytes <= SMEM_BYTES
    with pytest.raises(ValueError, match="does not fit"):
        smem_plan(4096, 256, 4, "bulk")
    assert bulk_piece_bytes(7168) == 7168 and bulk_piece_bytes(4096) == 8192 and bulk_piece_bytes(256) == 512


@pytest.mark.compile
def test_default_tiles_fit_shared_memory():
    """The kernel's shared storage at the P = 1 defaults (4-stage 128 x 256 ring 192 KB + 32 KB
    staging + barriers and row metadata) fits the sm_90 227 KB and matches smem_plan."""
    from megamoe_interleave.config import SMEM_BYTES
    from megamoe_interleave.kernel import fake_launch_arguments
    from megamoe_interleave.kernel_sm90 import MegaMoESm90
    from xstage.cute_compile import compile_hopper

    config = MegaMoEConfig("expert_wave").resolve(DSV4, 1, 8192, 132)
    op = MegaMoESm90(4096, 2048, config)
    compile_hopper(op, *fake_launch_arguments(4096, 2048))
    size = op.shared_storage.size_in_bytes()
    assert 4 * 48 * 1024 + 32 * 1024 <= size <= SMEM_BYTES, size
    assert abs(size - smem_plan(4096, config.block_n, config.stages, config.dispatch_copy).total_bytes) < 2048


def _check_sass_pipelined(tmp_path, config):
    """The SASS ptxas made of the DSL's PTX keeps the consumers' WGMMAs pipelined: at the launch's
    168 registers per thread ptxas serialized them in some builds (C7511, a ``WARPGROUP.DEPBAR ...
    0x0`` after every HGMMA: ~25 % slower mainloops, measured on the H200); with setmaxnreg there
    is one wait per K block's batch of HGMMAs and both setmaxnreg survive. Local memory: at most
    one spilled pointer (<= 16 bytes of stack), none from the consumers' setmaxnreg up to their
    last HGMMA. Timed builds only (expert_wave's trace build keeps timestamps live across the
    mainloop and is serialized at 208 registers)."""
    tool = cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (CUDA toolkit or triton)")
    d = tmp_path / "cubin"
    d.mkdir()
    _compile(4096, 2048, config, f"--keep-cubin --dump-dir={d}")
    (cubin,) = [p for p in d.iterdir() if p.suffix == ".cubin"]
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    hgmma = len(re.findall(r"\bHGMMA\.", sass))
    waits = len(re.findall(r"WARPGROUP\.DEPBAR", sass))
    assert hgmma >= 16 and waits <= hgmma // 2, f"{waits} WGMMA waits for {hgmma} HGMMAs: serialized"
    assert len(re.findall(r"SETMAXREG", sass)) == 2, "ptxas dropped setmaxnreg"
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    lines = sass.splitlines()
    alloc = next(i for i, line in enumerate(lines) if "SETMAXREG.TRY_ALLOC" in line)
    last_mma = max(i for i, line in enumerate(lines) if re.search(r"\bHGMMA\.", line))
    local = [i for i, line in enumerate(lines) if re.search(r"\b(LDL|STL)\b", line)]
    assert stack <= 16 and len(local) <= 4, f"local memory: {stack} B stack, {len(local)} accesses (spills)"
    assert not [i for i in local if alloc < i < last_mma], "local memory access in the consumers' code"


@pytest.mark.compile
@pytest.mark.parametrize("P", [1, 8])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_default_builds_sass_pipelined(tmp_path, schedule, P):
    """The shipped builds at DeepSeek-V4-Flash: P = 1 (4 stages, LSU Dispatch; expert_wave with the
    L2 column order, whose divmod_small must not bring back an integer division) and P = 8 (3
    stages, bulk Dispatch; expert_wave windowed at W = 5)."""
    _check_sass_pipelined(tmp_path, MegaMoEConfig(schedule).resolve(DSV4, P, 8192, 132))


@pytest.mark.compile
@pytest.mark.parametrize("schedule,variant", [
    (s, v) for s in SCHEDULES for v in (dict(block_n=128, stages=4), dict(stages=3, dispatch_copy="lsu"))]
    + [(s, dict(stages=3, dispatch_copy="bulk", dispatch_window=0)) for s in SCHEDULES]
    + [("expert_wave", dict(stages=3, dispatch_copy="bulk", dispatch_window=6))])
def test_other_builds_sass_pipelined(tmp_path, schedule, variant):
    _check_sass_pipelined(tmp_path, MegaMoEConfig(schedule, **variant).resolve(DSV4, 8, 8192, 132))


@pytest.mark.compile
@pytest.mark.parametrize("schedule,window", [("expert_wave", 0), ("expert_wave", 5), ("interleaved", 0)])
def test_bulk_dispatch_ptx(tmp_path, schedule, window):
    """The bulk Dispatch (the P = 8 tiles: 128 x 256, 3 stages): the dispatch warp moves rows with
    non-tensor bulk copies -- a load completing on an mbarrier, a store in a bulk group, the buffer
    reused after wait_group.read, rows published after wait_group 0 -- with an L2 evict-first
    policy on both; its 16-byte vector copy is gone (only the prologue's remains); only a window
    polls the L1 tiles' row counters (with a nanosleep between polls)."""
    from megamoe_interleave.kernel_sm90 import DISPATCH_UNROLL

    config = MegaMoEConfig(schedule, dispatch_copy="bulk", dispatch_window=window).resolve(DSV4, 8, 8192, 132)
    ptx = _ptx(tmp_path, 4096, 2048, config)
    policy = r"\{ \.reg \.b64 xs_pol; createpolicy\.fractional\.L2::(evict_\w+)\.b64 xs_pol, 1\.0; "
    hint = r"\.L2::cache_hint \[[^\]]+\], \[[^\]]+\], \d+(, \[[^\]]+\])?, xs_pol;"
    load = r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier::complete_tx::bytes"
    store = r"cp\.async\.bulk\.global\.shared::cta\.bulk_group"
    assert re.search(load, ptx) and re.search(store, ptx)
    assert {m.group(1) for m in re.finditer(policy + load + hint, ptx)} == {"evict_first"}
    assert {m.group(1) for m in re.finditer(policy + store + hint, ptx)} == {"evict_first"}
    assert bool(re.search(r"nanosleep\.u32", ptx)) == (window > 0)
    assert re.search(r"cp\.async\.bulk\.wait_group\.read\s+1;", ptx)
    assert re.search(r"cp\.async\.bulk\.wait_group\s+0;", ptx)
    assert len(re.findall(r"ld\.global\.v4", ptx)) < 2 * DISPATCH_UNROLL  # the prologue's copy + row records
    # a row is published only after its stores completed: wait_group 0 -> proxy fence -> release
    # fence -> release increment, in this order with nothing but arithmetic between
    pub = re.search(r"cp\.async\.bulk\.wait_group\s+0;(.*?)red\.release\.gpu\.global\.add", ptx, re.S)
    assert pub, "no publication after a bulk wait_group 0"
    between = pub.group(1)
    assert between.index("fence.proxy.async.global") < between.index("fence.acq_rel.gpu")
    assert not re.search(r"\b(st|ld|cp)\.(global|async)", between)
    # lane 0 copies alone; the warp reconverges before the CTA-wide (warp-aligned) barriers
    assert re.search(r"bar\.warp\.sync", ptx)


def test_setmaxnreg_fits_the_launch_register_pool():
    """setmaxnreg only moves registers within the launch's pool (384 threads x 168 = 64512): a
    split asking for more (e.g. 80 / 216 = 65536) makes the consumers' increase fail at run time.
    The counts must also be multiples of 8 in [24, 256]."""
    from megamoe_interleave.kernel_sm90 import AUX_WARPGROUP_REGS, MMA_WARPGROUP_REGS

    launch_regs = 65536 // 384 // 8 * 8  # 168
    assert 128 * AUX_WARPGROUP_REGS + 256 * MMA_WARPGROUP_REGS <= 384 * launch_regs
    for n in (AUX_WARPGROUP_REGS, MMA_WARPGROUP_REGS):
        assert n % 8 == 0 and 24 <= n <= 256
    assert AUX_WARPGROUP_REGS < launch_regs < MMA_WARPGROUP_REGS


@pytest.mark.compile
@pytest.mark.parametrize("copy", ["lsu", "bulk"])
def test_no_dispatch_copy_kernel_has_no_dispatch_copy(copy):
    """lab.megamoe.diag.no_dispatch_copy.NoDispatchCopy (scripts/diag/megamoe_dispatch_cost.py, the ncu
    driver's --no-dispatch-copy): the shipped kernel of the config copies the rows (LSU: the
    16-byte vector loads / stores of copy_chunks; bulk: cp.async.bulk pieces into and out of smem),
    the subclass of the same config does not, and its TMA tile loads are the shipped ones."""
    from lab.megamoe.diag.no_dispatch_copy import NoDispatchCopy
    from megamoe_interleave.kernel import fake_launch_arguments
    from megamoe_interleave.kernel_sm90 import MegaMoESm90
    from xstage.cute_compile import compile_hopper

    config = resolved("expert_wave", dispatch_copy=copy, dispatch_window=5 if copy == "bulk" else 0)

    def counts(cls):
        ptx = compile_hopper(cls(512, 256, config), *fake_launch_arguments(512, 256), keep_ptx=True).ptx
        assert ptx
        ops = re.findall(r"(cp\.async\.bulk[\w.:]*|ld\.global(?:\.nc)?\.v4|st\.global\.v4)", ptx)
        return {k: ops.count(k) for k in set(ops)}

    shipped, nocopy = counts(MegaMoESm90), counts(NoDispatchCopy)
    tma = [k for k in shipped if k.startswith("cp.async.bulk.tensor")]
    assert tma and all(nocopy.get(k) == shipped[k] for k in tma)
    bulk_rows = [k for k in shipped if k.startswith("cp.async.bulk.") and not k.startswith("cp.async.bulk.tensor")]
    assert bool(bulk_rows) == (copy == "bulk") and not any(nocopy.get(k) for k in bulk_rows)
    for k in ("ld.global.v4", "st.global.v4"):
        assert nocopy.get(k, 0) < shipped[k], k


def fp8_mainloop_sass(tool, cubin):
    """The FP8 builds' SASS checks: FP8 WGMMAs only (QGMMA), at most one wait per four of them (not
    serialized), both setmaxnreg kept, no local memory between the first and the last QGMMA. Returns
    (SASS, its lines, the indices of its local-memory lines)."""
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    lines = sass.splitlines()
    qgmma = [i for i, line in enumerate(lines) if re.search(r"\bQGMMA\.64x(64|128)x32\.F32\.E4M3\.E4M3", line)]
    waits = len(re.findall(r"WARPGROUP\.DEPBAR", sass))
    assert len(qgmma) >= 16 and not re.search(r"\bHGMMA\.", sass)
    assert waits <= len(qgmma) // 4, f"{waits} WGMMA waits for {len(qgmma)} QGMMAs: serialized"
    assert len(re.findall(r"SETMAXREG", sass)) == 2, "ptxas dropped setmaxnreg"
    local = [i for i, line in enumerate(lines) if re.search(r"\b(LDL|STL)\b", line)]
    assert not [i for i in local if qgmma[0] < i < qgmma[-1]], "local memory access in the mainloops"
    return sass, lines, local


@pytest.mark.compile
@pytest.mark.parametrize("P", [1, 8])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_w8a8_builds_fp8_wgmma_pipelined(tmp_path, schedule, P):
    """The W8A8 builds at DeepSeek-V4-Flash (128 x 256 tiles, 128-deep K stages; P = 8 with the bulk
    Dispatch, rows and scales as bulk pieces):
    the mainloops issue FP8 WGMMAs (wgmma ... e4m3.e4m3 in the PTX, QGMMA ...E4M3.E4M3 in the
    SASS, no BF16 HGMMA left), one wait per 128-column batch of 4 k32 WGMMAs (the promotion needs the
    batch's sums, nothing more), no local memory between the consumers' first and last QGMMA (the
    promotion's 192 accumulator registers fit at the 224 / 56 split), both
    setmaxnreg kept, h quantized with cvt.rn.satfinite.e4m3x2 and the scales read through L2."""
    tool = cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (CUDA toolkit or triton)")
    config = MegaMoEConfig(schedule, precision="w8a8").resolve(DSV4, P, 8192, 132)
    assert (config.block_n, config.dispatch_copy) == (256, "lsu" if P == 1 else "bulk")
    d = tmp_path / "build"
    d.mkdir()
    _compile(4096, 2048, config, f"--keep-ptx --keep-cubin --dump-dir={d}")
    ptx = "\n".join(p.read_text() for p in d.iterdir() if p.suffix == ".ptx")
    (cubin,) = [p for p in d.iterdir() if p.suffix == ".cubin"]
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3", ptx)  # every tile
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "ld.global.cg.f32" in ptx
    sass, lines, local = fp8_mainloop_sass(tool, cubin)
    # the weights' scales per lane, read by shuffle; at the 224 / 56 register split the consumers touch
    # no local memory (at 216 / 72 the tile loop's state was reloaded at every tile: 32-56 B of stack,
    # 5.8-7.6 % of the CTAs' time between tiles); the aux warps keep at most one spilled word pair
    assert re.search(r"\bSHFL\.IDX\b", sass), "the weight scales are not read by warp shuffle"
    alloc = next(i for i, line in enumerate(lines) if "SETMAXREG.TRY_ALLOC" in line)
    assert not [i for i in local if i > alloc], "local memory in the consumer warpgroups"
    usage = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) <= 8, "the W8A8 build spills again"


@pytest.mark.compile
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("trace", [False, True])
def test_w8a8_kernel_compiles(schedule, trace):
    """The smallest W8A8 tiles (H 512, I 256: two L1 and two L2 pair tiles per row), with and
    without the per-tile trace."""
    config = MegaMoEConfig(schedule, precision="w8a8", trace=trace).resolve(get_shape("deepseek-v4-flash"), 1, 256,
                                                                            132)
    assert _compile(512, 256, config) is not None


@pytest.mark.compile
def test_w8a8_kernel_compiles_past_32_k_blocks():
    """H = 8192: 64 K blocks per L1 tile, so each weight scale block spans two registers per lane
    (MegaMoESm90W8A8.weight_scales; DeepSeek-V4-Flash has 32 and 16). Compiles only: no GPU test
    runs a hidden size past 4096."""
    config = MegaMoEConfig("interleaved", precision="w8a8").resolve(get_shape("deepseek-v4-flash"), 1, 256, 132)
    assert _compile(8192, 2048, config) is not None


def _check_staging_handoff_w8a8(ptx, empty, full):
    """W8A8's staged L1 tile (E4M3 pairs, st.shared.b16) and its rows' h scales pass from the
    consumers to the epilogue warps through the same EMPTY / FULL handoff as the bf16 stmatrix
    tile: every consumer shared store runs between a wait on EMPTY and the next arrive on FULL,
    and every epilogue-side shared load between a wait on FULL and the next arrive on EMPTY
    (racecheck reports these pairs, results/h200/sanitizers/README.md). Returns (stores, loads)."""
    aux, consumers = _role_regions(ptx)
    stores = _count_in_window(consumers, rf"bar\.sync\s+{empty},", rf"bar\.arrive\s+{full},",
                              r"\bst\.shared\.(b16|b32|f32)\b", inside=True,
                              what="consumer shared store outside the EMPTY..FULL window")
    loads = _count_in_window(aux, rf"bar\.sync\s+{full},", rf"bar\.arrive\s+{empty},",
                             r"\bld\.shared\.(v4\.)?(b32|f32|u32)\b", inside=True,
                             what="epilogue shared load outside the FULL..EMPTY window")
    return stores, loads


@pytest.mark.compile
@pytest.mark.parametrize("precision", ["w8a8", "w4a8"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_w8a8_staging_handoff_ptx(tmp_path, schedule, precision):
    """The W8A8 handoff's program order (what racecheck cannot follow, see _check_staging_handoff_w8a8),
    and the check fails when the consumers' EMPTY wait is gone. W4A8 stages as W8A8 (its racecheck
    listing has the same pattern; its widening's 16-byte stores are not the handoff's)."""
    from megamoe_interleave.kernel_sm90 import NamedBarrier

    empty, full = int(NamedBarrier.EpilogueEmpty), int(NamedBarrier.EpilogueFull)
    config = MegaMoEConfig(schedule, precision=precision).resolve(type(DSV4)("t", 1024, 512, 16, 4, ""), 2, 128, 132)
    ptx = _ptx(tmp_path, 1024, 512, config)
    stores, loads = _check_staging_handoff_w8a8(ptx, empty, full)
    assert stores >= 32 and loads >= 2, (stores, loads)  # E4M3 pairs of both fragments, scales; sC, row_scale
    broken = ptx.replace(f"bar.sync \t{empty}, 320;", "nop;", 1)
    with pytest.raises(AssertionError, match="outside the EMPTY"):
        _check_staging_handoff_w8a8(broken, empty, full)


@pytest.mark.compile
def test_act_quant_kernel_ptx():
    """The W8A8 staging kernel (act_quant) rounds as the torch recipe does on a GPU: a multiply by
    fl32(1/448), the correctly rounded reciprocal, RN-saturating E4M3 conversion, no approximate
    division; 16-byte loads, 8-byte E4M3 stores, no local memory."""
    from megamoe_interleave.act_quant import compile_act_quant

    ptx = compile_act_quant(4096, keep_ptx=True).ptx
    body = ptx[ptx.index(".entry"):]
    assert body.count("rcp.rn.f32") == 1 and body.count("cvt.rn.satfinite.e4m3x2.f32") == 4
    assert not re.search(r"\b(div|rcp\.approx|ex2)\.", body) and ".local" not in body
    assert "0f3B124925" in body  # fl32(1 / 448)
    assert "ld.global.v4.b32" in body and "st.global.v2.b32" in body
    with pytest.raises(ValueError, match="multiple of 128"):
        compile_act_quant(200)


@pytest.mark.compile
@pytest.mark.parametrize("precision", ["bf16", "w8a8", "w4a8"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pair_split_n_builds(tmp_path, schedule, precision):
    """MegaMoEConfig(pair_split="n") at DeepSeek-V4-Flash, P = 1: the M split's rows (2 x 128 pool
    rows, a pair tile per N block) and TMA loads, and for the rows split along N the same loads with
    the multicast on the other operand (four multicast loads: L1 and L2, each split), the FP8 builds'
    mainloop SASS as the M split's."""
    config = MegaMoEConfig(schedule, precision=precision, pair_split="n").resolve(DSV4, 1, 512, 132)
    from megamoe_interleave.kernel import make_kernel

    kernel = make_kernel(DSV4.hidden, DSV4.intermediate, config)
    assert (kernel.pool_rows_per_row, kernel.pairs_l1, kernel.pairs_l2, kernel.row_split_n) == (
        256, 2048 // 128, 4096 // 256, True)
    d = tmp_path / "build"
    d.mkdir()
    _compile(DSV4.hidden, DSV4.intermediate, config, f"--keep-ptx --keep-cubin --dump-dir={d}")
    ptx = "\n".join(p.read_text() for p in d.iterdir() if p.suffix == ".ptx")
    tma = re.findall(r"cp\.async\.bulk\.tensor\.2d\S+", ptx)
    assert len(tma) == (12 if precision == "w4a8" else 8) and sum("multicast::cluster" in t for t in tma) == 4
    tool = cuobjdump()
    if precision != "bf16" and tool is not None:
        (cubin,) = [p for p in d.iterdir() if p.suffix == ".cubin"]
        fp8_mainloop_sass(tool, cubin)
