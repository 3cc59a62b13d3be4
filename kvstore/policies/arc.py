"""`"arc"`: adaptive replacement (ARC, Megiddo & Modha) over prefix leaves, with a sampled
LRU guard. The default before the segmented policy; kept for comparison (`--policies arc` in
bench/trace_replay.py)."""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from .base import OneByOne, pack_snapshot, unpack_snapshot
from .leaves import _PARENT, _PRIO, _SEG, PrefixLeaves
from .lru import LRUPolicy


class AdaptivePolicy(OneByOne):
    """ARC over prefix leaves (``"arc"``; the default before the segmented policy).

    Segment 0 (T1) holds blocks seen once since they entered the history, segment 1 (T2) blocks
    seen at least twice. Evicted keys go to ghost lists B1/B2 (keys only). A miss on a B1 ghost
    says T1 was too small, on a B2 ghost that T2 was; the target size ``p`` of T1 moves
    accordingly (the ARC rule), so the recency/frequency balance follows the workload instead of
    a constant. The ghost history is twice the capacity: prompt tails come back after longer
    than one cache lifetime, and remembering them is what lets the second use be admitted to T2.
    Within a segment victims are LRU prefix leaves.
    """

    kind = "arc"
    GHOST_FACTOR = 2       # history length in units of the capacity (structural, not fitted)

    def __init__(self, capacity_blocks_hint: int | None = None, shadow: bool = True) -> None:
        self._hint = capacity_blocks_hint if capacity_blocks_hint and capacity_blocks_hint > 0 \
            else None
        self._leaves = PrefixLeaves(2)
        self._clock = 0
        self._p = 0.0
        self._peak = 0
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self._returning: OrderedDict[bytes, None] = OrderedDict()
        self._duel: _Duel | None = _Duel() if shadow else None

    def __len__(self) -> int:
        return len(self._leaves)

    def __contains__(self, gkey: bytes) -> bool:
        return gkey in self._leaves

    @property
    def capacity(self) -> int:
        """Blocks the tier holds: the hint, else the most ever resident (learned at first pick)."""
        return self._hint or max(self._peak, 1)

    def _ghost_hit(self, gkey: bytes) -> bool:
        """ARC adaptation on a ghost hit; True when the key belongs in T2 on insert."""
        if gkey in self._b1:
            del self._b1[gkey]
            self._p = min(float(self.capacity),
                          self._p + max(1.0, len(self._b2) / max(1, len(self._b1))))
            return True
        if gkey in self._b2:
            del self._b2[gkey]
            self._p = max(0.0, self._p - max(1.0, len(self._b1) / max(1, len(self._b2))))
            return True
        return False

    def record_miss(self, gkey: bytes) -> None:
        """A lookup missed here: adapt now, and admit the key to T2 when it is inserted."""
        if self._duel is not None:
            self._duel.miss(gkey, self.capacity)
        if gkey not in self._leaves and self._ghost_hit(gkey):
            self._returning[gkey] = None
            if len(self._returning) > self.capacity:
                self._returning.popitem(last=False)

    def insert(self, gkey: bytes, parent: bytes | None, size: int) -> None:
        self._clock += 1
        if self._duel is not None:
            self._duel.access(gkey, parent, self.capacity)
        if gkey in self._leaves:
            self._leaves.update(gkey, self._clock, 1)
            return
        if gkey in self._returning:
            del self._returning[gkey]
            seg = 1
        else:
            seg = 1 if self._ghost_hit(gkey) else 0
        self._leaves.add(gkey, parent, self._clock, seg)
        if len(self._leaves) > self._peak:
            self._peak = len(self._leaves)

    def touch(self, gkey: bytes) -> None:
        if gkey in self._leaves:
            self._clock += 1
            if self._duel is not None:
                self._duel.access(gkey, None, self.capacity)
            self._leaves.update(gkey, self._clock, 1)

    def remove(self, gkey: bytes) -> None:
        node = self._leaves.remove(gkey)
        if node is None:
            return
        (self._b1 if node[_SEG] == 0 else self._b2)[gkey] = None
        limit = self.GHOST_FACTOR * self.capacity
        while len(self._b1) + len(self._b2) > limit:
            (self._b1 if len(self._b1) >= len(self._b2) else self._b2).popitem(last=False)

    def pick(self, can_evict: Callable[[bytes], bool]) -> bytes | None:
        if self._duel is not None and self._duel.lru_ahead():
            # Recency is winning on this workload: the least recent leaf of either segment.
            a = self._leaves.peek(0, can_evict)
            b = self._leaves.peek(1, can_evict)
            if a is None or b is None:
                return a or b
            return a if self._leaves.nodes[a][_PRIO] < self._leaves.nodes[b][_PRIO] else b
        t1 = self._leaves.sizes[0]
        first = 0 if t1 > max(1.0, self._p) or self._leaves.sizes[1] == 0 else 1
        victim = self._leaves.peek(first, can_evict)
        if victim is None:
            victim = self._leaves.peek(1 - first, can_evict)
        return victim

    def snapshot(self) -> bytes:
        nodes = [[k, n[_PARENT], n[_SEG]] for k, n in self._leaves.ordered()]
        return pack_snapshot({"kind": self.kind, "nodes": nodes, "p": self._p, "peak": self._peak,
                      "b1": list(self._b1), "b2": list(self._b2),
                      "duel": self._duel.score if self._duel is not None else 0.0})

    def restore(self, blob: bytes) -> None:
        state = unpack_snapshot(blob, self.kind)
        self.__init__(self._hint)
        for gkey, parent, seg in state["nodes"]:
            self._clock += 1
            self._leaves.add(gkey, parent, self._clock, 1 if seg else 0)
        self._p = float(state["p"])
        self._peak = max(int(state["peak"]), len(self._leaves))
        self._b1.update((k, None) for k in state["b1"])
        self._b2.update((k, None) for k in state["b2"])
        if self._duel is not None:
            self._duel.score = float(state.get("duel", 0.0))


