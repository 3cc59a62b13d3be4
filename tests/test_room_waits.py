"""Writers waiting for host room (kvstore/moves/room_waits.py): a landing hands its room to the
waiters it can serve and wakes no other, every block stays intact, and a wait still ends at
its deadline.

Real store, real SSD tier and real threads; the SSD writes are held at a gate so the flights
land when the test says. Wake-ups are counted with the store lock's own timing
(kvstore/lock_timing.py, on through its environment variable): each is a hold of the lock
taken in `_wait_landing`.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from kvstore_client.errors import ResourceExhausted

from kvstore import lock_timing
from kvstore.moves import host_room

from .store_helpers import make_store, namespace, random_prompt
from .test_store_concurrency import check_lease, check_quiet, expected

BLOCK = 4096


def _wait_for(cond, what: str, seconds: float = 20.0) -> None:
    end = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.005)


def _wakeups(lock) -> int:
    """Holds of the store lock that began with a waiter for room waking up."""
    return sum(s.n for k, s in lock.holds.items() if "_wait_landing" in k.split("==>")[0])


def _gated_writes(store) -> tuple[list[threading.Event], list[threading.Event]]:
    """Hold the i-th SSD write until gates[i] is set (the first four writes; later ones run as
    they come); entered[i] is set when it starts."""
    entered = [threading.Event() for _ in range(4)]
    gates = [threading.Event() for _ in range(4)]
    put_filled = store.ssd.put_filled
    calls = []

    def held(items, fill):
        i = len(calls)
        calls.append(i)
        if i >= len(gates):
            return put_filled(items, fill)
        entered[i].set()
        assert gates[i].wait(30)
        return put_filled(items, fill)
    store.ssd.put_filled = held
    return entered, gates


def _evict(store, nbytes: int, out: list) -> threading.Thread:
    def run() -> None:
        with store.state.lock:
            out.append(store.moves.host_room.evict(nbytes))
    t = threading.Thread(target=run)
    t.start()
    return t


def _flights(store, seed: int, *sizes: int):
    """A full pool of 8 one-block prompts, its SSD writes gated, and one eviction thread per
    size in `sizes`, each in flight (its write entered) before the next starts. Returns
    (ns, rng, full, entered, gates, evicted, threads)."""
    ns = namespace(store)
    rng = np.random.default_rng(seed)
    full = random_prompt(rng, 8)[1]
    store.put(ns, full, [expected(k) for k in full])
    entered, gates = _gated_writes(store)
    evicted: list = []
    threads = []
    for i, size in enumerate(sizes):
        threads.append(_evict(store, size, evicted))
        assert entered[i].wait(10)
    return ns, rng, full, entered, gates, evicted, threads


def test_a_landing_wakes_only_the_writers_it_serves(tmp_path, monkeypatch):
    """Six writers wait on a full host while two batches are demoted: the first landing frees
    two slots and wakes exactly the two writers it hands them to; the second serves the rest.
    (With one condition for all, the first landing woke all six and four went back to
    sleep: ten wake-ups, not six.)"""
    monkeypatch.setenv(lock_timing.ENV, str(tmp_path / "lock.json"))
    with make_store(tmp_path, host_capacity=8 * BLOCK, high_watermark=1.0,
                    low_watermark=1.0) as store:
        lock = store.state.lock
        assert isinstance(lock, lock_timing.TimedRLock)
        ns, rng, full, entered, gates, evicted, (first, second) = _flights(
            store, 31, 2 * BLOCK, 6 * BLOCK)
        room = store.moves.host_room
        news = [random_prompt(rng, 1)[1] for _ in range(6)]
        results: list = []

        def put(keys) -> None:
            results.append(store.put(ns, keys, [expected(keys[0])]))
        writers = [threading.Thread(target=put, args=(k,)) for k in news]
        for t in writers:
            t.start()
        _wait_for(lambda: room._waiting == 6, "six writers waiting for room")
        before = _wakeups(lock)
        gates[0].set()
        first.join(30)
        _wait_for(lambda: len(results) == 2, "two writers served by the first landing")
        gates[1].set()
        second.join(30)
        for t in writers:
            t.join(30)
        assert not any(t.is_alive() for t in writers + [first, second])
        assert sorted(evicted) == [(2 * BLOCK, 2), (6 * BLOCK, 6)]
        assert [r.stored for r in results] == [1] * 6
        assert _wakeups(lock) - before == 6
        for g in gates:
            g.set()
        check_quiet(store)
        for keys in news:
            lease = store.acquire(ns, keys)
            assert len(lease.keys) == 1
            check_lease(store, ns, keys, lease)
            store.release(lease.id)
        lease = store.acquire(ns, full)                 # the victims, back from SSD
        assert len(lease.keys) == len(full)
        check_lease(store, ns, full, lease)
        store.release(lease.id)
        check_quiet(store)


def test_a_waiting_writer_still_gives_up_at_its_deadline(tmp_path, monkeypatch):
    """No landing comes: the writer's wait ends at ROOM_WAIT_S with ResourceExhausted, it is no
    longer counted as waiting, and its slot is not taken when the flight lands later."""
    monkeypatch.setattr(host_room, "ROOM_WAIT_S", 0.3)
    with make_store(tmp_path, host_capacity=8 * BLOCK, high_watermark=1.0,
                    low_watermark=1.0) as store:
        ns, rng, full, entered, gates, evicted, (t,) = _flights(store, 32, 8 * BLOCK)
        new = random_prompt(rng, 1)[1]
        with pytest.raises(ResourceExhausted):
            store.put(ns, new, [expected(new[0])])
        room = store.moves.host_room
        assert room._waiting == 0 and not room._waits.wants
        assert store.state.counters["host_room_wait_timeouts"] == 1
        gates[0].set()
        t.join(30)
        for g in gates:
            g.set()
        assert evicted == [(8 * BLOCK, 8)]
        check_quiet(store)
        assert store.host.used_bytes == 0
        assert store.lookup(ns, new).prefix_blocks == 0


def test_a_reserve_short_of_room_is_served_as_one(tmp_path, monkeypatch):
    """Two Reserves of three slots wait on a full host while two batches of four are demoted:
    the first landing hands the first Reserve all three of its slots (and the second the one
    left, which it keeps while it waits for the rest); the second landing completes it. Each
    Reserve wakes once, and its lease's slots are its own."""
    monkeypatch.setenv(lock_timing.ENV, str(tmp_path / "lock.json"))
    with make_store(tmp_path, host_capacity=8 * BLOCK, high_watermark=1.0,
                    low_watermark=1.0) as store:
        lock = store.state.lock
        ns, rng, full, entered, gates, evicted, (first, second) = _flights(
            store, 33, 4 * BLOCK, 4 * BLOCK)
        room = store.moves.host_room
        leases: list = []

        def reserve() -> None:
            leases.append(store.reserve(ns, 3))
        r1 = threading.Thread(target=reserve)
        r1.start()
        _wait_for(lambda: room._waiting == 1, "the first Reserve waiting")
        r2 = threading.Thread(target=reserve)
        r2.start()
        _wait_for(lambda: room._waiting == 2, "both Reserves waiting")
        before = _wakeups(lock)
        gates[0].set()
        r1.join(20)
        assert not r1.is_alive() and len(leases) == 1 and len(leases[0].slots) == 3
        assert r2.is_alive()
        gates[1].set()
        r2.join(20)
        first.join(20)
        second.join(20)
        assert not r2.is_alive() and len(leases) == 2 and len(leases[1].slots) == 3
        assert _wakeups(lock) - before == 2
        for g in gates:
            g.set()
        offsets = [s.offset for lease in leases for s in lease.slots]
        assert len(set(offsets)) == 6
        for lease in leases:
            keys = random_prompt(rng, 3)[1]
            for s, k in zip(lease.slots, keys, strict=True):
                store.host.view(s.offset, s.length)[:] = np.frombuffer(expected(k), np.uint8)
            assert store.commit(lease.id, keys).stored == 3
            got = store.acquire(ns, keys)
            check_lease(store, ns, keys, got)
            store.release(got.id)
        check_quiet(store)



