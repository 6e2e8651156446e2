"""CuTe DSL device helpers shared by every xstage kernel.

One place for the few PTX-level operations the kernels need, each a thin
wrapper over ``cute.arch`` so the emitted instruction is explicit:

===========================  ===============================================
helper                        PTX (sm_90a)
===========================  ===============================================
``peer_address``              ``ld.global.b64`` of ``peer_table[dst]`` + add
``store_v4``                  ``st.global.v4.b32`` (``.cs`` / ``L1::no_allocate``
                              variants via ``cache``)
``store_v4_to_peer``          both of the above
``stmatrix_x4``               ``stmatrix.sync.aligned.m8n8.x4.shared.b16``
                              (four 8x8 bf16 tiles, one 16-byte row per lane)
``globaltimer_ns``            ``mov.u64 %rd, %globaltimer`` (ns, GPU-wide)
``clock64``                   ``mov.u64 %rd, %clock64`` (SM cycles, per SM)
``smid``                      ``mov.u32 %r, %smid``
``load_acquire``              ``ld.acquire.{gpu,sys}.global.b32``
``load_relaxed``              ``ld.relaxed.{gpu,sys}.global.b32``
``store_release``             ``st.release.{gpu,sys}.global.b32``
``red_add_release``           ``red.release.{gpu,sys}.global.add.s32``
``red_add_relaxed``           ``red.relaxed.{gpu,sys}.global.add.s32``
``spin_wait_ge``              bounded acquire/relaxed poll; on timeout it
                              ``atom.or``s an error code into an error flag
``mbarrier_wait_bounded``     ``mbarrier.try_wait.parity`` retried until a
                              ``%globaltimer`` deadline; on timeout the same
                              error-word protocol as ``spin_wait_ge``
``mbarrier_wait_in_step``     the same for a ring shared by a CTA pair: past
                              the deadline it reports, then waits on for at
                              most a count of ``try_wait``s
``grid_arrive_and_wait``      one-thread-per-CTA counter barrier built on
                              ``red_add_relaxed`` + ``spin_wait_ge``
===========================  ===============================================

Conventions
-----------
* Remote (peer) addresses are plain ``Int64`` virtual addresses: a rank's
  peer table is an int64 tensor ``[P]`` built by :mod:`xstage.world`, and
  ``peer_table[dst] + byte_offset`` is a generic address that the SM can
  store to (NVLink peer mapping, symmetric memory, or pinned host memory
  under UVA).  Addresses must be 16-byte aligned for ``store_v4``: the
  helper promises alignment to the compiler, it does not check it (the
  host checks offsets before launch).
* Flags are ``Int32`` words addressed by a ``cute.Pointer`` (e.g.
  ``flags.iterator + i``) in global memory.
* Every spin is bounded: ``spin_wait_ge`` (global flags) and
  ``mbarrier_wait_bounded`` (shared-memory mbarrier phases, e.g. the
  full/empty barriers of a TMA pipeline) give up after ``timeout_ns`` of
  ``%globaltimer`` time, records ``error_code`` in an error word with an
  atomic OR and returns ``False``.  The host reads the error word after the
  kernel and raises (see :func:`raise_on_device_error`).  Kernels must not
  loop on a wait that can fail.
* ``%globaltimer`` is GPU-wide and comparable across SMs, but its update
  granularity is implementation-defined (calibrate it); ``%clock64`` counts
  the SM's own cycles and is only comparable within one SM.
"""
from __future__ import annotations



import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64, const_expr
from cutlass.base_dsl.typing import Vector
from cutlass.cutlass_dsl import dsl_user_op

__all__ = [
    "STORE_CACHE_HINTS",
    "ERR_SPIN_TIMEOUT",
    "ERR_BARRIER_TIMEOUT",
    "ERR_MBARRIER_TIMEOUT",
    "ERR_ROUTING",
    "peer_address",
    "store_v4",
    "store_v4_to_peer",
    "bulk_copy_g2s",
    "bulk_copy_s2g",
    "globaltimer_ns",
    "clock64",
    "smid",
    "load_acquire",
    "load_relaxed",
    "store_release",
    "red_add_release",
    "red_add_relaxed",
    "atomic_or_relaxed",
    "spin_wait_ge",
    "mbarrier_wait_bounded",
    "mbarrier_wait_in_step",
    "mbarrier_wait_tries",
    "spin_wait_ge_tries",
    "nanosleep",
    "BULK_CACHE_POLICIES",
    "grid_arrive_and_wait",
    "raise_on_device_error",
    "DeviceError",
]

