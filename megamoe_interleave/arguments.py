"""The fused kernel's launch arguments: one typed object, built once on the host (the host plan,
the device-side plan, the compile's fake tensors), whose field order is the kernel's parameter
order -- the only place that order is written.

The class is a plain ``NamedTuple`` here, so the host imports no DSL; :mod:`.kernel_sm90` gives it
the JIT-argument protocol (quack's ``mlir_namedtuple``), as quack's ``VarlenArguments`` has it, and
the compiled function takes the tuple as one argument (TVM-FFI checks every tensor in it).
"""
from __future__ import annotations

from typing import Any, NamedTuple

from .config import FP8_PRECISIONS, QUANT_BLOCK, TRACE_FIELDS

NUM_SCALAR_ARGS = 4  # after the arguments: max_tokens, topk, barrier_base, num_ctas


class MegaMoEArguments(NamedTuple):
    """Global tensors of one rank's launch (shapes: :func:`tensor_argument_spec`)."""

    mPeerX: Any  # (P,) int64: every rank's symmetric x
    mPeerCombine: Any  # (P,) int64: every rank's symmetric combine
    mPoolSrc: Any  # (n_pool, 3) int32: (source rank, token, pick), expert-major
    mPoolWeight: Any  # (n_pool,) f32 routing weights
    mPoolX: Any  # (n_pad, H): the dispatched rows; n_pad = n_pool + BLOCK_M (padded M tiles)
    mH: Any  # (n_pad, I): the L1 output
    mW1: Any  # (E_l, 2I, H): gate | up interleaved (weights.transform_weights)
    mW2: Any  # (E_l, H, I)
    mRowRecord: Any  # (n_rows, 4) int32: the scheduler rows (RowGrid.row_record)
    mScheduleTable: Any  # int32: wave row starts (expert_wave) or the pairs' L2 starts (interleaved)
    mCounters: Any  # int32 words: workspace.py's layout
    mTrace: Any  # (ctas, tiles, len(TRACE_FIELDS)) int64 (trace builds; else a stand-in)
    mPlan: Any  # (2,) int32: num_rows, n_pool (on the device, so a device-side plan can write them)
    # W8A8 (FP32, quant.py's layouts; bf16 builds never read them and take stand-ins)
    mPeerXScale: Any  # (P,) int64: every rank's symmetric x_scales
    mPoolXScale: Any  # (n_pad, H/128)
    mHScale: Any  # (n_pad, I/128)
    mW1Scale: Any  # (E_l, 2I/128, H/128)
    mW2Scale: Any  # (E_l, H/128, I/128)


# The W4A8 kernel's arguments: the same fields (mW1 / mW2 packed E2M1 codes (E_l, 2I, H/2) / (E_l, H, I/2)
# uint8, mW1Scale / mW2Scale the widened blocks' FP32 scales 2^r), then each row's shift words, int32
# (E_l, H/128, 2I) / (E_l, I/128, H): a row's four 32-group shifts of one K block, a byte each
# (quant_fp4.kernel_operands). A class of its own, so the other kernels' programs do not change.
MegaMoEArgumentsW4A8 = NamedTuple("MegaMoEArgumentsW4A8", [(f, Any) for f in MegaMoEArguments._fields]
                                  + [("mW1Shift", Any), ("mW2Shift", Any)])


def arguments_class(precision: str):
    """The launch-argument class of ``precision``'s kernel."""
    return MegaMoEArgumentsW4A8 if precision == "w4a8" else MegaMoEArguments


def tensor_argument_spec(hidden: int, intermediate: int, precision: str = "bf16"):
    """:class:`MegaMoEArguments` as (name, dtype name, shape) in field order; str dims are dynamic and
    agree wherever the same name appears. One definition for the compile
    (:func:`.kernel.fake_launch_arguments`) and the host-side check. BF16 builds take any
    [1, 1] / [1, 1, 1] scale stand-ins (and any (P,) table)."""
    q = QUANT_BLOCK
    if precision in FP8_PRECISIONS:
        ab = "float8_e4m3fn"
        scales = dict(mPoolXScale=("float32", ("n_pad", hidden // q)),
                      mHScale=("float32", ("n_pad", intermediate // q)),
                      mW1Scale=("float32", ("E_l", 2 * intermediate // q, hidden // q)),
                      mW2Scale=("float32", ("E_l", hidden // q, intermediate // q)))
    else:
        ab = "bfloat16"
        scales = dict(mPoolXScale=("float32", (1, 1)), mHScale=("float32", (1, 1)),
                      mW1Scale=("float32", (1, 1, 1)), mW2Scale=("float32", (1, 1, 1)))
    spec = dict(mPeerX=("int64", ("P",)), mPeerCombine=("int64", ("P",)), mPoolSrc=("int32", ("n_pool", 3)),
                mPoolWeight=("float32", ("n_pool",)), mPoolX=(ab, ("n_pad", hidden)),
                mH=(ab, ("n_pad", intermediate)), mW1=(ab, ("E_l", 2 * intermediate, hidden)),
                mW2=(ab, ("E_l", hidden, intermediate)), mRowRecord=("int32", ("n_rows", 4)),
                mScheduleTable=("int32", ("n_s",)), mCounters=("int32", ("n_c",)),
                mTrace=("int64", ("n_tc", "n_tt", len(TRACE_FIELDS))), mPlan=("int32", (2,)),
                mPeerXScale=("int64", ("P",)), **scales)
    if precision == "w4a8":
        spec.update(mW1=("uint8", ("E_l", 2 * intermediate, hidden // 2)),
                    mW2=("uint8", ("E_l", hidden, intermediate // 2)),
                    mW1Shift=("int32", ("E_l", hidden // q, 2 * intermediate)),
                    mW2Shift=("int32", ("E_l", intermediate // q, hidden)))
    return [(name, *spec[name]) for name in arguments_class(precision)._fields]


def check_launch_arguments(hidden: int, intermediate: int, args: MegaMoEArguments, precision: str = "bf16") -> None:
    """ValueError unless the torch tensors of ``args`` match :func:`tensor_argument_spec` (dtype,
    rank, static dims, consistent dynamic dims, row-major contiguity, alignment)."""
    import torch

    cls = arguments_class(precision)
    if not isinstance(args, cls):
        raise TypeError(f"expected {cls.__name__}, got {type(args).__name__}")
    bound = {}
    for (name, dtype, shape), t in zip(tensor_argument_spec(hidden, intermediate, precision), args):
        if t.dtype != getattr(torch, dtype):
            raise ValueError(f"{name}: dtype {t.dtype}, expected torch.{dtype}")
        if t.dim() != len(shape):
            raise ValueError(f"{name}: rank {t.dim()}, expected {len(shape)}")
        for i, (want, got) in enumerate(zip(shape, t.shape)):
            if isinstance(want, str):
                if bound.setdefault(want, got) != got:
                    raise ValueError(f"{name}: dim {i} = {got} but {want} = {bound[want]} elsewhere")
            elif want != got:
                raise ValueError(f"{name}: dim {i} = {got}, expected {want}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if name == "mRowRecord" and t.data_ptr() % 16:
            raise ValueError("mRowRecord must be 16-byte aligned (one vector load per record)")
        if name == "mPoolX" and t.is_cuda and t.data_ptr() % 128:
            raise ValueError("mPoolX must be 128-byte aligned (TMA tiles)")
