"""Peer-memory worlds: symmetric allocations and per-rank peer address tables.

Every multi-rank kernel in xstage reaches other ranks' memory the same way: a
rank ``r`` gets an int64 table ``peer_table(r)[j]`` = base address of rank
``j``'s copy of a symmetric buffer *as seen from rank r*, and stores to
``peer_table(r)[j] + byte_offset`` (see ``xstage.device.store_v4_to_peer``).
Three backends provide such tables:

``loopback``
    One process, one GPU, ``P`` simulated ranks.  Every rank's buffer is a
    separate device allocation; a kernel "for rank r" is launched once per
    ``r`` with ``peer_table(r)``.  Ranks run one after another, so a wait
    inside one kernel on another rank's progress can never be satisfied here.
``host``
    Like loopback, but every rank's buffer is pinned host memory (page-locked,
    mapped into the device address space; with UVA the host pointer is the
    device pointer).  Stores from a kernel cross PCIe: a real interconnect
    with finite outstanding capacity on a single-GPU host.
``torch-symm``
    One process per GPU (torchrun, NCCL).  Buffers come from
    ``torch.distributed._symmetric_memory.empty`` + ``rendezvous``; the peer
    table holds the peer mappings of *this tensor* (allocation base + the
    tensor's offset inside it, see :func:`symm_peer_addresses`).
``nvshmem``
    One PE per process: buffers from NVSHMEM's symmetric heap (nvshmem4py),
    the peer table from its peer-pointer query (``nvshmem_ptr``), so the
    kernels run unchanged in a stack that already initialises NVSHMEM
    (DeepEP-style serving); see :class:`NvshmemWorld`.

Placement per buffer: a kernel's *remote destinations* (MegaMoE's Combine slots, the Ulysses
outputs) are allocated with ``alloc(..., remote=True)``. ``make_world("loopback", P,
remote="host")`` puts exactly those in pinned host memory and keeps every other buffer (inputs,
the Dispatch source) in device memory: a real remote path (PCIe, the calibrated ``h200-pcie-host``
profile) for the stores alone, on one GPU. In the plain loopback world ``remote=True`` changes
nothing (no remote path: the control); in ``host`` every buffer is pinned host memory; in
``torch-symm`` every buffer already is a peer's.

Contract (other packages code against it)::

    world = make_world("loopback" | "host" | "torch-symm" | "nvshmem", world_size=P, device=None)
    world.world_size, world.backend, world.local_ranks, world.device, world.placement
    world.barrier()
    buf = world.alloc(shape, dtype, remote=False)   # SymmetricTensor
    buf.local(r)       # rank r's own buffer (torch.Tensor on world.device)
    buf.peer_table(r)  # int64 CUDA tensor [P] of base addresses seen from r
    buf.fill_(value)   # poison every local copy
"""
from __future__ import annotations

import importlib
import math
import os
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

__all__ = [
    "BACKENDS",
    "REMOTE_PLACEMENTS",
    "WORLDS",
    "ADDRESS_ALIGN",
    "World",
    "LoopbackWorld",
    "HostWorld",
    "TorchSymmWorld",
    "NvshmemWorld",
    "SymmetricTensor",
    "make_world",
    "single_process",
    "symm_peer_addresses",
    "check_peer_table",
]

BACKENDS = ("loopback", "host", "torch-symm", "nvshmem")
REMOTE_PLACEMENTS = ("device", "host")  # loopback: where alloc(..., remote=True) puts a buffer
WORLDS = BACKENDS + ("loopback+host",)  # names make_world takes: "loopback+host" = loopback, remote="host"

# Every base address handed to a kernel is at least this aligned (16-byte
# vector stores need 16; we promise more so kernels can assume it).
ADDRESS_ALIGN = 16

ShapeLike = Union[int, Sequence[int]]


def _normalize_shape(shape: ShapeLike) -> Tuple[int, ...]:
    if isinstance(shape, bool):
        raise TypeError("shape must be an int or a sequence of ints, got a bool")
    if isinstance(shape, int):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"shape must be an int or a sequence of ints, got {shape!r}") from None
    if not dims:
        raise ValueError("shape must have at least one dimension")
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int):
            raise TypeError(f"shape entries must be ints, got {d!r} in {shape!r}")
        if d < 1:
            raise ValueError(f"shape entries must be >= 1, got {shape!r}")
    return dims