# Cache hints accepted by ``store_v4``: None (plain write-back store),
# "cs" (streaming, evict-first) and "no_allocate" (do not allocate in L1).
STORE_CACHE_HINTS = (None, "cs", "no_allocate")

# Error codes written (OR-ed) into a kernel's error word.  Bit flags, so that
# several failures in one launch stay distinguishable.
ERR_SPIN_TIMEOUT = 1
ERR_BARRIER_TIMEOUT = 2
ERR_MBARRIER_TIMEOUT = 4
ERR_ROUTING = 8  # set by torch ops before a launch (MegaMoE's device-side plan), not by a spin


class DeviceError(RuntimeError):
    """A kernel reported a failure through its error word."""


_ERROR_NAMES = {
    ERR_SPIN_TIMEOUT: "bounded spin-wait timed out (a flag never reached its target)",
    ERR_BARRIER_TIMEOUT: "grid barrier timed out (CTAs not co-resident, or a producer stalled)",
    ERR_MBARRIER_TIMEOUT: "shared-memory mbarrier wait timed out (a pipeline stage was never filled or released)",
    ERR_ROUTING: "an expert id outside [-1, num_experts) in topk_idx (the pick was dropped; its output is invalid)",
}


def raise_on_device_error(error_word, what: str = "kernel") -> None:
    """Raise :class:`DeviceError` if a kernel's int32 error word is non-zero.

    ``error_word``: a torch tensor (any device) whose first element is the
    error word, or an int.  Call after synchronizing with the kernel.
    """
    code = int(error_word.reshape(-1)[0].item()) if hasattr(error_word, "reshape") else int(error_word)
    if code == 0:
        return
    names = [msg for bit, msg in _ERROR_NAMES.items() if code & bit]
    unknown = code & ~sum(_ERROR_NAMES)
    if unknown:
        names.append(f"unknown error bits 0x{unknown:x}")
    raise DeviceError(f"{what}: device error 0x{code:x}: " + "; ".join(names))


# ---------------------------------------------------------------------------
# Addresses and 16-byte stores
# ---------------------------------------------------------------------------


@dsl_user_op
def peer_address(peer_table: cute.Tensor, dst, byte_offset, *, loc=None, ip=None) -> Int64:
    """Return ``peer_table[dst] + byte_offset`` as an Int64 virtual address.

    ``peer_table``: int64 tensor ``[P]`` of per-rank base addresses as seen
    from the calling rank (see :meth:`xstage.world.SymmetricTensor.peer_table`).
    """
    return Int64(peer_table[dst]) + Int64(byte_offset)


@dsl_user_op
def store_v4(address, w0, w1, w2, w3, cache: cutlass.Constexpr = None, *, loc=None, ip=None) -> None:
    """16-byte store ``st.global[.cs|.L1::no_allocate].v4.b32 [address], {w0..w3}``.

    ``address``: Int64 generic address, 16-byte aligned (promised to the
    compiler, not checked).  ``cache``: one of :data:`STORE_CACHE_HINTS`.
    """
    if const_expr(cache not in STORE_CACHE_HINTS):
        raise ValueError(f"cache must be one of {STORE_CACHE_HINTS}, got {cache!r}")
    ptr = cute.make_ptr(Int32, Int64(address), cute.AddressSpace.gmem, assumed_align=16, loc=loc, ip=ip)
    vec = Vector.from_elements(
        (Int32(w0), Int32(w1), Int32(w2), Int32(w3)), Int32, loc=loc, ip=ip
    ).ir_value()
    if const_expr(cache == "cs"):
        cute.arch.store(ptr.llvm_ptr, vec, cop="cs", loc=loc, ip=ip)
    elif const_expr(cache == "no_allocate"):
        cute.arch.store(ptr.llvm_ptr, vec, level1_eviction_priority="evict_no_allocate", loc=loc, ip=ip)
    else:
        cute.arch.store(ptr.llvm_ptr, vec, loc=loc, ip=ip)


