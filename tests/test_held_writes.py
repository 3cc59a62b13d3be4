"""The slots of an expired write lease stay unused for leases.expired_write_hold_s.

A client stalled past its write lease (stopped, frozen, swapping) resumes the copy it was in
the middle of, into slots it no longer owns. Freed at once, those slots went to the next writer,
whose committed blocks the late copy then overwrote. Here a real store, a pool of eight slots,
and the stalled writer's late copy written into its old slots after another writer stored.
"""

from __future__ import annotations

import time

import numpy as np
import xxhash
from kvstore_client import KVLayout

from kvstore.config import StoreConfig
from kvstore.store import Store

from .store_helpers import kv_block, namespace, random_prompt

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=16, dtype="float16")
HOLD_S = 0.5


def small_store(tmp_path, hold_s: float = HOLD_S) -> Store:
    cfg = StoreConfig(data_dir=str(tmp_path / "data"))
    cfg.host.capacity = 8 * LAYOUT.block_bytes
    cfg.ssd.enabled = False
    cfg.leases.expired_write_hold_s = hold_s
    return Store(cfg)


def expire(store: Store, ttl_s: float) -> None:
    time.sleep(ttl_s + 0.05)
    with store.state.lock:
        store.reap_expired()


def test_a_stalled_writers_late_copy_lands_in_slots_no_one_else_has(tmp_path) -> None:
    with small_store(tmp_path) as store:
        ns = namespace(store, LAYOUT)
        stalled = store.reserve(ns, 4, ttl_s=0.1)
        expire(store, 0.1)
        assert store.stats()["counters"]["expired_write_slots_held"] == 4
        # Another writer stores four blocks meanwhile: not into the stalled writer's slots.
        _, keys = random_prompt(np.random.default_rng(0), 4, LAYOUT)
        blocks = [kv_block(k, LAYOUT) for k in keys]
        lease = store.reserve(ns, 4)
        assert not {s.offset for s in lease.slots} & {s.offset for s in stalled.slots}
        for s, b in zip(lease.slots, blocks, strict=True):
            store.host.view(s.offset, s.length)[:] = np.frombuffer(b, np.uint8)
        assert store.commit(lease.id, keys,
                            checksums=[xxhash.xxh3_64_intdigest(b) for b in blocks]).stored == 4
        for s in stalled.slots:                 # the stalled writer resumes its copy
            store.host.view(s.offset, s.length)[:] = 0x5A
        assert store.get(ns, keys) == list(zip(keys, blocks, strict=True))
        # After the hold the slots go back to the allocator.
        expire(store, HOLD_S)
        assert store.stats()["counters"]["expired_write_slots_held"] == 0
        assert store.stats()["tiers"]["host"]["used_bytes"] == 4 * LAYOUT.block_bytes


def test_no_hold_frees_at_once(tmp_path) -> None:
    with small_store(tmp_path, hold_s=0) as store:
        ns = namespace(store, LAYOUT)
        store.reserve(ns, 4, ttl_s=0.1)
        expire(store, 0.1)
        assert store.stats()["tiers"]["host"]["used_bytes"] == 0


def test_the_daemons_own_release_of_a_lease_past_its_deadline_is_no_error(tmp_path) -> None:
    """Prefetch releases its own read lease with missing_ok; one past its deadline but not
    reaped yet raised LeaseExpired there, which would end the one prefetch thread for good."""
    with small_store(tmp_path) as store:
        ns = namespace(store, LAYOUT)
        _, keys = random_prompt(np.random.default_rng(1), 2, LAYOUT)
        store.put(ns, keys, [kv_block(k, LAYOUT) for k in keys])
        lease = store.acquire(ns, keys, ttl_s=0.05, for_client=False)
        time.sleep(0.1)
        store.release(lease.id, missing_ok=True)
        with store.state.lock:
            store.reap_expired()
        assert store.stats()["active_leases"] == 0