def _reserve_behind_a_run(store, rng, run_blocks: int, ns):
    """A host full of eight one-block prompts, an eviction run of `run_blocks` in batches of
    four (its SSD writes gated; the first batch is the four oldest prompts), a reader holding
    two of the first batch's victims (so its landing frees two slots, not four), and a
    Reserve of three waiting behind the run. Returns (entered, gates, evicted, runner,
    reserver, leases, errors, readers)."""
    prompts = [random_prompt(rng, 1)[1] for _ in range(8)]
    for keys in prompts:
        store.put(ns, keys, [expected(keys[0])])
    entered, gates = _gated_writes(store)
    evicted: list = []
    runner = _evict(store, run_blocks * BLOCK, evicted)
    assert entered[0].wait(10)
    readers = [store.acquire(ns, keys) for keys in prompts[:2]]
    assert [len(r.keys) for r in readers] == [1, 1]
    room = store.moves.host_room
    leases: list = []
    errors: list = []

    def reserve() -> None:
        try:
            leases.append(store.reserve(ns, 3))
        except ResourceExhausted as exc:
            errors.append(exc)
    reserver = threading.Thread(target=reserve)
    reserver.start()
    _wait_for(lambda: room._waiting == 1, "the Reserve waiting")
    return entered, gates, evicted, runner, reserver, leases, errors, readers


