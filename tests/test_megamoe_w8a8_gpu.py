"""GPU tests (Hopper) of the fused W8A8 kernel in the loopback world: against the recipe's
emulation (reference.reference_moe_w8a8, tolerance W8A8_KERNEL_REL_ERROR) and the float32
reference on the BF16 weights (the recipe's own error), both schedules bitwise equal."""
import pytest
import torch

from megamoe_interleave.config import BLOCK_M
from megamoe_interleave.reference import (
    W8A8_FP32_REL_ERROR, W8A8_KERNEL_REL_ERROR, reference_moe_fp32, reference_moe_w8a8, relative_error,
)

pytestmark = pytest.mark.gpu

E = 16


def _problem(P, tokens, k, kind, mask, seed, hidden, inter):
    from lab.megamoe.routing import make_routing

    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(E, 2 * inter, hidden, generator=g) / hidden ** 0.5).bfloat16()
    w2 = (torch.randn(E, hidden, inter, generator=g) / inter ** 0.5).bfloat16()
    xs = [torch.randn(t, hidden, generator=g).bfloat16().cuda() for t in tokens]
    routes = [make_routing(kind, t, E, k, seed=seed * 31 + r, mask_ratio=mask, strength=2.0)
              for r, t in enumerate(tokens)]
    return w1.cuda(), w2.cuda(), xs, [r[0].cuda() for r in routes], [r[1].cuda() for r in routes]


def _make(P, k, schedule, hidden, inter, **config):
    from megamoe_interleave import MegaMoE, MegaMoEConfig, make_world

    config.setdefault("lead" if schedule == "interleaved" else "experts_per_wave", 2)
    config.setdefault("precision", "w8a8")
    return MegaMoE(make_world("loopback", world_size=P, device="cuda"), E, hidden, inter, k, 256,
                   MegaMoEConfig(schedule, **config), backend="fused")


def _check(ys, emulated, fp32, fp32_bound=W8A8_FP32_REL_ERROR[1]):
    """Every output finite (the Combine slots are poisoned, so a row never stored shows), within
    W8A8_KERNEL_REL_ERROR of the emulation per rank and within the recipe's bound of fp32."""
    for y, emu, ref in zip(ys, emulated, fp32):
        assert y.shape == emu.shape and y.dtype == torch.bfloat16
        if y.numel() == 0:
            continue
        assert torch.isfinite(y.float()).all()
        assert relative_error(y, emu) <= W8A8_KERNEL_REL_ERROR, relative_error(y, emu)
        assert relative_error(y, ref) <= fp32_bound + W8A8_KERNEL_REL_ERROR, relative_error(y, ref)


CASES = [
    # P, tokens per rank, top-k, routing, mask ratio, (H, I)
    (1, [200], 2, "balanced", 0.0, (512, 256)),
    (1, [150], 1, "skewed", 0.0, (1024, 512)),
    (2, [100, 0], 1, "skewed", 0.0, (512, 256)),
    (4, [65, 3, 130, 17], 6, "balanced", 0.2, (1024, 512)),
    (8, [40, 1, 0, 77, 64, 5, 9, 120], 8, "skewed", 0.1, (512, 256)),
    (8, [32] * 8, 6, "balanced", 0.0, (1024, 256)),
]


@pytest.mark.parametrize("P,tokens,k,kind,mask,dims", CASES)
def test_fused_w8a8_matches_the_recipe_and_schedules_bitwise(P, tokens, k, kind, mask, dims):
    from megamoe_interleave import quant
    from lab.megamoe.routing import expert_load

    hidden, inter = dims
    w1, w2, xs, idx, w = _problem(P, tokens, k, kind, mask, P * 7 + k, hidden, inter)
    emulated = reference_moe_w8a8(xs, idx, w, *quant.quantize_weights(w1, w2))
    fp32 = reference_moe_fp32(xs, idx, w, w1, w2)
    outs = []
    for schedule in ("expert_wave", "interleaved"):
        moe = _make(P, k, schedule, hidden, inter)
        moe.load_weights(w1, w2)
        outs.append([y.clone() for y in moe.forward(xs, idx, w)])
        _check(outs[-1], emulated, fp32)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    load = expert_load(torch.cat(idx).cpu(), E)
    assert (load % BLOCK_M != 0).any()  # partial M blocks


