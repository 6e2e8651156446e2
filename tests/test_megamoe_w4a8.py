"""W4A8 (FP4 experts, FP8 activations): the storage format, the exact widening to the W8A8 weight
format, the checkpoint conversion, the references and the torch backend. CPU only."""
import pytest
import torch

from megamoe_interleave import MegaMoE, MegaMoEConfig, make_world, quant_fp4
from megamoe_interleave.reference import (W4A8_FP32_REL_ERROR, reference_moe_fp32, reference_moe_w4a8,
                                          relative_error)
from lab.megamoe.routing import make_routing
from megamoe_interleave.weights import interleave_w1, untransform_w1


def test_e2m1_codes_round_to_the_nearest_value_ties_to_the_smaller():
    x = torch.tensor([0.0, 0.25, 0.26, 0.75, 0.76, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 9.0, -0.2, -0.3, -6.0])
    want = [0.0, 0.0, 0.5, 0.5, 1.0, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 6.0, 0.0, -0.5, -6.0]
    assert quant_fp4.e2m1_values(quant_fp4.e2m1_codes(x)).tolist() == want
    assert quant_fp4.e2m1_codes(torch.tensor([-0.1]))[0] == 0  # -0 is +0, as DeepGEMM's
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(quant_fp4.e2m1_codes(quant_fp4.e2m1_values(codes))[codes != 8], codes[codes != 8])


def test_packing_puts_the_even_index_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 3, 15]], dtype=torch.uint8)
    packed = quant_fp4.pack(codes)
    assert packed.tolist() == [[0x21, 0xF3]]
    assert torch.equal(quant_fp4.unpack(packed), codes)
    assert torch.equal(quant_fp4.unpack(packed.view(torch.int8)), codes)


def test_quantize_weight_scale_is_amax_over_6_rounded_up_to_a_power_of_two():
    w = torch.randn(128, 256) * torch.logspace(-3, 1, 128)[:, None]
    packed, sf = quant_fp4.quantize_weight(w)
    assert packed.shape == (128, 128) and sf.shape == (128, 8) and sf.dtype == torch.uint8
    amax = w.reshape(128, 8, 32).abs().amax(-1)
    e = quant_fp4.group_exponents(sf).double()
    assert torch.all(2 ** e >= amax / 6) and torch.all(2 ** (e - 1) < amax / 6)
    deq = quant_fp4.dequantize(packed, sf)
    # every element within half an E2M1 step (the largest, 2 x 2^e, between 4 and 6) of its group
    assert torch.all((deq - w).abs() <= 2 ** quant_fp4.group_exponents(sf).float().repeat_interleave(32, -1))


def _fp4_weight(exponents: torch.Tensor, seed: int = 0):
    """FP32 weights [N, K] of random E2M1 values whose groups of 32 hold a +-6 (so the quantizer's
    scale is exactly 2^exponents[n, g]), with those exponents."""
    g = torch.Generator().manual_seed(seed)
    n, groups = exponents.shape
    codes = torch.randint(0, 16, (n, groups * 32), generator=g, dtype=torch.uint8)
    codes[:, ::32] = 7 | (codes[:, ::32] & 8)
    sf = (exponents + quant_fp4.UE8M0_BIAS).to(torch.uint8)
    return quant_fp4.dequantize(quant_fp4.pack(codes), sf), quant_fp4.pack(codes), sf


def test_fp4_values_quantize_to_themselves():
    w, packed, sf = _fp4_weight(torch.randint(-10, 10, (128, 8)))
    got_p, got_sf = quant_fp4.quantize_weight(w)
    assert torch.equal(got_sf, sf) and torch.equal(quant_fp4.dequantize(got_p, got_sf), w)


def test_widening_is_exact_when_a_block_spans_at_most_14_exponents():
    # one 128 x 128 block's groups span exponents 0 .. 14, the other block's 0 .. 15
    spread = torch.zeros(128, 8, dtype=torch.int32)
    spread[:, :4] = torch.linspace(0, 14, 512).round().reshape(128, 4).int()
    spread[:, 4:] = torch.linspace(0, 15, 512).round().reshape(128, 4).int()
    w, packed, sf = _fp4_weight(spread, seed=3)
    q, s = quant_fp4.widen(packed, sf)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (1, 2)
    assert s.tolist() == [[2.0 ** (14 - 6), 2.0 ** (15 - 6)]]
    wide = q.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert torch.equal(wide[:, :128], w[:, :128])
    # the 15-wide block: its exponent-0 groups (shift -9) are the only inexact ones
    assert quant_fp4.inexact_groups(sf) == int((spread[:, 4:] == 0).sum()) > 0
    exact = (spread[:, 4:] > 0).repeat_interleave(32, -1)
    assert torch.equal(wide[:, 128:][exact], w[:, 128:][exact])
    assert not torch.equal(wide[:, 128:], w[:, 128:])


