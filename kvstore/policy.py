"""Eviction policies: which resident block a tier gives up next (see docs/eviction.md).

One policy instance per tier. It sees only global keys and owns its ordering state, so the store
can swap policies per tier and the bench can replay traces against exactly the code the daemon
runs. Three policies:

* ``"lru"`` — prefix leaves first, least recently used first among leaves. A block whose
  children are resident is never a victim: a child is unreachable without its parent, so evicting
  the parent first would waste the child's slot.
* ``"default"`` — segmented LRU over the same prefix leaves (probation for blocks seen once,
  protected for blocks seen again), whose protected share is chosen online by miniature
  shadow caches (plain LRU is one of the candidates), plus a learned rule that sends a put's
  last block (usually a partial block in a prefix cache) to the eviction end when such tails
  are observed to be reused far less than other new blocks. Optional hook: ``note_put``.
* ``"lru"`` and ``"default"`` also take the engine's reuse hints (``Store.retain``) through
  the optional hook ``note_retention(gkeys, level)``: "low" to the eviction end, "high" kept
  like a block already reused.
* ``"arc"`` — the previous default: adaptive replacement (ARC, Megiddo & Modha) over prefix
  leaves with a sampled LRU guard. Kept for comparison (``--policies arc`` in the bench).

Every operation is O(1) or O(log n) amortized: leaves sit in lazily invalidated heaps that are
rebuilt when more than half their entries are stale.
"""

from __future__ import annotations

import heapq
import math
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

import msgpack
from kvstore_client.errors import InvalidArgument
from kvstore_client.layout import check_retention

from .ghost import GhostKeys
from .rowleaves import RowLeaves, Rows

SNAPSHOT_VERSION = 1

# node fields (a list per resident block: cheaper than objects on the hot path)
_PARENT, _LINKED, _CHILDREN, _PRIO, _SEG = range(5)


@runtime_checkable
class EvictionPolicy(Protocol):
    """The interface the store codes against (docs/internals.md)."""

    def insert(self, gkey: bytes, parent: bytes | None, size: int) -> None: ...
    def insert_many(self, items: Iterable[tuple[bytes, bytes | None, int]]) -> None: ...
    def touch(self, gkey: bytes) -> None: ...
    def touch_many(self, gkeys: Iterable[bytes]) -> None: ...
    def remove(self, gkey: bytes) -> None: ...
    def record_miss(self, gkey: bytes) -> None: ...
    def pick(self, can_evict: Callable[[bytes], bool]) -> bytes | None: ...
    def snapshot(self) -> bytes: ...
    def restore(self, blob: bytes) -> None: ...


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


def _pack(state: dict[str, Any], version: int = SNAPSHOT_VERSION) -> bytes:
    return msgpack.packb({"v": version, **state}, use_bin_type=True)


def _unpack(blob: bytes, kind: str, version: int = SNAPSHOT_VERSION) -> dict[str, Any]:
    try:
        state = msgpack.unpackb(blob, raw=False)
    except Exception as e:  # noqa: BLE001 - msgpack raises several unrelated types
        raise InvalidArgument(f"policy snapshot is not valid msgpack: {e}") from None
    if not isinstance(state, dict) or state.get("v") != version:
        raise InvalidArgument("policy snapshot has an unknown format version")
    if state.get("kind") != kind:
        raise InvalidArgument(f"policy snapshot is for {state.get('kind')!r}, not {kind!r}")
    return state


class _OneByOne:
    """The store's batch calls as a loop, for policies with nothing to gain from a batch."""

    def insert_many(self, items: Iterable[tuple[bytes, bytes | None, int]]) -> None:
        """insert() for each (gkey, parent, size), in order (the store's batch call)."""
        for gkey, parent, size in items:
            self.insert(gkey, parent, size)

    def touch_many(self, gkeys: Iterable[bytes]) -> None:
        """touch() for each key, in order (the store's batch call)."""
        for gkey in gkeys:
            self.touch(gkey)


class LRUPolicy(_OneByOne):
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
        return _pack({"kind": self.kind, "nodes": nodes})

    def restore(self, blob: bytes) -> None:
        state = _unpack(blob, self.kind)
        self.__init__()
        for gkey, parent in state["nodes"]:
            self.insert(gkey, parent, 0)


class AdaptivePolicy(_OneByOne):
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
        return _pack({"kind": self.kind, "nodes": nodes, "p": self._p, "peak": self._peak,
                      "b1": list(self._b1), "b2": list(self._b2),
                      "duel": self._duel.score if self._duel is not None else 0.0})

    def restore(self, blob: bytes) -> None:
        state = _unpack(blob, self.kind)
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


