"""GPU side of the SDK: open the daemon's device pool over CUDA IPC and move blocks between it
and the engine's own paged KV cache.

Why it is shaped this way:

* **Everything CUDA imports lazily.** `import kvstore_client.gpu` works with no torch, no CUDA,
  no CuPy; only calling into the GPU paths needs them, and then a missing piece raises
  `Unavailable` with a message naming what is missing.
* **One CUDA runtime wrapper, two backends.** torch has no public API for cudaMalloc outside its
  caching allocator, IPC handles or cudaHostRegister, so raw calls go through CuPy when it is
  installed and otherwise through ctypes on the libcudart that torch's CUDA wheels ship. The
  daemon (`tiers/cuda_util.py`) reuses this wrapper, since `kvstore_client` must not import
  `tiers`.
* **Each pool is opened once per process.** CUDA refuses to open the same IPC handle twice in a
  context and refuses to open a process's own handle, so `open_pool` caches mappings by handle
  and serves the exporting process (an in-process daemon) its own pointer.
* **Batched copies, no per-block Python loop.** A transfer is planned on the CPU with numpy
  (addresses of equal-size contiguous runs on both sides, `plan_block_runs`) and executed as one
  Triton kernel launch, or, without Triton, as bounded pairs of torch `index_select` /
  `index_copy_` over one wide-dtype view spanning the pool and the cache. Both work for any
  cache layout described by strides and a block table.
* **Streams and events.** Copies run on the client's own stream, after the engine's current
  stream; a `Transfer` carries the event so the engine can make a stream wait on it (GPU-side)
  or wait with a deadline (host-side) before Commit/Release.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import DeadlineExceeded, InvalidArgument, KVStoreError, Unavailable
from .layout import KVLayout

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

IPC_HANDLE_BYTES = 64                  # sizeof(cudaIpcMemHandle_t)
IPC_LAZY_ENABLE_PEER_ACCESS = 1        # cudaIpcMemLazyEnablePeerAccess
HOST_REGISTER_PORTABLE = 1             # cudaHostRegisterPortable: pinned for every context
_ERR_MEMORY_ALLOCATION = 2             # cudaErrorMemoryAllocation
_ERR_HOST_ALREADY_REGISTERED = 712     # cudaErrorHostMemoryAlreadyRegistered
_ERR_HOST_NOT_REGISTERED = 713         # cudaErrorHostMemoryNotRegistered

# More runs per block than this means the cache layout has no usable contiguous dimension.
MAX_RUNS_PER_BLOCK = 1 << 20
# The torch fallback stages through a temporary of at most this many bytes per step.
TORCH_STAGE_BYTES = 256 << 20

# Filled in by _triton_kernel(); module globals so Triton's JIT can resolve them.
triton: Any = None
tl: Any = None


class CudaError(KVStoreError):
    """A CUDA runtime call failed; `status` is the cudaError_t value."""

    def __init__(self, message: str, status: int = -1) -> None:
        super().__init__(message)
        self.status = status


# ---------------------------------------------------------------------------------------------
# availability
# ---------------------------------------------------------------------------------------------
def cuda_available() -> bool:
    """True when torch is installed with CUDA and sees at least one device. Never raises."""
    try:
        import torch
    except ImportError:
        return False
    try:
        return bool(torch.cuda.is_available()) and torch.cuda.device_count() > 0
    except Exception:  # broken driver installs raise from is_available on some versions
        return False


def require_cuda(device: int | None = None, what: str = "GPU transfer") -> Any:
    """Return the torch module, or raise Unavailable naming what is missing."""
    try:
        import torch
    except ImportError:
        raise Unavailable(f"{what}: no CUDA device (torch is not installed)") from None
    if not cuda_available():
        raise Unavailable(f"{what}: no CUDA device (torch.cuda.is_available() is False; "
                          f"torch {torch.__version__})")
    if device is not None:
        n = torch.cuda.device_count()
        if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < n:
            raise Unavailable(f"{what}: no CUDA device {device!r} (this process sees {n})")
    return torch


# ---------------------------------------------------------------------------------------------
# CUDA runtime: CuPy or ctypes on libcudart
# ---------------------------------------------------------------------------------------------
class CudaRuntime:
    """The raw runtime calls torch does not expose. Every call names its device explicitly."""

    name = "none"

    def malloc(self, device: int, nbytes: int) -> int:
        raise NotImplementedError

    def free(self, device: int, ptr: int) -> None:
        raise NotImplementedError

    def ipc_get_mem_handle(self, device: int, ptr: int) -> bytes:
        raise NotImplementedError

    def ipc_open_mem_handle(self, device: int, handle: bytes) -> int:
        raise NotImplementedError

    def ipc_close_mem_handle(self, device: int, ptr: int) -> None:
        raise NotImplementedError

    def host_register(self, ptr: int, nbytes: int, flags: int = HOST_REGISTER_PORTABLE) -> None:
        raise NotImplementedError

    def host_unregister(self, ptr: int) -> None:
        raise NotImplementedError


class _CupyRuntime(CudaRuntime):
    name = "cupy"

    def __init__(self, cupy: Any) -> None:
        self._rt = cupy.cuda.runtime
        self._err = cupy.cuda.runtime.CUDARuntimeError

    def _call(self, what: str, device: int | None, fn: Any, *args: Any) -> Any:
        try:
            if device is not None:
                self._rt.setDevice(device)
            return fn(*args)
        except self._err as e:
            raise CudaError(f"{what}: {e}", int(getattr(e, "status", -1))) from None

    def malloc(self, device: int, nbytes: int) -> int:
        # runtime.malloc is cudaMalloc itself: CuPy's memory pool is not involved, so the
        # allocation is its own exportable segment.
        return int(self._call("cudaMalloc", device, self._rt.malloc, nbytes))

    def free(self, device: int, ptr: int) -> None:
        self._call("cudaFree", device, self._rt.free, ptr)

    def ipc_get_mem_handle(self, device: int, ptr: int) -> bytes:
        return bytes(self._call("cudaIpcGetMemHandle", device, self._rt.ipcGetMemHandle, ptr))

    def ipc_open_mem_handle(self, device: int, handle: bytes) -> int:
        return int(self._call("cudaIpcOpenMemHandle", device, self._rt.ipcOpenMemHandle,
                              handle, IPC_LAZY_ENABLE_PEER_ACCESS))

    def ipc_close_mem_handle(self, device: int, ptr: int) -> None:
        self._call("cudaIpcCloseMemHandle", device, self._rt.ipcCloseMemHandle, ptr)

    def host_register(self, ptr: int, nbytes: int, flags: int = HOST_REGISTER_PORTABLE) -> None:
        self._call("cudaHostRegister", None, self._rt.hostRegister, ptr, nbytes, flags)

    def host_unregister(self, ptr: int) -> None:
        self._call("cudaHostUnregister", None, self._rt.hostUnregister, ptr)


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * IPC_HANDLE_BYTES)]


class _CtypesRuntime(CudaRuntime):
    name = "libcudart"

    def __init__(self, lib: ctypes.CDLL) -> None:
        c_void_pp = ctypes.POINTER(ctypes.c_void_p)
        sigs = {
            "cudaSetDevice": [ctypes.c_int],
            "cudaMalloc": [c_void_pp, ctypes.c_size_t],
            "cudaFree": [ctypes.c_void_p],
            "cudaIpcGetMemHandle": [ctypes.POINTER(_IpcHandle), ctypes.c_void_p],
            "cudaIpcOpenMemHandle": [c_void_pp, _IpcHandle, ctypes.c_uint],
            "cudaIpcCloseMemHandle": [ctypes.c_void_p],
            "cudaHostRegister": [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint],
            "cudaHostUnregister": [ctypes.c_void_p],
        }
        for fname, argtypes in sigs.items():
            fn = getattr(lib, fname)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        self._lib = lib

    def _check(self, what: str, status: int) -> None:
        if status != 0:
            msg = self._lib.cudaGetErrorString(status) or b"unknown error"
            raise CudaError(f"{what}: {msg.decode(errors='replace')} (cudaError {status})",
                            status)

    def _set(self, device: int) -> None:
        # The current device is per thread and per runtime copy; set it on every call.
        self._check("cudaSetDevice", self._lib.cudaSetDevice(device))

    def malloc(self, device: int, nbytes: int) -> int:
        self._set(device)
        p = ctypes.c_void_p()
        self._check("cudaMalloc", self._lib.cudaMalloc(ctypes.byref(p), nbytes))
        return int(p.value or 0)

    def free(self, device: int, ptr: int) -> None:
        self._set(device)
        self._check("cudaFree", self._lib.cudaFree(ctypes.c_void_p(ptr)))

    def ipc_get_mem_handle(self, device: int, ptr: int) -> bytes:
        self._set(device)
        h = _IpcHandle()
        self._check("cudaIpcGetMemHandle",
                    self._lib.cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(ptr)))
        return bytes(h.reserved)

    def ipc_open_mem_handle(self, device: int, handle: bytes) -> int:
        self._set(device)
        h = _IpcHandle.from_buffer_copy(handle)
        p = ctypes.c_void_p()
        self._check("cudaIpcOpenMemHandle", self._lib.cudaIpcOpenMemHandle(
            ctypes.byref(p), h, IPC_LAZY_ENABLE_PEER_ACCESS))
        return int(p.value or 0)

    def ipc_close_mem_handle(self, device: int, ptr: int) -> None:
        self._set(device)
        self._check("cudaIpcCloseMemHandle", self._lib.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr)))

    def host_register(self, ptr: int, nbytes: int, flags: int = HOST_REGISTER_PORTABLE) -> None:
        self._check("cudaHostRegister",
                    self._lib.cudaHostRegister(ctypes.c_void_p(ptr), nbytes, flags))

    def host_unregister(self, ptr: int) -> None:
        self._check("cudaHostUnregister", self._lib.cudaHostUnregister(ctypes.c_void_p(ptr)))


def _libcudart_candidates() -> list[str]:
    """Where libcudart may be: the copy torch's wheel already loaded first (same runtime state)."""
    names = ["libcudart.so.12", "libcudart.so.13", "libcudart.so.11.0", "libcudart.so"]
    try:  # pip wheels: nvidia-cuda-runtime-cu12 installs nvidia/cuda_runtime/lib/
        import nvidia.cuda_runtime as ncr  # type: ignore[import-not-found]
        for d in getattr(ncr, "__path__", []):
            lib = os.path.join(d, "lib")
            if os.path.isdir(lib):
                names[:0] = [os.path.join(lib, f) for f in sorted(os.listdir(lib))
                             if f.startswith("libcudart.so")]
    except ImportError:
        pass
    found = ctypes.util.find_library("cudart")
    if found:
        names.append(found)
    return names


