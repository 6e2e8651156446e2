"""The xDiT (xfuser) hook: the selection logic, and on the installed xfuser (CPU) its USP
signature, its attention backends, the patching of every module that holds USP, the fallback
into xfuser's own USP and the dispatch to the fused path. xfuser 0.7 refuses to import without an
accelerator build of torch, so the import here pretends a CUDA build (torch.version.cuda) for the
duration of the import only. In the project's venv (`scripts/test`, CI) xfuser is installed from
the `dit` extra and required; elsewhere these tests skip."""
import importlib
import importlib.metadata
import importlib.util
import os
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from fa4_a2a.integrations import xfuser as hook_mod
from fa4_a2a.integrations.xfuser import UspCall, unsupported_reason

BF16 = torch.bfloat16


def _qkv(B=1, H=8, S=64, D=128, dtype=BF16):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(B, H, S, D, generator=g).to(dtype) for _ in range(3))


def test_selection_takes_ulysses_only_calls_and_names_every_other_reason():
    q, k, v = _qkv()
    ok = UspCall(ulysses_degree=4, ring_degree=1, backend="SDPA")
    assert unsupported_reason(q, k, v, ok, on_hopper=True) is None
    cases = [
        (dict(ulysses_degree=1), "no Ulysses"), (dict(ring_degree=2), "ring attention"),
        (dict(joint_strategy="front"), "joint tensors"), (dict(attention_kwargs=True), "attention_kwargs"),
        (dict(kv_head_repeat=2), "grouped-query"), (dict(dropout_p=0.1), "dropout"),
        (dict(fp8_comms=True), "FP8 communication"), (dict(head_balance=True), "head balancing"),
        (dict(kv_cache=True), "KV cache"), (dict(backend="SAGE"), "not exact"),
        (dict(backend="FLASH_3_FP8"), "not exact"),
    ]
    for change, reason in cases:
        call = UspCall(**{**ok.__dict__, **change})
        assert reason in unsupported_reason(q, k, v, call, on_hopper=True), change
    assert "Hopper" in unsupported_reason(q, k, v, ok, on_hopper=False)
    assert "dtype" in unsupported_reason(*_qkv(dtype=torch.float32), ok, on_hopper=True)
    assert "head_dim" in unsupported_reason(*_qkv(D=96), ok, on_hopper=True)
    assert "divisible" in unsupported_reason(*_qkv(H=6), ok, on_hopper=True)
    assert "shapes" in unsupported_reason(q, k[:, :, :32], v, ok, on_hopper=True)


@pytest.fixture(scope="module")
def xfuser_usp():
    """xfuser's USP module, imported with torch.version.cuda set for the import only."""
    if os.environ.get("XSTAGE_REQUIRE_DIT") != "1" and importlib.util.find_spec("xfuser") is None:
        pytest.skip("xfuser not installed (the dit extra)")
    saved = torch.version.cuda
    torch.version.cuda = saved or "13.0"
    try:
        usp = importlib.import_module(hook_mod.USP_MODULE)
        importlib.import_module("xfuser.model_executor.layers.attention_processor")
    finally:
        torch.version.cuda = saved
    return usp


@pytest.fixture
def stub_state(xfuser_usp, monkeypatch):
    """xfuser's parallel and runtime state for one process: set ``degrees`` = (ulysses, ring)."""
    from xfuser.core.distributed.attention_backend import AttentionBackendType

    state = types.SimpleNamespace(attention_backend=AttentionBackendType.SDPA, fp8_comms=None,
                                  runtime_config=types.SimpleNamespace(use_spargeattn_head_balance=False))
    degrees = {"ulysses": 1, "ring": 1}
    monkeypatch.setattr(xfuser_usp, "get_runtime_state", lambda: state)
    monkeypatch.setattr(xfuser_usp, "get_ulysses_parallel_world_size", lambda: degrees["ulysses"])
    monkeypatch.setattr(xfuser_usp, "get_ring_parallel_world_size", lambda: degrees["ring"])
    monkeypatch.setattr(xfuser_usp, "get_sequence_parallel_world_size",
                        lambda: degrees["ulysses"] * degrees["ring"])
    return degrees


@pytest.fixture
def hook(xfuser_usp):
    h = hook_mod.enable()
    yield h
    h.disable()