@dsl_user_op
def store_v4_to_peer(
    peer_table: cute.Tensor, dst, byte_offset, w0, w1, w2, w3, cache: cutlass.Constexpr = None, *, loc=None, ip=None
) -> None:
    """16-byte store of ``{w0..w3}`` to ``peer_table[dst] + byte_offset``."""
    store_v4(peer_address(peer_table, dst, byte_offset, loc=loc, ip=ip), w0, w1, w2, w3, cache, loc=loc, ip=ip)


# L2 cache policies of the bulk copies (``.L2::cache_hint``): None or "evict_first" (data used
# once: it does not push reused lines out of L2). (An evict-last policy with L2 discards of the
# dead lines was measured and reverted: docs/experiments.md, `dispatch_keep`.)
# The policy is created inside the copy's own asm block (a scoped register), so no 64-bit
# policy stays live across the caller's loop -- in the fused MoE kernel a live policy register
# made ptxas serialize the consumers' WGMMAs.
BULK_CACHE_POLICIES = (None, "evict_first")


def _bulk_copy(op: str, operands: str, args, policy, loc, ip) -> None:
    """``op operands;``, or with a ``policy`` ``op.L2::cache_hint operands, policy;`` in a block
    that creates the policy."""
    if policy not in BULK_CACHE_POLICIES:
        raise ValueError(f"bulk copy cache policy must be one of {BULK_CACHE_POLICIES}, got {policy!r}")
    if policy is None:
        code = op + " " + operands + ";"
    else:
        code = ("{ .reg .b64 xs_pol; createpolicy.fractional.L2::" + policy + ".b64 xs_pol, 1.0; "
                + op + ".L2::cache_hint " + operands + ", xs_pol; }")
    cute.arch.inline_ptx(code, read_only_args=args, loc=loc, ip=ip)


@dsl_user_op
def bulk_copy_g2s(smem: cute.Pointer, address, nbytes, mbar: cute.Pointer, policy: cutlass.Constexpr = None,
                  *, loc=None, ip=None) -> None:
    """``cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes``: the bulk-copy
    engine reads ``nbytes`` (a multiple of 16) from global ``address`` (Int64, 16-byte aligned;
    a peer's or mapped host memory works alike) into shared memory at ``smem`` (16-byte
    aligned) and signals them to the mbarrier ``mbar`` (arm it with
    ``mbarrier_arrive_and_expect_tx`` first). One instruction instead of ``nbytes / 16``
    vector loads: no LSU / register traffic on the issuing SM. ``policy``: an L2 cache policy
    of :data:`BULK_CACHE_POLICIES`."""
    _bulk_copy("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes", "[{$r0}], [{$r1}], {$r2}, [{$r3}]",
               [Int32(smem.toint()), Int64(address), Int32(nbytes), Int32(mbar.toint())], policy, loc, ip)


@dsl_user_op
def bulk_copy_s2g(address, smem: cute.Pointer, nbytes, policy: cutlass.Constexpr = None, *, loc=None,
                  ip=None) -> None:
    """``cp.async.bulk.global.shared::cta.bulk_group``: ``nbytes`` from shared memory at ``smem``
    to global ``address`` (both 16-byte aligned), tracked by the issuing thread's bulk async-groups
    (``cute.arch.cp_async_bulk_commit_group`` / ``cp_async_bulk_wait_group``; ``read=True``
    waits only until the source may be overwritten). ``policy`` as in :func:`bulk_copy_g2s`."""
    _bulk_copy("cp.async.bulk.global.shared::cta.bulk_group", "[{$r0}], [{$r1}], {$r2}",
               [Int64(address), Int32(smem.toint()), Int32(nbytes)], policy, loc, ip)


@dsl_user_op
def stmatrix_x4(row_ptr: cute.Pointer, w0, w1, w2, w3, *, loc=None, ip=None) -> None:
    """``stmatrix.sync.aligned.m8n8.x4.shared.b16 [row_ptr], {w0..w3}`` (warp-collective).

    Stores four 8x8 tiles of 16-bit values: lane ``l`` holds, in ``w{i}``, the two values of
    row ``l // 4``, columns ``2 (l % 4)``, ``+1`` of tile ``i`` (the layout of a WGMMA / MMA
    accumulator fragment after packing pairs), and gives in ``row_ptr`` (shared memory,
    16-byte aligned) where row ``l % 8`` of tile ``l // 8`` goes: one 16-byte store per
    row instead of four 4-byte stores per lane.
    """
    from cutlass._mlir.dialects import nvvm

    words = [Int32(w).ir_value(loc=loc, ip=ip) for w in (w0, w1, w2, w3)]
    nvvm.stmatrix(row_ptr.llvm_ptr, words, nvvm.MMALayout.row, loc=loc, ip=ip)


