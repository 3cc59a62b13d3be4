"""Real threads against one Store: promotions and host evictions' demotions run outside the
store lock, so hammer every interleaving the locking protocol (docs/internals.md, "Locking") has
to survive: lookups, acquires, puts and deletes of blocks in flight, failed SSD writes, close().

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

from kvstore.state import aligned as _aligned
from tiers.ssd import extent_size

from .store_helpers import kv_block, make_store, namespace, quiet, random_prompt

SECONDS = 1.5          # each hammer runs at least this long
GOAL_DEADLINE_S = 120  # ... and on until what its test needs happened, or fails after this


@pytest.fixture
def slow_fill(monkeypatch):
    """Widen the window in which promotions are in flight off the lock (a slow disk)."""
    def install(store):
        fill = store.moves.promoter.fill

        def slow(info, jobs):
            time.sleep(0.002)
            fill(info, jobs)
        monkeypatch.setattr(store.moves.promoter, "fill", slow)
    return install


@pytest.fixture
def slow_demote(monkeypatch):
    """Widen the window in which evictions demote off the lock (a slow SSD write)."""
    def install(store):
        put_filled = store.ssd.put_filled

        def slow(items, fill):
            time.sleep(0.002)
            return put_filled(items, fill)
        monkeypatch.setattr(store.ssd, "put_filled", slow)
    return install


_EXPECTED: dict[bytes, bytes] = {}


def expected(key: bytes) -> bytes:
    if key not in _EXPECTED:
        _EXPECTED[key] = kv_block(key)
    return _EXPECTED[key]


def hammer(seconds: float, workers: list[Callable[[], None]],
           allowed: tuple[type[BaseException], ...] = (),
           until: Callable[[dict[str, int]], bool] | None = None) -> dict[str, int]:
    """Run each worker in a loop on its own thread; the first unexpected error fails the test.
    Returns how often each allowed error was raised.

    Runs `seconds`, then on until `until(seen)` holds (what the test needs to have happened:
    a demotion, a reaped lease...; on a loaded machine that can take longer), failing after
    GOAL_DEADLINE_S."""
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
    end = time.monotonic() + GOAL_DEADLINE_S
    reached = until is None or until(seen)
    while not reached and not stop.is_set() and time.monotonic() < end:
        stop.wait(0.05)
        reached = until(seen)
    stop.set()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a worker is stuck (deadlock?)"
    if errors:
        raise errors[0]
    assert reached, f"what the test waits for did not happen within {GOAL_DEADLINE_S} s: {seen}"
    return seen


def tier_count(store, tier: str, name: str) -> int:
    with store.state.lock:
        return int(store.tier_counters[tier][name])


def counter(store, name: str) -> int:
    with store.state.lock:
        return int(store.counters[name])


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
    with store.state.lock:
        offsets = [e.host for e in store.index.entries() if e.host is not None]
        assert len(offsets) == len(set(offsets)), "two blocks share a host slot"
        assert all(store.host.allocator.is_allocated(o) for o in offsets), "block in a freed slot"
        for lease in store.leases.all():
            if lease.kind == "read":
                for k, s in zip(lease.keys, lease.slots, strict=True):
                    e = store.index.get(lease.ns_id + k)
                    assert e is not None and e.host == s.offset and e.pins > 0


def check_quiet(store, deadline_s: float = 30.0) -> None:
    """Exact accounting once nothing is in flight (store_helpers.quiet): every allocated host
    byte has one owner."""
    check_live(store)
    with quiet(store, deadline_s):
        _check_accounting(store)


def _check_accounting(store) -> None:
    with store.state.lock:
        assert store.state.busy == 0
        entries = list(store.index.entries())
        owners = [e.host for e in entries if e.host is not None]
        writes = [*store.leases.all(), *store.held_writes.leases()]   # (held: expired)
        owners += [s.offset for lease in writes if lease.kind == "write" for s in lease.slots]
        assert len(owners) == len(set(owners)), "a slot has two owners"
        alloc = store.host.allocator
        assert alloc.used_bytes == sum(alloc.size_of(o) for o in owners), "leaked host slots"
        assert store.host.used_bytes == sum(_aligned(e.size) for e in entries if e.host is not None
                                            ) + sum(_aligned(s.length) for lease in writes
                                                    if lease.kind == "write"
                                                    for s in lease.slots)
        assert len(store.policies["host"]) == sum(e.host is not None for e in entries)
        mv = store.moves
        assert not store.state.demotions and mv.host_room.evicting == 0 \
            and mv.ssd_room.pending == 0
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
            assert store.ssd.used_bytes == sum(map(extent_size, on_ssd.values()))
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
        hammer(SECONDS, [*readers, evictor(store), checker(store)],
               until=lambda _: tier_count(store, "host", "promotions") > 20)
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
        hammer(SECONDS, [*readers, churn, checker(store)],
               until=lambda _: counter(store, "deleted_blocks") > 0)
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
        hammer(SECONDS, [*readers, write, write, checker(store)], allowed=(ResourceExhausted,),
               until=lambda _: min(tier_count(store, "host", "demotions"),
                                   tier_count(store, "host", "promotions"),
                                   tier_count(store, "ssd", "evictions")) > 0)
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
        hammer(SECONDS, [*readers, evict_ssd, refill, checker(store)],
               until=lambda _: tier_count(store, "ssd", "evictions") > 0)
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
                      allowed=(LeaseExpired, NotFound, ResourceExhausted),
                      until=lambda seen: seen.get("LeaseExpired", 0) > 0)
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


def close_once(store, moves: str) -> None:
    """Close the store while the hammer runs, once a few host `moves` (promotions, demotions)
    happened, so more are in flight (a wait on that, with a deadline; not a guessed sleep)."""
    end = time.monotonic() + GOAL_DEADLINE_S
    while tier_count(store, "host", moves) < 3 and time.monotonic() < end:
        time.sleep(0.005)
    store.close()


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

    closer = threading.Thread(target=close_once, args=(store, "promotions"))
    closer.start()
    seen = hammer(1.0, [read, read, read, evictor(store)], allowed=(Unavailable,),
                  until=lambda seen: seen.get("Unavailable", 0) > 0)
    closer.join()
    assert seen.get("Unavailable", 0) > 0
    assert store.state.busy == 0 and store.state.shut
    with pytest.raises(Unavailable):
        store.acquire(ns, prompts[0])


# ------------------------------------------------------------------ demotion off the lock


def test_lock_is_released_while_demoting(tmp_path):
    """While an eviction encodes and writes its victims to SSD, other calls get the lock: a
    lookup, an acquire of another block and an acquire of a victim all run inside put_filled."""
    with make_store(tmp_path) as store:
        ns = namespace(store)
        rng = np.random.default_rng(20)
        victims = random_prompt(rng, 6)[1]
        other = random_prompt(rng, 3)[1]
        store.put(ns, other, [expected(k) for k in other])
        keep = store.acquire(ns, other)                 # pinned: never a victim
        store.put(ns, victims, [expected(k) for k in victims])
        entered, done = threading.Event(), threading.Event()
        seen: dict[str, object] = {}
        put_filled = store.ssd.put_filled

        def slow_put_filled(items, fill):
            entered.set()
            seen["others_ran"] = done.wait(10)          # deadline: fail, never hang
            return put_filled(items, fill)
        store.ssd.put_filled = slow_put_filled

        def other_caller() -> None:
            entered.wait(10)
            seen["lookup"] = store.lookup(ns, other).prefix_blocks
            lease = store.acquire(ns, other)
            check_lease(store, ns, other, lease)
            store.release(lease.id)
            lease = store.acquire(ns, victims)          # host copies stay readable meanwhile
            check_lease(store, ns, victims, lease)
            seen["victims"] = lease
            done.set()
        t = threading.Thread(target=other_caller)
        t.start()
        store.evict("host")
        t.join(30)
        assert not t.is_alive()
        assert seen.get("others_ran") is True, "lookup/acquire waited for the demotion"
        assert seen["lookup"] == len(other)
        lease = seen["victims"]
        assert len(lease.keys) == len(victims)
        # Pinned during their demotion: they keep the host copy and gain an SSD copy.
        for k in victims:
            e = store.index.get(ns + k)
            assert e.host is not None and e.ssd and e.moving is None
        check_lease(store, ns, victims, lease)
        store.release(lease.id)
        store.release(keep.id)
        check_quiet(store)
        store.ssd.put_filled = put_filled
        assert store.evict("host")[1] == len(victims) + len(other)
        check_quiet(store)


def writer(store, ns, rng, n_blocks=6) -> Callable[[], None]:
    """Fresh prompts into a full host: every put evicts and demotes."""
    def one() -> None:
        keys = random_prompt(rng, n_blocks)[1]
        store.put(ns, keys, [expected(k) for k in keys])
    return one


def lookups(store, ns, prompts, rng) -> Callable[[], None]:
    """Prompts that never leave the store are found whole, wherever they are mid-demotion."""
    def one() -> None:
        keys = prompts[int(rng.integers(len(prompts)))]
        assert store.lookup(ns, keys).prefix_blocks == len(keys), "a block went missing"
    return one


def test_demotion_races_lookups_acquires_and_puts(tmp_path, slow_demote):
    # 48 host slots: writers of fresh prompts keep evicting, while readers acquire (and so pin
    # blocks being demoted), lookups run and the same prompts are put again (dedup mid-flight).
    with make_store(tmp_path, host_capacity=48 * 4096) as store:
        slow_demote(store)
        ns = namespace(store)
        prompts = prompts_on_ssd(store, ns)
        rng = np.random.default_rng(21)

        def rewrite() -> None:
            keys = prompts[int(rng.integers(len(prompts)))]
            store.put(ns, keys, [expected(k) for k in keys])
        readers = [reader(store, ns, prompts, np.random.default_rng(i)) for i in range(2)]
        hammer(SECONDS, [*readers, lookups(store, ns, prompts, np.random.default_rng(5)),
                         rewrite, writer(store, ns, np.random.default_rng(6)),
                         writer(store, ns, np.random.default_rng(7)),
                         evictor(store), checker(store)],
               until=lambda _: (tier_count(store, "host", "demotions") > 20
                                and tier_count(store, "host", "promotions") > 0
                                and counter(store, "duplicate_blocks") > 0))
        check_quiet(store)
        stats = store.stats()
        assert stats["tiers"]["host"]["demotions"] > 20
        assert stats["tiers"]["host"]["promotions"] > 0
        assert stats["counters"]["duplicate_blocks"] > 0
        for keys in prompts:                        # every copy still byte-exact
            lease = store.acquire(ns, keys)
            assert len(lease.keys) == len(keys)
            check_lease(store, ns, keys, lease)
            store.release(lease.id)


def test_delete_while_demoting(tmp_path, slow_demote):
    with make_store(tmp_path, host_capacity=48 * 4096) as store:
        slow_demote(store)
        ns = namespace(store)
        prompts = prompts_on_ssd(store, ns)
        rng = np.random.default_rng(22)

        def churn() -> None:
            keys = prompts[int(rng.integers(len(prompts)))]
            store.delete(ns, keys)                  # blocks in flight are skipped
            store.put(ns, keys, [expected(k) for k in keys])
            time.sleep(0.001)
        readers = [reader(store, ns, prompts, np.random.default_rng(i)) for i in range(2)]
        hammer(SECONDS, [*readers, churn, churn, writer(store, ns, np.random.default_rng(8)),
                         evictor(store), checker(store)],
               until=lambda _: (counter(store, "deleted_blocks") > 0
                                and tier_count(store, "host", "demotions") > 0))
        check_quiet(store)
        assert store.stats()["counters"]["deleted_blocks"] > 0
        assert store.stats()["tiers"]["host"]["demotions"] > 0
        store.delete(ns)                            # nothing in flight: everything goes
        assert len(store.index) == 0
        assert store.host.used_bytes == 0 and store.ssd.used_bytes == 0
        check_quiet(store)


@pytest.mark.parametrize("compress", ["always", "never"])
def test_demotion_failure_leaves_every_victim_as_it_was(tmp_path, compress):
    """With compression the encode and then the write can fail; stored raw, only the write
    (which copies each block out of its slot itself)."""
    with make_store(tmp_path, ssd_compress=compress) as store:
        ns = namespace(store)
        keys = random_prompt(np.random.default_rng(23), 12)[1]
        store.put(ns, keys, [expected(k) for k in keys])
        put_filled, encode = store.ssd.put_filled, store.moves.encoder.encode

        def broken(*args):
            raise OSError("injected: disk went away")
        for where in ("put_filled", "encode") if compress == "always" else ("put_filled",):
            if where == "put_filled":
                store.ssd.put_filled = broken
            else:
                store.moves.encoder.encode = broken
            with pytest.raises(OSError, match="injected"):
                store.evict("host")
            store.ssd.put_filled, store.moves.encoder.encode = put_filled, encode
            for k in keys:
                e = store.index.get(ns + k)
                assert e.host is not None and not e.ssd and e.moving is None
            check_quiet(store)
            lease = store.acquire(ns, keys)
            check_lease(store, ns, keys, lease)
            store.release(lease.id)
        assert store.evict("host")[1] == len(keys)  # evictable again, and demoted for real
        lease = store.acquire(ns, keys)
        check_lease(store, ns, keys, lease)
        store.release(lease.id)
        check_quiet(store)


def test_ssd_full_during_demotion_keeps_the_host_copies(tmp_path):
    # Room for one block on SSD: a batch of 6 cannot fit, and the error says so.
    store = make_store(tmp_path, ssd_capacity=3000)
    try:
        ns = namespace(store)
        keys = random_prompt(np.random.default_rng(24), 6)[1]
        store.put(ns, keys, [expected(k) for k in keys])
        with pytest.raises(ResourceExhausted, match="ssd tier full"):
            store.evict("host")
        check_quiet(store)
        lease = store.acquire(ns, keys)
        check_lease(store, ns, keys, lease)
        store.release(lease.id)
    finally:
        store.close(flush=False)        # a flush would hit the same full SSD


def test_demotion_failures_while_hammered(tmp_path, monkeypatch):
    """Every third SSD write fails: callers see the error, no block is lost or leaked."""
    class Injected(Exception):
        pass

    with make_store(tmp_path, host_capacity=48 * 4096) as store:
        ns = namespace(store)
        prompts = prompts_on_ssd(store, ns)
        put_filled = store.ssd.put_filled
        calls = [0]
        count = threading.Lock()

        def flaky(items, fill):
            with count:
                calls[0] += 1
                fail = calls[0] % 3 == 0
            time.sleep(0.001)
            if fail:
                raise Injected("injected write failure")
            return put_filled(items, fill)
        monkeypatch.setattr(store.ssd, "put_filled", flaky)
        written: list[list[bytes]] = []
        rng = np.random.default_rng(25)

        def write() -> None:
            keys = random_prompt(rng, 6)[1]
            store.put(ns, keys, [expected(k) for k in keys])
            written.append(keys)
        readers = [reader(store, ns, prompts, np.random.default_rng(i)) for i in range(2)]
        seen = hammer(SECONDS, [*readers, lookups(store, ns, prompts, np.random.default_rng(3)),
                                write, write, evictor(store), checker(store)],
                      allowed=(Injected,), until=lambda seen: seen.get("Injected", 0) > 0)
        assert seen.get("Injected", 0) > 0
        check_quiet(store)
        monkeypatch.setattr(store.ssd, "put_filled", put_filled)
        for keys in prompts + written:              # everything stored is still whole
            lease = store.acquire(ns, keys)
            assert len(lease.keys) == len(keys), "a block was lost by a failed demotion"
            check_lease(store, ns, keys, lease)
            store.release(lease.id)
        check_quiet(store)


def test_close_waits_for_demotions_in_flight(tmp_path, slow_demote):
    store = make_store(tmp_path, host_capacity=48 * 4096)
    slow_demote(store)
    ns = namespace(store)
    stored: list[list[bytes]] = []
    rngs = [np.random.default_rng(30 + i) for i in range(3)]

    def write(rng: np.random.Generator) -> Callable[[], None]:
        def one() -> None:
            keys = random_prompt(rng, 6)[1]
            store.put(ns, keys, [expected(k) for k in keys])
            stored.append(keys)
        return one

    closer = threading.Thread(target=close_once, args=(store, "demotions"))
    closer.start()
    seen = hammer(1.0, [*(write(r) for r in rngs), evictor(store)], allowed=(Unavailable,),
                  until=lambda seen: seen.get("Unavailable", 0) > 0)
    closer.join()
    assert seen.get("Unavailable", 0) > 0
    assert store.state.busy == 0 and store.state.shut and not store.state.demotions
    assert store.tier_counters["host"]["demotions"] > 0
    # close() flushed after the last demotion settled: every stored block is on SSD, intact.
    with make_store(tmp_path, host_capacity=48 * 4096) as again:
        ns = namespace(again)
        assert len(again.index) == len({k for keys in stored for k in keys})
        for keys in stored:
            lease = again.acquire(ns, keys[:4])
            assert len(lease.keys) == 4
            check_lease(again, ns, keys[:4], lease)
            again.release(lease.id)


def test_delete_and_put_of_blocks_being_demoted(tmp_path):
    """Mid-demotion, a delete skips the blocks (as for promotions) and a put of the same keys
    is a duplicate; once settled the blocks are on SSD only and the accounting is exact."""
    with make_store(tmp_path) as store:
        ns = namespace(store)
        keys = random_prompt(np.random.default_rng(26), 4)[1]
        store.put(ns, keys, [expected(k) for k in keys])
        entered, done = threading.Event(), threading.Event()
        put_filled = store.ssd.put_filled
        got: dict[str, object] = {}

        def slow_put_filled(items, fill):
            entered.set()
            got["ran"] = done.wait(10)
            return put_filled(items, fill)
        store.ssd.put_filled = slow_put_filled

        def meddle() -> None:
            entered.wait(10)
            got["deleted"] = store.delete(ns, keys)
            got["put"] = store.put(ns, keys, [expected(k) for k in keys])
            with store.state.lock:
                check_live(store)
                assert all(store.index.get(ns + k).moving is not None for k in keys)
            done.set()
        t = threading.Thread(target=meddle)
        t.start()
        assert store.evict("host")[1] == len(keys)
        t.join(30)
        assert got["ran"] is True
        assert got["deleted"] == 0
        assert got["put"].stored == 0 and got["put"].duplicates == len(keys)
        for k in keys:
            e = store.index.get(ns + k)
            assert e.host is None and e.ssd and e.moving is None
        check_quiet(store)
        lease = store.acquire(ns, keys)
        check_lease(store, ns, keys, lease)
        store.release(lease.id)
        assert store.delete(ns, keys) == len(keys)
        check_quiet(store)


def test_allocation_waits_for_demotions_in_flight(tmp_path):
    """A full host whose every victim is being demoted by another thread: a put waits for
    those demotions to free their slots (off the lock) rather than fail as if nothing were
    evictable."""
    with make_store(tmp_path, host_capacity=8 * 4096, high_watermark=1.0,
                    low_watermark=1.0) as store:
        ns = namespace(store)
        rng = np.random.default_rng(27)
        full = random_prompt(rng, 8)[1]
        store.put(ns, full, [expected(k) for k in full])
        assert store.host.used_bytes == store.host.capacity
        entered, go = threading.Event(), threading.Event()
        put_filled = store.ssd.put_filled

        def held_put_filled(items, fill):
            entered.set()
            assert go.wait(10)
            return put_filled(items, fill)
        store.ssd.put_filled = held_put_filled
        evicted: list[tuple[int, int]] = []
        evicting = threading.Thread(target=lambda: evicted.append(store.evict("host")))
        evicting.start()
        assert entered.wait(10)
        new = random_prompt(rng, 1)[1]
        result: list = []
        putting = threading.Thread(
            target=lambda: result.append(store.put(ns, new, [expected(new[0])])))
        putting.start()
        # A negative: given 0.2 s, the put must not finish (no room until the demotion ends).
        # A slow machine can only make it pass more often, never fail a correct store.
        putting.join(0.2)
        assert putting.is_alive() and not result, "the put found room in a full host"
        assert store.lookup(ns, full).prefix_blocks == len(full)   # the lock is free meanwhile
        go.set()
        evicting.join(30)
        putting.join(30)
        assert not evicting.is_alive() and not putting.is_alive()
        assert evicted == [(8 * 4096, 8)]
        assert result and result[0].stored == 1
        store.ssd.put_filled = put_filled
        check_quiet(store)
        lease = store.acquire(ns, new)
        check_lease(store, ns, new, lease)
        store.release(lease.id)
