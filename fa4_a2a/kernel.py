"""FlashAttention-4 SM90 forward with the Ulysses post-attention All-to-All fused into its epilogue.

``FlashAttentionUlyssesSm90`` subclasses flash-attn-4's ``FlashAttentionForwardSm90`` and changes
only what happens at an output-tile boundary: the MMA warpgroups that own the finished O tile store
it (16-byte vector stores) straight into the destination rank's output buffer at its Ulysses
position, through a device table of peer base addresses.  There is no communication warp or SM;
the stores drain through the X-Stage while the CTA (or, persistent, its next tile) computes.

Ulysses mapping, for rank ``r`` of ``P`` (local heads ``Hl = H / P``, shard ``C = S / P``):
  rank r computes full-sequence attention for heads ``[r*Hl, (r+1)*Hl)``: q/k/v ``[B, S, Hl, D]``;
  its output row ``s`` (global sequence position) of local head ``h`` belongs to rank
  ``j = s // C`` at ``out_j[b, s - j*C, r*Hl + h, :]`` where ``out_j`` is ``[B, C, H, D]``.
The host folds ``r*Hl*D*elem_bytes`` into every entry of the table (``peer_table[j] =
base(out_j) + r*Hl*D*elem_bytes``), so the kernel needs neither the rank nor a recompile per rank.

Compile-time switches (one class, no copies):
  ``num_ranks``   P (1 = plain attention through the same remote-store epilogue)
  ``ulysses``     False -> "FA-only": the parent epilogue (TMA store into a local [B, S, Hl, D])
  ``persistent``  static persistent tile order (grid = #SMs).  Stock sO aliases sQ, and the
                  producer TMAs the next tile's Q as soon as Q is released, so the persistent
                  variant needs one of two O staging policies (``o_staging``):
                    "own"     a separate O staging buffer in smem (+ tile_m*D*elem bytes); Q is
                              released early exactly as stock, the next Q load overlaps the epilogue;
                    "defer_q" keep the alias, defer Q's release until the epilogue has read the O
                              tile back out of smem (no extra smem; the next Q load waits).
"""

# No ``from __future__ import annotations`` here: @cute.struct needs evaluated field annotations.
import inspect
from typing import Any, NamedTuple, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr
from cutlass.cute import FastDivmodDivisorV2

from flash_attn.cute import utils as fa_utils
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
from flash_attn.cute.named_barrier import NamedBarrierFwd
from flash_attn.cute.seqlen_info import SeqlenInfoQK
from flash_attn.cute.tile_scheduler import SingleTileScheduler, StaticPersistentTileScheduler
from flash_attn.cute.utils import AuxData
from quack import layout_utils

from xstage import device as xdev
from xstage.device import peer_address

# Per-tile trace row (``trace=True``, Ulysses builds; lab.fa4_a2a.trace decodes it), int64 %globaltimer
# ns unless named otherwise: the CTA's start (non-persistent: the tile's own CTA; persistent: the
# CTA's first tile), epilogue entry (this tile's mainloop done, thread 0), the first remote store's
# issue (min over the epilogue threads), the last one's (max: the tile's store-issue span ends),
# the SM id. The host fills the min field with INT64_MAX and the rest with 0.
TRACE_FIELDS = ("t_cta_start", "t_epilogue", "t_first_store", "t_last_store", "smid")



class UlyssesAux(NamedTuple):
    """What the Ulysses epilogue needs beyond the parent's arguments. It travels in FA4's ``AuxData``
    (the parent's one extension point) as its tensor list, in this field order."""

    peer_table: Any  # int64 [P]: every rank's destination buffer, this rank's head offset folded in
    trace: Any = None  # int64 [B, Hl, m_blocks, len(TRACE_FIELDS)] (trace builds)

    def aux_data(self) -> AuxData:
        return AuxData([t for t in self if t is not None], None)

    @classmethod
    def of(cls, aux_data: AuxData) -> "UlyssesAux":
        return cls(*aux_data.tensors)


