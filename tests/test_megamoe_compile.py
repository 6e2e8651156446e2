"""CPU compile checks (sm_90a) of the MoE kernels for both schedulers."""
import pytest

from megamoe_interleave.scheduler import Schedule

SCHEDULES = [Schedule("expert_wave"), Schedule("interleaved", lead=3)]


@pytest.mark.compile
@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
def test_schedule_trace_compiles(schedule):
    from megamoe_interleave.schedule_trace import compile_schedule_trace

    assert compile_schedule_trace(schedule, 8, 16) is not None


@pytest.mark.compile
@pytest.mark.parametrize("mma", ["wgmma", "wgmma_cpasync", "fma"])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
def test_fused_kernel_compiles(schedule, mma):
    from megamoe_interleave.kernel_sm90 import compile_megamoe_sm90

    assert compile_megamoe_sm90(256, 128, schedule, block_n=64, mma=mma) is not None


@pytest.mark.compile
def test_fused_kernel_with_trace_compiles():
    from megamoe_interleave.kernel_sm90 import compile_megamoe_sm90

    assert compile_megamoe_sm90(256, 128, SCHEDULES[1], block_n=64, mma="wgmma_cpasync", trace=True) is not None


@pytest.mark.compile
@pytest.mark.parametrize("mma,block_m,block_n,stages", [("wgmma_cpasync", 128, 256, 3), ("wgmma", 128, 128, 2)])
def test_fused_kernel_two_warpgroups_compiles(mma, block_m, block_n, stages):
    """128-row tiles: two consumer warpgroups; 128x256x3 stages aliases the fp32 staging tile."""
    from megamoe_interleave.kernel_sm90 import MegaMoESm90, compile_megamoe_sm90

    op = MegaMoESm90(512, 256, SCHEDULES[1], block_m=block_m, block_n=block_n, mma=mma, stages=stages)
    assert op.num_threads == 256 and op.alias_c == (block_n == 256)
    assert compile_megamoe_sm90(512, 256, SCHEDULES[1], block_m=block_m, block_n=block_n, mma=mma,
                                stages=stages) is not None


def test_kernel_rejects_bad_tiling():
    from megamoe_interleave.kernel_sm90 import MegaMoESm90

    with pytest.raises(ValueError):
        MegaMoESm90(192, 128, SCHEDULES[0], block_n=64)  # H not a multiple of 2*block_n
    with pytest.raises(ValueError):
        MegaMoESm90(256, 128, SCHEDULES[0], block_n=24)
    with pytest.raises(ValueError):
        MegaMoESm90(256, 128, SCHEDULES[0], block_n=64, block_m=96, mma="wgmma")
    with pytest.raises(ValueError):
        MegaMoESm90(256, 128, SCHEDULES[0], block_n=64, block_m=64, num_threads=256, mma="wgmma")
    with pytest.raises(ValueError):  # shared memory does not fit
        MegaMoESm90(1024, 512, SCHEDULES[0], block_n=256, block_m=128, mma="wgmma_cpasync", stages=8)
    with pytest.raises(ValueError):
        MegaMoESm90(256, 128, SCHEDULES[0], mma="tf32")