def test_the_widening_in_fp16_that_the_kernel_plans_equals_the_recipe():
    """docs/w4a8.md's device widening, emulated: a nibble's magnitude bits shifted into an FP16's
    exponent and mantissa (``(code & 7) << 9``, sign ``(code & 8) << 12``) are the E2M1 value times
    2^-14 (subnormals included), so two exact FP16 multiplies by 2^7 and 2^(7 + d) and one
    round-to-nearest-even conversion to E4M3 give the recipe's ``e4m3(value * 2^d)`` bit for bit,
    for every nibble and every shift the recipe meets (the inexact ones below -8 included)."""
    codes = torch.arange(16, dtype=torch.int32)
    for d in range(-20, quant_fp4.WIDEN_MAX_SHIFT + 1):
        bits = ((codes & 7) << 9) | ((codes & 8) << 12)
        h = bits.to(torch.int16).view(torch.float16)
        assert torch.equal(h.float() * 2.0 ** 14, quant_fp4.e2m1_values(codes.to(torch.uint8)))
        v = h * torch.tensor(2.0 ** 7, dtype=torch.float16) * torch.tensor(2.0 ** (7 + d), dtype=torch.float16)
        want = (quant_fp4.e2m1_values(codes.to(torch.uint8)) * 2.0 ** d).to(torch.float8_e4m3fn)
        assert torch.equal(v.to(torch.float8_e4m3fn).view(torch.uint8), want.view(torch.uint8)), d


