"""Retain and Delete work a slice of keys per hold of the store lock (kvstore/store.py).

Why structural, not timed: what the fix promises is that another caller gets the lock between
slices, whatever the machine's speed. The slice size is made small and `state.unlocked` is
wrapped so that, each time the big call lets go, another thread takes the lock (and may change
the keys under the call); each slice's size is read off the calls it makes with the lock held.
Results are checked against one unsliced call's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest

import kvstore.store as store_mod

from .store_helpers import kv_block, make_store, namespace, random_prompt

N = 1000
SLICE = 100


def _prompt(seed: int, n: int = N) -> list[bytes]:
    return random_prompt(np.random.default_rng(seed), n)[1]


def _filled(tmp_path, name: str, keys: list[bytes], **kw):
    store = make_store(tmp_path / name, host_capacity=16 << 20, ssd=False, **kw)
    ns = namespace(store)
    store.put(ns, keys, [kv_block(k) for k in keys])
    return store, ns


def _between_slices(store, other: Callable[[int], None] | None = None) -> list[int]:
    """Wrap the store's lock release so that each release by this thread runs, in another
    thread, an acquire of the store lock and then `other(i)`; returns the list of the acquires
    that succeeded (their ordinal). A failed acquire means the lock was not released."""
    st = store.state
    me = threading.current_thread()
    real = st.unlocked
    got: list[int] = []

    @contextmanager
    def unlocked() -> Iterator[None]:
        with real():
            if threading.current_thread() is me:
                i = len(got)

                def run() -> None:
                    if st.lock.acquire(timeout=10):
                        try:
                            got.append(i)
                        finally:
                            st.lock.release()
                        if other is not None:
                            other(i)
                t = threading.Thread(target=run)
                t.start()
                t.join(20)
                assert not t.is_alive()
            yield

    st.unlocked = unlocked
    return got


def _slice_sizes(monkeypatch, obj, name: str) -> list[int]:
    """Record len(first argument) of each call of obj.name, checking the lock is held."""
    sizes: list[int] = []
    real = getattr(obj, name)

    def wrapped(gkeys, *a, **kw):
        sizes.append(len(gkeys))
        return real(gkeys, *a, **kw)

    monkeypatch.setattr(obj, name, wrapped)
    return sizes


def test_slices_are_small_by_default() -> None:
    assert 256 <= store_mod.SLICE_KEYS <= 4096


def test_retain_lets_others_take_the_lock_between_slices(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(store_mod, "SLICE_KEYS", SLICE)
    keys = _prompt(1)
    store, ns = _filled(tmp_path, "s", keys, policy="lru")
    with store:
        sizes = _slice_sizes(monkeypatch, store.state.policies["host"], "note_retention")
        got = _between_slices(store)
        assert store.retain(ns, keys, "low") == N
        assert sizes == [SLICE] * (N // SLICE)
        assert got == list(range(N // SLICE - 1))      # in between every two slices
        assert store.counters["retention_hint_blocks"] == N


@pytest.mark.parametrize("by_keys", [False, True])
def test_delete_lets_others_take_the_lock_between_slices(tmp_path, monkeypatch,
                                                         by_keys: bool) -> None:
    monkeypatch.setattr(store_mod, "SLICE_KEYS", SLICE)
    keys = _prompt(2)
    store, ns = _filled(tmp_path, "s", keys)
    with store:
        sizes = _slice_sizes(monkeypatch, store.moves, "delete")
        got = _between_slices(store)
        assert store.delete(ns, keys if by_keys else None) == N
        assert sizes == [SLICE] * (N // SLICE)
        assert got == list(range(N // SLICE - 1))
        assert store.state.index.namespace_keys(ns) == []
        assert store.lookup(ns, keys).prefix_blocks == 0
        assert store.counters["deleted_blocks"] == N


def test_sliced_retain_equals_one_unsliced_call(tmp_path, monkeypatch) -> None:
    """The policy ends in the same order, and the count is the same, as with one hold."""
    keys = _prompt(3)
    hinted = keys[::3] + [b"\x01" * 16] * 5 + keys[1::7]      # unknown keys, repeats
    snaps, counts = [], []
    for name, size in (("one", 1 << 20), ("sliced", 64)):
        monkeypatch.setattr(store_mod, "SLICE_KEYS", size)
        store, ns = _filled(tmp_path, name, keys, policy="lru")
        with store:
            counts.append((store.retain(ns, hinted, "low"), store.retain(ns, keys[5:90], "high")))
            with store.state.lock:
                snaps.append(store.state.policies["host"].snapshot())
    assert counts[0] == counts[1] == (len(keys[::3]) + len(keys[1::7]), 85)
    assert snaps[0] == snaps[1]


def test_retain_skips_keys_deleted_meanwhile_and_hints_those_stored_again(tmp_path,
                                                                        monkeypatch) -> None:
    monkeypatch.setattr(store_mod, "SLICE_KEYS", SLICE)
    keys = _prompt(4)
    store, ns = _filled(tmp_path, "s", keys, policy="lru")
    gone = keys[500:530]            # deleted by another caller before their slice
    again = keys[10:20]             # deleted and stored again after theirs: hinted once

    def other(i: int) -> None:
        if i == 0:
            assert store.delete(ns, gone) == len(gone)
        if i == 1:
            assert store.delete(ns, again) == len(again)
            store.put(ns, again, [kv_block(k) for k in again], parent=keys[9])

    with store:
        _between_slices(store, other)
        assert store.retain(ns, keys, "low") == N - len(gone)
        assert store.counters["retention_hint_blocks"] == N - len(gone)


def test_delete_counts_only_what_it_deleted_and_keeps_keys_stored_meanwhile(tmp_path,
                                                                           monkeypatch) -> None:
    monkeypatch.setattr(store_mod, "SLICE_KEYS", SLICE)
    keys = _prompt(5)
    store, ns = _filled(tmp_path, "s", keys)
    gone = keys[700:740]            # another caller deletes them first: not counted twice
    new = _prompt(6, 8)             # stored while the Delete(all) runs: not its keys

    def other(i: int) -> None:
        if i == 0:
            assert store.delete(ns, gone) == len(gone)
            store.put(ns, new, [kv_block(k) for k in new])

    with store:
        _between_slices(store, other)
        assert store.delete(ns) == N - len(gone)
        assert sorted(store.state.index.namespace_keys(ns)) == sorted(ns + k for k in new)
        assert store.counters["deleted_blocks"] == N