class _DeferredQRelease:
    """Pipeline proxy whose consumer release of the Q stage is a no-op.

    The persistent variant hands this to the parent ``mma`` so that Q's smem (which is also the O
    staging buffer) is released by our epilogue once the O tile has been read back out of it.
    """

    def __init__(self, pipeline_q):
        self._pipeline_q = pipeline_q

    def consumer_release_w_index(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return getattr(self._pipeline_q, name)

    # Carried through the MMA role's dynamic tile loop like the pipeline it wraps.
    def __extract_mlir_values__(self):
        return cutlass.extract_mlir_values(self._pipeline_q)

    def __new_from_mlir_values__(self, values):
        return _DeferredQRelease(cutlass.new_from_mlir_values(self._pipeline_q, values))


class _LaunchWithGrid:
    """Wraps a kernel launcher so that ``launch`` uses a different grid (persistent variant)."""

    def __init__(self, launcher, grid):
        self._launcher = launcher
        self._grid = grid

    def launch(self, *args, grid=None, **kwargs):
        return self._launcher.launch(*args, grid=self._grid, **kwargs)


class FlashAttentionUlyssesSm90(FlashAttentionForwardSm90):
    """FA4 SM90 forward whose epilogue performs the Ulysses post-attention All-to-All.

    Kernel arguments (through the parent ``__call__``):
      mQ, mK, mV: ``[B, S, Hl, D]`` this rank's head slice of the full sequence.
      mO: ulysses -> this rank's own destination buffer ``[B, S/P, H, D]`` (its layout describes
          every peer's buffer; the data goes to the addresses in the peer table);
          FA-only -> the local output ``[B, S, Hl, D]``.
      mLSE: optional local ``[B, Hl, S]`` float32 (log-sum-exp of this rank's heads).
      aux_data: :class:`UlyssesAux` ``.aux_data()`` (ulysses only).
    """

    def __init__(
        self,
        *args,
        num_ranks: int = 1,
        ulysses: bool = True,
        persistent: bool = False,
        o_staging: str = "own",
        num_sms: int = 132,
        trace: bool = False,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        if trace and not ulysses:
            raise ValueError("trace records the Ulysses epilogue's remote stores: it needs ulysses=True")
        self.trace = trace
        if o_staging not in ("own", "defer_q"):
            raise ValueError(f"o_staging must be 'own' or 'defer_q', got {o_staging!r}")
        if self.Q_in_regs:
            raise ValueError("Q_in_regs (sV sharing sQ) is not supported")
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        if ulysses and self.check_hdim_v_oob:
            raise ValueError("the Ulysses epilogue needs head_dim to be a multiple of 16")
        self.num_ranks = num_ranks
        self.ulysses = ulysses
        self.persistent = persistent
        # Only the persistent variant has a next tile that could overwrite sO through sQ.
        self.own_o_staging = persistent and o_staging == "own"
        self.defer_q_release = persistent and o_staging == "defer_q"
        self.num_sms = num_sms

    # The parent sets use_tma_O from use_tma_Q in __call__; the Ulysses epilogue does pointer math
    # on O, so it needs the non-TMA path. Assignments are accepted and ignored in that case.
    @property
    def use_tma_O(self):
        return False if self.ulysses else self._use_tma_O

    @use_tma_O.setter
    def use_tma_O(self, value):
        self._use_tma_O = value

    # ------------------------------------------------------------------ O staging buffer
    def _get_shared_storage_cls(self):
        """Stock layout, plus (own O staging) an sO buffer placed right after sQ."""
        if not self.own_o_staging:
            return super()._get_shared_storage_cls()
        align = self.buffer_align_bytes
        sQ_bytes = cute.cosize(self.sQ_layout) * self.dtype.width // 8
        if sQ_bytes % align:
            raise ValueError(f"sQ ({sQ_bytes} B) must be a multiple of {align} B to place sO after it")
        self._sO_offset_elems = cute.cosize(self.sQ_layout)

        def smem(layout):
            return cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layout)], align]

        mbar = lambda n: cute.struct.MemRange[cutlass.Int64, n]  # noqa: E731
        cosize_sP = cute.cosize(self.sP_layout) if self.sP_layout is not None else 0

        @cute.struct
        class SharedStorageOwnO:
            mbar_ptr_Q: mbar(2)
            mbar_ptr_K: mbar(self.num_stages * 2)
            mbar_ptr_V: mbar(self.num_stages * 2)
            sV: smem(self.sV_layout)
            sQ: smem(self.sQ_layout)
            sO: smem(self.sO_layout)  # must directly follow sQ (see _own_sO)
            sK: smem(self.sK_layout)
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cosize_sP], 1024]

        return SharedStorageOwnO

    @cute.jit
    def _own_sO(self, sO_alias: cute.Tensor) -> cute.Tensor:
        """The separate O staging buffer: same (swizzled) layout, sQ's bytes further on."""
        return cute.make_tensor(sO_alias.iterator + self._sO_offset_elems, sO_alias.layout)

    # ------------------------------------------------------------------ persistent tile order
    def kernel(self, *args, **kwargs):
        """Trace-time hook around the parent's kernel: swaps in a static persistent scheduler (the
        parent's arguments bound by name, so a reordered upstream signature cannot be misread)."""
        if not self.persistent:
            return super().kernel(*args, **kwargs)
        bound = inspect.signature(FlashAttentionForwardSm90.kernel).bind(self, *args, **kwargs)
        given = bound.arguments
        if given["TileScheduler"] is not SingleTileScheduler:
            raise NotImplementedError(
                "persistent variant supports the non-causal, non-varlen SingleTileScheduler path "
                f"only (got {given['TileScheduler']})"
            )
        single = given["tile_sched_params"]
        total_tiles = single.num_block * single.num_head * single.num_batch
        given["tile_sched_params"] = StaticPersistentTileScheduler.Params(
            FastDivmodDivisorV2(single.num_block),
            FastDivmodDivisorV2(single.num_head),
            total_tiles,
            cluster_shape_m=1,
        )
        given["TileScheduler"] = StaticPersistentTileScheduler
        grid = (cutlass.min(Int32(self.num_sms), total_tiles), Int32(1), Int32(1))
        return _LaunchWithGrid(super().kernel(*bound.args[1:], **bound.kwargs), grid)

    # ------------------------------------------------------------------ consumer (MMA) role
    @cute.jit
    def mma(
        self,
        tiled_mma_qk,
        tiled_mma_pv,
        mO,
        mLSE,
        sQ,
        sK,
        sVt,
        sP,
        sO,
        learnable_sink,
        pipeline_k,
        pipeline_v,
        pipeline_q,
        gmem_tiled_copy_O,
        tma_atom_O,
        tidx,
        softmax_scale_log2,
        softmax_scale,
        block_info,
        SeqlenInfoCls,
        AttentionMaskCls,
        TileSchedulerCls,
        blocksparse_tensors,
        aux_data: AuxData = AuxData(),
        fastdiv_mods=None,
    ):
        # The Ulysses tensors travel in aux_data; this role hands them to the epilogue it calls
        # within the same trace (the parent's epilogue signature has no aux argument), then runs
        # the parent's MMA/softmax role exactly as stock (no aux tensors, no fastdiv mods).
        if const_expr(self.ulysses):
            self._aux = UlyssesAux.of(aux_data)
        if const_expr(self.trace):
            self._t_cta_start = xdev.globaltimer_ns()
        self._pipeline_q = pipeline_q
        super().mma(
            tiled_mma_qk,
            tiled_mma_pv,
            mO,
            mLSE,
            sQ,
            sK,
            sVt,
            sP,
            self._own_sO(sO) if const_expr(self.own_o_staging) else sO,
            learnable_sink,
            pipeline_k,
            pipeline_v,
            _DeferredQRelease(pipeline_q) if const_expr(self.defer_q_release) else pipeline_q,
            gmem_tiled_copy_O,
            tma_atom_O,
            tidx,
            softmax_scale_log2,
            softmax_scale,
            block_info,
            SeqlenInfoCls,
            AttentionMaskCls,
            TileSchedulerCls,
            blocksparse_tensors,
            AuxData(),
            None,
        )

    # ------------------------------------------------------------------ epilogue
    @cute.jit
    def epilogue(
        self,
        acc_O: cute.Tensor,
        lse: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        sO: cute.Tensor,
        seqlen: SeqlenInfoQK,
        gmem_tiled_copy_O: cute.TiledCopy,
        tma_atom_O: Optional[cute.CopyAtom],
        tiled_mma: cute.TiledMma,
        tidx: Int32,
        m_block: Int32,
        head_idx: Int32,
        batch_idx: Int32,
    ):
        if const_expr(not self.ulysses):
            super().epilogue(
                acc_O, lse, mO, mLSE, sO, seqlen, gmem_tiled_copy_O, tma_atom_O, tiled_mma,
                tidx, m_block, head_idx, batch_idx,
            )
            if const_expr(self.defer_q_release):
                # Q's empty barrier counts one arrival per MMA warp, so it completes only after
                # warp 4 has passed the parent's TMA-store wait_group.read (the only sO reader).
                # No named barrier here: barrier 1 may still be in its 288-thread TMA phase.
                self._pipeline_q.consumer_release_w_index(0)
        else:
            self._ulysses_epilogue(
                acc_O, lse, mO, mLSE, sO, seqlen, gmem_tiled_copy_O, tiled_mma, tidx, m_block,
                head_idx, batch_idx,
            )

    @cute.jit
    def _epilogue_sync(self):
        cute.arch.barrier(
            barrier_id=int(NamedBarrierFwd.Epilogue), number_of_threads=self.num_epilogue_threads
        )

    @cute.jit
    def _ulysses_epilogue(
        self,
        acc_O: cute.Tensor,
        lse: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        sO: cute.Tensor,
        seqlen: SeqlenInfoQK,
        gmem_tiled_copy_O: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
        tidx: Int32,
        m_block: Int32,
        head_idx: Int32,
        batch_idx: Int32,
    ):
        t_row = Int64(0)
        if const_expr(self.trace):
            trace_row = self._aux.trace[batch_idx, head_idx, m_block, None]
            t_row = Int64(trace_row.iterator.toint())
            t_cta_start = self._t_cta_start
            if tidx == 0:
                trace_row[0] = t_cta_start
                trace_row[1] = xdev.globaltimer_ns()
                trace_row[4] = Int64(xdev.smid())
        # 1. Accumulator -> output dtype -> smem staging (sO aliases sQ: every MMA warpgroup must
        #    be done with its last QK^T before anyone overwrites it).
        rO = cute.make_fragment_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        self._epilogue_sync()
        smem_copy_atom_O = fa_utils.get_smem_store_atom(
            self.arch.major * 10 + self.arch.minor, self.dtype
        )
        smem_thr_copy_O = cute.make_tiled_copy_C(smem_copy_atom_O, tiled_mma).get_slice(tidx)
        cute.copy(smem_copy_atom_O, smem_thr_copy_O.retile(rO), smem_thr_copy_O.partition_D(sO))

        # 2. LSE stays local ([B, Hl, S]); it is written from registers meanwhile.
        if const_expr(mLSE is not None):
            self._store_lse_local(lse, mLSE, seqlen, tiled_mma, tidx, m_block, head_idx, batch_idx)

        # 3. smem -> registers in 16-byte row segments (rows spread over threads).
        self._epilogue_sync()
        gmem_thr_copy_O = gmem_tiled_copy_O.get_slice(tidx)
        tOsO = gmem_thr_copy_O.partition_S(sO)
        tOrO = cute.make_fragment_like(tOsO, self.dtype)
        cute.autovec_copy(tOsO, tOrO)
        if const_expr(self.defer_q_release):
            # Everyone has read sO: let the producer bring the next tile's Q into sQ.
            self._epilogue_sync()
            self._pipeline_q.consumer_release_w_index(0)

        # 4. Remote stores: each 16-byte segment goes to rank j = row // (S/P) at its Ulysses
        #    position. The destination layout is mO's ([B, S/P, H, D], identical on every rank).
        cO = cute.make_identity_tensor((self.tile_m, self.tile_hdimv))
        tOcO = gmem_thr_copy_O.partition_S(cO)
        elem_bytes = self.dtype.width // 8
        # mO here is (S/P, D, H, B) after the parent's transpose.
        stride_s = Int64(mO.stride[0])
        stride_h = Int64(mO.stride[2])
        stride_b = Int64(mO.stride[3])
        shard_len = seqlen.seqlen_q // self.num_ranks
        head_batch_offset = Int64(head_idx) * stride_h + Int64(batch_idx) * stride_b
        peer_table = self._aux.peer_table
        vec = cute.size(tOrO.shape[0])
        if const_expr(self.trace):
            xdev.red_min_u64(t_row + 2 * 8, xdev.globaltimer_ns())
        for rest_m in cutlass.range_constexpr(cute.size(tOrO.shape[1])):
            row = m_block * self.tile_m + tOcO[0, rest_m, 0][0]
            if row < seqlen.seqlen_q:
                dst_rank = row // shard_len
                row_in_shard = row - dst_rank * shard_len
                row_base = peer_address(
                    peer_table, dst_rank, (Int64(row_in_shard) * stride_s + head_batch_offset) * elem_bytes
                )
                for rest_k in cutlass.range_constexpr(cute.size(tOrO.shape[2])):
                    col = tOcO[0, rest_m, rest_k][1]
                    dst_ptr = cute.make_ptr(
                        self.dtype,
                        row_base + Int64(col) * elem_bytes,
                        cute.AddressSpace.gmem,
                        assumed_align=16,
                    )
                    dst = cute.make_tensor(dst_ptr, cute.make_layout(vec))
                    src = tOrO[None, rest_m, rest_k]
                    cute.copy(gmem_tiled_copy_O, src, cute.make_tensor(dst.iterator, src.layout))
        if const_expr(self.trace):  # this thread's stores are issued (accepted by the LSU)
            xdev.red_max_u64(t_row + 3 * 8, xdev.globaltimer_ns())

    @cute.jit
    def _store_lse_local(
        self,
        lse: cute.Tensor,
        mLSE: cute.Tensor,
        seqlen: SeqlenInfoQK,
        tiled_mma: cute.TiledMma,
        tidx: Int32,
        m_block: Int32,
        head_idx: Int32,
        batch_idx: Int32,
    ):
        """Row log-sum-exp of this tile to the local ``[B, Hl, S]`` tensor (seen as (S, Hl, B))."""
        mLSE_head = mLSE[None, head_idx, batch_idx]
        thr_mma = tiled_mma.get_slice(tidx)
        # Row coordinates of the accumulator rows this thread holds (same rows as `lse`).
        coords = layout_utils.reshape_acc_to_mn(
            thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_hdimv)))
        )
        # One thread per row writes: the one holding column 0.
        if coords[0][1] == 0:
            for i in cutlass.range(cute.size(lse), unroll_full=True):
                row = m_block * self.tile_m + coords[i, 0][0]
                if row < seqlen.seqlen_q:
                    mLSE_head[row] = lse[i]
