"""CPU tests: routing generators, shapes table, weight transform, torch references and the API."""
import pytest
import torch

from megamoe_interleave.api import MegaMoE, make_world, transform_weights, untransform_w1
from megamoe_interleave.config import BLOCK_M, MegaMoEConfig
from megamoe_interleave.reference import reference_moe_fp32, unfused_pipeline, permute_for_rank
from lab.megamoe.routing import (
    balanced_routing, expert_load, imbalance, make_routing, mask_picks, skewed_routing,
)
from megamoe_interleave.shapes import SHAPES, get_shape
from megamoe_interleave.int_ops import DIVMOD_SMALL_MAX

DSV4 = get_shape("deepseek-v4-flash")


def test_routing_seedable_valid_and_distinct():
    a = balanced_routing(300, 64, 6, seed=3)
    b = balanced_routing(300, 64, 6, seed=3)
    c = balanced_routing(300, 64, 6, seed=4)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])
    idx, w = a
    assert idx.shape == (300, 6) and idx.dtype == torch.int64 and w.dtype == torch.float32
    assert all(len(set(row.tolist())) == 6 for row in idx)  # distinct experts per token
    torch.testing.assert_close(w.sum(1), torch.ones(300))


def test_skewed_routing_is_skewed_with_shared_hot_experts():
    E = 128
    r0 = skewed_routing(4000, E, 6, strength=1.5, seed=0)[0]
    r1 = skewed_routing(4000, E, 6, strength=1.5, seed=1)[0]
    bal = balanced_routing(4000, E, 6, seed=0)[0]
    assert imbalance(r0, E) > 2 * imbalance(bal, E)
    hot0 = set(torch.topk(expert_load(r0, E), 5).indices.tolist())
    hot1 = set(torch.topk(expert_load(r1, E), 5).indices.tolist())
    assert len(hot0 & hot1) >= 3  # same hot experts on every rank
    # strength 0 is balanced
    assert imbalance(skewed_routing(4000, E, 6, strength=0.0)[0], E) < 1.5


def test_mask_picks_and_bad_args():
    idx = balanced_routing(1000, 32, 4)[0]
    m = mask_picks(idx, 0.3, seed=1)
    frac = (m == -1).float().mean().item()
    assert 0.25 < frac < 0.35 and torch.equal(m[m >= 0], idx[m >= 0])
    with pytest.raises(ValueError):
        balanced_routing(10, 8, 9)
    with pytest.raises(ValueError):
        make_routing("nope", 10, 8, 2)


def test_shapes_table():
    assert (get_shape("deepseek-v4-pro").hidden, get_shape("deepseek-v4-pro").intermediate) == (7168, 3072)
    f = get_shape("deepseek-v4-flash")
    assert (f.hidden, f.intermediate, f.num_experts, f.topk) == (4096, 2048, 256, 6)
    m = get_shape("mimo-v2.5-pro")
    assert (m.hidden, m.intermediate, m.num_experts, m.topk) == (6144, 2048, 384, 8)
    assert all(s.source for s in SHAPES.values())
    with pytest.raises(ValueError):
        get_shape("qwen3.5")


def test_transform_weights_interleaves_gate_up():
    E, I, H = 2, 32, 16
    w1 = torch.randn(E, 2 * I, H)
    w2 = torch.randn(E, H, I)
    w1i, w2o = transform_weights(w1, w2)
    assert torch.equal(w1i[:, 0:8], w1[:, 0:8]) and torch.equal(w1i[:, 8:16], w1[:, I:I + 8])
    assert torch.equal(w1i[:, 16:24], w1[:, 8:16])
    assert torch.equal(untransform_w1(w1i), w1) and torch.equal(w2o, w2)
    with pytest.raises(ValueError):
        transform_weights(w1, torch.randn(E, H, I + 1))


def _problem(P, E, H, I, k, tokens, kind="balanced", mask=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).bfloat16()
    xs = [torch.randn(t, H, generator=g).bfloat16() for t in tokens]
    routes = [make_routing(kind, t, E, k, seed=seed * 100 + r, mask_ratio=mask) for r, t in enumerate(tokens)]
    return w1, w2, xs, [r[0] for r in routes], [r[1] for r in routes]


def _check_close(ys, refs):
    for y, ref in zip(ys, refs):
        assert y.shape == ref.shape and y.dtype == torch.bfloat16
        assert torch.isfinite(y.float()).all()
        if y.numel() == 0:
            continue
        err = (y.float() - ref).abs()
        assert err.max().item() <= 0.02 + 0.02 * ref.abs().max().item(), err.max().item()


