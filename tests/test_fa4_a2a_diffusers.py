"""fa4_a2a.integrations.diffusers on the CPU, against the installed diffusers (the `dit` extra;
required in the project's venv, skipped elsewhere): registration, backend selection on a real
(tiny, random) FluxTransformer2DModel, the fallback to diffusers' native attention, and the
choice between FA4 alone, the fused Ulysses path and the fallback under context parallelism. The
kernel launch itself is replaced by an fp32 stand-in (the GPU test runs the kernel)."""
import logging
import os
import types

import pytest
import torch

from fa4_a2a.reference import attention_fp32

if os.environ.get("XSTAGE_REQUIRE_DIT") == "1":
    import diffusers
else:
    diffusers = pytest.importorskip("diffusers")

from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry  # noqa: E402

from fa4_a2a.integrations import diffusers as fd  # noqa: E402

BF16 = torch.bfloat16


def _tiny_flux():
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                             attention_head_dim=64, num_attention_heads=2, joint_attention_dim=32,
                                             pooled_projection_dim=32, axes_dims_rope=(16, 24, 24))
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(1, 16, 4, generator=g), encoder_hidden_states=torch.randn(1, 8, 32, generator=g),
                  pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]),
                  img_ids=torch.randn(16, 3, generator=g), txt_ids=torch.zeros(8, 3))
    return model.to(BF16), {k: v.to(BF16) if v.is_floating_point() else v for k, v in inputs.items()}


def _forward(model, inputs, backend):
    model.set_attention_backend(backend)
    with torch.no_grad():
        return model(**inputs).sample.float()


def test_register_adds_a_context_parallel_backend():
    assert fd.register() == fd.register() == fd.BACKEND
    member = AttentionBackendName(fd.BACKEND)
    assert member.value in {m.value for m in AttentionBackendName.__members__.values()}
    assert _AttentionBackendRegistry._backends[member] is fd.fa4_a2a_attention
    assert _AttentionBackendRegistry._is_context_parallel_available(member)


def test_old_diffusers_is_refused(monkeypatch):
    monkeypatch.setattr(diffusers, "__version__", "0.35.2")
    with pytest.raises(RuntimeError, match="needs diffusers >= 0.36"):
        fd.register()


def test_without_a_hopper_gpu_the_model_runs_diffusers_native_attention(caplog, monkeypatch):
    fd.register()
    monkeypatch.setattr(fd, "_logged", set())
    model, inputs = _tiny_flux()
    want = _forward(model, inputs, "native")
    with caplog.at_level(logging.WARNING, logger=fd.__name__):
        got = _forward(model, inputs, fd.BACKEND)
    assert torch.equal(got, want)
    msgs = [r.getMessage() for r in caplog.records if r.name == fd.__name__]
    assert msgs == ["xstage_fa4_a2a: the kernel needs a Hopper GPU (sm_90); using diffusers' native attention"]


def test_the_model_forward_through_the_kernel_path(monkeypatch):
    """Every attention of the model (joint and single blocks) goes to FA4; with an fp32 stand-in
    for the launch the model's output matches the native backend's within bf16 rounding."""
    fd.register()
    calls = []

    def fake_local(q, k, v, out, *, softmax_scale=None, causal=False):
        calls.append(tuple(q.shape))
        o, _ = attention_fp32(q, k, v, softmax_scale or q.shape[-1] ** -0.5, causal)
        out.copy_(o.to(out.dtype))

    model, inputs = _tiny_flux()
    want = _forward(model, inputs, "native")
    monkeypatch.setattr(fd, "_on_hopper", lambda t: True)
    monkeypatch.setattr(fd.interface, "attention_local", fake_local)
    got = _forward(model, inputs, fd.BACKEND)
    assert calls == [(1, 24, 2, 64), (1, 24, 2, 64)]  # joint block (8 text + 16 image tokens), single block
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


