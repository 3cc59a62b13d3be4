"""The ghost history of a large tier's policy: evicted keys, oldest first, as 32-bit fingerprints.

Why: SegmentedPolicy remembers up to twice its capacity of evicted keys (a key written again
while remembered is protected). For an SSD tier of a million blocks an OrderedDict of keys is
two million key objects and linked dict entries, ~360 bytes per *resident* block, more than
the packed index itself. This keeps the same FIFO-set behaviour in ~20 bytes per remembered
key: an open-addressing table of fingerprints (linear probing, backward-shift deletion) and a
ring of fingerprints in arrival order. Two keys with the same fingerprint count as one (about
one remembered key in two billion): a ghost hit only decides whether a block starts protected,
never which bytes are served. Fingerprints are xxh3 of the key, so a snapshot of them means
the same after a restart.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator

import xxhash

_MIN_SLOTS = 1024
_POS_MASK = 0xFFFFFFFF          # positions mod 2**32: a ring never spans that many entries


def fingerprint(gkey: bytes | int) -> int:
    """The 32-bit non-zero fingerprint of a key (an int is taken as one already)."""
    fp = gkey if isinstance(gkey, int) else xxhash.xxh3_64_intdigest(gkey)
    return (fp & 0xFFFFFFFF) or 1


class GhostKeys:
    """The subset of OrderedDict[bytes, None] that SegmentedPolicy uses for its ghost."""

    RING_SLACK = 4096           # ring entries of forgotten keys tolerated before compaction

    def __init__(self) -> None:
        self._fp = array("I", bytes(4 * _MIN_SLOTS))    # 0: empty slot
        self._pos = array("I", bytes(4 * _MIN_SLOTS))   # ring position of the slot's key, mod 2**32
        self._n = 0
        self._ring = array("I")
        self._base = 0                                   # ring position of _ring[0]
        self._head = 0

    def __len__(self) -> int:
        return self._n

    def _find(self, fp: int) -> int:
        slots = self._fp
        mask = len(slots) - 1
        i = fp & mask
        while (v := slots[i]) != 0:
            if v == fp:
                return i
            i = (i + 1) & mask
        return -1

    def __contains__(self, gkey: bytes | int) -> bool:
        return self._find(fingerprint(gkey)) >= 0

    def __setitem__(self, gkey: bytes | int, _value: None) -> None:
        """Remember `gkey` as the newest entry (kept where it is if remembered already)."""
        fp = fingerprint(gkey)
        if self._find(fp) >= 0:
            return
        if 2 * (self._n + 1) > len(self._fp):
            self._resize(2 * len(self._fp))
        self._insert(fp, self._base + len(self._ring))
        self._ring.append(fp)
        self._n += 1
        if len(self._ring) - self._head > 2 * self._n + self.RING_SLACK:
            self._compact_ring()

    def _insert(self, fp: int, pos: int) -> None:
        slots = self._fp
        mask = len(slots) - 1
        i = fp & mask
        while slots[i]:
            i = (i + 1) & mask
        slots[i] = fp
        self._pos[i] = pos & _POS_MASK

    def __delitem__(self, gkey: bytes | int) -> None:
        i = self._find(fingerprint(gkey))
        if i < 0:
            raise KeyError(gkey)
        self._remove_slot(i)

    def pop(self, gkey: bytes | int, default: None = None) -> None:
        i = self._find(fingerprint(gkey))
        if i >= 0:
            self._remove_slot(i)
        return default

    def _remove_slot(self, i: int) -> None:
        """Backward-shift deletion: later keys of the probe run move up, so no tombstones."""
        slots, pos = self._fp, self._pos
        mask = len(slots) - 1
        j = i
        while True:
            slots[i] = 0
            while True:
                j = (j + 1) & mask
                v = slots[j]
                if v == 0:
                    self._n -= 1
                    return
                home = v & mask
                # j's key may fill the hole at i unless its home lies cyclically in (i, j]
                if (home <= j and (i < home or i >= j)) or (home > j and i < home and i >= j):
                    continue
                break
            slots[i] = v
            pos[i] = pos[j]
            i = j

    def popitem(self, last: bool = False) -> tuple[int, None]:
        """Forget the oldest entry; returns (its fingerprint, None)."""
        assert not last, "only the oldest entry is ever dropped"
        ring = self._ring
        while self._head < len(ring):
            fp = ring[self._head]
            p = (self._base + self._head) & _POS_MASK
            self._head += 1
            i = self._find(fp)
            if i >= 0 and self._pos[i] == p:
                self._remove_slot(i)
                if self._head > self.RING_SLACK and 2 * self._head > len(ring):
                    del ring[:self._head]
                    self._base += self._head
                    self._head = 0
                return fp, None
        raise KeyError("popitem(): ghost is empty")

    def __iter__(self) -> Iterator[int]:
        """Remembered fingerprints, oldest first."""
        for k in range(self._head, len(self._ring)):
            fp = self._ring[k]
            i = self._find(fp)
            if i >= 0 and self._pos[i] == (self._base + k) & _POS_MASK:
                yield fp

    def update(self, items: Iterable[tuple[bytes | int, None]]) -> None:
        for k, _ in items:
            self[k] = None

    def _resize(self, slots: int) -> None:
        old_fp, old_pos = self._fp, self._pos
        self._fp = array("I", bytes(4 * slots))
        self._pos = array("I", bytes(4 * slots))
        for i, fp in enumerate(old_fp):
            if fp:
                self._insert(fp, old_pos[i])

    def _compact_ring(self) -> None:
        """Drop ring entries of keys forgotten out of order (re-admitted blocks)."""
        live = list(self)
        self._base += len(self._ring)         # fresh positions, beyond every old one
        self._ring = array("I", live)
        self._head = 0
        self._fp = array("I", bytes(4 * len(self._fp)))
        self._pos = array("I", bytes(4 * len(self._pos)))
        for k, fp in enumerate(live):
            self._insert(fp, self._base + k)
