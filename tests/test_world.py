"""xstage.world: validation and addressing on the CPU (fakes for torch-symm); real buffers on the GPU."""
import types

import pytest
import torch

from xstage import world as W


# ----------------------------------------------------------------- CPU: validation


@pytest.mark.parametrize("bad", [0, -1])
def test_world_size_must_be_positive(bad):
    with pytest.raises(ValueError, match="world_size"):
        W.make_world("loopback", bad, device="cpu")


@pytest.mark.parametrize("bad", [2.0, "2", True, None])
def test_world_size_must_be_int(bad):
    with pytest.raises(TypeError, match="world_size"):
        W.make_world("loopback", bad, device="cpu")


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend"):
        W.make_world("nvshmem-magic", 2, device="cpu")


def test_host_backend_rejects_cpu_device():
    with pytest.raises((ValueError, RuntimeError), match="CUDA"):
        W.make_world("host", 2, device="cpu")


def test_extra_kwargs_rejected_for_loopback():
    with pytest.raises(TypeError):
        W.make_world("loopback", 2, device="cpu", group=None)


def test_loopback_cpu_separate_allocations_and_tables():
    w = W.make_world("loopback", 3, device="cpu")
    assert w.backend == "loopback" and w.world_size == 3 and w.local_ranks == [0, 1, 2]
    buf = w.alloc((4, 8), torch.float32)
    ptrs = [buf.local(r).data_ptr() for r in range(3)]
    assert len(set(ptrs)) == 3  # separate allocations
    for r in range(3):
        t = buf.peer_table(r)
        assert t.dtype == torch.int64 and t.shape == (3,)
        assert t.tolist() == ptrs
        W.check_peer_table(t, 3, "cpu")
    # separate memory: writing one rank leaves the others alone
    buf.fill_(-1.0)
    buf.local(1).fill_(2.5)
    assert (buf.local(0) == -1).all() and (buf.local(1) == 2.5).all() and (buf.local(2) == -1).all()
    assert buf.nbytes == 4 * 8 * 4


@pytest.mark.parametrize("shape", [(), (0,), (3, -1), (2.0,), "abc", (True, 2)])
def test_alloc_rejects_bad_shapes(shape):
    w = W.make_world("loopback", 2, device="cpu")
    with pytest.raises((ValueError, TypeError)):
        w.alloc(shape, torch.float32)


@pytest.mark.parametrize("dtype", ["float32", float, None, 4])
def test_alloc_rejects_non_torch_dtype(dtype):
    w = W.make_world("loopback", 2, device="cpu")
    with pytest.raises(TypeError, match="dtype"):
        w.alloc(16, dtype)


def test_rank_checks():
    w = W.make_world("loopback", 2, device="cpu")
    buf = w.alloc(16, torch.int32)
    for bad in (2, -1):
        with pytest.raises(ValueError, match="not local"):
            buf.local(bad)
        with pytest.raises(ValueError):
            buf.peer_table(bad)
    with pytest.raises(TypeError):
        buf.local(1.0)
    with pytest.raises(ValueError, match="no host copy"):
        buf.host(0)


