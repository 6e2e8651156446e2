"""Integer arithmetic that runs on Python ints (the CPU references, the host plan) and on CuTe DSL
Int32 values (the kernel, at trace time), so that one scheduler definition serves both: Python
values take the Python path, DSL values emit the matching index arithmetic."""
from __future__ import annotations


def is_py(x) -> bool:
    return isinstance(x, (bool, int))


def select(cond, a, b):
    """``a if cond else b`` for Python values and for DSL dynamic values."""
    if is_py(cond):
        return a if cond else b
    import cutlass  # deferred: the reference must not need the DSL

    return cutlass.Int32(cutlass.select_(cond, a, b))


DIVMOD_SMALL_MAX = 1 << 20  # divmod_small's dividends stay below this


def divmod_small(a, b):
    """``(a // b, a % b)`` for 0 <= a < 2**20 (:data:`DIVMOD_SMALL_MAX`) and b >= 1: exact
    integers on the host; in the kernel through one ``rcp.approx`` instead of an integer
    division (whose code made ptxas serialize the fused kernel's WGMMAs). Exact: (a + 1/2) / b
    lies at least 1 / (2 b) from an integer, and the float error (rcp.approx's 1 ulp plus the
    product's rounding, <= 1.5 * 2^-23 relative) is at most (a + 1/2) / b * 1.5 * 2^-23, which
    is below 1 / (2 b) while a + 1/2 < 2^22 / 3."""
    if is_py(a) and is_py(b):
        return a // b, a % b
    import cutlass
    import cutlass.cute as cute

    q = cutlass.Int32((cutlass.Float32(a) + 0.5) * cute.arch.rcp_approx(cutlass.Float32(b)))
    return q, a - q * b


def logical_and(a, b):
    if is_py(a) and is_py(b):
        return bool(a) and bool(b)
    return a & b


def logical_or(a, b):
    if is_py(a) and is_py(b):
        return bool(a) or bool(b)
    return a | b


def logical_not(a):
    if is_py(a):
        return not a
    import cutlass

    return cutlass.Boolean(cutlass.select_(a, False, True))


def as_int(x):
    """Boolean -> 0/1 integer (Python) or Int32 (DSL)."""
    if is_py(x):
        return int(bool(x))
    import cutlass

    return cutlass.Int32(cutlass.select_(x, 1, 0))
