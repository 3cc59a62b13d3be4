"""How far a run of alike queued changes goes, found by loops that run in C.

Why: the publisher shares the GIL with the store's requests, and a commit of N blocks queues N
changes (its deletion N more). Looking at each in Python cost about a microsecond a change;
these compare a whole stretch at once with map/zip over the item lists, so the Python work
is per run, not per change. Each answers "how many of items[j:] are like items[j]", so the
caller handles them exactly as it would have one at a time.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from itertools import repeat

_FUNC, _ARGS = operator.attrgetter("func"), operator.attrgetter("args")    # of a LazyText

_FIRST_WINDOW = 16          # items compared at first; the window grows while all match
_MAX_WINDOW = 4096


def _leading(flags: Iterable[bool], n: int) -> int:
    """How many of the first flags are true (n: how many there are)."""
    got = list(flags)
    try:
        return got.index(False)
    except ValueError:
        return n


def _grow(match, j: int, end: int) -> int:
    """How many items from j on match (match(a, b): how many of [a, b) from a do), comparing
    in windows that start small: a short run costs a short look, a long one few calls."""
    k, w = 0, _FIRST_WINDOW
    while j + k < end:
        a = j + k
        b = min(end, a + w)
        got = match(a, b)
        k += got
        if got < b - a:
            break
        w = min(w * 4, _MAX_WINDOW)
    return k


def chain_span(texts: list, tiers: list, j: int, end: int) -> int:
    """How many items from j continue texts[j]'s chain: each the next block of the same
    commit (a LazyText of the same bound `text`, index one more), entering the same tier."""
    first = texts[j]
    func, i0, tier = first.func, first.args[0], tiers[j]
    kind = type(first)

    def match(a: int, b: int) -> int:
        sl, start, m = texts[a:b], i0 + (a - j), b - a
        # Whole windows by counts and list equality (no call per item: most windows match);
        # the exact prefix only in the window where the run ends.
        if (list(map(type, sl)).count(kind) == m and list(map(_FUNC, sl)).count(func) == m
                and list(map(_ARGS, sl)) == list(zip(range(start, start + m)))
                and tiers[a:b].count(tier) == m):
            return m
        return _leading(map(all, zip(
            map(operator.is_, map(getattr, sl, repeat("func"), repeat(None)), repeat(func)),
            map(operator.eq, map(getattr, sl, repeat("args"), repeat(None)),
                zip(range(start, start + m))),
            map(operator.eq, tiers[a:b], repeat(tier)), strict=True)), m)

    return _grow(match, j, end)


def removal_span(gkeys: list[bytes], tiers: list, texts: list, entered: list, j: int,
                 end: int) -> int:
    """How many items from j are removals like items[j]: no text, not entering, the same
    tiers, a key of the same namespace (its first 16 bytes)."""
    ns_id, tier = gkeys[j][:16], tiers[j]

    def match(a: int, b: int) -> int:
        m = b - a
        if (texts[a:b].count(None) == m and entered[a:b].count(False) == m
                and tiers[a:b].count(tier) == m
                and list(map(bytes.startswith, gkeys[a:b], repeat(ns_id))).count(True) == m):
            return m
        return _leading(map(all, zip(
            map(operator.is_, texts[a:b], repeat(None)),
            map(operator.not_, entered[a:b]),
            map(operator.eq, tiers[a:b], repeat(tier)),
            map(bytes.startswith, gkeys[a:b], repeat(ns_id)), strict=True)), m)

    return _grow(match, j, end)
