"""Leases given back in passing (`release_leases`) while another call holds the store lock:
ended at the next hold that reaps, before that call plans, and never counted against the
tenant's lease cap meanwhile (kvstore/carried.py)."""

from __future__ import annotations

import threading
import time

import numpy as np
from kvstore_client.common.limits import MAX_CARRIED_RELEASES
from kvstore_client.leases import LeaseKeeper

from kvstore.config import StoreConfig
from kvstore.store import Store

from .store_helpers import kv_block, namespace, random_prompt
from .test_store import write_via_lease


def _store(tmp_path, **limits) -> Store:
    cfg = StoreConfig(data_dir=str(tmp_path / "data"))
    cfg.host.capacity = 1 << 20
    cfg.ssd.enabled = False
    cfg.leases.default_ttl_s = 30
    for k, v in limits.items():
        setattr(cfg.limits, k, v)
    return Store(cfg, background=False)     # no reaper thread: the test decides who reaps


class LockHolder:
    """Another thread holding the store lock until told to let go."""

    def __init__(self, store: Store) -> None:
        self._held, self._go = threading.Event(), threading.Event()
        self._t = threading.Thread(target=self._run, args=(store,), daemon=True)
        self._t.start()
        assert self._held.wait(10)

    def _run(self, store: Store) -> None:
        with store.state.lock:
            self._held.set()
            self._go.wait(10)

    def let_go(self) -> None:
        self._go.set()
        self._t.join(10)


def test_a_lease_given_back_under_a_held_lock_ends_at_the_next_acquire(tmp_path):
    with _store(tmp_path) as store:
        ns = namespace(store)
        _, keys = random_prompt(np.random.default_rng(0), 4)
        assert write_via_lease(store, ns, keys).stored == 4
        old = store.acquire(ns, keys)
        holder = LockHolder(store)
        store.release_carried([old.id])          # the lock is busy: queued, not waited for
        assert store.leases.find(old.id) is not None
        assert store.counters["releases_carried"] == 0
        holder.let_go()
        new = store.acquire(ns, keys[:2])        # its round reaps first thing
        assert store.leases.find(old.id) is None
        assert store.counters["releases_carried"] == 1
        for k, s in zip(new.keys, new.slots, strict=True):
            assert store.host.view(s.offset, s.length).tobytes() == kv_block(k)
        store.release(new.id)


def test_a_lease_given_back_at_a_free_lock_ends_at_once(tmp_path):
    with _store(tmp_path) as store:
        ns = namespace(store)
        _, keys = random_prompt(np.random.default_rng(1), 2)
        write_via_lease(store, ns, keys)
        old = store.acquire(ns, keys)
        store.release_carried([old.id, "0" * 32])    # one never held: already free
        assert store.leases.find(old.id) is None
        assert store.counters["releases_carried"] == 1


def test_leases_given_back_do_not_count_against_the_cap(tmp_path):
    with _store(tmp_path, leases_per_tenant=1) as store:
        ns = namespace(store)
        _, keys = random_prompt(np.random.default_rng(2), 2)
        write_via_lease(store, ns, keys)
        old = store.acquire(ns, keys)            # the one lease the cap allows
        holder = LockHolder(store)
        store.release_carried([old.id])
        holder.let_go()
        new = store.acquire(ns, keys)            # admitted: the queued release ended first
        assert store.leases.find(old.id) is None and new.keys == keys


def test_a_client_carries_at_most_the_cap_and_sends_the_rest_itself():
    """The daemon refuses a call carrying more than MAX_CARRIED_RELEASES, so a client that
    finished more leases than that hands the cap to its next call and releases the rest."""
    sent: list[str] = []
    keeper = LeaseKeeper(renew=lambda lease_id: time.time() + 60, release=sent.append)
    keeper.carry = True
    try:
        ids = [f"lease-{i}" for i in range(MAX_CARRIED_RELEASES + 10)]
        for lease_id in ids:
            keeper.release_later(lease_id)
        carried = keeper.take_pending()
        assert carried == ids[:MAX_CARRIED_RELEASES]
        end = time.monotonic() + 10
        while len(sent) < 10 and time.monotonic() < end:
            sent += keeper.take_pending()       # a next call, or the thread: each once
            time.sleep(0.01)
        assert sorted(sent) == sorted(ids[MAX_CARRIED_RELEASES:])
    finally:
        keeper.close()
