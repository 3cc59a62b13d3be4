"""Release of many leases in one call (ReleaseRequest.lease_ids), against a real daemon: every
lease it names ends and its slots come back, one it may not release (unknown, released
already, another tenant's) costs only that one and stays held, the cap on ids is enforced,
and the SDK gives back the leases it releases together in one Release call, falling back to
one call each against a daemon that predates lease_ids (the real daemon behind a proxy that
drops the field, as an older daemon's parser does).
"""

from __future__ import annotations

import textwrap
from collections import Counter
from concurrent import futures

import grpc
import kvstore_client.leases
import numpy as np
import pytest
import torch
from kvstore_client import KVLayout, connect
from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client._proto import kvstore_pb2_grpc as pbg
from kvstore_client.common.limits import MAX_CARRIED_RELEASES

from kvstore.tenants import hash_token
from tests.daemon import cleanup, rpc_counts, start_daemon

T = 16
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=T, dtype="float16")
PB_LAYOUT = pb.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=T,
                        dtype="float16")
TOKENS = {"team-a": "batch-token-a", "team-b": "batch-token-b"}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    d = start_daemon(tmp_path_factory.mktemp("release-batch"))
    try:
        yield d
    finally:
        cleanup(d)


@pytest.fixture
def small_pool(tmp_path):
    """A daemon of its own, whose host pool a test fills with write leases."""
    d = start_daemon(tmp_path, {"host.capacity": "4MiB", "ssd.enabled": False})
    try:
        yield d
    finally:
        cleanup(d)


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("release-batch-tenants")
    f = tmp / "tenants.toml"
    f.write_text(textwrap.dedent(f"""
        [tenants.team-a]
        token_sha256 = "{hash_token(TOKENS['team-a'])}"
        models = ["*"]
        host_quota = "4MiB"
        [tenants.team-b]
        token_sha256 = "{hash_token(TOKENS['team-b'])}"
        models = ["*"]
        host_quota = "4MiB"
    """))
    d = start_daemon(tmp, {"auth.tokens_file": str(f)})
    try:
        yield d
    finally:
        cleanup(d)


def releases(d) -> Counter:
    """Release calls the daemon finished, by status code (its /metrics page)."""
    return Counter({code: n for (code, method), n in rpc_counts(d).items()
                    if method == "Release"})


def active_leases(address: str) -> int:
    """Leases the daemon holds, seen by a client holding none (one's own Stats gives its
    pending releases back first)."""
    with connect(address, transport="grpc") as watcher:
        return watcher.stats()["active_leases"]


def register(stub: pbg.KVStoreStub, model: str, md: tuple | None = None) -> bytes:
    spec = pb.NamespaceSpec(model=model, layout=PB_LAYOUT)
    return stub.RegisterNamespace(pb.RegisterNamespaceRequest(spec=spec), timeout=30,
                                  metadata=md).namespace_id


def reserve(stub: pbg.KVStoreStub, ns: bytes, count: int, md: tuple | None = None) -> str:
    return stub.Reserve(pb.ReserveRequest(namespace_id=ns, count=count), timeout=30,
                        metadata=md).lease.lease_id


def fill_pool(stub: pbg.KVStoreStub, ns: bytes, per: int) -> list[str]:
    """Write leases of `per` slots until the host pool has no room for another."""
    ids: list[str] = []
    for _ in range(1000):
        try:
            ids.append(reserve(stub, ns, per))
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
            return ids
    raise AssertionError("the pool never filled")


def test_one_release_ends_every_lease_it_names_and_their_slots_come_back(small_pool) -> None:
    daemon = small_pool
    with daemon.channel() as ch:
        stub = pbg.KVStoreStub(ch)
        ns = register(stub, "batch/slots")
        ids = fill_pool(stub, ns, 16)
        assert len(ids) >= 8
        before = releases(daemon)
        r = stub.Release(pb.ReleaseRequest(lease_id=ids[0], lease_ids=ids[1:]), timeout=30)
        assert [x.code for x in r.results] == ["OK"] * len(ids)
        assert releases(daemon) - before == Counter(OK=1)      # one call for all of them
        assert active_leases(daemon.address) == 0
        again = fill_pool(stub, ns, 16)         # every slot is free again
        assert len(again) == len(ids)
        r = stub.Release(pb.ReleaseRequest(lease_ids=again), timeout=30)   # lease_id unset
        assert [x.code for x in r.results] == ["OK"] * len(again)
        assert active_leases(daemon.address) == 0