def _check_dtype(dtype) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    return dtype


def check_peer_table(table: torch.Tensor, world_size: int, device: Optional[torch.device] = None) -> None:
    """Raise ValueError unless ``table`` is a valid peer table for ``world_size`` ranks.

    Kernels call this before launching: int64, 1-D, ``world_size`` entries,
    on ``device`` (when given), every address non-zero and 16-byte aligned.
    """
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"peer table must be a torch.Tensor, got {type(table).__name__}")
    if table.dtype != torch.int64:
        raise ValueError(f"peer table must be int64, got {table.dtype}")
    if table.dim() != 1 or table.numel() != world_size:
        raise ValueError(f"peer table must have shape [{world_size}], got {list(table.shape)}")
    if device is not None and table.device != torch.device(device):
        raise ValueError(f"peer table is on {table.device}, expected {device}")
    addrs = table.tolist()
    for j, a in enumerate(addrs):
        if a == 0 or a % ADDRESS_ALIGN:
            raise ValueError(f"peer table entry {j} = 0x{a:x} is null or not {ADDRESS_ALIGN}-byte aligned")


def symm_peer_addresses(
    buffer_ptrs: Sequence[int], rank: int, local_ptr: int, nbytes: int, buffer_size: Optional[int] = None
) -> List[int]:
    """Per-peer addresses of a tensor inside a torch symmetric-memory allocation.

    ``buffer_ptrs`` are the handle's per-rank mapped *allocation* bases (with
    the implicit memory pool a tensor may sit at an offset inside its
    allocation); ``local_ptr`` is this rank's ``tensor.data_ptr()``.  The
    tensor lives at the same offset in every rank's allocation, so peer ``j``
    sees it at ``buffer_ptrs[j] + (local_ptr - buffer_ptrs[rank])``.  This is
    also right when a torch version already folds the offset into
    ``buffer_ptrs`` (the offset is then 0).
    """
    P = len(buffer_ptrs)
    if P < 1:
        raise ValueError("buffer_ptrs is empty")
    if not 0 <= rank < P:
        raise ValueError(f"rank {rank} out of range for {P} buffer pointers")
    if int(buffer_ptrs[rank]) == 0:
        raise ValueError(f"buffer_ptrs[{rank}] is null")
    offset = int(local_ptr) - int(buffer_ptrs[rank])
    if offset < 0:
        raise ValueError(
            f"tensor at 0x{local_ptr:x} lies before its allocation base 0x{buffer_ptrs[rank]:x}: "
            "not a tensor of this symmetric-memory handle"
        )
    if buffer_size is not None and offset + nbytes > buffer_size:
        raise ValueError(
            f"tensor [offset {offset}, {nbytes} bytes] exceeds the symmetric buffer ({buffer_size} bytes)"
        )
    addrs = []
    for j, base in enumerate(buffer_ptrs):
        if int(base) == 0:
            raise ValueError(f"buffer_ptrs[{j}] is null (peer not mapped)")
        a = int(base) + offset
        if a % ADDRESS_ALIGN:
            raise ValueError(f"peer {j} address 0x{a:x} is not {ADDRESS_ALIGN}-byte aligned")
        addrs.append(a)
    return addrs