def test_the_usp_signature_and_backends_we_rely_on(xfuser_usp):
    import inspect

    from xfuser.core.distributed.attention_backend import AttentionBackendType

    assert importlib.metadata.version("xfuser") == hook_mod.TESTED_VERSION
    params = inspect.signature(xfuser_usp.USP).parameters
    for name in ("query", "key", "value", "dropout_p", "is_causal", "joint_strategy", "attn_layer", "backend",
                 "attention_kwargs", "head_balance_layer", "kv_head_repeat"):
        assert name in params, f"xfuser's USP has no {name!r}"
    assert set(hook_mod.EXACT_BACKENDS) <= {m.name for m in AttentionBackendType}
    for name in ("get_runtime_state", "get_ulysses_parallel_world_size", "get_ring_parallel_world_size",
                 "_has_kv_cache"):
        assert callable(getattr(xfuser_usp, name)), name


def test_enable_patches_every_module_holding_usp_and_disable_restores(xfuser_usp):
    original = xfuser_usp.USP
    holders = [n for n, m in sys.modules.items() if n.startswith("xfuser") and getattr(m, "USP", None) is original]
    assert hook_mod.USP_MODULE in holders and "xfuser.model_executor.layers.attention_processor" in holders
    h = hook_mod.enable()
    try:
        assert hook_mod.enable() is h  # idempotent
        assert set(h.patched) == set(holders)
        assert all(sys.modules[n].USP is h.replacement for n in holders)
    finally:
        h.disable()
    assert all(sys.modules[n].USP is original for n in holders)


def test_fallback_runs_xfusers_own_usp(stub_state, hook, xfuser_usp, monkeypatch):
    """Ulysses degree 1: the hook hands the call to xfuser's USP, whose SDPA path runs on the CPU."""
    monkeypatch.setattr(hook_mod, "fused_usp", lambda *a, **k: pytest.fail("fused path taken"))
    q, k, v = _qkv(dtype=torch.float32)
    out = xfuser_usp.USP(q, k, v, dropout_p=0.0, is_causal=False)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))


def test_ulysses_only_calls_take_the_fused_path(stub_state, hook, xfuser_usp, monkeypatch):
    parallel_state = importlib.import_module("xfuser.core.distributed.parallel_state")
    group = object()
    monkeypatch.setattr(parallel_state, "get_sp_group", lambda: types.SimpleNamespace(ulysses_group=group))
    monkeypatch.setattr(hook_mod, "_on_hopper", lambda t: True)
    seen = []
    monkeypatch.setattr(hook_mod, "fused_usp", lambda q, k, v, g, causal: seen.append((q, g, causal)) or q)
    stub_state["ulysses"] = 4
    q, k, v = _qkv()
    attention_processor = sys.modules["xfuser.model_executor.layers.attention_processor"]
    assert attention_processor.USP(q, k, v, dropout_p=0.0, is_causal=True) is q
    assert len(seen) == 1 and seen[0][0] is q and seen[0][1] is group and seen[0][2] is True
    stub_state["ring"] = 2  # USP proper (ring x Ulysses): xfuser's path, which needs the real groups
    monkeypatch.setattr(hook_mod, "_log_once", lambda m: seen.append(m))
    with pytest.raises(Exception):
        attention_processor.USP(q, k, v, dropout_p=0.0, is_causal=False)
    assert "ring attention (ring_degree > 1)" in seen


@pytest.mark.gpu
def test_fused_usp_matches_sdpa_on_a_one_rank_group(one_rank_nccl_group):
    """The real kernel through the hook's layout ([B, H, S, D] in and out) on a one-rank NCCL group,
    against torch SDPA (xfuser's SDPA backend) and fp32."""
    from fa4_a2a.reference import attention_fp32

    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(2, 8, 2048, 128, generator=g, device="cuda", dtype=BF16) for _ in range(3))
    ours = hook_mod.fused_usp(q, k, v, one_rank_nccl_group)
    sdpa = F.scaled_dot_product_attention(q, k, v)
    assert ours.shape == q.shape and ours.is_contiguous()
    ref, _ = attention_fp32(*(x.transpose(1, 2) for x in (q, k, v)), 128 ** -0.5, False)
    e_ours, e_sdpa = ((x.float() - ref.transpose(1, 2)).abs().max().item() for x in (ours, sdpa))
    print(f"vs fp32: fused_usp {e_ours:.2e}, sdpa {e_sdpa:.2e}")
    assert e_ours <= max(2 * e_sdpa, 1e-2)
