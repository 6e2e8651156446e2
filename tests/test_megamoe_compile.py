"""CPU compile checks (sm_90a) of the MoE kernels for both schedulers."""
import os
import re

import pytest
from ptx_utils import try_wait_loops

from megamoe_interleave.scheduler import Schedule

SCHEDULES = [Schedule("expert_wave"), Schedule("interleaved", lead=3, balance_l2=True)]


@pytest.mark.compile
@pytest.mark.parametrize("schedule", SCHEDULES + [Schedule("expert_wave", l2_columns=True)],
                         ids=lambda s: s.name + ("_l2_columns" if s.l2_columns else ""))
def test_schedule_trace_compiles(schedule):
    from megamoe_interleave.schedule_trace import compile_schedule_trace

    assert compile_schedule_trace(schedule, 8, 16) is not None


@pytest.mark.compile
@pytest.mark.parametrize("mma", ["wgmma", "wgmma_cpasync", "fma", "tma_ws", "tma_ws_mcast", "tma_ws_mcast_b"])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
def test_fused_kernel_compiles(schedule, mma):
    from megamoe_interleave.kernel_sm90 import compile_megamoe_sm90

    assert compile_megamoe_sm90(256, 128, schedule, block_n=64, mma=mma) is not None


def test_kernel_and_api_share_the_kernel_config():
    """One definition of the kinds, the trace row and the split-tail rule (kernel_config)."""
    from megamoe_interleave import api, kernel_config, kernel_sm90
    from megamoe_interleave.scheduler import Schedule

    assert kernel_sm90.WS_KINDS is kernel_config.WS_KINDS is api.WS_KINDS
    assert kernel_sm90.TRACE_FIELDS is kernel_config.TRACE_FIELDS is api.TRACE_FIELDS
    for mma, block_m, asked in (("tma_ws_mcast_b", 128, None), ("tma_ws", 64, None), ("wgmma", 128, None),
                                ("tma_ws", 128, False)):
        op = kernel_sm90.MegaMoESm90(512, 256, Schedule("expert_wave"), block_m=block_m, block_n=128, mma=mma,
                                     split_tail=asked)
        assert op.split_tail == kernel_config.resolve_split_tail(mma, block_m, asked)
    with pytest.raises(ValueError, match="split_tail"):
        kernel_config.resolve_split_tail("wgmma", 128, True)


@pytest.mark.compile
def test_fused_kernel_with_trace_compiles():
    from megamoe_interleave.kernel_sm90 import compile_megamoe_sm90

    assert compile_megamoe_sm90(256, 128, SCHEDULES[1], block_n=64, mma="wgmma_cpasync", trace=True) is not None


@pytest.mark.compile
@pytest.mark.parametrize("mma,block_m,block_n,stages", [("wgmma_cpasync", 128, 256, 3), ("wgmma", 128, 128, 2)])
def test_fused_kernel_two_warpgroups_compiles(mma, block_m, block_n, stages):
    """128-row tiles: two consumer warpgroups; 128x256x3 stages aliases the fp32 staging tile."""
    from megamoe_interleave.kernel_sm90 import MegaMoESm90, compile_megamoe_sm90

    op = MegaMoESm90(512, 256, SCHEDULES[1], block_m=block_m, block_n=block_n, mma=mma, stages=stages)
    assert op.num_threads == 256 and op.alias_c == (block_n == 256)
    assert compile_megamoe_sm90(512, 256, SCHEDULES[1], block_m=block_m, block_n=block_n, mma=mma,
                                stages=stages) is not None


def test_kernel_rejects_bad_tiling():
    from megamoe_interleave.kernel_sm90 import MegaMoESm90

    with pytest.raises(ValueError):
        MegaMoESm90(192, 128, SCHEDULES[0], block_n=64)  # H not a multiple of 2*block_n
    with pytest.raises(ValueError):
        MegaMoESm90(256, 128, SCHEDULES[0], block_n=24)
    with pytest.raises(ValueError):
        MegaMoESm90(256, 128, SCHEDULES[0], block_n=64, block_m=96, mma="wgmma")
    with pytest.raises(ValueError):
        MegaMoESm90(256, 128, SCHEDULES[0], block_n=64, block_m=64, num_threads=256, mma="wgmma")
    with pytest.raises(ValueError):  # shared memory does not fit
        MegaMoESm90(1024, 512, SCHEDULES[0], block_n=256, block_m=128, mma="wgmma_cpasync", stages=8)
    with pytest.raises(ValueError):
        MegaMoESm90(256, 128, SCHEDULES[0], mma="tf32")
    with pytest.raises(ValueError):
        MegaMoESm90(256, 128, SCHEDULES[0], block_n=64, silu="gelu")
    with pytest.raises(ValueError):  # tma_ws: a 5-stage 128x256 ring + the staging tile do not fit
        MegaMoESm90(512, 256, SCHEDULES[0], block_m=128, block_n=256, mma="tma_ws", stages=5)
    with pytest.raises(ValueError):  # dispatch warps: 1 or 2 of the 3 auxiliary warps, tma_ws* only
        MegaMoESm90(512, 256, SCHEDULES[0], block_m=128, block_n=256, mma="tma_ws", dispatch_warps=3)
    with pytest.raises(ValueError):
        MegaMoESm90(256, 128, SCHEDULES[0], block_n=64, mma="wgmma", dispatch_warps=1)
    with pytest.raises(ValueError):  # tma_ws needs the producer warpgroup on top of the consumers
        MegaMoESm90(256, 128, SCHEDULES[0], block_n=64, block_m=64, num_threads=128, mma="tma_ws")


