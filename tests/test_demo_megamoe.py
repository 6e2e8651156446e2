"""The GPU main job's MoE part without a GPU: DeepGEMM's contiguous layout and the block / token
quantizers of the baseline, the summary table and the figure from a result of the demo's shape,
and the model's prediction it prints. CPU only."""
import pytest
import torch

from lab.megamoe import deepgemm, demo


def test_contiguous_rows_pad_every_expert_and_skip_empty_ones():
    m, M = deepgemm.contiguous_rows([3, 0, 130], 128)
    assert M == 128 + 256 and m.dtype == torch.int32
    assert m[:3].tolist() == [0] * 3 and (m[3:128] == -1).all()
    assert (m[128:258] == 2).all() and (m[258:] == -1).all()
    assert deepgemm.contiguous_rows([], 128)[1] == 0


def test_quantizers_round_trip_within_e4m3():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(2, 256, 384, generator=g)
    q, s = deepgemm.block_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 2, 3)
    back = (q.float().view(2, 2, 128, 3, 128) * s.view(2, 2, 1, 3, 1)).view_as(w)
    assert ((back - w).norm() / w.norm()) < 0.04  # E4M3: 3 mantissa bits
    q1, s1 = deepgemm.block_quantize(w, experts_per_pass=1)  # the passes change nothing
    assert torch.equal(q1.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s1, s)
    x = torch.randn(5, 256, generator=g)
    q, s = deepgemm.token_quantize(x)
    assert s.shape == (5, 2) and ((q.float().view(5, 2, 128) * s[:, :, None]).view_as(x) - x).norm() / x.norm() < 0.04


def test_deepgemm_absent_is_one_line():
    dg, why = deepgemm.load()
    assert (dg is None) == bool(why) and "\n" not in why


def test_megamoe_fork_absent_or_upstream_is_one_line(monkeypatch, capsys):
    """The fused SM90 Mega MoE fork baseline: absent -> one line; upstream DeepGEMM in its place (no
    fp8_mega_moe) -> one line naming what is missing; its command line refuses a non-Hopper host before
    building anything."""
    import sys
    import types

    from lab.megamoe import megamoe_fork

    dg, why = megamoe_fork.load()
    assert (dg is None) == bool(why) and "\n" not in why
    monkeypatch.setitem(sys.modules, "deep_gemm", types.SimpleNamespace(__version__="2.6.1"))
    dg, why = megamoe_fork.load()
    assert dg is None and "not the fp8 SM90 Mega MoE fork: no fp8_mega_moe" in why
    dg, why = megamoe_fork.load("nvfp4")
    assert dg is None and "not the nvfp4 SM90 Mega MoE fork: no nvfp4_mega_moe" in why
    nvfp4 = types.SimpleNamespace(**{name: None for name in megamoe_fork.FORKS["nvfp4"]})
    monkeypatch.setitem(sys.modules, "deep_gemm", nvfp4)
    assert megamoe_fork.load("nvfp4") == (nvfp4, "") and megamoe_fork.load("fp8")[0] is None
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            megamoe_fork.main(["--tokens", "64"])
        assert "needs a Hopper GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        megamoe_fork.main(["--trials", "2"])
    with pytest.raises(SystemExit):
        megamoe_fork.main(["--fork", "int4"])


def test_megamoe_fork_checks():
    """The forks' checks: FP8 within the W8A8 recipe's fp32 bound plus the kernel tolerance; NVFP4 within
    FORK_OVER_OURS_FP4 times our W4A8's error against fp32 on the same tokens."""
    from lab.megamoe import megamoe_fork
    from megamoe_interleave.reference import W8A8_FP32_REL_ERROR, W8A8_KERNEL_REL_ERROR

    fp8_bound = W8A8_FP32_REL_ERROR[1] + W8A8_KERNEL_REL_ERROR
    assert megamoe_fork.check_fork("fp8", fp8_bound * 0.99, {})["ok"]
    assert not megamoe_fork.check_fork("fp8", fp8_bound * 1.01, {})["ok"]
    ours = {"ours w4a8": {"vs_fp32": 0.2}}
    assert megamoe_fork.check_fork("nvfp4", 0.24, ours)["ok"]
    assert not megamoe_fork.check_fork("nvfp4", 0.26, ours)["ok"]


def test_rows_per_expert_counts_every_live_pick():
    shape = type("S", (), dict(num_experts=8))()
    idx = [torch.tensor([[0, 5], [5, -1]]), torch.tensor([[7, 1]])]
    assert deepgemm.rows_per_expert(shape, 2, idx) == [[1, 1, 0, 0], [0, 2, 0, 1]]


