"""Host tier: one preallocated shared-memory slab that engines map once and copy into directly.

Why one slab: clients map it a single time (by name, `kvstore_client.shm.attach`) and then move
blocks with plain memcpy at offsets the daemon hands out — no per-block syscalls or sockets.
The slab is pre-faulted at start so the first copies into it do not pay page faults
(PERF-NOTES: fresh large buffers page-fault), and its base is page-aligned (mmap), so with
4 KiB-aligned extents every block copy is page-aligned.
"""

from __future__ import annotations

import os
import secrets
from multiprocessing import shared_memory

import numpy as np
from kvstore_client.errors import InvalidArgument

from .slab import ExtentAllocator, SlabAllocation

PAGE = 4096
_PREFAULT_CHUNK = 64 << 20


class HostTier(SlabAllocation):
    """A `capacity`-byte POSIX shared-memory segment cut into aligned extents."""

    name = "host"

    def __init__(self, capacity: int, shm_name: str | None = None) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < PAGE:
            raise InvalidArgument(f"host.capacity must be at least {PAGE} bytes, got {capacity!r}")
        capacity -= capacity % PAGE
        if shm_name is None or shm_name == "":
            shm_name = f"kvstore-{secrets.token_hex(6)}"
        shm_name = shm_name.lstrip("/")
        if "/" in shm_name or "\0" in shm_name or len(shm_name) > 200:
            raise InvalidArgument(f"host.shm_name must be a plain name like 'kvstore-main', "
                                  f"got {shm_name!r}")
        self.capacity = capacity
        self.shm_name = shm_name
        self._shm = _create_fresh(shm_name, capacity)
        self._array: np.ndarray | None = np.frombuffer(self._shm.buf, dtype=np.uint8,
                                                        count=capacity)
        _prefault(self._array)
        self._alloc = ExtentAllocator(capacity, PAGE)

    # -- access -------------------------------------------------------------------------------
    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """1-D uint8 numpy view of slab bytes [offset, offset+nbytes), zero copy."""
        arr = self._require_open()
        if offset < 0 or nbytes < 0 or offset + nbytes > self.capacity:
            raise InvalidArgument(f"host slab range [{offset}, {offset + nbytes}) is outside "
                                  f"the {self.capacity}-byte slab")
        return arr[offset:offset + nbytes]

    @property
    def array(self) -> np.ndarray:
        """The whole slab as 1-D uint8 (for batched gathers/scatters)."""
        return self._require_open()

    def describe(self) -> dict:
        """What a client needs to map the slab: `kvstore_client.shm.attach(name, size)`."""
        return {"kind": "shm", "name": self.shm_name, "size": self.capacity}

    # -- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        """Unmap and unlink the segment (clients still mapping it keep their pages)."""
        if self._shm is None:
            return
        self._array = None
        shm, self._shm = self._shm, None
        try:
            shm.unlink()
        except FileNotFoundError:
            pass
        try:
            shm.close()
        except BufferError:
            # numpy views handed out still live; the mapping is freed with them. Keep the
            # object so its __del__ doesn't retry the close and warn mid-run.
            _OPEN_VIEWS.append(shm)

    @property
    def closed(self) -> bool:
        return self._shm is None

    def _require_open(self) -> np.ndarray:
        if self._array is None:
            raise InvalidArgument("host tier is closed")
        return self._array

    def __enter__(self) -> HostTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_OPEN_VIEWS: list[shared_memory.SharedMemory] = []


def _create_fresh(name: str, size: int) -> shared_memory.SharedMemory:
    """Create segment `name`; a leftover of the same name (crashed daemon) is replaced."""
    try:
        return shared_memory.SharedMemory(name=name, create=True, size=size)
    except FileExistsError:
        pass
    _unlink(name)
    return shared_memory.SharedMemory(name=name, create=True, size=size)


def _unlink(name: str) -> None:
    dev = os.path.join("/dev/shm", name)
    if os.path.isdir("/dev/shm"):
        try:
            os.unlink(dev)
        except FileNotFoundError:
            pass
        return
    old = shared_memory.SharedMemory(name=name)   # registers; unlink() unregisters again
    old.close()
    old.unlink()


def _prefault(arr: np.ndarray) -> None:
    """Touch every page now (tmpfs allocates on first write) so block copies never fault."""
    for start in range(0, arr.size, _PREFAULT_CHUNK):
        arr[start:start + _PREFAULT_CHUNK].fill(0)
