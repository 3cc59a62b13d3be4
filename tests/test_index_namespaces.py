"""A namespace's walk in the block index (kvstore/index.py: namespace_keys,
namespace_residency) reaches its own rows only, and its SSD and remote totals (tier_usage)
match its blocks, both exact through inserts, frees, tier flips, sweeps, bulk loads and an
index image round trip.

Why: Stats, quota checks and Delete-all walk one tenant's namespaces under the store lock; a
walk that scanned every row made one tenant's call cost every other tenant's blocks
(docs/security.md), and the SSD/remote quota check, once per demotion batch, must not walk
even the tenant's own blocks. The checks are structural (which rows are read, what the
totals equal), not timed.
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
    _check_totals(ix, list(model) + ix._ns_ids + [GONE])


def _walked(ix: BlockIndex, ns: bytes) -> dict[str, tuple[int, int]]:
    """(blocks, bytes) per lower tier, recounted from a walk of the namespace's blocks."""
    out = {"ssd": [0, 0], "remote": [0, 0]}
    for _, ssd, remote, size in ix.namespace_residency(ns):
        for tier, on in (("ssd", ssd), ("remote", remote)):
            if on:
                out[tier][0] += 1
                out[tier][1] += size
    return {t: tuple(v) for t, v in out.items()}


def _check_totals(ix: BlockIndex, namespaces: list[bytes]) -> None:
    """Every namespace's running totals equal a walk of its blocks."""
    for ns in namespaces:
        assert {t: ix.tier_usage(ns, t) for t in ("ssd", "remote")} == _walked(ix, ns), ns
        assert ix.host_blocks(ns) == sum(h for h, _, _, _ in ix.namespace_residency(ns)), ns
    assert len(ix._tier_sums) == 4 * len(ix._ns_ids) and len(ix._host_n) == len(ix._ns_ids)


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


def _model_usage(blocks: dict[bytes, tuple[int, bool, bool]]) -> dict[str, tuple[int, int]]:
    """(blocks, bytes) per lower tier of a model namespace: key -> (size, ssd, remote)."""
    return {tier: (sum(1 for v in blocks.values() if v[i]),
                   sum(v[0] for v in blocks.values() if v[i]))
            for tier, i in (("ssd", 1), ("remote", 2))}


def _check_model(ix: BlockIndex, model: dict[bytes, dict[bytes, tuple[int, bool, bool]]]
                 ) -> None:
    """Totals equal the model's and a walk's, and each block's fields the model's."""
    _check(ix, {ns: set(blocks) for ns, blocks in model.items()})
    for ns, blocks in model.items():
        assert {t: ix.tier_usage(ns, t) for t in ("ssd", "remote")} == _model_usage(blocks)
        for k, (size, ssd, remote) in blocks.items():
            e = ix.read(ns + k)
            assert (e.size, e.ssd, e.remote) == (size, ssd, remote)