_runtime: CudaRuntime | None = None
_runtime_lock = threading.Lock()


def get_runtime() -> CudaRuntime:
    """The process's CUDA runtime wrapper (CuPy if installed, else libcudart via ctypes)."""
    global _runtime
    with _runtime_lock:
        if _runtime is not None:
            return _runtime
        require_cuda(None, "CUDA runtime")
        try:
            import cupy  # type: ignore[import-not-found]
            _runtime = _CupyRuntime(cupy)
            return _runtime
        except ImportError:
            pass
        errors = []
        for cand in _libcudart_candidates():
            try:
                _runtime = _CtypesRuntime(ctypes.CDLL(cand))
                return _runtime
            except (OSError, AttributeError) as e:
                errors.append(f"{cand}: {e}")
        raise Unavailable("CUDA runtime: neither CuPy nor libcudart could be loaded "
                          f"(install cupy-cuda12x or nvidia-cuda-runtime-cu12); tried {errors}")


# ---------------------------------------------------------------------------------------------
# pinned host memory (cudaHostRegister of an existing buffer, e.g. the shared-memory slab)
# ---------------------------------------------------------------------------------------------
def _address_of(buf: Any) -> tuple[int, int]:
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise InvalidArgument("can only pin a contiguous buffer")
        return int(buf.ctypes.data), int(buf.nbytes)
    arr = np.frombuffer(buf, dtype=np.uint8)
    return int(arr.ctypes.data), int(arr.nbytes)


