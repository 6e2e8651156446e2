"""xstage.cute_compile.cached's disk layer (XSTAGE_KERNEL_CACHE): a kernel compiled in one process
is an object file that another process (or machine) loads instead of compiling; the file name
changes with the key and with the text of the sources. CPU: compiles a tiny kernel for sm_90a."""
import types

import pytest

from xstage import cute_compile


def _tiny_kernel():
    import cutlass.cute as cute
    from cutlass import Float32
    from quack.compile_utils import make_fake_tensor

    @cute.kernel
    def double(a: cute.Tensor, b: cute.Tensor):
        t, _, _ = cute.arch.thread_idx()
        b[t] = a[t] * 2.0

    @cute.jit
    def launch(a: cute.Tensor, b: cute.Tensor, stream):
        double(a, b).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

    n = cute.sym_int()
    return cute_compile.compile_hopper(launch, make_fake_tensor(Float32, (n,), divisibility=1),
                                       make_fake_tensor(Float32, (n,), divisibility=1),
                                       cute_compile.fake_stream()).fn


@pytest.mark.compile
def test_a_kernel_on_disk_is_loaded_not_compiled(tmp_path, monkeypatch):
    monkeypatch.setenv(cute_compile.KERNEL_CACHE_ENV, str(tmp_path))
    key = ("TinyDouble", 1)
    sources = (cute_compile,)
    monkeypatch.setattr(cute_compile, "_CACHE", {})
    fn = cute_compile.cached(key, _tiny_kernel, sources=sources)
    path = cute_compile.disk_cache_path(key, sources)
    assert path.startswith(str(tmp_path)) and (tmp_path / path.rsplit("/", 1)[1]).stat().st_size > 1000
    monkeypatch.setattr(cute_compile, "_CACHE", {})  # a new process

    def must_not_compile():
        raise AssertionError("compiled although the object file exists")

    loaded = cute_compile.cached(key, must_not_compile, sources=sources)
    assert loaded is not fn and callable(loaded)


def test_the_file_name_follows_key_sources_and_environment(tmp_path, monkeypatch):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("x = 1\n")
    b.write_text("x = 2\n")
    mod_a, mod_b = types.SimpleNamespace(__file__=str(a)), types.SimpleNamespace(__file__=str(b))
    monkeypatch.setenv(cute_compile.KERNEL_CACHE_ENV, str(tmp_path / "cache"))
    base = cute_compile.disk_cache_path(("K", 1), (mod_a,))
    assert base == cute_compile.disk_cache_path(("K", 1), (mod_a,))
    assert base != cute_compile.disk_cache_path(("K", 2), (mod_a,))
    assert base != cute_compile.disk_cache_path(("K", 1), (mod_b,))
    monkeypatch.setenv("CUTE_DSL_LINEINFO", "1")
    assert base != cute_compile.disk_cache_path(("K", 1), (mod_a,))
    monkeypatch.delenv(cute_compile.KERNEL_CACHE_ENV)
    assert cute_compile.disk_cache_path(("K", 1), (mod_a,)) is None
