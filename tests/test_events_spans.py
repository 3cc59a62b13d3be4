"""spans.py: the runs of alike queued changes it measures in C are the runs a look at each
change in turn finds, on random queues of commits' blocks, removals and other changes."""

from __future__ import annotations

import numpy as np

from kvstore.entry import GPU, HOST, SSD
from kvstore.events.spans import chain_span, removal_span
from kvstore.events.texts import BlockText, LazyText, LazyTexts


def _chain_each(texts: list, tiers: list, j: int, n: int) -> int:
    first, k = texts[j], 1
    while (j + k < n and type(texts[j + k]) is LazyText
           and texts[j + k].func is first.func
           and texts[j + k].args[0] == first.args[0] + k and tiers[j + k] == tiers[j]):
        k += 1
    return k


def _removal_each(gkeys: list, tiers: list, texts: list, entered: list, j: int, n: int) -> int:
    k = 1
    while (j + k < n and texts[j + k] is None and not entered[j + k]
           and tiers[j + k] == tiers[j] and gkeys[j + k][:16] == gkeys[j][:16]):
        k += 1
    return k


def _random_queue(rng: np.random.Generator) -> list[tuple]:
    """Items as the recorder queues them: runs of a commit's blocks entering a tier (some
    with a block missing, some split), removals of one or two namespaces, other changes."""
    namespaces = [bytes([i]) * 16 for i in range(2)]
    items: list[tuple] = []
    for _ in range(int(rng.integers(1, 12))):
        ns = namespaces[int(rng.integers(2))]
        tier = (GPU, HOST, SSD)[int(rng.integers(3))]
        n = int(rng.integers(1, 300))
        keys = [rng.bytes(8) for _ in range(n)]
        what = int(rng.integers(4))
        if what == 0:                                   # a commit's blocks
            owner = LazyTexts(ns, keys, None, b"\0" * 4 * n, 1)
            book: dict = {}
            owner.keep(book, ns, keys)
            for k in keys:
                if rng.random() < 0.02:
                    continue                            # a block already held: not queued
                t = rng.random()
                tiers = (tier,) if t < 0.97 else (HOST if tier != HOST else GPU,)
                items.append((ns + k, tiers, True, False, book[ns + k]))
        elif what == 1:                                 # removals
            for k in keys:
                t = rng.random()
                g = (ns if t < 0.98 else namespaces[1 - namespaces.index(ns)]) + k
                tiers = (tier,) if t < 0.95 or t >= 0.98 else (GPU, HOST)
                items.append((g, tiers, rng.random() < 0.01, True, None))
        elif what == 2:                                 # a block with its own text
            text = BlockText((1,), None, b"\x91\x01", 1)
            items.append((ns + keys[0], (tier,), True, False, text))
        else:                                           # blocks whose text is not known
            items.extend((ns + k, (tier,), True, False, None) for k in keys[:3])
    return items


def test_spans_match_a_look_at_each_change():
    rng = np.random.default_rng(26)
    for _ in range(150):
        items = _random_queue(rng)
        n = len(items)
        gkeys = [it[0] for it in items]
        tiers = [it[1] for it in items]
        entered = [it[2] for it in items]
        texts = [it[4] for it in items]
        for j in sorted(set(rng.integers(0, n, 40).tolist()) | {0}):
            if type(texts[j]) is LazyText:
                assert chain_span(texts, tiers, j, n) == _chain_each(texts, tiers, j, n)
            elif texts[j] is None and not entered[j]:
                assert (removal_span(gkeys, tiers, texts, entered, j, n)
                        == _removal_each(gkeys, tiers, texts, entered, j, n))