def _ptx(compiled, dump_dir):
    ptx = getattr(getattr(compiled, "artifacts", None), "PTX", None)
    if ptx and not ptx.lstrip().startswith("//") and os.path.exists(ptx):
        ptx = open(ptx).read()
    if not ptx:
        ptx = "\n".join(open(os.path.join(dump_dir, f)).read() for f in sorted(os.listdir(dump_dir))
                        if f.endswith(".ptx"))
    assert ptx, "no PTX produced"
    return ptx


def _compile_ptx(tmp_path, hidden, inter, schedule, **kw):
    from megamoe_interleave.kernel_sm90 import compile_megamoe_sm90

    d = tmp_path / "ptx"
    d.mkdir()
    c = compile_megamoe_sm90(hidden, inter, schedule, options=f"--keep-ptx --dump-dir={d}", **kw)
    return _ptx(c, str(d))


def _check_tma_after_proxy_fence(ptx):
    """Every TMA load comes after a fence.proxy.async.global that follows the latest acquire
    load (rows written by generic stores, published by a release). Returns the TMA loads seen."""
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
@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
@pytest.mark.parametrize("block_m,block_n,stages,dispatch_warps",
                         [(128, 128, 4, 1), (64, 256, 4, 1), (128, 256, 3, 1), (128, 256, 3, 0), (128, 256, 3, 2)])
def test_tma_ws_ptx(tmp_path, schedule, block_m, block_n, stages, dispatch_warps):
    """mma='tma_ws' is a TMA + mbarrier + WGMMA kernel: 2-D bulk tensor loads of A and B for
    both GEMMs completing on mbarriers, WGMMA of the tile's width from smem, no cp.async
    (non-bulk); every TMA load comes after a fence.proxy.async.global that follows the latest
    acquire load (dispatched rows / h written by generic stores). The epilogue handoff: the
    consumers sync on EMPTY and arrive on FULL, the epilogue warps (96 threads less the
    dispatch warps) the reverse, plus their own barrier; the dispatch warps (overlapped
    Dispatch) have a barrier of their own; the 16-byte global stores are the epilogue warps'
    (h, Combine) and Dispatch's (one unrolled copy before a grid barrier, or the prologue's
    and the dispatch warps')."""
    from megamoe_interleave.kernel_sm90 import DISPATCH_UNROLL, DISPATCH_WARP_UNROLL, MegaMoESm90

    H, I = 512, 256
    kw = dict(block_m=block_m, block_n=block_n, mma="tma_ws", stages=stages, dispatch_warps=dispatch_warps)
    op = MegaMoESm90(H, I, schedule, **kw)
    assert op.num_threads == 2 * block_m + 128 and op.num_mma_threads == 2 * block_m and not op.alias_c
    epi = 96 - 32 * dispatch_warps
    assert op.num_epi_threads == epi
    ptx = _compile_ptx(tmp_path, H, I, schedule, **kw)
    tma = re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global\.tile\.mbarrier::complete_tx::bytes", ptx)
    assert len(tma) >= 4  # A and B of L1 and of L2
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{block_n}k16\.f32\.bf16\.bf16", ptx)
    handoff = 2 * block_m + epi
    pats = [r"mbarrier\.init\.shared", r"mbarrier\.arrive\.expect_tx\.shared",
            r"mbarrier\.try_wait\.parity(\.acquire\.cta)?\.shared", r"mbarrier\.arrive\.shared",
            r"wgmma\.wait_group\.sync\.aligned\s+1;", r"fence\.proxy\.async\.global",
            r"red\.release\.gpu\.global\.add", r"ld\.acquire\.gpu",
            rf"bar\.sync\s+3, {handoff};", rf"bar\.arrive\s+2, {handoff};",
            rf"bar\.sync\s+2, {handoff};", rf"bar\.arrive\s+3, {handoff};", rf"bar\.sync\s+4, {epi};"]
    if dispatch_warps:
        # the prologue (all threads) and the dispatch warps publish rows on barrier 5
        pats += [rf"bar\.sync\s+5, {32 * dispatch_warps};", rf"bar\.sync\s+5, {op.num_threads};"]
    for pat in pats:
        assert re.search(pat, ptx), f"PTX lacks {pat}"
    assert not re.search(r"cp\.async\.cg\.shared\.global", ptx)
    # 16-byte loads of the unrolled Dispatch copies (a scalar fallback would multiply the
    # copy's instructions); their 16-byte stores (ptxas may duplicate some of them when it
    # splits the loop: at least one each) + the epilogue warps' two stores (h, Combine)
    copies = DISPATCH_UNROLL + (DISPATCH_WARP_UNROLL if dispatch_warps else 0)
    # ... next to the 16-byte row-record loads of the schedule steps (one per step call site)
    assert len(re.findall(r"ld\.global\.v4", ptx)) > copies
    assert not re.search(r"ld\.global(\.nc)?\.(b16|u16)", ptx)
    assert len(re.findall(r"st\.global\.v4", ptx)) >= 2 + copies
    # the consumers stage their output with stmatrix.x4 (four 8x8 bf16 tiles per instruction)
    assert re.search(r"stmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16", ptx)
    assert _check_tma_after_proxy_fence(ptx) >= 4


