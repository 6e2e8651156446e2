"""xstage.device: a tiny kernel using every helper compiles for sm_90a with the intended PTX (CPU)."""
import re

import pytest
from ptx_utils import try_wait_loops

pytestmark = pytest.mark.compile


@pytest.fixture(scope="module")
def helper_ptx():
    import cutlass.cute as cute
    from cutlass import Int32, Int64

    from xstage import device as xd
    from xstage.cute_compile import compile_hopper, fake_stream

    @cute.kernel
    def probe(table: cute.Tensor, flags: cute.Tensor, out: cute.Tensor, err: cute.Tensor, timeout: Int64):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        t0 = xd.globaltimer_ns()
        c0 = xd.clock64()
        off = Int64(tidx) * 16
        xd.store_v4_to_peer(table, bidx % 2, off, tidx, 1, 2, 3)
        xd.store_v4_to_peer(table, bidx % 2, off + 4096, tidx, 1, 2, 3, "cs")
        xd.store_v4(xd.peer_address(table, 0, off + 8192), tidx, 1, 2, 3, "no_allocate")
        xd.grid_arrive_and_wait(flags.iterator, Int32(2), timeout, err.iterator, tidx)
        if tidx == 0:
            xd.store_release(flags.iterator + 1, 5, "gpu")
            xd.red_add_release(flags.iterator + 2, 1, "sys")
            xd.red_add_relaxed(flags.iterator + 4, 1, "gpu")
            ok = xd.spin_wait_ge(flags.iterator + 1, Int32(5), timeout, err.iterator)
            v = xd.load_acquire(flags.iterator + 3, "sys")
            r = xd.load_relaxed(flags.iterator + 5, "gpu")
            out[bidx, 0] = xd.globaltimer_ns() - t0 + Int64(v) + Int64(r) + Int64(ok)
            out[bidx, 1] = xd.clock64() - c0
            out[bidx, 2] = Int64(xd.smid())

    @cute.jit
    def launch(table, flags, out, err, timeout: Int64, stream):
        probe(table, flags, out, err, timeout).launch(grid=[2, 1, 1], block=[128, 1, 1], stream=stream)

    mk = cute.runtime.make_fake_compact_tensor
    c = compile_hopper(
        launch, mk(Int64, (2,), assumed_align=16), mk(Int32, (8,), assumed_align=16), mk(Int64, (2, 3)),
        mk(Int32, (1,)), Int64(0), fake_stream(), keep_ptx=True,
    )
    assert c.ptx, "no PTX produced"
    return c.ptx


@pytest.mark.parametrize(
    "pattern",
    [
        r"\.target sm_90a",
        r"st\.global\.v4\.b32",
        r"st\.global\.cs\.v4\.b32",
        r"st\.global\.L1::no_allocate\.v4\.b32",
        r"ld\.global(\.nc)?\.b64|ld\.global(\.nc)?\.u64",  # peer table load
        r"mov\.u64\s+%rd\d+, %globaltimer",
        r"mov\.u64\s+%rd\d+, %clock64",
        r"mov\.u32\s+%r\d+, %smid",
        r"st\.release\.gpu\.global\.b32",
        r"red\.release\.sys\.global\.add\.s32",
        r"red\.relaxed\.gpu\.global\.add\.s32",
        r"ld\.acquire\.gpu\.global\.b32",
        r"ld\.acquire\.sys\.global\.b32",
        r"ld\.relaxed\.gpu\.global\.b32",
        r"atom(\.relaxed\.gpu)?\.global\.or\.b32",
        r"bar\.sync",
    ],
)
def test_helper_ptx_contains(helper_ptx, pattern):
    assert re.search(pattern, helper_ptx), f"PTX lacks {pattern}"


