"""`"default"`: segmented LRU over prefix leaves, its order tuned online (docs/eviction.md).

The policy keeps each resident block's class and hint (segments.py); which heaps give up
victims first is a mode, chosen by miniature copies of the policy that see the same accesses
(shadows on a sample of keys, full-size twins once the engine sends hints; their accesses run
in simulate.py). The class docstring says how the choice is made and why.
"""

from __future__ import annotations

import math
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from kvstore_client.common.errors import InvalidArgument
from kvstore_client.common.layout import check_retention

from .base import pack_snapshot, unpack_snapshot
from .evicted_keys import GhostKeys
from .leaves import _PARENT, _PRIO, _SEG, PrefixLeaves
from .packed_leaves import RowLeaves, Rows
from .segments import _HEAPS, _HINT_OF, _N, _P, _R, _T, SOFT, STRICT, roles
from .simulate import simulate


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
    TWIN_START_BLOCKS = 1 << 13           # copied into the twins when they start
    PENDING_MAX = 1 << 14                 # deferred accesses fed inline past this many

    def __init__(self, capacity_blocks_hint: int | None = None, shadow: bool = True,
                 mode: tuple[float | None, bool, int] = (None, False, 0),
                 rows: Rows | None = None) -> None:
        self._hint = capacity_blocks_hint if capacity_blocks_hint and capacity_blocks_hint > 0 \
            else None
        # rows: the block index, for a tier that holds millions of blocks (SSD): the same
        # forest and order in packed arrays keyed by index row (packed_leaves.py).
        self._rows = rows
        self._leaves: Any = RowLeaves(rows, _HEAPS) if rows is not None else PrefixLeaves(_HEAPS)
        self._clock = 0
        self._peak = 0
        # Evicted keys, up to GHOST_FACTOR capacities: as fingerprints for a big tier.
        self._ghost: Any = GhostKeys() if rows is not None else OrderedDict()
        self._mode = mode
        self._roles = roles(mode[1], mode[2])
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
        have; the store feeds them in the background meanwhile (kvstore/upkeep.py)."""
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
            self._roles = roles(mode[1], mode[2])

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
            sh[2] += simulate(sh[0], sh[1], gkey, parent, cap)
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
        hit = (simulate(t0[0], t0[1], gkey, parent, cap),
               simulate(t1[0], t1[1], gkey, parent, cap),
               simulate(t2[0], t2[1], gkey, parent, cap))
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
        """First hint: the twins start as copies of the cache's newest TWIN_START_BLOCKS in LRU
        order, so they differ only by what the hints do from now on.

        Why not the whole cache: the first Retain runs this under the store lock, and copying
        120k blocks into three twins held it 2.3 s, stalling every other tenant. The twins are
        compared with each other (paired), so starting all three from the same newest part
        keeps the comparison fair; they fill up with the accesses that follow."""
        self._twins = []
        start = self._leaves.ordered()[-self.TWIN_START_BLOCKS:]
        for hinted in (0, STRICT, SOFT):
            pol = SegmentedPolicy(self.capacity, shadow=False, mode=self._mode[:2] + (hinted,))
            for gkey, node in start:
                pol.insert(gkey, node[_PARENT], 1)
            self._twins.append([pol, {gkey for gkey, _ in start}, 0.0])
        self._twin_n = 0
        self._disc = [[0.0] * 3 for _ in range(3)]

    # ---------------------------------------------------------------- state changes
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
        return pack_snapshot({"kind": self.kind, "nodes": nodes, "peak": self._peak,
                      "ghost": list(self._ghost), "mode": list(self._mode),
                      "scores": [sh[2] for sh in self._shadows or []]}, self.SNAPSHOT_V)

    def restore(self, blob: bytes) -> None:
        state = unpack_snapshot(blob, self.kind, self.SNAPSHOT_V)
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

