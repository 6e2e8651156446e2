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

pytestmark = [pytest.mark.compile]

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


@pytest.mark.compile
@pytest.mark.parametrize("persistent", [False, True])
def test_trace_build_records_and_untraced_build_is_free(persistent):
    """The trace build (issue 29) reads %globaltimer at the CTA start, the epilogue entry and
    around the remote stores, reduces the stores' first / last issue into the tile's row
    (red.global.min / max.u64) and records %smid; the shipped build has none of it."""
    traced = compile_ptx(KernelConfig(BF16, 128, 8, True, persistent, trace=True))
    assert traced.count("%globaltimer") >= 4 and "%smid" in traced
    assert "red.relaxed.gpu.global.min.u64" in traced and "red.relaxed.gpu.global.max.u64" in traced
    plain = compile_ptx(KernelConfig(BF16, 128, 8, True, persistent))
    assert "%globaltimer" not in plain and "red.relaxed.gpu.global" not in plain


def test_trace_decode_and_statistics():
    """Synthetic rows: store spans, the overlap count at each tile's first store, per-SM gaps
    from a tile's last store to the next CTA's start, the tail; unrun tiles are skipped."""
    import torch

    from lab.fa4_a2a.trace import UNSET_MIN, decode_trace, trace_rows, trace_statistics

    t = trace_rows(1, 1, 3 * 128, 128, "cpu")
    assert t.shape == (1, 1, 3, 5) and (t[..., 2] == UNSET_MIN).all()
    # tile 0 on SM 0: start 0, epilogue 100, stores 110-150; tile 1 on SM 0 after it: start 170,
    # epilogue 300, stores 305-400; tile 2 did not run (its epilogue stamp stays 0)
    t[0, 0, 0] = torch.tensor([0, 100, 110, 150, 0])
    t[0, 0, 1] = torch.tensor([170, 300, 305, 400, 0])
    rows = decode_trace(t)
    assert [r["m_block"] for r in rows] == [0, 1] and [r["store_span_ns"] for r in rows] == [40, 95]
    s = trace_statistics(rows)
    assert s["tiles"] == 2 and s["retire_to_next_start"]["median"] == 20 and s["sms"] == 1
    assert s["overlap_at_start"]["max"] == 1 and s["tail_ns"] == 100 and s["kernel_span_ns"] == 400
    assert s["epilogue_to_first_store"]["median"] == 7.5
    # per SM: mainloops 100 + 130, store issue 50 + 100, one retire gap of 20
    assert s["tile_mainloop"]["median"] == 115
    assert s["sm_time_mean_ns"] == {"compute_ns": 230, "store_ns": 150, "gap_ns": 20}
    p = trace_statistics(rows, persistent=True)  # one CTA: tile 1's mainloop starts at tile 0's last store
    assert "retire_to_next_start" not in p
    assert p["sm_time_mean_ns"] == {"compute_ns": 250, "store_ns": 150, "gap_ns": 0}


def test_builds_compile_without_a_user_warning():
    """scripts/run prints no library warnings: the FA-only build's empty AuxData() (no JIT argument,
    as meant) is no longer reported, and the Ulysses build has none."""
    import warnings

    from fa4_a2a import interface

    for cfg in (KernelConfig(torch.bfloat16, 128, 8, ulysses=False), KernelConfig(torch.bfloat16, 128, 8)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            interface._compile(cfg)
        assert not [str(w.message)[:200] for w in caught if issubclass(w.category, UserWarning)], cfg