def _commit_and_check(store, ns, rng, lease) -> None:
    keys = random_prompt(rng, len(lease.slots))[1]
    for s, k in zip(lease.slots, keys, strict=True):
        store.host.view(s.offset, s.length)[:] = np.frombuffer(expected(k), np.uint8)
    assert store.commit(lease.id, keys).stored == len(keys)
    got = store.acquire(ns, keys)
    check_lease(store, ns, keys, got)
    store.release(got.id)


def _served_three(reserver, runner, leases, errors) -> None:
    """The Reserve and the run both ended, the Reserve with its three slots."""
    reserver.join(20)
    runner.join(20)
    assert not reserver.is_alive() and not runner.is_alive()
    assert not errors and len(leases) == 1 and len(leases[0].slots) == 3


def _wind_up(store, ns, rng, gates, readers, lease) -> None:
    """Open every gate, drop the readers, and show the Reserve's slots store and serve."""
    for g in gates:
        g.set()
    for r in readers:
        store.release(r.id)
    _commit_and_check(store, ns, rng, lease)
    check_quiet(store)


def test_a_writer_left_short_sleeps_through_the_run(tmp_path, monkeypatch):
    """A Reserve of three waits on a run that evicts in two batches: the first landing hands it
    the two slots it frees while no batch is in flight, but the run picks its second batch in
    the same hold, so the Reserve sleeps on and wakes once, served, at the second landing.
    (Woken at the first landing, it found the second batch in flight and slept again: two
    wake-ups.)"""
    monkeypatch.setenv(lock_timing.ENV, str(tmp_path / "lock.json"))
    monkeypatch.setattr(host_room, "BATCH_BLOCKS", 4)
    with make_store(tmp_path, host_capacity=8 * BLOCK, high_watermark=1.0,
                    low_watermark=1.0) as store:
        lock = store.state.lock
        ns = namespace(store)
        rng = np.random.default_rng(34)
        entered, gates, evicted, runner, reserver, leases, errors, readers = (
            _reserve_behind_a_run(store, rng, 8, ns))
        before = _wakeups(lock)
        gates[0].set()
        assert entered[1].wait(10)              # the run's second batch, in flight
        assert reserver.is_alive()
        gates[1].set()
        _served_three(reserver, runner, leases, errors)
        assert evicted == [(6 * BLOCK, 6)]
        assert _wakeups(lock) - before == 1
        _wind_up(store, ns, rng, gates, readers, leases[0])


