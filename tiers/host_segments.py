"""Host tier with one private segment per tenant: the shared slab plus a memfd per tenant.

Why memfds: a tenant's clients must be able to map their own blocks zero-copy, and nothing
else. A POSIX shm segment has a name any process of the daemon's uid can open; a memfd has no
name at all, and reaches a client only as a file descriptor the daemon hands over after the
handshake (kvstore/handoff.py). Processes of another uid can open neither the daemon's fds
(/proc/<pid>/fd needs ptrace rights) nor another client's.

Why one offset space: the store addresses host copies by offset everywhere. Segment i covers
offsets [base_i, base_i + size_i), segment 0 being the shared slab at base 0, so the store keeps
one number per block; only allocation needs to say which segment, and the server rebases a
tenant's slot offsets to its own segment before they leave the daemon.
"""

from __future__ import annotations

import bisect
import mmap
import os
from typing import TYPE_CHECKING

from kvstore_client.common.errors import InvalidArgument
from kvstore_client.common.lazy import lazy_module

from .host import PAGE, HostTier, _prefault
from .slab import ExtentAllocator

if TYPE_CHECKING:
    import numpy as np
else:   # loaded when a tenant segment is made (not for a daemon without tenant pools)
    np = lazy_module("numpy", globals(), "np")


class _Segment:
    def __init__(self, name: str, size: int, base: int) -> None:
        self.name, self.size, self.base = name, size, base
        self.fd = os.memfd_create(f"kvstore-{name}", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self.mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.array = np.frombuffer(self.mm, dtype=np.uint8, count=size)
        _prefault(self.mm, size)
        self.alloc = ExtentAllocator(size, PAGE)


class SegmentedHost:
    """Drop-in for HostTier (view/alloc/free/used_bytes/...) over the shared slab plus one
    memfd segment per tenant with a host quota."""

    name = "host"

    def __init__(self, shared: HostTier, pools: dict[str, int]) -> None:
        self.shared = shared
        self.shm_name = shared.shm_name
        self._segments: list[_Segment] = []
        self._by_tenant: dict[str, int] = {}
        base = shared.capacity
        for tenant, size in sorted(pools.items()):
            size -= size % PAGE
            if size < PAGE:
                raise InvalidArgument(f"tenants.{tenant}.host_quota must be at least {PAGE} "
                                      "bytes")
            self._segments.append(_Segment(tenant, size, base))
            self._by_tenant[tenant] = len(self._segments)
            base += size
        self._bases = [0] + [s.base for s in self._segments]
        self.capacity = base

    # -- segments -----------------------------------------------------------------------------
    def segment_of_tenant(self, tenant: str | None) -> int:
        """The segment a tenant's blocks live in (0: the shared slab)."""
        return self._by_tenant.get(tenant, 0) if tenant else 0

    def segment_fd(self, seg: int) -> tuple[int, int]:
        s = self._segments[seg - 1]
        return s.fd, s.size

    @property
    def segment_count(self) -> int:
        """Segments, the shared slab included."""
        return len(self._bases)

    def base(self, seg: int) -> int:
        return self._bases[seg]

    def capacity_of(self, seg: int) -> int:
        return self.shared.capacity if seg == 0 else self._segments[seg - 1].size

    def used_of(self, seg: int) -> int:
        return self.shared.used_bytes if seg == 0 else self._segments[seg - 1].alloc.used_bytes

    def _locate(self, offset: int) -> tuple[int, int]:
        seg = bisect.bisect_right(self._bases, offset) - 1
        return seg, offset - self._bases[seg]

    def array_at(self, offset: int) -> tuple[np.ndarray, int]:
        """(the whole array of the segment holding `offset`, that segment's base offset): for
        device copies, which address one host array at a time."""
        seg, _ = self._locate(offset)
        arr = self.shared.array if seg == 0 else self._segments[seg - 1].array
        return arr, self._bases[seg]

    # -- HostTier's interface -------------------------------------------------------------------
    def view(self, offset: int, nbytes: int) -> np.ndarray:
        seg, local = self._locate(offset)
        if seg == 0:
            return self.shared.view(local, nbytes)
        s = self._segments[seg - 1]
        if local + nbytes > s.size or nbytes < 0:
            raise InvalidArgument(f"host range [{offset}, {offset + nbytes}) crosses the end of "
                                  f"tenant {s.name}'s segment")
        return s.array[local:local + nbytes]

    @property
    def array(self) -> np.ndarray:
        return self.shared.array

    @property
    def used_bytes(self) -> int:
        return self.shared.used_bytes + sum(s.alloc.used_bytes for s in self._segments)

    def alloc(self, nbytes: int, seg: int = 0) -> int:
        if seg == 0:
            return self.shared.alloc(nbytes)
        s = self._segments[seg - 1]
        return s.base + s.alloc.alloc(nbytes)

    def alloc_many(self, nbytes: int, n: int, seg: int = 0) -> list[int]:
        if seg == 0:
            return self.shared.alloc_many(nbytes, n)
        s = self._segments[seg - 1]
        return [s.base + off for off in s.alloc.alloc_many(nbytes, n)]

    def free(self, offset: int) -> None:
        seg, local = self._locate(offset)
        if seg == 0:
            self.shared.free(local)
        else:
            self._segments[seg - 1].alloc.free(local)

    def size_of(self, offset: int) -> int:
        seg, local = self._locate(offset)
        return (self.shared.size_of(local) if seg == 0
                else self._segments[seg - 1].alloc.size_of(local))

    def describe(self) -> dict:
        return self.shared.describe()

    @property
    def closed(self) -> bool:
        return self.shared.closed

    def close(self) -> None:
        for s in self._segments:
            s.array = None  # type: ignore[assignment]
            try:
                s.mm.close()
            except BufferError:
                pass        # views still held; the mapping goes with them
            os.close(s.fd)
        self._segments = []
        self.shared.close()
