"""Every BurstKernel variant compiles for sm_90a (CPU), and host-side launch validation."""
import re

import pytest

from calibration.kernels import BurstConfig, BurstKernel, validate_launch

VARIANTS = [
    BurstConfig(gap_mode="spin"),
    BurstConfig(gap_mode="mma"),
    BurstConfig(gap_mode="none"),
    BurstConfig(gap_mode="spin", cache="cs"),
    BurstConfig(gap_mode="spin", cache="no_allocate"),
    BurstConfig(gap_mode="spin", align_bursts=False),
]


@pytest.mark.compile
@pytest.mark.parametrize("cfg", VARIANTS, ids=lambda c: f"{c.gap_mode}-{c.cache}-align{int(c.align_bursts)}")
def test_variant_compiles(cfg):
    ptx = BurstKernel(cfg).compile(keep_ptx=True).ptx
    assert ptx and ".target sm_90a" in ptx
    store = {None: r"st\.global\.v4\.b32", "cs": r"st\.global\.cs\.v4\.b32",
             "no_allocate": r"st\.global\.L1::no_allocate\.v4\.b32"}[cfg.cache]
    assert re.search(store, ptx)
    assert "%globaltimer" in ptx and "%clock64" in ptx
    assert ("mma.sync.aligned.m16n8k16" in ptx) == (cfg.gap_mode == "mma")
    assert ("red.relaxed.gpu.global.add.s32" in ptx) == cfg.align_bursts


def _ok(**kw):
    base = dict(num_producers=132, bytes_per_producer=65536, num_bursts=10, region_bytes=132 * 65536 * 4,
                dst_buffer_bytes=1 << 30, num_sms=132)
    base.update(kw)
    return base


def test_validate_launch_accepts_good():
    validate_launch(BurstConfig(), **_ok())
    validate_launch(BurstConfig(gap_mode="mma"), **_ok(mma_iters=100))


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(num_producers=0), "num_producers"),
        (dict(num_producers=133), "co-resident"),
        (dict(bytes_per_producer=1000), "multiple"),
        (dict(bytes_per_producer=0), "multiple"),
        (dict(num_bursts=0), "num_bursts"),
        (dict(region_bytes=132 * 65536 + 16), "multiple of the burst volume"),
        (dict(region_bytes=132 * 65536 * 4, dst_buffer_bytes=1024), "exceeds"),
        (dict(gap_ns=-1), "gap_ns"),
        (dict(mma_iters=5), "mma_iters given"),
    ],
)
def test_validate_launch_rejects(kw, match):
    with pytest.raises(ValueError, match=match):
        validate_launch(BurstConfig(), **_ok(**kw))


def test_validate_launch_mma_rejects_gap_ns():
    with pytest.raises(ValueError, match="gap_ns given"):
        validate_launch(BurstConfig(gap_mode="mma"), **_ok(gap_ns=1000))


@pytest.mark.parametrize("kw", [dict(threads=48), dict(gap_mode="sleep"), dict(cache="wt")])
def test_bad_config(kw):
    with pytest.raises(ValueError):
        BurstConfig(**kw)
