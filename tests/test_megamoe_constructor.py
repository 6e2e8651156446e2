"""MegaMoE's constructor rejects misuse with a clear error before it resolves or allocates anything
(issue 43): a missing or wrong world, non-integer sizes, a config that is not a MegaMoEConfig (the
README's ``backend="torch"`` is a MegaMoE keyword, not a config field)."""
import numpy as np
import pytest

from megamoe_interleave import MegaMoE, MegaMoEConfig, api, make_world

SHAPE = dict(num_experts=16, hidden=128, intermediate=64, topk=2, max_tokens_per_rank=8)


@pytest.fixture
def world(monkeypatch):
    def no_allocation(*a, **k):
        raise AssertionError("MegaMoE allocated its buffer before rejecting its arguments")

    monkeypatch.setattr(api, "MegaMoEBuffer", no_allocation)
    return make_world("loopback", world_size=2, device="cpu")


@pytest.mark.parametrize("bad", [None, "loopback", 2, object()])
def test_world_must_be_a_world(world, bad):
    with pytest.raises(TypeError, match=r"world must be an xstage World \(make_world\("):
        MegaMoE(bad, **SHAPE)


@pytest.mark.parametrize("name,value", [("num_experts", 16.0), ("hidden", "128"), ("topk", True),
                                        ("max_tokens_per_rank", None), ("num_sms", 1.5)])
def test_sizes_must_be_ints(world, name, value):
    with pytest.raises(TypeError, match=f"{name} must be an int, got"):
        MegaMoE(world, **{**SHAPE, name: value})


def test_config_must_be_a_config(world):
    with pytest.raises(TypeError, match="backend is a keyword of MegaMoE itself: MegaMoE"):
        MegaMoE(world, *SHAPE.values(), "torch")  # backend passed where config goes
    with pytest.raises(TypeError, match="config must be a MegaMoEConfig or None, got dict"):
        MegaMoE(world, **SHAPE, config={"schedule": "auto"})
    with pytest.raises(ValueError, match="num_sms must be positive"):
        MegaMoE(world, **SHAPE, num_sms=0)


def test_backend_is_not_a_config_field():
    with pytest.raises(TypeError, match="backend"):
        MegaMoEConfig(precision="w8a8", backend="torch")


def test_numpy_sizes_and_the_readme_backend_still_work():
    moe = MegaMoE(make_world("loopback", world_size=2, device="cpu"),
                  **{**SHAPE, "num_experts": np.int64(16), "hidden": 512, "intermediate": 256},
                  config=MegaMoEConfig(precision="w8a8"), backend="torch")
    assert moe.backend == "torch" and moe.config.precision == "w8a8"
