"""The packed block index (kvstore/index.py) and the row-keyed policy state
(kvstore/policies/packed_leaves.py).

What must hold: an Entry anyone holds keeps its identity and its changes while the index packs
the rest; a packed block comes back with exactly the fields it had; rows are reused only after
the policy forgot them; and the SSD policy over rows picks exactly the victims the
object-per-block policy picks, for any sequence of operations.
"""

from __future__ import annotations

import gc
import random
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import index as index_mod
from kvstore.index import NS_ID_BYTES, BlockIndex, Entry
from kvstore.policies import SegmentedPolicy, make_policy
from kvstore.policies.base import unpack_snapshot as _unpack
from kvstore.policies.evicted_keys import GhostKeys, fingerprint

from .store_helpers import SMALL, kv_block, make_store, namespace, random_prompt

NS = bytes(range(NS_ID_BYTES))


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_held_entry_keeps_identity_and_changes_across_sweeps(monkeypatch):
    monkeypatch.setattr(index_mod, "_SWEEP_MIN", 8)
    ix = BlockIndex()
    for i in range(100):
        ix.add_cold(NS, key(i), key(i - 1) if i else None, 1000 + i, 7 * i, ssd=True)
    held = ix.get(NS + key(5))
    held.remote = True                   # a change made while the caller holds it
    dropped = ix.get(NS + key(6))
    dropped.checksum = 12345             # a change to an entry nobody keeps
    del dropped
    for i in range(10, 100):             # many gets: sweeps run meanwhile
        assert ix.get(NS + key(i)).size == 1000 + i
    ix.compact()
    assert ix.get(NS + key(5)) is held
    assert held.remote and held.ssd
    again = ix.get(NS + key(6))
    assert again.checksum == 12345 and again.size == 1006 and again.parent == key(5)
    assert ix.hot_count < 100


def test_entries_with_live_state_are_never_packed():
    ix = BlockIndex()
    busy = []
    for i in range(20):
        e = Entry(NS, key(i), None, 10, i)
        ix.add(e)
        if i % 4 == 0:
            e.host = i * 4096
        elif i % 4 == 1:
            e.pins = 1
        busy.append(i % 4 < 2)
    del e
    gc.collect()
    ix.compact()
    assert ix.hot_count == sum(busy)
    for i in range(20):
        v = ix.peek(NS + key(i))
        assert (v.host is not None) == (i % 4 == 0)
        assert v.pins == (1 if i % 4 == 1 else 0)


def test_peek_reads_flags_without_making_entries():
    ix = BlockIndex()
    ix.add_cold(NS, key(1), None, 10, 1, ssd=True)
    ix.add_cold(NS, key(2), None, 10, 2, remote=True)
    ix.add_cold(NS, key(3), None, 10, 3, ssd=True, remote=True)
    flags = [(v.ssd, v.remote, v.host, v.gpu) for v in (ix.peek(NS + key(i)) for i in (1, 2, 3))]
    assert flags == [(True, False, None, None), (False, True, None, None), (True, True, None, None)]
    assert ix.peek(NS + key(4)) is None and ix.get(NS + key(4)) is None
    assert ix.hot_count == 0


def test_child_counts_namespaces_and_row_reuse():
    ix = BlockIndex()
    other = b"\xff" * NS_ID_BYTES
    ix.add_cold(NS, key(2), key(1), 10, 2, ssd=True)          # child before its parent
    ix.add_cold(NS, key(3), key(1), 10, 3, ssd=True)
    ix.add_cold(NS, key(1), None, 10, 1, ssd=True)
    ix.add_cold(other, key(1), None, 10, 9, ssd=True)
    assert ix.get(NS + key(1)).children == 2
    assert sorted(ix.namespace_keys(NS)) == [NS + key(i) for i in (1, 2, 3)]
    assert ix.namespace_keys(other) == [other + key(1)]
    forgotten = []
    ix.on_free.append(forgotten.append)
    r = ix.row(NS + key(2))
    ix.discard(NS + key(2))
    assert forgotten == [r] and ix.get(NS + key(1)).children == 1
    ix.add_cold(NS, key(7), None, 10, 7, ssd=True)
    assert ix.row(NS + key(7)) == r and ix.key_at(r) == NS + key(7)
    ix.recount_children()
    assert ix.get(NS + key(1)).children == 1
    assert sorted(e.checksum for e in ix.entries()) == [1, 3, 7, 9]


def test_a_parent_dropped_before_its_child_counts_it_when_stored_again():
    """An SSD eviction batch may take a parent and its child while the child is stored again
    meanwhile: the parent goes, the child stays. Stored again, the parent must count that
    child, or the child's own drop later takes its count below zero and the parent is never a
    leaf again."""
    ix = BlockIndex()
    ix.add_cold(NS, key(1), None, 10, 1, ssd=True)
    ix.add_cold(NS, key(2), key(1), 10, 2, ssd=True)
    ix.discard(NS + key(1))                                    # the child stays indexed
    ix.add_cold(NS, key(1), None, 10, 1, ssd=True)
    assert ix.get(NS + key(1)).children == 1
    ix.discard(NS + key(2))
    assert ix.get(NS + key(1)).children == 0
    ix.recount_children()
    assert ix.get(NS + key(1)).children == 0


