"""The W4A8 swapped half tiles' index arithmetic (megamoe_interleave.sm90_fp4_swapped) on a CPU, with the kernel's
own helpers: each thread's staged columns are its fragment rows (tests/test_wgmma_rate.py checks those against
CuTe's layouts), the pairs that lanes l and l ^ 4 store write every (token, column) of the staged h and y tiles once
with its own value, and the staging tile's row and column steps the kernel adds at compile time are its layout's."""
import pytest

from megamoe_interleave import sm90_fp4_swapped as sw


def _threads():
    """(warp 0-7, lane, thread of its warpgroup) of the 256 consumer threads."""
    for warp in range(8):
        for lane in range(32):
            yield warp, lane, (warp % 4) * 32 + lane


def test_staged_columns_are_the_fragment_rows():
    for warp, lane, lt in _threads():
        for t in range(2):
            r0 = 128 * (warp // 4) + 64 * t + sw.fragment_row(lt)
            assert r0 % 16 < 8  # w1 interleaves gate and up rows by 8: r0 is a gate row, r0 + 8 its up row
            assert sw.h_column(lane, warp, t) == r0 // 16 * 8 + r0 % 8
            for v1 in range(2):
                assert sw.y_column(lane, warp, t, v1) == r0 + 8 * v1


@pytest.mark.parametrize("n", sw.SWAP_TOKENS)
@pytest.mark.parametrize("bits", [8, 16])  # E4M3 h (L1, the gate rows' h only), bf16 y (L2, both rows)
def test_column_pairs_write_every_staged_element_once(n, bits):
    def value(col, tok):
        return (col * 37 + tok * 11 + 5) % (1 << bits)

    def column(lane, warp, t, v1):
        return sw.h_column(lane, warp, t) if bits == 8 else sw.y_column(lane, warp, t, v1)

    staged = {}
    for warp, lane, _ in _threads():
        q, odd = lane % 4, (lane // 4) % 2
        for t in range(2):
            for v1 in range(1 if bits == 8 else 2):
                col, other_col = column(lane, warp, t, v1), column(lane ^ 4, warp, t, v1)
                for j in range(n // 8):
                    tok = 8 * j + 2 * q  # the pair holds tokens tok, tok + 1
                    mine = value(col, tok) | value(col, tok + 1) << bits
                    other = value(other_col, tok) | value(other_col, tok + 1) << bits
                    word = sw.column_pair(odd, mine, other, bits)
                    for dc, v in ((0, word & ((1 << bits) - 1)), (1, word >> bits)):
                        key = (tok + odd, col - odd + dc)  # the kernel's store: token tok + odd, columns col - odd ..
                        assert key not in staged, key
                        staged[key] = v
    columns = 128 if bits == 8 else 256
    assert staged == {(tok, c): value(c, tok) for tok in range(n) for c in range(columns)}


@pytest.mark.parametrize("P, tokens", [(1, 512), (1, 8192), (8, 8192)])
def test_staging_steps_are_the_staging_layout(P, tokens):
    """The kernel's compile-time offsets: 8 tokens down keep the swizzled column (stage_row_step), 64 y columns
    right are 32 words right (the L2 m-tiles)."""
    from megamoe_interleave.config import MegaMoEConfig
    from megamoe_interleave.shapes import get_shape
    from megamoe_interleave.sm90_fp4 import MegaMoESm90W4A8

    shape = get_shape("deepseek-v4-flash")
    k = MegaMoESm90W4A8(shape.hidden, shape.intermediate,
                        MegaMoEConfig(precision="w4a8").resolve(shape, P, tokens, 132))
    for tok0 in range(8):
        for c in range(k.stage_words):
            for j in range(max(sw.SWAP_TOKENS) // 8):
                assert k.stage_index(tok0, c) + k.stage_row_step(8 * j) == k.stage_index(tok0 + 8 * j, c)
            if c + 32 < k.stage_words:
                assert k.stage_index(tok0, c) + 32 == k.stage_index(tok0, c + 32)
