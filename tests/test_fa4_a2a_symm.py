"""The symmetric-memory A2A-only baseline (``fa4_a2a.a2a_copy``): sm_90a compile and PTX checks,
host-side validation on the CPU, and on a Hopper GPU (loopback and host worlds) every element of
every poisoned destination checked against the Ulysses layout reference, guard bands included."""

import re

import pytest
import torch

from fa4_a2a import Fa4A2AInputError, attention_a2a, ulysses_peer_table
from fa4_a2a.a2a_copy import A2ACopyConfig, a2a_symm, compile_a2a_copy, compile_a2a_copy_ptx
from fa4_a2a.baselines import serial_symm
from fa4_a2a.reference import head_to_seq_shards, seq_to_head_shards, ulysses_reference
from xstage.world import make_world

BF16, FP16 = torch.bfloat16, torch.float16


# ----------------------------------------------------------------------------- compile (CPU)


@pytest.mark.compile
def test_default_copy_kernel_ptx():
    """Loads all `unroll` chunks before storing them; 16-byte loads and stores only; the peer
    table read per store; no integer division in the per-chunk path (FastDivmod)."""
    cfg = A2ACopyConfig()
    ptx = compile_a2a_copy_ptx(cfg)
    assert ".target sm_90a" in ptx
    mem = re.findall(r"(?:st|ld)\.global[\w.:]*", ptx)
    assert set(mem) == {"ld.global.v4.b32", "st.global.v4.b32", "ld.global.b64"}, set(mem)
    # unrolled body: `unroll` loads, then `unroll` (table load, store) pairs; plus one tail chunk
    assert mem[:cfg.unroll] == ["ld.global.v4.b32"] * cfg.unroll
    assert mem.count("st.global.v4.b32") == cfg.unroll + 1
    assert mem.count("ld.global.b64") == cfg.unroll + 1
    assert len(re.findall(r"\bdiv\.[su]32", ptx)) <= 1  # only the host-invariant loop count
    assert callable(compile_a2a_copy(cfg)) and compile_a2a_copy(cfg) is compile_a2a_copy(cfg)


@pytest.mark.compile
def test_variant_copy_kernel_ptx():
    ptx = compile_a2a_copy_ptx(A2ACopyConfig(threads=256, unroll=1, cache="cs"))
    assert "st.global.cs.v4.b32" in ptx and "ld.global.v4.b32" in ptx
    assert "st.global.v4.b32" not in ptx


@pytest.mark.parametrize("kw", [dict(threads=48), dict(threads=2048), dict(unroll=0), dict(unroll=17),
                                dict(cache="wb")])
def test_config_rejects(kw):
    with pytest.raises(ValueError):
        A2ACopyConfig(**kw)


# ----------------------------------------------------------------------------- validation (CPU)


