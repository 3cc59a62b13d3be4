"""The prefix forest every policy orders: resident blocks linked to their parents, and the
leaves (blocks with no resident child) in lazily invalidated priority heaps.

Why leaves only: a child is unreachable without its parent, so evicting a parent before its
children would waste the children's slots. Each policy keeps its own order (recency, class,
hint) as the priority and heap ("segment") of a leaf; the forest keeps the heaps consistent
when blocks arrive out of order (a parent inserted after its children adopts them). For a tier
of millions of blocks, `packed_leaves.RowLeaves` is the same forest in packed arrays.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

# node fields (a list per resident block: cheaper than objects on the hot path)
_PARENT, _LINKED, _CHILDREN, _PRIO, _SEG = range(5)


class PrefixLeaves:
    """Resident blocks as a prefix forest; leaves kept in one priority heap per segment.

    Why a forest: only leaves (blocks with no resident child) may be evicted. A parent that is
    inserted after its children (promotion order) adopts them; a child whose parent is not
    resident is a root until the parent arrives.
    """

    def __init__(self, segments: int = 1) -> None:
        self.nodes: dict[bytes, list[Any]] = {}
        self._orphans: dict[bytes, set[bytes]] = {}     # absent parent -> resident children
        self._heaps: list[list[tuple[Any, bytes]]] = [[] for _ in range(segments)]
        self.sizes = [0] * segments

    def __len__(self) -> int:
        return len(self.nodes)

    def __contains__(self, gkey: bytes) -> bool:
        return gkey in self.nodes

    def _push(self, gkey: bytes, node: list[Any]) -> None:
        heap = self._heaps[node[_SEG]]
        heapq.heappush(heap, (node[_PRIO], gkey))
        if len(heap) > 64 and len(heap) > 2 * self.sizes[node[_SEG]] + 64:
            self._rebuild(node[_SEG])

    def _rebuild(self, seg: int) -> None:
        """Drop stale (and duplicate) entries; amortized O(1) per push since half the heap was
        garbage. Filters the heap itself rather than scanning every node: with many segments a
        small one is rebuilt often, and a scan of all nodes would cost O(n) each time. Every
        leaf of `seg` has an entry (each change that makes or moves a leaf pushes one)."""
        nodes = self.nodes
        seen: set[bytes] = set()
        heap = []
        for prio, k in self._heaps[seg]:
            n = nodes.get(k)
            if n is not None and n[_PRIO] == prio and n[_SEG] == seg and not n[_CHILDREN] \
                    and k not in seen:
                seen.add(k)
                heap.append((prio, k))
        heapq.heapify(heap)
        self._heaps[seg] = heap

    def add(self, gkey: bytes, parent: bytes | None, prio: Any, seg: int) -> None:
        if parent is not None and gkey in self._orphans and self._reaches(parent, gkey):
            parent = None       # adopting its waiting children would close a cycle: be a root
        node = [parent, False, None, prio, seg]
        if parent is not None and parent != gkey:
            pnode = self.nodes.get(parent)
            if pnode is not None:
                node[_LINKED] = True
                if pnode[_CHILDREN] is None:
                    pnode[_CHILDREN] = set()
                pnode[_CHILDREN].add(gkey)
            else:
                self._orphans.setdefault(parent, set()).add(gkey)
        adopted = self._orphans.pop(gkey, None) if self._orphans else None
        if adopted:
            for child in adopted:
                self.nodes[child][_LINKED] = True
            node[_CHILDREN] = adopted
        self.nodes[gkey] = node
        sizes = self.sizes
        sizes[seg] += 1
        if not adopted:                   # a new leaf: _push, inlined
            heap = self._heaps[seg]
            heapq.heappush(heap, (prio, gkey))
            if len(heap) > 64 and len(heap) > 2 * sizes[seg] + 64:
                self._rebuild(seg)

    def _reaches(self, start: bytes, target: bytes) -> bool:
        """Whether parent links up from `start` arrive at `target`. Only walked when a block
        that resident children wait for arrives with a parent, so the hot path never pays;
        prefix-hash keys cannot form cycles, but parent links sent by a client can."""
        node: list[Any] | None = None
        for _ in range(len(self.nodes) + 1):
            if start == target:
                return True
            node = self.nodes.get(start)
            if node is None or node[_PARENT] is None:
                return False
            start = node[_PARENT]
        return False

    def update(self, gkey: bytes, prio: Any, seg: int) -> None:
        node = self.nodes[gkey]
        sizes = self.sizes
        sizes[node[_SEG]] -= 1
        sizes[seg] += 1
        node[_PRIO] = prio
        node[_SEG] = seg
        if not node[_CHILDREN]:           # _push, inlined: the hottest call of every policy
            heap = self._heaps[seg]
            heapq.heappush(heap, (prio, gkey))
            if len(heap) > 64 and len(heap) > 2 * sizes[seg] + 64:
                self._rebuild(seg)

    def remove(self, gkey: bytes) -> list[Any] | None:
        node = self.nodes.pop(gkey, None)
        if node is None:
            return None
        self.sizes[node[_SEG]] -= 1
        parent = node[_PARENT]
        if node[_LINKED]:
            pnode = self.nodes[parent]
            children = pnode[_CHILDREN]
            children.discard(gkey)
            if not children:              # the parent is a leaf again: _push, inlined
                pnode[_CHILDREN] = None
                seg = pnode[_SEG]
                heap = self._heaps[seg]
                heapq.heappush(heap, (pnode[_PRIO], parent))
                if len(heap) > 64 and len(heap) > 2 * self.sizes[seg] + 64:
                    self._rebuild(seg)
        elif parent is not None:
            waiting = self._orphans.get(parent)
            if waiting is not None:
                waiting.discard(gkey)
                if not waiting:
                    del self._orphans[parent]
        if node[_CHILDREN]:           # deleted under its children: they become roots
            for child in node[_CHILDREN]:
                self.nodes[child][_LINKED] = False
            self._orphans[gkey] = node[_CHILDREN]
        return node

    def top(self, seg: int) -> tuple[Any, bytes] | None:
        """(priority, key) of the lowest-priority leaf of `seg`, evictable or not; stale heap
        entries on the way are dropped. None when the segment has no leaf."""
        heap, nodes = self._heaps[seg], self.nodes
        while heap:
            prio, g = heap[0]
            n = nodes.get(g)
            if n is None or n[_CHILDREN] or n[_PRIO] != prio or n[_SEG] != seg:
                heapq.heappop(heap)
                continue
            return prio, g
        return None

    def peek(self, seg: int, can_evict: Callable[[bytes], bool]) -> bytes | None:
        """Lowest-priority evictable leaf of `seg`, left in place."""
        heap = self._heaps[seg]
        skipped = []
        found = None
        while heap:
            prio, gkey = heap[0]
            node = self.nodes.get(gkey)
            if node is None or node[_CHILDREN] or node[_PRIO] != prio or node[_SEG] != seg:
                heapq.heappop(heap)
                continue
            if not can_evict(gkey):
                skipped.append(heapq.heappop(heap))
                continue
            found = gkey
            break
        for item in skipped:
            heapq.heappush(heap, item)
        return found

    def ordered(self) -> list[tuple[bytes, list[Any]]]:
        """All nodes by (priority, key): the order snapshot() writes and restore() replays."""
        return sorted(self.nodes.items(), key=lambda kv: (kv[1][_PRIO], kv[0]))