@pytest.mark.compile
@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
@pytest.mark.parametrize("block_n,stages", [(128, 4), (256, 3)])  # (256, 3): the API default tiles
def test_tma_ws_mcast_ptx(tmp_path, schedule, block_n, stages):
    """mma='tma_ws_mcast': the CTA pair is a 2-CTA cluster; A (shared by the pair) is loaded
    half by each CTA with a multicast TMA, B with a plain one; consumers release stages on
    both CTAs' empty barriers (mapa + remote arrive); cluster barrier after mbarrier init;
    split_tail's 64-row N-split WGMMA next to the full-width one."""
    ptx = _compile_ptx(tmp_path, 512, 256, schedule, block_m=128, block_n=block_n, mma="tma_ws_mcast", stages=stages)
    mcast = re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global\.tile\.mbarrier::complete_tx::bytes"
                       r"\.multicast::cluster", ptx)
    plain = re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global\.tile", ptx)
    assert len(mcast) == 2 and len(plain) == 2  # A of L1 and L2 multicast; B of L1 and L2 plain
    for pat in (r"mapa\.shared::cluster", r"mbarrier\.arrive\.shared::cluster", r"barrier\.cluster\.arrive",
                r"barrier\.cluster\.wait", r"%cluster_ctarank", rf"wgmma\.mma_async\.sync\.aligned\.m64n{block_n}k16",
                rf"wgmma\.mma_async\.sync\.aligned\.m64n{block_n // 2}k16"):
        assert re.search(pat, ptx), f"PTX lacks {pat}"
    # one cluster barrier after the mbarrier init, one before exit (after the producers'
    # full-barrier drain: no CTA leaves while its peer may still multicast into it)
    assert len(re.findall(r"barrier\.cluster\.wait", ptx)) >= 2
    _check_tma_after_proxy_fence(ptx)


@pytest.mark.compile
@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
def test_tma_ws_mcast_b_ptx(tmp_path, schedule):
    """mma='tma_ws_mcast_b': the pair splits M and shares B: B (the expert's weights) is loaded
    half by each CTA with a multicast TMA, A (each CTA's own rows) with a plain one; the same
    cluster release, exit drain and barrier as tma_ws_mcast."""
    ptx = _compile_ptx(tmp_path, 512, 256, schedule, block_m=128, block_n=256, mma="tma_ws_mcast_b", stages=4)
    mcast = re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global\.tile\.mbarrier::complete_tx::bytes"
                       r"\.multicast::cluster", ptx)
    plain = re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global\.tile", ptx)
    assert len(mcast) == 2 and len(plain) == 2  # B of L1 and L2 multicast; A of L1 and L2 plain
    for pat in (r"mapa\.shared::cluster", r"mbarrier\.arrive\.shared::cluster", r"%cluster_ctarank"):
        assert re.search(pat, ptx), f"PTX lacks {pat}"
    assert len(re.findall(r"barrier\.cluster\.wait", ptx)) >= 2
    _check_tma_after_proxy_fence(ptx)


