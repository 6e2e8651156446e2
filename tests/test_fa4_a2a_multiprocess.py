"""The multi-process (torch-symm) path of fa4_a2a on the CPU, with fakes.

P threads play P processes: a fake ``torch.distributed`` (all_to_all_single, barrier) and a fake
symmetric-memory module (rendezvous exchanges every rank's CPU buffer address) drive the real
``TorchSymmWorld``, ``UlyssesWorkspace`` and ``ulysses_attention``; only the kernel launch is
replaced by a float32 stand-in that stores each output row through the real (folded) peer table,
resolving addresses to the peers' CPU tensors.  Checks: each process sees only its own rank
(``local_ranks == [rank]``), the pre-A2A permutes and table folding give the Ulysses result,
and every rank barriers after its launch before returning.
"""

import threading
import types

import pytest
import torch

import fa4_a2a
from fa4_a2a import ulysses as U
from fa4_a2a.baselines import a2a_all_to_all_single, a2a_all_to_all_single_pre
from fa4_a2a.reference import attention_fp32, head_to_seq_shards, seq_to_head_shards, ulysses_reference
from xstage.world import TorchSymmWorld

BF16 = torch.bfloat16


class _Fabric:
    """State shared by the P fake processes."""

    def __init__(self, P):
        self.P = P
        self.tls = threading.local()
        self.sync = threading.Barrier(P, timeout=30)
        self.slots = {}
        self.tensors = {}  # data_ptr -> tensor: what a peer address resolves to
        self.events = []
        self.lock = threading.Lock()

    @property
    def rank(self):
        return self.tls.rank

    def exchange(self, value):
        """Every rank contributes ``value``; returns the list of all ranks' values."""
        self.slots[self.rank] = value
        self.sync.wait()
        out = [self.slots[j] for j in range(self.P)]
        self.sync.wait()
        return out

    def log(self, what):
        with self.lock:
            self.events.append((self.rank, what))

    def dist(self):
        fab = self

        def all_to_all_single(recv, send, group=None):
            chunks = fab.exchange(send)
            for j in range(fab.P):
                recv[j].copy_(chunks[j][fab.rank])

        def barrier(group=None):
            fab.log("barrier")
            fab.sync.wait()

        return types.SimpleNamespace(
            is_available=lambda: True, is_initialized=lambda: True,
            get_world_size=lambda group=None: fab.P, get_rank=lambda group=None: fab.rank,
            all_to_all_single=all_to_all_single, barrier=barrier, group=types.SimpleNamespace(WORLD="WORLD"))

    def symm(self):
        fab = self

        def empty(shape, dtype, device):
            return torch.empty(shape, dtype=dtype)

        def rendezvous(t, group):
            with fab.lock:
                fab.tensors[t.data_ptr()] = t
            ptrs = fab.exchange(t.data_ptr())
            return types.SimpleNamespace(rank=fab.rank, world_size=fab.P, buffer_ptrs=ptrs,
                                         buffer_size=t.numel() * t.element_size())

        return types.SimpleNamespace(empty=empty, rendezvous=rendezvous)

    def resolve(self, addr):
        """(tensor, byte offset) of a peer address."""
        for base, t in self.tensors.items():
            if base <= addr < base + t.numel() * t.element_size():
                return t, addr - base
        raise AssertionError(f"address 0x{addr:x} is in no rank's buffer")


def _fake_launch(fab):
    """Stand-in for the fused kernel: fp32 attention, each row stored through the peer table."""

    def launch(q, k, v, out, table, num_ranks, scale, causal, persistent):
        fab.log("launch")
        B, S, Hl, D = q.shape
        o, _ = attention_fp32(q, k, v, scale, causal)
        o = o.to(q.dtype)
        C, elem = S // num_ranks, q.element_size()
        for j, addr in enumerate(table.tolist()):
            dst, off = fab.resolve(addr)
            assert off % (D * elem) == 0
            h0 = off // (D * elem)  # the folded head offset r*Hl
            dst[:, :, h0:h0 + Hl] = o[:, j * C:(j + 1) * C]

    return launch


def _run_ranks(P, body):
    fab = _Fabric(P)
    results, errors = [None] * P, []

    def worker(r):
        fab.tls.rank = r
        try:
            results[r] = body(fab, r)
        except BaseException as e:  # surfaced in the main thread
            errors.append((r, e))
            fab.sync.abort()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(P)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return fab, results


@pytest.mark.parametrize("P", [2, 4])
def test_ulysses_attention_one_rank_per_process(P, monkeypatch):
    B, C, H, D = 2, 24, 2 * P, 64
    g = torch.Generator().manual_seed(P)
    qs, ks, vs = ([torch.randn(B, C, H, D, generator=g).to(BF16) for _ in range(P)] for _ in range(3))
    ref = ulysses_reference(qs, ks, vs)
    fabric = {}

    def body(fab, r):
        fabric["fab"] = fab
        world = TorchSymmWorld(P, torch.device("cpu"), dist=fab.dist(), symm_mem=fab.symm())
        assert world.local_ranks == [r]
        out = fa4_a2a.ulysses_attention(qs[r], ks[r], vs[r], world)
        assert isinstance(out, torch.Tensor) and out.shape == (B, C, H, D)
        return out.clone()

    monkeypatch.setattr(U, "_launch_fused", lambda *a: _fake_launch(fabric["fab"])(*a))
    fab, outs = _run_ranks(P, body)
    for r in range(P):
        torch.testing.assert_close(outs[r].float(), ref[r], atol=2e-2, rtol=0)
        mine = [e for rr, e in fab.events if rr == r]
        assert mine.index("launch") < mine.index("barrier"), f"rank {r} must barrier after its launch: {mine}"


