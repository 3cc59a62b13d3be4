"""Pinned host memory: cudaHostRegister of an existing buffer (e.g. the shared-memory slab).

Why a module of its own: the daemon pins its host slab and clients pin their mapping of it, and
both must do so unconditionally: without CUDA (the CPU device, CPU-only machines) pinning is a
no-op handle with `pinned == False`, so no caller branches on the platform.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

from .cuda_runtime import (
    _ERR_HOST_ALREADY_REGISTERED,
    _ERR_HOST_NOT_REGISTERED,
    HOST_REGISTER_PORTABLE,
    CudaError,
    cuda_available,
    get_runtime,
)
from .errors import InvalidArgument, Unavailable


def _address_of(buf: Any) -> tuple[int, int]:
    """Address and length of `buf`. A writable non-numpy buffer (the daemon's shm slab) is
    measured with ctypes, so pinning it does not import numpy before the daemon is ready."""
    np = sys.modules.get("numpy")           # an ndarray exists only if numpy is loaded
    if np is not None and isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise InvalidArgument("can only pin a contiguous buffer")
        return int(buf.ctypes.data), int(buf.nbytes)
    view = memoryview(buf)
    if not view.readonly and view.c_contiguous:
        with view.cast("B") as flat:
            if not flat.nbytes:
                return 0, 0
            probe = ctypes.c_char.from_buffer(flat)
            addr = ctypes.addressof(probe)
            del probe                       # releases its export of the buffer
            return addr, flat.nbytes
    import numpy as np

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

