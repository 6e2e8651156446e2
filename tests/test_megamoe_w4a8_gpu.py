"""GPU tests (Hopper) of the fused W4A8 kernel (megamoe_interleave.sm90_fp4) in the loopback world.

The W4A8 recipe is W8A8's on the widened weights (quant_fp4.widen_weights), and the kernel widens
exactly, so the strongest check is bitwise: the W4A8 layer's y equals the W8A8 layer's on those
widened weights, for every routing, both schedules, graph replays and repeated calls. Each case is
also held against the recipe's emulation (reference_moe_w4a8, W8A8's kernel tolerance) and the fp32
reference on the dequantized FP4 weights.
"""
import pytest
import torch

from megamoe_interleave.reference import W4A8_FP32_REL_ERROR, reference_moe_fp32, reference_moe_w4a8
from test_megamoe_w8a8_gpu import CASES, E, _counts_routing, _problem  # pytest puts tests/ on sys.path
from test_megamoe_w8a8_gpu import _check as check_fp8
from test_megamoe_w8a8_gpu import replays_equal_eager

pytestmark = pytest.mark.gpu


def _make(P, k, schedule, hidden, inter, precision="w4a8", **config):
    from megamoe_interleave import MegaMoE, MegaMoEConfig, make_world

    config.setdefault("lead" if schedule == "interleaved" else "experts_per_wave", 2)
    return MegaMoE(make_world("loopback", world_size=P, device="cuda"), E, hidden, inter, k, 256,
                   MegaMoEConfig(schedule, precision=precision, **config), backend="fused")


def _layers(P, k, schedule, hidden, inter, fp4):
    """(the W4A8 layer on ``fp4``, the W8A8 layer on its widened weights)."""
    from megamoe_interleave import quant_fp4

    w4 = _make(P, k, schedule, hidden, inter)
    w4.load_quantized_weights(*fp4)
    w8 = _make(P, k, schedule, hidden, inter, precision="w8a8")
    w8.load_quantized_weights(*quant_fp4.widen_weights(*fp4))
    return w4, w8


def _check(ys, xs, idx, w, fp4):
    """W8A8's check (finite, poisoned slots; the kernel tolerance) against the W4A8 emulation and, with
    W4A8's bound, fp32 on the dequantized FP4 weights."""
    from megamoe_interleave import quant_fp4

    check_fp8(ys, reference_moe_w4a8(xs, idx, w, *fp4),
              reference_moe_fp32(xs, idx, w, *quant_fp4.dequantize_weights(*fp4)), W4A8_FP32_REL_ERROR[1])