@dsl_user_op
def cvt_e4m3x2(lo, hi, *, loc=None, ip=None) -> Int32:
    """``cvt.rn.satfinite.e4m3x2.f32``: two FP32 values as E4M3 (round to nearest even, saturated
    to +-448), ``lo`` in bits 0-7 and ``hi`` in bits 8-15 of the result (the byte order of two
    consecutive elements in memory)."""
    from cutlass._mlir.dialects import llvm

    return Int32(llvm.inline_asm(
        Int32.mlir_type, [Float32(lo).ir_value(loc=loc, ip=ip), Float32(hi).ir_value(loc=loc, ip=ip)],
        "{ .reg .b16 xs_q; cvt.rn.satfinite.e4m3x2.f32 xs_q, $2, $1; cvt.u32.u16 $0, xs_q; }",
        "=r,f,f", has_side_effects=False, loc=loc, ip=ip))


@dsl_user_op
def rcp_rn(x, *, loc=None, ip=None) -> Float32:
    """``rcp.rn.f32``: the correctly rounded reciprocal (what ``1.0f / x`` compiles to without fast
    math), spelled out so that no compiler flag can turn it into ``rcp.approx``."""
    from cutlass._mlir.dialects import llvm

    return Float32(llvm.inline_asm(Float32.mlir_type, [Float32(x).ir_value(loc=loc, ip=ip)], "rcp.rn.f32 $0, $1;",
                                   "=f,f", has_side_effects=False, loc=loc, ip=ip))


@dsl_user_op
def mul_f16x2(a, b, *, loc=None, ip=None) -> Int32:
    """``mul.rn.f16x2``: two FP16 products, each half of ``a`` times the same half of ``b`` (32-bit words)."""
    from cutlass._mlir.dialects import llvm

    return Int32(llvm.inline_asm(Int32.mlir_type, [Int32(a).ir_value(loc=loc, ip=ip), Int32(b).ir_value(loc=loc, ip=ip)],
                                 "mul.rn.f16x2 $0, $1, $2;", "=r,r,r", has_side_effects=False, loc=loc, ip=ip))


@dsl_user_op
def cvt_e4m3x4_f16x2(a, b, *, loc=None, ip=None) -> Int32:
    """``cvt.rn.satfinite.e4m3x2.f16x2`` of two words: the FP16 halves of ``a`` as E4M3 bytes 0 (low
    half) and 1, those of ``b`` as bytes 2 and 3 (round to nearest even, saturated)."""
    from cutlass._mlir.dialects import llvm

    return Int32(llvm.inline_asm(
        Int32.mlir_type, [Int32(a).ir_value(loc=loc, ip=ip), Int32(b).ir_value(loc=loc, ip=ip)],
        "{ .reg .b16 xs_lo, xs_hi; cvt.rn.satfinite.e4m3x2.f16x2 xs_lo, $1; cvt.rn.satfinite.e4m3x2.f16x2 xs_hi, $2; "
        "mov.b32 $0, {xs_lo, xs_hi}; }",
        "=r,r,r", has_side_effects=False, loc=loc, ip=ip))


@dsl_user_op
def prmt(a, b, selector, *, loc=None, ip=None) -> Int32:
    """``prmt.b32``: byte i of the result is byte ``selector``'s nibble i of the eight bytes (``a`` bytes
    0-3, ``b`` bytes 4-7; a nibble's bit 3 replicates that byte's sign instead). ``selector``: a Python
    int (an immediate) or a 32-bit value (a register: its low 16 bits). No side effects, so ptxas may
    schedule it."""
    from cutlass._mlir.dialects import llvm

    ops = [Int32(a).ir_value(loc=loc, ip=ip), Int32(b).ir_value(loc=loc, ip=ip)]
    if isinstance(selector, int):
        asm, constraints = f"prmt.b32 $0, $1, $2, {selector:#x};", "=r,r,r"
    else:
        asm, constraints = "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r"
        ops.append(Int32(selector).ir_value(loc=loc, ip=ip))
    return Int32(llvm.inline_asm(Int32.mlir_type, ops, asm, constraints, has_side_effects=False, loc=loc, ip=ip))


