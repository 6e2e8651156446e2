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
