"""First line of defence without a GPU: a CuTe DSL kernel compiles for sm_90a.

Uses the same mechanism as every kernel of the project
(:func:`xstage.cute_compile.compile_hopper`). On a Hopper host the same
kernel also runs and is checked against torch.
"""
import pytest

from xstage.cute_compile import compile_hopper, fake_stream, fake_tensor


def _axpy():
    import cutlass.cute as cute
    from cutlass import Float32

    @cute.kernel
    def axpy_kernel(x: cute.Tensor, y: cute.Tensor, a: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * 128 + tidx
        if i < x.shape[0]:
            y[i] = a * x[i] + y[i]

    @cute.jit
    def axpy(x: cute.Tensor, y: cute.Tensor, a: Float32, stream):
        n = x.shape[0]
        axpy_kernel(x, y, a).launch(grid=[(n + 127) // 128, 1, 1], block=[128, 1, 1], stream=stream)

    return axpy


@pytest.mark.compile
def test_small_kernel_compiles_for_sm90a():
    import cutlass
    import cutlass.cute as cute

    n = cute.sym_int()
    x = fake_tensor(cutlass.Float32, (n,), stride=(1,))
    y = fake_tensor(cutlass.Float32, (n,), stride=(1,))
    c = compile_hopper(_axpy(), x, y, cutlass.Float32(2.0), fake_stream(), keep_ptx=True)
    assert c.ptx is not None
    assert ".target sm_90a" in c.ptx
    assert "fma.rn.f32" in c.ptx


@pytest.mark.gpu
def test_small_kernel_runs_on_hopper():
    import cutlass
    import cutlass.cute as cute
    import torch

    n = cute.sym_int()
    c = compile_hopper(_axpy(), fake_tensor(cutlass.Float32, (n,), stride=(1,)),
                       fake_tensor(cutlass.Float32, (n,), stride=(1,)), cutlass.Float32(2.0), fake_stream())
    x = torch.randn(100_003, device="cuda")
    y = torch.randn_like(x)
    ref = 2.0 * x.double() + y.double()
    c(x, y, 2.0)
    torch.cuda.synchronize()
    torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-6)