class SymmetricTensor:
    """One buffer of identical shape/dtype on every rank, with peer tables.

    Created by :meth:`World.alloc`.  ``local(r)`` is rank r's own copy;
    ``peer_table(r)`` the int64 device table of every rank's base address as
    seen from rank r; ``addresses(r)`` the same as Python ints.
    """

    def __init__(
        self,
        world: "World",
        shape: Tuple[int, ...],
        dtype: torch.dtype,
        locals_: Dict[int, torch.Tensor],
        addresses: Dict[int, List[int]],
        keepalive: Sequence[object] = (),
        host_copies: Optional[Dict[int, torch.Tensor]] = None,
    ):
        self.world = world
        self.shape = shape
        self.dtype = dtype
        self._locals = locals_
        self._addresses = addresses
        self._tables: Dict[int, torch.Tensor] = {}
        self._keepalive = list(keepalive)  # owners of the memory (host pinned buffers, symm handles)
        self._host = host_copies or {}

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def _check_rank(self, r: int) -> None:
        if isinstance(r, bool) or not isinstance(r, int):
            raise TypeError(f"rank must be an int, got {r!r}")
        if r not in self.world.local_ranks:
            raise ValueError(
                f"rank {r} is not local to this process (local ranks: {self.world.local_ranks}, "
                f"backend {self.world.backend})"
            )

    def local(self, r: int) -> torch.Tensor:
        """Rank r's own buffer (a separate allocation per rank in loopback/host).

        ``host`` backend: a CUDA tensor aliasing the pinned host memory when
        torch accepts the mapping (else the pinned CPU tensor itself).
        """
        self._check_rank(r)
        return self._locals[r]

    def host(self, r: int) -> torch.Tensor:
        """``host`` backend only: rank r's pinned CPU tensor (same memory as ``local(r)``)."""
        self._check_rank(r)
        if r not in self._host:
            raise ValueError(f"backend {self.world.backend!r} has no host copy")
        return self._host[r]

    def addresses(self, r: int) -> List[int]:
        """Every rank's base address as seen from rank r (Python ints)."""
        self._check_rank(r)
        return list(self._addresses[r])

    def peer_table(self, r: int) -> torch.Tensor:
        """int64 tensor [P] on the world's device: base address of every rank's buffer seen from r."""
        self._check_rank(r)
        if r not in self._tables:
            self._tables[r] = torch.tensor(self._addresses[r], dtype=torch.int64, device=self.world.device)
        return self._tables[r]

    def fill_(self, value) -> "SymmetricTensor":
        """Fill (poison) every local copy with ``value``."""
        for r in self.world.local_ranks:
            self._locals[r].fill_(value)
        return self

    def __repr__(self) -> str:
        return (
            f"SymmetricTensor(shape={self.shape}, dtype={self.dtype}, backend={self.world.backend}, "
            f"world_size={self.world.world_size})"
        )


