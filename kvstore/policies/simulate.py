"""One access to a miniature segmented policy: the tuner's shadow and twin caches, written out.

SegmentedPolicy chooses its order by running small copies of itself (shadows on a sample of
keys, full-size twins once hints exist) and counting their hits. Those simulated accesses are
most of the policy's CPU time, so `simulate` and `sim_evict` do exactly what insert/touch and
pick/remove would do on such a copy, with the common cases inlined.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from .leaves import _CHILDREN, _LINKED, _PARENT, _PRIO, _SEG
from .segments import _N, _P, _R

if TYPE_CHECKING:
    from .segmented import SegmentedPolicy


def simulate(pol: SegmentedPolicy, resident: set[bytes], gkey: bytes, parent: bytes | None,
              cap: int) -> int:
    """One access to a shadow or twin cache of `cap` blocks: 1 on a hit, else 0 after
    inserting `gkey` and evicting down to `cap` (never `gkey` itself).

    Exactly ``arc._Duel._one(pol, resident, ...)``, with pol.touch / insert / remove and the
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
        sim_evict(pol, resident, gkey, cap)
    return 0


def sim_evict(pol: SegmentedPolicy, resident: set[bytes], gkey: bytes, cap: int) -> None:
    """Evict from a shadow or twin until it holds `cap` blocks: ``pol.pick(lambda g: g !=
    gkey)`` then ``pol.remove(victim)``, repeated, with pick's heap search (``_oldest``) and
    the removal of a leaf inlined; why, see simulate. Rare cases (the oldest leaf is `gkey`
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
