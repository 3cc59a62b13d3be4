"""Round trips on the engine's path: once warm, a store waits on one (its Commit, which also
reserves the next store's slots) and a load on one (Acquire; its lease is released afterwards by
the client's lease thread, off the load's path). Counted by the daemon's own RPC metrics.
"""

from __future__ import annotations

import time
from collections import Counter

import grpc
import kvstore_client.leases
import kvstore_client.writes
import numpy as np
import pytest
import torch
import xxhash
from kvstore_client import KVLayout, connect
from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client._proto import kvstore_pb2_grpc as pb_grpc

from tests.daemon import cleanup, rpc_counts, start_daemon

T = 16
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=T, dtype="float16")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    d = start_daemon(tmp_path_factory.mktemp("round-trips"))
    try:
        yield d
    finally:
        cleanup(d)


def rpcs(d) -> Counter:
    """Successful RPCs the daemon finished, by method (its /metrics page)."""
    return Counter({method: n for (code, method), n in rpc_counts(d).items()
                    if code == "OK"})


def active_leases(d) -> int:
    """Leases the daemon holds, seen by another client (one's own Stats gives its spares back)."""
    with connect(d.address, transport="grpc") as watcher:
        return watcher.stats()["active_leases"]


def wait_for(pred, deadline_s: float = 20.0) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def prompt(seed: int, blocks: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, blocks * T)


def make_kv(seed: int, blocks: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, blocks * T, 2, 64, generator=g).to(torch.float16)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16)


def counter(d, name: str) -> int:
    with connect(d.address, transport="grpc") as watcher:
        return int(watcher.stats()["counters"].get(name, 0))


def test_warm_store_and_load_wait_on_one_round_trip_each(daemon, monkeypatch) -> None:
    monkeypatch.setattr(kvstore_client.leases, "SPARE_IDLE_S", 60.0)
    # A finished read lease waits CARRY_WAIT_S for a call to carry its release. Long here, so
    # that the next store's Commit carries it however slowly this machine runs the loop; the
    # last one, with nothing after it, goes back in a Release the lease thread sends itself.
    monkeypatch.setattr(kvstore_client.leases, "CARRY_WAIT_S", 60.0)
    with connect(daemon.address, transport="shm") as c:
        ns = c.namespace(LAYOUT, model="rt/steady")
        assert ns.store(prompt(1, 4), make_kv(1, 4)) == 4     # cold: LookupReserve + Commit
        before, carried = rpcs(daemon), counter(daemon, "releases_carried")
        for r in range(3):
            ids, kv = prompt(10 + r, 4), make_kv(10 + r, 4)
            assert ns.store(ids, kv) == 4
            if r == 2:
                monkeypatch.setattr(kvstore_client.leases, "CARRY_WAIT_S", 0.05)
            out = torch.zeros_like(kv)
            assert ns.load(ids, out) == 4 * T
            assert torch.equal(bits(out), bits(kv))
        assert wait_for(lambda: active_leases(daemon) == 1)     # only the spare is left
        d = rpcs(daemon) - before
        carried = counter(daemon, "releases_carried") - carried
        assert carried == 2 and d["Release"] == 1
        assert d["LookupReserve"] == 0 and d["Reserve"] == 0    # every slot reserved ahead
        assert d["Commit"] == 3 and d["Acquire"] == 3
        assert d["Lookup"] <= 3          # the cached-prefix check, overlapped with the copy
        assert counter(daemon, "reserve_ahead") >= 4
        assert c.counters["checksum_failures"] == 0 and c.counters["leases_lost"] == 0


def test_store_into_a_reserved_lease_skips_the_cached_prefix(daemon, monkeypatch) -> None:
    """The lookup answers while the last block is being filled: the cached blocks before it
    are never copied, and the commit publishes the new ones from the slots they were filled in.
    """
    monkeypatch.setattr(kvstore_client.writes, "_AHEAD_CHUNK_BYTES", LAYOUT.block_bytes)
    with connect(daemon.address, transport="shm") as c:
        ns = c.namespace(LAYOUT, model="rt/prefix")
        ids, kv = prompt(2, 4), make_kv(2, 4)
        keys = ns.keys(ids)
        assert ns.store(ids[:2 * T], kv[:, :, :2 * T].contiguous()) == 2
        assert ns.store(prompt(3, 4), make_kv(3, 4)) == 4       # leaves a 4-slot spare
        assert ns._writer.spare is not None and len(ns._writer.spare.slots) == 4
        ns._writer.prefix_seen = True          # as after a store that found blocks cached
        src = kv.view(torch.int16).numpy()
        filled: list[int] = []
        lookups: list = []               # the store's Lookup, sent as a future
        send = c.call_future

        def call_future(method: str, request, timeout=None):
            fut = send(method, request, timeout)
            lookups.append((method, fut))
            return fut
        monkeypatch.setattr(c, "call_future", call_future)

        def fill(base: np.ndarray, offsets, first: int) -> None:
            for j, off in enumerate(offsets):
                filled.append(first + j)
                if len(filled) == 1:     # the lookup's answer arrives meanwhile
                    assert [m for m, _ in lookups] == ["Lookup"]
                    lookups[0][1].result(timeout=30)
                base[off:off + LAYOUT.block_bytes].view(np.int16)[:] = \
                    src[:, :, (first + j) * T:(first + j + 1) * T].reshape(-1)
        before = rpcs(daemon)
        assert ns.store_blocks(keys, fill) == 2
        # Block 3 alone first, unless the answer beat even that; the cached two never.
        assert sorted(filled) == [2, 3]
        d = rpcs(daemon) - before
        assert d["LookupReserve"] == 0 and d["Reserve"] == 0 and d["Commit"] == 1
        out = torch.zeros_like(kv)
        assert ns.load(ids, out) == 4 * T
        assert torch.equal(bits(out), bits(kv))