@pytest.mark.compile
@pytest.mark.parametrize("silu", ["tanh", "exp2"])
def test_silu_variants_ptx(tmp_path, silu):
    """The L1 epilogue's sigmoid: silu="tanh" one tanh.approx per output, "exp2" (quack
    swiglu) ex2.approx + rcp.approx; compiled with the unbalanced interleaved schedule (the
    balanced one is SCHEDULES[1])."""
    ptx = _compile_ptx(tmp_path, 512, 256, Schedule("interleaved", lead=3), block_m=128, block_n=256,
                       mma="tma_ws_mcast_b", stages=3, silu=silu)
    n_tanh = len(re.findall(r"tanh\.approx\.f32", ptx))
    n_ex2 = len(re.findall(r"ex2\.approx", ptx))
    if silu == "tanh":
        assert n_tanh > 0 and n_ex2 == 0
    else:
        assert n_tanh == 0 and n_ex2 > 0 and re.search(r"rcp\.approx", ptx)


@pytest.mark.compile
def test_wgmma_path_has_no_tma(tmp_path):
    """Contrast for test_tma_ws_ptx: the register-staged path issues no bulk tensor copies."""
    ptx = _compile_ptx(tmp_path, 256, 128, SCHEDULES[0], block_n=64, mma="wgmma")
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" not in ptx


@pytest.mark.compile
def test_tma_ws_with_trace_compiles():
    from megamoe_interleave.kernel_sm90 import compile_megamoe_sm90

    assert compile_megamoe_sm90(256, 128, SCHEDULES[0], block_n=64, mma="tma_ws", trace=True) is not None


def _check_ring_waits_bounded(ptx, min_waits):
    """Every mbarrier wait loop reads %globaltimer inside the loop (bounded); none of
    cute.arch.mbarrier_wait's unbounded inline-asm LAB_WAIT loops is left; the ring's error
    code is OR-ed into the error word."""
    from megamoe_interleave.kernel_sm90 import ERR_RING_TIMEOUT

    assert "LAB_WAIT" not in ptx, "unbounded mbarrier wait loop (cute.arch.mbarrier_wait) in the PTX"
    loops = [body for body in try_wait_loops(ptx) if body is not None]
    assert len(loops) >= min_waits, f"{len(loops)} bounded ring waits, expected >= {min_waits}"
    for body in loops:
        assert any("%globaltimer" in ln for ln in body), "mbarrier.try_wait loop without a %globaltimer read:\n" + \
            "\n".join(body)
    assert re.search(rf"atom(\.relaxed\.gpu)?\.global\.or\.b32\s+%r\d+, \[%rd\d+\], {ERR_RING_TIMEOUT};", ptx)


@pytest.mark.compile
@pytest.mark.parametrize("mma", ["tma_ws", "tma_ws_mcast", "tma_ws_mcast_b"])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
def test_tma_ws_ring_waits_bounded(tmp_path, schedule, mma):
    """No hangs: every full/empty ring wait of the tma_ws roles is a try_wait loop bounded by
    %globaltimer that reports ERR_RING_TIMEOUT (= xstage ERR_MBARRIER_TIMEOUT) in the error word.
    Wait sites: producer acquire in the L1 and L2 load loops, the producer tail (one per stage),
    consumer first-stage + per-K-block waits of the L1 and L2 mainloops, the producer's
    error-path waits for the previous load (L1, L2) and its exit drain (one per stage)."""
    stages = 4
    ptx = _compile_ptx(tmp_path, 512, 256, schedule, block_m=128, block_n=128, mma=mma, stages=stages)
    _check_ring_waits_bounded(ptx, min_waits=2 + 2 * stages + 4 + 2)


def test_ring_timeout_maps_to_device_error():
    """Host side: the ring's error bit is xstage's ERR_MBARRIER_TIMEOUT, distinct from the row-counter
    spin and the grid barrier, and raise_on_device_error (the check in MegaMoE._run_fused) names it."""
    from megamoe_interleave import kernel_sm90 as k
    from xstage import device as xd

    assert k.ERR_RING_TIMEOUT == xd.ERR_MBARRIER_TIMEOUT
    assert k.ERR_RING_TIMEOUT & (k.ERR_DEPENDENCY_TIMEOUT | xd.ERR_BARRIER_TIMEOUT) == 0
    with pytest.raises(xd.DeviceError, match="MegaMoESm90 rank 0: device error 0x4: shared-memory mbarrier wait"):
        xd.raise_on_device_error(k.ERR_RING_TIMEOUT, "MegaMoESm90 rank 0")
    op = k.MegaMoESm90(256, 128, SCHEDULES[0], block_n=64, mma="tma_ws", timeout_ns=1000)
    assert op.ring_timeout_ns > op.timeout_ns  # a ring wait may span one row-counter spin


