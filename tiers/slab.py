"""Extent allocator that cuts one preallocated slab (host shm, GPU) into block slots.

Why this shape: KV blocks of one namespace all have the same size, so the common path is
"free a 2 MiB slot, allocate a 2 MiB slot". Per-size free lists make that O(1) and reuse the
exact extent, so a namespace's blocks never fragment the slab. New sizes are bump-allocated
from the end of the used region. Only when neither works (the slab is full of free extents of
other sizes) do we pay for coalescing adjacent free extents and splitting a larger one.

Every extent is rounded up to `align` (default 4096) so copies in and out of the slab stay
page-aligned (a copy a few bytes off a page runs up to 3.4x slower, docs/performance.md).
Not thread-safe: the owner (store) holds a lock.
"""

from __future__ import annotations

from array import array
from collections import deque
from typing import Any

from kvstore_client.common.errors import InvalidArgument, ResourceExhausted


class ExtentAllocator:
    """Offsets into a `capacity`-byte region; `alloc`/`free` in O(1) on the common path."""

    def __init__(self, capacity: int, align: int = 4096) -> None:
        if align <= 0 or align & (align - 1):
            raise InvalidArgument(f"slab alignment must be a positive power of two, got {align}")
        if capacity < 0:
            raise InvalidArgument(f"slab capacity must not be negative, got {capacity}")
        self.capacity = capacity
        self.align = align
        self._limit = capacity - capacity % align      # usable bytes (whole aligned extents)
        self._top = 0                                  # bump pointer: [top, limit) never used
        self._used: dict[int, int] = {}                # offset -> size of allocated extents
        self._free: dict[int, int] = {}                # offset -> size of free extents
        # size -> free offsets of that size, oldest freed first. A deque, not an ordered dict:
        # popping a dict's first key walks past every slot deleted before it until the dict
        # resizes, which made refilling a churned pool quadratic (90 us, then 282 us per
        # alloc after 200k frees). Offsets only ever leave from the front (exact take, split)
        # or all at once (coalesce), so a deque is O(1) for every operation used.
        self._by_size: dict[int, deque[int]] = {}
        self.used_bytes = 0

    @classmethod
    def from_extents(cls, capacity: int, align: int, extents: list[tuple[int, int]]
                     ) -> ExtentAllocator:
        """An allocator with `extents` ((offset, size), aligned, disjoint) allocated and every
        gap below the highest one free: how a persistent tier (SSD) rebuilds it on open."""
        a = cls(capacity, align)
        top = 0
        for off, size in sorted(extents):
            if off % align or size % align or off < top or off + size > a._limit:
                raise InvalidArgument(f"extent ({off}, {size}) is unaligned, overlaps another "
                                      f"or lies past {a._limit}")
            if off > top:
                a._add_free(top, off - top)
            a._used[off] = size
            a.used_bytes += size
            top = off + size
        a._top = top
        return a

    def state(self) -> dict:
        """Everything the allocator knows, as packed arrays (the SSD tier's index image), so a
        restart rebuilds it with bulk operations instead of a step per extent."""
        free = [(off, size) for size, bucket in self._by_size.items() for off in bucket]
        return {"capacity": self.capacity, "align": self.align, "top": self._top,
                "used_bytes": self.used_bytes,
                "used_off": array("Q", self._used.keys()).tobytes(),
                "used_size": array("Q", self._used.values()).tobytes(),
                "free_off": array("Q", [o for o, _ in free]).tobytes(),
                "free_size": array("Q", [s for _, s in free]).tobytes()}

    @classmethod
    def from_state(cls, state: dict) -> ExtentAllocator:
        """The allocator `state()` described; InvalidArgument if the state is inconsistent."""
        try:
            a = cls(int(state["capacity"]), int(state["align"]))
            arrays = {}
            for name in ("used_off", "used_size", "free_off", "free_size"):
                arrays[name] = array("Q")
                arrays[name].frombytes(state[name])
            top, used = int(state["top"]), int(state["used_bytes"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"allocator state is malformed: {exc}") from None
        used_off, used_size = arrays["used_off"], arrays["used_size"]
        free_off, free_size = arrays["free_off"], arrays["free_size"]
        if (len(used_off) != len(used_size) or len(free_off) != len(free_size)
                or sum(used_size) != used or top > a._limit
                or (used_off and max(used_off) >= top) or (free_off and max(free_off) >= top)):
            raise InvalidArgument("allocator state does not add up")
        del a._used                 # built on first use (__getattr__): off a daemon's start
        a._lazy_used = (used_off, used_size)
        a.used_bytes = used
        for off, size in zip(free_off, free_size, strict=True):
            a._add_free(off, size)
        if len(a._free) != len(free_off):
            raise InvalidArgument("allocator state repeats a free extent")
        a._top = top
        return a

    def __getattr__(self, name: str) -> Any:
        """`_used` of an allocator from_state() made, built when first needed: a dict of one
        entry per allocated extent is the costliest step of a restart from the index image
        (~20 ms for 100k extents), and the first allocation or free comes after SERVING.
        Checked then: an extent listed twice, or both allocated and free, raises (every later
        use too), never hands out overlapping extents."""
        lazy = self.__dict__.get("_lazy_used") if name == "_used" else None
        if lazy is None:
            raise AttributeError(name)
        used = dict(zip(lazy[0], lazy[1], strict=True))
        if len(used) != len(lazy[0]) or not used.keys().isdisjoint(self._free):
            raise InvalidArgument("allocator state repeats an extent")
        self._used = used
        del self._lazy_used
        return used

    def materialize(self) -> None:
        """Build what from_state() left for first use now (a background thread's job)."""
        self._used  # noqa: B018 - builds it (__getattr__)

    def grow(self, capacity: int) -> None:
        """Raise the capacity (a file-backed tier that preallocated more room)."""
        if capacity > self.capacity:
            self.capacity = capacity
            self._limit = capacity - capacity % self.align

    @property
    def top(self) -> int:
        """End of the highest extent ever handed out (the file size a tier needs)."""
        return self._top

    # -- public -------------------------------------------------------------------------------
    def round(self, nbytes: int) -> int:
        """The extent size `alloc(nbytes)` takes (nbytes rounded up to the alignment)."""
        return (nbytes + self.align - 1) & ~(self.align - 1)

    def alloc(self, nbytes: int) -> int:
        """Offset of a fresh `align`-aligned extent of at least `nbytes` bytes."""
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise InvalidArgument(f"allocation size must be a positive integer, got {nbytes!r}")
        used = self._used       # first: a lazily built map is checked before any change
        size = self.round(nbytes)
        off = self._take_exact(size)
        if off is None:
            off = self._bump(size)
        if off is None:
            off = self._split(size)
        if off is None and self._free:
            self.coalesce()
            off = self._take_exact(size)
            if off is None:
                off = self._bump(size)
            if off is None:
                off = self._split(size)
        if off is None:
            raise ResourceExhausted(
                f"slab full: no free extent of {size} bytes ({self.used_bytes} of "
                f"{self.capacity} bytes in use, {len(self._free)} free extents)")
        used[off] = size
        self.used_bytes += size
        return off

    def alloc_many(self, nbytes: int, n: int) -> list[int]:
        """n extents as n alloc() calls would hand them out, all or none (ResourceExhausted).

        Why: a Reserve of a whole batch paid a Python call chain per slot; the extents freed
        by the previous batch sit in one size bucket, taken here in one pass."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise InvalidArgument(f"allocation count must be a non-negative integer, got {n!r}")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise InvalidArgument(f"allocation size must be a positive integer, got {nbytes!r}")
        used = self._used
        size = self.round(nbytes)
        out: list[int] = []
        bucket = self._by_size.get(size)
        if bucket:
            free = self._free
            for _ in range(min(n, len(bucket))):
                off = bucket.popleft()
                del free[off]
                used[off] = size
                out.append(off)
            if not bucket:
                del self._by_size[size]
            self.used_bytes += size * len(out)
        try:
            while len(out) < n:
                out.append(self.alloc(nbytes))
        except BaseException:
            for off in out:
                self.free(off)
            raise
        return out

    def free(self, offset: int) -> None:
        """Return an extent; it is reused first by the next allocation of the same size."""
        size = self._used.pop(offset, None)
        if size is None:
            why = "already freed" if offset in self._free else "not an allocated extent"
            raise InvalidArgument(f"cannot free slab offset {offset}: {why}")
        self.used_bytes -= size
        self._add_free(offset, size)

    def size_of(self, offset: int) -> int:
        """Size of the allocated extent starting at `offset`."""
        try:
            return self._used[offset]
        except KeyError:
            raise InvalidArgument(f"slab offset {offset} is not an allocated extent") from None

    def is_allocated(self, offset: int) -> bool:
        return offset in self._used

    @property
    def free_bytes(self) -> int:
        """Bytes not allocated (free extents plus the never-used tail)."""
        return self._limit - self.used_bytes

    def coalesce(self) -> None:
        """Merge adjacent free extents; a free run ending at the bump pointer lowers it."""
        runs: list[tuple[int, int]] = []
        for off in sorted(self._free):
            size = self._free[off]
            if runs and runs[-1][0] + runs[-1][1] == off:
                runs[-1] = (runs[-1][0], runs[-1][1] + size)
            else:
                runs.append((off, size))
        self._free.clear()
        self._by_size.clear()
        if runs and runs[-1][0] + runs[-1][1] == self._top:
            self._top = runs.pop()[0]
        for off, size in runs:
            self._add_free(off, size)

    # -- internals ----------------------------------------------------------------------------
    def _add_free(self, off: int, size: int) -> None:
        self._free[off] = size
        bucket = self._by_size.get(size)
        if bucket is None:
            bucket = self._by_size[size] = deque()
        bucket.append(off)

    def _pop_free(self, size: int) -> int:
        """The oldest free offset of `size` (the bucket exists and is not empty)."""
        bucket = self._by_size[size]
        off = bucket.popleft()
        if not bucket:
            del self._by_size[size]
        del self._free[off]
        return off

    def _take_exact(self, size: int) -> int | None:
        if size not in self._by_size:
            return None
        return self._pop_free(size)  # oldest freed first: spreads reuse, deterministic

    def _bump(self, size: int) -> int | None:
        if self._top + size > self._limit:
            return None
        off = self._top
        self._top += size
        return off

    def _split(self, size: int) -> int | None:
        """Best fit: the smallest free extent larger than `size`; the rest stays free."""
        best = min((s for s in self._by_size if s > size), default=None)
        if best is None:
            return None
        off = self._pop_free(best)
        self._add_free(off + size, best - size)
        return off


class SlabAllocation:
    """Allocation half of a slab tier (host shm, GPU): everything delegates to `self._alloc`.

    Not thread-safe on its own: the store's lock covers it.
    """

    _alloc: ExtentAllocator

    @property
    def used_bytes(self) -> int:
        return self._alloc.used_bytes

    @property
    def allocator(self) -> ExtentAllocator:
        return self._alloc

    def alloc(self, nbytes: int) -> int:
        """Offset of a page-aligned extent of >= nbytes; ResourceExhausted when full."""
        return self._alloc.alloc(nbytes)

    def alloc_many(self, nbytes: int, n: int) -> list[int]:
        """n extents of >= nbytes each, all or none (ExtentAllocator.alloc_many)."""
        return self._alloc.alloc_many(nbytes, n)

    def free(self, offset: int) -> None:
        self._alloc.free(offset)

    def size_of(self, offset: int) -> int:
        return self._alloc.size_of(offset)