def _args(P=4, B=1, S=256, Hl=2, D=128, dtype=BF16):
    o = torch.randn(B, S, Hl, D).to(dtype)
    out = torch.empty(B, S // P, Hl * P, D, dtype=dtype)
    return o, out, torch.zeros(P, dtype=torch.int64)


def _raises(match, *a, **kw):
    with pytest.raises(Fa4A2AInputError, match=match):
        a2a_symm(*a, **kw)


def test_a2a_symm_validation_before_launch():
    o, out, table = _args()
    _raises("must be a CUDA tensor", o, out, table, num_ranks=4)  # well-formed: stops at the device
    _raises("not divisible by the world size 3", o, torch.empty(1, 85, 6, 128, dtype=BF16),
            torch.zeros(3, dtype=torch.int64), num_ranks=3)
    _raises("out must have shape", o, torch.empty(1, 64, 4, 128, dtype=BF16), table, num_ranks=4)
    _raises("dtype mismatch", o, out.half(), table, num_ranks=4)
    _raises("peer_table must be int64", o, out, table.int(), num_ranks=4)
    _raises("peer_table must be int64", o, out, table[:2], num_ranks=4)
    o_nc = torch.randn(1, 2, 256, 128).to(BF16).transpose(1, 2)  # [1, 256, 2, 128], strided
    _raises("o_local must be contiguous", o_nc, out, table, num_ranks=4)
    _raises("head_dim 96 unsupported", *_args(D=96), num_ranks=4)
    _raises("world size must be a positive int", o, out, table, num_ranks=0)
    flat = torch.empty(o.numel() + 1, dtype=BF16)
    _raises("not 16-byte aligned", flat[1:].view(o.shape), out, table, num_ranks=4)


# ----------------------------------------------------------------------------- GPU


def _guarded(shape, dtype, guard=4096):
    """A tensor of ``shape`` inside a larger NaN-poisoned allocation (guard bands both sides)."""
    n = 1
    for d in shape:
        n *= d
    buf = torch.full((n + 2 * guard,), float("nan"), dtype=dtype, device="cuda")
    return buf, buf[guard:guard + n].view(shape)


CASES = [
    # P, B, C, Hl, D, dtype, config, num_ctas
    (1, 2, 384, 3, 128, BF16, A2ACopyConfig(), None),
    (2, 1, 200, 2, 64, FP16, A2ACopyConfig(), None),
    (4, 2, 300, 3, 128, BF16, A2ACopyConfig(), None),
    (8, 1, 136, 5, 128, BF16, A2ACopyConfig(), None),
    (8, 3, 1000, 1, 64, FP16, A2ACopyConfig(threads=256, unroll=1, cache="cs"), None),
    (4, 1, 250, 2, 128, BF16, A2ACopyConfig(), 1),  # one CTA: many grid-stride steps + a tail
    (8, 1, 520, 3, 64, BF16, A2ACopyConfig(threads=128, unroll=3), 7),
]


@pytest.mark.gpu
@pytest.mark.parametrize("P,B,C,Hl,D,dtype,cfg,num_ctas", CASES)
def test_a2a_symm_matches_the_layout_reference(P, B, C, Hl, D, dtype, cfg, num_ctas):
    g = torch.Generator(device="cuda").manual_seed(P * 7919 + C)
    o_locals = [torch.randn(B, C * P, Hl, D, generator=g, device="cuda").to(dtype) for _ in range(P)]
    bufs, dests = zip(*(_guarded((B, C, Hl * P, D), dtype) for _ in range(P)))
    for r in range(P):
        table = ulysses_peer_table(list(dests), r, Hl, D, dtype)
        a2a_symm(o_locals[r], dests[r], table, num_ranks=P, config=cfg, num_ctas=num_ctas)
    torch.cuda.synchronize()
    want = head_to_seq_shards(o_locals)
    for j in range(P):
        assert not torch.isnan(dests[j]).any(), f"rank {j}: unwritten (poisoned) elements"
        assert torch.equal(dests[j], want[j]), f"rank {j}: copy differs from the layout reference"
        guard = torch.cat([bufs[j][:4096], bufs[j][-4096:]])
        assert torch.isnan(guard).all(), f"rank {j}: stores outside the destination buffer"


@pytest.mark.gpu
def test_a2a_symm_world_tables_host_world_and_graph_capture():
    """World-allocated destinations (folded tables as the fused kernel gets them), the pinned-host
    world, and a captured graph replayed on fresh data."""
    P, B, C, Hl, D = 4, 1, 192, 2, 128
    for backend in ("loopback", "host"):
        world = make_world(backend, P)
        dest = world.alloc((B, C, Hl * P, D), BF16)
        tables = [dest.peer_table(r) + r * Hl * D * 2 for r in range(P)]
        g = torch.Generator(device="cuda").manual_seed(5)
        o_locals = [torch.randn(B, C * P, Hl, D, generator=g, device="cuda").to(BF16) for _ in range(P)]
        dest.fill_(float("nan"))
        graph = torch.cuda.CUDAGraph()
        a2a_symm(o_locals[0], dest.local(0), tables[0], num_ranks=P)  # compile outside capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for r in range(P):
                a2a_symm(o_locals[r], dest.local(r), tables[r], num_ranks=P)
        for o in o_locals:
            o.copy_(torch.randn(o.shape, generator=g, device="cuda").to(BF16))
        dest.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for j, w in enumerate(head_to_seq_shards(o_locals)):
            got = dest.local(j).to("cuda")
            assert not torch.isnan(got).any() and torch.equal(got, w), f"{backend}: rank {j}"


@pytest.mark.gpu
def test_serial_symm_equals_fused_bitwise():
    """Serial (FA-only, then the copy kernel) and Fused move the same bytes to the same places:
    identical outputs, both within tolerance of the float32 Ulysses reference."""
    P, B, C, Hl, D = 4, 1, 300, 2, 128
    world = make_world("loopback", P)
    g = torch.Generator(device="cuda").manual_seed(17)
    qs, ks, vs = ([torch.randn(B, C, Hl * P, D, generator=g, device="cuda").to(BF16) for _ in range(P)]
                  for _ in range(3))
    qh, kh, vh = seq_to_head_shards(qs), seq_to_head_shards(ks), seq_to_head_shards(vs)
    outs = {}
    for name in ("serial_symm", "fused"):
        dest = world.alloc((B, C, Hl * P, D), BF16)
        dest.fill_(float("nan"))
        for r in range(P):
            table = dest.peer_table(r) + r * Hl * D * 2
            if name == "fused":
                attention_a2a(qh[r], kh[r], vh[r], dest.local(r), table, num_ranks=P)
            else:
                o_local = torch.full_like(qh[r], float("nan"))
                serial_symm(qh[r], kh[r], vh[r], o_local, dest.local(r), table, num_ranks=P)
        torch.cuda.synchronize()
        outs[name] = [dest.local(j).clone() for j in range(P)]
    ref = ulysses_reference(qs, ks, vs)
    for j in range(P):
        assert not torch.isnan(outs["serial_symm"][j]).any()
        assert (outs["serial_symm"][j].float() - ref[j]).abs().max().item() <= 2e-2
        assert torch.equal(outs["serial_symm"][j], outs["fused"][j]), f"rank {j}: serial_symm != fused"


@pytest.mark.gpu
@pytest.mark.parametrize("backend,P", [("loopback", 4), ("host", 2)])
def test_selfcheck_on_single_process_worlds(backend, P):
    """fa4_a2a.selfcheck (the multi-GPU correctness entry point) on the worlds one GPU has."""
    from fa4_a2a.selfcheck import check_world

    res = check_world(make_world(backend, P), verbose=False)
    assert len(res["checks"]) == 2 * 4 and res["max_err"] < 2e-2
