"""lab.megamoe.diag.wgmma_rate, the FP8 WGMMA-rate microbenchmark (and the W4A8 widening next to it):
every variant compiles for sm_90a with the batches it claims; the shipped mainloop's batch shape keeps
its registers (CPU)."""
import re
from collections import Counter

import pytest

from lab.megamoe.diag import wgmma_rate as w


def test_variants_reject_shapes_they_cannot_run():
    with pytest.raises(ValueError):
        w.Variant(256, 96, True)
    with pytest.raises(ValueError):
        w.Variant(256, 64, False)  # accumulating in place is one batch over the tile
    with pytest.raises(ValueError):
        w.Variant(128, 128, False, widen=True)  # the W4A8 stage is the 256-column tile's
    with pytest.raises(ValueError):
        w.Variant(256, 128, True, ping_pong=False, swap_rs_n=12)  # N in steps of 8
    with pytest.raises(ValueError):
        w.Variant(256, 64, True, half=True)  # the half tile's batch is 128 columns per warpgroup
    with pytest.raises(ValueError):
        w.Variant(256, 128, True, order="turns")  # the order is the single fragment's (no ping-pong)
    with pytest.raises(ValueError):
        w.Variant(256, 128, True, ping_pong=False, order="alternate")


@pytest.mark.compile
@pytest.mark.parametrize("v", w.VARIANTS, ids=lambda v: v.name)
def test_variant_issues_its_batches(v):
    from xstage.cute_compile import compile_hopper

    ptx = compile_hopper(w.WgmmaRateSm90(v), *w._fake_args(), keep_ptx=True).ptx
    shapes = Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32\.f32\.e4m3\.e4m3", ptx))
    if v.swap_rs_n or v.half:  # two batches per loop: the half tile's K pair, or the swapped tile's two m-tiles
        assert shapes == {str(v.swap_rs_n or v.slice_n): 8}
        assert len(re.findall(r"wgmma\.wait_group", ptx)) == 2
        # RS: the A operand is a register vector, not a descriptor (64-bit)
        rs = re.findall(r"wgmma\.mma_async[^;]*?\{[^}]*\},\s*\{([^}]*)\}", ptx)
        assert bool(v.swap_rs_n) == bool(rs and all(len(a.split(",")) == 4 for a in rs))
    else:
        batches = v.tile_n // v.slice_n
        assert shapes == {str(v.slice_n): 4 * batches}  # 4 x k32 per 128-K stage and batch
        assert len(re.findall(r"wgmma\.wait_group", ptx)) == (batches if v.promote else 1)
    assert ptx.count("%clock64") == 2
    # the warpgroups' order: a named-barrier arrive only where one warpgroup waits for the other's batch
    assert bool(re.search(r"\bbar(rier)?\.(sync\.)?arrive\b", ptx)) == bool(v.order)
    assert ("cp.async.bulk.shared::cluster.global" in ptx) == v.refill
    # widen: 4 groups of 32 weights per thread and k-block, a table of 4 FP16 multiplies each (built per group in
    # the full tiles' widening, once per CTA where the half and swapped tiles look them up), 2 prmt per word
    assert ptx.count("mul.rn.f16x2") == (0 if not v.widen else 4 if v.half or v.swap_rs_n else 16)
    assert ptx.count("prmt.b32") >= (32 if v.widen else 0)


@pytest.mark.compile
def test_the_shipped_batch_shape_does_not_spill():
    """4 x n64 with ping-pong (the W8A8 mainloop's) stays in registers; a tool-less host skips."""
    u = w.sass_usage(w.Variant(256, 64, True))
    if u is None:
        pytest.skip("no cuobjdump (CUDA toolkit or triton)")
    assert u["local_memory_instructions"] == 0 and u["wgmma"] == 16 and u["wgmma_waits"] == 4


@pytest.mark.compile
def test_swapped_rs_fragment_words_match_cute_layout():
    """The swapped RS form widens each thread's weights straight into its A fragment: the rows and K that
    ``swapped_fragment_row`` / ``swapped_fragment_word`` give every fragment byte are the ones CuTe's
    ``m64nNk32`` E4M3 RS partition assigns (its layout evaluated at trace time; A's does not depend on N), and
    its accumulator holds the (weight row, token) that ``consume_swapped``'s promotion scales assume."""
    import cutlass.cute as cute
    from cutlass import Float8E4M3FN
    from quack import sm90_utils

    coords, acc = {}, {}

    @cute.jit
    def probe():
        mma = sm90_utils.make_tiled_mma(Float8E4M3FN, "K", "K", 64, source="RS")
        for lt in list(range(128)):  # a Python loop (the DSL turns ``range`` into a device loop)
            cA = mma.get_slice(lt).partition_A(cute.make_identity_tensor((64, w.BLOCK_K)))
            coords[lt] = [tuple(cA[i]) for i in range(cute.size(cA))]
            cC = mma.get_slice(lt).partition_C(cute.make_identity_tensor((64, 64)))
            acc[lt] = [tuple(cC[i]) for i in range(cute.size(cC))]

    cute.compile(probe)
    for lt in range(128):
        r0, q = w.swapped_fragment_row(lt), lt % 4
        # the promotion's scales: element e = 4 j + 2 v1 + v0 is weight row r0 + 8 v1, token 8 j + 2 q + v0
        assert acc[lt] == [(r0 + 8 * ((e // 2) % 2), 8 * (e // 4) + 2 * q + e % 2) for e in range(32)]
        assert len(coords[lt]) == 64  # 16 words of four E4M3 bytes
        for g in range(4):
            for h in range(2):
                for upper in range(2):
                    word = w.swapped_fragment_word(g, h, upper)
                    want = [(r0 + 8 * h, 32 * g + 16 * upper + 4 * q + i) for i in range(4)]
                    assert coords[lt][4 * word:4 * word + 4] == want, (lt, g, h, upper)
