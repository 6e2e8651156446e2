"""fa4_a2a.UlyssesAttention as a drop-in for yunchang's (CPU): the installed yunchang's signatures,
its attention types, and the process-group path (a torch-symm world built from the group) on the
fake multi-process fabric of test_fa4_a2a_multiprocess. In the project's venv (`scripts/test`, CI)
yunchang is installed from the `dit` extra and required; elsewhere these tests skip."""
import inspect
import os

import pytest
import torch

import fa4_a2a
from fa4_a2a import ulysses as U
from fa4_a2a.reference import ulysses_reference
from xstage.world import TorchSymmWorld, make_world

from test_fa4_a2a_multiprocess import BF16, _fake_launch, _run_ranks

if os.environ.get("XSTAGE_REQUIRE_DIT") == "1":
    import yunchang
else:
    yunchang = pytest.importorskip("yunchang")


def _params(fn):
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


def _defaults(fn):
    return {p.name: p.default for p in inspect.signature(fn).parameters.values()}


def test_same_signatures_as_yunchang():
    theirs, ours = yunchang.UlyssesAttention, fa4_a2a.UlyssesAttention
    kw_only = inspect.Parameter.KEYWORD_ONLY
    ours_init = [p for p in _params(ours.__init__) if p[1] != kw_only]  # world=, persistent=: ours only
    assert ours_init == _params(theirs.__init__)
    assert _params(ours.forward) == _params(theirs.forward)
    d_theirs, d_ours = _defaults(theirs.__init__), _defaults(ours.__init__)
    assert d_theirs["attn_type"] == yunchang.kernels.AttnType.FA and d_ours["attn_type"] is None
    for name in ("sequence_process_group", "scatter_idx", "gather_idx", "use_sync"):
        assert d_ours[name] == d_theirs[name], name
    assert _defaults(ours.forward) == _defaults(theirs.forward)


def test_every_yunchang_attn_type_is_accepted_or_refused():
    world = make_world("loopback", 2, device="cpu")
    members = {m.value: m for m in yunchang.kernels.AttnType}
    assert set(U.EXACT_ATTN_TYPES) <= set(members), "an accepted type is gone from yunchang's AttnType"
    for value, member in members.items():
        if value in U.EXACT_ATTN_TYPES:
            assert fa4_a2a.UlyssesAttention(world, attn_type=member).attn_type is member
            fa4_a2a.UlyssesAttention(world, attn_type=value)  # the string value too
        else:
            with pytest.raises(NotImplementedError, match="exact attention"):
                fa4_a2a.UlyssesAttention(world, attn_type=member)
    assert "sage_fp8" in members and "sage_fp8" not in U.EXACT_ATTN_TYPES


def test_world_or_group_arguments():
    world = make_world("loopback", 2, device="cpu")
    assert fa4_a2a.UlyssesAttention(world).world is world
    assert fa4_a2a.UlyssesAttention(world=world).world is world
    with pytest.raises(ValueError, match="not both"):
        fa4_a2a.UlyssesAttention(world, world=world)
    with pytest.raises(ValueError, match="not both"):
        fa4_a2a.UlyssesAttention(object(), world=world)
    with pytest.raises(ValueError, match="must be an xstage.world World"):
        fa4_a2a.UlyssesAttention(world="loopback")
    fa4_a2a.UlyssesAttention()  # yunchang's default: the default group, resolved on the first forward


def test_default_group_needs_torch_distributed():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    m = fa4_a2a.UlyssesAttention()
    x = torch.zeros(1, 8, 2, 64, dtype=BF16)
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        m(x, x, x)


@pytest.mark.parametrize("P", [2, 4])
def test_process_group_path_one_rank_per_process(P, monkeypatch):
    """yunchang-style use: UlyssesAttention(group) in every process; the module builds one
    torch-symm world per (group, rank) on its first forward and reuses it."""
    import torch.distributed as dist

    B, C, H, D = 1, 16, 2 * P, 64
    g = torch.Generator().manual_seed(10 + P)
    qs, ks, vs = ([torch.randn(B, C, H, D, generator=g).to(BF16) for _ in range(P)] for _ in range(3))
    ref = ulysses_reference(qs, ks, vs)
    group = object()  # stands for a ProcessGroup: only passed through
    state, made = {}, []

    def fake_make_world(backend, world_size, device=None, group=None):
        assert backend == "torch-symm"
        fab = state["fab"]
        world = TorchSymmWorld(world_size, torch.device("cpu"), group=group, dist=fab.dist(), symm_mem=fab.symm())
        made.append((fab.rank, world))
        return world

    def body(fab, r):
        state["fab"] = fab
        m = fa4_a2a.UlyssesAttention(group, attn_type="fa3")
        out1 = m(qs[r], ks[r], vs[r]).clone()
        out2 = m(qs[r], ks[r], vs[r], causal=False).clone()
        assert m.world.local_ranks == [r] and m.world.group is group
        assert fa4_a2a.UlyssesAttention(group).world is m.world  # cached per (group, rank)
        torch.testing.assert_close(out1, out2, atol=0, rtol=0)
        return out1

    monkeypatch.setattr(U, "_group_worlds", {})
    monkeypatch.setattr(U, "make_world", fake_make_world)
    monkeypatch.setattr(U, "_launch_fused", lambda *a: _fake_launch(state["fab"])(*a))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: state["fab"].rank)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: P)
    _, outs = _run_ranks(P, body)
    assert sorted(r for r, _ in made) == list(range(P))  # one world per rank, built once
    for r in range(P):
        torch.testing.assert_close(outs[r].float(), ref[r], atol=2e-2, rtol=0)


@pytest.mark.gpu
def test_same_output_as_yunchangs_module_on_a_one_rank_group(one_rank_nccl_group):
    """The real kernel: fa4_a2a.UlyssesAttention and yunchang's own (its torch SDPA path; its FA
    path needs flash-attn 2) on the same one-rank NCCL group and inputs, both against fp32."""
    from fa4_a2a.reference import attention_fp32

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 2048, 8, 128, generator=g, device="cuda", dtype=BF16) for _ in range(3))
    torch_flash = yunchang.kernels.AttnType.TORCH_FLASH
    theirs = yunchang.UlyssesAttention(one_rank_nccl_group, attn_type=torch_flash)(q, k, v)
    ours = fa4_a2a.UlyssesAttention(one_rank_nccl_group)(q, k, v).clone()
    ref, _ = attention_fp32(q, k, v, 128 ** -0.5, False)
    e_ours, e_theirs = ((x.float() - ref).abs().max().item() for x in (ours, theirs))
    d = (ours.float() - theirs.float()).abs().max().item()
    print(f"vs fp32: fa4_a2a {e_ours:.2e}, yunchang {e_theirs:.2e}; fa4_a2a vs yunchang {d:.2e}")
    assert e_ours <= max(2 * e_theirs, 1e-2) and d <= 2e-2
