"""The CPU device: the device interface with a shared-memory slab standing in for device memory.

Why it exists: this project's machines have no GPU, and the GPU tier's logic (placement,
leases, eviction with demotion, promotion, verification, clients gathering from an opened
pool) must run somewhere to be tested. This implementation keeps the device's shape: its
memory is a slab of its own, separate from the host tier's, that a client process opens by
handle (the segment name) and gathers from with the same `PagedCopier`; its copies run on a
worker thread of their own and complete through a `Transfer`, like copies on a CUDA stream.
It is what the daemon uses when the operator enables the gpu tier on a machine without CUDA.
"""

from __future__ import annotations

import concurrent.futures as cf
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import xxhash
from kvstore_client.common.errors import InvalidArgument
from kvstore_client.common.layout import KVLayout
from kvstore_client.common.pools import CPU_MEMFD_KIND, CPU_POOL_KIND
from kvstore_client.common.transfer import FutureEvent, Transfer

from .device import PAGE, DeviceTier, Item, check_host
from .host import _create_fresh, _prefault
from .slab import ExtentAllocator


class CpuDeviceTier(DeviceTier):
    """A `capacity`-byte shared-memory slab for device `device`, cut into aligned slots."""

    kind = "cpu"

    def __init__(self, capacity: int, device: int = 0, *, slab_name: str = "",
                 memfd: bool = False) -> None:
        """memfd: the slab is a memfd with no name (a tenant's own segment, handed to its
        clients as a file descriptor over the handshake socket) instead of a named segment."""
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < PAGE:
            raise InvalidArgument(f"gpu.capacity must be at least {PAGE} bytes, got {capacity!r}")
        capacity -= capacity % PAGE
        self.capacity = capacity
        self.device = device
        self.slab_name = (slab_name or f"kvstore-cpudev-{os.getpid()}-{device}").lstrip("/")
        self.fd: int | None = None
        if memfd:
            self.fd = os.memfd_create(f"kvstore-{self.slab_name}", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, capacity)
            self._shm: Any = _Memfd(self.fd, capacity)
        else:
            self._shm = _create_fresh(self.slab_name, capacity)
        self._array: np.ndarray | None = np.frombuffer(self._shm.buf, dtype=np.uint8,
                                                        count=capacity)
        _prefault(self._shm.buf, capacity)
        self._alloc = ExtentAllocator(capacity, PAGE)
        self._worker: cf.ThreadPoolExecutor | None = cf.ThreadPoolExecutor(
            1, thread_name_prefix=f"kvstore-cpudev{device}")
        self._lock = threading.Lock()

    # -- access --------------------------------------------------------------------------------
    @property
    def array(self) -> np.ndarray:
        if self._array is None:
            raise InvalidArgument("the cpu device tier is closed")
        return self._array

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        self._check_range(offset, nbytes)
        return self.array[offset:offset + nbytes]

    def describe(self) -> dict:
        self.array  # noqa: B018 - raises when closed
        if self.fd is not None:     # no name: the fd reaches its tenant over the handshake
            return {"kind": CPU_MEMFD_KIND, "device": self.device, "handle": b"",
                    "name": "", "size": self.capacity, "pid": os.getpid()}
        return {"kind": CPU_POOL_KIND, "device": self.device, "handle": b"",
                "name": self.slab_name, "size": self.capacity, "pid": os.getpid()}

    def checksums(self, items: Sequence[tuple[int, int]], timeout_s: float = 30.0) -> list[int]:
        # The slab is host memory: hash it in place, no staging copy.
        return [xxhash.xxh3_64_intdigest(self.view(o, n)) for o, n in items]

    # -- copies --------------------------------------------------------------------------------
    # The checked copies run in the caller's thread: this device's "copy engine" is the CPU the
    # caller already runs on, and handing a copy the caller waits for to another thread only
    # adds a GIL handoff. Each block is hashed right after its copy, while it is in cache.
    def copy_to_host_checked(self, items: Sequence[Item], host: np.ndarray,
                             timeout_s: float = 30.0) -> list[int]:
        check_host(host, to_host=True)
        self._plan(items, host.size, "host buffer")
        dev = self.array
        out = []
        for g, h, n in items:
            np.copyto(host[h:h + n], dev[g:g + n])
            out.append(xxhash.xxh3_64_intdigest(host[h:h + n]))
        return out

    def copy_from_host_checked(self, items: Sequence[Item], host: np.ndarray,
                               timeout_s: float = 30.0) -> list[int]:
        check_host(host, to_host=False)
        self._plan(items, host.size, "host buffer")
        dev = self.array
        out = []
        for g, h, n in items:
            np.copyto(dev[g:g + n], host[h:h + n])
            out.append(xxhash.xxh3_64_intdigest(dev[g:g + n]))
        return out

    def copy_to_host_batch(self, items: Sequence[Item], host: np.ndarray,
                           after: Any = None) -> Transfer:
        check_host(host, to_host=True)
        g, h, n = self._plan(items, host.size, "host buffer")
        dev = self.array
        return self._submit(lambda: _runs(dev, g, host, h, n), after, int(n.sum()))

    def copy_from_host_batch(self, items: Sequence[Item], host: np.ndarray,
                             after: Any = None) -> Transfer:
        check_host(host, to_host=False)
        g, h, n = self._plan(items, host.size, "host buffer")
        dev = self.array
        return self._submit(lambda: _runs(host, h, dev, g, n), after, int(n.sum()))

    def gather(self, items: Sequence[Item], dst: DeviceTier | None = None) -> Transfer:
        target = self if dst is None else dst
        if not isinstance(target, CpuDeviceTier):
            raise InvalidArgument("a cpu device can gather only into another cpu device")
        s, d, n = self._plan(items, target.capacity, "destination slab")
        src, out = self.array, target.array
        return self._submit(lambda: _runs(src, s, out, d, n), None, int(n.sum()))

    def encode_batch(self, items: Sequence[tuple[int, int]], codec: str, layout: KVLayout,
                     after: Any = None) -> cf.Future[list[bytes]]:
        from . import codecs  # torch-heavy for lossy codecs: import on first use

        for off, nb in items:
            self._check_range(off, nb)
            if nb != layout.block_bytes:
                raise InvalidArgument(f"block at device offset {off} is {nb} bytes; the "
                                      f"layout needs {layout.block_bytes}")
        views = [self.view(o, n) for o, n in items]

        def work() -> list[bytes]:
            _wait(after)
            return [bytes(codecs.encode(codec, v, layout)) for v in views]
        return self._executor().submit(work)

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            worker, self._worker = self._worker, None
            if self._shm is None:
                return
        if worker is not None:
            worker.shutdown(wait=True)
        self._array = None
        shm, self._shm = self._shm, None
        try:
            shm.unlink()
        except FileNotFoundError:
            pass
        try:
            shm.close()
        except BufferError:     # views handed out still live: the mapping goes with them
            _OPEN.append(shm)

    @property
    def closed(self) -> bool:
        return self._shm is None

    # -- internals -----------------------------------------------------------------------------
    def _executor(self) -> cf.ThreadPoolExecutor:
        with self._lock:
            if self._worker is None:
                raise InvalidArgument("the cpu device tier is closed")
            return self._worker

    def _submit(self, fn: Callable[[], None], after: Any, nbytes: int) -> Transfer:
        def run() -> None:
            _wait(after)
            fn()
        return Transfer(FutureEvent(self._executor().submit(run)), method="memcpy",
                        nbytes=nbytes)


_OPEN: list[Any] = []


class _Memfd:
    """A memfd mapping with the part of SharedMemory's interface close() uses."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.buf = memoryview(self.mm)

    def unlink(self) -> None:
        os.close(self.fd)           # the memory goes once no client maps it any more

    def close(self) -> None:
        self.buf.release()
        self.mm.close()


def _wait(after: Any) -> None:
    """`after` (a Transfer or a Future) finishes first; every wait has a deadline."""
    if isinstance(after, Transfer):
        after.wait(30.0)
    elif isinstance(after, cf.Future):
        after.result(timeout=30.0)


def _runs(src: np.ndarray, s: np.ndarray, dst: np.ndarray, d: np.ndarray,
          n: np.ndarray) -> None:
    for so, do, nb in zip(s.tolist(), d.tolist(), n.tolist(), strict=True):
        np.copyto(dst[do:do + nb], src[so:so + nb])