def test_bounded_pipeline_refuses_unbounded_waits():
    """The ring's pipeline class keeps no unbounded wait: the base class's waits raise."""
    from megamoe_interleave.kernel_sm90 import BoundedPipelineTmaAsync

    for name in ("producer_acquire", "consumer_wait", "producer_tail"):
        with pytest.raises(NotImplementedError, match="unbounded wait"):
            getattr(BoundedPipelineTmaAsync, name)(None, None)


def test_ring_wait_check_rejects_unbounded_loop():
    """The PTX check of test_tma_ws_ring_waits_bounded can fail: an unbounded try_wait loop (the
    shape cute.arch.mbarrier_wait emits, with and without its inline-asm labels) is caught."""
    unbounded = "\n".join([
        "$L__BB0_7:",
        "\tmbarrier.try_wait.parity.acquire.cta.shared::cta.b64 %p3, [%r1], %r2;",
        "\t@!%p3 bra $L__BB0_7;",
        "\tatom.global.or.b32 \t%r6, [%rd4], 4;",
    ])
    with pytest.raises(AssertionError, match="without a %globaltimer read"):
        _check_ring_waits_bounded(unbounded, min_waits=1)
    with pytest.raises(AssertionError, match="LAB_WAIT"):
        _check_ring_waits_bounded("LAB_WAIT:\n mbarrier.try_wait.parity.shared.b64 P1, [%r1], %r2, 10000000;\n"
                                  "@P1 bra.uni DONE;\n bra.uni LAB_WAIT;\n", min_waits=0)


