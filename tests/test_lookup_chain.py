"""Lookup by child links (BlockIndex.peek_run, kvstore/index.py).

What must hold: peek_run answers exactly what a dict probe per key answers (same Entry
objects, same tier flags, stopping at the same key) for any history of adds, re-adds,
discards with row reuse, late parents, hot and packed blocks; a chain indexed in order is
walked by its links, not by a probe per key; and the link bits never disturb the flags they
share a byte with (tier flags, remote count, restart).
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import index as index_mod
from kvstore.index import NS_ID_BYTES, BlockIndex, Entry

from .store_helpers import kv_block, make_store, namespace

NS = bytes(range(NS_ID_BYTES))
NS2 = bytes(reversed(range(NS_ID_BYTES)))


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


class CountingDict(dict):
    """The index's own key -> row dict, counting the probes lookups make."""

    gets = 0

    def get(self, *a):  # noqa: ANN002, ANN201 - dict.get's own signature
        CountingDict.gets += 1
        return super().get(*a)


def expected(ix: BlockIndex, ns: bytes, keys: list[bytes]) -> list:
    out = []
    for k in keys:
        e = ix.peek(ns + k)
        if e is None:
            break
        out.append(e)
    return out


def check_flags(ix: BlockIndex) -> None:
    """The _HOT bit marks exactly the rows with an Entry; remote_count counts what entries say."""
    hot_rows = {e.row for e in ix.hot_entries()}
    for r, g in enumerate(ix._keys):
        if g is not None:
            assert bool(ix._flags[r] & index_mod._HOT) == (r in hot_rows), r
    assert ix.remote_count() == sum(bool(e.remote) for e in ix.entries())


def test_a_prompt_is_found_with_one_dict_probe():
    """Child links (also when two prompts indexed turn about interleave their rows) and
    consecutive rows (a block without a parent after the one before) find a prompt's keys
    with one probe."""
    ix = BlockIndex()
    for i in range(200):
        ix.add_cold(NS, key(i), key(i - 1) if i % 50 else None, 10, i, ssd=True)
    for i in range(1000, 1040):         # two chains, rows interleaved
        ix.add_cold(NS, key(i), key(i - 1) if i > 1000 else None, 10, i, remote=True)
        ix.add_cold(NS, key(i + 5000), key(i + 4999) if i > 1000 else None, 10, i, ssd=True)
    ix._rows = CountingDict(ix._rows)
    for keys, n in (([key(i) for i in range(10, 26)], 16),
                    ([key(i) for i in range(45, 61)], 16),      # crosses a chain start
                    ([key(i) for i in range(190, 206)], 10),    # runs off the end
                    ([key(i) for i in range(1000, 1030)], 30),
                    ([key(i) for i in range(6000, 6030)], 30),
                    ([key(i) for i in range(1005, 1010)] + [key(999_999)], 5)):
        CountingDict.gets = 0
        got = ix.peek_run(NS, keys)
        assert len(got) == n
        assert CountingDict.gets == 1 + (n < len(keys))     # a miss asks the dict once
        assert got == expected(ix, NS, keys)
    CountingDict.gets = 0
    assert ix.peek_run(NS2, [key(i) for i in range(10, 26)]) == []
    assert CountingDict.gets == 1


def test_links_survive_restart_load_and_do_not_leak_into_flags():
    items = []
    for i in range(300):
        parent = NS + key(i - 1) if i % 40 else None
        items.append((NS + key(i), parent, 10 + i, i))
    ix = BlockIndex()
    ix.load_ssd(items)
    ix._rows = CountingDict(ix._rows)
    CountingDict.gets = 0
    got = ix.peek_run(NS, [key(i) for i in range(1, 17)])
    assert CountingDict.gets == 1 and len(got) == 16
    assert all(e.ssd and not e.remote for e in got)
    assert [e.size for e in ix.entries()] == [10 + i for i in range(300)]
    check_flags(ix)