def test_a_store_that_expects_no_cached_prefix_copies_it_and_learns(daemon) -> None:
    """After stores of new blocks only, the next store does not look up first: a cached prefix
    is copied again, the daemon keeps its own copy (duplicates), and the next store looks up."""
    with connect(daemon.address, transport="shm") as c:
        ns = c.namespace(LAYOUT, model="rt/learn")
        ids, kv = prompt(20, 4), make_kv(20, 4)
        assert ns.store(ids[:2 * T], kv[:, :, :2 * T].contiguous()) == 2
        assert ns.store(prompt(21, 4), make_kv(21, 4)) == 4
        assert not ns._writer.prefix_seen
        before = rpcs(daemon)
        other = make_kv(22, 4)              # what a wrong copy of the prefix would serve
        other[:, :, 2 * T:] = kv[:, :, 2 * T:]
        assert ns.store(ids, other) == 2    # blocks 0-1 copied, refused as duplicates
        assert (rpcs(daemon) - before)["Lookup"] == 0 and ns._writer.prefix_seen
        out = torch.zeros_like(kv)
        assert ns.load(ids, out) == 4 * T
        assert torch.equal(bits(out), bits(kv))     # the first commit's bytes, all four
        before = rpcs(daemon)
        assert ns.store(prompt(23, 4), make_kv(23, 4)) == 4
        assert (rpcs(daemon) - before)["Lookup"] == 1


def test_an_all_cached_store_keeps_its_spare_and_an_idle_spare_goes_back(daemon,
                                                                         monkeypatch) -> None:
    monkeypatch.setattr(kvstore_client.leases, "SPARE_IDLE_S", 60.0)
    with connect(daemon.address, transport="shm") as c:
        ns = c.namespace(LAYOUT, model="rt/cached")
        ids, kv = prompt(4, 3), make_kv(4, 3)
        assert ns.store(ids, kv) == 3
        assert ns.store(ids, kv) == 0       # copied again, refused as duplicates: it learns
        spare = ns._writer.spare.lease_id
        assert ns.store(ids, kv) == 0       # looked up first: nothing copied, nor committed
        assert ns._writer.spare is not None and ns._writer.spare.lease_id == spare
        assert active_leases(daemon) == 1
        monkeypatch.setattr(kvstore_client.leases, "SPARE_IDLE_S", 0.2)
        assert ns.store(prompt(5, 3), make_kv(5, 3)) == 3
        # Nobody stores again: the client gives the spare back by itself.
        assert wait_for(lambda: active_leases(daemon) == 0)


def test_delete_after_load_sees_the_released_lease(daemon) -> None:
    with connect(daemon.address, transport="shm") as c:
        ns = c.namespace(LAYOUT, model="rt/delete")
        ids, kv = prompt(6, 4), make_kv(6, 4)
        assert ns.store(ids, kv) == 4
        assert ns.load(ids, torch.zeros_like(kv)) == 4 * T
        assert ns.delete(ns.keys(ids)) == 4     # the load's lease was released first
        assert ns.lookup(ids) == 0


def test_store_after_a_restart_drops_the_old_spare(tmp_path) -> None:
    d = start_daemon(tmp_path)
    try:
        with connect(d.address, transport="shm") as c:
            ns = c.namespace(LAYOUT, model="rt/restart")
            assert ns.store(prompt(7, 2), make_kv(7, 2)) == 2
            assert ns._writer.spare is not None
            d.stop()
            d.start()
            ids, kv = prompt(8, 2), make_kv(8, 2)
            assert ns.store(ids, kv) == 2
            out = torch.zeros_like(kv)
            assert ns.load(ids, out) == 2 * T
            assert torch.equal(bits(out), bits(kv))
    finally:
        cleanup(d)


