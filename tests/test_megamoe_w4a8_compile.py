"""The W4A8 fused kernel (megamoe_interleave.sm90_fp4) compiles for sm_90a without a GPU, and its program
is what docs/w4a8.md plans: packed B and shift words by TMA, the widening (FP16 multiplies, E4M3
conversions, 16-byte shared loads and stores), the proxy fence, FP8 WGMMAs still pipelined, no local
memory in the mainloops."""
import re
import subprocess

import pytest

from megamoe_interleave.config import MegaMoEConfig
from megamoe_interleave.shapes import get_shape
from test_megamoe_compile import fp8_mainloop_sass  # pytest puts tests/ on sys.path
from xstage.cute_compile import cuobjdump

DSV4 = get_shape("deepseek-v4-flash")
SCHEDULES = ["expert_wave", "interleaved"]


def _compile(hidden, inter, config, options=""):
    from megamoe_interleave.kernel import compile_megamoe_sm90

    return compile_megamoe_sm90(hidden, inter, config, options=options)


@pytest.mark.compile
def test_widening_addresses_are_the_ring_and_wgmma_layouts():
    """MegaMoESm90W4A8.widen_stage addresses the packed stage and the widened block by hand; the
    formulas are the layouts quack builds for them (64-byte swizzle of uint8 256 x 64, 128-byte swizzle
    of E4M3 256 x 128), for every row, 16-byte chunk and stage."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float8E4M3FN, Uint8
    from cutlass.utils import LayoutEnum
    from quack import sm90_utils

    bad = []

    @cute.jit
    def check():
        packed = sm90_utils.make_smem_layout(Uint8, LayoutEnum.ROW_MAJOR, (256, 64), stage=3)
        wide = sm90_utils.make_smem_layout(Float8E4M3FN, LayoutEnum.ROW_MAJOR, (256, 128), stage=2)
        for row in cutlass.range_constexpr(256):
            for s in cutlass.range_constexpr(2):
                for c in cutlass.range_constexpr(4):
                    if cutlass.const_expr(packed((row, 16 * c, s)) != s * 256 * 64 + row * 64
                                          + ((16 * c) ^ (((row >> 1) & 3) << 4))):
                        bad.append(("packed", row, c, s))
                for c in cutlass.range_constexpr(8):
                    if cutlass.const_expr(wide((row, 16 * c, s)) != s * 256 * 128 + row * 128
                                          + ((16 * c) ^ ((row & 7) << 4))):
                        bad.append(("widened", row, c, s))

    check()
    assert not bad, bad[:8]


@pytest.mark.compile
@pytest.mark.parametrize("P", [1, 8])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_w4a8_builds_widen_into_pipelined_fp8_wgmma(tmp_path, schedule, P):
    """DeepSeek-V4-Flash W4A8 builds (3 stages; P = 8 with the bulk Dispatch): six TMA tile loads (A, packed
    B, shift words of L1 and L2), the widening in the PTX (per 32-group one ld.shared.v4 of codes, its
    table looked up, two prmt per 8 weights (the signs braided), two st.shared.v4; the tables' FP16 multiplies and
    cvt.rn.satfinite.e4m3x2.f16x2 once per CTA), the async-proxy fence after it, the W4A8 barriers (Widen: 256 consumer threads;
    WidenWg0 + warpgroup: 128), the FP8 mainloop's SASS checks (test_megamoe_compile.fp8_mainloop_sass), one
    spilled word at most."""
    from megamoe_interleave.named_barrier import NamedBarrier

    tool = cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (CUDA toolkit or triton)")
    config = MegaMoEConfig(schedule, precision="w4a8").resolve(DSV4, P, 8192, 132)
    assert (config.block_n, config.stages) == (256, 3)
    d = tmp_path / "build"
    d.mkdir()
    _compile(DSV4.hidden, DSV4.intermediate, config, f"--keep-ptx --keep-cubin --dump-dir={d}")
    ptx = "\n".join(p.read_text() for p in d.iterdir() if p.suffix == ".ptx")
    (cubin,) = [p for p in d.iterdir() if p.suffix == ".cubin"]
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3", ptx)
    tma = re.findall(r"cp\.async\.bulk\.tensor\.2d\S+", ptx)
    assert len(tma) == 6 and sum("multicast::cluster" in t for t in tma) == 2  # B multicast; A and shifts not
    loads, stores = ptx.count("ld.shared.v4.b32"), ptx.count("st.shared.v4.b32")
    assert loads >= 4 and stores == 2 * loads  # four per widening site: one load, two stores per group
    assert ptx.count("mul.rn.f16x2") == 4 and ptx.count("prmt.b32") >= 8 * loads  # the tables once, lookups
    assert "cvt.rn.satfinite.e4m3x2.f16x2" in ptx and "fence.proxy.async.shared::cta" in ptx
    assert re.search(rf"bar\.sync\s+{int(NamedBarrier.Widen)}, 256;", ptx)
    assert re.search(r"bar\.sync\s+%r\d+, 128;", ptx)
    sass, lines, _ = fp8_mainloop_sass(tool, cubin)
    assert re.search(r"\bHMUL2\b", sass) and re.search(r"\bF2FP\b", sass) and re.search(r"\bPRMT\b", sass)
    # One word spills (stored once at the kernel's start; the consumers reload it a few times per tile,
    # outside the K loops: the widening's registers pushed it out at the 224 / 56 split)
    usage = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) <= 8, "the W4A8 build spills more"
    assert len([line for line in lines if re.search(r"\bSTL\b", line)]) <= 1


@pytest.mark.compile
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("trace", [False, True])
def test_w4a8_kernel_compiles(schedule, trace):
    """The smallest W4A8 tiles (H 512, I 256: two L1 and two L2 pair tiles per row, 4 and 2 K blocks),
    with and without the per-tile trace."""
    config = MegaMoEConfig(schedule, precision="w4a8", trace=trace).resolve(DSV4, 1, 256, 132)
    assert _compile(512, 256, config) is not None