def test_ids_it_cannot_release_cost_only_themselves(daemon) -> None:
    with daemon.channel() as ch:
        stub = pbg.KVStoreStub(ch)
        ns = register(stub, "batch/mixed")
        a, b, gone = (reserve(stub, ns, 1) for _ in range(3))
        stub.Release(pb.ReleaseRequest(lease_id=gone), timeout=30)
        r = stub.Release(pb.ReleaseRequest(
            lease_id="0" * 32, lease_ids=[a, gone, "", "x" * 4096, b, a]), timeout=30)
        got = [(x.code, x.message) for x in r.results]
        assert [c for c, _ in got] == ["NOT_FOUND", "OK", "NOT_FOUND", "INVALID_ARGUMENT",
                                       "NOT_FOUND", "OK", "NOT_FOUND"]
        assert "unknown lease" in got[0][1] and "lease_id is empty" in got[3][1]
        assert all(m == "" for c, m in got if c == "OK")
        assert active_leases(daemon.address) == 0
        # the single form answers as before: its one lease's failure is the call's status
        with pytest.raises(grpc.RpcError) as e:
            stub.Release(pb.ReleaseRequest(lease_id=a), timeout=30)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_more_ids_than_the_cap_is_refused_before_any_ends(daemon) -> None:
    with daemon.channel() as ch:
        stub = pbg.KVStoreStub(ch)
        ns = register(stub, "batch/cap")
        mine = reserve(stub, ns, 1)
        filler = [f"{i:032x}" for i in range(MAX_CARRIED_RELEASES)]
        with pytest.raises(grpc.RpcError) as e:
            stub.Release(pb.ReleaseRequest(lease_id=mine, lease_ids=filler), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"{MAX_CARRIED_RELEASES + 1} lease ids" in e.value.details()
        assert f"limit is {MAX_CARRIED_RELEASES}" in e.value.details()
        assert active_leases(daemon.address) == 1               # not ended
        r = stub.Release(pb.ReleaseRequest(lease_id=mine, lease_ids=filler[1:]), timeout=30)
        assert len(r.results) == MAX_CARRIED_RELEASES and r.results[0].code == "OK"
        assert active_leases(daemon.address) == 0


def test_a_tenant_cannot_release_another_tenants_lease(tenants) -> None:
    ma = (("authorization", f"Bearer {TOKENS['team-a']}"),)
    mb = (("authorization", f"Bearer {TOKENS['team-b']}"),)
    with tenants.channel() as ch:
        stub = pbg.KVStoreStub(ch)
        ns_a, ns_b = register(stub, "batch/t", ma), register(stub, "batch/t", mb)
        a1, a2 = reserve(stub, ns_a, 1, ma), reserve(stub, ns_a, 1, ma)
        b1 = reserve(stub, ns_b, 1, mb)
        r = stub.Release(pb.ReleaseRequest(lease_id=a1, lease_ids=[b1, a2]), timeout=30,
                         metadata=ma)
        assert [x.code for x in r.results] == ["OK", "NOT_FOUND", "OK"]
        assert "unknown lease" in r.results[1].message
        assert "team-b" not in r.results[1].message
        # B's lease is still held: B renews and releases it
        assert stub.RenewLease(pb.RenewLeaseRequest(lease_id=b1), timeout=30,
                               metadata=mb).deadline > 0
        r = stub.Release(pb.ReleaseRequest(lease_ids=[b1, a1]), timeout=30, metadata=mb)
        assert [x.code for x in r.results] == ["OK", "NOT_FOUND"]


def hold_releases(monkeypatch: pytest.MonkeyPatch) -> None:
    """Finished pins and the spare write lease wait for Stats or close() to send them, not
    for the lease thread: the test decides when they go, whatever this machine's speed."""
    monkeypatch.setattr(kvstore_client.leases, "CARRY_WAIT_S", 600.0)
    monkeypatch.setattr(kvstore_client.leases, "SPARE_IDLE_S", 600.0)


def _pins(c, model: str, n: int) -> list:
    ns = c.namespace(LAYOUT, model=model)
    ids = np.random.default_rng(7).integers(0, 50_000, 4 * T)
    kv = torch.randn(2, 2, 4 * T, 2, 64, generator=torch.Generator().manual_seed(7))
    assert ns.store(ids, kv.to(torch.float16)) == 4
    keys = ns.keys(ids)
    pins = [ns.pin(keys[:1 + i % 4]) for i in range(n)]
    assert all(p.blocks for p in pins)
    return pins


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "grpc"])
def test_the_sdk_releases_many_leases_in_one_call(daemon, monkeypatch, lane) -> None:
    hold_releases(monkeypatch)
    held = active_leases(daemon.address)       # others' (none unless a test before failed)
    with connect(daemon.address, transport="shm", lane=lane) as c:
        pins = _pins(c, f"batch/sdk/{lane}", 40)
        c.stats()                       # the store's spare lease goes back (one Release)
        assert active_leases(daemon.address) == held + 40
        before = releases(daemon)
        for p in pins:
            p.release()
        c.stats()                       # sends the 40 pending releases first
        assert releases(daemon) - before == Counter(OK=1)
        assert active_leases(daemon.address) == held
        pins = _pins(c, f"batch/sdk/{lane}/close", 24)
        before = releases(daemon)
    assert releases(daemon) - before == Counter(OK=1)           # close(): one call too
    assert active_leases(daemon.address) == held