def test_commit_reserve_ahead_and_first_slot_on_the_wire(daemon) -> None:
    big = pb.KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16,
                      dtype="bfloat16")
    with daemon.channel() as ch, connect(daemon.address, transport="shm") as c:
        c.namespace(LAYOUT, model="rt/wire-map")           # maps the pool, to hash the slots
        pool = c.pool.slab.array

        def sums(slots) -> list[int]:
            return [xxhash.xxh3_64_intdigest(pool[s.offset:s.offset + s.length])
                    for s in slots]
        stub = pb_grpc.KVStoreStub(ch)
        reg = stub.RegisterNamespace(pb.RegisterNamespaceRequest(
            spec=pb.NamespaceSpec(model="rt/wire", layout=big)), timeout=10)
        ns = reg.namespace_id
        keys = [xxhash.xxh3_128_digest(f"w{i}".encode()) for i in range(3)]
        lease = stub.Reserve(pb.ReserveRequest(namespace_id=ns, count=3), timeout=10).lease
        # More keys than the slots after first_slot: refused, nothing stored.
        with pytest.raises(grpc.RpcError) as ei:
            stub.Commit(pb.CommitRequest(lease_id=lease.lease_id, keys=keys, first_slot=1,
                                         checksums=[1, 2, 3]), timeout=10)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "from slot 1" in ei.value.details()
        # Host slots committed without checksums: refused (a late write of a client whose
        # lease on them expired would be published as these blocks).
        with pytest.raises(grpc.RpcError) as ei:
            stub.Commit(pb.CommitRequest(lease_id=lease.lease_id, keys=keys[1:], first_slot=1),
                        timeout=10)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "no checksums" in ei.value.details()
        # Slot 0 unused, keys[1:] from slots 1 and 2; far more slots ahead than the pool holds:
        # the commit stands, without a next lease.
        r = stub.Commit(pb.CommitRequest(lease_id=lease.lease_id, keys=keys[1:], first_slot=1,
                                         parent=keys[0], reserve_next=4096,
                                         checksums=sums(lease.slots[1:])), timeout=10)
        assert r.stored == 2 and not r.HasField("next_lease")
        look = stub.Lookup(pb.LookupRequest(namespace_id=ns, keys=keys[1:]), timeout=10)
        assert look.prefix_blocks == 2
        r = stub.Reserve(pb.ReserveRequest(namespace_id=ns, count=1), timeout=10).lease
        nxt = stub.Commit(pb.CommitRequest(lease_id=r.lease_id, keys=keys[:1], reserve_next=2,
                                           next_ttl_s=5, checksums=sums(r.slots)),
                          timeout=10).next_lease
        assert len(nxt.slots) == 2 and nxt.deadline - time.time() <= 5.5
        stub.Release(pb.ReleaseRequest(lease_id=nxt.lease_id), timeout=10)
        counters = stub.Stats(pb.StatsRequest(), timeout=10).counters
        assert counters["reserve_ahead_refused"] >= 1 and counters["reserve_ahead"] >= 1


def test_reserve_ahead_takes_free_room_only(tmp_path) -> None:
    """A Commit's reservation for a store that may not come never evicts: in a full pool it is
    skipped (the next store reserves, evicting as it must) and the commit stands."""
    d = start_daemon(tmp_path, {"host.capacity": "4MiB"})
    try:
        with connect(d.address, transport="shm") as c:
            ns = c.namespace(LAYOUT, model="rt/full")
            for r in range(8):                  # 8 x 32 blocks of 16 KiB: twice the pool
                assert ns.store(prompt(100 + r, 32), make_kv(100 + r, 32)) == 32

            def host() -> dict:
                with connect(d.address, transport="grpc") as w:
                    return w.stats()["tiers"]["host"]
            last = [host()]

            def settled() -> bool:              # background demotion has finished
                now = host()
                same = now == last[0]
                last[0] = now
                return same
            assert wait_for(settled)
            cap = last[0]["capacity_bytes"]
            with d.channel() as ch:
                stub = pb_grpc.KVStoreStub(ch)
                lease = stub.Reserve(pb.ReserveRequest(namespace_id=ns.ns_id, count=1),
                                     timeout=10).lease
                assert wait_for(settled)        # the demotion this Reserve may have woken
                before = last[0]
                room = 0.95 * cap - before["used_bytes"]
                assert 0 <= room < 64 * LAYOUT.block_bytes
                (slot,) = lease.slots
                view = c.pool.slab.array[slot.offset:slot.offset + slot.length]
                r = stub.Commit(pb.CommitRequest(
                    lease_id=lease.lease_id, keys=[b"k" * 16], reserve_next=64,
                    checksums=[xxhash.xxh3_64_intdigest(view)]), timeout=10)
                assert r.stored == 1 and not r.HasField("next_lease")
                assert host()["evictions"] == before["evictions"]
                counters = stub.Stats(pb.StatsRequest(), timeout=10).counters
                assert counters["reserve_ahead_refused"] >= 1
    finally:
        cleanup(d)