def _fake_deep_gemm(broken: bool):
    """A stand-in ``deep_gemm`` module on the CPU: the grouped GEMM dequantizes both operands (128 x 128
    weight blocks, 1 x 128 activation groups) and multiplies in fp32; ``broken`` writes zeros."""
    import types

    def gemm(a, b, d, m_indices, disable_ue8m0_cast=True):
        (x_q, x_s), (w_q, w_s) = a, b
        M, K = x_q.shape
        x = (x_q.float().view(M, K // 128, 128) * x_s[:, :, None]).view(M, K)
        for row in range(M):
            e = int(m_indices[row])
            if e < 0 or broken:
                d[row] = 0
                continue
            N = w_q.shape[1]
            w = (w_q[e].float().view(N // 128, 128, K // 128, 128) * w_s[e][:, None, :, None]).view(N, K)
            d[row] = (x[row] @ w.t()).to(d.dtype)

    return types.SimpleNamespace(__version__="fake", get_mk_alignment_for_contiguous_layout=lambda: 128,
                                 get_mn_major_tma_aligned_tensor=lambda t: t, m_grouped_fp8_gemm_nt_contiguous=gemm)


@pytest.mark.parametrize("broken", [False, True])
def test_deepgemm_paired_variant_checks_the_build_before_it_is_timed(monkeypatch, broken):
    """The benches' DeepGEMM variant: a callable over every rank's two GEMMs when DeepGEMM's L1 of rank 0's
    first expert is within 1 % of fp32, left out (None, with the check in the note) when it is not."""
    import sys

    monkeypatch.setitem(sys.modules, "deep_gemm", _fake_deep_gemm(broken))
    shape = type("S", (), dict(num_experts=4, hidden=256, intermediate=128))()
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(4, 256, 256, generator=g).to(torch.bfloat16)
    w2 = torch.randn(4, 256, 128, generator=g).to(torch.bfloat16)
    idx = [torch.tensor([[0, 1], [0, 3], [2, -1]])]
    run, note = deepgemm.paired_variant(shape, 1, w1, w2, idx)
    assert note["deepgemm"] == "DeepGEMM fake"
    err = note["check"]["relative_error_l1_expert0"]
    if broken:
        assert run is None and err > 0.5
    else:
        assert run is not None and err < 0.01
        run()


def _result():
    names = ["fused bf16", "fused w8a8", "torch bf16 GEMMs", "torch fp8 GEMMs"]
    variants = {n: dict(n_matched=9, median_ratio=0.97) for n in names if n != "torch bf16 GEMMs"}
    layers = dict(shape="s", checks={"bf16": dict(relative_error=3e-3, against="fp32 reference", ok=True)},
                  deepgemm="DeepGEMM not importable (x)", paired={"torch bf16 GEMMs": dict(
                      reference_clock_mhz=1980, variants=variants)},
                  median_us={n: 1000.0 + i for i, n in enumerate(names)}, tflops={n: 500.0 for n in names}, ok=True)
    world = dict(expert_wave_us=4400.0, interleaved_us=3800.0, speedup=1.15, matched_trials=9)
    pcie = {"shape": "s", "loopback": dict(world, speedup=1.0), "loopback+host": world, "auto": dict(schedule="interleaved"),
            "model": dict(platform="h200-pcie-host", R_bytes_per_s=52.6e9, combine_bytes=2 ** 27,
                          expert_wave_us=4500.0, interleaved_us=3900.0, speedup=4500 / 3900), "ok": True}
    return {"layers": layers, "xstage_pcie": pcie, "ok": True}


def test_summary_and_figure(capsys, tmp_path):
    demo.print_summary(_result())
    text = capsys.readouterr().out
    assert "0.970x its time" in text and "expert_wave / interleaved 1.150" in text and "picks interleaved" in text
    pytest.importorskip("matplotlib")
    assert demo.plot(_result(), tmp_path / "demo.png") and (tmp_path / "demo.png").stat().st_size > 10_000


def test_the_models_prediction_is_eq_11_over_the_whole_kernel():
    """What the demo prints as the model: kernel_rate_bounds with the control's times split 2:1."""
    from xstage import model

    il, ew = model.kernel_rate_bounds(2e-3, 1e-3, 52.6e9 * 2e-3, 52.6e9)  # V / R = 2 ms
    assert il == pytest.approx(3e-3) and ew == pytest.approx(4e-3)
    assert demo.L1_FLOP_SHARE == pytest.approx(2 / 3)


def test_deepgemm_bundle_is_unpacked_once_and_imported(tmp_path, monkeypatch):
    """XSTAGE_DEEPGEMM_BUNDLE: the package archive unpacked to root/dgu and imported from there, its
    compiled kernels to root/dgcache_u (DG_JIT_CACHE_DIR); a bundle without the archive is one line."""
    import io
    import sys
    import tarfile

    def tar_xz(path, files):
        with tarfile.open(path, "w:xz") as t:
            for name, text in files.items():
                data = text.encode()
                info = tarfile.TarInfo(name)
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))

    bundle, root = tmp_path / "bundle", tmp_path / "root"
    bundle.mkdir(), root.mkdir()
    tar_xz(bundle / "dgu.tar.xz", {"deep_gemm/__init__.py": "__version__ = 'bundled'\n"
                                                            "def m_grouped_fp8_gemm_nt_contiguous(*a, **k): pass\n"})
    tar_xz(bundle / "jit_cache_h200.tar.xz", {"dgcache_u/cache/k/kernel.cubin": "x"})
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "deep_gemm", raising=False)
    monkeypatch.delenv("DG_JIT_CACHE_DIR", raising=False)
    assert deepgemm.use_bundle(str(bundle), root=str(root))
    assert (root / "dgu" / "deep_gemm" / "__init__.py").exists() and (root / "dgcache_u" / "cache" / "k").is_dir()
    import os
    assert os.environ["DG_JIT_CACHE_DIR"] == str(root / "dgcache_u") and sys.path[0] == str(root / "dgu")
    import deep_gemm
    assert deep_gemm.__version__ == "bundled"
    monkeypatch.setenv("XSTAGE_DEEPGEMM_BUNDLE", str(tmp_path))
    dg, why = deepgemm.load()
    assert dg is None and "has no dgu.tar.xz" in why