class PinnedHost:
    """A host range registered as pinned (page-locked, DMA-able) memory.

    Without CUDA this is a no-op with `pinned == False`, so callers pin unconditionally.
    `close()` must run before the buffer is unmapped: unmapping a registered range leaves the
    driver holding stale page pins.
    """

    def __init__(self, ptr: int, nbytes: int, pinned: bool, owned: bool, reason: str = "") -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.pinned = pinned
        self.reason = reason
        self._owned = owned    # False: someone else registered it; never unregister theirs

    def close(self) -> None:
        if self._owned:
            self._owned = False
            try:
                get_runtime().host_unregister(self.ptr)
            except CudaError as e:
                if e.status != _ERR_HOST_NOT_REGISTERED:
                    raise
        self.pinned = False

    def __enter__(self) -> PinnedHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pin_host(buf: Any, *, required: bool = False) -> PinnedHost:
    """Register `buf` (numpy array / buffer, e.g. a shm slab) with cudaHostRegister(Portable).

    Host↔GPU copies from pageable memory run through a driver bounce buffer at a fraction of
    PCIe speed; registered memory is copied by DMA directly. Returns a no-op handle without CUDA
    unless `required`.
    """
    ptr, nbytes = _address_of(buf)
    if nbytes == 0:
        return PinnedHost(ptr, 0, False, False, "empty buffer")
    if not cuda_available():
        if required:
            raise Unavailable("cannot pin host memory: no CUDA device")
        return PinnedHost(ptr, nbytes, False, False, "no CUDA device")
    try:
        rt = get_runtime()
    except Unavailable as e:
        if required:
            raise
        return PinnedHost(ptr, nbytes, False, False, str(e))
    try:
        rt.host_register(ptr, nbytes, HOST_REGISTER_PORTABLE)
    except CudaError as e:
        if e.status == _ERR_HOST_ALREADY_REGISTERED:
            return PinnedHost(ptr, nbytes, True, False, "already registered")
        if required:
            raise
        return PinnedHost(ptr, nbytes, False, False, str(e))
    return PinnedHost(ptr, nbytes, True, True)


# ---------------------------------------------------------------------------------------------
# raw device memory as torch tensors
# ---------------------------------------------------------------------------------------------
class _CudaArray:
    """Minimal __cuda_array_interface__ exporter so torch can view raw device memory, zero copy.

    torch keeps a reference to this object for as long as the tensor lives, and this object
    keeps `owner` (e.g. the open pool) alive.
    """

    def __init__(self, ptr: int, nbytes: int, owner: object = None) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2,
            "strides": None,
        }
        self._owner = owner


def device_tensor(ptr: int, nbytes: int, device: int, owner: object = None) -> torch.Tensor:
    """1-D uint8 CUDA tensor over [ptr, ptr+nbytes) on `device` (memory not owned by torch)."""
    torch = require_cuda(device, "device view")
    with torch.cuda.device(device):
        t = torch.as_tensor(_CudaArray(ptr, nbytes, owner), device=f"cuda:{device}")
    if t.data_ptr() != ptr or t.numel() != nbytes:
        raise CudaError("torch did not view the device memory in place")
    return t


def host_tensor(ptr: int, nbytes: int, owner: object = None) -> torch.Tensor:
    """1-D uint8 CPU tensor over raw host memory (used for CPU execution of the same plans)."""
    import torch

    arr = np.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=np.uint8)
    t = torch.from_numpy(arr)
    t._kvstore_owner = owner  # type: ignore[attr-defined]
    return t