@pytest.mark.parametrize("P,tokens,k,kind,mask", [
    (1, [70], 2, "balanced", 0.0),
    (2, [33, 0], 6, "skewed", 0.0),
    (4, [65, 1, 17, 128], 8, "balanced", 0.25),
    (4, [40, 40, 40, 40], 1, "skewed", 0.0),
])
@pytest.mark.parametrize("schedule", ["expert_wave", "interleaved"])
def test_api_torch_backend_matches_fp32_reference(P, tokens, k, kind, mask, schedule):
    E, H, I = 16, 128, 64
    w1, w2, xs, idx, w = _problem(P, E, H, I, k, tokens, kind, mask)
    world = make_world("loopback", world_size=P, device="cpu")
    moe = MegaMoE(world, num_experts=E, hidden=H, intermediate=I, topk=k, max_tokens_per_rank=128,
                  config=MegaMoEConfig(schedule))
    moe.load_weights(w1, w2)
    refs = reference_moe_fp32(xs, idx, w, w1, w2)
    for _ in range(2):  # repeated calls reuse the buffer
        _check_close(moe.forward(xs, idx, w), refs)
    # The unfused baseline agrees too.
    el = E // P
    w1_t = [w1[r * el:(r + 1) * el].transpose(1, 2) for r in range(P)]
    w2_t = [w2[r * el:(r + 1) * el].transpose(1, 2) for r in range(P)]
    _check_close(unfused_pipeline(xs, idx, w, w1_t, w2_t), refs)


def test_permutation_is_expert_major_and_complete():
    idx = [torch.tensor([[0, 3], [2, -1]]), torch.tensor([[3, 1]])]
    w = [torch.rand(2, 2), torch.rand(1, 2)]
    p = permute_for_rank(idx, w, 1, 2)  # rank 1 owns experts 2, 3
    assert p.counts.tolist() == [1, 2]
    assert list(zip(p.src_rank.tolist(), p.src_token.tolist(), p.src_pick.tolist(), p.expert.tolist())) == [
        (0, 1, 0, 0), (0, 0, 1, 1), (1, 0, 0, 1)]


def test_config_is_resolved_once_and_frozen():
    """MegaMoE.config is the resolved MegaMoEConfig (given fields kept, the rest filled in) and
    cannot be changed behind the layer's back."""
    import dataclasses

    world = make_world("loopback", world_size=2, device="cpu")
    moe = MegaMoE(world, num_experts=16, hidden=128, intermediate=64, topk=2, max_tokens_per_rank=8,
                  config=MegaMoEConfig("expert_wave", dispatch_copy="bulk", dispatch_window=3))
    assert moe.config.resolved and moe.config.block_n == 64 and moe.config.dispatch_window == 3
    assert moe.config.schedule_spec() == moe.config.schedule_spec()
    with pytest.raises(dataclasses.FrozenInstanceError):
        moe.config.block_n = 128