def test_a_writer_left_short_wakes_when_the_run_ends(tmp_path, monkeypatch):
    """The run is one batch: the Reserve left one slot short sleeps through the landing, wakes
    when the run ends with nothing in flight (not at its deadline), and evicts the block it
    still lacks itself. (No background demoter: its runs' ends would wake the Reserve too.)"""
    monkeypatch.setenv(lock_timing.ENV, str(tmp_path / "lock.json"))
    monkeypatch.setattr(host_room, "BATCH_BLOCKS", 4)
    monkeypatch.setattr(host_room, "ROOM_WAIT_S", 60.0)
    with make_store(tmp_path, host_capacity=8 * BLOCK, high_watermark=1.0,
                    low_watermark=1.0, background_demotion=False) as store:
        lock = store.state.lock
        ns = namespace(store)
        rng = np.random.default_rng(35)
        entered, gates, evicted, runner, reserver, leases, errors, readers = (
            _reserve_behind_a_run(store, rng, 4, ns))
        before = _wakeups(lock)
        gates[1].set()                          # the Reserve's own eviction is not held
        gates[0].set()
        _served_three(reserver, runner, leases, errors)
        assert evicted == [(2 * BLOCK, 2)]
        assert _wakeups(lock) - before == 1
        assert store.state.counters["host_room_wait_timeouts"] == 0
        _wind_up(store, ns, rng, gates, readers, leases[0])


def test_a_writer_sleeping_through_a_run_gives_up_at_its_deadline(tmp_path, monkeypatch):
    """The run's second batch does not land in time: the Reserve holding two handed slots
    still gives up at ROOM_WAIT_S, gives them back, and is no longer counted as waiting."""
    monkeypatch.setattr(host_room, "BATCH_BLOCKS", 4)
    monkeypatch.setattr(host_room, "ROOM_WAIT_S", 0.5)
    with make_store(tmp_path, host_capacity=8 * BLOCK, high_watermark=1.0,
                    low_watermark=1.0) as store:
        ns = namespace(store)
        rng = np.random.default_rng(36)
        entered, gates, evicted, runner, reserver, leases, errors, readers = (
            _reserve_behind_a_run(store, rng, 8, ns))
        gates[0].set()
        assert entered[1].wait(10)
        reserver.join(10)
        assert not reserver.is_alive()
        assert not leases and len(errors) == 1
        room = store.moves.host_room
        assert room._waiting == 0 and not room._waits.wants
        assert store.state.counters["host_room_wait_timeouts"] == 1
        gates[1].set()
        runner.join(20)
        for g in gates:
            g.set()
        assert evicted == [(6 * BLOCK, 6)]
        for r in readers:
            store.release(r.id)
        check_quiet(store)
        assert store.host.used_bytes == 2 * BLOCK      # the two the reader held


def test_a_load_short_of_room_is_counted_with_its_wait(tmp_path, monkeypatch):
    """A promotion that finds the pool full waits for the landing that frees it, and that wait
    is counted apart from the writers' (promotion_room_waits, _seconds: an operator's view of
    loads held up by demotion); a promotion that finds a free slot counts nothing."""
    with make_store(tmp_path, host_capacity=8 * BLOCK, high_watermark=1.0,
                    low_watermark=1.0) as store:
        ns = namespace(store)
        rng = np.random.default_rng(37)
        cold = [random_prompt(rng, 1)[1] for _ in range(2)]
        for keys in cold:
            store.put(ns, keys, [expected(keys[0])])
        store.evict("host")
        counters = store.state.counters
        lease = store.acquire(ns, cold[0])               # room free: no wait counted
        check_lease(store, ns, cold[0], lease)
        store.release(lease.id)
        assert counters["promotion_room_waits"] == 0
        store.evict("host")
        _, _, _, _, gates, evicted, (t,) = _flights(store, 38, 8 * BLOCK)
        got: list = []
        loader = threading.Thread(target=lambda: got.append(store.acquire(ns, cold[1])))
        loader.start()
        room = store.moves.host_room
        _wait_for(lambda: room._waiting == 1, "the load waiting for room")
        held = 0.2
        time.sleep(held)
        gates[0].set()
        t.join(30)
        loader.join(30)
        for g in gates:
            g.set()
        assert evicted == [(8 * BLOCK, 8)] and len(got) == 1
        check_lease(store, ns, cold[1], got[0])
        store.release(got[0].id)
        assert counters["promotion_room_waits"] == 1
        assert held <= counters["promotion_room_wait_seconds"] < 30
        check_quiet(store)