def test_bulk_load_matches_one_by_one_and_drops_cycle_closers():
    items = []
    for i in range(50):
        parent = NS + key(i - 1) if i % 7 else (NS + key(99) if i == 14 else None)
        items.append((NS + key(i), parent, 100 + i, i))
    items.append((NS + key(60), NS + key(61), 1, 60))     # 61 comes later: a cycle closer
    items.append((NS + key(61), NS + key(60), 1, 61))
    bulk, one = BlockIndex(), BlockIndex()
    bulk.load_ssd(items)
    for g, pg, size, c in items[:50]:
        one.add_cold(NS, g[NS_ID_BYTES:], pg[NS_ID_BYTES:] if pg else None, size, c, ssd=True)
    for g, *_ in items[:50]:
        a, b = bulk.get(g), one.get(g)
        assert (a.parent, a.size, a.checksum, a.children, a.ssd) == \
            (b.parent, b.size, b.checksum, b.children, b.ssd)
    assert bulk.get(NS + key(60)).parent is None
    assert bulk.get(NS + key(61)).parent == key(60) and bulk.get(NS + key(60)).children == 1
    assert bulk._awaited == {NS + key(99): 1}
    assert bulk.namespace_keys(NS) == [g for g, *_ in items]


def test_read_walks_do_not_unpack_and_count_like_entries():
    ix = BlockIndex()
    other = b"\xee" * NS_ID_BYTES
    for i in range(30):
        ix.add_cold(NS if i % 3 else other, key(i), None, 10 + i, i, ssd=i % 2 == 0,
                    remote=i % 5 == 0)
    e = ix.get(NS + key(1))
    e.host, e.remote = 4096, True            # hot, and its packed flags are stale now
    ix.get(NS + key(5)).remote = False       # thawed, changed, dropped: packs back
    ix.compact()
    want = {(x.ns_id, x.host is not None, x.ssd, x.remote, x.size) for x in ix.entries()}
    assert set(ix.residency()) == want and len(want) == 30
    assert ix.remote_count() == sum(x.remote for x in ix.entries())
    assert ix.read(NS + key(1)) is e and ix.read(NS + key(2)).size == 12
    assert ix.hot_count == 1 and ix.hot_entries() == [e]


def _twin_policies(n_hint: int | None):
    ix = BlockIndex()
    return ix, SegmentedPolicy(n_hint, rows=ix), SegmentedPolicy(n_hint)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_row_policy_picks_exactly_what_the_object_policy_picks(seed):
    rnd = random.Random(seed)
    ix, rows, objs = _twin_policies(rnd.choice([None, 40]))
    live: list[int] = []
    nxt = 0
    for step in range(600):
        op = rnd.random()
        if op < 0.45 or not live:
            i = nxt
            nxt += 1
            parent = rnd.choice([None, rnd.randrange(0, nxt + 5)])
            if parent == i:
                parent = None
            p = NS + key(parent) if parent is not None else None
            ix.add_cold(NS, key(i), key(parent) if parent is not None else None, 1, i)
            for pol in (rows, objs):
                pol.insert(NS + key(i), p, 1)
            live.append(i)
        elif op < 0.6:
            g = NS + key(rnd.choice(live))
            rows.touch(g)
            objs.touch(g)
        elif op < 0.68:
            gs = [NS + key(i) for i in rnd.sample(live, min(3, len(live)))]
            rows.note_put(gs)
            objs.note_put(gs)
        elif op < 0.72:
            gs = [NS + key(i) for i in rnd.sample(live, min(4, len(live)))]
            level = rnd.choice(["low", "high", "normal"])
            rows.note_retention(gs, level)
            objs.note_retention(gs, level)
        elif op < 0.8:                          # delete, possibly under resident children
            i = live.pop(rnd.randrange(len(live)))
            rows.remove(NS + key(i))
            objs.remove(NS + key(i))
            ix.discard(NS + key(i))
        else:                                   # evict
            banned = {NS + key(i) for i in rnd.sample(live, min(2, len(live)))}
            can = (lambda g, b=banned: g not in b)
            a, b = rows.pick(can), objs.pick(can)
            assert a == b, f"step {step}"
            if a is not None:
                rows.remove(a)
                objs.remove(a)
                ix.discard(a)
                live.remove(int.from_bytes(a[NS_ID_BYTES:], "big"))
        assert len(rows) == len(objs) == len(live)
    a, b = _unpack(rows.snapshot(), "default", 2), _unpack(objs.snapshot(), "default", 2)
    assert a.pop("ghost") == [fingerprint(g) for g in b.pop("ghost")]
    assert a == b
    blob = rows.snapshot()
    rows, objs = SegmentedPolicy(rows._hint, rows=ix), SegmentedPolicy(objs._hint)
    rows.restore(blob)                  # bulk load, parents from the index
    objs.restore(blob)                  # one insert per node, parents from the snapshot
    order = []
    while (v := rows.pick(lambda g: True)) is not None:
        assert v == objs.pick(lambda g: True)
        order.append(v)
        rows.remove(v)
        objs.remove(v)
    assert len(order) == len(live)


