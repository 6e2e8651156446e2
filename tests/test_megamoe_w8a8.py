"""CPU tests of the W8A8 groundwork: quant.py (E4M3 quantization, the kernel weight layout, the
DeepGEMM-layout conversion), the recipe's emulation (reference.reference_moe_w8a8) against the
float32 reference, the torch backend's W8A8 data flow against the emulation, and the errors."""
import inspect

import pytest
import torch

from megamoe_interleave import quant, reference
from megamoe_interleave.api import MegaMoE, make_world, transform_weights, untransform_w1
from megamoe_interleave.config import MegaMoEConfig
from megamoe_interleave.reference import (
    W8A8_FP32_REL_ERROR, W8A8_KERNEL_REL_ERROR, reference_moe_fp32, reference_moe_w8a8, relative_error,
    w8a8_quantization_error,
)
from lab.megamoe.routing import expert_load
from test_megamoe_reference import _problem as bf16_problem  # pytest puts tests/ on sys.path

E, H, I = 16, 512, 256  # the smallest shape the W8A8 tiles take (H % 512, I % 256)
W8A8 = MegaMoEConfig(precision="w8a8")


def _bits(q):
    return q.view(torch.uint8)


def _scale_per_element(q, s):
    return quant.dequantize(torch.ones(q.shape).to(quant.E4M3), s)


def _problem(P, tokens, k=4, kind="balanced", mask=0.0, seed=0):
    """(w1, w2, xs, topk_idx, topk_weights) at E, H, I: bf16 weights of unit-variance outputs."""
    return bf16_problem(P, E, H, I, k, tokens, kind, mask, seed)


def _layer(P, **kw):
    return MegaMoE(make_world("loopback", world_size=P, device="cpu"), num_experts=E, hidden=H, intermediate=I,
                   topk=kw.pop("topk", 4), max_tokens_per_rank=128, config=kw.pop("config", W8A8), **kw)


