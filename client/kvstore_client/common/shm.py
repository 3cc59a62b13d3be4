"""Map the daemon's shared-memory slab into a client process, zero copy.

Why not `multiprocessing.shared_memory.SharedMemory(name)`: in Python 3.11 attaching by name
registers the segment with the resource tracker, which unlinks it when the client exits —
deleting the daemon's slab under every other client (docs/performance.md). On Linux we open
`/dev/shm/<name>` and mmap it ourselves, so the tracker never hears of it. Elsewhere we fall
back to SharedMemory and unregister it at once.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

from .errors import InvalidArgument, NotFound

_SHM_DIR = Path("/dev/shm")


class SharedSlab:
    """A mapped slab: `.buf` (memoryview) and `.array` (1-D uint8 numpy view), both zero copy."""

    def __init__(self, name: str, size: int, mm: mmap.mmap, keep: object = None) -> None:
        self.name = name
        self.size = size
        self._mmap = mm
        self._keep = keep          # fallback path: the SharedMemory object owning the mapping
        self.buf: memoryview = memoryview(mm)[:size]
        self.array: np.ndarray = np.frombuffer(self.buf, dtype=np.uint8)

    def close(self) -> None:
        """Unmap. Never unlinks: the segment belongs to the daemon."""
        if self._mmap is None:
            return
        self.array = None  # type: ignore[assignment]
        self.buf.release()
        try:
            if self._keep is not None:
                self._keep.close()  # type: ignore[attr-defined]
            else:
                self._mmap.close()
        except BufferError:
            # The caller still holds numpy views; the mapping goes when they do.
            pass
        self._mmap = None  # type: ignore[assignment]

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def __enter__(self) -> SharedSlab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not name.strip("/") or "/" in name.strip("/") \
            or "\0" in name:
        raise InvalidArgument(f"shared-memory name must be a plain name like 'kvstore-1a2b', "
                              f"got {name!r}")
    return name.strip("/")


def attach(name: str, size: int) -> SharedSlab:
    """Map the existing segment `name`, checking it holds at least `size` bytes."""
    name = _check_name(name)
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise InvalidArgument(f"shared-memory size must be a positive integer, got {size!r}")
    if _SHM_DIR.is_dir():
        return _attach_dev_shm(name, size)
    return _attach_fallback(name, size)


def attach_fd(fd: int, size: int, name: str = "memfd") -> SharedSlab:
    """Map a pool the daemon handed over as a file descriptor (common/handoff.py); the fd is
    closed once mapped (the mapping keeps the memory alive)."""
    try:
        actual = os.fstat(fd).st_size
        if actual < size:
            raise InvalidArgument(f"the pool fd holds {actual} bytes, fewer than the {size} "
                                  "the daemon announced")
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return SharedSlab(name, size, mm)


def _attach_dev_shm(name: str, size: int) -> SharedSlab:
    try:
        fd = os.open(_SHM_DIR / name, os.O_RDWR)
    except FileNotFoundError:
        raise NotFound(f"shared-memory segment {name!r} does not exist (is the daemon running, "
                       f"and on this host?)") from None
    try:
        actual = os.fstat(fd).st_size
        if actual < size:
            raise InvalidArgument(f"shared-memory segment {name!r} holds {actual} bytes, "
                                  f"fewer than the {size} expected (stale segment or wrong name?)")
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)   # the mapping keeps the segment alive
    return SharedSlab(name, size, mm)


def _attach_fallback(name: str, size: int) -> SharedSlab:
    from multiprocessing import resource_tracker, shared_memory

    try:
        shm = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        raise NotFound(f"shared-memory segment {name!r} does not exist") from None
    try:  # 3.13+ has track=False; before, undo the registration the constructor made
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:  # platforms without a tracker
        pass
    if shm.size < size:
        shm.close()
        raise InvalidArgument(f"shared-memory segment {name!r} holds {shm.size} bytes, fewer "
                              f"than the {size} expected")
    return SharedSlab(name, size, shm._mmap, keep=shm)  # type: ignore[attr-defined]