def test_bulk_copy_helpers_ptx():
    """bulk_copy_g2s / bulk_copy_s2g emit the non-tensor bulk copies with 32-bit shared
    addresses, completing on the mbarrier (load, waited with mbarrier_wait_tries) and on a bulk
    async-group (store); their L2 cache policy."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Int32, Int64

    from xstage import device as xd
    from xstage.cute_compile import compile_hopper, fake_stream

    @cute.kernel
    def copy(g: cute.Tensor, err: cute.Tensor):
        smem = cutlass.utils.SmemAllocator()
        buf = smem.allocate_array(BFloat16, 4096, byte_alignment=128)
        mbar = smem.allocate_array(Int64, 1, byte_alignment=8)
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            cute.arch.mbarrier_init(mbar, 1)
            cute.arch.mbarrier_init_fence()
            cute.arch.mbarrier_arrive_and_expect_tx(mbar, 8192)
            xd.bulk_copy_g2s(buf, g.iterator.toint(), 8192, mbar)
            if xd.mbarrier_wait_tries(mbar, Int32(0), 1000, err.iterator):
                xd.bulk_copy_s2g(Int64(g.iterator.toint()) + 8192, buf, 8192)
            # the same pair with the evict-first L2 cache policy
            cute.arch.mbarrier_arrive_and_expect_tx(mbar, 4096)
            xd.bulk_copy_g2s(buf, g.iterator.toint(), 4096, mbar, "evict_first")
            if xd.mbarrier_wait_tries(mbar, Int32(1), 1000, err.iterator):
                xd.bulk_copy_s2g(Int64(g.iterator.toint()) + 4096, buf, 4096, "evict_first")
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0)

    @cute.jit
    def launch(g, err, stream):
        copy(g, err).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream, smem=16384)

    mk = cute.runtime.make_fake_compact_tensor
    ptx = compile_hopper(launch, mk(BFloat16, (8192,), assumed_align=16), mk(Int32, (1,)), fake_stream(),
                         keep_ptx=True).ptx
    assert re.search(r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier::complete_tx::bytes \[%r\d+\], "
                     r"\[%rd\d+\], 8192, \[%r\d+\];", ptx)
    assert re.search(r"cp\.async\.bulk\.global\.shared::cta\.bulk_group \[%rd\d+\], \[%r\d+\], 8192;", ptx)
    assert re.search(r"cp\.async\.bulk\.wait_group\s+0;", ptx)
    # the evict-first copies: a policy created in each copy's own asm block (scoped register)
    assert len(re.findall(r"createpolicy\.fractional\.L2::evict_first\.b64 xs_pol, 1\.0;", ptx)) == 2
    assert re.search(r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier::complete_tx::bytes\.L2::cache_hint "
                     r"\[%r\d+\], \[%rd\d+\], 4096, \[%r\d+\], xs_pol;", ptx)
    assert re.search(r"cp\.async\.bulk\.global\.shared::cta\.bulk_group\.L2::cache_hint \[%rd\d+\], \[%r\d+\], "
                     r"4096, xs_pol;", ptx)
    # mbarrier_wait_tries: try_waits bounded by a count (no timer), then the error word
    assert "globaltimer" not in ptx and re.search(r"mbarrier\.try_wait", ptx)
    assert re.search(rf"atom(\.relaxed\.gpu)?\.global\.or\.b32\s+%r\d+, \[%rd\d+\], {xd.ERR_MBARRIER_TIMEOUT};", ptx)


def test_store_v4_rejects_unknown_cache_hint():
    import cutlass.cute as cute
    from cutlass import Int64

    from xstage import device as xd
    from xstage.cute_compile import compile_hopper, fake_stream

    @cute.kernel
    def bad(table: cute.Tensor):
        xd.store_v4(Int64(table[0]), 1, 2, 3, 4, "evict_everything")

    @cute.jit
    def launch(table, stream):
        bad(table).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

    with pytest.raises(Exception, match="cache must be one of"):
        compile_hopper(launch, cute.runtime.make_fake_compact_tensor(Int64, (1,), assumed_align=16), fake_stream())


def test_raise_on_device_error():
    import torch

    from xstage import device as xd

    xd.raise_on_device_error(torch.zeros(1, dtype=torch.int32))
    with pytest.raises(xd.DeviceError, match="spin-wait timed out"):
        xd.raise_on_device_error(torch.tensor([xd.ERR_SPIN_TIMEOUT], dtype=torch.int32), "k")
    with pytest.raises(xd.DeviceError, match="grid barrier"):
        xd.raise_on_device_error(xd.ERR_BARRIER_TIMEOUT | 8)


def _wait_probe_ptx(wait):
    """PTX of a kernel whose only wait is ``wait(mbar, tidx, timeout, error_word)`` on an smem mbarrier."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32, Int64

    from xstage.cute_compile import compile_hopper, fake_stream

    @cute.kernel
    def probe(out: cute.Tensor, err: cute.Tensor, timeout: Int64):
        tidx, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()
        mbar = smem.allocate_array(Int64, 1)
        if tidx == 0:
            cute.arch.mbarrier_init(mbar, 64)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if tidx < 64:
            cute.arch.mbarrier_arrive(mbar)
        ok = wait(mbar, tidx, timeout, err.iterator)
        out[tidx] = Int32(ok)

    @cute.jit
    def launch(out, err, timeout: Int64, stream):
        probe(out, err, timeout).launch(grid=[1, 1, 1], block=[128, 1, 1], stream=stream)

    mk = cute.runtime.make_fake_compact_tensor
    c = compile_hopper(launch, mk(Int32, (128,)), mk(Int32, (1,)), Int64(0), fake_stream(), keep_ptx=True)
    assert c.ptx, "no PTX produced"
    return c.ptx


