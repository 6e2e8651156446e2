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
def test_widening_is_a_table_per_group_and_seven_instructions_per_word(tmp_path):
    """Per group: 4 mul.rn.f16x2 and 2 cvt.rn.satfinite.e4m3x2.f16x2 pairs (the table); per word of 8
    weights: 2 prmt (the lookups; the braided signs need a mask, no gather), no FP32 arithmetic and no
    local memory."""
    ptx = _compile(keep_ptx=True).ptx
    body = ptx[ptx.index(".entry"):]
    assert body.count("mul.rn.f16x2") == 4 and body.count("cvt.rn.satfinite.e4m3x2.f16x2") == 4
    assert body.count("prmt.b32") == 2
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


def _braided(word: int) -> int:
    """A word of eight nibbles (K order) with its signs braided as the kernel's codes are."""
    b = torch.tensor(list(word.to_bytes(4, "little")), dtype=torch.uint8)
    return int.from_bytes(bytes(quant_fp4.braid_signs(b).tolist()), "little")


def _braided_codes(packed: torch.Tensor) -> torch.Tensor:
    """quant_fp4.braid_signs of packed codes [..., K/2] as int32 words (nibble i at bits 4i)."""
    return quant_fp4.braid_signs(packed).contiguous()


def _widen_as_the_device(word: int, d: int):
    """fp4_widen's instructions on the CPU, on a braided word: FP16 products (exact in float16), E4M3
    conversions (torch's round to nearest even), prmt and the sign masks; (lo, hi) as unsigned words."""
    import struct

    from megamoe_interleave.fp4_widen import E2M1_F16X2, SIGN_BYTES, shift_factor

    def halves(w):
        return torch.tensor(struct.unpack("<ee", struct.pack("<I", w & 0xFFFFFFFF)), dtype=torch.float16)

    f = halves(shift_factor(d))
    pairs = [halves(c) * f for c in E2M1_F16X2]  # exact: the emulated mul.rn.f16x2
    table = torch.cat(pairs).to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    t_lo, t_hi = (int.from_bytes(bytes(table[i:i + 4]), "little") for i in (0, 4))
    mags = word & 0x77777777
    sign = SIGN_BYTES & 0xFFFFFFFF
    return (_prmt(t_lo, t_hi, mags & 0xFFFF) | (word & sign),
            _prmt(t_lo, t_hi, mags >> 16) | ((word << 4) & sign))


def test_the_table_widening_is_the_recipe_for_every_nibble_and_shift():
    """Every nibble value in every position, every shift from MIN_SHIFT to 6 (exact, rounding and
    all-zero groups): the device algorithm's bytes are e4m3(E2M1 value * 2^d), signed zeros included."""
    from megamoe_interleave.fp4_widen import MIN_SHIFT

    g = torch.Generator().manual_seed(2)
    words = [0x76543210, 0xFEDCBA98, 0x89ABCDEF, 0x01234567, 0x80808080, 0x0F0F0F0F]
    words += torch.randint(0, 2 ** 32, (24,), generator=g, dtype=torch.int64).tolist()
    for d in range(MIN_SHIFT, quant_fp4.WIDEN_MAX_SHIFT + 1):
        for word in words:
            lo, hi = _widen_as_the_device(_braided(word), d)
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
    codes = _braided_codes(quant_fp4.pack(nibbles.to(torch.uint8))).view(torch.int32).view(words)  # nibble i at 4i
    out = torch.full((words, 2), -1, dtype=torch.int32, device="cuda")
    fn = cached(("WidenWords-test",), lambda: _compile().fn)
    fn(codes.cuda(), d.cuda(), out)
    want = _emulate(nibbles.to(torch.uint8), d[:, None].expand(-1, 8))
    assert torch.equal(out.cpu().view(torch.uint8).view(words, 8), want)


