"""fa4_a2a on the CPU: bad input raises a clear error before any launch; Ulysses layouts.

The kernels cannot run here; these tests use CPU tensors, which pass every structural check and
then must be rejected by the device check (never reaching a compile or launch).
"""

import math

import pytest
import torch

import fa4_a2a
from fa4_a2a import Fa4A2AInputError, attention_a2a, attention_local, ulysses_attention, ulysses_peer_table
from fa4_a2a.reference import (
    attention_fp32,
    head_to_seq_shards,
    seq_to_head_shards,
    ulysses_destination,
    ulysses_reference,
)
from xstage.world import make_world

BF16 = torch.bfloat16


def _qkv(B=1, S=256, Hl=2, D=128, dtype=BF16):
    return [torch.randn(B, S, Hl, D).to(dtype) for _ in range(3)]


def _fused_args(P=4, B=1, S=256, Hl=2, D=128, dtype=BF16):
    q, k, v = _qkv(B, S, Hl, D, dtype)
    out = torch.empty(B, S // P, Hl * P, D, dtype=dtype)
    table = torch.zeros(P, dtype=torch.int64)
    return q, k, v, out, table


def _raises(match, fn, *a, **kw):
    with pytest.raises(Fa4A2AInputError, match=match):
        fn(*a, **kw)


def test_well_formed_cpu_input_stops_at_the_device_check():
    q, k, v, out, table = _fused_args()
    _raises("must be a CUDA tensor", attention_a2a, q, k, v, out, table, num_ranks=4)
    _raises("must be a CUDA tensor", attention_local, q, k, v, torch.empty_like(q))


def test_sequence_not_divisible_by_world_size():
    q, k, v, out, table = _fused_args(P=4, S=256)
    _raises("not divisible by the world size 3", attention_a2a, q, k, v, out, torch.zeros(3, dtype=torch.int64), num_ranks=3)


def test_heads_not_divisible_by_world_size():
    world = make_world("loopback", 4, device="cpu")
    xs = [torch.randn(1, 64, 6, 64).to(BF16) for _ in range(4)]
    _raises("heads 6 is not divisible by the world size 4", ulysses_attention, xs, xs, xs, world)


@pytest.mark.parametrize("head_dim", [32, 96, 256])
def test_unsupported_head_dim(head_dim):
    q, k, v, out, table = _fused_args(D=head_dim)
    _raises(f"head_dim {head_dim} unsupported", attention_a2a, q, k, v, out, table, num_ranks=4)


def test_dtype_unsupported_and_mismatch():
    q, k, v, out, table = _fused_args()
    _raises("dtype torch.float32 unsupported", attention_a2a, q.float(), k, v, out, table, num_ranks=4)
    _raises("dtype mismatch", attention_a2a, q.half(), k, v, out, table, num_ranks=4)


def test_misaligned_and_non_contiguous():
    q, k, v, out, table = _fused_args()
    flat = torch.empty(q.numel() + 1, dtype=BF16)
    q_mis = flat[1:].view(q.shape)  # 2-byte offset
    _raises("not 16-byte aligned", attention_a2a, q_mis, k, v, out, table, num_ranks=4)
    q_t = torch.randn(1, 2, 256, 128).to(BF16).transpose(1, 2)  # strided but 16-B rows: allowed layout
    k_nc = torch.randn(1, 256, 2, 256).to(BF16)[..., ::2]  # last dim not contiguous
    _raises("contiguous last dimension", attention_a2a, q, k_nc, v, out, table, num_ranks=4)
    out_nc = torch.empty(1, 64, 16, 128, dtype=BF16).transpose(1, 2)[:, :, :8]
    _raises("out must have shape|out must be contiguous", attention_a2a, q, k, v, out_nc, table, num_ranks=4)
    # A transposed (strided) q is fine structurally and only stops at the device check.
    _raises("must be a CUDA tensor", attention_a2a, q_t.contiguous(), k, v, out, table, num_ranks=4)


def test_shape_errors():
    q, k, v, out, table = _fused_args()
    _raises("must be 4-D", attention_a2a, q[0], k, v, out, table, num_ranks=4)
    _raises("same shape", attention_a2a, q, k[:, :128], v, out, table, num_ranks=4)
    _raises("out must have shape", attention_a2a, q, k, v, torch.empty(1, 64, 4, 128, dtype=BF16), table, num_ranks=4)
    _raises("peer_table must be int64", attention_a2a, q, k, v, out, table.int(), num_ranks=4)
    _raises("peer_table must be int64", attention_a2a, q, k, v, out, table[:3], num_ranks=4)
    _raises("lse must be float32", attention_a2a, q, k, v, out, table, num_ranks=4, lse=torch.empty(1, 2, 255))
    _raises("world size must be a positive int", attention_a2a, q, k, v, out, table, num_ranks=0)


def test_device_mismatch_is_reported():
    q, k, v, out, table = _fused_args()
    meta = torch.empty(q.shape, dtype=BF16, device="meta")
    with pytest.raises(Fa4A2AInputError):
        attention_a2a(q, k, meta, out, table, num_ranks=4)


def test_ulysses_api_rejects_wrong_rank_count_and_single_tensor():
    world = make_world("loopback", 2, device="cpu")
    xs = [torch.randn(1, 64, 4, 64).to(BF16) for _ in range(3)]
    _raises("expected 2 tensors", ulysses_attention, xs, xs, xs, world)
    _raises("pass a sequence of 2 tensors", ulysses_attention, xs[0], xs[0], xs[0], world)


@pytest.mark.parametrize("world", [None, "loopback", 4])
def test_ulysses_api_rejects_a_world_that_is_not_a_world(world):
    xs = [torch.randn(1, 64, 4, 64).to(BF16) for _ in range(2)]
    _raises(r"world must be an xstage.world World \(from xstage.world.make_world\), got "
            + type(world).__name__, ulysses_attention, xs, xs, xs, world)


def test_module_rejects_unsupported_features():
    world = make_world("loopback", 2, device="cpu")
    m = fa4_a2a.UlyssesAttention(world)
    x = [torch.randn(1, 64, 4, 64).to(BF16)] * 2
    with pytest.raises(NotImplementedError):
        m(x, x, x, dropout_p=0.1)
    with pytest.raises(NotImplementedError):
        m(x, x, x, window_size=(16, 0))
    with pytest.raises(NotImplementedError):
        fa4_a2a.UlyssesAttention(world, scatter_idx=1, gather_idx=2)


# ----------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("P", [1, 2, 4, 8])
def test_pre_and_post_a2a_are_inverse_layouts(P):
    g = torch.Generator().manual_seed(P)
    xs = [torch.randn(2, 24, 8, 16, generator=g) for _ in range(P)]
    ys = seq_to_head_shards(xs)
    assert ys[0].shape == (2, 24 * P, 8 // P, 16)
    for a, b in zip(xs, head_to_seq_shards(ys)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("P,S", [(2, 96), (4, 200), (8, 1000)])
def test_destination_formula_matches_the_post_a2a(P, S):
    """The device arithmetic (row // (S/P), head offset r*Hl) reproduces head_to_seq_shards,
    including tiles that straddle two destination ranks (S/P not a multiple of 128)."""
    B, Hl, D = 1, 2, 4
    g = torch.Generator().manual_seed(S)
    ys = [torch.randn(B, S, Hl, D, generator=g) for _ in range(P)]
    want = head_to_seq_shards(ys)
    got = [torch.full((B, S // P, Hl * P, D), float("nan")) for _ in range(P)]
    for r in range(P):
        for row in range(S):
            for h in range(Hl):
                j, jrow, jh = ulysses_destination(row, h, r, S, Hl, P)
                got[j][:, jrow, jh] = ys[r][:, row, h]
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_ulysses_reference_equals_per_rank_head_attention():
    """Full-sequence attention split by sequence == attention per head shard, then post-A2A."""
    P = 4
    g = torch.Generator().manual_seed(0)
    qs, ks, vs = ([torch.randn(1, 32, 8, 16, generator=g) for _ in range(P)] for _ in range(3))
    ref = ulysses_reference(qs, ks, vs)
    per_rank = [attention_fp32(q, k, v)[0] for q, k, v in zip(*(seq_to_head_shards(x) for x in (qs, ks, vs)))]
    # The two sides batch different head groups into BLAS, whose fp32 summation order depends on the CPU (CI saw
    # 1.7e-5); a layout mistake moves values by O(1), so 1e-4 still catches it.
    for a, b in zip(ref, head_to_seq_shards(per_rank)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_attention_fp32_matches_sdpa_and_lse():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 40, 3, 16, generator=g) for _ in range(3))
    for causal in (False, True):
        out, lse = attention_fp32(q, k, v, causal=causal)
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)
        torch.testing.assert_close(out, sdpa, rtol=1e-4, atol=1e-4)  # fp32 summation order differs by CPU
    s = torch.einsum("bshd,bthd->bhst", q, k) / math.sqrt(16)
    torch.testing.assert_close(lse, torch.logsumexp(s.masked_fill(torch.ones(40, 40, dtype=torch.bool).triu(1), -math.inf), -1))


def test_peer_table_folds_the_head_offset():
    bufs = [torch.empty(1, 8, 16, 64, dtype=BF16) for _ in range(4)]
    t = ulysses_peer_table(bufs, rank=3, heads_local=4, head_dim=64, dtype=BF16)
    assert t.dtype == torch.int64 and t.tolist() == [b.data_ptr() + 3 * 4 * 64 * 2 for b in bufs]
    with pytest.raises(ValueError, match="out of range"):
        ulysses_peer_table(bufs, rank=4, heads_local=4, head_dim=64, dtype=BF16)
    with pytest.raises(ValueError, match="16-byte aligned"):
        ulysses_peer_table([8, 16], rank=0, heads_local=1, head_dim=64, dtype=BF16, device="cpu")


def test_workspace_tables_on_a_cpu_loopback_world():
    world = make_world("loopback", 4, device="cpu")
    ws = fa4_a2a.UlyssesWorkspace(world, (1, 16, 8, 64), BF16)
    for r in range(4):
        bases = [ws.out(j).data_ptr() for j in range(4)]
        assert ws.tables[r].tolist() == [b + r * 2 * 64 * 2 for b in bases]
