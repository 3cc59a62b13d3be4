"""`"lru"`: prefix leaves first, least recently used first among leaves."""

from __future__ import annotations

from collections.abc import Callable

from kvstore_client.common.layout import check_retention

from .base import OneByOne, pack_snapshot, unpack_snapshot
from .leaves import _PARENT, PrefixLeaves


class LRUPolicy(OneByOne):
    """Prefix leaves first, least recently used first among leaves."""

    kind = "lru"

    def __init__(self, capacity_blocks_hint: int | None = None) -> None:
        self._leaves = PrefixLeaves(1)
        self._clock = 0

    def __len__(self) -> int:
        return len(self._leaves)

    def __contains__(self, gkey: bytes) -> bool:
        return gkey in self._leaves

    def insert(self, gkey: bytes, parent: bytes | None, size: int) -> None:
        self._clock += 1
        if gkey in self._leaves:
            self._leaves.update(gkey, self._clock, 0)
        else:
            self._leaves.add(gkey, parent, self._clock, 0)

    def touch(self, gkey: bytes) -> None:
        if gkey in self._leaves:
            self._clock += 1
            self._leaves.update(gkey, self._clock, 0)

    def remove(self, gkey: bytes) -> None:
        self._leaves.remove(gkey)

    def record_miss(self, gkey: bytes) -> None:
        """LRU keeps no history."""

    def note_retention(self, gkeys: list[bytes], level: str) -> None:
        """Optional hook (Store.retain): "low" moves the blocks to the eviction end, "high" to
        the most recently used end."""
        if check_retention(level) == "normal":
            return
        for g in gkeys:
            if g in self._leaves:
                self._clock += 1
                self._leaves.update(g, self._clock if level == "high" else -self._clock, 0)

    def pick(self, can_evict: Callable[[bytes], bool]) -> bytes | None:
        return self._leaves.peek(0, can_evict)

    def snapshot(self) -> bytes:
        nodes = [[k, n[_PARENT]] for k, n in self._leaves.ordered()]
        return pack_snapshot({"kind": self.kind, "nodes": nodes})

    def restore(self, blob: bytes) -> None:
        state = unpack_snapshot(blob, self.kind)
        self.__init__()
        for gkey, parent in state["nodes"]:
            self.insert(gkey, parent, 0)