@pytest.mark.parametrize("l2_handoffs", [1, 2])
@pytest.mark.parametrize("block_n", [64, 128, 256])
def test_staging_swizzle_is_a_conflict_free_permutation(block_n, l2_handoffs):
    """tma_ws staging tile (BM x BN/(2 l2_handoffs) words, no padding): stage_index is a
    permutation, keeps each 16-byte chunk contiguous (the epilogue's vector reads), and a
    warp's staging store (8 consecutive rows x the 4 words of one 8-column group) hits 32
    distinct banks, also within the BN/4 words of L1's h columns."""
    from megamoe_interleave.kernel_sm90 import MegaMoESm90

    stages = 4 if block_n < 256 or l2_handoffs == 2 else 3
    op = MegaMoESm90(1024, 512, SCHEDULES[0], block_m=128, block_n=block_n, mma="tma_ws", stages=stages,
                     l2_handoffs=l2_handoffs)
    W = op.stage_words
    assert W == block_n // (2 * l2_handoffs)
    idx = [[op.stage_index(m, c) for c in range(W)] for m in range(128)]
    assert sorted(i for row in idx for i in row) == list(range(128 * W))
    for m in range(128):
        for c in range(0, W, 4):
            assert idx[m][c:c + 4] == list(range(idx[m][c], idx[m][c] + 4))
    for r0 in range(0, 128, 8):
        for j in range(W // 4):
            banks = {idx[r0 + r][4 * j + q] % 32 for r in range(8) for q in range(4)}
            assert len(banks) == 32, (r0, j)
        assert max(idx[r0 + r][c] - (r0 + r) * W for r in range(8) for c in range(block_n // 4)) < W


def test_l2_handoffs_auto():
    """One L2 handoff when the BN-wide staging tile fits next to the ring, else two."""
    from megamoe_interleave.kernel_sm90 import MegaMoESm90

    def op(stages, bn=256, **kw):
        return MegaMoESm90(4096, 2048, SCHEDULES[0], block_m=128, block_n=bn, mma="tma_ws_mcast_b", stages=stages,
                           **kw)
    assert op(3).l2_handoffs == 1 and op(3).stage_words == 128
    assert op(4).l2_handoffs == 2 and op(4).stage_words == 64
    assert op(4, bn=128).l2_handoffs == 1
    assert op(3, l2_handoffs=2).stage_words == 64
    with pytest.raises(ValueError):
        op(4, l2_handoffs=1)  # 192 KB ring + 64 KB staging
    with pytest.raises(ValueError):
        op(3, l2_handoffs=3)


@pytest.mark.compile
def test_default_tiles_fit_shared_memory():
    """DeepSeek-V4-Flash default tiles (128 x 256, 4 stages): the kernel's shared storage fits
    the sm_90 227 KB (A/B ring 192 KB + 32 KB staging + barriers and row metadata)."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Int32
    from quack.compile_utils import make_fake_stream, make_fake_tensor

    from megamoe_interleave.api import default_tiles
    from megamoe_interleave.kernel_sm90 import NUM_SCALAR_ARGS, SMEM_BYTES, MegaMoESm90, tensor_argument_spec

    H, I = 4096, 2048
    bm, bn, stages = default_tiles("tma_ws_mcast_b", H, I)
    assert (bm, bn, stages) == (128, 256, 4)
    op = MegaMoESm90(H, I, SCHEDULES[0], block_m=bm, block_n=bn, mma="tma_ws_mcast_b", stages=stages)
    syms, tensors = {}, []
    for _, dtype, shape in tensor_argument_spec(H, I):
        dims = tuple(syms.setdefault(d, cute.sym_int()) if isinstance(d, str) else d for d in shape)
        tensors.append(make_fake_tensor(dtype, dims, divisibility=8 if dtype is BFloat16 else 1))
    cute.compile(op, *tensors, *([Int32(0)] * NUM_SCALAR_ARGS), make_fake_stream())
    size = op.shared_storage.size_in_bytes()
    assert 4 * 48 * 1024 + 32 * 1024 <= size <= SMEM_BYTES, size


def _cuobjdump():
    """cuobjdump from the CUDA toolkit or the one triton ships (installed with quack)."""
    import shutil

    path = shutil.which("cuobjdump")
    if path:
        return path
    try:
        import triton
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return path if os.path.exists(path) else None


def _dispatch_options(spec: str) -> dict:
    """Kernel options of a Dispatch spec "copy[/ef][/W<window>][/keep]"."""
    copy, *flags = spec.split("/")
    window = next((int(f[1:]) for f in flags if f.startswith("W")), 0)
    return dict(dispatch_copy=copy, dispatch_evict_first="ef" in flags, dispatch_window=window,
                dispatch_keep="keep" in flags)


@pytest.mark.compile
@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
@pytest.mark.parametrize("mma,block_n,stages,trace,dispatch",
                         [("tma_ws_mcast_b", 256, 3, False, "lsu"), ("tma_ws_mcast_b", 256, 4, False, "lsu"),
                          ("tma_ws_mcast_b", 256, 3, False, "bulk"), ("tma_ws_mcast_b", 256, 3, False, "bulk/ef"),
                          ("tma_ws_mcast_b", 256, 3, False, "bulk/ef/W5"),  # expert_wave's default at P = 8
                          ("tma_ws_mcast_b", 256, 3, False, "bulk/ef/W6"),
                          ("tma_ws_mcast_b", 256, 3, False, "bulk/ef/W6/keep"),
                          ("tma_ws", 256, 3, False, "lsu"), ("tma_ws", 128, 4, False, "lsu"),
                          ("tma_ws_mcast", 128, 4, False, "lsu")])
def test_tma_ws_sass_wgmma_pipelined(tmp_path, schedule, mma, block_n, stages, trace, dispatch):
    """The SASS ptxas made of the DSL's PTX keeps the consumers' WGMMAs pipelined: at the
    launch's 168 registers per thread ptxas serialized them in some builds (C7511, a
    ``WARPGROUP.DEPBAR ... 0x0`` after every HGMMA: ~25 % slower mainloops, measured on the
    H200); with setmaxnreg (kernel_sm90.AUX_WARPGROUP_REGS / MMA_WARPGROUP_REGS) there is one
    wait per K block's batch of HGMMAs and both setmaxnreg survive. Local memory: at most one
    spilled pointer (<= 16 bytes of stack), and no local access from the consumers'
    ``setmaxnreg`` up to their last HGMMA (the mainloops and handoffs). Timed builds only: the
    trace build of expert_wave (trace=True keeps timestamps live across the mainloop) is
    serialized at 208 registers, so its traced mainloop times overstate the untraced kernel's."""
    import subprocess

    from megamoe_interleave.kernel_sm90 import compile_megamoe_sm90

    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (CUDA toolkit or triton)")
    d = tmp_path / "cubin"
    d.mkdir()
    compile_megamoe_sm90(4096, 2048, schedule, options=f"--keep-cubin --dump-dir={d}", block_m=128,
                         block_n=block_n, mma=mma, stages=stages, trace=trace, **_dispatch_options(dispatch))
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
def test_l2_columns_sass_wgmma_pipelined(tmp_path):
    """expert_wave with l2_columns at P = 8's defaults (bulk Dispatch, evict-first, W = 5):
    the same SASS checks. Its schedule step divides by the expert's row count through
    rcp.approx (scheduler.divmod_small); an integer division there made ptxas serialize the
    WGMMAs."""
    test_tma_ws_sass_wgmma_pipelined(tmp_path, Schedule("expert_wave", l2_columns=True), "tma_ws_mcast_b", 256, 3,
                                      False, "bulk/ef/W5")


@pytest.mark.compile
@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
@pytest.mark.parametrize("dispatch", ["bulk", "bulk/ef", "bulk/ef/W6/keep"])
def test_bulk_dispatch_ptx(tmp_path, schedule, dispatch):
    """dispatch_copy="bulk" (the P = 8 tiles: 128 x 256, 3 stages): the dispatch warp moves rows
    with non-tensor bulk copies -- a load completing on an mbarrier, a store in a bulk group,
    the buffer reused after wait_group.read, rows published after wait_group 0 -- and its
    16-byte vector copy is gone (only the prologue's, by all threads, remains). The L2
    evict-first policy is on the loads exactly when ``dispatch_evict_first``, and on the stores
    unless ``dispatch_keep`` makes them evict-last; only ``dispatch_keep`` discards lines, and
    only a window polls the L1 tiles' row counters (with a nanosleep between polls)."""
    from megamoe_interleave.kernel_sm90 import DISPATCH_UNROLL

    opts = _dispatch_options(dispatch)
    evict_first, keep = opts["dispatch_evict_first"], opts["dispatch_keep"]
    ptx = _compile_ptx(tmp_path, 4096, 2048, schedule, block_m=128, block_n=256, mma="tma_ws_mcast_b", stages=3,
                       **opts)
    policy = r"\{ \.reg \.b64 xs_pol; createpolicy\.fractional\.L2::(evict_\w+)\.b64 xs_pol, 1\.0; "
    hint = r"\.L2::cache_hint \[[^\]]+\], \[[^\]]+\], \d+(, \[[^\]]+\])?, xs_pol;"
    load = r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier::complete_tx::bytes"
    store = r"cp\.async\.bulk\.global\.shared::cta\.bulk_group"
    assert re.search(load, ptx) and re.search(store, ptx)
    load_policies = {m.group(1) for m in re.finditer(policy + load + hint, ptx)}
    store_policies = {m.group(1) for m in re.finditer(policy + store + hint, ptx)}
    assert load_policies == ({"evict_first"} if evict_first else set())
    assert store_policies == ({"evict_last"} if keep else {"evict_first"} if evict_first else set())
    assert bool(re.search(r"discard\.global\.L2 \[%rd\d+\], 128;", ptx)) == keep
    assert bool(re.search(r"nanosleep\.u32", ptx)) == (opts["dispatch_window"] > 0)
    assert re.search(r"cp\.async\.bulk\.wait_group\.read\s+1;", ptx)
    assert re.search(r"cp\.async\.bulk\.wait_group\s+0;", ptx)
    # the prologue's unrolled copy + the row-record loads (keep: two more, discard_dead_rows
    # inlined twice); no second unrolled copy
    assert len(re.findall(r"ld\.global\.v4", ptx)) < 2 * DISPATCH_UNROLL + (2 if keep else 0)
    # a row is published only after its stores completed: wait_group 0 -> proxy fence ->
    # release fence -> release increment, in this order with nothing but arithmetic between
    pub = re.search(r"cp\.async\.bulk\.wait_group\s+0;(.*?)red\.release\.gpu\.global\.add", ptx, re.S)
    assert pub, "no publication after a bulk wait_group 0"
    between = pub.group(1)
    assert between.index("fence.proxy.async.global") < between.index("fence.acq_rel.gpu")
    assert not re.search(r"\b(st|ld|cp)\.(global|async)", between)
    # lane 0 copies alone; the warp reconverges before the CTA-wide (warp-aligned) barriers
    assert re.search(r"bar\.warp\.sync", ptx)


def test_bulk_dispatch_validation():
    """dispatch_copy: a known kind, one dispatch warp, and room for the bounce buffers (none
    next to the 4-stage 128 x 256 ring of P = 1)."""
    from megamoe_interleave.kernel_sm90 import MegaMoESm90

    kw = dict(block_m=128, block_n=256, mma="tma_ws_mcast_b")
    MegaMoESm90(4096, 2048, SCHEDULES[1], stages=3, dispatch_copy="bulk", **kw)
    with pytest.raises(ValueError, match="dispatch_copy must be"):
        MegaMoESm90(4096, 2048, SCHEDULES[1], stages=3, dispatch_copy="tma", **kw)
    with pytest.raises(ValueError, match="dispatch_warps=1"):
        MegaMoESm90(4096, 2048, SCHEDULES[1], stages=3, dispatch_copy="bulk", dispatch_warps=2, **kw)
    with pytest.raises(ValueError, match="does not fit"):
        MegaMoESm90(4096, 2048, SCHEDULES[1], stages=4, dispatch_copy="bulk", **kw)
    with pytest.raises(ValueError, match="bulk' only"):
        MegaMoESm90(4096, 2048, SCHEDULES[1], stages=3, dispatch_copy="lsu", dispatch_evict_first=True, **kw)
    # the windowed Dispatch: bulk only; keep needs a window (it bounds the pinned lines)
    MegaMoESm90(4096, 2048, SCHEDULES[1], stages=3, dispatch_copy="bulk", dispatch_window=6, dispatch_keep=True, **kw)
    with pytest.raises(ValueError, match="dispatch_window"):
        MegaMoESm90(4096, 2048, SCHEDULES[1], stages=3, dispatch_copy="lsu", dispatch_window=6, **kw)
    with pytest.raises(ValueError, match="dispatch_window"):
        MegaMoESm90(4096, 2048, SCHEDULES[1], stages=3, dispatch_copy="bulk", dispatch_window=-1, **kw)
    with pytest.raises(ValueError, match="needs dispatch_window"):
        MegaMoESm90(4096, 2048, SCHEDULES[1], stages=3, dispatch_copy="bulk", dispatch_keep=True, **kw)
    # rows longer than one piece go in equal pieces of <= 8 KB, multiples of 16 bytes
    op = MegaMoESm90(7168, 3072, SCHEDULES[1], stages=2, dispatch_copy="bulk", **kw)
    assert (op.bulk_pieces, op.bulk_piece_bytes) == (2, 7168)


def test_default_dispatch_copy():
    """dispatch_copy=None: bulk copies where the kernel takes them -- the 3-stage 128 x 256
    tiles of loopback P = 8 at DeepSeek-V4-Flash -- and the LSU copy where the bounce buffers
    do not fit (P = 1's 4 stages), without one dispatch warp, or outside the warp-specialized
    kinds."""
    from megamoe_interleave.api import default_dispatch_copy, default_tiles

    H, I, E, k = 4096, 2048, 256, 6

    def resolved(P, mma="tma_ws_mcast_b", **kw):
        bm, bn, stages = default_tiles(mma, H, I, rows_per_expert=P * 8192 * k / E)
        options = dict(block_m=bm, block_n=bn, mma=mma, stages=stages, **kw)
        return default_dispatch_copy(H, I, SCHEDULES[1], options)

    assert resolved(8) == "bulk"
    assert resolved(1) == "lsu"
    assert resolved(8, dispatch_warps=2) == "lsu"
    assert resolved(8, mma="wgmma") == "lsu"


def test_default_dispatch_window():
    """dispatch_window=None: expert_wave with bulk copies paces its Dispatch one row beyond the
    L1 rows in flight (66 CTA pairs // 16 L1 pair tiles per row + 1 = 5 at DeepSeek-V4-Flash on
    132 SMs, the measured best); interleaved and the LSU copy run unpaced; keep stays off. The
    resolved options construct a kernel."""
    from megamoe_interleave.api import default_tiles, resolve_dispatch_options
    from megamoe_interleave.kernel_sm90 import MegaMoESm90

    H, I, E, k = 4096, 2048, 256, 6
    for P, schedule, want in ((8, SCHEDULES[0], 5), (8, SCHEDULES[1], 0), (1, SCHEDULES[0], 0)):
        bm, bn, stages = default_tiles("tma_ws_mcast_b", H, I, rows_per_expert=P * 8192 * k / E)
        options = dict(block_m=bm, block_n=bn, mma="tma_ws_mcast_b", stages=stages)
        got = resolve_dispatch_options(H, I, schedule, options, 132)
        assert (got["dispatch_window"], got["dispatch_keep"]) == (want, False), (P, schedule.name)
        MegaMoESm90(H, I, schedule, **options, **got)
    assert resolve_dispatch_options(H, I, SCHEDULES[0], options, 132, dispatch_window=3)["dispatch_window"] == 3


def test_setmaxnreg_fits_the_launch_register_pool():
    """setmaxnreg only moves registers within the launch's pool (384 threads x 168 = 64512): a
    split asking for more (e.g. 80 / 216 = 65536) makes the consumers' increase fail at run
    time. The counts must also be multiples of 8 in [24, 256]."""
    from megamoe_interleave.kernel_sm90 import AUX_WARPGROUP_REGS, MMA_WARPGROUP_REGS

    launch_regs = 65536 // 384 // 8 * 8  # 168
    assert 128 * AUX_WARPGROUP_REGS + 256 * MMA_WARPGROUP_REGS <= 384 * launch_regs
    for n in (AUX_WARPGROUP_REGS, MMA_WARPGROUP_REGS):
        assert n % 8 == 0 and 24 <= n <= 256
    assert AUX_WARPGROUP_REGS < launch_regs < MMA_WARPGROUP_REGS