@dsl_user_op
def store_shared_b16(address, value, *, loc=None, ip=None) -> None:
    """``st.shared.b16 [address], value``: the low 16 bits of ``value`` at a 2-byte aligned
    shared-memory ``address`` (32-bit, as ``pointer.toint()`` of a shared pointer)."""
    from cutlass._mlir.dialects import llvm

    llvm.inline_asm(None, [Int32(address).ir_value(loc=loc, ip=ip), Int32(value).ir_value(loc=loc, ip=ip)],
                    "{ .reg .b16 xs_h; cvt.u16.u32 xs_h, $1; st.shared.b16 [$0], xs_h; }",
                    "r,r", has_side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def load_shared_v4(address, *, loc=None, ip=None):
    """``ld.shared.v4.b32`` of a 16-byte aligned shared-memory ``address`` (32-bit): four Int32. Kept
    in program order (side effects), so it stays behind the waits that make its data valid."""
    from cutlass._mlir.dialects import llvm

    i32 = Int32.mlir_type
    res = llvm.inline_asm(llvm.StructType.get_literal([i32] * 4), [Int32(address).ir_value(loc=loc, ip=ip)],
                          "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r", has_side_effects=True,
                          loc=loc, ip=ip)
    return tuple(Int32(llvm.extractvalue(i32, res, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def store_shared_v4(address, w0, w1, w2, w3, *, loc=None, ip=None) -> None:
    """``st.shared.v4.b32 [address], {w0..w3}`` at a 16-byte aligned shared-memory ``address`` (32-bit)."""
    from cutlass._mlir.dialects import llvm

    llvm.inline_asm(None, [Int32(v).ir_value(loc=loc, ip=ip) for v in (address, w0, w1, w2, w3)],
                    "st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r", has_side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def red_max_u64(address, value, *, loc=None, ip=None) -> None:
    """``red.relaxed.gpu.global.max.u64 [address], value`` (e.g. the latest of many threads'
    timestamps into one word)."""
    from cutlass._mlir.dialects import llvm

    llvm.inline_asm(None, [Int64(address).ir_value(loc=loc, ip=ip), Int64(value).ir_value(loc=loc, ip=ip)],
                    "red.relaxed.gpu.global.max.u64 [$0], $1;", "l,l", has_side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def red_min_u64(address, value, *, loc=None, ip=None) -> None:
    """``red.relaxed.gpu.global.min.u64 [address], value`` (the earliest of many timestamps)."""
    from cutlass._mlir.dialects import llvm

    llvm.inline_asm(None, [Int64(address).ir_value(loc=loc, ip=ip), Int64(value).ir_value(loc=loc, ip=ip)],
                    "red.relaxed.gpu.global.min.u64 [$0], $1;", "l,l", has_side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def load_f32_cg(address, *, loc=None, ip=None) -> Float32:
    """``ld.global.cg.f32``: an FP32 load cached in L2 only, so a value another SM published
    (behind a release this thread's CTA acquired) is never read from a stale L1 line."""
    from cutlass._mlir.dialects import llvm

    return Float32(llvm.inline_asm(
        Float32.mlir_type, [Int64(address).ir_value(loc=loc, ip=ip)], "ld.global.cg.f32 $0, [$1];", "=f,l",
        has_side_effects=True, loc=loc, ip=ip))


# ---------------------------------------------------------------------------
# Timers
# ---------------------------------------------------------------------------


@dsl_user_op
def globaltimer_ns(*, loc=None, ip=None) -> Int64:
    """``%globaltimer``: GPU-wide nanosecond timer (coarse update step; calibrate)."""
    return cute.arch.globaltimer(loc=loc, ip=ip)


@dsl_user_op
def globaltimer_after_shared_load(word: cute.Pointer, *, loc=None, ip=None) -> Int64:
    """``%globaltimer`` read once a volatile load of the 32-bit shared-memory ``word`` has
    returned (0 if the word holds 0): a timestamp that cannot run ahead of a preceding
    ``bar.sync``. A warp leaving a named-barrier wait may issue register-only instructions, a plain
    timer read among them, before the barrier has resolved; a shared-memory load cannot. The timer
    read is predicated on the loaded value (ptxas 13.0 turns that into a compare of the load's
    result followed by the timer read and a select, so in-order issue still orders it: checked in
    the SASS of MegaMoESm90's trace build)."""
    from cutlass._mlir.dialects import llvm

    return Int64(llvm.inline_asm(
        Int64.mlir_type, [Int32(word.toint()).ir_value(loc=loc, ip=ip)],
        "{ .reg .b32 xs_v; .reg .pred xs_p; ld.volatile.shared.b32 xs_v, [$1]; setp.ne.b32 xs_p, xs_v, 0; "
        "mov.u64 $0, 0; @xs_p mov.u64 $0, %globaltimer; }",
        "=l,r", has_side_effects=True, loc=loc, ip=ip))


@dsl_user_op
def clock64(*, loc=None, ip=None) -> Int64:
    """``%clock64``: this SM's cycle counter (not comparable across SMs)."""
    return cute.arch.clock64(loc=loc, ip=ip)


@dsl_user_op
def smid(*, loc=None, ip=None) -> Int32:
    """``%smid``: the SM this thread runs on."""
    return cute.arch.smid(loc=loc, ip=ip)


# ---------------------------------------------------------------------------
# Int32 flags: acquire/release loads, stores and reductions
# ---------------------------------------------------------------------------


def _check_scope(scope: str) -> None:
    if scope not in ("gpu", "sys"):
        raise ValueError(f"flag scope must be 'gpu' or 'sys', got {scope!r}")


@dsl_user_op
def load_acquire(flag: cute.Pointer, scope: cutlass.Constexpr = "gpu", *, loc=None, ip=None) -> Int32:
    """``ld.acquire.<scope>.global.b32``: later accesses are ordered after it."""
    _check_scope(scope)
    return cute.arch.load(flag.llvm_ptr, Int32, sem="acquire", scope=scope, loc=loc, ip=ip)


@dsl_user_op
def load_relaxed(flag: cute.Pointer, scope: cutlass.Constexpr = "gpu", *, loc=None, ip=None) -> Int32:
    """``ld.relaxed.<scope>.global.b32``: a coherent poll with no ordering."""
    _check_scope(scope)
    return cute.arch.load(flag.llvm_ptr, Int32, sem="relaxed", scope=scope, loc=loc, ip=ip)


@dsl_user_op
def store_release(flag: cute.Pointer, value, scope: cutlass.Constexpr = "gpu", *, loc=None, ip=None) -> None:
    """``st.release.<scope>.global.b32``: publishes this thread's earlier writes."""
    _check_scope(scope)
    cute.arch.store(flag.llvm_ptr, Int32(value), sem="release", scope=scope, loc=loc, ip=ip)


@dsl_user_op
def red_add_release(flag: cute.Pointer, value, scope: cutlass.Constexpr = "gpu", *, loc=None, ip=None) -> None:
    """``red.release.<scope>.global.add.s32``: fire-and-forget counter publish."""
    _check_scope(scope)
    cute.arch.red(flag.llvm_ptr, Int32(value), op="add", dtype=Int32, sem="release", scope=scope, loc=loc, ip=ip)


@dsl_user_op
def red_add_relaxed(flag: cute.Pointer, value, scope: cutlass.Constexpr = "gpu", *, loc=None, ip=None) -> None:
    """``red.relaxed.<scope>.global.add.s32``: counter bump that orders nothing.

    Used where only the *time* of arrival matters (timing barriers), so that
    the arrival does not wait for this thread's outstanding stores.
    """
    _check_scope(scope)
    cute.arch.red(flag.llvm_ptr, Int32(value), op="add", dtype=Int32, sem="relaxed", scope=scope, loc=loc, ip=ip)


@dsl_user_op
def atomic_or_relaxed(flag: cute.Pointer, value, scope: cutlass.Constexpr = "gpu", *, loc=None, ip=None) -> Int32:
    """``atom.relaxed.<scope>.global.or.b32``; returns the old value."""
    _check_scope(scope)
    return cute.arch.atomic_or(flag.llvm_ptr, Int32(value), sem="relaxed", scope=scope, loc=loc, ip=ip)


@cute.jit
def spin_wait_ge(
    flag: cute.Pointer,
    target: Int32,
    timeout_ns: Int64,
    error_word: cute.Pointer,
    error_code: cutlass.Constexpr = ERR_SPIN_TIMEOUT,
    acquire: cutlass.Constexpr = True,
    scope: cutlass.Constexpr = "gpu",
) -> Boolean:
    """Poll ``*flag >= target`` for at most ``timeout_ns`` (``%globaltimer``).

    Returns True when the flag reached the target.  On timeout it ORs
    ``error_code`` into ``*error_word`` and returns False; the caller must
    then skip the work that depended on the flag (never loop again), and the
    host raises after the kernel (:func:`raise_on_device_error`).
    ``acquire=False`` polls with relaxed loads (timing-only waits).  Call from
    one thread; follow with a CTA barrier if the whole CTA depends on it.
    """
    deadline = globaltimer_ns() + timeout_ns
    value = Int32(0)
    if const_expr(acquire):
        value = load_acquire(flag, scope)
    else:
        value = load_relaxed(flag, scope)
    timed_out = Boolean(False)
    while value < target and not timed_out:
        if globaltimer_ns() > deadline:
            timed_out = Boolean(True)
        else:
            if const_expr(acquire):
                value = load_acquire(flag, scope)
            else:
                value = load_relaxed(flag, scope)
    ok = Boolean(True)
    if timed_out:
        atomic_or_relaxed(error_word, Int32(error_code), "gpu")
        ok = Boolean(False)
    return ok


@dsl_user_op
def nanosleep(ns, *, loc=None, ip=None) -> None:
    """``nanosleep.u32 ns``: suspend the thread for about ``ns`` nanoseconds (PTX: within [0, 2 ns])."""
    cute.arch.inline_ptx("nanosleep.u32 {$r0};", read_only_args=[Int32(ns)], loc=loc, ip=ip)


@cute.jit
def spin_wait_ge_tries(
    flag: cute.Pointer,
    target: Int32,
    max_polls: cutlass.Constexpr,
    sleep_ns: cutlass.Constexpr,
    error_word: cute.Pointer,
    error_code: cutlass.Constexpr = ERR_SPIN_TIMEOUT,
) -> Boolean:
    """:func:`spin_wait_ge` (acquire, gpu scope) bounded by a count of polls instead of
    ``%globaltimer``, with a ``nanosleep`` of ``sleep_ns`` between polls: about
    ``max_polls * sleep_ns`` at most (nanosleep is approximate). No timer reads, for code
    where they cost registers that matter (the fused MoE kernel's dispatch thread: the timer
    loop made ptxas serialize the consumers' WGMMAs). Returns True when ``*flag >= target``;
    otherwise ORs ``error_code`` into ``*error_word`` and returns False."""
    value = load_acquire(flag, "gpu")
    polls = Int32(0)
    while value < target and polls < max_polls:
        nanosleep(Int32(sleep_ns))
        value = load_acquire(flag, "gpu")
        polls = polls + 1
    return _report_unless(value >= target, error_word, error_code)


@cute.jit
def _report_unless(ok: Boolean, error_word: cute.Pointer, error_code: cutlass.Constexpr) -> Boolean:
    """The counted waits' ending: unless ``ok``, OR ``error_code`` into ``*error_word``;
    returns ``ok``."""
    if not ok:
        atomic_or_relaxed(error_word, Int32(error_code), "gpu")
    return ok


@cute.jit
def mbarrier_wait_bounded(
    mbar: cute.Pointer,
    phase: Int32,
    timeout_ns: Int64,
    error_word: cute.Pointer,
    error_code: cutlass.Constexpr = ERR_MBARRIER_TIMEOUT,
) -> Boolean:
    """Wait for the phase of parity ``phase`` of the shared-memory mbarrier
    ``mbar`` to complete, for at most ``timeout_ns`` (``%globaltimer``).

    The bounded counterpart of ``cute.arch.mbarrier_wait`` (whose
    ``try_wait`` retry loop never gives up), with the same acquire
    semantics (``mbarrier.try_wait.parity``, ``.acquire.cta``).  The first
    ``try_wait`` runs before any timer read, so an already completed phase
    costs what it costs without the bound; each further ``try_wait`` may
    suspend the thread for a hardware-chosen time, so the loop does not
    poll hot.  Returns True when the phase completed.  On timeout it ORs
    ``error_code`` into ``*error_word`` (global memory) and returns False;
    the caller must not retry the wait, and should skip its later waits too
    (else a broken pipeline costs one timeout per wait); the host raises
    after the kernel (:func:`raise_on_device_error`).  Any thread may call
    it; every lane decides on its own.
    """
    done = cute.arch.mbarrier_try_wait(mbar, phase)
    timed_out = Boolean(False)
    if not done:
        deadline = globaltimer_ns() + timeout_ns
        while not done and not timed_out:
            if globaltimer_ns() > deadline:
                timed_out = Boolean(True)
            else:
                done = cute.arch.mbarrier_try_wait(mbar, phase)
    if timed_out:
        atomic_or_relaxed(error_word, Int32(error_code), "gpu")
    return done


@cute.jit
def mbarrier_wait_in_step(
    mbar: cute.Pointer,
    phase: Int32,
    ok: Boolean,
    timeout_ns: Int64,
    error_word: cute.Pointer,
    error_code: cutlass.Constexpr = ERR_MBARRIER_TIMEOUT,
    drain_tries: cutlass.Constexpr = 1 << 20,
) -> Boolean:
    """A ring partner's wait: while ``ok``, :func:`mbarrier_wait_bounded` (past ``timeout_ns`` it
    ORs ``error_code`` into ``*error_word`` and ``ok`` turns False); once not ``ok``, it still waits,
    for at most ``drain_tries`` ``try_wait``s, without reporting again. Returns ``ok``.

    Why not skip the wait after a timeout: in a ring shared by a CTA pair (one CTA multicasts into
    both), a stage refilled before both CTAs consumed it lets the peer's bytes land in a barrier
    phase this CTA has not armed, and the launch fails. Waiting keeps both sides in step, so the
    call ends in a ``DeviceError``. The drain is bounded by a count, not ``%globaltimer``: the
    timer runs on while the context is time-sliced out, and a second timer loop in the consumers'
    K loop made ptxas serialize their WGMMAs."""
    if ok:
        ok = mbarrier_wait_bounded(mbar, phase, timeout_ns, error_word, error_code)
    if not ok:
        _mbarrier_try_wait_count(mbar, phase, drain_tries)
    return ok


@cute.jit
def _mbarrier_try_wait_count(mbar: cute.Pointer, phase: Int32, max_tries: cutlass.Constexpr) -> Boolean:
    """``try_wait`` on ``phase`` until it completes or ``max_tries`` more tries failed; whether it completed."""
    done = cute.arch.mbarrier_try_wait(mbar, phase)
    tries = Int32(0)
    while not done and tries < max_tries:
        done = cute.arch.mbarrier_try_wait(mbar, phase)
        tries = tries + 1
    return done


@cute.jit
def mbarrier_wait_tries(
    mbar: cute.Pointer,
    phase: Int32,
    max_tries: cutlass.Constexpr,
    error_word: cute.Pointer,
    error_code: cutlass.Constexpr = ERR_MBARRIER_TIMEOUT,
) -> Boolean:
    """:func:`mbarrier_wait_bounded` bounded by a count of ``try_wait``s instead of
    ``%globaltimer`` (each may suspend the thread for a hardware-chosen time, so the bound in
    time is hardware-dependent): no timer reads, for code where they cost registers that matter
    (the fused MoE kernel's bulk Dispatch: the timer loop made ptxas serialize other warps'
    WGMMAs). Returns True when the phase completed; otherwise ORs ``error_code`` into
    ``*error_word`` and returns False."""
    return _report_unless(_mbarrier_try_wait_count(mbar, phase, max_tries), error_word, error_code)


@cute.jit
def grid_arrive_and_wait(
    counter: cute.Pointer,
    target: Int32,
    timeout_ns: Int64,
    error_word: cute.Pointer,
    tidx: Int32,
) -> None:
    """Counter barrier across CTAs: thread 0 adds 1 to ``*counter`` and waits
    until it reaches ``target`` (e.g. ``num_ctas * (round + 1)``), then the CTA
    syncs.  Relaxed ordering: the barrier aligns *time*, it publishes no data.
    Requires every participating CTA to be co-resident; a missing CTA turns
    into :data:`ERR_BARRIER_TIMEOUT` instead of a hang.
    """
    if tidx == 0:
        red_add_relaxed(counter, Int32(1), "gpu")
        spin_wait_ge(counter, target, timeout_ns, error_word, ERR_BARRIER_TIMEOUT, False, "gpu")
    cute.arch.sync_threads()