def _cp(ulysses, ring=1, anything=False, group="G"):
    mesh = types.SimpleNamespace(get_group=lambda: group)
    cfg = types.SimpleNamespace(ulysses_degree=ulysses, ring_degree=ring, ulysses_anything=anything, _ulysses_mesh=mesh)
    return types.SimpleNamespace(context_parallel_config=cfg)


@pytest.mark.parametrize("case,expect", [
    (dict(cp=_cp(2)), "fused"), (dict(cp=_cp(1)), "local"), (dict(cp=None), "local"),
    (dict(cp=_cp(2, ring=2)), "native"), (dict(cp=_cp(2, anything=True)), "native"), (dict(cp=_cp(3)), "native"),
    (dict(cp=_cp(2), D=96), "native"), (dict(cp=_cp(2), dtype=torch.float32), "native"),
    (dict(cp=_cp(2), mask=True), "native"), (dict(cp=_cp(2), dropout=0.1), "native"),
    (dict(cp=_cp(2), kv_heads=2), "native")])
def test_path_selection(case, expect, monkeypatch):
    seen = []
    monkeypatch.setattr(fd, "_on_hopper", lambda t: True)
    monkeypatch.setattr(fd, "_logged", set())
    monkeypatch.setattr(fd, "world_for_group", lambda group: ("world", group))
    monkeypatch.setattr(fd, "ulysses_attention", lambda q, k, v, world, softmax_scale, causal:
                        seen.append(("fused", world, softmax_scale, causal)) or q)
    monkeypatch.setattr(fd.interface, "attention_local", lambda q, k, v, out, softmax_scale, causal:
                        seen.append(("local", softmax_scale, causal)))
    native = AttentionBackendName.NATIVE
    monkeypatch.setitem(_AttentionBackendRegistry._backends, native, lambda q, k, v, **kw: seen.append(("native",)) or q)
    D, dtype = case.get("D", 64), case.get("dtype", BF16)
    q = torch.zeros(1, 8, 4, D, dtype=dtype)
    k, v = (torch.zeros(1, 8, case.get("kv_heads", 4), D, dtype=dtype) for _ in range(2))
    mask = torch.ones(1, 8, dtype=torch.bool) if case.get("mask") else None
    fd.fa4_a2a_attention(q, k, v, attn_mask=mask, dropout_p=case.get("dropout", 0.0), scale=0.1, is_causal=False,
                         _parallel_config=case["cp"])
    assert [s[0] for s in seen] == [expect]
    if expect == "fused":
        assert seen[0][1:] == (("world", "G"), 0.1, False)


@pytest.mark.gpu
def test_flux_forward_through_fa4_matches_native_on_the_gpu():
    """The real kernel (FA4, no context parallelism) inside a random Flux transformer against
    diffusers' native SDPA backend: the errors are printed and bounded at bf16 rounding."""
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)):
        pytest.skip("needs a Hopper GPU")
    fd.register()
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                                             attention_head_dim=128, num_attention_heads=4, joint_attention_dim=64,
                                             pooled_projection_dim=64, axes_dims_rope=(16, 56, 56)).to("cuda", BF16)
    g = torch.Generator(device="cuda").manual_seed(1)
    n, t = 1024, 128
    inputs = dict(hidden_states=torch.randn(1, n, 16, generator=g, device="cuda", dtype=BF16),
                  encoder_hidden_states=torch.randn(1, t, 64, generator=g, device="cuda", dtype=BF16),
                  pooled_projections=torch.randn(1, 64, generator=g, device="cuda", dtype=BF16),
                  timestep=torch.tensor([0.5], device="cuda", dtype=BF16),
                  img_ids=torch.randn(n, 3, generator=g, device="cuda"), txt_ids=torch.zeros(t, 3, device="cuda"))
    want = _forward(model, inputs, "native")
    got = _forward(model, inputs, fd.BACKEND)
    err = (got - want).abs()
    rel = err.max().item() / want.abs().max().item()
    print(f"flux forward, fa4_a2a backend vs native: max abs {err.max().item():.3e}, max rel {rel:.3e}")
    assert torch.isfinite(got).all() and rel < 2e-2