def test_tier_totals_stay_exact_through_every_change(monkeypatch):
    """A random run of every operation that changes whether a block is indexed or on SSD or
    remote, checked against a model after each step; then an image round trip and a bulk
    load rebuild the same totals."""
    monkeypatch.setattr(index_mod, "_SWEEP_MIN", 16)
    rng = random.Random(11)
    ix = BlockIndex()
    model: dict[bytes, dict[bytes, tuple[int, bool, bool]]] = {BIG: {}, SMALL_NS: {}}
    held: list[Entry] = []              # entries a mover holds across sweeps
    for step in range(4000):
        ns = BIG if rng.random() < 0.7 else SMALL_NS
        k = key(rng.randrange(300))
        size = rng.randrange(1, 1 << 20)
        ssd, remote = rng.random() < 0.6, rng.random() < 0.3
        op = rng.randrange(10)
        if op == 0 and k in model[ns]:
            ix.discard(ns + k)
            del model[ns][k]
        elif op == 1:
            ix.add(Entry(ns, k, None, size, step, ssd=ssd, remote=remote))
            model[ns][k] = (size, ssd, remote)
        elif op == 2:
            ix.add_cold(ns, k, None, size, step, ssd=ssd, remote=remote)
            model[ns][k] = (size, ssd, remote)
        elif op == 3:                   # a commit's batch: new blocks, a host copy each
            batch = [Entry(ns, key(1000 + step * 4 + i), None, size + i, step, ssd=ssd,
                           remote=remote) for i in range(rng.randrange(1, 4))]
            ix.add_host_many(batch, [4096 * i for i in range(len(batch))])
            for e in batch:
                model[ns][e.key] = (e.size, ssd, remote)
        elif op in (4, 5) and model[ns]:    # a demotion, promotion or eviction flips a tier
            k = rng.choice(sorted(model[ns]))
            e = ix.get(ns + k)
            on = rng.random() < 0.5
            (ix.set_ssd if op == 4 else ix.set_remote)(e, on)
            sz, s, r = model[ns][k]
            model[ns][k] = (sz, on, r) if op == 4 else (sz, s, on)
            if rng.random() < 0.3:
                held.append(e)
            del e
        elif op == 6 and held:          # a mover's entry, discarded meanwhile: flips count 0
            e = held.pop(rng.randrange(len(held)))
            if ix.get(e.gkey) is e:
                ix.discard(e.gkey)
                del model[e.ns_id][e.key]
            ix.set_ssd(e, not e.ssd)
            ix.set_remote(e, not e.remote)
            if e.row < 0:               # (detached: its host copy counts nowhere either)
                ix.set_host(e, 4096) if e.host is None else ix.clear_host(e)
            del e
        elif op == 7:
            if rng.random() < 0.5:
                held.clear()
            ix.compact()
        elif op == 8 and model[ns]:     # hot again from its packed row, then let go
            ix.get(ns + rng.choice(sorted(model[ns])))
        elif op == 9 and model[ns]:     # a promotion gives a host copy, an eviction takes it
            e = ix.get(ns + rng.choice(sorted(model[ns])))
            ix.set_host(e, 4096 * step) if e.host is None else ix.clear_host(e)
            del e
        if step % 50 == 0 or op in (0, 6, 7):
            _check_model(ix, model)
        else:
            _check_totals(ix, [ns])
    _check_model(ix, model)
    held.clear()
    ix.compact()
    _check_model(ix, model)
    assert ix.hot_count < len(ix)       # the run packed and unpacked rows

    # The image keeps SSD blocks only, without their remote bit; the loaded totals are rebuilt.
    kept = warm_image._kept_rows(ix, {BIG, SMALL_NS})
    loaded = BlockIndex()
    warm_image.load_index(loaded, warm_image._dump_index(ix, kept))
    on_ssd = {ns: {k: (v[0], True, False) for k, v in blocks.items() if v[1]}
              for ns, blocks in model.items()}
    _check_model(loaded, on_ssd)
    k = sorted(on_ssd[BIG])[0]
    loaded.set_remote(loaded.get(BIG + k))      # a loaded index keeps counting from there
    on_ssd[BIG][k] = (on_ssd[BIG][k][0], True, True)
    loaded.add_cold(SMALL_NS, key(5000), None, 7, 0, ssd=True)
    on_ssd[SMALL_NS][key(5000)] = (7, True, False)
    _check_model(loaded, on_ssd)

    bulk = BlockIndex()
    items = [(ns + k, None, v[0], 0) for ns, blocks in model.items() for k, v in blocks.items()]
    bulk.load_ssd(items)
    every = {ns: {k: (v[0], True, False) for k, v in blocks.items()}
             for ns, blocks in model.items()}
    _check_model(bulk, every)
    for ns, blocks in every.items():    # evicted from SSD one by one, down to nothing
        for k in sorted(blocks):
            e = bulk.get(ns + k)
            bulk.set_ssd(e, False)
            assert bulk.drop_if_gone(e)
        assert bulk.tier_usage(ns, "ssd") == (0, 0)
    _check_totals(bulk, [BIG, SMALL_NS])


def test_load_ssd_with_repeated_keys_counts_each_block_once():
    ix = BlockIndex()
    ix.load_ssd([(BIG + key(1), None, 10, 0), (BIG + key(2), None, 20, 0),
                 (BIG + key(1), None, 30, 0)])
    assert ix.tier_usage(BIG, "ssd") == (2, 50) and ix.tier_usage(BIG, "remote") == (0, 0)
    _check_totals(ix, [BIG])