def _widen_as_the_kernel(codes: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """The fused kernel's widening of ``codes`` [N, K/2] (signs braided) with its shift words [K/128, N],
    emulated as fp4_widen does it: a row's group g takes byte g of its K block's word, sign-extended, as the factor
    2^(7 + d) of two FP16 multiplies, then round-to-nearest-even to E4M3 (uint8 [N, K])."""
    n = codes.shape[0]
    nib = quant_fp4.unpack(codes).to(torch.int32)
    # braided signs: byte j < 4 of a word's output takes bit 3 of nibble 2 j + 1, byte 4 + j that of nibble 2 j
    per_word = nib.reshape(n, -1, 8)
    signs = torch.cat([per_word[..., 1::2], per_word[..., 0::2]], dim=-1).reshape(n, -1) & 8
    w = words.t().contiguous()  # [N, K/128]
    d = torch.stack([(w << (24 - 8 * g)) >> 24 for g in range(4)], dim=-1).reshape(n, -1)  # [N, K/32]
    h = (((nib & 7) << 9) | (signs << 12)).to(torch.int16).view(torch.float16)
    f = torch.exp2((7 + d).float()).to(torch.float16).repeat_interleave(quant_fp4.SCALE_GROUP, dim=-1)
    return (h * torch.tensor(2.0 ** 7, dtype=torch.float16) * f).to(torch.float8_e4m3fn).view(torch.uint8)


def test_kernel_operands_widen_to_the_recipe_bit_for_bit():
    """quant_fp4.kernel_operands (codes, block scales, shift words), widened as the fused kernel
    does it, is widen_weights' W8A8 operands bit for bit, w1's interleaved rows included, with block
    spreads past the exact 14 (rounded groups) and past the clamp at -20 (zeros)."""
    g = torch.Generator().manual_seed(5)
    E, H, inter = 2, 256, 256
    def spread(lo, hi, shape):  # a power of two per 32-group
        return torch.exp2(torch.randint(lo, hi, shape, generator=g).float()).repeat_interleave(32, -1)

    w1 = torch.randn(E, 2 * inter, H, generator=g) * spread(-24, 14, (E, 2 * inter, H // 32))
    w2 = torch.randn(E, H, inter, generator=g) * spread(-12, 4, (E, H, inter // 32))
    fp4 = quant_fp4.quantize_weights(w1, w2)
    d1, _ = quant_fp4._block_shift(untransform_w1(fp4[1]))
    assert quant_fp4.inexact_groups(fp4[1]) > 0 and int(d1.min()) < -20
    w1_q, w1_s, w2_q, w2_s = quant_fp4.widen_weights(*fp4)
    c1, s1, sh1, c2, s2, sh2 = quant_fp4.kernel_operands(*fp4)
    assert sh1.shape == (E, H // 128, 2 * inter) and sh2.shape == (E, inter // 128, H) and sh1.dtype == torch.int32
    assert torch.equal(quant_fp4.unbraid_signs(c1), fp4[0]) and torch.equal(quant_fp4.unbraid_signs(c2), fp4[2])
    assert not torch.equal(c1, fp4[0]) and torch.equal(s1, w1_s) and torch.equal(s2, w2_s)
    for e in range(E):
        assert torch.equal(_widen_as_the_kernel(c1[e], sh1[e]), w1_q[e].view(torch.uint8))
        assert torch.equal(_widen_as_the_kernel(c2[e], sh2[e]), w2_q[e].view(torch.uint8))


def test_deepgemm_layout_converts_bit_for_bit():
    """DeepGEMM's per_token_cast_to_fp4 layout (gate | up rows, int8 codes; scales as FP32 powers of
    two or four UE8M0 bytes per int32) -> the kernel layout, equal to quantizing in it."""
    g = torch.Generator().manual_seed(1)
    E, H, inter = 2, 256, 128
    w1, w2 = torch.randn(E, 2 * inter, H, generator=g), torch.randn(E, H, inter, generator=g)
    want = quant_fp4.quantize_weights(w1, w2)
    p1, b1 = quant_fp4.quantize_weight(w1)
    p2, b2 = quant_fp4.quantize_weight(w2)
    as_fp32 = lambda b: (b.to(torch.int32) << 23).view(torch.float32)  # noqa: E731
    as_int32 = lambda b: b.contiguous().view(torch.int32)  # noqa: E731
    for conv in (as_fp32, as_int32):
        got = quant_fp4.from_deepgemm_layout(p1.view(torch.int8), conv(b1), p2.view(torch.int8), conv(b2))
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(want[0], interleave_w1(p1)) and torch.equal(want[1], interleave_w1(b1))
    with pytest.raises(ValueError, match="powers of two"):
        quant_fp4.from_deepgemm_layout(p1, as_fp32(b1) * 1.5, p2, as_fp32(b2))


def _problem(P=2, E=8, H=512, inter=256, k=2, tokens=(40, 0), seed=0):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(E, 2 * inter, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, inter, generator=g) / inter ** 0.5
    xs = [torch.randn(t, H, generator=g).bfloat16() for t in tokens]
    routes = [make_routing("balanced", t, E, k, seed=r, mask_ratio=0.1) for r, t in enumerate(tokens)]
    return w1.bfloat16(), w2.bfloat16(), xs, [r[0] for r in routes], [r[1] for r in routes]


def test_torch_backend_is_the_recipe_bit_for_bit_and_within_its_bound_of_fp32():
    P, E, H, inter, k = 2, 8, 512, 256, 2
    w1, w2, xs, idx, wts = _problem(P, E, H, inter, k, tokens=(40, 25))
    moe = MegaMoE(make_world("loopback", world_size=P, device="cpu"), E, H, inter, k, 64,
                  MegaMoEConfig(precision="w4a8"), backend="torch")
    moe.load_weights(w1, w2)
    ys = moe(xs, idx, wts)
    fp4 = quant_fp4.quantize_weights(w1, w2)
    assert quant_fp4.inexact_groups(fp4[1]) == 0 and quant_fp4.inexact_groups(fp4[3]) == 0
    ref = reference_moe_w4a8(xs, idx, wts, *fp4)
    assert all(torch.equal(y, r) for y, r in zip(ys, ref))
    err = relative_error(ys, reference_moe_fp32(xs, idx, wts, *quant_fp4.dequantize_weights(*fp4)))
    assert W4A8_FP32_REL_ERROR[0] <= err <= W4A8_FP32_REL_ERROR[1], err  # measured ~0.043
    # the same weights through load_quantized_weights, bit for bit
    moe2 = MegaMoE(make_world("loopback", world_size=P, device="cpu"), E, H, inter, k, 64,
                   MegaMoEConfig(precision="w4a8"), backend="torch")
    moe2.load_quantized_weights(*fp4)
    assert all(torch.equal(moe2.w1[r], moe.w1[r]) and torch.equal(moe2.w1_scales[r], moe.w1_scales[r])
               for r in range(P))
    assert all(torch.equal(y, r) for y, r in zip(moe2(xs, idx, wts), ys))
    # README: a W8A8 layer on widen_weights' E4M3 weights computes the W4A8 recipe, bit for bit
    w8 = MegaMoE(make_world("loopback", world_size=P, device="cpu"), E, H, inter, k, 64,
                 MegaMoEConfig(precision="w8a8"), backend="torch")
    w8.load_quantized_weights(*quant_fp4.widen_weights(*fp4))
    assert all(torch.equal(y, r) for y, r in zip(w8(xs, idx, wts), ys))


def test_w4a8_misuse_fails_before_any_launch():
    world = make_world("loopback", world_size=1, device="cpu")
    with pytest.raises(ValueError, match="block_n=256"):
        MegaMoE(world, 8, 768, 384, 2, 16, MegaMoEConfig(precision="w4a8"), backend="fused", num_sms=132)
    with pytest.raises(ValueError, match="multiples of 128"):
        MegaMoE(world, 8, 192, 256, 2, 16, MegaMoEConfig(precision="w4a8"), backend="torch")
    moe = MegaMoE(world, 8, 512, 256, 2, 16, MegaMoEConfig(precision="w4a8"), backend="torch")
    with pytest.raises(ValueError, match="packed FP4 uint8"):
        moe.load_quantized_weights(torch.zeros(8, 512, 256), torch.zeros(8, 512, 16, dtype=torch.uint8),
                                   torch.zeros(8, 512, 128, dtype=torch.uint8), torch.zeros(8, 512, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scales"):
        moe.load_quantized_weights(torch.zeros(8, 512, 256, dtype=torch.uint8), torch.zeros(8, 512, 16),
                                   torch.zeros(8, 512, 128, dtype=torch.uint8), torch.zeros(8, 512, 8, dtype=torch.uint8))


def test_the_per_expert_functions_in_slices_give_the_same_bits(monkeypatch):
    """quantize_weight, dequantize and widen run in slices of experts (bounded temporaries at
    DeepSeek-V4-Flash size): with a slice of one expert, the same results as in one piece."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(5, 256, 256, generator=g)
    whole = quant_fp4.quantize_weight(w)
    deq, (q, s) = quant_fp4.dequantize(*whole), quant_fp4.widen(*whole)
    monkeypatch.setattr(quant_fp4, "CHUNK_ELEMENTS", 256 * 256)
    sliced = quant_fp4.quantize_weight(w)
    assert all(torch.equal(a, b) for a, b in zip(whole, sliced))
    assert torch.equal(quant_fp4.dequantize(*sliced), deq)
    q1, s1 = quant_fp4.widen(*sliced)
    assert torch.equal(q1.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s1, s)


def test_the_kernels_table_count_covers_every_shift():
    """One group table per shift the host writes (quant_fp4.shift_words clamps at MIN_SHIFT, the recipe's
    largest shift is WIDEN_MAX_SHIFT), and the shared-memory plan holds them."""
    from megamoe_interleave import config, fp4_widen

    assert fp4_widen.TABLES == config.WIDEN_TABLES == quant_fp4.WIDEN_MAX_SHIFT - fp4_widen.MIN_SHIFT + 1
    assert fp4_widen.MAX_SHIFT == quant_fp4.WIDEN_MAX_SHIFT


def test_braided_signs_move_only_signs_and_come_back():
    """quant_fp4.braid_signs: every nibble keeps its magnitude bits, the signs of a word land where
    SIGN_SOURCE says (weights 0-3 at bit 7 of the word's bytes, 4-7 at bit 3), and unbraid_signs undoes it."""
    g = torch.Generator().manual_seed(8)
    packed = torch.randint(0, 256, (3, 5, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    braided = quant_fp4.braid_signs(packed)
    nib, bnib = quant_fp4.unpack(packed).reshape(3, 5, -1, 8), quant_fp4.unpack(braided).reshape(3, 5, -1, 8)
    assert torch.equal(nib & 7, bnib & 7)
    for j, src in enumerate(quant_fp4.SIGN_SOURCE):
        assert torch.equal(bnib[..., j] & 8, nib[..., src] & 8)
    word = int.from_bytes(bytes(braided[0, 0, :4].tolist()), "little")
    for i in range(8):
        bit = 8 * i + 7 if i < 4 else 8 * (i - 4) + 3
        assert (word >> bit) & 1 == int(nib[0, 0, 0, i]) >> 3
    assert torch.equal(quant_fp4.unbraid_signs(braided), packed)