# block classes and hints of SegmentedPolicy; heap index = class * 3 + hint
_P, _R, _T = range(3)                     # probation, protected, put tail
_N, _L, _H = range(3)                     # hint: normal, low, high
_HEAPS = 9
_HINT_OF = {"normal": _N, "low": _L, "high": _H}


def _simulate(pol: SegmentedPolicy, resident: set[bytes], gkey: bytes, parent: bytes | None,
              cap: int) -> int:
    """One access to a shadow or twin cache of `cap` blocks: 1 on a hit, else 0 after
    inserting `gkey` and evicting down to `cap` (never `gkey` itself).

    Exactly ``_Duel._one(pol, resident, ...)``, with pol.touch / insert / remove and the
    common cases of PrefixLeaves.update / add inlined. Why: the tuner runs ten shadows per
    sampled access and three full-size twins per access once hints exist, so these calls are
    most of the policy's CPU time on the store's hot path, and most of that was call
    overhead and checks that are constant for a simulation (`pol` has no shadows or twins of
    its own, its capacity is its hint, its leaves are a PrefixLeaves). `resident` is the set
    of keys `pol` holds (kept, as _Duel does, for the callers that walk it).
    """
    leaves = pol._leaves
    nodes, sizes = leaves.nodes, leaves.sizes
    clock = pol._clock = pol._clock + 1
    node = nodes.get(gkey)
    if node is not None:              # hit: touch, i.e. protected and any hint spent
        seg = _R * 3 + _N
        sizes[node[_SEG]] -= 1
        sizes[seg] += 1
        node[_PRIO] = clock
        node[_SEG] = seg
        if not node[_CHILDREN]:
            heap = leaves._heaps[seg]
            heapq.heappush(heap, (clock, gkey))
            if len(heap) > 64 and len(heap) > 2 * sizes[seg] + 64:
                leaves._rebuild(seg)
        return 1
    ghost = pol._ghost
    if gkey in ghost:                 # insert: back from the ghost history, protected
        del ghost[gkey]
        seg = _R * 3
    else:
        seg = _P * 3
    if parent not in resident:
        parent = None
    if leaves._orphans:               # children wait for a parent: the general path
        leaves.add(gkey, parent, clock, seg)
    else:                             # a new leaf under a resident parent, or a root
        if parent is not None:
            pnode = nodes[parent]
            kids = pnode[_CHILDREN]
            if kids is None:
                pnode[_CHILDREN] = {gkey}
            else:
                kids.add(gkey)
        nodes[gkey] = [parent, parent is not None, None, clock, seg]
        sizes[seg] += 1
        heap = leaves._heaps[seg]
        heapq.heappush(heap, (clock, gkey))
        if len(heap) > 64 and len(heap) > 2 * sizes[seg] + 64:
            leaves._rebuild(seg)
    resident.add(gkey)
    n = len(resident)
    if n > pol._peak:
        pol._peak = n
    if n > cap:
        _sim_evict(pol, resident, gkey, cap)
    return 0


def _sim_evict(pol: SegmentedPolicy, resident: set[bytes], gkey: bytes, cap: int) -> None:
    """Evict from a shadow or twin until it holds `cap` blocks: ``pol.pick(lambda g: g !=
    gkey)`` then ``pol.remove(victim)``, repeated, with pick's heap search (``_oldest``) and
    the removal of a leaf inlined; why, see _simulate. Rare cases (the oldest leaf is `gkey`
    itself, children waiting for an absent parent) take the general methods."""
    leaves = pol._leaves
    nodes, sizes, heaps, ghost = leaves.nodes, leaves.sizes, leaves._heaps, pol._ghost
    capacity = pol._hint or max(pol._peak, 1)
    limit = pol.GHOST_FACTOR * capacity
    first, prob, prot, both = pol._roles
    share = pol._mode[0]
    heappop, heappush = heapq.heappop, heapq.heappush
    while len(resident) > cap:
        if share is None:                 # pick's order of heap groups for this mode
            groups = (first, both)
        else:
            in_prot = 0
            for h in prot:
                in_prot += sizes[h]
            if in_prot > share * capacity or not any([sizes[h] for h in prob]):
                groups = (first, prot, prob)
            else:
                groups = (first, prob, prot)
        victim = None
        for group in groups:              # _oldest(group), can_evict inlined
            best, best_prio = None, None
            for h in group:
                if not sizes[h]:
                    continue
                heap = heaps[h]
                while heap:
                    prio, g = heap[0]
                    node = nodes.get(g)
                    if node is None or node[_CHILDREN] or node[_PRIO] != prio or node[_SEG] != h:
                        heappop(heap)
                        continue
                    if best_prio is None or prio < best_prio:
                        best, best_prio = g, prio
                    break
            if best == gkey:
                best = pol._oldest_evictable(group, gkey.__ne__)
            if best is not None:
                victim = best
                break
        if victim is None:
            return
        resident.discard(victim)
        if leaves._orphans:
            leaves.remove(victim)
        else:                             # a leaf, and no children wait for it
            node = nodes.pop(victim)
            sizes[node[_SEG]] -= 1
            if node[_LINKED]:
                pnode = nodes[node[_PARENT]]
                kids = pnode[_CHILDREN]
                kids.discard(victim)
                if not kids:              # the parent is a leaf again
                    pnode[_CHILDREN] = None
                    seg = pnode[_SEG]
                    heap = heaps[seg]
                    heappush(heap, (pnode[_PRIO], node[_PARENT]))
                    if len(heap) > 64 and len(heap) > 2 * sizes[seg] + 64:
                        leaves._rebuild(seg)
                        heaps = leaves._heaps
        ghost[victim] = None
        while len(ghost) > limit:
            ghost.popitem(last=False)


