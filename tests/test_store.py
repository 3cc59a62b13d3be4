"""The in-process Store: dedup, leases, demotion/promotion, restart, corruption, invariants."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
import xxhash
from kvstore_client.common.hashing import block_keys
from kvstore_client.errors import (
    DataLoss,
    InvalidArgument,
    LeaseExpired,
    NotFound,
    ResourceExhausted,
)

from kvstore.state import aligned as _aligned
from tiers.frame import HEADER_BYTES
from tiers.ssd import SSDTier, extent_size

from .store_helpers import SMALL, kv_block, make_store, namespace, random_prompt


def write_via_lease(store, ns, keys, parent=None, checksums=True):
    lease = store.reserve(ns, len(keys))
    sums = []
    for slot, k in zip(lease.slots, keys, strict=True):
        data = kv_block(k)
        store.host.view(slot.offset, slot.length)[:] = np.frombuffer(data, np.uint8)
        sums.append(xxhash.xxh3_64_intdigest(data))
    return store.commit(lease.id, keys, parent=parent, checksums=sums if checksums else None)


def test_reserve_commit_lookup_acquire(tmp_path):
    with make_store(tmp_path) as store:
        ns = namespace(store)
        _, keys = random_prompt(np.random.default_rng(0), 5)
        assert store.lookup(ns, keys).prefix_blocks == 0
        assert write_via_lease(store, ns, keys[:3]).stored == 3
        res = store.lookup(ns, keys)
        assert res.prefix_blocks == 3 and res.per_tier["host"] == 3
        lease = store.acquire(ns, keys)
        assert lease.keys == keys[:3]
        for k, s, c in zip(lease.keys, lease.slots, lease.checksums, strict=True):
            got = store.host.view(s.offset, s.length).tobytes()
            assert got == kv_block(k) and xxhash.xxh3_64_intdigest(got) == c
        store.release(lease.id)
        with pytest.raises(NotFound):
            store.release(lease.id)


def test_dedup_commit_of_existing_key_stores_nothing(tmp_path):
    with make_store(tmp_path) as store:
        ns = namespace(store)
        _, keys = random_prompt(np.random.default_rng(1), 4)
        assert write_via_lease(store, ns, keys).stored == 4
        used, blocks = store.host.used_bytes, store.stats()["blocks"]
        r = write_via_lease(store, ns, keys)
        assert (r.stored, r.duplicates) == (0, 4)
        r = store.put(ns, keys, [kv_block(k) for k in keys])
        assert (r.stored, r.duplicates) == (0, 4)
        assert store.host.used_bytes == used and store.stats()["blocks"] == blocks
        assert store.stats()["counters"]["duplicate_blocks"] == 8


def test_commit_with_wrong_checksum_publishes_nothing(tmp_path):
    with make_store(tmp_path) as store:
        ns = namespace(store)
        _, keys = random_prompt(np.random.default_rng(2), 2)
        used = store.host.used_bytes
        lease = store.reserve(ns, 2)
        with pytest.raises(DataLoss):
            store.commit(lease.id, keys, checksums=[1, 2])
        assert store.lookup(ns, keys).prefix_blocks == 0
        assert store.host.used_bytes == used


def test_commit_into_a_stale_mapping_is_refused_at_once(tmp_path):
    # A client that wrote into a mapping the daemon no longer uses (a restarted daemon's old
    # segment) leaves every slot unlike its checksums; the sampled check must catch it on
    # every try, whichever block it picks.
    with make_store(tmp_path) as store:
        ns = namespace(store)
        _, keys = random_prompt(np.random.default_rng(20), 8)
        for _ in range(20):
            lease = store.reserve(ns, 8)
            sums = [xxhash.xxh3_64_intdigest(kv_block(k)) for k in keys]
            with pytest.raises(DataLoss, match="stale mapping"):
                store.commit(lease.id, keys, checksums=sums)
        assert store.lookup(ns, keys).prefix_blocks == 0
        assert store.stats()["counters"]["commit_checksum_mismatch"] == 20


@pytest.mark.parametrize("commit_check", ["sample", "all"])
def test_a_torn_block_the_commit_did_not_hash_is_never_served(tmp_path, commit_check):
    # One torn block among 8: "all" refuses the commit; "sample" may publish it, and then
    # every read path drops it (counted) instead of serving it.
    with make_store(tmp_path, commit_check=commit_check) as store:
        ns = namespace(store)
        _, keys = random_prompt(np.random.default_rng(21), 8)
        lease = store.reserve(ns, 8)
        sums = []
        for j, (slot, k) in enumerate(zip(lease.slots, keys, strict=True)):
            data = kv_block(k)
            sums.append(xxhash.xxh3_64_intdigest(data))
            view = store.host.view(slot.offset, slot.length)
            view[:] = np.frombuffer(data, np.uint8)
            if j == 5:
                view[100] ^= 0xFF          # torn: the checksum says otherwise
        try:
            store.commit(lease.id, keys, checksums=sums)
        except DataLoss:
            assert store.lookup(ns, keys).prefix_blocks == 0
            return
        assert commit_check == "sample"
        got = store.get(ns, keys)
        assert [k for k, _ in got] == keys[:5]
        assert all(d == kv_block(k) for k, d in got)
        assert store.stats()["counters"]["corrupt_blocks"] == 1
        assert store.lookup(ns, keys).prefix_blocks == 5      # dropped, not kept


def test_second_process_maps_host_slab_and_reads_committed_block(tmp_path):
    with make_store(tmp_path) as store:
        ns = namespace(store)
        _, keys = random_prompt(np.random.default_rng(3), 3)
        write_via_lease(store, ns, keys)
        lease = store.acquire(ns, keys)
        info = store.host_info()
        slots = [(s.offset, s.length) for s in lease.slots]
        code = (
            "import sys, xxhash\n"
            "from kvstore_client.common.shm import attach\n"
            f"slab = attach({info['name']!r}, {info['size']})\n"
            f"for off, n in {slots!r}:\n"
            "    print(xxhash.xxh3_64_hexdigest(slab.array[off:off + n]))\n"
            "slab.close()\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, timeout=60).stdout.split()
        assert out == [xxhash.xxh3_64_hexdigest(kv_block(k)) for k in keys]
        store.release(lease.id)
        # The child's exit must not have unlinked the daemon's segment.
        assert store.get(ns, keys)[0][1] == kv_block(keys[0])


def test_restart_serves_1000_demoted_blocks_byte_equal(tmp_path):
    rng = np.random.default_rng(4)
    prompts = [random_prompt(rng, 10)[1] for _ in range(100)]
    with make_store(tmp_path, host_capacity=256 << 10) as store:   # 128 blocks of host
        ns = namespace(store)
        for keys in prompts:
            store.put(ns, keys, [kv_block(k) for k in keys])
        assert store.stats()["tiers"]["ssd"]["blocks"] >= 1000 - 128
    with make_store(tmp_path, host_capacity=256 << 10) as store:
        ns2 = namespace(store)
        assert ns2 == ns
        assert store.stats()["tiers"]["ssd"]["blocks"] == 1000
        for keys in prompts:
            assert store.lookup(ns, keys).prefix_blocks == 10
            got = store.get(ns, keys)
            assert [k for k, _ in got] == keys
            assert all(data == kv_block(k) for k, data in got)


def test_flipped_byte_on_ssd_is_a_counted_miss_never_served(tmp_path):
    _, keys = random_prompt(np.random.default_rng(5), 4)
    with make_store(tmp_path) as store:
        ns = namespace(store)
        store.put(ns, keys, [kv_block(k) for k in keys])
    ssd = SSDTier(str(tmp_path / "data" / "ssd"), 64 << 20)
    value = bytearray(ssd.get(ns + keys[2]))
    value[len(value) // 2] ^= 0x40
    ssd.put(ns + keys[2], bytes(value), ssd.get_meta(ns + keys[2]))
    ssd.close()
    with make_store(tmp_path) as store:
        got = store.get(ns, keys)
        assert [k for k, _ in got] == keys[:2]
        assert all(d == kv_block(k) for k, d in got)
        assert store.stats()["counters"]["corrupt_blocks"] == 1
        assert store.lookup(ns, keys).prefix_blocks == 2     # the bad copy was dropped


def test_expired_write_lease_gives_its_slots_back(tmp_path):
    """After leases.expired_write_hold_s (kvstore/held_writes.py: a writer stalled past its
    lease may still be copying into them), here 1 s."""
    with make_store(tmp_path) as store:
        store.held_writes.hold_s = 1.0
        ns = namespace(store)
        used = store.host.used_bytes
        lease = store.reserve(ns, 8, ttl_s=0.2)
        assert store.host.used_bytes > used
        deadline = time.monotonic() + 5
        while store.stats()["active_leases"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert store.stats()["active_leases"] == 0
        assert store.host.used_bytes > used             # expired, its slots still held
        while store.host.used_bytes != used and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.host.used_bytes == used
        with pytest.raises(LeaseExpired):
            store.commit(lease.id, random_prompt(np.random.default_rng(6), 8)[1])


def test_read_lease_pins_blocks_against_eviction(tmp_path):
    with make_store(tmp_path) as store:
        ns = namespace(store)
        _, keys = random_prompt(np.random.default_rng(7), 6)
        store.put(ns, keys, [kv_block(k) for k in keys])
        lease = store.acquire(ns, keys[:3])
        store.evict("host")
        res = store.lookup(ns, keys)
        assert res.per_tier["host"] == 3 and res.prefix_blocks == 6
        assert all(store.index.get(ns + k).host is not None for k in keys[:3])
        store.release(lease.id)
        store.evict("host")
        assert store.lookup(ns, keys).per_tier["host"] == 0
        # promotion brings them back, byte-equal, and keeps the SSD copy
        assert all(d == kv_block(k) for k, d in store.get(ns, keys))
        assert store.lookup(ns, keys).per_tier == {"host": 6, "ssd": 6}


def test_host_full_of_pinned_blocks_is_resource_exhausted(tmp_path):
    with make_store(tmp_path, host_capacity=64 << 10, ssd=False) as store:
        ns = namespace(store)
        _, keys = random_prompt(np.random.default_rng(8), 12)
        store.put(ns, keys, [kv_block(k) for k in keys])
        lease = store.acquire(ns, keys)
        with pytest.raises(ResourceExhausted, match="host tier full|do not fit"):
            store.reserve(ns, 8)            # 12 pinned 4 KiB extents + 8 > 64 KiB
        store.release(lease.id)
        assert len(store.reserve(ns, 8).slots) == 8   # now evictable (no lower tier: dropped)
        n = store.lookup(ns, keys).prefix_blocks      # leaves went first: what stays is a prefix
        assert all((ns + k) in store.index for k in keys[:n])
        assert not any((ns + k) in store.index for k in keys[n:])


def test_namespaces_never_see_each_other(tmp_path):
    with make_store(tmp_path) as store:
        a, b = namespace(store, model="a"), namespace(store, model="b")
        _, keys = random_prompt(np.random.default_rng(9), 3)
        store.put(a, keys, [kv_block(k) for k in keys])
        assert store.lookup(b, keys).prefix_blocks == 0
        assert store.get(b, keys) == []
        assert store.delete(b) == 0 and store.lookup(a, keys).prefix_blocks == 3
        assert store.delete(a, keys[1:]) == 2 and store.lookup(a, keys).prefix_blocks == 1


@pytest.mark.parametrize("call", [
    lambda s, ns: s.lookup(b"short", []),
    lambda s, ns: s.lookup(ns, [b"x" * 8]),
    lambda s, ns: s.reserve(ns, 0),
    lambda s, ns: s.reserve(ns, -3),
    lambda s, ns: s.reserve(ns, 1, tier="tape"),
    lambda s, ns: s.put(ns, [b"k" * 16], [b"too short"]),
    lambda s, ns: s.acquire(ns, [b"k" * 16], ttl_s=-1),
    lambda s, ns: s.commit("", [b"k" * 16]),
    lambda s, ns: s.evict("nvme"),
])
def test_bad_input_is_invalid_argument(tmp_path, call):
    with make_store(tmp_path) as store:
        ns = namespace(store)
        with pytest.raises(InvalidArgument):
            call(store, ns)


def test_unknown_namespace_and_lease_are_not_found(tmp_path):
    with make_store(tmp_path) as store:
        with pytest.raises(NotFound):
            store.lookup(b"\0" * 16, [])
        with pytest.raises(NotFound):
            store.renew("0" * 32)


def test_keys_continue_a_chain_across_calls(tmp_path):
    with make_store(tmp_path) as store:
        ns = namespace(store)
        toks = np.arange(8 * 6)
        keys = block_keys(toks, 8)
        store.put(ns, keys[:2], [kv_block(k) for k in keys[:2]])
        store.put(ns, keys[2:], [kv_block(k) for k in keys[2:]], parent=keys[1])
        e = store.index.get(ns + keys[2])
        assert e.parent == keys[1]
        assert store.index.get(ns + keys[1]).children == 1


def test_client_given_parents_cannot_form_an_unevictable_cycle(tmp_path):
    """A -> parent B, then B -> parent A: without a guard neither is ever a prefix leaf."""
    with make_store(tmp_path, ssd=False) as store:
        ns = namespace(store)
        _, (a, b) = random_prompt(np.random.default_rng(10), 2)
        store.put(ns, [a], [kv_block(a)], parent=b)
        store.put(ns, [b], [kv_block(b)], parent=a)
        ea, eb = store.index.get(ns + a), store.index.get(ns + b)
        assert (ea.parent, eb.parent) == (b, None)       # the closing link was dropped
        freed, blocks = store.evict("host")
        assert blocks == 2 and store.host.used_bytes == 0 and len(store.index) == 0


def test_retain_low_orders_eviction_and_reaches_every_tier(tmp_path):
    # "lru" applies a hint at once; the default follows hints only once its full-size twins
    # show they pay (docs/eviction.md; tests/test_policy.py), which a fresh store cannot show yet
    with make_store(tmp_path, policy="lru") as store:
        ns = namespace(store)
        rng = np.random.default_rng(11)
        _, older = random_prompt(rng, 4)
        _, newer = random_prompt(rng, 4)
        store.put(ns, older, [kv_block(k) for k in older])
        store.put(ns, newer, [kv_block(k) for k in newer])
        assert store.retain(ns, newer + [b"\x01" * 16], "low") == 4    # unknown keys skipped
        store.evict("host", 4 * _aligned(SMALL.block_bytes))
        # without the hint LRU order would have taken `older`
        assert store.lookup(ns, older).per_tier.get("host") == 4
        assert store.lookup(ns, newer).per_tier.get("host", 0) == 0
        assert store.lookup(ns, newer).prefix_blocks == 4                 # demoted, not lost
        assert store.retain(ns, newer, "high") == 4                       # SSD-only now
        assert store.counters["retention_hint_blocks"] == 8
        with pytest.raises(InvalidArgument, match="retention level must be one of"):
            store.retain(ns, newer, "never")
        with pytest.raises(NotFound):
            store.retain(b"\x00" * 16, newer, "low")
        assert all(d == kv_block(k) for k, d in store.get(ns, newer))


def test_ssd_eviction_takes_the_oldest_prompt_whole(tmp_path):
    # SSD's oldest leaf is the older prompt's tail; once it is picked, its parent is the oldest
    # leaf and goes in the same batch (its one child leaves with it), not the newer prompt's
    # tail: the batch follows the policy's order and nothing is left without its parent.
    with make_store(tmp_path, ssd_compress="never") as store:
        ns = namespace(store)
        rng = np.random.default_rng(41)
        _, older = random_prompt(rng, 4)
        _, newer = random_prompt(rng, 4)
        store.put(ns, older, [kv_block(k) for k in older])
        store.put(ns, newer, [kv_block(k) for k in newer])
        store.evict("host")
        assert store.lookup(ns, older).per_tier["ssd"] == 4
        assert store.lookup(ns, newer).per_tier["ssd"] == 4
        # (4 blocks' extents: what the SSD tier's bytes count, tiers/ssd/tier.py)
        _, blocks = store.evict("ssd", 4 * extent_size(HEADER_BYTES + SMALL.block_bytes))
        assert blocks == 4
        assert store.lookup(ns, older).prefix_blocks == 0
        assert all(store.index.get(ns + k) is None for k in older)
        assert store.lookup(ns, newer).prefix_blocks == 4
        assert [d for _, d in store.get(ns, newer)] == [kv_block(k) for k in newer]


def test_acquire_of_a_prefix_longer_than_host_serves_what_fits(tmp_path):
    # 300 blocks on SSD, a host pool of ~128: the acquire promotes and pins what host can hold
    # and answers that prefix, byte-equal, instead of failing the whole load.
    with make_store(tmp_path, host_capacity=256 << 10) as store:
        ns = namespace(store)
        _, keys = random_prompt(np.random.default_rng(30), 300)
        for i in range(0, 300, 20):
            store.put(ns, keys[i:i + 20], [kv_block(k) for k in keys[i:i + 20]],
                      parent=keys[i - 1] if i else None)
        store.evict("host")
        assert store.lookup(ns, keys).per_tier["ssd"] == 300
        lease = store.acquire(ns, keys)
        n = len(lease.keys)
        assert 0 < n < 300 and lease.keys == keys[:n]
        for k, s in zip(lease.keys, lease.slots, strict=True):
            assert store.host.view(s.offset, s.length).tobytes() == kv_block(k)
        assert store.stats()["counters"]["acquire_cut_host_full"] == 1
        store.release(lease.id)
        got = store.get(ns, keys[n:])        # the rest is still there for the next call
        assert got and all(d == kv_block(k) for k, d in got)