# ---------------------------------------------------------------------------------------------
# pools: one IPC mapping per handle per process
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PoolDesc:
    """What `GPUTier.describe()` tells a client (validated)."""

    device: int
    handle: bytes
    size: int
    pid: int
    uuid: str = ""
    name: str = ""

    @classmethod
    def parse(cls, d: dict) -> PoolDesc:
        if not isinstance(d, dict) or d.get("kind") != "cuda_ipc":
            raise InvalidArgument(f"not a CUDA IPC pool description: {d!r:.200}")
        handle = d.get("handle")
        if isinstance(handle, str):  # JSON transports carry it as hex
            try:
                handle = bytes.fromhex(handle)
            except ValueError:
                raise InvalidArgument("pool handle is not hex") from None
        if isinstance(handle, (bytearray, memoryview)):
            handle = bytes(handle)
        if not isinstance(handle, bytes) or len(handle) != IPC_HANDLE_BYTES:
            raise InvalidArgument(f"pool handle must be {IPC_HANDLE_BYTES} bytes "
                                  f"(cudaIpcMemHandle_t), got {type(handle).__name__} "
                                  f"of length {len(handle) if hasattr(handle, '__len__') else '?'}")
        for key in ("device", "size", "pid"):
            v = d.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0 or (key == "size" and v == 0):
                raise InvalidArgument(f"pool {key} must be a non-negative integer, got {v!r}")
        return cls(d["device"], handle, d["size"], d["pid"], str(d.get("uuid", "")),
                   str(d.get("name", "")))


class DevicePool:
    """A daemon GPU pool mapped into this process. Use `open_pool`, not the constructor."""

    def __init__(self, desc: PoolDesc, ptr: int, device: int, local: bool) -> None:
        self.desc = desc
        self.ptr = ptr
        self.size = desc.size
        self.device = device          # the device index *in this process*
        self.local = local            # True: this process exported it; nothing to close
        self._tensor: torch.Tensor | None = None
        self.closed = False

    @property
    def tensor(self) -> torch.Tensor:
        """The whole pool as a 1-D uint8 CUDA tensor (zero copy)."""
        if self.closed:
            raise InvalidArgument("GPU pool mapping is closed")
        if self._tensor is None:
            self._tensor = device_tensor(self.ptr, self.size, self.device, self)
        return self._tensor

    def close(self) -> None:
        """Unmap (cudaIpcCloseMemHandle) after every stream on the device has drained."""
        if self.closed:
            return
        self.closed = True
        self._tensor = None
        with _pools_lock:
            if _pools.get(self.desc.handle) is self:
                del _pools[self.desc.handle]
        if self.local or _pools_pid != os.getpid():
            return   # own export, or a forked child that never had this mapping
        torch = require_cuda(self.device, "close GPU pool")
        torch.cuda.synchronize(self.device)   # no kernel may still read the mapping
        get_runtime().ipc_close_mem_handle(self.device, self.ptr)


_pools: dict[bytes, DevicePool] = {}
_pools_pid = os.getpid()
_pools_lock = threading.Lock()
# handle -> (ptr, device) of pools this process exported itself (an in-process daemon).
_local_exports: dict[bytes, tuple[int, int]] = {}


def register_local_export(handle: bytes, ptr: int, device: int) -> None:
    """Called by the daemon's GPU tier: CUDA cannot open a process's own IPC handle."""
    with _pools_lock:
        _local_exports[bytes(handle)] = (ptr, device)


def unregister_local_export(handle: bytes) -> None:
    with _pools_lock:
        _local_exports.pop(bytes(handle), None)
        pool = _pools.pop(bytes(handle), None)
    if pool is not None:
        pool.closed = True


def _local_device_for(desc: PoolDesc, torch: Any) -> int | None:
    """The index of the pool's physical GPU in this process (CUDA_VISIBLE_DEVICES may differ)."""
    if not desc.uuid:
        return None
    for i in range(torch.cuda.device_count()):
        try:
            if str(torch.cuda.get_device_properties(i).uuid) == desc.uuid:
                return i
        except (AttributeError, RuntimeError):
            return None
    return None


def open_pool(desc: dict | PoolDesc, device: int | None = None) -> DevicePool:
    """Map the daemon pool `desc` once per process; later calls return the same mapping.

    `device`: the device to map it on when the pool's GPU is not visible here (peer access is
    enabled lazily). A pool with the same `name` but another handle (the daemon restarted) is
    closed first: its memory belongs to a dead daemon.
    """
    global _pools_pid
    d = desc if isinstance(desc, PoolDesc) else PoolDesc.parse(desc)
    torch = require_cuda(None, "open GPU pool")
    with _pools_lock:
        if _pools_pid != os.getpid():   # forked: inherited mappings are not valid here
            _pools.clear()
            _pools_pid = os.getpid()
        hit = _pools.get(d.handle)
        if hit is not None and not hit.closed:
            return hit
        stale = [p for p in _pools.values() if d.name and p.desc.name == d.name]
        local = _local_exports.get(d.handle)
    for p in stale:
        p.close()
    if local is not None:
        pool = DevicePool(d, local[0], local[1], local=True)
    else:
        if d.pid == os.getpid():
            raise InvalidArgument("this process exported the pool but has no record of it "
                                  "(closed GPU tier?)")
        dev = _local_device_for(d, torch)
        if dev is None:
            dev = device if device is not None else torch.cuda.current_device()
        require_cuda(dev, "open GPU pool")
        ptr = get_runtime().ipc_open_mem_handle(dev, d.handle)
        pool = DevicePool(d, ptr, dev, local=False)
    with _pools_lock:
        _pools[d.handle] = pool
    return pool


def close_all_pools() -> None:
    """Unmap every pool this process opened (also runs at exit)."""
    with _pools_lock:
        pools = list(_pools.values())
    for p in pools:
        try:
            p.close()
        except Exception:  # exiting: the driver reclaims mappings with the process anyway
            pass


atexit.register(close_all_pools)