def test_check_peer_table_errors():
    good = torch.tensor([16, 32], dtype=torch.int64)
    W.check_peer_table(good, 2)
    with pytest.raises(ValueError, match="int64"):
        W.check_peer_table(good.to(torch.int32), 2)
    with pytest.raises(ValueError, match="shape"):
        W.check_peer_table(good, 3)
    with pytest.raises(ValueError, match="aligned"):
        W.check_peer_table(torch.tensor([16, 33], dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="aligned"):
        W.check_peer_table(torch.tensor([0, 32], dtype=torch.int64), 2)
    with pytest.raises(TypeError):
        W.check_peer_table([16, 32], 2)


# ----------------------------------------------------------- CPU: torch-symm addressing


def test_symm_peer_addresses_with_pool_offset():
    bases = [0x7F0000000000, 0x7F1000000000, 0x7F2000000000, 0x7F3000000000]
    rank, offset = 2, 0x2400  # tensor 9 KiB into its allocation (implicit mempool)
    addrs = W.symm_peer_addresses(bases, rank, bases[rank] + offset, 4096, buffer_size=1 << 20)
    assert addrs == [b + offset for b in bases]


def test_symm_peer_addresses_offset_already_folded():
    # A torch version whose buffer_ptrs already include the tensor offset: offset 0.
    bases = [0x10000 + 0x2400, 0x90000 + 0x2400]
    assert W.symm_peer_addresses(bases, 1, bases[1], 64) == bases


def test_symm_peer_addresses_errors():
    bases = [0x100000, 0x200000]
    with pytest.raises(ValueError, match="before its allocation"):
        W.symm_peer_addresses(bases, 0, 0x0FFFF0, 16)
    with pytest.raises(ValueError, match="exceeds"):
        W.symm_peer_addresses(bases, 0, 0x100000 + 4096, 4096, buffer_size=4096)
    with pytest.raises(ValueError, match="aligned"):
        W.symm_peer_addresses(bases, 0, 0x100008, 16)
    with pytest.raises(ValueError, match="null"):
        W.symm_peer_addresses([0x100000, 0], 0, 0x100000, 16)
    with pytest.raises(ValueError, match="out of range"):
        W.symm_peer_addresses(bases, 2, 0x100000, 16)


class _FakeHandle:
    def __init__(self, rank, world_size, buffer_ptrs, buffer_size):
        self.rank, self.world_size = rank, world_size
        self.buffer_ptrs, self.buffer_size = buffer_ptrs, buffer_size


class _FakeSymm:
    """Stands in for torch.distributed._symmetric_memory: CPU tensors inside a pretend pool."""

    def __init__(self, rank, world_size, pool_offset):
        self.rank, self.world_size, self.pool_offset = rank, world_size, pool_offset
        self.calls = []

    def empty(self, shape, dtype, device):
        t = torch.empty(shape, dtype=dtype)
        self.calls.append(("empty", tuple(shape), dtype))
        return t

    def rendezvous(self, t, group):
        self.calls.append(("rendezvous", group))
        alloc_base = t.data_ptr() - self.pool_offset
        # peers' allocations mapped at unrelated addresses
        ptrs = [alloc_base + (j - self.rank) * (1 << 36) for j in range(self.world_size)]
        return _FakeHandle(self.rank, self.world_size, ptrs, self.pool_offset + t.numel() * t.element_size())


def _fake_dist(rank, world_size, initialized=True):
    calls = []
    d = types.SimpleNamespace(
        is_available=lambda: True,
        is_initialized=lambda: initialized,
        get_world_size=lambda group=None: world_size,
        get_rank=lambda group=None: rank,
        barrier=lambda group=None: calls.append("barrier"),
        group=types.SimpleNamespace(WORLD="WORLD"),
        calls=calls,
    )
    return d


def test_torch_symm_world_with_fakes():
    dist, symm = _fake_dist(1, 4), _FakeSymm(1, 4, pool_offset=0x3000)
    w = W.TorchSymmWorld(4, torch.device("cpu"), dist=dist, symm_mem=symm)
    assert w.backend == "torch-symm" and w.local_ranks == [1] and w.rank == 1
    buf = w.alloc((64,), torch.bfloat16)
    local = buf.local(1)
    addrs = buf.addresses(1)
    assert addrs[1] == local.data_ptr()
    for j in range(4):  # allocation base of peer j + the tensor's offset in the pool
        assert addrs[j] == local.data_ptr() + (j - 1) * (1 << 36)
    assert buf.peer_table(1).tolist() == addrs
    with pytest.raises(ValueError, match="not local"):
        buf.local(0)
    assert symm.calls[0] == ("empty", (64,), torch.bfloat16) and symm.calls[1] == ("rendezvous", "WORLD")
    w.barrier()
    assert dist.calls == ["barrier"]


def test_torch_symm_world_validation():
    with pytest.raises(RuntimeError, match="initialized"):
        W.TorchSymmWorld(2, torch.device("cpu"), dist=_fake_dist(0, 2, initialized=False), symm_mem=_FakeSymm(0, 2, 0))
    with pytest.raises(ValueError, match="process group has 2"):
        W.TorchSymmWorld(4, torch.device("cpu"), dist=_fake_dist(0, 2), symm_mem=_FakeSymm(0, 2, 0))


def test_torch_symm_handle_mismatch_detected():
    dist = _fake_dist(0, 2)
    symm = _FakeSymm(0, 3, pool_offset=0)  # handle claims 3 ranks
    w = W.TorchSymmWorld(2, torch.device("cpu"), dist=dist, symm_mem=symm)
    with pytest.raises(RuntimeError, match="world_size"):
        w.alloc(16, torch.float32)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_loopback_gpu_tables_and_separation():
    w = W.make_world("loopback", 4)
    buf = w.alloc((1024,), torch.float32)
    buf.fill_(float("nan"))
    ptrs = [buf.local(r).data_ptr() for r in range(4)]
    assert len(set(ptrs)) == 4
    for r in range(4):
        t = buf.peer_table(r)
        assert t.is_cuda and t.tolist() == ptrs
        W.check_peer_table(t, 4, w.device)
        buf.local(r).copy_(torch.full((1024,), float(r), device=w.device))
    w.barrier()
    for r in range(4):
        assert (buf.local(r) == r).all()


@pytest.mark.gpu
def test_host_world_is_pinned_and_device_visible():
    w = W.make_world("host", 2)
    buf = w.alloc((4096,), torch.int32)
    for r in range(2):
        h = buf.host(r)
        assert h.is_pinned() and not h.is_cuda
        assert buf.peer_table(r).tolist() == [buf.host(j).data_ptr() for j in range(2)]
    dev = buf.local(0)
    assert dev.is_cuda, "torch refused the __cuda_array_interface__ view of pinned memory"
    assert dev.data_ptr() == buf.host(0).data_ptr()
    buf.fill_(-7)
    w.barrier()
    assert (buf.host(1) == -7).all()
    # A device kernel (torch) writes through the mapped pointer; the CPU sees it.
    vals = torch.randint(-2**31, 2**31 - 1, (4096,), dtype=torch.int32, device=w.device)
    dev.copy_(vals)
    w.barrier()
    assert torch.equal(buf.host(0), vals.cpu())
    assert (buf.host(1) == -7).all()


def test_remote_placement_option_checks_and_labels():
    """``loopback`` takes ``remote="device"`` (the control: alloc(remote=True) changes nothing) or
    ``"host"`` (only the remote destinations in pinned host memory, which needs CUDA);
    ``"loopback+host"`` names the latter; the other backends take no such option."""
    w = W.make_world("loopback", 2, device="cpu")
    assert w.placement == "loopback" and w.remote == "device"
    buf = w.alloc((8,), torch.float32, remote=True)
    assert buf.local(0).device.type == "cpu" and not buf.local(0).is_pinned()
    with pytest.raises(ValueError, match="remote must be one of"):
        W.make_world("loopback", 2, device="cpu", remote="nvlink")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        W.make_world("loopback", 2, device="cpu", remote="host")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        W.make_world("loopback+host", 2, device="cpu")
    with pytest.raises(TypeError):
        W.make_world("host", 2, device="cpu", remote="host")
    assert "loopback+host" in W.WORLDS


@pytest.mark.gpu
def test_remote_placement_puts_only_remote_buffers_in_pinned_memory():
    """loopback+host: a buffer allocated with remote=True is pinned host memory reached through the
    device mapping (its peer table holds the host pointers); every other buffer stays on the GPU."""
    w = W.make_world("loopback+host", 2)
    assert w.backend == "loopback" and w.placement == "loopback+host"
    src = w.alloc((4096,), torch.int32)
    dst = w.alloc((4096,), torch.int32, remote=True)
    for r in range(2):
        assert src.local(r).is_cuda
        with pytest.raises(ValueError, match="no host copy"):  # a device allocation
            src.host(r)
        h = dst.host(r)
        assert h.is_pinned() and dst.local(r).data_ptr() == h.data_ptr()
        assert dst.peer_table(r).tolist() == [dst.host(j).data_ptr() for j in range(2)]
    vals = torch.randint(-2**31, 2**31 - 1, (4096,), dtype=torch.int32, device=w.device)
    dst.local(1).copy_(vals)
    w.barrier()
    assert torch.equal(dst.host(1), vals.cpu())



# ----------------------------------------------------------- CPU: nvshmem world


class _FakeNvshmem:
    """Stands in for nvshmem.core + nvshmem.core.interop.torch: CPU tensors as the heap, each
    peer's copy a separate tensor (its address is what the world must put in the table)."""

    def __init__(self, pe, n_pes, initialized=True, reachable=None):
        self.pe, self.npes, self.initialized = pe, n_pes, initialized
        self.reachable = set(range(n_pes)) if reachable is None else reachable
        self.calls, self.peers, self.freed, self.finalized = [], {}, [], False

    def init_status(self):
        return types.SimpleNamespace(name="STATUS_IS_INITIALIZED" if self.initialized else "STATUS_NOT_INITIALIZED")

    def get_unique_id(self, empty=False):
        return "empty-uid" if empty else "uid-of-pe0"

    def init(self, device, uid, rank, nranks, initializer_method):
        self.calls.append(("init", device, uid, rank, nranks, initializer_method))
        self.initialized = True

    def my_pe(self):
        return self.pe

    def n_pes(self):
        return self.npes

    def tensor(self, shape, dtype):
        t = torch.empty(shape, dtype=dtype)
        self.peers[t.data_ptr()] = [t if j == self.pe else torch.empty(shape, dtype=dtype) for j in range(self.npes)]
        return t

    def get_peer_tensor(self, t, pe):
        return self.peers[t.data_ptr()][pe] if pe in self.reachable else None

    def free_tensor(self, t):
        self.freed.append(t.data_ptr())

    def finalize(self):
        self.finalized = True


def _nv_world(nv, rank=1, P=4, **kw):
    return W.NvshmemWorld(P, torch.device("cpu"), nvshmem=nv, interop=nv, dist=_fake_dist(rank, P), **kw)


def test_nvshmem_world_joins_an_initialized_nvshmem_and_tables_the_peer_pointers():
    nv = _FakeNvshmem(1, 4)
    w = _nv_world(nv)
    assert w.backend == "nvshmem" and w.local_ranks == [1] and nv.calls == []  # joined, not re-initialised
    buf = w.alloc((64,), torch.bfloat16, remote=True)
    peers = nv.peers[buf.local(1).data_ptr()]
    assert buf.addresses(1) == [p.data_ptr() for p in peers] and buf.addresses(1)[1] == buf.local(1).data_ptr()
    assert buf.peer_table(1).dtype == torch.int64 and buf.peer_table(1).tolist() == buf.addresses(1)
    w.barrier()
    assert w._dist.calls == ["barrier"]


def test_nvshmem_world_initializes_nvshmem_from_a_broadcast_unique_id():
    nv, sent = _FakeNvshmem(0, 2, initialized=False), []
    dist = _fake_dist(0, 2)
    dist.broadcast_object_list = lambda objs, src, group=None: sent.append((list(objs), src, group))
    devices = []
    factory = lambda i: devices.append(i) or types.SimpleNamespace(set_current=lambda: None, index=i)  # noqa: E731
    W.NvshmemWorld(2, torch.device("cpu"), nvshmem=nv, interop=nv, dist=dist, device_factory=factory)
    assert sent == [(["uid-of-pe0"], 0, None)] and devices == [0]
    (call,) = nv.calls
    assert call[0] == "init" and call[2:] == ("uid-of-pe0", 0, 2, "uid")


def test_nvshmem_world_close_frees_its_heap_buffers_and_finalizes_only_its_own_init():
    for initialized in (False, True):
        nv = _FakeNvshmem(0, 2, initialized=initialized)
        factory = lambda i: types.SimpleNamespace(set_current=lambda: None)  # noqa: E731
        dist = _fake_dist(0, 2)
        dist.broadcast_object_list = lambda objs, src, group=None: None
        w = W.NvshmemWorld(2, torch.device("cpu"), nvshmem=nv, interop=nv, dist=dist, device_factory=factory)
        bufs = [w.alloc((8,), torch.float32).local(0) for _ in range(2)]
        w.close()
        assert dist.calls == ["barrier"]  # no PE still stores into what is freed
        assert nv.freed == [bufs[1].data_ptr(), bufs[0].data_ptr()]
        assert nv.finalized == (not initialized)  # a joined NVSHMEM belongs to the stack


def test_nvshmem_world_refuses_what_it_cannot_run():
    with pytest.raises(RuntimeError, match="PE 3 is rank 1"):
        _nv_world(_FakeNvshmem(3, 4))
    with pytest.raises(ValueError, match="2 PEs"):
        _nv_world(_FakeNvshmem(1, 2))
    with pytest.raises(RuntimeError, match="not load/store reachable"):
        _nv_world(_FakeNvshmem(1, 4, reachable={0, 1})).alloc((16,), torch.float32)
    with pytest.raises(RuntimeError, match="torch.distributed"):
        W.NvshmemWorld(2, torch.device("cpu"), nvshmem=_FakeNvshmem(0, 2), interop=_FakeNvshmem(0, 2),
                       dist=_fake_dist(0, 2, initialized=False))
    with pytest.raises(TypeError, match="unexpected arguments"):
        W.make_world("nvshmem", 2, device="cpu", symm_mem=None)


def test_nvshmem_world_without_nvshmem4py_says_how_to_install(monkeypatch):
    real = W.importlib.import_module

    def no_nvshmem(name, *args):
        if name.startswith("nvshmem"):
            raise ImportError(name)
        return real(name, *args)

    monkeypatch.setattr(W.importlib, "import_module", no_nvshmem)
    with pytest.raises(RuntimeError, match=r"xstage\[nvshmem\]"):
        W.NvshmemWorld(2, torch.device("cpu"), dist=_fake_dist(0, 2))


@pytest.mark.gpu
def test_nvshmem_world_one_pe_runs_both_kernels(one_rank_nccl_group):
    """One PE on the GPU: NVSHMEM initialised by the world (UID bootstrap over the group), every
    symmetric buffer on its heap, the fused attention and the fused MegaMoE storing through the
    world's peer tables: attention against fp32, both bitwise equal to the loopback world's; then
    close() frees the heap buffers and finalizes."""
    pytest.importorskip("nvshmem.core")
    from fa4_a2a import ulysses_attention
    from fa4_a2a.reference import attention_fp32
    from megamoe_interleave import MegaMoE, MegaMoEConfig
    from lab.megamoe.routing import make_routing

    w = W.make_world("nvshmem", 1)
    assert w.backend == "nvshmem" and w.rank == 0 and w._owns_nvshmem
    g = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (torch.randn(1, 2048, 8, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = ulysses_attention(q, k, v, w).clone()
    ref, _ = attention_fp32(q, k, v, 128 ** -0.5, False)
    assert not torch.isnan(out).any() and (out.float() - ref).abs().max().item() <= 1e-2
    assert torch.equal(out, ulysses_attention([q], [k], [v], W.make_world("loopback", 1))[0])

    E, H, I, topk, T = 8, 512, 256, 2, 200
    w1 = (torch.randn(E, 2 * I, H, generator=g, device="cuda") / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g, device="cuda") / I ** 0.5).bfloat16()
    x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
    idx, wts = (t.cuda() for t in make_routing("skewed", T, E, topk, seed=3, strength=2.0))
    ys = []
    for world in (w, W.make_world("loopback", 1)):
        moe = MegaMoE(world, E, H, I, topk, 256, MegaMoEConfig("interleaved", lead=2), backend="fused")
        moe.load_weights(w1, w2)
        ys.append(moe.forward([x], [idx], [wts])[0].clone())
    assert torch.isfinite(ys[0].float()).all() and torch.equal(ys[0], ys[1])
    w.close()
    assert w._heap_tensors == [] and not w._owns_nvshmem