# ------------------------------------------------------------------ an older daemon

OLD_UNARY = ("RegisterNamespace", "Lookup", "LookupReserve", "LookupAcquire", "Reserve",
             "Commit", "Acquire", "Release", "RenewLease", "Delete", "Evict", "Flush", "Stats")


def _forward(ch: grpc.Channel, name: str, seen: Counter):
    call = ch.unary_unary(f"/kvstore.v1.KVStore/{name}")

    def handle(raw: bytes, ctx: grpc.ServicerContext) -> bytes:
        if name == "Release":
            # An older daemon's ReleaseRequest has no lease_ids: its parser skips them.
            req = pb.ReleaseRequest.FromString(raw)
            seen["ids_sent"] += 1 + len(req.lease_ids)
            seen["calls"] += 1
            req.ClearField("lease_ids")
            raw = req.SerializeToString()
        try:
            return call(raw, timeout=30)
        except grpc.RpcError as e:
            ctx.abort(e.code(), e.details())
    return handle


def test_against_an_older_daemon_no_lease_is_left_held(daemon, tmp_path, monkeypatch) -> None:
    hold_releases(monkeypatch)
    upstream = daemon.channel()
    seen: Counter = Counter()
    put = upstream.stream_unary("/kvstore.v1.KVStore/Put")
    handlers = {n: grpc.unary_unary_rpc_method_handler(_forward(upstream, n, seen))
                for n in OLD_UNARY}
    handlers["Put"] = grpc.stream_unary_rpc_method_handler(lambda it, ctx: put(it, timeout=30))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("kvstore.v1.KVStore", handlers),))
    sock = tmp_path / "old.sock"
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    try:
        held = active_leases(daemon.address)
        with connect(str(sock), transport="shm") as c:
            pins = _pins(c, "batch/old", 12)
            c.stats()
            assert active_leases(daemon.address) == held + 12
            seen.clear()
            for p in pins:
                p.release()
            c.stats()
            assert active_leases(daemon.address) == held    # none left to its deadline
            # the first call named all 12 and ended one; the other 11 went one call each
            assert seen == Counter(calls=12, ids_sent=12 + 11)
            seen.clear()
            pins = _pins(c, "batch/old/again", 3)
            for p in pins:
                p.release()
            c.stats()                   # remembered: one call each from the start
            assert seen == Counter(calls=4, ids_sent=4)     # the store's spare, the 3 pins
            assert active_leases(daemon.address) == held
    finally:
        server.stop(None)
        upstream.close()
