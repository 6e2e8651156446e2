"""The W8A8 layer's input staging on the GPU: bf16 ``x [T, H]`` -> E4M3 rows and one FP32 scale per
token and 128 columns (:func:`quant.quantize_act`'s recipe, bit for bit), written straight into the
layer's symmetric buffers by one small CuTe DSL kernel.

The torch recipe takes about six kernels and fp32 copies of x (about 1.3 GB of traffic at 8192
tokens of DeepSeek-V4-Flash, and six graph nodes at decode batches). Here each thread owns 8
columns (one 16-byte load): 16 threads share a 128-column group, reduce its amax by shuffles, and
each stores its 8 E4M3 bytes and, for one of them, the group's scale. Same rounding as torch on a
GPU: ``scale = max(amax, 1e-4) * fl32(1/448)`` (torch multiplies by the reciprocal of a scalar
divisor), ``q = e4m3_rn_satfinite(x * rcp_rn(scale))`` (``1.0 / scales`` is torch's correctly
rounded reciprocal, and the recipe's clamp to +-448 is the saturation). NaN propagates as in torch.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from xstage.device import cvt_e4m3x2, rcp_rn

from .config import QUANT_BLOCK
from .quant import AMAX_FLOOR, E4M3_MAX
from .row_kernel import VEC, RowChunkKernel, compile_row_kernel, compiled_row_kernel

GROUP_THREADS = QUANT_BLOCK // VEC  # threads sharing one scale (16: a half warp)


class ActQuantSm90(RowChunkKernel):
    """``mX`` [T, H] bf16 -> ``mQ`` [T, H / 4] int32 (the E4M3 bytes, 4 per word) and ``mS`` [T, H / 128] f32."""

    multiple, why = QUANT_BLOCK, f"1x{QUANT_BLOCK} scale groups"

    @cute.jit
    def __call__(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, stream):
        self.launch_chunks(self.kernel(mX, mQ, mS), cute.size(mX, mode=[0]), stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor):
        t, c = self.thread_chunk()
        num_tokens = cute.size(mX, mode=[0])
        # Threads past the last token load its row again: all 16 of a group take part in the
        # shuffles (a group may straddle the end when hidden / 8 is not a multiple of 32).
        t_load = cutlass.min(t, num_tokens - 1)
        v = cute.make_rmem_tensor((VEC,), Float32)
        v.store(cute.local_tile(mX, (1, VEC), (t_load, c)).load().to(Float32).reshape((VEC,)))
        amax = Float32(0.0)
        for j in cutlass.range_constexpr(VEC):
            amax = cute.arch.fmax(amax, cute.arch.fmax(v[j], -v[j], nan=True), nan=True)
        for k in cutlass.range_constexpr(4):
            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=GROUP_THREADS >> (k + 1)), nan=True)
        scale = cute.arch.fmax(amax, Float32(AMAX_FLOOR), nan=True) * Float32(1.0 / E4M3_MAX)
        inv = rcp_rn(scale)
        words = cute.make_rmem_tensor((2,), Int32)
        for w in cutlass.range_constexpr(2):
            lo = cvt_e4m3x2(v[4 * w] * inv, v[4 * w + 1] * inv)
            hi = cvt_e4m3x2(v[4 * w + 2] * inv, v[4 * w + 3] * inv)
            words[w] = lo | (hi << 16)
        if t < num_tokens:
            cute.local_tile(mQ, (1, 2), (t, c)).store(words.load().reshape((1, 2)))
            if c % GROUP_THREADS == 0:
                mS[t, c // GROUP_THREADS] = scale


def fake_arguments(hidden: int):
    from xstage.cute_compile import fake_stream, fake_tensor

    T = cute.sym_int()
    return (fake_tensor(BFloat16, (T, hidden), stride=(hidden, 1)),
            fake_tensor(Int32, (T, hidden // 4), stride=(hidden // 4, 1)),
            fake_tensor(Float32, (T, hidden // QUANT_BLOCK), stride=(hidden // QUANT_BLOCK, 1)), fake_stream())


def compile_act_quant(hidden: int, *, keep_ptx: bool = False):
    """Compile for CUTE_DSL_ARCH with fake tensors (no GPU needed); returns xstage's Compiled."""
    return compile_row_kernel(ActQuantSm90, hidden, fake_arguments, keep_ptx=keep_ptx)


def compiled_act_quant(hidden: int):
    """The staging kernel for rows of ``hidden`` bf16 elements, compiled once (on any host)."""
    return compiled_row_kernel(ActQuantSm90, hidden, fake_arguments)


def quantize_act_into(x, q, s) -> None:
    """:func:`quant.quantize_act` of CUDA bf16 ``x [T, H]`` written into ``q`` (E4M3 [T, H]) and ``s``
    (f32 [T, H / 128]), both row-contiguous (e.g. the leading rows of the layer's buffers)."""
    import torch

    T, H = x.shape
    if (x.dtype != torch.bfloat16 or q.dtype != torch.float8_e4m3fn or s.dtype != torch.float32
            or q.shape != (T, H) or s.shape != (T, H // QUANT_BLOCK)):
        raise ValueError(f"need bf16 x [T, H] -> e4m3 [T, H] and f32 [T, H/{QUANT_BLOCK}], got {x.dtype} "
                         f"{tuple(x.shape)}, {q.dtype} {tuple(q.shape)}, {s.dtype} {tuple(s.shape)}")
    if T:
        compiled_act_quant(H)(x.contiguous(), q.view(torch.int32), s)
