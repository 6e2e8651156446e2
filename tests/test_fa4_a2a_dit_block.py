"""lab.fa4_a2a.dit_block on the CPU: the command line's checks, and both block paths (stock: pre-A2A,
FA4, A2A copies; fused: ulysses_attention) through a CPU loopback world against the float32 block
reference, with float32 stand-ins for the two kernel launches (the fused one stores through the
real folded peer table). The GPU run of the benchmark checks the real kernels the same way."""
import pytest
import torch

from lab.fa4_a2a import dit_block as DB
from fa4_a2a import ulysses as U
from fa4_a2a.reference import attention_fp32
from xstage.world import make_world

BF16 = torch.bfloat16


def _stand_ins(monkeypatch):
    def local(q, k, v, out, *, softmax_scale=None, causal=False):
        out.copy_(attention_fp32(q, k, v, softmax_scale, causal)[0].to(out.dtype))

    def resolve(addr):
        for ws in U._workspaces.values():
            for r in ws.world.local_ranks:
                t = ws.dest.local(r)
                base = t.data_ptr()
                if base <= addr < base + t.numel() * t.element_size():
                    return t, addr - base
        raise AssertionError(f"address 0x{addr:x} is in no destination buffer")

    def fused(q, k, v, out, table, num_ranks, scale, causal, persistent):
        o = attention_fp32(q, k, v, scale, causal)[0].to(q.dtype)
        B, S, Hl, D = q.shape
        C = S // num_ranks
        for j, addr in enumerate(table.tolist()):
            dst, off = resolve(addr)
            h0 = off // (D * q.element_size())
            dst[:, :, h0:h0 + Hl] = o[:, j * C:(j + 1) * C]

    monkeypatch.setattr(DB.interface, "attention_local", local)
    monkeypatch.setattr(U, "_launch_fused", fused)
    monkeypatch.setattr(U, "_workspaces", {})


@pytest.mark.parametrize("P", [1, 2, 4])
def test_both_blocks_match_the_fp32_reference(P, monkeypatch):
    _stand_ins(monkeypatch)
    world = make_world("loopback", P, device="cpu")
    blk = DB.make_weights(128, 4, 64, device="cpu", dtype=BF16, seed=P)
    res = DB.check(world, blk, 32 * P, BF16)
    assert res["block_stock"]["ok"] and res["block_fused"]["ok"], res
    assert res["block_fused"]["max_abs_err"] < 3e-2


def test_check_fails_when_a_path_is_wrong(monkeypatch):
    _stand_ins(monkeypatch)
    world = make_world("loopback", 2, device="cpu")
    blk = DB.make_weights(128, 4, 64, device="cpu", dtype=BF16)
    real = DB.interface.attention_local
    monkeypatch.setattr(DB.interface, "attention_local",
                        lambda q, k, v, out, **kw: (real(q, k, v, out, **kw), out[:, :1].fill_(3.0)))
    res = DB.check(world, blk, 64, BF16)
    assert not res["block_stock"]["ok"] and res["block_fused"]["ok"]


def test_command_line_checks():
    a = DB.parse_args([])
    assert a.P == 8 and a.models == sorted(DB.MODELS) and a.world == "loopback"
    with pytest.raises(SystemExit):
        DB.parse_args(["--P", "16"])  # 24 heads (FLUX.1) not divisible by 16
    with pytest.raises(SystemExit):
        DB.parse_args(["--seqs", "1001"])
    assert all(hidden == h * d for hidden, h, d in DB.MODELS.values())  # both configs: hidden = heads x head_dim


def test_summary_shares_and_ratio():
    clocks = {k: [1980] * 6 for k in DB.VARIANTS}
    samples = {"block_stock": [100.0] * 6, "block_fused": [96.0] * 6, "attn_stock": [60.0] * 6,
               "attn_fused": [56.0] * 6}
    row = DB.summarise(samples, clocks, 30.0)
    assert row["median_us"]["block_stock"] == 100.0
    assert row["variants"]["block_fused"]["median_ratio"] == pytest.approx(0.96)
    assert row["attn_share"] == {"stock": pytest.approx(0.6), "fused": pytest.approx(56 / 96)}
    assert DB.csv_rows({"rows": [dict(row, model="flux.1", S=8192, P=8, world="loopback")]})[0][
        "block_fused_over_stock"] == pytest.approx(0.96)