@pytest.fixture(scope="module")
def mbarrier_wait_ptx():
    """A kernel whose only wait is one xd.mbarrier_wait_bounded."""
    from cutlass import Int32

    from xstage import device as xd

    return _wait_probe_ptx(lambda mbar, tidx, timeout, err: xd.mbarrier_wait_bounded(mbar, Int32(0), timeout, err))


def test_mbarrier_wait_bounded_ptx(mbarrier_wait_ptx):
    """The wait is a try_wait loop that reads %globaltimer on every trip and ORs the error code
    into the error word on timeout; no unbounded try_wait loop (cute.arch.mbarrier_wait's
    inline-asm LAB_WAIT loop) is emitted."""
    from xstage import device as xd

    ptx = mbarrier_wait_ptx
    assert "LAB_WAIT" not in ptx
    loops = try_wait_loops(ptx)
    assert len(loops) == 2, loops  # the fast try before the loop + the one inside it
    assert loops[0] is None and loops[1] is not None
    assert any("%globaltimer" in ln for ln in loops[1]), "try_wait loop without a %globaltimer read"
    assert re.search(rf"atom(\.relaxed\.gpu)?\.global\.or\.b32\s+%r\d+, \[%rd\d+\], {xd.ERR_MBARRIER_TIMEOUT};", ptx)


def test_mbarrier_wait_in_step_ptx():
    """The ring partner's wait: the bounded wait (a %globaltimer loop that reports), then, for a thread
    no longer ok, a second try_wait loop bounded by a count of tries (no timer: it must not end early
    while the context is time-sliced out) that reports nothing."""
    from cutlass import Boolean, Int32

    from xstage import device as xd

    ptx = _wait_probe_ptx(lambda mbar, tidx, timeout, err: xd.mbarrier_wait_in_step(
        mbar, Int32(0), Boolean(tidx % 2 == 0), timeout, err))
    assert "LAB_WAIT" not in ptx
    loops = try_wait_loops(ptx)
    assert len(loops) == 4 and loops[0] is None and loops[2] is None, loops
    assert any("%globaltimer" in ln for ln in loops[1])
    assert not any("%globaltimer" in ln for ln in loops[3])
    assert any(re.search(r"setp\.\w+\.[us]32\s+%p\d+, %r\d+, 104857[56];", ln) for ln in loops[3])
    assert len(re.findall(rf"atom(\.relaxed\.gpu)?\.global\.or\.b32\s+%r\d+, \[%rd\d+\], {xd.ERR_MBARRIER_TIMEOUT};",
                          ptx)) == 1


def test_raise_on_device_error_mbarrier_timeout():
    import torch

    from xstage import device as xd

    assert xd.ERR_MBARRIER_TIMEOUT not in (xd.ERR_SPIN_TIMEOUT, xd.ERR_BARRIER_TIMEOUT)
    assert xd.ERR_MBARRIER_TIMEOUT & (xd.ERR_SPIN_TIMEOUT | xd.ERR_BARRIER_TIMEOUT) == 0  # a bit of its own
    with pytest.raises(xd.DeviceError, match=r"0x4: shared-memory mbarrier wait timed out"):
        xd.raise_on_device_error(torch.tensor([xd.ERR_MBARRIER_TIMEOUT], dtype=torch.int32), "k")
    with pytest.raises(xd.DeviceError) as info:
        xd.raise_on_device_error(xd.ERR_MBARRIER_TIMEOUT | xd.ERR_SPIN_TIMEOUT | 16)
    msg = str(info.value)
    assert "mbarrier wait timed out" in msg and "spin-wait timed out" in msg and "unknown error bits 0x10" in msg
    assert "grid barrier" not in msg
    # ERR_ROUTING (MegaMoE's device-side plan) is a bit of its own too
    codes = (xd.ERR_SPIN_TIMEOUT, xd.ERR_BARRIER_TIMEOUT, xd.ERR_MBARRIER_TIMEOUT, xd.ERR_ROUTING)
    assert sum(codes) == (xd.ERR_SPIN_TIMEOUT | xd.ERR_BARRIER_TIMEOUT | xd.ERR_MBARRIER_TIMEOUT | xd.ERR_ROUTING)
    with pytest.raises(xd.DeviceError, match=r"0x8: an expert id outside"):
        xd.raise_on_device_error(xd.ERR_ROUTING, "k")
