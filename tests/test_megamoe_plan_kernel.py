"""The device-side plan's CuTe DSL kernel (megamoe_interleave.plan_kernel): compiled for sm_90a
with PTX checks on the CPU; on a GPU, equal to plan_all_ranks (torch) exactly for random routings
(masked picks, zero-token experts, empty ranks, both schedules, several sizes)."""
import pytest
import torch

from megamoe_interleave.device_plan import plan_all_ranks
from megamoe_interleave.plan_kernel import DevicePlanSm90, compile_device_plan
from megamoe_interleave.scheduler import ExpertWaveSchedule, InterleavedSchedule

SCHEDULES = [ExpertWaveSchedule(), InterleavedSchedule(lead=2, balance_l2=True),
             InterleavedSchedule(lead=2)]
HIDDEN, INTER = 512, 256


@pytest.mark.parametrize("schedule", SCHEDULES, ids=["expert_wave", "interleaved_balanced", "interleaved"])
def test_the_plan_kernel_compiles_without_local_memory(schedule):
    plan = DevicePlanSm90(8, 512, 6, 8, row_block=256, schedule=schedule, num_pairs=66, pairs_l1=4, pairs_l2=2,
                          hidden=HIDDEN, intermediate=INTER)
    ptx = compile_device_plan(plan, keep_ptx=True).ptx
    assert ".local" not in ptx  # no spills or local arrays
    assert "st.global.v4.b32" in ptx  # one vector store per row record
    assert ptx.count("bar.sync") >= 3


def test_the_plan_kernel_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="shared memory"):
        DevicePlanSm90(8, 1 << 20, 8, 8, row_block=256, schedule=SCHEDULES[1], num_pairs=66, pairs_l1=4, pairs_l2=2,
                       hidden=HIDDEN, intermediate=INTER)
    with pytest.raises(ValueError, match="residue class"):
        DevicePlanSm90(1, 64, 2, 8, row_block=256, schedule=SCHEDULES[1], num_pairs=300, pairs_l1=4, pairs_l2=2,
                       hidden=HIDDEN, intermediate=INTER)


@pytest.mark.gpu
def test_the_plan_kernel_equals_the_torch_plan_exactly():
    from megamoe_interleave.plan_kernel import plan_all_ranks_kernel

    g = torch.Generator().manual_seed(11)
    for trial in range(36):
        P = [1, 2, 4, 8][trial % 4]
        el = [1, 3, 8, 32][trial % 4 if trial < 16 else (trial // 4) % 4]
        T = [1, 77, 300][trial % 3]
        k = min([1, 2, 6][(trial // 3) % 3], P * el)
        E = P * el
        idx = torch.randint(E, (P, T, k), generator=g)
        if trial % 5 == 0:  # a few hot experts, the rest get no token
            hot = torch.randperm(E, generator=g)[: max(1, E // 8)]
            idx = hot[torch.randint(len(hot), (P, T, k), generator=g)]
        idx = torch.where(torch.rand(P, T, k, generator=g) < [0.0, 0.1, 0.5][trial % 3], -1, idx)
        w = torch.rand(P, T, k, generator=g)
        num_tokens = torch.randint(0, T + 1, (P,), generator=g)
        if trial % 7 == 0:
            num_tokens[0] = 0
        split_m = (trial // 4) % 3 != 2  # a third: the pair splits N (128-row scheduler rows, half the pair tiles)
        kw = dict(experts_per_rank=el, row_block=256 if split_m else 128, schedule=SCHEDULES[trial % 3],
                  num_pairs=[66, 5, 1][trial % 3], pairs_l1=4 if split_m else 2, pairs_l2=2 if split_m else 1,
                  hidden=HIDDEN, intermediate=INTER,
                  experts_per_wave=[None, 1, 2][(trial // 2) % 3])
        args = (idx.cuda(), w.cuda(), num_tokens.cuda())
        want, got = plan_all_ranks(*args, **kw), plan_all_ranks_kernel(*args, **kw)
        for name in ("counts", "n_pool", "pool_src", "pool_weight", "num_rows", "row_record", "schedule_table"):
            a, b = getattr(want, name), getattr(got, name)
            assert a.shape == b.shape and torch.equal(a.cpu(), b.cpu()), f"trial {trial}: {name} differs"
