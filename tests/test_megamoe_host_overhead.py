"""Host side of MegaMoE.forward: the vectorized permutation, the cheap top-k reduction, the
cached scratch, the single table upload, the optional Combine poison and the number of
device syncs of the planning (CPU; one GPU test compares poison on/off)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megamoe_interleave.api import MegaMoE, make_world
from megamoe_interleave.config import BLOCK_M, MegaMoEConfig
from megamoe_interleave.reference import (
    Permutation, permute_for_rank, permute_ranks, reference_moe_fp32, routing_bounds, slot_rows, topk_reduce,
    weighted_combine,
)
from lab.megamoe.routing import make_routing
from megamoe_interleave.row_grid import balanced_l2_start


def _slow_permute(topk_idx, topk_weights, d, el):
    """Independent reference: every (source, token, pick) slot visited in order, then a
    stable sort by local expert (Python lists, no torch tricks)."""
    rows = []
    for s, (idx, w) in enumerate(zip(topk_idx, topk_weights)):
        for t, row in enumerate(idx.tolist()):
            for j, e in enumerate(row):
                if e >= 0 and d * el <= e < (d + 1) * el:
                    rows.append((e - d * el, s, t, j, float(w[t, j])))
    rows.sort(key=lambda r: r[0])  # stable: (source, token, pick) order kept inside an expert
    counts = [sum(1 for r in rows if r[0] == e) for e in range(el)]
    return rows, counts


def _routing(P, tokens, E, k, mask, seed):
    out = [make_routing("skewed", t, E, k, seed=seed * 13 + s, mask_ratio=mask, strength=1.0)
           for s, t in enumerate(tokens)]
    return [r[0] for r in out], [r[1] for r in out]


@pytest.mark.parametrize("tokens", [[37], [5, 0, 19, 19], [12, 12, 12], [0, 0], [1, 64, 3]])
@pytest.mark.parametrize("mask", [0.0, 0.3])
def test_permute_ranks_matches_slot_by_slot_reference(tokens, mask):
    P, E, k = len(tokens), 16, 3
    el = E // P if E % P == 0 else 4
    idx, w = _routing(P, tokens, el * P, k, mask, seed=len(tokens))
    perms = permute_ranks(idx, w, range(P), el)
    assert sorted(perms) == list(range(P))
    for d in range(P):
        rows, counts = _slow_permute(idx, w, d, el)
        p = perms[d]
        assert isinstance(p, Permutation) and p.counts_host == counts and p.counts.tolist() == counts
        got = list(zip(p.expert.tolist(), p.src_rank.tolist(), p.src_token.tolist(), p.src_pick.tolist()))
        assert got == [r[:4] for r in rows]
        assert p.weights.dtype == torch.float32
        assert p.weights.tolist() == [r[4] for r in rows]
        # the single-rank entry point agrees
        q = permute_for_rank(idx, w, d, el)
        assert torch.equal(q.src_token, p.src_token) and q.counts_host == counts


def test_routing_bounds_one_readback():
    a = torch.tensor([[3, -1], [7, 2]])
    b = torch.zeros(0, 2, dtype=torch.int64)
    c = torch.tensor([[5, 6]])
    assert routing_bounds([a, b, c]) == [(-1, 7), None, (5, 6)]
    assert routing_bounds([b]) == [None]


@pytest.mark.parametrize("mask", [0.0, 0.25])
def test_weighted_combine_skips_masked_slots_and_matches_fp64(mask):
    """Masked slots hold poison and are never read; the sum is in pick order with fp32
    accumulation (bit for bit a sequential fp32 loop over the picks, rounded once)."""
    g = torch.Generator().manual_seed(5)
    k, T, H = 4, 33, 64
    combine = torch.randn(k, T, H, generator=g).bfloat16()
    idx = make_routing("balanced", T, 16, k, seed=1, mask_ratio=mask)[0]
    valid = (idx >= 0).t()[:, :, None]
    want = torch.where(valid, combine.double(), 0.0).sum(0)
    poisoned = torch.where(valid, combine, float("nan"))  # masked slots hold poison
    y = weighted_combine(poisoned, idx)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()
    torch.testing.assert_close(y.double(), want, atol=0.02, rtol=0.01)
    acc = torch.zeros(T, H)
    for j in range(k):
        acc = acc + torch.where(valid[j], combine[j].float(), 0.0)
    assert torch.equal(y, acc.bfloat16())
    # The flat-buffer form the layer uses: rows of a [k * stride + 1, H] buffer, last row = padding.
    stride = T + 5
    flat = torch.full((k * stride + 1, H), float("nan")).bfloat16()
    flat[: k * stride].view(k, stride, H)[:, :T] = combine
    bad = idx.clone()
    bad[0, 0] = 16  # out of range: skipped like a masked pick when num_experts is given
    rows = slot_rows(bad, stride, num_experts=16)
    assert rows[0, 0] == k * stride
    want_rows = torch.where(((bad >= 0) & (bad < 16)).t()[:, :, None], combine.float(), 0.0)
    got = topk_reduce(flat, rows)
    assert torch.isfinite(got.float()).all()
    torch.testing.assert_close(got.double(), want_rows.sum(0).double(), atol=0.02, rtol=0.01)


def _problem(P, tokens, E=16, H=128, I=64, k=2, mask=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).bfloat16()
    xs = [torch.randn(t, H, generator=g).bfloat16() for t in tokens]
    idx, w = _routing(P, tokens, E, k, mask, seed)
    return w1, w2, xs, idx, w


def _close(ys, refs):
    for y, ref in zip(ys, refs):
        assert torch.isfinite(y.float()).all()
        assert (y.float() - ref).abs().max().item() <= 0.02 + 0.02 * ref.abs().max().item()


@pytest.mark.parametrize("poison", [True, False])
def test_torch_backend_poison_flag_and_zero_copy_staging(poison):
    P, T = 2, 24
    w1, w2, xs, idx, w = _problem(P, [T, 9], mask=0.2, seed=3)
    world = make_world("loopback", world_size=P, device="cpu")
    moe = MegaMoE(world, num_experts=16, hidden=128, intermediate=64, topk=2, max_tokens_per_rank=32,
                  poison_combine=poison)
    moe.load_weights(w1, w2)
    refs = reference_moe_fp32(xs, idx, w, w1, w2)
    _close(moe.forward(xs, idx, w), refs)
    # Poison covers exactly the slots the reduction reads, and only when asked for.
    for r in range(P):
        moe.buffer.combine.local(r).fill_(7.0)
    moe.stage_inputs(xs, idx, w)
    moe.flush_poison()
    for r, x in enumerate(xs):
        c = moe.buffer.combine_slots(r)
        assert bool(c[:, : x.shape[0]].isnan().all()) == poison
        assert bool((c[:, x.shape[0]:] == 7.0).all())
    # Inputs that already live in the symmetric buffers are used in place (no copy).
    buf = moe.buffer
    views = [(buf.x.local(r)[: x.shape[0]], buf.topk_idx.local(r)[: x.shape[0]],
              buf.topk_weights.local(r)[: x.shape[0]]) for r, x in enumerate(xs)]
    for (bx, bi, bw), x, i, ww in zip(views, xs, idx, w):
        bx.copy_(x), bi.copy_(i), bw.copy_(ww)
    copies = []
    orig = torch.Tensor.copy_

    def spy(self, src, *a, **kw):
        copies.append(self.data_ptr())
        return orig(self, src, *a, **kw)

    torch.Tensor.copy_ = spy
    try:
        ys = moe.forward([v[0] for v in views], [v[1] for v in views], [v[2] for v in views])
    finally:
        torch.Tensor.copy_ = orig
    staged = {v.data_ptr() for trip in views for v in trip}
    assert not staged & set(copies)
    _close(ys, refs)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_fused_planning_syncs_scratch_reuse_and_tables():
    """Host planning of every rank: one expert-range read-back + one counts read-back in
    total (no nonzero, no item()); scratch reused across calls and grown on demand; the
    one-upload tables equal the Python row grid."""
    P, E, H, I, k = 4, 16, 256, 128, 6
    w1, w2, xs, idx, w = _problem(P, [33, 0, 70, 5], E=E, H=H, I=I, k=k, mask=0.1, seed=7)
    world = make_world("loopback", world_size=P, device="cpu")
    moe = MegaMoE(world, num_experts=E, hidden=H, intermediate=I, topk=k, max_tokens_per_rank=128,
                  config=MegaMoEConfig(block_n=64), backend="fused")
    moe.load_weights(w1, w2)
    tolist_calls = []
    orig_tolist, orig_item = torch.Tensor.tolist, torch.Tensor.item

    def counting_tolist(self):
        tolist_calls.append(self.numel())
        return orig_tolist(self)

    def no_item(self):
        raise AssertionError("item() (a device sync per call) in the planning path")

    torch.Tensor.tolist, torch.Tensor.item = counting_tolist, no_item
    try:
        with _Ops() as ops:
            moe.stage_inputs(xs, idx, w)
            first = [moe.launcher.launch_arguments(d) for d in range(P)]
    finally:
        torch.Tensor.tolist, torch.Tensor.item = orig_tolist, orig_item
    assert len(tolist_calls) == 2, tolist_calls  # expert-id bounds, per-expert counts
    assert "nonzero" not in ops.names and "_local_scalar_dense" not in ops.names
    for d, (num_ctas, tensors, scalars) in enumerate(first):
        perm, grid = moe.planner.plan_rank(d)
        assert moe.planner.plan_rank(d)[0] is perm  # cached for the staged inputs
        num_rows, n_pool = tensors[12].tolist()
        assert num_rows == grid.num_rows
        assert tensors[4].shape == (n_pool + BLOCK_M, H) and tensors[5].shape == (n_pool + BLOCK_M, I)
        tok_off = [0] + torch.cumsum(perm.counts, 0).tolist()
        want = [(e, r - grid.expert_row_offset[e], tok_off[e], tok_off[e + 1] - tok_off[e])
                for r, e in enumerate(grid.row_expert)]
        assert [tuple(r) for r in tensors[8].tolist()] == (want or [(0, 0, 0, 0)])
        assert tensors[8].data_ptr() % 16 == 0
        assert moe.config.schedule_spec().balance_l2  # the API default: the table is the pairs' L2 starts
        assert tensors[9].tolist() == grid.l2_start == balanced_l2_start(
            grid, num_ctas // 2, block_m=BLOCK_M, hidden=H, intermediate=I)
        assert sorted(tensors[9].tolist()) == list(range(num_ctas // 2))
        assert tensors[2].tolist() == torch.stack([perm.src_rank, perm.src_token, perm.src_pick], 1).tolist()
    # Same inputs again: same scratch memory; a new staging re-plans.
    moe.stage_inputs(xs, idx, w)
    again = [moe.launcher.launch_arguments(d) for d in range(P)]
    for a, b in zip(first, again):
        assert a[1][4].data_ptr() == b[1][4].data_ptr() and a[1][5].data_ptr() == b[1][5].data_ptr()
    # More tokens: the scratch grows (still n_pool + BLOCK_M rows, contiguous).
    w1b, w2b, xs2, idx2, ws2 = _problem(P, [128, 128, 100, 128], E=E, H=H, I=I, k=k, seed=8)
    moe.stage_inputs(xs2, idx2, ws2)
    for d in range(P):
        _, tensors, scalars = moe.launcher.launch_arguments(d)
        n_pool = int(tensors[12][1])
        assert tensors[4].shape[0] == n_pool + BLOCK_M and tensors[4].is_contiguous()
        last = tensors[8][-1]  # the last expert with tokens ends the pool
        assert int(last[2] + last[3]) == n_pool == permute_for_rank(idx2, ws2, d, E // P).src_rank.numel()


def test_bad_expert_id_rejected_with_one_readback():
    w1, w2, xs, idx, w = _problem(2, [4, 4], seed=1)
    world = make_world("loopback", world_size=2, device="cpu")
    moe = MegaMoE(world, num_experts=16, hidden=128, intermediate=64, topk=2, max_tokens_per_rank=8)
    moe.load_weights(w1, w2)
    for bad_val in (16, -2):
        bad = [i.clone() for i in idx]
        bad[1][2, 1] = bad_val
        with pytest.raises(ValueError, match="topk_idx entries"):
            moe.forward(xs, bad, w)


@pytest.mark.gpu
def test_fused_poison_off_matches_poison_on_bitwise():
    from lab.megamoe.routing import make_routing as mr

    P, E, H, I, k = 2, 16, 256, 128, 4
    g = torch.Generator().manual_seed(11)
    w1 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).bfloat16().cuda()
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).bfloat16().cuda()
    tokens = [70, 33]
    xs = [torch.randn(t, H, generator=g).bfloat16().cuda() for t in tokens]
    routes = [mr("skewed", t, E, k, seed=s, mask_ratio=0.2) for s, t in enumerate(tokens)]
    idx = [r[0].cuda() for r in routes]
    w = [r[1].cuda() for r in routes]
    refs = reference_moe_fp32(xs, idx, w, w1, w2)
    outs = {}
    for poison in (True, False):
        world = make_world("loopback", world_size=P, device="cuda")
        moe = MegaMoE(world, num_experts=E, hidden=H, intermediate=I, topk=k, max_tokens_per_rank=128,
                      config=MegaMoEConfig(block_n=64), backend="fused", poison_combine=poison)
        moe.load_weights(w1, w2)
        outs[poison] = [moe.forward(xs, idx, w) for _ in range(2)]
        assert moe.last_kernel_us and moe.last_kernel_us > 0
    for ys in outs[True] + outs[False]:
        _close(ys, refs)
        for a, b in zip(ys, outs[True][0]):
            assert torch.equal(a, b)
