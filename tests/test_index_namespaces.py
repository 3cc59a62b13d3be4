"""A namespace's walk in the block index (kvstore/index.py: namespace_keys,
namespace_residency) reaches its own rows only, and stays exact through inserts, frees,
sweeps, bulk loads and an index image round trip.

Why: Stats, quota checks and Delete-all walk one tenant's namespaces under the store lock; a
walk that scanned every row made one tenant's call cost every other tenant's blocks
(docs/security.md). The check is structural (which rows are read), not timed.
"""

from __future__ import annotations

import random

import pytest

from kvstore import index as index_mod
from kvstore import warm_image
from kvstore.index import NS_ID_BYTES, BlockIndex, Entry

BIG, SMALL_NS, GONE = (bytes([b]) * NS_ID_BYTES for b in (1, 2, 3))


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


class _Rows(list):
    """The index's row -> key list, refusing a walk over every row and counting reads."""

    reads = 0

    def __iter__(self):
        raise AssertionError("a namespace walk iterated every row of the index")

    def __getitem__(self, i):
        _Rows.reads += 1
        return super().__getitem__(i)


def _check(ix: BlockIndex, model: dict[bytes, set[bytes]]) -> None:
    """namespace_keys and namespace_residency give exactly each namespace's blocks, and the
    per-namespace row lists agree with the rows."""
    for ns, keys in model.items():
        assert sorted(ix.namespace_keys(ns)) == sorted(ns + k for k in keys)
        sizes = sorted(size for _, _, _, size in ix.namespace_residency(ns))
        assert sizes == sorted(ix.read(ns + k).size for k in keys)
    for n, own in enumerate(ix._ns_rows):
        for i, r in enumerate(own):
            assert ix._ns_pos[r] == i and ix._ns[r] == n and ix._keys[r] is not None
    assert sum(len(own) for own in ix._ns_rows) == len(ix)


def test_a_namespace_walk_reads_only_its_own_rows():
    ix = BlockIndex()
    for i in range(2000):
        ix.add_cold(BIG, key(i), None, 10, i, ssd=True)
    for i in range(3):
        ix.add_cold(SMALL_NS, key(i), None, 20, i, ssd=True)
    ix._keys = _Rows(ix._keys)
    _Rows.reads = 0
    assert sorted(ix.namespace_keys(SMALL_NS)) == [SMALL_NS + key(i) for i in range(3)]
    assert ix.namespace_keys(GONE) == []
    assert [size for *_, size in ix.namespace_residency(SMALL_NS)] == [20, 20, 20]
    assert _Rows.reads == 3             # its own keys; packed rows need no key in residency


def test_namespace_rows_stay_exact_through_changes_sweeps_and_reloads(monkeypatch):
    monkeypatch.setattr(index_mod, "_SWEEP_MIN", 16)
    rng = random.Random(7)
    ix = BlockIndex()
    model: dict[bytes, set[bytes]] = {BIG: set(), SMALL_NS: set()}
    for step in range(3000):
        ns = BIG if rng.random() < 0.8 else SMALL_NS
        k = key(rng.randrange(400))
        if k in model[ns] and rng.random() < 0.4:
            ix.discard(ns + k)
            model[ns].discard(k)
        elif rng.random() < 0.5:
            ix.add(Entry(ns, k, None, 100 + step, step, ssd=True))   # hot, replaces any
            model[ns].add(k)
        else:
            ix.add_cold(ns, k, None, 100 + step, step, ssd=rng.random() < 0.9, remote=True)
            model[ns].add(k)
    _check(ix, model)
    ix.compact()
    _check(ix, model)
    held = [ix.get(BIG + k) for k in sorted(model[BIG])[:50]]    # hot again, then walked
    _check(ix, model)
    del held

    # An index image keeps the SSD blocks only: the rows of the others are free there.
    kept = warm_image._kept_rows(ix, {BIG, SMALL_NS})
    on_ssd = {ns: {k for k in keys if ix.read(ns + k).ssd} for ns, keys in model.items()}
    assert on_ssd != model              # some free rows in the image: its sparse path
    loaded = BlockIndex()
    warm_image.load_index(loaded, warm_image._dump_index(ix, kept))
    _check(loaded, on_ssd)
    for i in range(5):                  # reuses the image's free rows
        loaded.add_cold(SMALL_NS, key(1000 + i), None, 1, i, ssd=True)
        on_ssd[SMALL_NS].add(key(1000 + i))
    _check(loaded, on_ssd)

    bulk = BlockIndex()
    bulk.load_ssd([(ns + k, None, 100, 0) for ns, keys in model.items() for k in sorted(keys)])
    _check(bulk, model)


@pytest.mark.parametrize("order", ["first", "last", "middle"])
def test_freeing_any_row_of_a_namespace_keeps_the_others(order):
    ix = BlockIndex()
    for i in range(5):
        ix.add_cold(SMALL_NS, key(i), None, 1, i, ssd=True)
        ix.add_cold(BIG, key(i), None, 1, i, ssd=True)
    gone = {"first": 0, "last": 4, "middle": 2}[order]
    ix.discard(SMALL_NS + key(gone))
    _check(ix, {SMALL_NS: {key(i) for i in range(5) if i != gone},
                BIG: {key(i) for i in range(5)}})
