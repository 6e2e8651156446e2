"""The W4A8 widening (megamoe_interleave.fp4_widen) in a test kernel of its own: one thread per word
of eight nibbles. CPU: its algorithm emulated instruction by instruction against the recipe, and its
PTX (the instructions a widened word costs); GPU: the recipe's bits."""
import re

import pytest
import torch

from megamoe_interleave import quant_fp4

THREADS = 128


def _widen_kernel():
    import cutlass.cute as cute
    from cutlass import Int32

    from megamoe_interleave.fp4_widen import group_table, shift_factor, widen_e2m1x8

    class WidenWords:
        """``mCodes`` [W] int32 (8 nibbles each), ``mShift`` [W] int32 (its d) -> ``mOut`` [W, 2] int32."""

        @cute.jit
        def __call__(self, mCodes: cute.Tensor, mShift: cute.Tensor, mOut: cute.Tensor, stream):
            n = cute.size(mCodes, mode=[0])
            self.kernel(mCodes, mShift, mOut).launch(grid=[(n + THREADS - 1) // THREADS, 1, 1],
                                                     block=[THREADS, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, mCodes: cute.Tensor, mShift: cute.Tensor, mOut: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            i = Int32(bidx) * THREADS + Int32(tidx)
            if i < cute.size(mCodes, mode=[0]):
                lo, hi = widen_e2m1x8(mCodes[i], group_table(shift_factor(mShift[i])))
                mOut[i, 0] = lo
                mOut[i, 1] = hi

    return WidenWords()


def _compile(**kw):
    import cutlass.cute as cute
    from cutlass import Int32

    from xstage.cute_compile import compile_hopper, fake_stream, fake_tensor

    W = cute.sym_int()
    return compile_hopper(_widen_kernel(), fake_tensor(Int32, (W,), stride=(1,)), fake_tensor(Int32, (W,), stride=(1,)),
                          fake_tensor(Int32, (W, 2), stride=(2, 1)), fake_stream(), **kw)


@pytest.mark.compile
def test_widening_is_a_table_per_group_and_nine_instructions_per_word(tmp_path):
    """Per group: 4 mul.rn.f16x2 and 2 cvt.rn.satfinite.e4m3x2.f16x2 pairs (the table); per word of 8
    weights: 4 prmt (2 lookups, 2 sign gathers), no FP32 arithmetic and no local memory."""
    ptx = _compile(keep_ptx=True).ptx
    body = ptx[ptx.index(".entry"):]
    assert body.count("mul.rn.f16x2") == 4 and body.count("cvt.rn.satfinite.e4m3x2.f16x2") == 4
    assert body.count("prmt.b32") == 4
    assert not re.search(r"\b(mul|fma|add)\.(rn\.)?f32\b", body) and ".local" not in body


def _prmt(a: int, b: int, sel: int) -> int:
    """prmt.b32 (default mode) on Python ints."""
    src = (a & 0xFFFFFFFF) | ((b & 0xFFFFFFFF) << 32)
    out = 0
    for i in range(4):
        n = (sel >> (4 * i)) & 0xF
        byte = (src >> (8 * (n & 7))) & 0xFF
        out |= (0xFF if n & 8 and byte & 0x80 else (0 if n & 8 else byte)) << (8 * i)
    return out


def _widen_as_the_device(word: int, d: int):
    """fp4_widen's instructions on the CPU: FP16 products (exact in float16), E4M3 conversions
    (torch's round to nearest even), prmt and the sign OR; (lo, hi) as unsigned words."""
    import struct

    from megamoe_interleave.fp4_widen import E2M1_F16X2, SIGN_BYTES, shift_factor

    def halves(w):
        return torch.tensor(struct.unpack("<ee", struct.pack("<I", w & 0xFFFFFFFF)), dtype=torch.float16)

    f = halves(shift_factor(d))
    pairs = [halves(c) * f for c in E2M1_F16X2]  # exact: the emulated mul.rn.f16x2
    table = torch.cat(pairs).to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    t_lo, t_hi = (int.from_bytes(bytes(table[i:i + 4]), "little") for i in (0, 4))
    mags = word & 0x77777777
    c4 = (word << 4) & 0xFFFFFFFF
    sign = SIGN_BYTES & 0xFFFFFFFF
    return (_prmt(t_lo, t_hi, mags & 0xFFFF) | (_prmt(c4, word, 0x5140) & sign),
            _prmt(t_lo, t_hi, mags >> 16) | (_prmt(c4, word, 0x7362) & sign))


def test_the_table_widening_is_the_recipe_for_every_nibble_and_shift():
    """Every nibble value in every position, every shift from MIN_SHIFT to 6 (exact, rounding and
    all-zero groups): the device algorithm's bytes are e4m3(E2M1 value * 2^d), signed zeros included."""
    from megamoe_interleave.fp4_widen import MIN_SHIFT

    g = torch.Generator().manual_seed(2)
    words = [0x76543210, 0xFEDCBA98, 0x89ABCDEF, 0x01234567, 0x80808080, 0x0F0F0F0F]
    words += torch.randint(0, 2 ** 32, (24,), generator=g, dtype=torch.int64).tolist()
    for d in range(MIN_SHIFT, quant_fp4.WIDEN_MAX_SHIFT + 1):
        for word in words:
            lo, hi = _widen_as_the_device(word, d)
            nibbles = torch.tensor([(word >> (4 * i)) & 0xF for i in range(8)], dtype=torch.uint8)
            want = _emulate(nibbles, torch.full((8,), d))
            assert list((lo | (hi << 32)).to_bytes(8, "little")) == want.tolist(), (hex(word), d)


def _emulate(codes_u8, d):
    """The recipe: e4m3(E2M1 value * 2^d), per nibble (codes_u8: one nibble per byte)."""
    return (quant_fp4.e2m1_values(codes_u8) * torch.exp2(d.float())).to(torch.float8_e4m3fn).view(torch.uint8)


def test_emulation_is_the_recipes_widen():
    """_emulate with a block's shifts is quant_fp4.widen's E4M3 (the GPU test below compares with it)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(128, 128, generator=g) * torch.logspace(-6, 6, 4).repeat_interleave(32)[None, :]
    packed, sf = quant_fp4.quantize_weight(w)
    q, _ = quant_fp4.widen(packed, sf)
    d, _ = quant_fp4._block_shift(sf)
    got = _emulate(quant_fp4.unpack(packed), d.repeat_interleave(quant_fp4.SCALE_GROUP, dim=-1))
    assert torch.equal(got, q.view(torch.uint8))


@pytest.mark.gpu
def test_the_device_widening_gives_the_recipes_bits():
    """Every nibble value at every shift from -20 to 6 (exact and rounding ones), into poisoned
    outputs: the kernel's bytes equal the recipe's."""
    from megamoe_interleave.fp4_widen import MIN_SHIFT
    from xstage.cute_compile import cached

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper (sm_90) GPU")
    g = torch.Generator().manual_seed(1)
    words = 4096
    nibbles = torch.randint(0, 16, (words, 8), generator=g, dtype=torch.int32)
    nibbles[:2] = torch.arange(16, dtype=torch.int32).view(2, 8)  # every nibble value
    d = torch.randint(MIN_SHIFT, quant_fp4.WIDEN_MAX_SHIFT + 1, (words,), generator=g, dtype=torch.int32)
    codes = quant_fp4.pack(nibbles.to(torch.uint8)).view(torch.int32).view(words)  # nibble i at bits 4i
    out = torch.full((words, 2), -1, dtype=torch.int32, device="cuda")
    fn = cached(("WidenWords-test",), lambda: _compile().fn)
    fn(codes.cuda(), d.cuda(), out)
    want = _emulate(nibbles.to(torch.uint8), d[:, None].expand(-1, 8))
    assert torch.equal(out.cpu().view(torch.uint8).view(words, 8), want)
