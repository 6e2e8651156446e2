"""MegaMoE without host syncs: the device-side plan's launch arguments and Combine-slot preparation
on the CPU; on a GPU, ``enqueue`` under torch's sync debug mode, a captured graph replayed 100 times
with fresh routing against eager ``forward`` (bitwise) and the fp32 reference, and ``check()``."""
import dataclasses

import pytest
import torch

from megamoe_interleave import MegaMoE, MegaMoEConfig, make_world
from megamoe_interleave.arguments import MegaMoEArguments, check_launch_arguments, tensor_argument_spec
from megamoe_interleave.config import BLOCK_M
from lab.megamoe.routing import make_routing
from megamoe_interleave.row_grid import balanced_l2_start, schedule_table

E, H, I = 16, 256, 128


def _routing(tokens, k, mask, seed, kind="skewed"):
    routes = [make_routing(kind, t, E, k, seed=seed * 31 + r, mask_ratio=mask, strength=2.0)
              for r, t in enumerate(tokens)]
    return [r[0] for r in routes], [r[1] for r in routes]


def _weights(seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).bfloat16()
    return w1.to(device), w2.to(device)


def _moe(P, k, schedule, *, world="loopback", device="cpu", max_tokens=256, **kw):
    return MegaMoE(make_world(world, world_size=P, device=device), E, H, I, k, max_tokens,
                   MegaMoEConfig(schedule, **kw), backend="fused")


def _stacked(moe):
    buf, P = moe.buffer, moe.world.world_size
    return (torch.stack([buf.topk_idx.local(s) for s in range(P)]),
            torch.stack([buf.topk_weights.local(s) for s in range(P)]),
            torch.tensor(buf.num_tokens, dtype=torch.int64))