# ---------------------------------------------------------------------------------------------
# the engine's paged cache and transfer planning (pure numpy; CPU-testable)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorGeom:
    """Address, element size, shape [num_blocks, block_tokens, heads, head_dim] and strides
    (in elements) of one K or V cache tensor of one layer."""

    addr: int
    itemsize: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    @classmethod
    def of(cls, t: Any) -> TensorGeom:
        return cls(int(t.data_ptr()), int(t.element_size()), tuple(t.shape), tuple(t.stride()))

    def extent(self) -> tuple[int, int]:
        """[lowest, highest+1) byte address any element can occupy."""
        lo = hi = 0
        for n, s in zip(self.shape, self.strides, strict=True):
            if n > 1:
                if s >= 0:
                    hi += (n - 1) * s
                else:
                    lo += (n - 1) * s
        return self.addr + lo * self.itemsize, self.addr + (hi + 1) * self.itemsize

    def block_span(self) -> int:
        """Bytes one block's elements spread over (must not exceed the block stride)."""
        return (sum((n - 1) * abs(s) for n, s in zip(self.shape[1:], self.strides[1:],
                                                     strict=True)) + 1) * self.itemsize


@dataclass(frozen=True)
class StaticPlan:
    """The per-cache part of every transfer, computed once per copier.

    Run r of block b lives at `eng_off[r] + b * eng_stride[r]` in the engine cache and at
    `slot + part_off[r]` in the pool; every run is `run_bytes` long and contiguous on both sides.
    """

    run_bytes: int
    eng_off: np.ndarray       # (R,) int64 absolute byte address of run r of block 0
    eng_stride: np.ndarray    # (R,) int64 bytes between consecutive blocks
    part_off: np.ndarray      # (R,) int64 byte offset of run r inside a canonical slot
    num_blocks: int


@dataclass(frozen=True)
class RunPlan:
    """Equal-size contiguous runs: run i is `run_bytes` at `engine[i]` ↔ `pool[i]`."""

    engine: np.ndarray       # int64 absolute byte addresses in the engine cache
    pool: np.ndarray         # int64 absolute byte addresses in the pool
    run_bytes: int

    @property
    def nbytes(self) -> int:
        return int(self.engine.size) * self.run_bytes


def _dense_suffix_elems(g: TensorGeom) -> int:
    """Elements of the longest row-major dense suffix of one block's [T, H, D]."""
    run, expected = 1, 1
    for n, s in zip(reversed(g.shape[1:]), reversed(g.strides[1:]), strict=True):
        if n != 1 and s != expected:
            break
        run *= n
        expected *= n
    return run


def static_plan(geoms: Sequence[TensorGeom], layout: KVLayout) -> StaticPlan:
    """Runs of one block: the largest pieces contiguous in both the engine tensor and the
    canonical slot, the same size for every tensor, so one launch moves a whole batch.

    `geoms` lists K and V in canonical order (layer 0 K, layer 0 V, layer 1 K, ...).
    """
    T, H, D = layout.block_tokens, layout.num_kv_heads, layout.head_dim
    if len(geoms) != 2 * layout.num_layers:
        raise InvalidArgument(f"the cache has {len(geoms)} K/V tensors; the layout needs "
                              f"{2 * layout.num_layers} ({layout.num_layers} layers x K,V)")
    nb = geoms[0].shape[0] if geoms and geoms[0].shape else 0
    for c, g in enumerate(geoms):
        if len(g.shape) != 4 or tuple(g.shape[1:]) != (T, H, D):
            raise InvalidArgument(f"cache tensor {c} has shape {g.shape}; expected "
                                  f"[num_blocks, {T}, {H}, {D}]")
        if g.itemsize != layout.itemsize:
            raise InvalidArgument(f"cache tensor {c} has {g.itemsize}-byte elements; the "
                                  f"namespace dtype {layout.dtype} has {layout.itemsize}")
        if g.shape[0] != nb:
            raise InvalidArgument("all cache tensors must have the same number of blocks")
        if nb > 1 and abs(g.strides[0]) * g.itemsize < g.block_span():
            raise InvalidArgument(f"cache tensor {c}: blocks overlap (block stride "
                                  f"{g.strides[0]} elements)")
    e = layout.itemsize
    chunk = T * H * D                      # elements of one (layer, K|V) part of a block
    run = 0
    for g in geoms:
        run = int(np.gcd(run, _dense_suffix_elems(g)))
    q = chunk // run                       # runs per (layer, K|V) part
    if len(geoms) * q > MAX_RUNS_PER_BLOCK:
        raise InvalidArgument(f"the cache layout is contiguous only in pieces of {run * e} "
                              f"bytes ({len(geoms) * q} per block); keep head_dim contiguous "
                              "(stride 1)")
    starts = np.arange(q, dtype=np.int64) * run          # canonical element offsets in a part
    t_i, h_i, d_i = np.unravel_index(starts, (T, H, D))
    within = np.stack([t_i * g.strides[1] + h_i * g.strides[2] + d_i * g.strides[3]
                       for g in geoms]).astype(np.int64)                     # (2L, q)
    addr = np.array([g.addr for g in geoms], dtype=np.int64)[:, None]
    eng_off = (addr + within * e).reshape(-1)
    eng_stride = np.repeat(np.array([g.strides[0] * e for g in geoms], dtype=np.int64), q)
    part_off = (np.arange(len(geoms), dtype=np.int64)[:, None] * chunk * e
                + (starts * e)[None, :]).reshape(-1)
    return StaticPlan(run * e, eng_off, eng_stride, part_off, nb)


def _as_index_array(name: str, values: Any, bound: int | None = None) -> np.ndarray:
    arr = np.asarray(values.cpu() if hasattr(values, "cpu") else values)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise InvalidArgument(f"{name} must be a 1-D sequence of integers")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and arr.min() < 0:
        raise InvalidArgument(f"{name} must not be negative")
    if bound is not None and arr.size and arr.max() >= bound:
        raise InvalidArgument(f"{name} holds {int(arr.max())}, outside [0, {bound})")
    return arr