class World:
    """Base class: ``world_size`` ranks, of which ``local_ranks`` live in this process."""

    backend: str = ""

    def __init__(self, world_size: int, device: torch.device):
        self.world_size = world_size
        self.device = device

    @property
    def local_ranks(self) -> List[int]:
        raise NotImplementedError

    @property
    def placement(self) -> str:
        """Where the remote destinations live, for result labels: the backend's name, or
        ``loopback+host`` when only they are pinned host memory."""
        return self.backend

    def barrier(self) -> None:
        raise NotImplementedError

    def alloc(self, shape: ShapeLike, dtype: torch.dtype, remote: bool = False) -> SymmetricTensor:
        """One buffer per rank; ``remote``: a buffer that kernels store into from other ranks
        (see the module docstring's placement paragraph)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world_size={self.world_size}, device={self.device})"


class LoopbackWorld(World):
    """P simulated ranks in one process on one device; one allocation per rank."""

    backend = "loopback"

    def __init__(self, world_size: int, device: torch.device, remote: str = "device"):
        if remote not in REMOTE_PLACEMENTS:
            raise ValueError(f"remote must be one of {REMOTE_PLACEMENTS}, got {remote!r}")
        if remote == "host" and device.type != "cuda":
            raise ValueError("remote='host' (pinned host memory) needs a CUDA device")
        super().__init__(world_size, device)
        self.remote = remote
        self.uva_checks: List[str] = []  # as HostWorld's, for the pinned remote destinations

    @property
    def local_ranks(self) -> List[int]:
        return list(range(self.world_size))

    @property
    def placement(self) -> str:
        return "loopback+host" if self.remote == "host" else "loopback"

    def barrier(self) -> None:
        # All ranks share one process and stream order; a device sync makes
        # every rank's previous kernels complete.
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def alloc(self, shape: ShapeLike, dtype: torch.dtype, remote: bool = False) -> SymmetricTensor:
        shape = _normalize_shape(shape)
        dtype = _check_dtype(dtype)
        if remote and self.remote == "host":
            return _alloc_pinned(self, shape, dtype)
        locals_ = {r: torch.empty(shape, dtype=dtype, device=self.device) for r in self.local_ranks}
        ptrs = [locals_[r].data_ptr() for r in self.local_ranks]
        for r, p in enumerate(ptrs):
            if p % ADDRESS_ALIGN:
                raise RuntimeError(f"allocation for rank {r} is not {ADDRESS_ALIGN}-byte aligned (0x{p:x})")
        return SymmetricTensor(self, shape, dtype, locals_, {r: list(ptrs) for r in self.local_ranks})


class _CudaArrayView:
    """Minimal ``__cuda_array_interface__`` over a device-visible address (bytes)."""

    def __init__(self, ptr: int, nbytes: int, owner: object):
        self._owner = owner  # keeps the pinned allocation alive as long as the view
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def _host_device_pointer(ptr: int) -> Optional[int]:
    """cudaHostGetDevicePointer for a pinned host pointer, if cuda-python is present (else None)."""
    try:
        from cuda.bindings import runtime as cudart  # type: ignore
    except Exception:
        return None
    try:
        err, dptr = cudart.cudaHostGetDevicePointer(ptr, 0)
    except Exception:
        return None
    if int(err) != 0:
        return None
    return int(dptr)


class HostWorld(World):
    """P ranks whose buffers are pinned, device-mapped host memory (stores go over PCIe)."""

    backend = "host"

    def __init__(self, world_size: int, device: torch.device):
        super().__init__(world_size, device)
        self.uva_checks: List[str] = []

    @property
    def local_ranks(self) -> List[int]:
        return list(range(self.world_size))

    def barrier(self) -> None:
        torch.cuda.synchronize(self.device)

    def alloc(self, shape: ShapeLike, dtype: torch.dtype, remote: bool = False) -> SymmetricTensor:
        return _alloc_pinned(self, _normalize_shape(shape), _check_dtype(dtype))


def _alloc_pinned(world: World, shape: Tuple[int, ...], dtype: torch.dtype) -> SymmetricTensor:
    """One pinned, device-mapped host buffer per local rank of ``world`` (stores to it cross PCIe)."""
    host: Dict[int, torch.Tensor] = {}
    locals_: Dict[int, torch.Tensor] = {}
    addrs: List[int] = []
    keep: List[object] = []
    with torch.cuda.device(world.device):
        for r in world.local_ranks:
            h = torch.empty(shape, dtype=dtype, pin_memory=True)
            ptr = h.data_ptr()
            if ptr % ADDRESS_ALIGN:
                raise RuntimeError(f"pinned allocation for rank {r} is not {ADDRESS_ALIGN}-byte aligned")
            # With UVA (every 64-bit CUDA platform) a pinned host pointer is
            # also its device pointer; check when cuda-python can tell.
            dptr = _host_device_pointer(ptr)
            if dptr is not None:
                if dptr != ptr:
                    raise RuntimeError(
                        f"pinned memory is mapped at 0x{dptr:x} on the device, host 0x{ptr:x}: no UVA"
                    )
                world.uva_checks.append(f"rank {r}: cudaHostGetDevicePointer == host pointer")
            nbytes = h.numel() * h.element_size()
            try:
                dev_view = torch.as_tensor(_CudaArrayView(ptr, nbytes, h), device=world.device)
                dev_view = dev_view.view(dtype).view(shape)
            except Exception:  # torch refused the mapping: fall back to the CPU tensor
                dev_view = h
            host[r] = h
            locals_[r] = dev_view
            addrs.append(ptr)
            keep.append(h)
    return SymmetricTensor(world, shape, dtype, locals_, {r: list(addrs) for r in world.local_ranks}, keep, host)


class _ProcessGroupWorld(World):
    """One rank per process over a torch.distributed group: the group's rank is the local rank,
    and ``barrier`` syncs the device and the group. Subclasses allocate."""

    def __init__(self, world_size: int, device: torch.device, group, dist, why: str):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{self.backend} world needs an initialized torch.distributed process group "
                               f"({why}): call dist.init_process_group('nccl') first")
        actual = dist.get_world_size(group)
        if actual != world_size:
            raise ValueError(f"world_size={world_size} but the process group has {actual} ranks")
        super().__init__(world_size, device)
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)

    @property
    def local_ranks(self) -> List[int]:
        return [self.rank]

    def barrier(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._dist.barrier(group=self.group)


class TorchSymmWorld(_ProcessGroupWorld):
    """One rank per process: torch.distributed + torch symmetric memory.

    ``dist``/``symm_mem`` are injectable for tests (defaults:
    ``torch.distributed`` and ``torch.distributed._symmetric_memory``).
    """

    backend = "torch-symm"

    def __init__(self, world_size: int, device: torch.device, group=None, dist=None, symm_mem=None):
        if dist is None:
            import torch.distributed as dist  # noqa: F811
        if symm_mem is None:
            import torch.distributed._symmetric_memory as symm_mem  # noqa: F811
        super().__init__(world_size, device, group, dist, "run under torchrun")
        self._symm = symm_mem

    def _group_arg(self):
        if self.group is not None:
            return self.group
        return self._dist.group.WORLD

    def alloc(self, shape: ShapeLike, dtype: torch.dtype, remote: bool = False) -> SymmetricTensor:
        shape = _normalize_shape(shape)
        dtype = _check_dtype(dtype)
        t = self._symm.empty(shape, dtype=dtype, device=self.device)
        hdl = self._symm.rendezvous(t, self._group_arg())
        if hdl.world_size != self.world_size:
            raise RuntimeError(f"symmetric handle has world_size {hdl.world_size}, expected {self.world_size}")
        if hdl.rank != self.rank:
            raise RuntimeError(f"symmetric handle rank {hdl.rank} != process rank {self.rank}")
        nbytes = t.numel() * t.element_size()
        addrs = symm_peer_addresses(
            list(hdl.buffer_ptrs), self.rank, t.data_ptr(), nbytes, getattr(hdl, "buffer_size", None)
        )
        return SymmetricTensor(self, shape, dtype, {self.rank: t}, {self.rank: addrs}, keepalive=[hdl])


def _nvshmem_initialized(core) -> bool:
    """NVSHMEM is up (nvshmem4py's init_status: IS_INITIALIZED or one of the MPG states)."""
    name = getattr(core.init_status(), "name", str(core.init_status()))
    return name.endswith("IS_INITIALIZED") or name.endswith("MPG")


class NvshmemWorld(_ProcessGroupWorld):
    """One PE per process: buffers from NVSHMEM's symmetric heap (nvshmem4py's torch interop),
    peer tables from its peer-pointer query (``get_peer_tensor``, i.e. ``nvshmem_ptr``).

    Joins an NVSHMEM that the stack has initialised (the PE must equal the process's rank in
    ``group``); otherwise initialises it with a unique id broadcast over ``group``. torch.distributed
    must be initialised either way: the kernels' host side uses it (the pre-attention A2A, the
    MegaMoE routing exchange). Every peer must be reachable by loads and stores (one node: NVLink
    or PCIe P2P). A peer without a mapping (another node) raises at ``alloc``: inter-node would
    need device-side puts (``nvshmem_putmem_nbi``) in the kernels' store seam instead of st.global.
    ``nvshmem`` (``nvshmem.core``), ``interop`` (``nvshmem.core.interop.torch``), ``dist`` and
    ``device_factory`` (``cuda.core.Device``) are injectable for tests.
    """

    backend = "nvshmem"

    def __init__(self, world_size: int, device: torch.device, group=None, nvshmem=None, interop=None, dist=None,
                 device_factory=None):
        if dist is None:
            import torch.distributed as dist  # noqa: F811
        super().__init__(world_size, device, group, dist, "the kernels' host side exchanges over it")
        if nvshmem is None or interop is None:
            try:
                nvshmem = nvshmem or importlib.import_module("nvshmem.core")
                interop = interop or importlib.import_module("nvshmem.core.interop.torch")
            except ImportError as e:
                raise RuntimeError("the nvshmem world needs nvshmem4py: pip install 'xstage[nvshmem]'") from e
        self._nv, self._interop = nvshmem, interop
        self._heap_tensors = []  # every buffer alloc() took from the symmetric heap, for close()
        self._owns_nvshmem = not _nvshmem_initialized(nvshmem)  # close() finalizes only what it initialized
        if self._owns_nvshmem:
            self._init_nvshmem(device_factory)
        pe, n_pes = nvshmem.my_pe(), nvshmem.n_pes()
        if n_pes != world_size:
            raise ValueError(f"NVSHMEM has {n_pes} PEs, the world {world_size} ranks")
        if pe != self.rank:
            raise RuntimeError(f"NVSHMEM PE {pe} is rank {self.rank} of the process group: the world needs PE = rank")

    def _init_nvshmem(self, device_factory) -> None:
        """UID bootstrap: rank 0's unique id broadcast over the group, then nvshmem init."""
        if device_factory is None:
            from cuda.core import Device as device_factory  # nvshmem4py's dependency
        uid = [self._nv.get_unique_id() if self.rank == 0 else self._nv.get_unique_id(empty=True)]
        src = 0 if self.group is None else self._dist.get_global_rank(self.group, 0)
        self._dist.broadcast_object_list(uid, src=src, group=self.group)
        dev = device_factory(self.device.index or 0)
        dev.set_current()
        self._nv.init(device=dev, uid=uid[0], rank=self.rank, nranks=self.world_size, initializer_method="uid")

    def alloc(self, shape: ShapeLike, dtype: torch.dtype, remote: bool = False) -> SymmetricTensor:
        shape = _normalize_shape(shape)
        dtype = _check_dtype(dtype)
        t = self._interop.tensor(shape, dtype=dtype)
        addrs = []
        for j in range(self.world_size):
            peer = self._interop.get_peer_tensor(t, j)
            if peer is None or peer.data_ptr() == 0:
                raise RuntimeError(f"PE {j} is not load/store reachable from PE {self.rank} (another node?): the "
                                   "kernels store through peer pointers; inter-node needs device-side puts")
            if peer.data_ptr() % ADDRESS_ALIGN:
                raise ValueError(f"peer {j} address 0x{peer.data_ptr():x} is not {ADDRESS_ALIGN}-byte aligned")
            addrs.append(peer.data_ptr())
        if addrs[self.rank] != t.data_ptr():
            raise RuntimeError("NVSHMEM's own-PE pointer differs from the tensor's address")
        self._heap_tensors.append(t)
        return SymmetricTensor(self, shape, dtype, {self.rank: t}, {self.rank: addrs}, keepalive=[t])

    def close(self) -> None:
        """Free every buffer this world took from the symmetric heap and, if this world initialised
        NVSHMEM, finalize it (a joined NVSHMEM belongs to the stack). Collective, like NVSHMEM's
        free: every PE calls it. Tensors of this world must not be used afterwards."""
        self.barrier()  # no kernel of any PE still stores into the buffers
        while self._heap_tensors:
            self._interop.free_tensor(self._heap_tensors.pop())
        if self._owns_nvshmem:
            self._nv.finalize()
            self._owns_nvshmem = False


def single_process(world) -> bool:
    """Every rank of ``world`` lives in this process (loopback, host): one stream orders all ranks'
    work, and no cross-process exchange or barrier is needed."""
    return len(world.local_ranks) == world.world_size


def _resolve_device(device, backend: str) -> torch.device:
    if device is None:
        if not torch.cuda.is_available():
            raise RuntimeError(f"backend {backend!r} needs a CUDA device (none visible)")
        if backend in ("torch-symm", "nvshmem") and "LOCAL_RANK" in os.environ:
            return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        return torch.device("cuda", torch.cuda.current_device())
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"backend {backend!r}: CUDA device {dev} requested but CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev
    if dev.type == "cpu" and backend == "loopback":
        # Host-side testing of addressing only: tables live on the CPU, no kernel can run.
        return dev
    raise ValueError(f"backend {backend!r} needs a CUDA device, got {dev}")


def make_world(backend: str, world_size: int = 1, device=None, **kwargs) -> World:
    """Create a peer-memory world.

    backend: ``"loopback"`` | ``"host"`` | ``"torch-symm"`` | ``"nvshmem"`` (see module doc), or ``"loopback+host"``
    for ``"loopback"`` with ``remote="host"``.
    world_size: number of ranks P (>= 1).  device: a CUDA device (default: the
    current one).  ``loopback`` also accepts ``device="cpu"`` for host-side
    tests of the addressing (tables on the CPU; nothing can be launched).
    ``torch-symm`` and ``nvshmem`` accept ``group=`` (default: the world group); ``loopback`` accepts
    ``remote="host"`` (remote destinations in pinned host memory, see the module docstring).
    """
    if backend == "loopback+host":
        backend, kwargs = "loopback", dict(kwargs, remote="host")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {WORLDS}")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    allowed = {"loopback": {"remote"}, "host": set(), "torch-symm": {"group", "dist", "symm_mem"},
               "nvshmem": {"group", "nvshmem", "interop", "dist", "device_factory"}}[backend]
    if set(kwargs) - allowed:
        raise TypeError(f"unexpected arguments for backend {backend!r}: {sorted(set(kwargs) - allowed)}")
    dev = _resolve_device(device, backend)
    if backend == "loopback":
        return LoopbackWorld(world_size, dev, **kwargs)
    if backend == "host":
        return HostWorld(world_size, dev)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if backend == "nvshmem":
        return NvshmemWorld(world_size, dev, **kwargs)
    return TorchSymmWorld(world_size, dev, **kwargs)