COUNTS = [0, 128, 1, 64, 65, 127, 0, 200, 3, 0, 70, 0, 129, 5, 0, 40]  # rows per expert: none, full, half, ...


def _counts_routing(P, k, seed):
    """(tokens per rank, top-k ids per rank on the GPU) giving the experts COUNTS rows, shuffled."""
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(COUNTS)])
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(seed))]
    tokens = ids.numel() // (P * k)
    return tokens, list(ids[: P * tokens * k].view(P, tokens, k).cuda())


def test_fused_w8a8_zero_token_experts_and_half_tiles():
    """Experts with no tokens, exactly one full block, and last blocks of <= 64 rows (the half
    tiles, whose warpgroups exchange the h amax through shared memory) and of 65-127 rows."""
    from megamoe_interleave import quant

    P, k, hidden, inter = 2, 2, 512, 256
    tokens, idx = _counts_routing(P, k, 3)
    w1, w2, xs, _, w = _problem(P, [tokens] * P, k, "balanced", 0.0, 5, hidden, inter)
    emulated = reference_moe_w8a8(xs, idx, w, *quant.quantize_weights(w1, w2))
    fp32 = reference_moe_fp32(xs, idx, w, w1, w2)
    for schedule in ("expert_wave", "interleaved"):
        moe = _make(P, k, schedule, hidden, inter)
        moe.load_weights(w1, w2)
        _check(moe.forward(xs, idx, w), emulated, fp32)


def test_fused_w8a8_e4m3_inputs_and_prequantized_weights():
    """E4M3 x with its scales and weights loaded pre-quantized give the bf16-input call's y bit
    for bit (the same E4M3 rows and scales reach the kernel)."""
    from megamoe_interleave import quant

    P, k, hidden, inter = 2, 6, 512, 256
    w1, w2, xs, idx, w = _problem(P, [90, 45], k, "balanced", 0.1, 9, hidden, inter)
    moe = _make(P, k, "interleaved", hidden, inter)
    moe.load_weights(w1, w2)
    ys = [y.clone() for y in moe.forward(xs, idx, w)]
    pre = _make(P, k, "interleaved", hidden, inter)
    pre.load_quantized_weights(*quant.quantize_weights(w1, w2))
    x_in = [quant.quantize_act(x) for x in xs]
    for a, b in zip(pre.forward([q for q, _ in x_in], idx, w, x_scales=[s for _, s in x_in]), ys):
        assert torch.equal(a, b)