def check_batch(sp: StaticPlan, layout: KVLayout, block_ids: Any, slot_offsets: Any,
                pool_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Validate a batch against the cache and pool; O(n), never O(runs)."""
    blocks = _as_index_array("block_ids", block_ids, sp.num_blocks)
    slots = _as_index_array("slot_offsets", slot_offsets)
    if blocks.size != slots.size:
        raise InvalidArgument(f"{blocks.size} block ids but {slots.size} slot offsets")
    if slots.size and int(slots.max()) + layout.block_bytes > pool_size:
        raise InvalidArgument(f"slot offset {int(slots.max())} + block of {layout.block_bytes} "
                              f"bytes runs past the {pool_size}-byte pool")
    return blocks, slots


def check_distinct(blocks: np.ndarray, slots: np.ndarray, block_bytes: int,
                   to_pool: bool) -> None:
    """Two copies writing the same destination would race; refuse the batch."""
    if to_pool:
        s = np.sort(slots)
        if s.size > 1 and (np.diff(s) < block_bytes).any():
            raise InvalidArgument("pool slots overlap: a destination appears twice in one "
                                  "transfer")
    elif np.unique(blocks).size != blocks.size:
        raise InvalidArgument("engine blocks: a destination appears twice in one transfer")


def plan_block_runs(geoms: Sequence[TensorGeom], layout: KVLayout, block_ids: Any,
                    slot_offsets: Any, pool_addr: int, pool_size: int) -> RunPlan:
    """Absolute addresses of every run of a batch (host-side; the copier does this on device)."""
    sp = static_plan(geoms, layout)
    blocks, slots = check_batch(sp, layout, block_ids, slot_offsets, pool_size)
    engine = sp.eng_off[None, :] + blocks[:, None] * sp.eng_stride[None, :]
    pool = pool_addr + slots[:, None] + sp.part_off[None, :]
    return RunPlan(engine.reshape(-1), pool.reshape(-1), sp.run_bytes)


def coalesce_runs(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge runs that continue each other on both sides (fewer, larger copies)."""
    if src.size == 0:
        return src, dst, nbytes
    order = np.argsort(src, kind="stable")
    s, d, n = src[order], dst[order], nbytes[order]
    joins = (s[1:] == s[:-1] + n[:-1]) & (d[1:] == d[:-1] + n[:-1])
    head = np.concatenate(([True], ~joins))
    group = np.cumsum(head) - 1
    sizes = np.bincount(group, weights=n).astype(np.int64)
    return s[head], d[head], sizes


# ---------------------------------------------------------------------------------------------
# executing plans
# ---------------------------------------------------------------------------------------------
_WIDE = {16: "complex128", 8: "int64", 4: "int32", 2: "int16", 1: "uint8"}
_TRITON_WIDE = {8: "int64", 4: "int32", 2: "int16", 1: "int8"}


def copy_width(*values: Any) -> int:
    """Largest element width (≤16 bytes) dividing every address and size: the widest view."""
    acc = 16
    for v in values:
        if isinstance(v, np.ndarray):
            if v.size:
                acc |= int(np.bitwise_or.reduce(v.astype(np.int64)))
        else:
            acc |= int(v)
    return min(16, acc & -acc)


def _span_tensor(base: int, end: int, device: int | None, owner: object) -> torch.Tensor:
    """One 1-D uint8 tensor from `base` to `end` covering the cache and the pool (and the gaps
    between them, which are never touched), so one index op or kernel reaches both."""
    if device is None:
        return host_tensor(base, end - base, owner)
    return device_tensor(base, end - base, device, owner)


_kernel: Any = None


def _triton_kernel() -> Any:
    """Compile-on-first-use batched block copy; None when Triton is not installed."""
    global _kernel
    if _kernel is not None:
        return _kernel or None
    try:
        import triton as _triton
        import triton.language as _tl
    except ImportError:
        _kernel = False
        return None
    globals()["triton"] = _triton   # Triton resolves `tl` through the function's globals
    globals()["tl"] = _tl

    @_triton.jit
    def _copy_blocks(base, blocks, slots, eng_off, eng_stride, pool_off, runs, run_elems,
                     TO_POOL: tl.constexpr, W: tl.constexpr, VEC: tl.constexpr,
                     BLOCK: tl.constexpr):
        # program = (block i, run r, part of the run); offsets in bytes, then in W-byte elements
        pid = tl.program_id(0).to(tl.int64)
        parts = tl.cdiv(run_elems, BLOCK)
        part = pid % parts
        t = pid // parts
        r = t % runs
        i = t // runs
        b = tl.load(blocks + i)
        s = tl.load(slots + i)
        e = (tl.load(eng_off + r) + b * tl.load(eng_stride + r)) // W
        p = (tl.load(pool_off + r) + s) // W
        if TO_POOL:
            src = e
            dst = p
        else:
            src = p
            dst = e
        src = tl.multiple_of(src, VEC)   # VEC: run starts are VEC-element aligned
        dst = tl.multiple_of(dst, VEC)
        idx = part * BLOCK + tl.arange(0, BLOCK)
        mask = idx < run_elems
        v = tl.load(base + (src + idx), mask=mask)
        tl.store(base + (dst + idx), v, mask=mask)

    _kernel = _copy_blocks
    return _kernel


# ---------------------------------------------------------------------------------------------
# transfers
# ---------------------------------------------------------------------------------------------
class Transfer:
    """An enqueued copy. `event` is None for CPU copies (already complete)."""

    def __init__(self, event: Any = None, keepalive: object = None, method: str = "",
                 nbytes: int = 0) -> None:
        self.event = event
        self.method = method
        self.nbytes = nbytes
        self._keep = keepalive   # index tensors, views: alive until the copy is done

    def done(self) -> bool:
        if self.event is None or self.event.query():
            self._keep = None
            return True
        return False

    def wait(self, timeout_s: float | None = 30.0) -> None:
        """Block the host until done; DeadlineExceeded after `timeout_s` (every wait has one)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        delay = 20e-6
        while not self.done():
            if deadline is not None and time.monotonic() > deadline:
                raise DeadlineExceeded(f"GPU transfer of {self.nbytes} bytes not done after "
                                       f"{timeout_s}s")
            time.sleep(delay)
            delay = min(delay * 2, 2e-3)

    def wait_stream(self, stream: Any) -> None:
        """Make `stream` (e.g. the engine's compute stream) wait for this copy, GPU-side."""
        if self.event is not None:
            stream.wait_event(self.event)


# ---------------------------------------------------------------------------------------------
# the engine-facing copier
# ---------------------------------------------------------------------------------------------
def _torch_dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


class PagedKVCache:
    """The engine's paged cache: per layer a K and a V tensor [num_blocks, tokens, heads, dim].

    Any strides are accepted (views into a bigger tensor are fine); head_dim should be
    contiguous. Constructors cover the common engines.
    """

    def __init__(self, layers: Sequence[tuple[Any, Any]]) -> None:
        if not layers:
            raise InvalidArgument("the cache has no layers")
        self.tensors: list[Any] = []
        for i, kv in enumerate(layers):
            if len(kv) != 2:
                raise InvalidArgument(f"layer {i}: expected a (K, V) pair")
            self.tensors.extend(kv)
        devs = {str(t.device) for t in self.tensors}
        if len(devs) != 1:
            raise InvalidArgument(f"cache tensors live on several devices: {sorted(devs)}")
        self.device = self.tensors[0].device
        self.dtype = _torch_dtype_name(self.tensors[0])

    @classmethod
    def from_layers(cls, layers: Sequence[tuple[Any, Any]]) -> PagedKVCache:
        return cls(layers)

    @classmethod
    def from_vllm(cls, kv_caches: Sequence[Any], kv_dim: int = 0) -> PagedKVCache:
        """vLLM flash-attn caches are [2, num_blocks, ...] per layer (kv_dim=0); FlashInfer's
        are [num_blocks, 2, ...] (kv_dim=1)."""
        if kv_dim not in (0, 1):
            raise InvalidArgument("kv_dim must be 0 ([2, blocks, ...]) or 1 ([blocks, 2, ...])")
        return cls([(t.select(kv_dim, 0), t.select(kv_dim, 1)) for t in kv_caches])

    def geoms(self) -> list[TensorGeom]:
        return [TensorGeom.of(t) for t in self.tensors]

    def check(self, layout: KVLayout) -> None:
        if self.dtype != layout.dtype:
            raise InvalidArgument(f"cache dtype {self.dtype} differs from the namespace dtype "
                                  f"{layout.dtype}")


class PagedCopier:
    """Moves blocks between one engine cache and one pool (device or host region).

    `pool` is a `DevicePool` or any object with `.ptr`, `.size` and `.device` (None for host
    memory, which runs the same torch path on the CPU). The per-cache plan is computed once
    here; a transfer uploads only its block ids and slot offsets and expands them to run
    addresses on the device. Copies run on `stream` (default: a stream owned by this copier),
    after the work already queued on the engine's current stream. `method`: "auto" (Triton
    when installed), "triton" or "torch".
    """

    def __init__(self, pool: Any, cache: PagedKVCache, layout: KVLayout,
                 stream: Any = None, method: str = "auto") -> None:
        import torch

        if method not in ("auto", "triton", "torch"):
            raise InvalidArgument(f"unknown copy method {method!r}")
        cache.check(layout)
        self.pool, self.cache, self.layout, self.method = pool, cache, layout, method
        self.device: int | None = None
        self.stream = None
        if cache.device.type == "cuda":
            torch_ = require_cuda(cache.device.index, "GPU copy")
            self.device = cache.device.index if cache.device.index is not None else \
                torch_.cuda.current_device()
            if pool.device is None:
                raise InvalidArgument("a CUDA cache needs a GPU pool (use the host slab for "
                                      "host memory)")
            self.stream = stream or torch.cuda.Stream(device=self.device)
            self._dev = torch.device("cuda", self.device)
        elif pool.device is not None:
            raise InvalidArgument("a CPU cache cannot copy from a GPU pool")
        else:
            self._dev = torch.device("cpu")
        geoms = cache.geoms()
        self._sp = static_plan(geoms, layout)
        regions = [g.extent() for g in geoms] + [(pool.ptr, pool.ptr + pool.size)]
        self._base = min(lo for lo, _ in regions)
        self._end = max(hi for _, hi in regions)
        sp = self._sp
        self._w = copy_width(sp.eng_off, sp.eng_stride, sp.part_off, sp.run_bytes, pool.ptr,
                             self._base)
        eng_rel = sp.eng_off - self._base
        pool_rel = sp.part_off + (pool.ptr - self._base)
        static = np.stack([eng_rel, sp.eng_stride, pool_rel])       # (3, R) bytes
        self._static = torch.from_numpy(static).to(self._dev)
        if self.stream is not None:
            self._static.record_stream(self.stream)   # used on our stream, made on another
        self._span: Any = None
        self._kernel = None
        if self.device is not None and method in ("auto", "triton"):
            self._kernel = _triton_kernel()
            if self._kernel is None and method == "triton":
                raise Unavailable("Triton is not installed; use method='torch'")

    @property
    def runs_per_block(self) -> int:
        return int(self._sp.eng_off.size)

    def plan(self, block_ids: Any, slot_offsets: Any) -> RunPlan:
        """Host-side expansion of a batch (for inspection and tests; transfers use the device)."""
        blocks, slots = check_batch(self._sp, self.layout, block_ids, slot_offsets,
                                    self.pool.size)
        sp = self._sp
        engine = sp.eng_off[None, :] + blocks[:, None] * sp.eng_stride[None, :]
        pool = self.pool.ptr + slots[:, None] + sp.part_off[None, :]
        return RunPlan(engine.reshape(-1), pool.reshape(-1), sp.run_bytes)

    def load(self, block_ids: Any, slot_offsets: Any, after: Any = None) -> Transfer:
        """Pool slots → engine blocks (after a cache hit). Make compute wait on the result."""
        return self._run(block_ids, slot_offsets, after, to_pool=False)

    def store(self, block_ids: Any, slot_offsets: Any, after: Any = None) -> Transfer:
        """Engine blocks → pool slots (before Commit). Wait on the result before Commit."""
        return self._run(block_ids, slot_offsets, after, to_pool=True)

    # -- internals -------------------------------------------------------------------------------
    def _span_view(self) -> torch.Tensor:
        if self._span is None:
            self._span = _span_tensor(self._base, self._end, self.device, self.pool)
        return self._span

    def _run(self, block_ids: Any, slot_offsets: Any, after: Any, to_pool: bool) -> Transfer:
        import torch

        if getattr(self.pool, "closed", False):
            raise InvalidArgument("the GPU pool mapping is closed (daemon restarted? re-open it)")
        blocks, slots = check_batch(self._sp, self.layout, block_ids, slot_offsets,
                                    self.pool.size)
        check_distinct(blocks, slots, self.layout.block_bytes, to_pool)
        nbytes = int(blocks.size) * self.layout.block_bytes
        if blocks.size == 0:
            return Transfer(None, method="none")
        w = copy_width(self._w, slots)
        ids = torch.from_numpy(np.stack([blocks, slots]))
        if self.device is None:
            self._execute_torch(ids, w, to_pool)
            return Transfer(None, method="torch", nbytes=nbytes)
        s = self.stream
        with torch.cuda.device(self.device):
            s.wait_stream(torch.cuda.current_stream(self.device))   # engine's writes first
            if isinstance(after, Transfer):
                after.wait_stream(s)
            elif after is not None:          # a torch.cuda.Event
                s.wait_event(after)
            with torch.cuda.stream(s):
                # pinned staging: a pageable upload would block the host on the stream
                ids_d = ids.pin_memory().to(self._dev, non_blocking=True)
                if self._kernel is not None:
                    method = self._execute_triton(ids_d, w, to_pool)
                else:
                    method = self._execute_torch(ids_d, w, to_pool)
                ev = torch.cuda.Event()
                ev.record(s)
        for t in self.cache.tensors:   # the caching allocator must not reuse them mid-copy
            t.record_stream(s)
        return Transfer(ev, keepalive=(self.pool, ids_d), method=method, nbytes=nbytes)

    def _execute_triton(self, ids_d: torch.Tensor, w: int, to_pool: bool) -> str:
        import torch

        tw = min(w, 8)
        span = self._span_view().view(getattr(torch, _TRITON_WIDE[tw])) if tw > 1 else \
            self._span_view().view(torch.int8)
        run = self._sp.run_bytes // tw
        block = 1024 if run >= 1024 else max(16, 1 << (run - 1).bit_length())
        n, runs = ids_d.shape[1], self.runs_per_block
        grid = (n * runs * ((run + block - 1) // block),)
        st = self._static
        self._kernel[grid](span, ids_d[0], ids_d[1], st[0], st[1], st[2], runs, run,
                           TO_POOL=to_pool, W=tw, VEC=2 if w >= 16 else 1, BLOCK=block,
                           num_warps=4)
        return "triton"

    def _execute_torch(self, ids: torch.Tensor, w: int, to_pool: bool) -> str:
        """Fallback: index_select into a bounded temporary, then index_copy_, over overlapping
        rows of one wide view (row k = run_bytes starting at element k)."""
        import torch

        span = self._span_view()
        n_el = span.numel() // w
        wide = span[:n_el * w].view(getattr(torch, _WIDE[w]))
        run = self._sp.run_bytes // w
        rows = wide.as_strided((n_el - run + 1, run), (1, 1))
        st = self._static
        eng = ((st[0][None, :] + ids[0][:, None] * st[1][None, :]) // w).reshape(-1)
        pool = ((st[2][None, :] + ids[1][:, None]) // w).reshape(-1)
        src, dst = (eng, pool) if to_pool else (pool, eng)
        step = max(1, TORCH_STAGE_BYTES // self._sp.run_bytes)
        for i in range(0, src.numel(), step):   # bounded: one step per TORCH_STAGE_BYTES moved
            tmp = rows.index_select(0, src[i:i + step])
            rows.index_copy_(0, dst[i:i + step], tmp)
        return "torch"
