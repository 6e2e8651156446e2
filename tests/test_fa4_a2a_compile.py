"""Every fa4_a2a kernel variant compiles for sm_90a (runs on a CPU-only machine).

Each distinct code path is compiled once: the Ulysses epilogue (bf16/fp16, head_dim 64/128,
P = 1/2/8, with/without LSE, persistent or not, causal), and the FA-only variant (stock epilogue).
P only changes a compile-time divisor, so the full dtype x head_dim x persistent product is built
for P = 8 and a representative subset for P = 1, 2.
"""

import re

import pytest
import torch

from fa4_a2a.interface import KernelConfig, compile_kernel, compile_ptx

pytestmark = [pytest.mark.compile, pytest.mark.filterwarnings("ignore:Argument aux_data")]

BF16, FP16 = torch.bfloat16, torch.float16

ULYSSES_VARIANTS = (
    [KernelConfig(dt, d, 8, True, pers) for dt in (BF16, FP16) for d in (64, 128) for pers in (False, True)]
    + [KernelConfig(dt, d, p, True, pers) for (dt, d) in ((BF16, 128), (FP16, 64)) for p in (1, 2) for pers in (False, True)]
    + [KernelConfig(BF16, 128, 8, True, False, has_lse=True), KernelConfig(FP16, 64, 2, True, True, has_lse=True)]
    + [KernelConfig(BF16, 128, 8, True, False, causal=True), KernelConfig(FP16, 64, 4, True, False, causal=True, has_lse=True)]
    + [KernelConfig(dt, d, 8, True, True, o_staging="defer_q") for (dt, d) in ((BF16, 128), (FP16, 64))]
)
LOCAL_VARIANTS = [KernelConfig(dt, d, 1, False, pers) for dt in (BF16, FP16) for d in (64, 128) for pers in (False, True)] + [
    KernelConfig(BF16, 128, 1, False, False, causal=True, has_lse=True),
    KernelConfig(BF16, 128, 1, False, True, o_staging="defer_q"),
]


def _name(cfg):
    return (f"{'ulysses' if cfg.ulysses else 'local'}-{str(cfg.dtype).split('.')[-1]}-d{cfg.head_dim}-P{cfg.num_ranks}"
            f"{('-pers-' + cfg.o_staging) if cfg.persistent else ''}{'-causal' if cfg.causal else ''}{'-lse' if cfg.has_lse else ''}")


@pytest.mark.parametrize("cfg", ULYSSES_VARIANTS + LOCAL_VARIANTS, ids=_name)
def test_variant_compiles(cfg):
    assert callable(compile_kernel(cfg))
    assert compile_kernel(cfg) is compile_kernel(cfg)  # cached


def test_cache_key_distinguishes_every_switch():
    base = KernelConfig(BF16, 128, 8)
    others = [KernelConfig(FP16, 128, 8), KernelConfig(BF16, 64, 8), KernelConfig(BF16, 128, 2),
              KernelConfig(BF16, 128, 8, ulysses=False), KernelConfig(BF16, 128, 8, persistent=True),
              KernelConfig(BF16, 128, 8, causal=True), KernelConfig(BF16, 128, 8, has_lse=True),
              KernelConfig(BF16, 128, 8, num_sms=78), KernelConfig(BF16, 128, 8, persistent=True, o_staging="defer_q")]
    keys = {base.key()} | {c.key() for c in others}
    assert len(keys) == len(others) + 1
    assert "FlashAttentionUlyssesSm90" in base.key()


def test_ulysses_epilogue_emits_16_byte_remote_stores_and_no_tma_store():
    ptx = compile_ptx(KernelConfig(BF16, 128, 8, True, False))
    stores = re.findall(r"st\.global[\w.:]*", ptx)
    # 128x128 bf16 tile over 256 epilogue threads: 4 rows x 2 x 16 B per thread, all v4.
    assert stores.count("st.global.v4.b32") == 8, stores
    assert set(stores) == {"st.global.v4.b32"}, stores
    assert "cp.async.bulk.tensor.4d.global.shared" not in ptx
    assert "ld.global.b64" in ptx  # peer-table loads


def test_fa_only_keeps_the_stock_tma_store():
    ptx = compile_ptx(KernelConfig(BF16, 128, 1, False, False))
    assert "cp.async.bulk.tensor.4d.global.shared" in ptx
    assert "st.global.v4.b32" not in ptx


def _q_release_lines(ptx):
    return [i for i, l in enumerate(ptx) if re.search(r"mbarrier\.arrive\.shared\.b64 %rd\d+, \[%r\d+\+8\]", l)]


def test_persistent_own_o_buffer_keeps_the_early_q_release():
    """With its own O staging buffer the persistent variant releases Q before the epilogue, as stock."""
    for pers in (False, True):
        ptx = compile_ptx(KernelConfig(BF16, 128, 8, True, pers)).split("\n")
        epi_bars = [i for i, l in enumerate(ptx) if re.search(r"bar\.sync\s+1, 256", l)]
        rel = _q_release_lines(ptx)
        assert len(rel) == 1 and rel[0] < epi_bars[0] and len(epi_bars) == 2, (pers, rel, epi_bars)


def test_persistent_defer_q_releases_q_after_reading_the_o_tile():
    """With sO aliasing sQ ("defer_q") Q's release must come after the epilogue's last read of sO
    (third epilogue barrier) and before the remote stores."""
    ptx = compile_ptx(KernelConfig(BF16, 128, 8, True, True, o_staging="defer_q")).split("\n")
    q_empty_arrive = _q_release_lines(ptx)
    epi_bars = [i for i, l in enumerate(ptx) if re.search(r"bar\.sync\s+1, 256", l)]
    stores = [i for i, l in enumerate(ptx) if "st.global.v4.b32" in l]
    assert len(epi_bars) == 3 and stores
    releases_in_epilogue = [i for i in q_empty_arrive if epi_bars[-1] < i < stores[0]]
    assert releases_in_epilogue, (q_empty_arrive, epi_bars, stores[:1])
    assert len(q_empty_arrive) == 1, "the parent's early Q release must be suppressed"