def test_stale_links_after_row_reuse_fall_back_to_the_dict():
    ix = BlockIndex()
    for i in range(32):
        ix.add_cold(NS, key(i), key(i - 1) if i else None, 10, i, ssd=True)
    for i in range(31, 4, -1):          # leaves first, as eviction frees them
        ix.discard(NS + key(i))
    # A different chain takes the freed rows: key(4)'s link now points at a row holding
    # another key, which must not be mistaken for key(5).
    for i in range(100, 127):
        ix.add_cold(NS, key(i), key(i - 1) if i > 100 else None, 20, i, remote=True)
    assert len(ix.peek_run(NS, [key(i) for i in range(0, 8)])) == 5
    got = ix.peek_run(NS, [key(i) for i in range(100, 127)])
    assert len(got) == 27 and all(e.remote and not e.ssd for e in got)
    # Re-adding key 5 under key 4 links it again.
    ix.add_cold(NS, key(5), key(4), 10, 5, ssd=True)
    assert len(ix.peek_run(NS, [key(i) for i in range(0, 8)])) == 6
    check_flags(ix)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_peek_run_answers_like_a_probe_per_key(seed):
    rng = random.Random(seed)
    index_mod_sweep = index_mod._SWEEP_MIN
    index_mod._SWEEP_MIN = 8                # sweeps (packing) happen often
    try:
        ix = BlockIndex()
        held: list[Entry] = []
        n = 0
        for _ in range(400):
            op = rng.random()
            ns = NS if rng.random() < 0.8 else NS2
            if op < 0.35:                   # a chain, in order, maybe off an existing block
                start = rng.randrange(n + 1)
                parent = key(rng.randrange(n)) if n and rng.random() < 0.5 else None
                for i in range(rng.randrange(1, 12)):
                    k = key(start + i + 1000 * rng.randrange(3))
                    if rng.random() < 0.5:
                        ix.add_cold(ns, k, parent, 10, 1, ssd=rng.random() < 0.8,
                                    remote=rng.random() < 0.3)
                    else:
                        e = Entry(ns, k, parent, 10, 1, ssd=rng.random() < 0.5,
                                  remote=rng.random() < 0.3)
                        if rng.random() < 0.5:
                            e.host = 0
                        ix.add(e)
                        if rng.random() < 0.3:
                            held.append(e)
                    parent = k
                    n = max(n, start + i + 1)
            elif op < 0.55 and n:           # discard a few (rows go back to the free list)
                for _ in range(rng.randrange(1, 6)):
                    ix.discard(ns + key(rng.randrange(n)))
            elif op < 0.7 and n:            # take an Entry (hot) and change its flags
                e = ix.get(ns + key(rng.randrange(n)))
                if e is not None:
                    e.remote = rng.random() < 0.5
                    e.ssd = rng.random() < 0.5
                    if rng.random() < 0.5:
                        held.append(e)
            elif op < 0.8 and n:            # a parent learned late
                e = ix.get(ns + key(rng.randrange(n)))
                if e is not None:
                    ix.set_parent(e, key(rng.randrange(n)))
            elif op < 0.85:
                if held:
                    held.pop(rng.randrange(len(held)))
                ix.compact()
            if n:
                a = rng.randrange(n)
                keys = [key(i + 1000 * rng.randrange(3)) for i in range(a, a + 20)]
                for ns_ in (NS, NS2):
                    got = ix.peek_run(ns_, keys)
                    want = expected(ix, ns_, keys)
                    assert len(got) == len(want)
                    assert all(x is y for x, y in zip(got, want, strict=True))
        check_flags(ix)
    finally:
        index_mod._SWEEP_MIN = index_mod_sweep


def test_store_lookup_after_restart_and_row_reuse(tmp_path):
    """Store.lookup over packed SSD blocks after a restart (bulk load), and after part of a
    prompt was deleted and its rows reused by another prompt; bytes stay exact."""
    a = [bytes([1]) + i.to_bytes(15, "big") for i in range(24)]
    b = [bytes([2]) + i.to_bytes(15, "big") for i in range(24)]
    s = make_store(tmp_path)
    try:
        ns = namespace(s)
        s.put(ns, a, [kv_block(k) for k in a])
        s.evict("host")
        assert s.lookup(ns, a).per_tier["ssd"] == 24
    finally:
        s.close()
    s = make_store(tmp_path)
    try:
        ns = namespace(s)
        assert s.index.hot_count == 0
        assert s.lookup(ns, a).prefix_blocks == 24
        assert s.delete(ns, a[12:]) == 12
        s.put(ns, b, [kv_block(k) for k in b])
        assert s.lookup(ns, a).prefix_blocks == 12
        assert s.lookup(ns, b).prefix_blocks == 24
        # a lookup answers which keys are cached in turn, whatever their parents
        assert s.lookup(ns, a[:12] + b).prefix_blocks == 36
        assert s.get(ns, a + b) == [(k, kv_block(k)) for k in a[:12]]
        assert s.get(ns, b) == [(k, kv_block(k)) for k in b]
    finally:
        s.close(flush=False)


def test_a_hot_mark_without_an_entry_reads_as_packed():
    """Flags loaded back from a saved image may carry a _HOT mark from the process that saved
    them; with no Entry behind it the row's packed tier flags answer."""
    ix = BlockIndex()
    for i in range(4):
        ix.add_cold(NS, key(i), key(i - 1) if i else None, 10, i, ssd=True, remote=i == 2)
    for r in range(4):
        ix._flags[r] |= index_mod._HOT
    got = ix.peek_run(NS, [key(i) for i in range(4)])
    assert [(e.ssd, e.remote, e.host) for e in got] == [(True, i == 2, None) for i in range(4)]
    assert ix.peek(NS + key(2)).remote