class _Duel:
    """Guard against ARC losing to LRU: simulate both on a 1/RATE sample of keys.

    Why: ARC's frequency segment can hold stale blocks on workloads where plain recency is
    better (e.g. a cache big enough for most reuse distances). Two shadow caches of
    capacity/RATE blocks see the sampled keys only (spatial sampling, as in SHARDS); when the
    shadow LRU has scored more hits recently, pick() follows recency. Costs O(1) per operation
    and one pair of tiny caches; the score halves every shadow-capacity accesses so the choice
    follows phase changes.
    """

    RATE = 16

    def __init__(self) -> None:
        self.arc = AdaptivePolicy(None, shadow=False)
        self.lru = LRUPolicy()
        self.res_arc: set[bytes] = set()
        self.res_lru: set[bytes] = set()
        self.score = 0.0
        self.n = 0

    @staticmethod
    def sampled(gkey: bytes) -> bool:
        return zlib.crc32(gkey) % _Duel.RATE == 0

    def miss(self, gkey: bytes, capacity: int) -> None:
        if self.sampled(gkey) and gkey not in self.res_arc:
            self.arc.record_miss(gkey)

    def access(self, gkey: bytes, parent: bytes | None, capacity: int) -> None:
        if not self.sampled(gkey):
            return
        cap = max(1, capacity // self.RATE)
        self.arc._hint = cap
        hit_arc = self._one(self.arc, self.res_arc, gkey, parent, cap)
        hit_lru = self._one(self.lru, self.res_lru, gkey, parent, cap)
        self.score += hit_lru - hit_arc
        self.n += 1
        if self.n >= cap:
            self.n = 0
            self.score /= 2

    @staticmethod
    def _one(policy: Any, resident: set[bytes], gkey: bytes, parent: bytes | None,
             cap: int) -> int:
        if gkey in resident:
            policy.touch(gkey)
            return 1
        policy.insert(gkey, parent if parent in resident else None, 1)
        resident.add(gkey)
        while len(resident) > cap:
            victim = policy.pick(lambda g: g != gkey)
            if victim is None:
                break
            resident.discard(victim)
            policy.remove(victim)
        return 0

    def lru_ahead(self) -> bool:
        return self.score > 0