# -- quantize / dequantize ------------------------------------------------------------------
@pytest.mark.parametrize("block_rows", [1, 128])
def test_round_trip_within_the_e4m3_bound(block_rows):
    """Every element comes back within half an E4M3 step: 2^-4 of its value in the normal range,
    2^-10 of the scale among the subnormals (fp32 slack 2^-16); s = amax * fl32(1/448) exactly, and each
    group's largest element lands on +-448. Magnitudes vary by 2^-8 .. 2^20 between groups (above
    the 1e-4 amax floor)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 384, generator=g)
    x *= torch.exp2(torch.randint(-8, 21, (256 // block_rows, 1), generator=g).float()).repeat_interleave(
        block_rows, 0)
    x[5, 7] = 1e3 * x[5].abs().max()  # an outlier: its group's small values go subnormal
    q, s = quant.quantize(x, block_rows)
    assert q.dtype == quant.E4M3 and s.dtype == torch.float32 and s.shape == (256 // block_rows, 3)
    amax = x.view(256 // block_rows, block_rows, 3, 128).abs().amax(dim=(1, 3))
    assert torch.equal(s, amax * (1 / 448))
    err = (quant.dequantize(q, s) - x).abs()
    bound = torch.maximum(2 ** -4 * x.abs(), 2 ** -10 * _scale_per_element(q, s)) * (1 + 2 ** -16)
    assert (err <= bound).all()
    top = q.float().view(256 // block_rows, block_rows, 3, 128).abs().amax(dim=(1, 3))
    assert (top == 448).all()


@pytest.mark.parametrize("block_rows", [1, 128])
def test_values_representable_in_e4m3_round_trip_exactly(block_rows):
    """Groups of E4M3 values times a power of two, each holding +-448 times it: the scale is that
    power of two, the codes are the values' own, the round trip is exact (signed zeros included)."""
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 256, (256, 256), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # no NaN codes (1.0 instead)
    codes[::block_rows, ::128] = 0x7E  # 448, once per group
    v = codes.view(quant.E4M3).float()
    p = torch.exp2(torch.randint(-12, 13, (256 // block_rows, 2), generator=g).float())
    x = v * p.repeat_interleave(block_rows, 0).repeat_interleave(128, 1)
    q, s = quant.quantize(x, block_rows)
    assert torch.equal(s, p) and torch.equal(_bits(q), codes)
    assert torch.equal(quant.dequantize(q, s), x)


def test_all_zero_groups_get_the_floor_scale_and_stay_zero():
    """amax is floored at 1e-4 (DeepGEMM's rule): an all-zero group gets s = 1e-4 * fl32(1/448), finite
    and nonzero, codes 0 and exact zeros back, no NaN; the other groups are unaffected."""
    x = torch.randn(4, 384)
    x[1] = 0
    x[2, 128:256] = 0
    q, s = quant.quantize_act(x)
    floor = torch.tensor(1e-4) * (1 / 448)
    assert (s[1] == floor).all() and s[2, 1] == floor and s[0, 0] == x[0, :128].abs().max() * (1 / 448)
    assert (_bits(q[1]) == 0).all() and (_bits(q[2, 128:256]) == 0).all()
    d = quant.dequantize(q, s)
    assert torch.isfinite(d).all() and (d[1] == 0).all() and (d[2, 128:256] == 0).all()
    w = torch.randn(2, 256, 256)
    w[1, 128:, :128] = 0
    wq, ws = quant.quantize_weight(w)
    assert ws[1, 1, 0] == floor and (quant.dequantize(wq, ws)[1, 128:, :128] == 0).all()


# -- the kernel weight layout ---------------------------------------------------------------
def test_w1_is_quantized_in_gate_and_up_blocks_then_interleaved():
    """w1's scale blocks are 128 x 128 blocks of its gate rows and of its up rows (DeepSeek's and
    DeepGEMM's blocks), quantized before the interleave: the interleaved codes are the natural
    codes' rows reordered, bit for bit, and the kernel's w1_s row 2n / 2n + 1 is gate / up block n,
    L1 N tile n's two scales. Each interleaved row's scale (quant.w1_scale_rows) is its natural
    row's block scale, so dequantize_w1 is the natural dequantization interleaved."""
    g = torch.Generator().manual_seed(3)
    w1 = (torch.randn(2, 2 * I, H, generator=g) * torch.rand(2, 2 * I, 1, generator=g)).bfloat16()
    w2 = torch.randn(2, H, I, generator=g).bfloat16()
    w1_q, w1_s, w2_q, w2_s = quant.quantize_weights(w1, w2)
    assert w1_s.shape == (2, 2 * I // 128, H // 128) and w2_s.shape == (2, H // 128, I // 128)
    q_nat, s_nat = quant.quantize_weight(w1)
    nb = I // 128
    assert torch.equal(_bits(w1_q), _bits(transform_weights(q_nat, w2_q)[0]))
    assert torch.equal(w1_s[:, 0::2], s_nat[:, :nb]) and torch.equal(w1_s[:, 1::2], s_nat[:, nb:])
    for n in (0, nb - 1):  # gate block n from the gate rows' amax, up block n from the up rows'
        gate = w1.float()[:, 128 * n:128 * n + 128].view(2, 128, H // 128, 128)
        up = w1.float()[:, I + 128 * n:I + 128 * n + 128].view(2, 128, H // 128, 128)
        assert torch.equal(w1_s[:, 2 * n], gate.abs().amax(dim=(1, 3)) * (1 / 448))
        assert torch.equal(w1_s[:, 2 * n + 1], up.abs().amax(dim=(1, 3)) * (1 / 448))
    assert not torch.equal(w1_s[:, 0::2], w1_s[:, 1::2])  # the test's gate and up scales differ
    rows = quant.w1_scale_rows(w1_s)  # [2, 2I, H/128]
    assert torch.equal(untransform_w1(rows), s_nat.repeat_interleave(128, dim=1))
    assert torch.equal(untransform_w1(quant.dequantize_w1(w1_q, w1_s)), quant.dequantize(q_nat, s_nat))
    assert torch.equal(_bits(w2_q), _bits(quant.quantize_weight(w2)[0])) and torch.equal(w2_s, quant.quantize_weight(w2)[1])


def test_from_deepgemm_layout_is_bit_for_bit():
    """DeepGEMM / DeepSeek layout (w1 blocks over gate | up rows) -> kernel layout: the codes'
    rows interleaved and the scales reordered, nothing requantized (the layer's weights dequantize
    to the checkpoint's values exactly); w2 passes through; the layer takes them as they are."""
    g = torch.Generator().manual_seed(4)
    w1 = (torch.randn(2, 2 * I, H, generator=g) * torch.rand(2, 2 * I, 1, generator=g)).bfloat16()
    w2 = torch.randn(2, H, I, generator=g).bfloat16()
    q_nat, s_nat = quant.quantize_weight(w1)  # DeepGEMM's per_block_cast_to_fp8 of w13
    w2_q, w2_s = quant.quantize_weight(w2)
    c1_q, c1_s, c2_q, c2_s = quant.from_deepgemm_layout(q_nat, s_nat, w2_q, w2_s)
    assert torch.equal(_bits(untransform_w1(c1_q)), _bits(q_nat))
    assert torch.equal(untransform_w1(quant.dequantize_w1(c1_q, c1_s)), quant.dequantize(q_nat, s_nat))
    assert sorted(c1_s.flatten().tolist()) == sorted(s_nat.flatten().tolist())
    assert torch.equal(_bits(c2_q), _bits(w2_q)) and torch.equal(c2_s, w2_s)
    with pytest.raises(ValueError, match="128x128 blocks"):
        quant.from_deepgemm_layout(q_nat, s_nat[:, 1:], w2_q, w2_s)
    # the layer takes the converted weights as they are, and they are load_weights' own
    w1, w2, xs, idx, w = _problem(2, [20, 9], seed=4)
    conv = quant.from_deepgemm_layout(*quant.quantize_weight(w1), *quant.quantize_weight(w2))
    assert all(torch.equal(a.view(torch.uint8) if a.dtype == quant.E4M3 else a,
                           b.view(torch.uint8) if b.dtype == quant.E4M3 else b)
               for a, b in zip(conv, quant.quantize_weights(w1, w2)))
    moe = _layer(2)
    moe.load_quantized_weights(*conv)
    for y, ref in zip(moe.forward(xs, idx, w), reference_moe_w8a8(xs, idx, w, *conv)):
        assert torch.equal(y, ref)


# -- the emulation against float32 ----------------------------------------------------------
@pytest.mark.parametrize("seed,kind", [(0, "balanced"), (1, "skewed")])
def test_emulation_error_against_fp32_is_the_recipes(seed, kind):
    """||y - ref|| / ||ref|| within the derived band W8A8_FP32_REL_ERROR = [0.044, 0.088]
    (reference.py: E4M3's 2^-4 relative rounding, x and w1 counted twice through SwiGLU); no
    element off by more than 2 x the upper bound of the output's largest value; the bf16 path's
    error is far smaller (the band is the quantization's, not the data flow's)."""
    P, tokens = 2, [96, 64]
    w1, w2, xs, idx, w = _problem(P, tokens, kind=kind, seed=seed)
    refs = reference_moe_fp32(xs, idx, w, w1, w2)
    ys = reference_moe_w8a8(xs, idx, w, *quant.quantize_weights(w1, w2))
    lo, hi = W8A8_FP32_REL_ERROR
    assert lo < relative_error(ys, refs) == w8a8_quantization_error(xs, idx, w, w1, w2) < hi
    for y, ref in zip(ys, refs):
        assert y.dtype == torch.bfloat16 and (y.float() - ref).abs().max() <= 2 * hi * ref.abs().max()
    bf16 = _layer(P, config=MegaMoEConfig())
    bf16.load_weights(w1, w2)
    assert relative_error(bf16.forward(xs, idx, w), refs) < lo / 4


def test_a_wrong_rounding_point_is_caught_by_the_emulation_not_by_fp32(monkeypatch):
    """h not quantized before Linear-2: still inside the fp32 band (the fp32 comparison cannot
    tell: ~0.060 against ~0.064), but more than twice W8A8_KERNEL_REL_ERROR away from the
    emulation (~0.023), while the kernel's expected deviation -- every promoted GEMM result
    perturbed by 2^-13 relative, Hopper's ~14-bit FP8 accumulation -- stays inside it (~0.004)."""
    w1, w2, xs, idx, w = _problem(2, [96, 64], seed=5)
    wq = quant.quantize_weights(w1, w2)
    refs = reference_moe_fp32(xs, idx, w, w1, w2)
    emu = reference_moe_w8a8(xs, idx, w, *wq)
    quantize_act = quant.quantize_act
    with monkeypatch.context() as m:  # x (bf16) is quantized, h (fp32) reaches L2 unrounded
        m.setattr(quant, "quantize_act", lambda t: quantize_act(t) if t.dtype == torch.bfloat16 else (
            t, torch.ones(t.shape[0], t.shape[1] // 128)))
        no_h = reference_moe_w8a8(xs, idx, w, *wq)
    lo, hi = W8A8_FP32_REL_ERROR
    assert lo < relative_error(no_h, refs) < hi
    assert relative_error(no_h, emu) > 2 * W8A8_KERNEL_REL_ERROR
    g = torch.Generator().manual_seed(0)
    exact = reference.blockwise_scaled_mm
    with monkeypatch.context() as m:
        m.setattr(reference, "blockwise_scaled_mm", lambda *a: (lambda o: o * (
            1 + 2 ** -13 * torch.randn(o.shape, generator=g)))(exact(*a)))
        noisy = reference_moe_w8a8(xs, idx, w, *wq)
    assert 0 < relative_error(noisy, emu) < W8A8_KERNEL_REL_ERROR


# -- the torch backend's W8A8 data flow -----------------------------------------------------
@pytest.mark.parametrize("P,tokens,kind,mask", [
    (1, [70], "balanced", 0.0),
    (2, [33, 0], "skewed", 0.0),
    (2, [5, 3], "balanced", 0.3),
    (4, [65, 1, 17, 128], "balanced", 0.25),
    (4, [40, 40, 40, 40], "skewed", 0.0),
])
def test_torch_backend_w8a8_is_the_emulation_bit_for_bit(P, tokens, kind, mask):
    """Dispatch of E4M3 rows + scales, the recipe per local expert, BF16 Combine into the slots
    and the top-k reduction give exactly reference_moe_w8a8's y (with masked picks, an expert with
    no tokens, a token with every pick masked; without any masked pick; a rank with no tokens):
    every row is computed on its own
    with the same FP32 operations (the block dots are exact), whichever rank and batch it lands
    in, and both reduce the same BF16 slots with weighted_combine. Also with E4M3 x + scales given,
    with the weights loaded pre-quantized, and on a second call (buffer reuse, poisoned slots)."""
    w1, w2, xs, idx, w = _problem(P, tokens, kind=kind, mask=mask, seed=P)
    if mask:  # no masked pick otherwise: the reduction's unmasked path
        idx = [torch.where(i == 3, -1, i) for i in idx]  # expert 3 (on rank 0) gets no tokens
        idx[-1][0] = -1  # a token with every pick masked
        assert expert_load(torch.cat(idx), E)[3] == 0
    wq = quant.quantize_weights(w1, w2)
    want = reference_moe_w8a8(xs, idx, w, *wq)
    moe = _layer(P)
    moe.load_weights(w1, w2)
    assert all(torch.equal(_bits(moe.w1[r]), _bits(wq[0][r * E // P:(r + 1) * E // P])) for r in range(P))
    x_in = [quant.quantize_act(x) for x in xs]
    for ys in (moe.forward(xs, idx, w), moe.forward([q for q, _ in x_in], idx, w, x_scales=[s for _, s in x_in])):
        for y, ref, x in zip(ys, want, xs):
            assert y.dtype == torch.bfloat16 and y.shape == x.shape and torch.equal(y, ref)
    pre = _layer(P)
    pre.load_quantized_weights(*wq)
    assert all(torch.equal(y, ref) for y, ref in zip(pre.forward(xs, idx, w), want))


# -- configuration and errors ---------------------------------------------------------------
def test_w8a8_errors_before_any_launch():
    world = make_world("loopback", world_size=2, device="cpu")

    def layer(hidden=H, inter=I, **kw):
        return MegaMoE(world, num_experts=E, hidden=hidden, intermediate=inter, topk=2, max_tokens_per_rank=8, **kw)
    bulk = layer(config=MegaMoEConfig(precision="w8a8", dispatch_copy="bulk", stages=3), backend="fused")
    assert bulk.config.dispatch_copy == "bulk"  # the kernel's checks pass: W8A8 dispatches in bulk too
    with pytest.raises(ValueError, match="precision must be one of"):
        MegaMoEConfig(precision="fp8")
    with pytest.raises(ValueError, match="multiples of 128"):
        layer(hidden=576, inter=192, config=W8A8)
    with pytest.raises(ValueError, match="block_n=256"):
        layer(hidden=256, inter=128, config=W8A8)  # tiles 128 wide only
    with pytest.raises(ValueError, match="block_n=256"):
        layer(config=MegaMoEConfig(precision="w8a8", block_n=128))
    assert layer(hidden=256, inter=128).config.block_n == 128  # bf16 unchanged
    moe = layer(config=W8A8)
    assert moe.config.precision == "w8a8" and moe.config.block_n == 256
    assert moe.config.kernel_key().precision == "w8a8"
    assert moe.buffer.x.dtype == quant.E4M3 and moe.buffer.x_scales.shape == (8, H // 128)
    w1, w2, xs, idx, w = _problem(2, [4, 4], k=2)
    with pytest.raises(ValueError, match="weights must be torch.bfloat16"):
        moe.load_weights(w1.float(), w2.float())
    with pytest.raises(ValueError, match="needs MegaMoEConfig"):
        layer().load_quantized_weights(*quant.quantize_weights(w1, w2))
    wq = quant.quantize_weights(w1, w2)
    with pytest.raises(ValueError, match="float32 scales"):
        moe.load_quantized_weights(wq[0], wq[1][:, :1], wq[2], wq[3])
    with pytest.raises(ValueError, match="weights must be torch.float8_e4m3fn"):
        moe.load_quantized_weights(w1, wq[1], w2, wq[3])
    moe.load_weights(w1, w2)
    x_q = [quant.quantize_act(x) for x in xs]
    with pytest.raises(ValueError, match="E4M3 x comes with x_scales"):
        moe.forward([q for q, _ in x_q], idx, w)
    with pytest.raises(ValueError, match="x_scales must be float32"):
        moe.forward([q for q, _ in x_q], idx, w, x_scales=[s[:, :1] for _, s in x_q])
    with pytest.raises(ValueError, match="x must be torch.float8_e4m3fn"):
        moe.forward(xs, idx, w, x_scales=[s for _, s in x_q])
    bf16 = layer()
    bf16.load_weights(w1, w2)
    with pytest.raises(ValueError, match="x_scales"):
        bf16.forward(xs, idx, w, x_scales=[s for _, s in x_q])


def test_constructor_stays_at_ten_parameters():
    """precision is a MegaMoEConfig field: MegaMoE's constructor keeps <= 10 parameters."""
    assert len(inspect.signature(MegaMoE.__init__).parameters) - 1 <= 10


def test_activation_scales_multiply_by_the_float32_reciprocal_of_448():
    """The recipe's scale is max(amax, 1e-4) times fl32(1/448), as torch evaluates ``/ 448`` on a
    GPU, on every device (the GPU staging kernel matches it bit for bit); for some amax that differs
    from the correctly rounded quotient."""
    import struct

    def f32(v):
        return struct.unpack("f", struct.pack("f", v))[0]

    amaxes = torch.tensor([1.0 + i / 64 for i in range(256)], dtype=torch.float32)
    x = torch.zeros(amaxes.numel(), 128)
    x[:, 0] = amaxes
    _, s = quant.quantize_act(x.bfloat16())
    inv448 = f32(1.0 / 448.0)
    bf = x[:, 0].bfloat16().float().tolist()
    assert s[:, 0].tolist() == [f32(f32(a) * inv448) for a in bf]
    assert any(f32(a * inv448) != f32(a / 448.0) for a in bf)