def test_l2_columns_default_on_for_expert_wave_within_divmod_range():
    """On for expert_wave wherever an expert's L2 positions stay in divmod_small's exact range,
    off past it (the row order), an error when asked for there; never for interleaved."""
    world = make_world("loopback", world_size=2, device="cpu")

    def moe(tokens, **config):
        return MegaMoE(world, num_experts=16, hidden=128, intermediate=64, topk=2, max_tokens_per_rank=tokens,
                       config=MegaMoEConfig("expert_wave", **config))
    assert moe(8).config.schedule_spec().l2_columns
    assert not moe(8, l2_columns=False).config.schedule_spec().l2_columns
    # 2 ranks x T tokens // 256 + 1 rows, x 2 L2 pair tiles (H = 128, block_n = 64)
    shape = type(DSV4)("t", 128, 64, 16, 2, "")
    edge = (DIVMOD_SMALL_MAX // 2 - 1) * 128
    assert MegaMoEConfig("expert_wave").resolve(shape, 2, edge - 128, 132).l2_columns
    assert not MegaMoEConfig("expert_wave").resolve(shape, 2, edge + 128, 132).l2_columns
    with pytest.raises(ValueError, match="l2_columns: up to"):
        MegaMoEConfig("expert_wave", l2_columns=True).resolve(shape, 2, edge + 128, 132)
    assert not MegaMoE(world, num_experts=16, hidden=128, intermediate=64, topk=2,
                       max_tokens_per_rank=8).config.schedule_spec().l2_columns


def test_api_rejects_bad_input_before_launch():
    world = make_world("loopback", world_size=2, device="cpu")
    with pytest.raises(ValueError):
        MegaMoE(world, num_experts=15, hidden=128, intermediate=64, topk=2, max_tokens_per_rank=8)
    with pytest.raises(ValueError):
        MegaMoE(world, num_experts=16, hidden=100, intermediate=64, topk=2, max_tokens_per_rank=8)
    with pytest.raises(ValueError, match="does not apply"):
        MegaMoE(world, num_experts=16, hidden=128, intermediate=64, topk=2, max_tokens_per_rank=8,
                config=MegaMoEConfig(l2_columns=True))
    with pytest.raises(ValueError, match="topk"):
        MegaMoE(world, num_experts=16, hidden=128, intermediate=64, topk=17, max_tokens_per_rank=8)
    with pytest.raises(ValueError, match="backend"):
        MegaMoE(world, num_experts=16, hidden=128, intermediate=64, topk=2, max_tokens_per_rank=8, backend="cuda")
    moe = MegaMoE(world, num_experts=16, hidden=128, intermediate=64, topk=2, max_tokens_per_rank=8)
    assert not moe.config.schedule_spec().l2_columns  # interleaved
    w1, w2, xs, idx, w = _problem(2, 16, 128, 64, 2, [4, 4])
    with pytest.raises(RuntimeError):
        moe.forward(xs, idx, w)  # weights not loaded
    moe.load_weights(w1, w2)
    with pytest.raises(ValueError):
        moe.forward(xs[:1], idx[:1], w[:1])  # wrong number of ranks
    with pytest.raises(ValueError):
        moe.forward([x.float() for x in xs], idx, w)  # dtype
    bad = [i.clone() for i in idx]
    bad[0][0, 0] = 16
    with pytest.raises(ValueError):
        moe.forward(xs, bad, w)  # expert id out of range
    big = [torch.randn(9, 128).bfloat16()] * 2
    with pytest.raises(ValueError):
        moe.forward(big, [balanced_routing(9, 16, 2)[0]] * 2, [balanced_routing(9, 16, 2)[1]] * 2)


@pytest.mark.parametrize("schedule,trace", [("expert_wave", False), ("interleaved", True)])
@pytest.mark.parametrize("tokens", [[33, 0, 70, 5], [0, 0, 0, 0]])
def test_fused_launch_arguments_match_kernel_signature(schedule, trace, tokens):
    """The host planning of the fused backend produces arguments that match the kernel's
    compiled signature (dtypes, shapes, shared dynamic dims, contiguity) -- on the CPU."""
    from megamoe_interleave.arguments import check_launch_arguments, tensor_argument_spec

    P, E, H, I, k = 4, 16, 256, 128, 6
    w1, w2, xs, idx, w = _problem(P, E, H, I, k, tokens, "skewed", 0.1)
    world = make_world("loopback", world_size=P, device="cpu")
    moe = MegaMoE(world, num_experts=E, hidden=H, intermediate=I, topk=k, max_tokens_per_rank=128,
                  config=MegaMoEConfig(schedule, block_n=64, trace=trace), backend="fused")
    moe.load_weights(w1, w2)
    moe.stage_inputs(xs, idx, w)
    for d in range(P):
        num_ctas, tensors, scalars = moe.launcher.launch_arguments(d)
        assert num_ctas % 2 == 0 and 2 <= num_ctas <= 132
        check_launch_arguments(H, I, tensors)
        names = [n for n, _, _ in tensor_argument_spec(H, I)]
        t = dict(zip(names, tensors))
        num_rows, n_pool = t["mPlan"].tolist()
        assert scalars == (128, k)  # max_tokens, topk
        assert t["mPoolX"].shape[0] >= n_pool + BLOCK_M  # padded M tiles
        assert t["mCounters"].numel() >= 2 + num_rows
        last = t["mRowRecord"][-1]  # (expert, block, first pool row, tokens): the last expert with tokens
        assert n_pool == 0 or int(last[2] + last[3]) == n_pool
        assert t["mRowRecord"].data_ptr() % 16 == 0
        if trace:  # room for every tile of the busiest CTA
            from megamoe_interleave.row_grid import enumerate_all

            _, grid = moe.planner.plan_rank(d)
            most = max((len(q) for q in enumerate_all(moe.config.schedule_spec(), grid, num_ctas)), default=0)
            assert t["mTrace"].shape[:2] == (num_ctas, t["mTrace"].shape[1]) and t["mTrace"].shape[1] >= most
    with pytest.raises(ValueError):  # the checker itself can fail
        check_launch_arguments(H, I, tensors._replace(mPoolX=tensors.mPoolX[:, :8]))
    with pytest.raises(TypeError):  # only the typed arguments, never a positional tuple
        check_launch_arguments(H, I, tuple(tensors))


def test_default_ring_depth_follows_rows_per_expert():
    """128 x 256 tiles: 4 ring stages for few rows per local expert (DeepSeek-V4-Flash at P = 1:
    8192 * 6 / 256 = 192), 3 for many (loopback P = 8: 1536) -- the two measured points; other
    tiles keep 4; an explicit ``stages`` wins."""
    from megamoe_interleave.config import DEEP_RING_MAX_ROWS

    def stages(P, tokens, shape=DSV4, **config):
        return MegaMoEConfig(**config).resolve(shape, P, tokens, 132).stages
    assert stages(1, 8192) == 4 and stages(8, 8192) == 3
    assert stages(1, DEEP_RING_MAX_ROWS * 256 // 6 + 1) == 3
    assert stages(8, 8192, type(DSV4)("t", 512, 128, 16, 2, "")) == 4  # 128 x 128 tiles
    assert stages(8, 8192, stages=4, dispatch_copy="lsu") == 4
    for P, want in ((1, 4), (8, 3)):
        world = make_world("loopback", world_size=P, device="cpu")
        # 1024 tokens x 6 picks over 32 experts: 192 (P = 1) / 1536 (P = 8) rows per expert
        moe = MegaMoE(world, num_experts=32, hidden=4096, intermediate=2048, topk=6, max_tokens_per_rank=1024)
        assert moe.config.stages == want


def test_fused_rejects_pools_beyond_int32_chunk_indices():
    """Dispatch indexes pool rows in 16-byte chunks with int32: a configuration whose largest
    pool exceeds that is refused at construction, before any buffer is allocated."""
    world = make_world("loopback", world_size=8, device="cpu")
    with pytest.raises(ValueError, match="int32"):
        MegaMoE(world, num_experts=256, hidden=7168, intermediate=3072, topk=8, max_tokens_per_rank=65536,
                backend="fused")


def test_rerun_needs_the_fused_backend_and_a_forward():
    world = make_world("loopback", world_size=1, device="cpu")
    moe = MegaMoE(world, num_experts=4, hidden=128, intermediate=64, topk=2, max_tokens_per_rank=16)
    with pytest.raises(ValueError, match="fused"):
        moe.rerun()
    moe.backend = "fused"  # the guard on the plan comes next (no kernel is launched)
    with pytest.raises(RuntimeError, match="forward"):
        moe.rerun()


def test_rerun_after_set_trace_replans_the_staged_inputs():
    """set_trace drops the host plan (it holds the config); rerun() then plans the staged inputs
    again rather than asking for a forward (the sweep's traced calls; the guard broke every sweep cell
    on the H200 on 2026-12-04). On CPU the call stops at the launch."""
    world = make_world("loopback", world_size=1, device="cpu")
    moe = MegaMoE(world, num_experts=4, hidden=128, intermediate=64, topk=2, max_tokens_per_rank=16,
                  backend="fused")
    moe.load_weights((torch.randn(4, 128, 128) / 16).to(torch.bfloat16),
                     (torch.randn(4, 128, 64) / 16).to(torch.bfloat16))
    x = torch.randn(8, 128).to(torch.bfloat16)
    idx = torch.randint(0, 4, (8, 2), dtype=torch.int32)
    w = torch.rand(8, 2)
    with pytest.raises(RuntimeError, match="CUDA"):
        moe.forward([x], [idx], [w])
    for trace in (True, False):
        moe.set_trace(trace)
        with pytest.raises(RuntimeError, match="CUDA"):
            moe.rerun()


def test_dispatched_rows_is_the_kernels_pool():
    """MegaMoE.dispatched_rows(d) is the leading [n_pool, H] of the pool tensor the kernel gets
    (mPoolX), only once a launch planned it; gather_rows fills row i with x[src rank][src token]
    (CPU)."""
    from megamoe_interleave.arguments import tensor_argument_spec
    from megamoe_interleave.reference import gather_rows

    P, E, H, I, k = 2, 16, 256, 128, 6
    w1, w2, xs, idx, w = _problem(P, E, H, I, k, [120, 77], "balanced", 0.1, seed=5)
    moe = MegaMoE(make_world("loopback", world_size=P, device="cpu"), num_experts=E, hidden=H, intermediate=I,
                  topk=k, max_tokens_per_rank=128, config=MegaMoEConfig(block_n=128, stages=2), backend="fused")
    moe.load_weights(w1, w2)
    moe.stage_inputs(xs, idx, w)
    with pytest.raises(RuntimeError, match="forward"):
        moe.launcher.dispatched_rows(1)
    names = [n for n, _, _ in tensor_argument_spec(H, I)]
    for d in range(P):
        pool_x = dict(zip(names, moe.launcher.launch_arguments(d)[1]))["mPoolX"]
        rows = moe.launcher.dispatched_rows(d)
        perm = moe.planner.plan_rank(d)[0]
        n = perm.src_rank.numel()
        assert rows.shape == (n, H) and rows.data_ptr() == pool_x.data_ptr() and n > 0
        rows.copy_(gather_rows(xs, perm, rows.device))
        for i in range(n):
            assert torch.equal(pool_x[i], xs[int(perm.src_rank[i])][int(perm.src_token[i])])


def test_schedule_auto_is_chosen_for_the_world_before_the_config_resolves():
    """MegaMoEConfig("auto") takes no fixed schedule's fields and does not resolve by itself;
    MegaMoE picks for its world's remote path (loopback: none) and records why."""
    from megamoe_interleave.config import MegaMoEConfig

    with pytest.raises(ValueError, match="fixed schedule"):
        MegaMoEConfig("auto", lead=3)
    with pytest.raises(ValueError, match="chosen for a world"):
        MegaMoEConfig("auto").resolve(DSV4, 8, 4096, 132)
    moe = MegaMoE(make_world("loopback", world_size=2, device="cpu"), num_experts=16, hidden=256, intermediate=128,
                  topk=2, max_tokens_per_rank=64, config=MegaMoEConfig("auto"), backend="torch")
    assert moe.config.schedule == "interleaved" and moe.config.resolved
    assert moe.schedule_choice.platform is None and "locality" in moe.schedule_choice.reason
    assert MegaMoE(make_world("loopback", world_size=2, device="cpu"), num_experts=16, hidden=256, intermediate=128,
                   topk=2, max_tokens_per_rank=64, backend="torch").schedule_choice is None


def test_schedule_auto_with_a_remote_path_chooses_per_call_from_the_routing(monkeypatch):
    """With a remote path, auto is chosen again in each forward from the call's rows per local
    expert (the host plan's counts): expert_wave where its waves absorb the Combine (DeepSeek-V4-Pro
    dims, balanced 2048 tokens), interleaved for a skewed call; the resolved config, the scheduler
    and block_n follow (tests/test_megamoe_gpu.py runs it)."""
    import types

    from megamoe_interleave import api
    from megamoe_interleave.config import MegaMoEConfig
    from xstage import profiles

    monkeypatch.setattr(api, "_remote_path", lambda world: profiles.load("h200-pcie-host"))
    moe = MegaMoE(make_world("loopback", world_size=1, device="cpu"), num_experts=384, hidden=7168,
                  intermediate=3072, topk=6, max_tokens_per_rank=64, config=MegaMoEConfig("auto"), backend="torch")
    # at construction: balanced at 64 tokens per rank (one row per expert, all padding): absorbed
    assert set(moe.configs) == {"interleaved", "expert_wave"} and moe.schedule_choice.schedule == "expert_wave"
    per_call = {0: types.SimpleNamespace(counts_host=[32] * 384 + [0])}  # + the masked-pick sentinel
    config, choice = moe.planner.choose(per_call)
    assert choice.schedule == "expert_wave" == config.schedule == config.schedule_spec().name
    assert config is moe.configs["expert_wave"] and config.resolved
    config, choice = moe.planner.choose({0: types.SimpleNamespace(counts_host=[128] * 96 + [0] * 289)})
    assert choice.schedule == "interleaved" == config.schedule == config.schedule_spec().name
    assert config.block_n == moe.configs["interleaved"].block_n and moe.config.schedule == "expert_wave"  # the layer's own
    moe.set_trace(True)
    assert all(c.trace for c in moe.configs.values()) and moe.config.trace