def _stage_kernel():
    """MegaMoESm90W4A8.widen_stage in a kernel of its own (256 threads, one CTA, the group tables built by its
    precision_prologue): codes [256, 64] uint8 and shift words [256] int32 are written into the kernel's packed-stage and shift layouts through cute's
    own (swizzled) indexing, widened into block ``buf`` of the widened layout by the kernel's code (its
    hand-made swizzled addresses), and read back through cute's indexing: [256, 128] E4M3 bytes."""
    import dataclasses

    import cutlass
    import cutlass.cute as cute
    from cutlass import Float8E4M3FN, Int32, Int64, Uint8
    from cutlass.utils import LayoutEnum
    from quack import sm90_utils

    from megamoe_interleave.config import MegaMoEConfig
    from megamoe_interleave.fp4_widen import TABLES
    from megamoe_interleave.shapes import get_shape
    from megamoe_interleave.sm90_fp4 import MegaMoESm90W4A8

    shape = get_shape("deepseek-v4-flash")
    fp4 = MegaMoESm90W4A8(shape.hidden, shape.intermediate,
                          MegaMoEConfig(precision="w4a8").resolve(shape, 1, 512, 132))

    @dataclasses.dataclass(frozen=True)
    class Views:
        sB: object
        sW: object
        shifts: object
        tables: object

    class WidenStage:
        @cute.jit
        def __call__(self, mCodes: cute.Tensor, mShift: cute.Tensor, mOut: cute.Tensor, buf: Int32, stream):
            self.kernel(mCodes, mShift, mOut, buf).launch(grid=[1, 1, 1], block=[256, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, mCodes: cute.Tensor, mShift: cute.Tensor, mOut: cute.Tensor, buf: Int32):
            tidx, _, _ = cute.arch.thread_idx()
            t = Int32(tidx)
            packed = sm90_utils.make_smem_layout(Uint8, LayoutEnum.ROW_MAJOR, (256, 64), stage=fp4.stages)
            wide = sm90_utils.make_smem_layout(Float8E4M3FN, LayoutEnum.ROW_MAJOR, (256, 128), stage=2)

            @cute.struct
            class Storage:
                sB: cute.struct.Align[cute.struct.MemRange[Uint8, cute.cosize(packed)], 1024]
                sW: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(wide)], 1024]
                shifts: cute.struct.Align[cute.struct.MemRange[Int32, 256 * fp4.stages], 128]
                tables: cute.struct.Align[cute.struct.MemRange[Int64, TABLES], 8]

            st = cutlass.utils.SmemAllocator().allocate(Storage)
            views = Views(st.sB.get_tensor(packed.outer, swizzle=packed.inner),
                          st.sW.get_tensor(wide.outer, swizzle=wide.inner), st.shifts.get_tensor(fp4.shift_layout()),
                          st.tables.get_tensor(cute.make_layout(TABLES)))
            fp4.precision_prologue(views, t)  # the group tables, as the kernel builds them
            stage = fp4.stages - 1  # the last ring stage: its offset counts too
            for j in cutlass.range_constexpr(64):
                views.sB[t, j, stage] = mCodes[t, j]
            views.shifts[0, t, stage] = mShift[t]
            cute.arch.sync_threads()
            fp4.widen_stage(views, t, Int32(stage), buf)
            cute.arch.sync_threads()
            # the widened block's bytes through its swizzled layout viewed as uint8, as the kernel views its
            # ring's B (cute.recast_tensor of the E4M3 view disagreed from row 1 on, where the 128-byte swizzle
            # starts, on an H200 while the fused kernel's WGMMAs read the widened weights bit for bit)
            out = st.sW.get_tensor(wide.outer, swizzle=wide.inner, dtype=Uint8)
            for j in cutlass.range_constexpr(128):
                mOut[t, j] = out[t, j, buf]

    return WidenStage()


def _compile_stage(**kw):
    from cutlass import Int32, Uint8

    from xstage.cute_compile import compile_hopper, fake_stream, fake_tensor

    return compile_hopper(_stage_kernel(), fake_tensor(Uint8, (256, 64), stride=(64, 1)),
                          fake_tensor(Int32, (256,), stride=(1,)), fake_tensor(Uint8, (256, 128), stride=(128, 1)),
                          Int32(0), fake_stream(), **kw)


@pytest.mark.compile
def test_the_kernels_stage_widening_compiles_alone():
    """The stage widening of the W4A8 kernel (its own code, not a copy) in a one-CTA test kernel."""
    ptx = _compile_stage(keep_ptx=True).ptx
    # the widening's own (inline, "op {" with a space; the compiler's vector accesses have a tab)
    assert ptx.count("ld.shared.v4.b32 {") == 4 and ptx.count("st.shared.v4.b32 [") == 8


@pytest.mark.gpu
@pytest.mark.parametrize("buf", [0, 1])
def test_the_kernels_stage_widening_gives_the_recipes_bits(buf):
    """Random codes (every nibble) and per-row shift bytes from -20 to 6 through the kernel's
    widen_stage: the E4M3 block read back through cute's own swizzled indexing is quant_fp4.widen's,
    row by row (the packed stage's and the widened block's swizzles, the shift byte order, the tables)."""
    from megamoe_interleave.fp4_widen import MIN_SHIFT
    from xstage.cute_compile import cached

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper (sm_90) GPU")
    g = torch.Generator().manual_seed(3 + buf)
    nibbles = torch.randint(0, 16, (256, 128), generator=g, dtype=torch.uint8)
    d = torch.randint(MIN_SHIFT, quant_fp4.WIDEN_MAX_SHIFT + 1, (256, 4), generator=g, dtype=torch.int32)
    words = quant_fp4.shift_words(d[None])[0]  # [1, 256]: one K block
    out = torch.full((256, 128), 0x7F, dtype=torch.uint8, device="cuda")
    fn = cached(("WidenStage-test",), lambda: _compile_stage().fn)
    fn(_braided_codes(quant_fp4.pack(nibbles)).cuda(), words[0].cuda(), out, buf)
    want = _emulate(nibbles, d.repeat_interleave(quant_fp4.SCALE_GROUP, dim=-1))
    assert torch.equal(out.cpu(), want)
