"""PrefixLeaves over the block index's rows: the same prefix forest in packed arrays.

Why: the SSD tier's policy holds every block the SSD holds (millions). leaves.PrefixLeaves
spends a dict slot, a key copy, a list and a heap tuple per block (~850 bytes with the
default policy); this keeps the identical order (same priorities, same lazy heaps, same
adoption of orphans) in ~35 bytes of arrays per row plus one int per heap item, keyed by the
row the index already gives each block (kvstore/index.py), so no second key -> node dict.

The index calls `_forget(row)` before it frees a row, so a row reused by another block never
inherits a node. Rows are fixed while a block is indexed, and the store indexes a block before
it inserts it into a policy and discards it after removing it.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Callable, Iterator
from typing import Any, Protocol

_ROW_BITS = 32
_ROW_MASK = (1 << _ROW_BITS) - 1


class Rows(Protocol):
    """What RowLeaves needs of the index."""

    on_free: list[Callable[[int], None]]

    def row(self, gkey: bytes) -> int | None: ...
    def key_at(self, row: int) -> bytes: ...
    def parent_key(self, row: int) -> bytes | None: ...


class _Nodes:
    """Read-only mapping gkey -> (parent, linked, children, prio, seg), the shape
    SegmentedPolicy reads from PrefixLeaves.nodes."""

    def __init__(self, leaves: RowLeaves) -> None:
        self._l = leaves

    def get(self, gkey: bytes) -> tuple | None:
        r = self._l._resident_row(gkey)
        return None if r is None else self._l._node(r)

    def __getitem__(self, gkey: bytes) -> tuple:
        n = self.get(gkey)
        if n is None:
            raise KeyError(gkey)
        return n

    def __contains__(self, gkey: bytes) -> bool:
        return self._l._resident_row(gkey) is not None

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._l.keys())

    def __len__(self) -> int:
        return self._l._n


class RowLeaves:
    """Drop-in for leaves.PrefixLeaves (same methods, same order) keyed by index rows."""

    def __init__(self, rows: Rows, segments: int = 1) -> None:
        self._rows = rows
        rows.on_free.append(self._forget)
        self._heaps: list[list[int]] = [[] for _ in range(segments)]
        self.sizes = [0] * segments
        self._leafs = [0] * segments         # resident leaves per segment (heap trim trigger)
        self._n = 0
        self._in = bytearray()              # 1: the row's block is in this policy
        self._seg = bytearray()
        self._prio = array("q")
        self._nchild = array("i")           # resident children linked to this row
        self._prow = array("i")             # parent row when linked, else -1
        self._first = array("i")            # first linked child, -1 none
        self._next = array("i")             # sibling list (doubly linked)
        self._prev = array("i")
        self._orphans: dict[bytes, set[int]] = {}   # absent parent gkey -> child rows
        self._orphan_of: dict[int, bytes] = {}      # child row -> the parent it waits for
        self.nodes = _Nodes(self)

    def __len__(self) -> int:
        return self._n

    def __contains__(self, gkey: bytes) -> bool:
        return self._resident_row(gkey) is not None

    def _resident_row(self, gkey: bytes) -> int | None:
        r = self._rows.row(gkey)
        if r is None or r >= len(self._in) or not self._in[r]:
            return None
        return r

    def _node(self, r: int) -> tuple:
        return (self._parent_key(r), self._prow[r] >= 0, self._nchild[r], self._prio[r],
                self._seg[r])

    def _parent_key(self, r: int) -> bytes | None:
        p = self._prow[r]
        if p >= 0:
            return self._rows.key_at(p)
        return self._orphan_of.get(r)

    def _grow(self, r: int) -> None:
        n = len(self._in)
        if r < n:
            return
        add = max(r + 1 - n, n // 4, 1024)
        self._in.extend(bytes(add))
        self._seg.extend(bytes(add))
        self._prio.extend(array("q", bytes(8 * add)))
        self._nchild.extend(array("i", bytes(4 * add)))
        minus = array("i", [-1]) * add
        self._prow.extend(minus)
        self._first.extend(minus)
        self._next.extend(minus)
        self._prev.extend(minus)

    # ------------------------------------------------------------------ heaps
    def _push(self, r: int) -> None:
        seg = self._seg[r]
        heap = self._heaps[seg]
        heapq.heappush(heap, self._prio[r] << _ROW_BITS | r)
        # Trimmed against the leaves, not all nodes: a bulk load of chains leaves one stale
        # item per parent, which a node-count trigger would keep (40 bytes per block).
        if len(heap) > 64 and len(heap) > 2 * self._leafs[seg] + 64:
            self._rebuild(seg)

    def _valid(self, item: int, seg: int) -> bool:
        r = item & _ROW_MASK
        return (self._in[r] and not self._nchild[r] and self._seg[r] == seg
                and self._prio[r] == item >> _ROW_BITS)

    def _rebuild(self, seg: int) -> None:
        """Drop stale items (every valid leaf has at least one item: it is pushed whenever it
        becomes a leaf or changes place); amortized O(1) per push."""
        heap = list({it for it in self._heaps[seg] if self._valid(it, seg)})
        heapq.heapify(heap)
        self._heaps[seg] = heap

    # ------------------------------------------------------------------ links
    def _link(self, c: int, p: int) -> None:
        if not self._nchild[p] and self._in[p]:
            self._leafs[self._seg[p]] -= 1
        self._prow[c] = p
        head = self._first[p]
        self._next[c] = head
        self._prev[c] = -1
        if head >= 0:
            self._prev[head] = c
        self._first[p] = c
        self._nchild[p] += 1

    def _unlink(self, c: int) -> int:
        p = self._prow[c]
        nx, pv = self._next[c], self._prev[c]
        if pv >= 0:
            self._next[pv] = nx
        else:
            self._first[p] = nx
        if nx >= 0:
            self._prev[nx] = pv
        self._prow[c] = self._next[c] = self._prev[c] = -1
        self._nchild[p] -= 1
        if not self._nchild[p] and self._in[p]:
            self._leafs[self._seg[p]] += 1
        return p

    def _children(self, p: int) -> list[int]:
        out = []
        c = self._first[p]
        while c >= 0:
            out.append(c)
            c = self._next[c]
        return out

    # ------------------------------------------------------------------ PrefixLeaves API
    def add(self, gkey: bytes, parent: bytes | None, prio: int, seg: int) -> None:
        r = self._rows.row(gkey)
        if r is None:
            raise KeyError(f"block {gkey.hex()} is not indexed; index it before its policy")
        if prio < 0:
            raise ValueError("row-keyed leaves take non-negative priorities")
        self._grow(r)
        if self._in[r]:
            self.remove(gkey)
        if parent is not None and gkey in self._orphans and self._reaches(parent, gkey):
            parent = None       # adopting its waiting children would close a cycle: be a root
        if parent is not None and parent != gkey:
            p = self._resident_row(parent)
            if p is not None:
                self._link(r, p)
            else:
                self._orphans.setdefault(parent, set()).add(r)
                self._orphan_of[r] = parent
        adopted = self._orphans.pop(gkey, None)
        if adopted:
            for c in adopted:
                del self._orphan_of[c]
                self._link(c, r)
        self._in[r] = 1
        self._prio[r] = prio
        self._seg[r] = seg
        self.sizes[seg] += 1
        self._n += 1
        if not self._nchild[r]:
            self._leafs[seg] += 1
            self._push(r)

    def load(self, nodes: list[tuple[bytes, int]], first_prio: int) -> int:
        """Bulk add (warm restart) into empty leaves: `nodes` are (gkey, seg) in priority order,
        priorities first_prio, first_prio + 1, ...; each node's parent is the index's (the
        policy is always given the index's parent, and the index never holds a cycle), so no
        ancestry is walked. Keys the index does not hold are skipped. Returns the next
        priority."""
        assert not self._n, "load() fills empty leaves only"
        row = self._rows.row
        rs = [row(g) for g, _ in nodes]
        self._grow(max((r for r in rs if r is not None), default=0))
        inside, prios, segs, sizes = self._in, self._prio, self._seg, self.sizes
        loaded = []
        prio = first_prio
        for r, (_, seg) in zip(rs, nodes, strict=True):
            if r is None or inside[r]:
                continue
            inside[r] = 1
            prios[r] = prio
            segs[r] = seg
            sizes[seg] += 1
            prio += 1
            loaded.append(r)
        self._n = len(loaded)
        parent_key = self._rows.parent_key
        first, nxt, prev, prow, nchild = (self._first, self._next, self._prev, self._prow,
                                          self._nchild)
        for r in loaded:
            pg = parent_key(r)
            if pg is None:
                continue
            p = row(pg)
            if p is not None and p < len(inside) and inside[p]:
                if p == r:
                    continue
                prow[r] = p                 # _link without the leaf count (done below)
                head = first[p]
                nxt[r] = head
                if head >= 0:
                    prev[head] = r
                first[p] = r
                nchild[p] += 1
            else:
                self._orphans.setdefault(pg, set()).add(r)
                self._orphan_of[r] = pg
        self._leafs = [0] * len(self._heaps)
        for r in loaded:
            if not self._nchild[r]:
                seg = self._seg[r]
                self._leafs[seg] += 1
                self._heaps[seg].append(self._prio[r] << _ROW_BITS | r)
        for heap in self._heaps:
            heapq.heapify(heap)
        return prio

    def _reaches(self, start: bytes, target: bytes) -> bool:
        """Whether parent links up from `start` arrive at `target` (see PrefixLeaves)."""
        for _ in range(self._n + 1):
            if start == target:
                return True
            r = self._resident_row(start)
            if r is None:
                return False
            nxt = self._parent_key(r)
            if nxt is None:
                return False
            start = nxt
        return False

    def update(self, gkey: bytes, prio: int, seg: int) -> None:
        r = self._resident_row(gkey)
        if r is None:
            raise KeyError(gkey)
        self.sizes[self._seg[r]] -= 1
        self.sizes[seg] += 1
        if not self._nchild[r]:
            self._leafs[self._seg[r]] -= 1
            self._leafs[seg] += 1
        self._prio[r] = prio
        self._seg[r] = seg
        if not self._nchild[r]:
            self._push(r)

    def remove(self, gkey: bytes) -> tuple | None:
        r = self._resident_row(gkey)
        if r is None:
            return None
        return self._remove_row(r, gkey)

    def _remove_row(self, r: int, gkey: bytes) -> tuple:
        node = self._node(r)
        if not self._nchild[r]:
            self._leafs[self._seg[r]] -= 1
        self._in[r] = 0
        self.sizes[self._seg[r]] -= 1
        self._n -= 1
        if self._prow[r] >= 0:
            p = self._unlink(r)
            if not self._nchild[p]:
                self._push(p)
        elif (waits := self._orphan_of.pop(r, None)) is not None:
            group = self._orphans.get(waits)
            if group is not None:
                group.discard(r)
                if not group:
                    del self._orphans[waits]
        if self._nchild[r]:             # deleted under its children: they become roots
            kids = self._children(r)
            for c in kids:
                self._unlink(c)
                self._orphan_of[c] = gkey
            self._orphans[gkey] = set(kids)
        return node

    def _forget(self, r: int) -> None:
        """The index frees row `r`: drop its node if the store did not remove it first."""
        if r < len(self._in) and self._in[r]:
            self._remove_row(r, self._rows.key_at(r))

    def top(self, seg: int) -> tuple[int, bytes] | None:
        """(priority, key) of the lowest-priority leaf of `seg` (see PrefixLeaves.top)."""
        heap = self._heaps[seg]
        while heap:
            item = heap[0]
            if not self._valid(item, seg):
                heapq.heappop(heap)
                continue
            return item >> _ROW_BITS, self._rows.key_at(item & _ROW_MASK)
        return None

    def peek(self, seg: int, can_evict: Callable[[bytes], bool]) -> bytes | None:
        """Lowest-priority evictable leaf of `seg`, left in place."""
        heap = self._heaps[seg]
        skipped = []
        found = None
        while heap:
            item = heap[0]
            if not self._valid(item, seg):
                heapq.heappop(heap)
                continue
            g = self._rows.key_at(item & _ROW_MASK)
            if not can_evict(g):
                skipped.append(heapq.heappop(heap))
                continue
            found = g
            break
        for item in skipped:
            heapq.heappush(heap, item)
        return found

    def keys(self) -> list[bytes]:
        key_at = self._rows.key_at
        return [key_at(r) for r, x in enumerate(self._in) if x]

    def ordered(self) -> list[tuple[bytes, Any]]:
        """All nodes by (priority, key): the order snapshot() writes and restore() replays."""
        key_at = self._rows.key_at
        out = [(key_at(r), self._node(r)) for r, x in enumerate(self._in) if x]
        out.sort(key=lambda kv: (kv[1][3], kv[0]))
        return out