def test_ulysses_attention_rejects_a_list_of_all_ranks_in_a_multiprocess_world():
    fab = _Fabric(2)
    fab.tls.rank = 0
    world = TorchSymmWorld(2, torch.device("cpu"), dist=fab.dist(), symm_mem=fab.symm())
    xs = [torch.randn(1, 8, 2, 64).to(BF16)] * 2
    with pytest.raises(fa4_a2a.Fa4A2AInputError, match="expected 1 tensors"):
        fa4_a2a.ulysses_attention(xs, xs, xs, world)


@pytest.mark.parametrize("P", [2, 4])
def test_all_to_all_single_permutes_match_the_layout_reference(P):
    """yunchang's pre/post permutes (baselines) == seq_to_head_shards / head_to_seq_shards."""
    B, C, Hl, D = 2, 6, 3, 8
    g = torch.Generator().manual_seed(10 + P)
    xs = [torch.randn(B, C, Hl * P, D, generator=g) for _ in range(P)]
    ys = [torch.randn(B, C * P, Hl, D, generator=g) for _ in range(P)]

    def body(fab, r):
        d = fab.dist()
        return a2a_all_to_all_single_pre(xs[r], dist=d), a2a_all_to_all_single(ys[r], dist=d)

    _, res = _run_ranks(P, body)
    for r, (pre, post) in enumerate(res):
        assert torch.equal(pre, seq_to_head_shards(xs)[r])
        assert torch.equal(post, head_to_seq_shards(ys)[r])


def test_barrier_false_and_single_process_worlds_do_not_barrier(monkeypatch):
    calls = []
    monkeypatch.setattr(U, "_launch_fused", lambda *a: calls.append("launch"))
    # Loopback on the CPU: P launches, stream order completes them, no barrier.
    from xstage.world import make_world

    world = make_world("loopback", 2, device="cpu")
    world.barrier = lambda: calls.append("barrier")
    xs = [torch.randn(1, 8, 2, 64).to(BF16) for _ in range(2)]
    outs = fa4_a2a.ulysses_attention(xs, xs, xs, world)
    assert calls == ["launch", "launch"] and len(outs) == 2

    # Multi-process with barrier=False: no barrier inside (the caller barriers, e.g. after a
    # graph replay); the outputs are complete once every rank has launched.
    P = 2
    g = torch.Generator().manual_seed(3)
    qs, ks, vs = ([torch.randn(1, 16, 2 * P, 64, generator=g).to(BF16) for _ in range(P)] for _ in range(3))
    fabric = {}

    def body(fab, r):
        fabric["fab"] = fab
        world = TorchSymmWorld(P, torch.device("cpu"), dist=fab.dist(), symm_mem=fab.symm())
        return fa4_a2a.ulysses_attention(qs[r], ks[r], vs[r], world, barrier=False)

    monkeypatch.setattr(U, "_launch_fused", lambda *a: _fake_launch(fabric["fab"])(*a))
    fab, outs = _run_ranks(P, body)
    assert [e for _, e in fab.events] == ["launch", "launch"]
    for o, r in zip(outs, ulysses_reference(qs, ks, vs)):
        torch.testing.assert_close(o.float(), r, atol=2e-2, rtol=0)


@pytest.mark.parametrize("P", [2, 3])
def test_selfcheck_plumbing_one_rank_per_process(P, monkeypatch):
    """fa4_a2a.selfcheck.check_world on a fake multi-process world (kernels replaced by float32
    stand-ins that store through the real peer tables): inputs agree across ranks, destinations
    are poisoned and barriered, and every path is compared for the process's own rank."""
    import fa4_a2a.baselines as Bm
    import fa4_a2a.interface as Im
    from fa4_a2a.selfcheck import check_world

    fabric = {}

    def local(q, k, v, o, **kw):
        o.copy_(attention_fp32(q, k, v)[0].to(o.dtype))

    def fused(q, k, v, out, table, num_ranks, **kw):
        _fake_launch(fabric["fab"])(q, k, v, out, table, num_ranks, None, False, False)

    def serial(q, k, v, o_local, out, table, num_ranks, **kw):
        local(q, k, v, o_local)
        fused(q, k, v, out, table, num_ranks)

    monkeypatch.setattr(U, "_launch_fused", lambda *a: _fake_launch(fabric["fab"])(*a))
    monkeypatch.setattr(fa4_a2a, "attention_a2a", fused)
    monkeypatch.setattr(Bm, "serial_symm", serial)
    monkeypatch.setattr(Im, "attention_local", local)

    def body(fab, r):
        fabric["fab"] = fab
        world = TorchSymmWorld(P, torch.device("cpu"), dist=fab.dist(), symm_mem=fab.symm())
        return check_world(world, verbose=False)

    fab, res = _run_ranks(P, body)
    for r, out in enumerate(res):
        assert out["ranks"] == [r] and len(out["checks"]) == 2 * 5, out["checks"]
    # A kernel that sends chunk j to the wrong rank must be caught.
    def misrouted(q, k, v, out, table, num_ranks, **kw):
        fused(q, k, v, out, table.flip(0), num_ranks)

    monkeypatch.setattr(fa4_a2a, "attention_a2a", misrouted)
    with pytest.raises(AssertionError, match="fused rank"):
        _run_ranks(P, body)