STRICT, SOFT = 1, 2        # hint modes: every "low" goes first / not for blocks already reused


def _roles(tail: bool, hinted: int) -> tuple[tuple[int, ...], ...]:
    """Heaps by role for one mode: (evicted first, probation, protected, all but first)."""
    first: list[int] = []
    prob: list[int] = []
    prot: list[int] = []
    for cls in (_P, _R, _T):
        for hint in (_N, _L, _H):
            h = cls * 3 + hint
            if hinted and hint == _L and (hinted == STRICT or cls != _R):
                first.append(h)             # SOFT: a block already reused outlives "low"
            elif hinted and hint == _H:
                prot.append(h)
            elif cls == _T and tail:
                first.append(h)
            elif cls == _R:
                prot.append(h)
            else:
                prob.append(h)
    return tuple(first), tuple(prob), tuple(prot), tuple(sorted(prob + prot))


class SegmentedPolicy:
    """The project's default: segmented LRU over prefix leaves, self-tuned by miniature caches.

    Every resident block has a *class* from what the store saw (probation: written once;
    protected: hit while resident, or written again while still in the ghost history of
    evicted keys, 2x capacity; tail: the last block of a put, via ``note_put``) and a *hint*
    from the engine (normal / low / high, via ``note_retention``). Each (class, hint) pair has
    its own heap of leaves ordered by recency, so the eviction order is a *mode* applied to
    that state at pick time, and modes can change without touching the blocks:

    * share: None = plain LRU over every block (exactly ``"lru"``'s order), else the protected
      segment's share of the capacity (segmented LRU: victims come from probation while
      protected is within its share).
    * tail: put tails go to the eviction end (a prompt's last block is usually partial in a
      prefix cache, and its key changes when the conversation grows).
    * hint: engine hints reorder ("low" first, "high" as protected); off: hints are ignored.

    The blind mode is chosen online by miniature caches (Waldspurger et al., ATC'17; SHARDS
    spatial sampling): one shadow cache per candidate mode, capacity/RATE blocks, fed the
    1/RATE sample of keys. pick() follows the best recent scorer (scores halve every WINDOW
    shadow capacities of sampled accesses), but leaves plain LRU only for a candidate that
    beats it by a margin: where the sample cannot tell, the policy keeps LRU's order.
    Whether to follow hints is judged by three full-size twins (blind, strict, soft) that
    start at the first hint as copies of the cache: a hint mode is followed once its twin
    beats the blind twin in a paired test (``_beats``), and left once the blind twin beats it
    on the same test; else the order in use stays.
    O(log n) amortized per operation (lazy heaps) plus O(candidates) shadow work per sampled
    access, and three twin operations per access once hints exist.
    """

    kind = "default"
    SNAPSHOT_V = 2
    GHOST_FACTOR = 2                      # history length in capacities (as in ARC)
    SHARES: tuple[float | None, ...] = (None, 0.5, 0.75, 0.875, 0.9375)   # None: plain LRU
    RATE = 16                             # shadow sampling rate (SHARDS-style)
    SHADOW_MAX = 4096                     # blocks per shadow: past it the rate doubles
    WINDOW = 4                            # shadow scores halve every WINDOW shadow capacities
    MARGIN = 0.02                         # relative lead a candidate needs over LRU / blind
    MARGIN_HITS = 4.0                     # ... and in (decayed) sampled hits
    PAIR_Z = 3.0                          # twins: hints followed when they win at z >= 3
    # Twins are full-size copies (three of them): ~1.2 KB per block. Above this many blocks
    # (an SSD tier of millions) they would cost more memory than the index itself, so a tier
    # that large drops them and keeps the blind order; hints then never reorder it (never
    # below blind, by construction).
    TWIN_MAX_BLOCKS = 1 << 17
    PENDING_MAX = 1 << 14                 # deferred accesses fed inline past this many

    def __init__(self, capacity_blocks_hint: int | None = None, shadow: bool = True,
                 mode: tuple[float | None, bool, int] = (None, False, 0),
                 rows: Rows | None = None) -> None:
        self._hint = capacity_blocks_hint if capacity_blocks_hint and capacity_blocks_hint > 0 \
            else None
        # rows: the block index, for a tier that holds millions of blocks (SSD): the same
        # forest and order in packed arrays keyed by index row (kvstore/rowleaves.py).
        self._rows = rows
        self._leaves: Any = RowLeaves(rows, _HEAPS) if rows is not None else PrefixLeaves(_HEAPS)
        self._clock = 0
        self._peak = 0
        # Evicted keys, up to GHOST_FACTOR capacities: as fingerprints for a big tier.
        self._ghost: Any = GhostKeys() if rows is not None else OrderedDict()
        self._mode = mode
        self._roles = _roles(mode[1], mode[2])
        self._shadows: list[list[Any]] | None = None
        self._sampled_n = 0
        self._rate = self.RATE
        if shadow:
            self._shadows = [self._new_shadow((share, tail, 0))
                             for share in self.SHARES for tail in (False, True)]
        self._twins: list[list[Any]] | None = None
        self._twin_n = 0
        self._disc = [[0.0] * 3 for _ in range(3)]   # [i][j]: accesses twin i hit, j missed
        # Deferred tuning (defer_tuning): the accesses the shadows and twins have yet to see,
        # in order, each with the capacity it saw; (None, tail, 0) stands for a note_put.
        self._pending: list[tuple[bytes | None, bytes | None, int]] | None = None

    @staticmethod
    def _new_shadow(mode: tuple[float | None, bool, int]) -> list[Any]:
        return [SegmentedPolicy(1, shadow=False, mode=mode), set(), 0.0]

    def __len__(self) -> int:
        return len(self._leaves)

    def __contains__(self, gkey: bytes) -> bool:
        return gkey in self._leaves

    def compact(self) -> None:
        """Drop the heaps' stale items now (after a bulk load: parents inserted before their
        children leave an item per parent behind)."""
        for seg in range(_HEAPS):
            self._leaves._rebuild(seg)

    @property
    def capacity(self) -> int:
        """Blocks the tier holds: the hint, else the most ever resident (learned at first pick)."""
        return self._hint or max(self._peak, 1)

    @property
    def mode(self) -> tuple[float | None, bool, int]:
        """(protected share or None for LRU, tail rule on, hints followed): the order in use."""
        if self._pending:
            self.tune()
        return self._mode

    def defer_tuning(self) -> None:
        """Feed the shadows and twins later (`tune`), not on the call that inserts or touches.

        Why: their simulations are about a third of the daemon's work for a store's Commit,
        and nothing they decide is needed until the next eviction. Every reader of what they
        decide (pick, the mode, a snapshot, a hint) first feeds them everything pending, in
        order and with the capacity each access saw, so the cache evicts exactly as it would
        have; the store feeds them in the background meanwhile (Store._tune_policy)."""
        if self._pending is None:
            self._pending = []

    def tune(self, limit: int | None = None) -> int:
        """Feed the shadows and twins up to `limit` pending accesses; returns how many are
        left."""
        pending = self._pending
        if not pending:
            return 0
        n = len(pending) if limit is None else min(limit, len(pending))
        batch = pending[:n]
        del pending[:n]
        for gkey, parent, cap in batch:
            if gkey is None:
                self._put_tail_shadows(parent)            # type: ignore[arg-type]
                continue
            if self._shadows is not None and self._sampled(gkey):
                self._shadow(gkey, parent, cap)
            if self._twins is not None:
                self._twin_access(gkey, parent, cap)
        return len(pending)

    def _set_mode(self, mode: tuple[float | None, bool, int]) -> None:
        if mode != self._mode:
            self._mode = mode
            self._roles = _roles(mode[1], mode[2])

    # ---------------------------------------------------------------- shadows
    def _sampled(self, gkey: bytes) -> bool:
        return not zlib.crc32(gkey) % self._rate

    def _resample(self, capacity: int = 0) -> None:
        """Fixed-size sampling (SHARDS' s_max): once a shadow would hold more than SHADOW_MAX
        blocks, halve the sample. Why: the shadows' memory then stays constant (a few MB)
        instead of growing with the tier (10 shadows of capacity/16 cost more than the packed
        SSD index itself); a sample of thousands still ranks the modes. The rate is a power of
        two, so the new sample is a subset of the old and the shadows keep their state for
        it."""
        rate = self._rate
        capacity = capacity or self.capacity
        while capacity // rate > self.SHADOW_MAX:
            rate *= 2
        if rate == self._rate:
            return
        self._rate = rate
        for pol, resident, _ in self._shadows or ():
            for k in [k for k in resident if zlib.crc32(k) % rate]:
                resident.discard(k)
                pol.remove(k)
                pol._ghost.pop(k, None)
            pol._ghost = OrderedDict((k, None) for k in pol._ghost if not zlib.crc32(k) % rate)

    def _shadow(self, gkey: bytes, parent: bytes | None, capacity: int = 0) -> None:
        if self._shadows is None or not self._sampled(gkey):
            return
        capacity = capacity or self.capacity
        if capacity // self._rate > self.SHADOW_MAX:
            self._resample(capacity)
            if not self._sampled(gkey):
                return
        cap = max(1, capacity // self._rate)
        for sh in self._shadows:
            sh[0]._hint = cap
            sh[2] += _simulate(sh[0], sh[1], gkey, parent, cap)
        self._sampled_n += 1
        if self._sampled_n >= self.WINDOW * cap:
            self._sampled_n = 0
            for sh in self._shadows:
                sh[2] /= 2
        self._choose()

    def _choose(self) -> None:
        """Pick the order to follow. Blind: the best shadow, but plain LRU unless a candidate
        leads it by the margin, and a new mode only when it leads the current one by the
        margin too. Then whether to follow hints, by the twins' paired test (_beats), which
        must be won to change the hint mode in either direction: hints are followed once a
        hint twin beats the blind twin, and left only when the blind twin beats the followed
        one (or the other hint mode replaces it on the same test).

        Why the same test both ways: a twin's hits come in clumps (a prompt's blocks hit or
        miss together, and a block one twin holds keeps hitting until evicted), so over a
        window of a few capacities the lead of the better twin swings by several times what
        independent accesses would give; at small capacities that window holds little
        evidence. Leaving hints as soon as the hint twin was not ahead made the cache switch
        modes on those swings, and each switch costs it the contents the previous order built
        (synthetic `scan` at 1k blocks: hinted 0.03 points below blind although the soft hint
        twin led the blind twin in every stretch). Hints still start only on a significant
        win, so ties and wrong hints keep the blind order."""
        shadows = self._shadows
        assert shadows is not None

        def lead(a: float, b: float) -> bool:
            return a > b * (1 + self.MARGIN) + self.MARGIN_HITS

        base = shadows[0]                  # (None, False, False): plain LRU
        best = max(shadows, key=lambda sh: sh[2])
        choice = best if lead(best[2], base[2]) else base
        blind = self._mode[:2] + (0,)
        current = next((sh for sh in shadows if sh[0]._mode == blind), None)
        if current is None or (choice is not current and lead(choice[2], current[2])):
            blind = choice[0]._mode
        mode = blind
        if self._twins is not None:
            tb = self._twins[0]
            tb[0]._set_mode(blind)
            for tw in self._twins[1:]:
                tw[0]._set_mode(blind[:2] + (tw[0]._mode[2],))
            now = self._mode[2]
            if now and self._beats(0, now):
                now = 0                      # the blind twin wins beyond chance: leave hints
            if now:
                other = SOFT if now == STRICT else STRICT
                if self._beats(other, now):
                    now = other
            else:
                d = self._disc
                cand = max((STRICT, SOFT), key=lambda i: d[i][0] - d[0][i])
                if self._beats(cand, 0):
                    now = cand
            mode = blind[:2] + (now,)
        self._set_mode(mode)

    def _beats(self, i: int, j: int) -> bool:
        """Twin i wins over twin j beyond chance (McNemar's paired test).

        Why paired: the twins see the same accesses, so only the accesses one of them hits
        and the other misses say anything about which order is better; counting just those
        (decayed like the scores), a real advantage shows after a few dozen of them, while a
        relative margin on total hits needs thousands when both hit often, and meanwhile the
        cache keeps the worse order. Ties (no significant difference) go to twin j, the
        order in use (see _choose)."""
        a, b = self._disc[i][j], self._disc[j][i]
        return a - b > self.PAIR_Z * math.sqrt(a + b) + self.MARGIN_HITS

    def _twin_access(self, gkey: bytes, parent: bytes | None, cap: int = 0) -> None:
        """Full-size LRU twins, blind and hinted, see every access once hints exist.

        Why full size: a sampled shadow scores every resident sampled key as a hit, which
        misjudges orders that keep whole conversations (prefix hits need the whole leading
        run); at full size a resident block's parents are resident too, so the twins count
        what the real cache would. They cost one more LRU operation each per access."""
        twins = self._twins
        assert twins is not None
        cap = cap or self._hint or max(self._peak, 1)   # self.capacity
        if cap > self.TWIN_MAX_BLOCKS:
            self._twins = None
            self._set_mode(self._mode[:2] + (0,))
            return
        t0, t1, t2 = twins
        hit = (_simulate(t0[0], t0[1], gkey, parent, cap),
               _simulate(t1[0], t1[1], gkey, parent, cap),
               _simulate(t2[0], t2[1], gkey, parent, cap))
        if hit[0] != hit[1] or hit[0] != hit[2]:
            d = self._disc
            for i in range(3):
                if hit[i]:
                    for j in range(3):
                        if not hit[j]:
                            d[i][j] += 1.0
        self._twin_n += 1
        if self._twin_n >= self.WINDOW * cap:
            self._twin_n = 0
            for row in self._disc:
                row[:] = [x / 2 for x in row]

    def _start_twins(self) -> None:
        """First hint: both twins start as copies of the cache's current contents in LRU order,
        so they differ only by what the hints do from now on."""
        self._twins = []
        for hinted in (0, STRICT, SOFT):
            pol = SegmentedPolicy(self.capacity, shadow=False, mode=self._mode[:2] + (hinted,))
            for gkey, node in self._leaves.ordered():
                pol.insert(gkey, node[_PARENT], 1)
            self._twins.append([pol, set(self._leaves.nodes), 0.0])
        self._twin_n = 0
        self._disc = [[0.0] * 3 for _ in range(3)]

    # ---------------------------------------------------------------- state changes
    def _place(self, gkey: bytes, cls: int, hint: int = _N) -> None:
        self._clock += 1
        self._leaves.update(gkey, self._clock, cls * 3 + hint)

    def note_put(self, gkeys: list[bytes]) -> None:
        """Optional hook: one put (or commit) wrote `gkeys`, in chain order (the store calls it
        once per put/commit, after the blocks are inserted). Its last block, if still unused,
        becomes a tail; whether tails go first is the tuner's choice (the tail rule)."""
        if not gkeys:
            return
        tail = gkeys[-1]
        if self._pending is None:
            self._put_tail_shadows(tail)
        elif (self._shadows is not None and self._sampled(tail)) or self._twins is not None:
            self._pending.append((None, tail, 0))
        node = self._leaves.nodes.get(tail)
        if node is not None and node[_SEG] // 3 == _P:
            self._leaves.update(tail, node[_PRIO], _T * 3 + node[_SEG] % 3)

    def _put_tail_shadows(self, tail: bytes) -> None:
        if self._shadows is not None and self._sampled(tail):
            for pol, resident, _ in self._shadows:
                if tail in resident:
                    pol.note_put([tail])
        for pol, resident, _ in self._twins or ():
            if tail in resident:
                pol.note_put([tail])

    def note_retention(self, gkeys: list[bytes], level: str) -> None:
        """Optional hook (Store.retain): the engine's reuse hint. "low" blocks go first and
        "high" ones are kept as protected *when the hinted order is in use*; the hint is
        recorded either way, so the shadows can judge whether following hints pays."""
        hint = _HINT_OF[check_retention(level)]
        if self._pending:
            self.tune()
        if self._shadows is not None and self._twins is None \
                and self.capacity <= self.TWIN_MAX_BLOCKS:
            self._start_twins()
        for pol, resident, _ in (self._twins or ())[1:]:
            mine = [g for g in gkeys if g in resident]
            if mine:
                pol.note_retention(mine, level)
        for g in gkeys:
            node = self._leaves.nodes.get(g)
            if node is not None and node[_SEG] % 3 != hint:
                self._leaves.update(g, node[_PRIO], node[_SEG] - node[_SEG] % 3 + hint)

    # ---------------------------------------------------------------- interface
    def record_miss(self, gkey: bytes) -> None:
        """Nothing to do: a key written again while in the ghost history is protected."""

    def insert(self, gkey: bytes, parent: bytes | None, size: int) -> None:
        # The steps of insert_many for one key, written out: a single insert (put, promotion,
        # the trace replay) should not pay for a batch's setup.
        if self._pending is not None:
            self._defer(gkey, parent)
        else:
            if self._shadows is not None and self._sampled(gkey):
                self._shadow(gkey, parent)
            if self._twins is not None:
                self._twin_access(gkey, parent)
        leaves = self._leaves
        self._clock += 1
        if gkey in leaves.nodes:
            leaves.update(gkey, self._clock, _R * 3 + _N)         # written again: reused
            return
        ghost = self._ghost
        if gkey in ghost:
            del ghost[gkey]
            seg = _R * 3
        else:
            seg = _P * 3
        leaves.add(gkey, parent, self._clock, seg)
        if len(leaves.nodes) > self._peak:
            self._peak = len(leaves.nodes)

    def insert_many(self, items: Iterable[tuple[bytes, bytes | None, int]]) -> None:
        """insert() for each (gkey, parent, size), in order.

        Why a batch call: a store commit publishes many blocks at once, and the per-call work
        (attribute lookups, the shadow and twin checks) is then paid once per batch. Only one
        key in RATE is fed to the shadows, so the sample test runs here, not in a call."""
        shadows, sampled = self._shadows, self._sampled
        leaves, ghost = self._leaves, self._ghost
        nodes = leaves.nodes
        pending = self._pending
        for gkey, parent, _size in items:
            if pending is not None:
                if (shadows is not None and sampled(gkey)) or self._twins is not None:
                    pending.append((gkey, parent, self._hint or max(self._peak, 1)))
            else:
                if shadows is not None and sampled(gkey):
                    self._shadow(gkey, parent)
                if self._twins is not None:   # (not hoisted: a growing tier drops its twins)
                    self._twin_access(gkey, parent)
            self._clock += 1
            if gkey in nodes:
                leaves.update(gkey, self._clock, _R * 3 + _N)     # written again: reused
                continue
            if gkey in ghost:
                del ghost[gkey]
                seg = _R * 3
            else:
                seg = _P * 3
            leaves.add(gkey, parent, self._clock, seg)
            if len(nodes) > self._peak:
                self._peak = len(nodes)
        if pending is not None and len(pending) > self.PENDING_MAX:
            self.tune()

    def touch(self, gkey: bytes) -> None:
        leaves = self._leaves
        if gkey not in leaves.nodes:
            return
        if self._pending is not None:
            self._defer(gkey, None)
        else:
            if self._shadows is not None and self._sampled(gkey):
                self._shadow(gkey, None)
            if self._twins is not None:
                self._twin_access(gkey, None)
        self._clock += 1
        leaves.update(gkey, self._clock, _R * 3 + _N)        # reused: protected, hint spent

    def touch_many(self, gkeys: Iterable[bytes]) -> None:
        """touch() for each key, in order (a read lease's blocks): one call per batch, as
        insert_many."""
        shadows, sampled = self._shadows, self._sampled
        leaves = self._leaves
        nodes = leaves.nodes
        pending = self._pending
        for gkey in gkeys:
            if gkey not in nodes:
                continue
            if pending is not None:
                if (shadows is not None and sampled(gkey)) or self._twins is not None:
                    pending.append((gkey, None, self._hint or max(self._peak, 1)))
            else:
                if shadows is not None and sampled(gkey):
                    self._shadow(gkey, None)
                if self._twins is not None:
                    self._twin_access(gkey, None)
            self._clock += 1
            leaves.update(gkey, self._clock, _R * 3 + _N)   # reused: protected, hint spent
        if pending is not None and len(pending) > self.PENDING_MAX:
            self.tune()

    def _defer(self, gkey: bytes, parent: bytes | None) -> None:
        pending = self._pending
        assert pending is not None
        if (self._shadows is not None and self._sampled(gkey)) or self._twins is not None:
            pending.append((gkey, parent, self._hint or max(self._peak, 1)))
            if len(pending) > self.PENDING_MAX:
                self.tune()

    def remove(self, gkey: bytes) -> None:
        if self._leaves.remove(gkey) is None:
            return
        ghost = self._ghost
        ghost[gkey] = None
        limit = self.GHOST_FACTOR * self.capacity
        while len(ghost) > limit:
            ghost.popitem(last=False)

    def _oldest(self, heaps: tuple[int, ...], can_evict: Callable[[bytes], bool]
                ) -> bytes | None:
        """Least recent evictable leaf among `heaps`. Fast path: the oldest valid heap top
        (stale tops are dropped on the way); only when that one is not evictable (pinned,
        leased) does it search each heap past its unevictable leaves."""
        leaves = self._leaves
        sizes, top = leaves.sizes, leaves.top
        best, best_prio = None, None
        for h in heaps:
            if not sizes[h]:
                continue
            t = top(h)
            if t is not None and (best_prio is None or t[0] < best_prio):
                best_prio, best = t
        if best is None or can_evict(best):
            return best
        return self._oldest_evictable(heaps, can_evict)

    def _oldest_evictable(self, heaps: tuple[int, ...], can_evict: Callable[[bytes], bool]
                          ) -> bytes | None:
        leaves = self._leaves
        best, best_prio = None, None
        for h in heaps:
            if not leaves.sizes[h]:
                continue
            g = leaves.peek(h, can_evict)
            if g is not None:
                prio = leaves.nodes[g][_PRIO]
                if best_prio is None or prio < best_prio:
                    best, best_prio = g, prio
        return best

    def pick(self, can_evict: Callable[[bytes], bool]) -> bytes | None:
        if self._pending:
            self.tune()
        first, prob, prot, both = self._roles
        if first:                         # (empty unless the mode sends tails or hints first)
            victim = self._oldest(first, can_evict)
            if victim is not None:
                return victim
        share = self._mode[0]
        if share is None:
            return self._oldest(both, can_evict)
        sizes = self._leaves.sizes
        in_prot = 0
        for h in prot:
            in_prot += sizes[h]
        if in_prot > share * (self._hint or max(self._peak, 1)) or \
                not any([sizes[h] for h in prob]):
            order = (prot, prob)
        else:
            order = (prob, prot)
        return self._oldest(order[0], can_evict) or self._oldest(order[1], can_evict)

    def snapshot(self) -> bytes:
        if self._pending:
            self.tune()
        nodes = [[k, n[_PARENT], n[_SEG]] for k, n in self._leaves.ordered()]
        return _pack({"kind": self.kind, "nodes": nodes, "peak": self._peak,
                      "ghost": list(self._ghost), "mode": list(self._mode),
                      "scores": [sh[2] for sh in self._shadows or []]}, self.SNAPSHOT_V)

    def restore(self, blob: bytes) -> None:
        state = _unpack(blob, self.kind, self.SNAPSHOT_V)
        rows = self._rows
        if rows is not None:
            rows.on_free.remove(self._leaves._forget)
        deferred = self._pending is not None
        self.__init__(self._hint, shadow=self._shadows is not None, rows=rows)
        if deferred:
            self.defer_tuning()
        for node in state["nodes"]:
            seg = node[2]
            if not isinstance(seg, int) or not 0 <= seg < _HEAPS:
                raise InvalidArgument(f"policy snapshot has an unknown block class {seg!r}")
        if rows is not None:
            # Bulk: parents from the index, keys no longer stored (a snapshot older than a
            # crash) skipped.
            self._clock = self._leaves.load([(n[0], n[2]) for n in state["nodes"]], 1) - 1
        else:
            for gkey, parent, seg in state["nodes"]:
                self._clock += 1
                self._leaves.add(gkey, parent, self._clock, seg)
        self._peak = max(int(state["peak"]), len(self._leaves))
        self._ghost.update((k, None) for k in state["ghost"])
        share, tail, hinted = state["mode"]
        if hinted not in (0, STRICT, SOFT):
            raise InvalidArgument(f"policy snapshot has an unknown hint mode {hinted!r}")
        self._set_mode((None if share is None else float(share), bool(tail), int(hinted)))
        for sh, score in zip(self._shadows or [], state["scores"], strict=False):
            sh[2] = float(score)


_POLICIES: dict[str, Callable[[int | None], Any]] = {
    "lru": LRUPolicy,
    "default": SegmentedPolicy,
    "arc": AdaptivePolicy,
}


def make_policy(name: str, capacity_blocks_hint: int | None = None,
                rows: Rows | None = None) -> EvictionPolicy:
    """A fresh policy by name: "lru", "default" (the tuned segmented policy) or "arc".

    `rows` (the block index): "default" keeps its per-block state in packed arrays keyed by
    index row, for a tier holding millions of blocks; the order is the same either way."""
    factory = _POLICIES.get(name)
    if factory is None:
        raise InvalidArgument(f"unknown eviction policy {name!r}; choose one of "
                              f"{sorted(_POLICIES)}")
    if rows is not None and factory is SegmentedPolicy:
        return SegmentedPolicy(capacity_blocks_hint, rows=rows)
    return factory(capacity_blocks_hint)
