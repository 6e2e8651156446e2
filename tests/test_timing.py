"""Timing statistics (CPU) and the event/graph harness (GPU)."""
import pytest

from lab.timing import Timing, bench, bench_graph, ratio


def test_timing_stats():
    t = Timing([5.0, 1.0, 3.0, 2.0, 4.0])
    assert t.median_us == 3.0 and t.p10_us == 1.0 and t.p90_us == 5.0
    assert ratio(Timing([6.0]), Timing([3.0])) == 2.0
    assert t.as_dict()["trials"] == 5


def test_bad_arguments():
    with pytest.raises(ValueError):
        bench(lambda: None, iters=0)
    with pytest.raises(ValueError):
        bench_graph(lambda: None, replays=-1)


@pytest.mark.gpu
def test_bench_and_graph_measure_real_work():
    import torch

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    small = bench_graph(lambda: a @ a, replays=5, trials=5)
    big_a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    big = bench_graph(lambda: big_a @ big_a, replays=5, trials=5)
    assert 0 < small.median_us < big.median_us  # 8x the FLOPs must take longer
    eager = bench(lambda: a @ a, iters=5, trials=5)
    assert eager.median_us > 0