def test_row_policy_restore_skips_blocks_no_longer_indexed():
    ix, rows, _ = _twin_policies(None)
    for i in range(10):
        ix.add_cold(NS, key(i), key(i - 1) if i else None, 1, i)
        rows.insert(NS + key(i), NS + key(i - 1) if i else None, 1)
    blob = rows.snapshot()
    ix.discard(NS + key(9))                 # gone since the snapshot was taken
    fresh = make_policy("default", None, rows=ix)
    fresh.restore(blob)
    assert len(fresh) == 9 and NS + key(9) not in fresh
    assert fresh.pick(lambda g: True) == NS + key(8)


def _fill_ssd(store, ns, rng, n):
    _, keys = random_prompt(rng, n)
    store.put(ns, keys, [kv_block(k) for k in keys])
    store.flush()
    return keys


def test_restart_with_a_stale_policy_snapshot_can_evict_every_block(tmp_path):
    """A crash leaves the snapshot of the last clean stop: blocks written since must still be
    evictable, blocks deleted since must not be named by the policy."""
    from tiers.ssd import SSDTier

    def tier() -> SSDTier:
        return SSDTier(str(tmp_path / "data" / "ssd"), 64 << 20)

    rng = np.random.default_rng(3)
    s = make_store(tmp_path)
    ns = namespace(s)
    first = _fill_ssd(s, ns, rng, 12)
    s.close()
    t = tier()
    stale = t.get_state("policy.ssd")
    t.close()
    assert stale
    s = make_store(tmp_path)
    second = _fill_ssd(s, ns, rng, 12)
    assert s.delete(ns, first[6:]) == 6
    s.close()
    t = tier()
    t.put_state("policy.ssd", stale)        # as if the daemon had crashed after the first stop
    t.close()
    s = make_store(tmp_path)
    try:
        pol = s.policies["ssd"]
        on_ssd = [ns + k for k in first[:6] + second]
        assert len(pol) == len(s.ssd) == len(on_ssd)
        assert all(g in pol for g in on_ssd)
        want = first[:6] + second
        assert s.get(ns, want) == [(k, kv_block(k)) for k in want]
        s.evict("ssd")
        assert len(s.ssd) == 0 and len(pol) == 0
    finally:
        s.close(flush=False)


def test_store_serves_packed_blocks_byte_exact_after_restart(tmp_path, monkeypatch):
    monkeypatch.setattr(index_mod, "_SWEEP_MIN", 4)
    rng = np.random.default_rng(4)
    s = make_store(tmp_path, host_capacity=64 * SMALL.block_bytes)
    ns = namespace(s)
    prompts = [_fill_ssd(s, ns, rng, 8) for _ in range(6)]
    s.close()
    s = make_store(tmp_path, host_capacity=64 * SMALL.block_bytes)
    try:
        assert s.index.hot_count == 0
        for keys in prompts:
            assert s.lookup(ns, keys).prefix_blocks == len(keys)
            assert s.get(ns, keys) == [(k, kv_block(k)) for k in keys]
        s.evict("host")
        s.index.compact()
        assert s.index.hot_count < len(s.index)
        for keys in prompts:
            assert s.get(ns, keys) == [(k, kv_block(k)) for k in keys]
    finally:
        s.close(flush=False)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_ghost_keys_behave_like_the_ordered_dict_they_replace(seed):
    class Often(GhostKeys):
        RING_SLACK = 8                  # compact the ring and trim its head often

    rnd = random.Random(seed)
    ghost, model = Often(), OrderedDict()
    for _ in range(5000):
        k = key(rnd.randrange(3000))
        op = rnd.random()
        if op < 0.5:
            ghost[k] = None
            model.setdefault(k, None)
        elif op < 0.7 and model:
            if k in model:
                del ghost[k]
                del model[k]
            else:
                with pytest.raises(KeyError):
                    del ghost[k]
        elif op < 0.9 and model:
            assert ghost.popitem(last=False)[0] == fingerprint(model.popitem(last=False)[0])
        assert (k in ghost) == (k in model) and len(ghost) == len(model)
    assert list(ghost) == [fingerprint(k) for k in model]
    assert all(k in ghost for k in model)


@pytest.mark.parametrize("n", [3000])
def test_shadows_stay_bounded_as_the_tier_grows(n, monkeypatch):
    monkeypatch.setattr(SegmentedPolicy, "SHADOW_MAX", 16)
    pol = SegmentedPolicy(None)
    for i in range(n):
        pol.insert(NS + key(i), None, 1)
    assert pol._rate > SegmentedPolicy.RATE
    for sh, resident, _ in pol._shadows:
        assert len(resident) <= 16 + 1 and len(sh) == len(resident)
        assert all(pol._sampled(g) for g in resident)
