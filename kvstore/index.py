"""The block index: where each block lives, its parent, size and checksum.

Keyed by global key (namespace id + block key) so one dict serves every namespace and no lookup
can reach another namespace's block. A key appears once per tier (dedup): an entry records
residency per tier rather than holding copies.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

NS_ID_BYTES = 16


@dataclass(slots=True)
class Entry:
    ns_id: bytes
    key: bytes
    parent: bytes | None        # parent block key (same namespace), None for a prompt's first block
    size: int                   # raw block bytes
    checksum: int               # xxh3-64 of the raw bytes
    host: int | None = None     # offset in the host slab
    ssd: bool = False
    remote: bool = False
    pins: int = 0               # read leases holding the host copy
    gpu: int | None = None      # offset in the device slab of device `gpu_dev` (gpu tier)
    gpu_dev: int = 0
    gpu_pins: int = 0           # read leases holding the gpu copy
    children: int = 0           # indexed blocks whose parent this is
    # Set while the block moves between tiers outside the store lock (kvstore/movement.py):
    # an acquire promoting it (host copy None; other acquires wait on the event), or an
    # eviction demoting it to SSD (host copy still there, readable and acquirable). Meanwhile
    # no delete, eviction or other demotion or promotion touches it.
    moving: threading.Event | None = None

    @property
    def gkey(self) -> bytes:
        return self.ns_id + self.key

    @property
    def parent_gkey(self) -> bytes | None:
        return self.ns_id + self.parent if self.parent else None

    @property
    def resident(self) -> bool:
        return self.host is not None or self.ssd or self.remote or self.gpu is not None


class BlockIndex:
    def __init__(self) -> None:
        self._entries: dict[bytes, Entry] = {}
        self._by_ns: dict[bytes, set[bytes]] = {}
        # Parents named by indexed blocks but not indexed themselves: only a key in here can
        # close a cycle of parent links when it arrives, so only then is its ancestry walked.
        self._awaited: dict[bytes, int] = {}
        # The dict's own method: lookups call it once per key on the hot path.
        self.get = self._entries.get

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, gkey: bytes) -> bool:
        return gkey in self._entries

    def add(self, entry: Entry) -> None:
        g = entry.gkey
        if entry.parent and g in self._awaited and self._reaches(entry.parent_gkey, g):
            entry.parent = None     # a client-given parent that would close a cycle is dropped
        self._entries[g] = entry
        self._by_ns.setdefault(entry.ns_id, set()).add(g)
        self._awaited.pop(g, None)
        self._link(entry)

    def _link(self, entry: Entry) -> None:
        p = entry.parent_gkey
        if p is None:
            return
        if (parent := self._entries.get(p)) is not None:
            parent.children += 1
        else:
            self._awaited[p] = self._awaited.get(p, 0) + 1

    def _unlink(self, entry: Entry) -> None:
        p = entry.parent_gkey
        if p is None:
            return
        if (parent := self._entries.get(p)) is not None:
            parent.children -= 1
        elif (n := self._awaited.get(p, 0)) > 1:
            self._awaited[p] = n - 1
        else:
            self._awaited.pop(p, None)

    def _reaches(self, start: bytes | None, target: bytes) -> bool:
        """Whether walking parent links up from `start` arrives at `target` (a cycle)."""
        seen = 0
        while start is not None and seen <= len(self._entries):
            if start == target:
                return True
            e = self._entries.get(start)
            start = e.parent_gkey if e is not None else None
            seen += 1
        return False

    def recount_children(self) -> None:
        """Child counts after a bulk load in arbitrary order (warm restart)."""
        self._awaited.clear()
        for e in self._entries.values():
            e.children = 0
        for e in self._entries.values():
            self._link(e)

    def set_parent(self, entry: Entry, parent: bytes | None) -> None:
        """Fill in a parent learned late (a block first seen without one)."""
        if entry.parent or not parent or self._reaches(entry.ns_id + parent, entry.gkey):
            return
        entry.parent = parent
        self._link(entry)

    def discard(self, gkey: bytes) -> None:
        e = self._entries.pop(gkey, None)
        if e is not None:
            self._unlink(e)
            keys = self._by_ns.get(e.ns_id)
            if keys is not None:
                keys.discard(gkey)
                if not keys:
                    del self._by_ns[e.ns_id]

    def namespace_keys(self, ns_id: bytes) -> list[bytes]:
        return list(self._by_ns.get(ns_id, ()))

    def entries(self) -> Iterator[Entry]:
        return iter(list(self._entries.values()))