@pytest.mark.parametrize("P,tokens,k,kind,mask,dims", CASES)  # W8A8's
def test_fused_w4a8_is_w8a8_on_the_widened_weights_bitwise(P, tokens, k, kind, mask, dims):
    from megamoe_interleave import quant_fp4

    hidden, inter = dims
    w1, w2, xs, idx, w = _problem(P, tokens, k, kind, mask, P * 7 + k, hidden, inter)
    fp4 = quant_fp4.quantize_weights(w1, w2)
    outs = []
    for schedule in ("expert_wave", "interleaved"):
        w4, w8 = _layers(P, k, schedule, hidden, inter, fp4)
        ys = [y.clone() for y in w4.forward(xs, idx, w)]
        for a, b in zip(ys, w8.forward(xs, idx, w)):
            assert torch.equal(a, b), schedule
        _check(ys, xs, idx, w, fp4)
        outs.append(ys)
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_fused_w4a8_zero_token_experts_half_tiles_and_wide_exponent_spreads():
    """Experts with no tokens, one full block, last blocks of <= 64 rows (half tiles: each warpgroup
    widens its own B rows) and of 65-127; weights whose 32-groups span up to 38 exponents per block,
    so some groups round (shift below -8) and some go to zero (below -20): bitwise W8A8 on the
    widened weights. load_weights of the same BF16 weights gives the same bits."""
    from megamoe_interleave import quant_fp4

    P, k, hidden, inter = 2, 2, 512, 256
    tokens, idx = _counts_routing(P, k, 3)
    w1, w2, xs, _, w = _problem(P, [tokens] * P, k, "balanced", 0.0, 5, hidden, inter)
    g = torch.Generator().manual_seed(8)
    spread = torch.exp2(torch.randint(-24, 14, (E, 2 * inter, hidden // 32), generator=g).float())
    w1 = (w1.float().cpu() * spread.repeat_interleave(32, -1) / 2 ** 8).bfloat16().cuda()
    fp4 = quant_fp4.quantize_weights(w1, w2)
    assert quant_fp4.inexact_groups(fp4[1]) > 0
    for schedule in ("expert_wave", "interleaved"):
        w4, w8 = _layers(P, k, schedule, hidden, inter, fp4)
        ys = [y.clone() for y in w4.forward(xs, idx, w)]
        for a, b in zip(ys, w8.forward(xs, idx, w)):
            assert torch.equal(a, b), schedule
        from_bf16 = _make(P, k, schedule, hidden, inter)
        from_bf16.load_weights(w1, w2)
        for a, b in zip(from_bf16.forward(xs, idx, w), ys):
            assert torch.equal(a, b)


def test_fused_w4a8_takes_a_deepgemm_fp4_checkpoint_bit_for_bit():
    """DeepGEMM's per_token_cast_to_fp4 layout (gate | up rows, int8 codes, scales packed four UE8M0
    per int32) through quant_fp4.from_deepgemm_layout gives the layer quantized in the kernel layout
    y bit for bit, with up rows 16x the gate rows (their blocks' scales differ)."""
    from megamoe_interleave import quant_fp4

    P, k, hidden, inter = 2, 6, 512, 256
    w1, w2, xs, idx, w = _problem(P, [90, 45], k, "balanced", 0.1, 9, hidden, inter)
    w1 = torch.cat([w1[:, :inter], 16 * w1[:, inter:]], dim=1)
    p1, s1 = quant_fp4.quantize_weight(w1)
    p2, s2 = quant_fp4.quantize_weight(w2)
    ckpt = (p1.view(torch.int8), s1.contiguous().view(torch.int32), p2.view(torch.int8),
            s2.contiguous().view(torch.int32))
    moe = _make(P, k, "interleaved", hidden, inter)
    moe.load_quantized_weights(*quant_fp4.from_deepgemm_layout(*ckpt))
    ys = [y.clone() for y in moe.forward(xs, idx, w)]
    ref = _make(P, k, "interleaved", hidden, inter)
    ref.load_weights(w1, w2)
    for a, b in zip(ref.forward(xs, idx, w), ys):
        assert torch.equal(a, b)
    _check(ys, xs, idx, w, quant_fp4.quantize_weights(w1, w2))


@pytest.mark.parametrize("schedule", ["expert_wave", "interleaved"])
def test_fused_w4a8_100_repeated_calls(schedule):
    """100 calls with fresh inputs and routing each: every 10th bitwise against W8A8 on the widened
    weights and within the emulation's tolerance; the first call's inputs again at the end give its
    y bit for bit (state reset between calls)."""
    from megamoe_interleave import quant_fp4

    P, k, hidden, inter = 2, 6, 512, 256
    w1, w2, _, _, _ = _problem(P, [1, 1], k, "balanced", 0.0, 11, hidden, inter)
    fp4 = quant_fp4.quantize_weights(w1, w2)
    moe, w8 = _layers(P, k, schedule, hidden, inter, fp4)
    first = None
    for it in range(100):
        tokens = [17 + (it * 13) % 100, (it * 7) % 60]
        _, _, xs, idx, w = _problem(P, tokens, k, "balanced" if it % 2 else "skewed", 0.1 * (it % 3), 100 + it,
                                    hidden, inter)
        ys = [y.clone() for y in moe.forward(xs, idx, w)]
        if it % 10 == 0:
            for a, b in zip(ys, w8.forward(xs, idx, w)):
                assert torch.equal(a, b), it
            _check(ys, xs, idx, w, fp4)
        if it == 0:
            first = (xs, idx, w, ys)
    xs, idx, w, ys0 = first
    for a, b in zip(moe.forward(xs, idx, w), ys0):
        assert torch.equal(a, b)


@pytest.mark.parametrize("P,schedule", [(1, "interleaved"), (2, "expert_wave")])
def test_w4a8_graph_replays_equal_eager_forward(P, schedule):
    """W4A8 as one CUDA graph (input staging, device-side plan, kernels, reduction): 20 replays with
    fresh tokens and routing each give eager forward's y bit for bit; no device error."""
    from megamoe_interleave import quant_fp4

    k, hidden, inter = 4, 512, 256
    w1, w2, _, _, _ = _problem(P, [1] * P, k, "balanced", 0.0, 21, hidden, inter)
    fp4 = quant_fp4.quantize_weights(w1, w2)
    eager = _make(P, k, schedule, hidden, inter)
    eager.load_quantized_weights(*fp4)
    moe = _make(P, k, schedule, hidden, inter)
    moe.load_quantized_weights(*fp4)
    layer = moe.capture([200, 37][:P])
    replays_equal_eager(layer, eager, k, 20, lambda ys, xs, idxs, ws: _check(ys, xs, idxs, ws, fp4))


def test_w4a8_is_clean_under_memcheck(tmp_path):
    """lab.sanitize's W4A8 case (the W8A8 problems, issue 39's included, each checked bit for bit
    against W8A8 on the widened weights) under memcheck with the caching allocator off: no access
    past a tensor, the packed ring, the shift words or the widened blocks."""
    import shutil

    from lab import sanitize

    if shutil.which("compute-sanitizer") is None:
        pytest.skip("compute-sanitizer (CUDA toolkit) not found")
    errors, _, log = sanitize.sanitize("megamoe_w4a8_interleaved", "memcheck", str(tmp_path), 600)
    assert errors == 0, open(log).read()[-4000:]
