"""Real threads against one Store: promotions run outside the store lock, so hammer every
interleaving the locking protocol (docs/internals.md, "Locking") has to survive.

Each block's bytes derive from its key (kv_block), so a reader that got a slot freed and reused
by another block, or a copy that failed its checksum, sees the wrong bytes. At the end every host
slot must have exactly one owner (a block or a write lease) and the byte accounting must be exact.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import xxhash
from kvstore_client.errors import LeaseExpired, NotFound, ResourceExhausted, Unavailable

from kvstore.movement import _aligned

from .store_helpers import kv_block, make_store, namespace, random_prompt

SECONDS = 1.5


@pytest.fixture
def slow_fill(monkeypatch):
    """Widen the window in which promotions are in flight off the lock (a slow disk)."""
    def install(store):
        fill = store._fill

        def slow(info, jobs):
            time.sleep(0.002)
            fill(info, jobs)
        monkeypatch.setattr(store, "_fill", slow)
    return install


_EXPECTED: dict[bytes, bytes] = {}


def expected(key: bytes) -> bytes:
    if key not in _EXPECTED:
        _EXPECTED[key] = kv_block(key)
    return _EXPECTED[key]


def hammer(seconds: float, workers: list[Callable[[], None]],
           allowed: tuple[type[BaseException], ...] = ()) -> dict[str, int]:
    """Run each worker in a loop on its own thread; the first unexpected error fails the test.
    Returns how often each allowed error was raised."""
    stop = threading.Event()
    errors: list[BaseException] = []
    seen: dict[str, int] = {}

    def loop(fn: Callable[[], None]) -> None:
        while not stop.is_set():
            try:
                fn()
            except allowed as exc:
                seen[type(exc).__name__] = seen.get(type(exc).__name__, 0) + 1
            except BaseException as exc:
                errors.append(exc)
                stop.set()
    threads = [threading.Thread(target=loop, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    stop.wait(seconds)
    stop.set()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a worker is stuck (deadlock?)"
    if errors:
        raise errors[0]
    return seen


def check_lease(store, ns, keys, lease) -> None:
    """A read lease covers a prefix of `keys`, byte-exact, and its checksums hold."""
    assert lease.keys == keys[:len(lease.keys)]
    for k, s, c in zip(lease.keys, lease.slots, lease.checksums, strict=True):
        got = store.host.view(s.offset, s.length).tobytes()
        assert got == expected(k), "served bytes that are not this block's"
        assert xxhash.xxh3_64_intdigest(got) == c


def reader(store, ns, prompts, rng) -> Callable[[], None]:
    def one() -> None:
        keys = prompts[int(rng.integers(len(prompts)))]
        lease = store.acquire(ns, keys)
        check_lease(store, ns, keys, lease)
        time.sleep(0.001)
        check_lease(store, ns, keys, lease)         # still ours, still intact
        store.release(lease.id)
    return one


def check_live(store) -> None:
    """Invariants that hold at any moment (under the lock), promotions in flight or not."""
    with store._lock:
        offsets = [e.host for e in store.index.entries() if e.host is not None]
        assert len(offsets) == len(set(offsets)), "two blocks share a host slot"
        assert all(store.host.allocator.is_allocated(o) for o in offsets), "block in a freed slot"
        for lease in store.leases.all():
            if lease.kind == "read":
                for k, s in zip(lease.keys, lease.slots, strict=True):
                    e = store.index.get(lease.ns_id + k)
                    assert e is not None and e.host == s.offset and e.pins > 0


def check_quiet(store) -> None:
    """Exact accounting once nothing is in flight: every allocated host byte has one owner."""
    check_live(store)
    with store._lock:
        assert store._busy == 0
        entries = list(store.index.entries())
        owners = [e.host for e in entries if e.host is not None]
        owners += [s.offset for lease in store.leases.all() if lease.kind == "write"
                   for s in lease.slots]
        assert len(owners) == len(set(owners)), "a slot has two owners"
        alloc = store.host.allocator
        assert alloc.used_bytes == sum(alloc.size_of(o) for o in owners), "leaked host slots"
        assert store.host.used_bytes == sum(_aligned(e.size) for e in entries if e.host is not None
                                            ) + sum(_aligned(s.length) for lease
                                                    in store.leases.all()
                                                    if lease.kind == "write"
                                                    for s in lease.slots)
        assert len(store.policies["host"]) == sum(e.host is not None for e in entries)
        pins: dict[bytes, int] = {}
        for lease in store.leases.all():
            if lease.kind == "read":
                for k in lease.keys:
                    pins[lease.ns_id + k] = pins.get(lease.ns_id + k, 0) + 1
        for e in entries:
            assert e.moving is None and e.resident
            assert e.pins == pins.get(e.gkey, 0), "pin count drifted"
        if store.ssd is not None:
            on_ssd = {g: size for g, _, size in store.ssd.scan_meta()}
            assert set(on_ssd) == {e.gkey for e in entries if e.ssd}, "SSD and index disagree"
            assert store.ssd.used_bytes == sum(on_ssd.values())
            assert store.ssd.used_bytes <= store.ssd.capacity


def prompts_on_ssd(store, ns, n_prompts=4, blocks=6, seed=0) -> list[list[bytes]]:
    rng = np.random.default_rng(seed)
    prompts = [random_prompt(rng, blocks)[1] for _ in range(n_prompts)]
    for keys in prompts:
        store.put(ns, keys, [expected(k) for k in keys])
    store.evict("host")
    return prompts


def checker(store) -> Callable[[], None]:
    def one() -> None:
        check_live(store)
        time.sleep(0.005)
    return one


def evictor(store, pause_s=0.002) -> Callable[[], None]:
    def one() -> None:
        store.evict("host")
        time.sleep(pause_s)
    return one


def test_same_blocks_promoted_by_many_threads_get_one_slot(tmp_path, slow_fill):
    with make_store(tmp_path) as store:
        slow_fill(store)
        ns = namespace(store)
        prompts = prompts_on_ssd(store, ns)
        readers = [reader(store, ns, prompts, np.random.default_rng(i)) for i in range(4)]
        hammer(SECONDS, [*readers, evictor(store), checker(store)])
        check_quiet(store)
        assert store.stats()["tiers"]["host"]["promotions"] > 20


def test_delete_and_rewrite_while_promoting(tmp_path, slow_fill):
    with make_store(tmp_path) as store:
        slow_fill(store)
        ns = namespace(store)
        prompts = prompts_on_ssd(store, ns)
        rng = np.random.default_rng(9)

        def churn() -> None:
            keys = prompts[int(rng.integers(len(prompts)))]
            store.delete(ns, keys)
            store.put(ns, keys, [expected(k) for k in keys])    # the same bytes, a new copy
            store.evict("host")
        readers = [reader(store, ns, prompts, np.random.default_rng(i)) for i in range(3)]
        hammer(SECONDS, [*readers, churn, checker(store)])
        check_quiet(store)
        assert store.stats()["counters"]["deleted_blocks"] > 0


def test_demotion_under_pressure_while_promoting(tmp_path, slow_fill):
    # 48 host slots and room for about 150 blocks on SSD: fresh writes keep evicting from both
    # (demoting from host) while readers promote.
    with make_store(tmp_path, host_capacity=48 * 4096, ssd_capacity=150 * 2300) as store:
        slow_fill(store)
        ns = namespace(store)
        prompts = prompts_on_ssd(store, ns)
        rng = np.random.default_rng(10)

        def write() -> None:
            keys = random_prompt(rng, 6)[1]
            store.put(ns, keys, [expected(k) for k in keys])
        readers = [reader(store, ns, prompts, np.random.default_rng(i)) for i in range(3)]
        hammer(SECONDS, [*readers, write, write, checker(store)], allowed=(ResourceExhausted,))
        check_quiet(store)
        stats = store.stats()["tiers"]
        assert stats["host"]["demotions"] > 0 and stats["host"]["promotions"] > 0
        assert stats["ssd"]["evictions"] > 0


def test_ssd_eviction_while_promoting(tmp_path, slow_fill):
    """The copy a promotion reads must stay: SSD eviction skips blocks in flight."""
    with make_store(tmp_path) as store:
        slow_fill(store)
        ns = namespace(store)
        prompts = prompts_on_ssd(store, ns)

        def evict_ssd() -> None:
            store.evict("ssd", 2 * 4096)        # leaves go first: likely the ones in flight
            time.sleep(0.001)

        def refill() -> None:
            for keys in prompts:
                store.put(ns, keys, [expected(k) for k in keys])
            store.flush()
            store.evict("host")
            time.sleep(0.005)
        readers = [reader(store, ns, prompts, np.random.default_rng(i)) for i in range(3)]
        hammer(SECONDS, [*readers, evict_ssd, refill, checker(store)])
        check_quiet(store)
        assert store.stats()["tiers"]["ssd"]["evictions"] > 0


def test_reaper_expires_leases_while_promotions_are_in_flight(tmp_path, slow_fill):
    with make_store(tmp_path, host_capacity=64 * 4096) as store:
        slow_fill(store)
        ns = namespace(store)
        prompts = prompts_on_ssd(store, ns)
        rng = np.random.default_rng(11)

        def abandon_write() -> None:
            store.reserve(ns, int(rng.integers(1, 4)), ttl_s=0.05)   # a client that died
            time.sleep(0.01)
        readers = [reader(store, ns, prompts, np.random.default_rng(i)) for i in range(2)]

        def overstay() -> None:
            """A reader that outlives its lease: the reaper takes it; release then says so."""
            keys = prompts[int(rng.integers(len(prompts)))]
            lease = store.acquire(ns, keys, ttl_s=0.2)
            check_lease(store, ns, keys, lease)
            time.sleep(0.5)                         # past the deadline and a reaper pass
            store.release(lease.id)
        seen = hammer(SECONDS, [*readers, overstay, abandon_write, evictor(store),
                                checker(store)],
                      allowed=(LeaseExpired, NotFound, ResourceExhausted))
        assert seen.get("LeaseExpired", 0) > 0
        deadline = time.monotonic() + 5
        while store.stats()["active_leases"] and time.monotonic() < deadline:
            time.sleep(0.05)
        check_quiet(store)
        assert store.stats()["counters"]["leases_expired"] > 0


def test_corrupt_copy_is_never_served_to_concurrent_acquires(tmp_path, slow_fill):
    with make_store(tmp_path) as store:
        slow_fill(store)
        ns = namespace(store)
        keys = prompts_on_ssd(store, ns, n_prompts=1, blocks=8)[0]
        bad = 3
        for round_ in range(10):
            g = ns + keys[bad]
            value = bytearray(store.ssd.get(g))
            value[len(value) // 2] ^= 0x40
            store.ssd.put(g, bytes(value), store.ssd.get_meta(g))
            start = threading.Barrier(4)
            got: list[int] = []

            def read(start: threading.Barrier = start, got: list[int] = got) -> None:
                start.wait()
                lease = store.acquire(ns, keys)
                check_lease(store, ns, keys, lease)
                got.append(len(lease.keys))
                store.release(lease.id)
            hammer_once([read] * 4)
            assert max(got) <= bad, "a block that failed its checksum was served"
            assert store.stats()["counters"]["corrupt_blocks"] == round_ + 1
            check_quiet(store)
            store.put(ns, keys[bad:], [expected(k) for k in keys[bad:]], parent=keys[bad - 1])
            store.flush()
            store.evict("host")


def hammer_once(workers: list[Callable[[], None]]) -> None:
    errors: list[BaseException] = []

    def run(fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a worker is stuck (deadlock?)"
    if errors:
        raise errors[0]


def test_close_waits_for_promotions_in_flight(tmp_path, slow_fill):
    store = make_store(tmp_path)
    slow_fill(store)
    ns = namespace(store)
    prompts = prompts_on_ssd(store, ns)
    rng = np.random.default_rng(12)

    def read() -> None:
        # No byte check here: close() unmaps the slab under a lease's feet, by design.
        lease = store.acquire(ns, prompts[int(rng.integers(len(prompts)))])
        store.release(lease.id)

    def close_soon() -> None:
        time.sleep(0.3)
        store.close()
    closer = threading.Thread(target=close_soon)
    closer.start()
    seen = hammer(1.0, [read, read, read, evictor(store)], allowed=(Unavailable,))
    closer.join()
    assert seen.get("Unavailable", 0) > 0
    assert store._busy == 0 and store._shut
    with pytest.raises(Unavailable):
        store.acquire(ns, prompts[0])