@pytest.mark.parametrize("schedule", ["expert_wave", "interleaved"])
def test_device_launch_arguments_are_the_host_plans(schedule):
    """Same pool, weights, row records and sizes as the host planner (the schedule table at the
    fixed grid's pair count), in the kernel's signature, on the CPU."""
    P, k, tokens = 4, 6, [200, 0, 77, 256]
    w1, w2 = _weights(0)
    idx, w = _routing(tokens, k, 0.1, seed=1)
    moe = _moe(P, k, schedule)
    moe.load_weights(w1, w2)
    moe.stage_inputs([torch.randn(t, H).bfloat16() for t in tokens], idx, w)
    names = [n for n, _, _ in tensor_argument_spec(H, I)]
    plans = moe.launcher.device_plans(moe.config, *_stacked(moe))
    for d in range(P):
        dev = dict(zip(names, moe.launcher.device_launch_arguments(d, moe.config, plans)))
        _, host_tensors, _ = moe.launcher.launch_arguments(d)
        host = dict(zip(names, host_tensors))
        perm, grid = moe.planner.plan_rank(d)
        n = perm.src_rank.numel()
        assert dev["mPlan"].tolist() == host["mPlan"].tolist() == [grid.num_rows, n]
        assert torch.equal(dev["mPoolSrc"][:n], host["mPoolSrc"][:n]) and not dev["mPoolSrc"][n:].any()
        assert torch.equal(dev["mPoolWeight"][:n], host["mPoolWeight"][:n])
        assert torch.equal(dev["mRowRecord"][: grid.num_rows], host["mRowRecord"][: grid.num_rows])
        fixed = grid
        if moe.config.schedule_spec().balance_l2:
            fixed = dataclasses.replace(grid, l2_start=balanced_l2_start(
                grid, moe.device_ctas // 2, block_m=BLOCK_M, hidden=H, intermediate=I))
        assert dev["mScheduleTable"].tolist() == list(schedule_table(moe.config.schedule_spec(), fixed))
        assert dev["mPoolX"].shape[0] == moe.device_plan_sizes.max_pool + BLOCK_M
        assert dev["mCounters"].numel() >= 2 + 2 * moe.device_plan_sizes.max_rows
        check_launch_arguments(H, I, MegaMoEArguments(**dev))
    # The worst-case scratch is kept: a second plan reuses the same pointers (graph replays).
    again = moe.launcher.device_launch_arguments(P - 1, moe.config, moe.launcher.device_plans(moe.config, *_stacked(moe)))
    assert again[4].data_ptr() == dev["mPoolX"].data_ptr() and again[5].data_ptr() == dev["mH"].data_ptr()


def test_w8a8_device_launch_arguments():
    """W8A8 (H 512, I 256): the device-side path hands the kernel E4M3 pool / h scratch, worst-case
    FP32 scale scratch, the x_scales table and the block scales, in the W8A8 signature, on the CPU."""
    from megamoe_interleave import quant

    P, k, Hq, Iq = 2, 2, 512, 256
    g = torch.Generator().manual_seed(5)
    w1 = (torch.randn(E, 2 * Iq, Hq, generator=g) / Hq ** 0.5).bfloat16()
    w2 = (torch.randn(E, Hq, Iq, generator=g) / Iq ** 0.5).bfloat16()
    moe = MegaMoE(make_world("loopback", world_size=P, device="cpu"), E, Hq, Iq, k, 64,
                  MegaMoEConfig("interleaved", precision="w8a8"), backend="fused")
    moe.load_weights(w1, w2)
    idx, w = _routing([40, 9], k, 0.1, seed=2)
    moe.stage_inputs([torch.randn(t, Hq).bfloat16() for t in (40, 9)], idx, w)
    names = [n for n, _, _ in tensor_argument_spec(Hq, Iq, "w8a8")]
    plans = moe.launcher.device_plans(moe.config, *_stacked(moe))
    for d in range(P):
        dev = dict(zip(names, moe.launcher.device_launch_arguments(d, moe.config, plans)))
        check_launch_arguments(Hq, Iq, MegaMoEArguments(**dev), "w8a8")
        assert dev["mPoolX"].dtype == dev["mH"].dtype == quant.E4M3
        n_pad = moe.device_plan_sizes.max_pool + BLOCK_M
        assert dev["mPoolXScale"].shape == (n_pad, Hq // 128) and dev["mHScale"].shape == (n_pad, Iq // 128)
        assert dev["mW1Scale"] is moe.w1_scales[d] and torch.equal(dev["mPeerXScale"], moe.buffer.x_scales.peer_table(d))
    with pytest.raises(ValueError):  # a bf16 signature check rejects the W8A8 arguments
        check_launch_arguments(Hq, Iq, MegaMoEArguments(**dev))


def test_w4a8_launch_arguments():
    """W4A8 (H 512, I 256), host and device-side paths on the CPU: packed codes, the widened blocks'
    scales and the shift words of quant_fp4.kernel_operands, E4M3 pool / h and FP32 scale scratch, in
    the W4A8 signature (which a W8A8 check rejects)."""
    from megamoe_interleave import quant, quant_fp4
    from megamoe_interleave.arguments import MegaMoEArgumentsW4A8

    P, k, Hq, Iq = 2, 2, 512, 256
    config = MegaMoEConfig("interleaved", precision="w4a8")
    g = torch.Generator().manual_seed(6)
    w1 = (torch.randn(E, 2 * Iq, Hq, generator=g) / Hq ** 0.5).bfloat16()
    w2 = (torch.randn(E, Hq, Iq, generator=g) / Iq ** 0.5).bfloat16()
    moe = MegaMoE(make_world("loopback", world_size=P, device="cpu"), E, Hq, Iq, k, 64, config, backend="fused")
    moe.load_weights(w1, w2)
    idx, w = _routing([40, 9], k, 0.1, seed=3)
    moe.stage_inputs([torch.randn(t, Hq).bfloat16() for t in (40, 9)], idx, w)
    names = [n for n, _, _ in tensor_argument_spec(Hq, Iq, "w4a8")]
    plans = moe.launcher.device_plans(moe.config, *_stacked(moe))
    el = E // P
    for d in range(P):
        want = quant_fp4.kernel_operands(*quant_fp4.quantize_weights(w1[d * el:(d + 1) * el], w2[d * el:(d + 1) * el]))
        for args in (moe.launcher.device_launch_arguments(d, moe.config, plans), moe.launcher.launch_arguments(d)[1]):
            assert isinstance(args, MegaMoEArgumentsW4A8)
            check_launch_arguments(Hq, Iq, args, "w4a8")
            t = dict(zip(names, args))
            assert t["mPoolX"].dtype == t["mH"].dtype == quant.E4M3 and t["mW1"].dtype == torch.uint8
            for name, w_ in zip(("mW1", "mW1Scale", "mW1Shift", "mW2", "mW2Scale", "mW2Shift"), want):
                assert torch.equal(t[name], w_), name
    with pytest.raises(TypeError):
        check_launch_arguments(Hq, Iq, args, "w8a8")


def test_call_preparation_poisons_and_flags_out_of_range_ids():
    """Poison on exactly the read slots (the padding row and the slots past T untouched),
    ERR_ROUTING into every rank's error word for a live out-of-range id and not for a stale one
    past num_tokens; check() raises it and resets the words."""
    from xstage.device import ERR_ROUTING

    P, k, tokens = 2, 4, [50, 31]
    w1, w2 = _weights(1)
    idx, w = _routing(tokens, k, 0.3, seed=2)
    moe = _moe(P, k, "interleaved")
    moe.load_weights(w1, w2)
    moe.stage_inputs([torch.randn(t, H).bfloat16() for t in tokens], idx, w)
    buf = moe.buffer
    for r in range(P):
        buf.combine.local(r).fill_(7.0)
    moe.launcher.prepare_combine_slots(*_stacked(moe)[::2])
    for r, T in enumerate(tokens):
        slots = buf.combine_slots(r)
        assert bool(slots[:, :T].isnan().all()) and bool((slots[:, T:] == 7.0).all())
        assert bool((buf.combine.local(r)[-1] == 7.0).all())  # the padding row
        assert int(buf.counters[r][0]) == 0
    buf.topk_idx.local(1)[tokens[1]:] = E + 3  # stale rows past T: ignored
    moe.launcher.prepare_combine_slots(*_stacked(moe)[::2])
    assert [int(buf.counters[r][0]) for r in range(P)] == [0, 0]
    buf.topk_idx.local(1)[3, 1] = E
    moe.launcher.prepare_combine_slots(*_stacked(moe)[::2])
    assert [int(buf.counters[r][0]) for r in range(P)] == [ERR_ROUTING] * 2
    with pytest.raises(RuntimeError, match="expert id outside"):
        moe.check()
    assert [int(buf.counters[r][0]) for r in range(P)] == [0, 0]  # check() resets after raising


def test_enqueue_and_capture_refuse_what_they_cannot_run(monkeypatch):
    w1, w2 = _weights(2)
    moe = _moe(1, 2, "interleaved", trace=True)
    moe.load_weights(w1, w2)
    x, (idx,), (w,) = torch.randn(8, H).bfloat16(), *_routing([8], 2, 0.0, seed=3)
    with pytest.raises(NotImplementedError, match="trace"):
        moe.enqueue(x, idx, w)
    torch_moe = MegaMoE(make_world("loopback", world_size=1, device="cpu"), E, H, I, 2, 16, backend="torch")
    with pytest.raises(ValueError, match="fused"):
        torch_moe.enqueue(x, idx, w)
    with pytest.raises(ValueError, match="CUDA"):
        torch_moe.capture(8)
    # Multi-process worlds (torch-symm, nvshmem): the device-side plan needs every source's routing.
    import megamoe_interleave.api as api

    fused = _moe(1, 2, "interleaved")
    fused.load_weights(w1, w2)
    monkeypatch.setattr(api, "single_process", lambda world: False)
    with pytest.raises(NotImplementedError, match="multi-process"):
        fused.enqueue(x, idx, w)


def test_topk_reduce_kernel_compiles_to_16_byte_accesses():
    """The reduction kernel reads each slot and writes y with 16-byte vector accesses (sm_90a PTX)."""
    from megamoe_interleave.topk_reduce import compile_topk_reduce

    ptx = compile_topk_reduce(4096, keep_ptx=True).ptx
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx
    assert "st.global.b16" not in ptx and "ld.global.b16" not in ptx
    with pytest.raises(ValueError, match="multiple of 8"):
        compile_topk_reduce(100)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("T,k,H", [(1, 1, 8), (300, 6, 4096), (77, 8, 7168), (0, 4, 256)])
def test_topk_reduce_kernel_equals_embedding_bag_bitwise(T, k, H):
    """The CUDA kernel against embedding_bag (the CPU path's) on the same GPU data: NaN in the
    padding row and in masked slots (never read), out-of-range ids skipped, bit for bit."""
    from megamoe_interleave.reference import slot_rows, topk_reduce

    g = torch.Generator(device="cuda").manual_seed(T + k)
    stride = T + 3
    slots = torch.randn(k * stride + 1, H, device="cuda", generator=g).bfloat16()
    idx = torch.randint(-1, E + 1, (T, k), device="cuda", generator=g)
    valid = ((idx >= 0) & (idx < E)).t()
    slots[: k * stride].view(k, stride, H)[:, :T][~valid] = float("nan")
    slots[-1] = float("nan")
    rows = slot_rows(idx, stride, num_experts=E)
    got = topk_reduce(slots, rows)
    want = torch.nn.functional.embedding_bag(rows, slots, mode="sum", padding_idx=slots.shape[0] - 1)
    assert got.shape == (T, H) and torch.isfinite(got.float()).all()
    assert torch.equal(got, want)

def _fresh_inputs(g, layer, k, step):
    """New tokens and routing written in place into the graph's inputs: skewed or balanced,
    masked picks on some steps, one rank's routing sent to a few experts (zero-token experts)."""
    out = []
    for r, (x, idx, w) in enumerate(zip(layer.x, layer.topk_idx, layer.topk_weights)):
        T = x.shape[0]
        new_idx, new_w = make_routing("skewed" if step % 2 else "balanced", T, E, k, seed=step * 97 + r,
                                      mask_ratio=0.2 if step % 3 == 0 else 0.0, strength=2.0)
        if step % 5 == 0:
            new_idx = torch.where(new_idx >= 0, new_idx % 3, new_idx)  # experts 3.. get no token
        x.copy_(torch.randn(T, x.shape[1], generator=g).bfloat16())
        idx.copy_(new_idx)
        w.copy_(new_w)
        out.append((x.clone(), new_idx.cuda(), new_w.cuda()))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("P,world,schedule", [(1, "loopback", "interleaved"), (2, "loopback", "expert_wave"),
                                              (4, "loopback", "interleaved"), (8, "loopback", "interleaved"),
                                              (2, "host", "interleaved")])
def test_graph_replays_equal_eager_forward_and_reference(P, world, schedule):
    """100 replays, fresh routing each: y bitwise equal to eager forward (host-planned launch) of
    the same inputs, every 10th also against the fp32 reference; no device error."""
    from megamoe_interleave.reference import reference_moe_fp32

    k = 4
    w1, w2 = _weights(3, "cuda")
    eager = _moe(P, k, schedule, world=world, device="cuda")
    eager.load_weights(w1, w2)
    moe = _moe(P, k, schedule, world=world, device="cuda")
    moe.load_weights(w1, w2)
    tokens = [200, 37, 256, 1, 129, 64, 255, 100][:P]
    layer = moe.capture(tokens)
    g = torch.Generator().manual_seed(4)
    for step in range(100):
        inputs = _fresh_inputs(g, layer, k, step)
        ys = [y.clone() for y in layer.replay()]
        xs, idx, w = (list(v) for v in zip(*inputs))
        want = eager.forward(xs, idx, w)
        for r, (a, b) in enumerate(zip(ys, want)):
            assert torch.equal(a, b), f"step {step}, rank {r}: replay != eager forward"
        if step % 10 == 0:
            for y, ref in zip(ys, reference_moe_fp32(xs, idx, w, w1, w2)):
                assert torch.isfinite(y).all()
                assert (y.float() - ref).abs().max().item() <= 0.02 + 0.02 * ref.abs().max().item()
    layer.check()


@pytest.mark.gpu
def test_enqueue_needs_no_host_sync_and_check_raises_bad_ids():
    """enqueue under torch's sync debug mode ("error"), y equal to forward's; an out-of-range id
    raises at check(), not at the call."""
    k, tokens = 4, [256, 90]
    w1, w2 = _weights(5, "cuda")
    moe = _moe(2, k, "interleaved", device="cuda")
    moe.load_weights(w1, w2)
    idx, w = _routing(tokens, k, 0.1, seed=6)
    idx, w = [i.cuda() for i in idx], [v.cuda() for v in w]
    xs = [torch.randn(t, H, device="cuda").bfloat16() for t in tokens]
    want = [y.clone() for y in moe.forward(xs, idx, w)]
    moe.enqueue(xs, idx, w)  # first call: compile, scratch, token-count upload
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ys = moe.enqueue(xs, idx, w)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for a, b in zip(ys, want):
        assert torch.equal(a, b)
    moe.check()
    bad = [i.clone() for i in idx]
    bad[1][5, 0] = E
    moe.enqueue(xs, bad, w)  # no raise here: nothing is read back
    with pytest.raises(RuntimeError, match="expert id outside"):
        moe.check()
    for a, b in zip(moe.enqueue(xs, idx, w), want):  # clean again after check()
        assert torch.equal(a, b)
    moe.check()
