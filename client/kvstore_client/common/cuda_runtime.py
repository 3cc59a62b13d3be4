"""CUDA runtime bindings: the only SDK module that talks to CUDA itself.

Why it exists: torch has no public API for cudaMalloc outside its caching allocator, IPC
handles or cudaHostRegister, so those raw calls go through CuPy when it is installed and
otherwise through ctypes on the libcudart that torch's CUDA wheels ship. The daemon
(`tiers/gpu.py`) reuses this wrapper, since `kvstore_client` must not import `tiers`.

Kept as small as it can be: availability checks, the runtime wrapper, and viewing raw device
memory as a torch tensor. Every decision (which pool, which copies, which plan) lives in
modules the CPU device exercises too (`pools`, `copy_plan`, `paged_copy`, `transfer`).
Everything imports lazily: importing this module needs neither torch's CUDA nor CuPy.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading
from typing import TYPE_CHECKING, Any

from .errors import KVStoreError, Unavailable

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

IPC_HANDLE_BYTES = 64                  # sizeof(cudaIpcMemHandle_t)
IPC_LAZY_ENABLE_PEER_ACCESS = 1        # cudaIpcMemLazyEnablePeerAccess
HOST_REGISTER_PORTABLE = 1             # cudaHostRegisterPortable: pinned for every context
MEMCPY_DEFAULT = 4                     # cudaMemcpyDefault: direction from the pointers
_ERR_MEMORY_ALLOCATION = 2             # cudaErrorMemoryAllocation
_ERR_HOST_ALREADY_REGISTERED = 712     # cudaErrorHostMemoryAlreadyRegistered
_ERR_HOST_NOT_REGISTERED = 713         # cudaErrorHostMemoryNotRegistered




class CudaError(KVStoreError):
    """A CUDA runtime call failed; `status` is the cudaError_t value."""

    def __init__(self, message: str, status: int = -1) -> None:
        super().__init__(message)
        self.status = status


# ---------------------------------------------------------------------------------------------
# availability
# ---------------------------------------------------------------------------------------------
# Device nodes an NVIDIA driver creates (Linux, containers with GPUs, WSL's /dev/dxg).
_DRIVER_NODES = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/dxg")


def _no_nvidia_driver() -> bool:
    """True when this machine has no NVIDIA driver at all: no need to import torch (seconds)
    to learn that CUDA is unavailable, so a CPU-only daemon starts without it."""
    return os.name == "posix" and not any(os.path.exists(p) for p in _DRIVER_NODES)


def cuda_available() -> bool:
    """True when torch is installed with CUDA and sees at least one device. Never raises."""
    if _no_nvidia_driver() and "torch" not in sys.modules:
        return False
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

    def use_device(self, device: int) -> None:
        """Make `device` current for this thread's raw calls (before `memcpy_async`)."""
        raise NotImplementedError

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """cudaMemcpyAsync with the direction taken from the pointers (unified addressing)
        on a raw stream handle of the current device: a microsecond where torch's copy_ of
        two slices costs ten."""
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

    def use_device(self, device: int) -> None:
        self._call("cudaSetDevice", device, lambda: None)

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        try:
            self._rt.memcpyAsync(dst, src, nbytes, MEMCPY_DEFAULT, stream)
        except self._err as e:
            raise CudaError(f"cudaMemcpyAsync: {e}", int(getattr(e, "status", -1))) from None


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
            "cudaMemcpyAsync": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                ctypes.c_void_p],
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

    def use_device(self, device: int) -> None:
        self._set(device)

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        status = self._lib.cudaMemcpyAsync(dst, src, nbytes, MEMCPY_DEFAULT, stream)
        if status:
            self._check("cudaMemcpyAsync", status)


_libcuda: Any = None
_CUDA_ERROR_NOT_READY = 600


def _driver() -> Any:
    """libcuda with the few calls the copier's per-call path makes, or False without it.

    Why the driver API: it is one library per process, so handles made by torch's runtime
    are valid here whatever runtime copy CuPy or ctypes loaded, and each call is one ctypes
    call, where the torch equivalents build Python stream and event objects."""
    global _libcuda
    if _libcuda is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            lib.cuGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            lib.cuStreamQuery.argtypes = [ctypes.c_void_p]
            lib.cuGraphLaunch.restype = lib.cuStreamQuery.restype = ctypes.c_int
            _libcuda = lib
        except (OSError, AttributeError):
            _libcuda = False
    return _libcuda


def graph_launch(graph_exec: int, stream: int) -> bool:
    """cuGraphLaunch of an instantiated graph (torch's `raw_cuda_graph_exec()`) on a raw
    stream handle; False (nothing launched) where the driver library or the call fails."""
    lib = _driver()
    return bool(lib) and lib.cuGraphLaunch(graph_exec, stream) == 0


def stream_idle(stream: int) -> bool | None:
    """Whether a raw stream has nothing queued (cuStreamQuery); None where that cannot be
    told (no driver library, an error), so the caller orders after the stream anyway."""
    lib = _driver()
    if not lib:
        return None
    status = lib.cuStreamQuery(stream)
    return True if status == 0 else False if status == _CUDA_ERROR_NOT_READY else None


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