def test_fused_w8a8_takes_a_deepseek_checkpoint_bit_for_bit():
    """A DeepSeek / DeepGEMM-layout FP8 checkpoint (w1 in 128x128 blocks of its gate rows and of its
    up rows) through quant.from_deepgemm_layout, with up rows 16x the gate rows so the two scales of
    an L1 N tile differ: the kernel is within W8A8_KERNEL_REL_ERROR of that checkpoint's emulation,
    full and half (<= 64-row) tiles. The same weights with the tile's gate and up scales swapped
    emulate 10x further off than that, so a kernel that took the wrong scale per column would fail."""
    from megamoe_interleave import quant

    P, k, hidden, inter = 2, 2, 512, 256
    tokens, idx = _counts_routing(P, k, 4)
    w1, w2, xs, _, w = _problem(P, [tokens] * P, k, "balanced", 0.0, 6, hidden, inter)
    w1 = torch.cat([w1[:, :inter], 16 * w1[:, inter:]], dim=1)
    ckpt = (*quant.quantize_weight(w1), *quant.quantize_weight(w2))  # the checkpoint's own tensors
    conv = quant.from_deepgemm_layout(*ckpt)
    emulated = reference_moe_w8a8(xs, idx, w, *conv)
    swapped = conv[1].view(E, -1, 2, hidden // 128).flip(2).reshape(conv[1].shape)
    wrong = reference_moe_w8a8(xs, idx, w, conv[0], swapped, *conv[2:])
    assert min(relative_error(a, b) for a, b in zip(wrong, emulated)) > 10 * W8A8_KERNEL_REL_ERROR
    fp32 = reference_moe_fp32(xs, idx, w, quant.dequantize(*ckpt[:2]), quant.dequantize(*ckpt[2:]))
    for schedule in ("expert_wave", "interleaved"):
        moe = _make(P, k, schedule, hidden, inter)
        moe.load_quantized_weights(*conv)
        _check(moe.forward(xs, idx, w), emulated, fp32)


@pytest.mark.parametrize("schedule", ["expert_wave", "interleaved"])
def test_fused_w8a8_100_repeated_calls(schedule):
    """100 calls with fresh inputs and routing each: every 10th against the emulation, and the
    first call's inputs again at the end give its y bit for bit (state reset between calls)."""
    from megamoe_interleave import quant

    P, k, hidden, inter = 2, 6, 512, 256
    w1, w2, _, _, _ = _problem(P, [1, 1], k, "balanced", 0.0, 11, hidden, inter)
    wq = quant.quantize_weights(w1, w2)
    moe = _make(P, k, schedule, hidden, inter)
    moe.load_weights(w1, w2)
    first = None
    for it in range(100):
        tokens = [17 + (it * 13) % 100, (it * 7) % 60]
        _, _, xs, idx, w = _problem(P, tokens, k, "balanced" if it % 2 else "skewed", 0.1 * (it % 3), 100 + it,
                                    hidden, inter)
        ys = moe.forward(xs, idx, w)
        if it % 10 == 0:
            emulated = reference_moe_w8a8(xs, idx, w, *wq)
            _check(ys, emulated, reference_moe_fp32(xs, idx, w, w1, w2))
        if it == 0:
            first = (xs, idx, w, [y.clone() for y in ys])
    xs, idx, w, ys0 = first
    for a, b in zip(moe.forward(xs, idx, w), ys0):
        assert torch.equal(a, b)


@pytest.mark.parametrize("P,schedule", [(1, "interleaved"), (2, "expert_wave"), (4, "interleaved")])
def test_w8a8_graph_replays_equal_eager_forward(P, schedule):
    """W8A8 as one CUDA graph (bf16 x quantized on the device inside the graph, device-side plan,
    kernels, reduction): 30 replays with fresh tokens and routing each (masked picks, zero-token
    experts on some) give eager forward's y bit for bit; every 10th within the emulation's
    tolerance; no device error."""
    from megamoe_interleave import quant

    k, hidden, inter = 4, 512, 256
    w1, w2, _, _, _ = _problem(P, [1] * P, k, "balanced", 0.0, 21, hidden, inter)
    wq = quant.quantize_weights(w1, w2)
    eager = _make(P, k, schedule, hidden, inter)
    eager.load_weights(w1, w2)
    moe = _make(P, k, schedule, hidden, inter)
    moe.load_weights(w1, w2)
    layer = moe.capture([200, 37, 256, 129][:P])
    replays_equal_eager(layer, eager, k, 30, lambda ys, xs, idxs, ws: _check(
        ys, reference_moe_w8a8(xs, idxs, ws, *wq), reference_moe_fp32(xs, idxs, ws, w1, w2)))


def replays_equal_eager(layer, eager, k, steps, check):
    """``steps`` replays of the captured ``layer`` with fresh tokens and routing each
    (test_megamoe_graph._fresh_inputs): each y bit for bit ``eager``'s forward, every 10th also
    ``check(ys, xs, idxs, ws)``; then no device error."""
    from test_megamoe_graph import _fresh_inputs  # pytest puts tests/ on sys.path

    g = torch.Generator().manual_seed(4)
    for step in range(steps):
        xs, idxs, ws = (list(v) for v in zip(*_fresh_inputs(g, layer, k, step)))
        ys = [y.clone() for y in layer.replay()]
        for r, (a, b) in enumerate(zip(ys, eager.forward(xs, idxs, ws))):
            assert torch.equal(a, b), f"step {step}, rank {r}: replay != eager forward"
        if step % 10 == 0:
            check(ys, xs, idxs, ws)
    layer.check()


@pytest.mark.parametrize("schedule,window", [("interleaved", 0), ("expert_wave", 0), ("expert_wave", 2)])
def test_w8a8_bulk_dispatch_equals_lsu_bitwise(schedule, window):
    """The bulk Dispatch (E4M3 row pieces plus the scales as one more piece through the bounce
    buffers; windowed for expert_wave) gives the LSU copy's y bit for bit, 3-stage ring."""
    P, k, hidden, inter = 4, 6, 1024, 256
    w1, w2, xs, idx, w = _problem(P, [65, 3, 130, 17], k, "skewed", 0.1, 31, hidden, inter)
    outs = []
    for copy, win in (("lsu", 0), ("bulk", window)):
        moe = _make(P, k, schedule, hidden, inter, stages=3, dispatch_copy=copy, dispatch_window=win)
        moe.load_weights(w1, w2)
        outs.append([y.clone() for y in moe.forward(xs, idx, w)])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_w8a8_reads_nothing_past_its_tensors_under_memcheck(tmp_path):
    """Issue 39's fault, deterministically: the suite's illegal address came from scale reads up to
    63 rows past the pool (CTA 1 of an expert's last pair with no rows of its own), which faulted
    only when the caching allocator had put the scale scratch at the end of a mapped segment. With
    the allocator off every tensor is its own allocation and memcheck flags any such read, whatever
    ran before: lab.sanitize's W8A8 case (the issue's P = 1 problem included) must be
    clean and correct under it."""
    import shutil

    from lab import sanitize

    if shutil.which("compute-sanitizer") is None:
        pytest.skip("compute-sanitizer (CUDA toolkit) not found")
    errors, _, log = sanitize.sanitize("megamoe_w8a8_expert_wave", "memcheck", str(tmp_path), 600)
    assert errors == 0, open(log).read()[-4000:]


@pytest.mark.parametrize("T,H", [(1, 128), (37, 384), (300, 4096)])
def test_the_staging_kernel_quantizes_x_as_the_recipe_bit_for_bit(T, H):
    """act_quant's kernel (the W8A8 layer's input staging) gives quant.quantize_act's E4M3 bytes and
    scales exactly, into poisoned outputs, rows of every magnitude: all-zero groups (the 1e-4 floor),
    E4M3 subnormals, saturation, 448-multiples. H = 384: a 16-thread group can end a token mid-warp."""
    from megamoe_interleave import quant
    from megamoe_interleave.act_quant import quantize_act_into

    g = torch.Generator().manual_seed(T * 7 + H)
    x = torch.randn(T, H, generator=g) * torch.logspace(-8, 8, T)[:, None]
    x[0, :128] = 0.0
    x[-1, -128:] = torch.linspace(-448.0, 448.0, 128)
    x = x.bfloat16().cuda()
    want_q, want_s = quant.quantize_act(x)
    q = torch.full((T, H), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    s = torch.full((T, H // 128), float("nan"), device="cuda")
    quantize_act_into(x, q, s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s.view(torch.int32), want_s.view(torch.int32))


@pytest.mark.parametrize("precision", ["w8a8", "w4a8"])
def test_pair_split_n_gives_the_m_splits_bits_in_fp8(precision):
    """pair_split="n" in the FP8 kernels: the same tiles (h quantized per tile, scales per row and N
    block), so y is the M split's bit for bit, full and half tiles, both schedules."""
    P, k, hidden, inter = 2, 6, 1024, 512
    w1, w2, xs, idx, w = _problem(P, [250, 77], k, "skewed", 0.1, 23, hidden, inter)
    for schedule in ("expert_wave", "interleaved"):
        ys = []
        for split in ("m", "n"):
            moe = _make(P, k, schedule, hidden, inter, precision=precision, pair_split=split)
            moe.load_weights(w1, w2)
            ys.append([y.clone() for y in moe.forward(xs, idx, w)])
        for a, b in zip(*ys):
            assert torch.equal(a, b), schedule
