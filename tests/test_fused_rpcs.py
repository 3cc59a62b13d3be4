"""LookupReserve and LookupAcquire: one round trip each, and the SDK against a daemon without them.

The "older daemon" is the real daemon behind a byte-forwarding gRPC proxy that serves only the
calls a daemon had before these two: exactly what a new SDK meets when the daemon lags behind.
"""

from __future__ import annotations

from concurrent import futures

import grpc
import numpy as np
import pytest
import torch
import xxhash
from kvstore_client import KVLayout, connect
from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client._proto import kvstore_pb2_grpc as pb_grpc
from kvstore_client.common.shm import attach

from tests.daemon import cleanup, start_daemon

LAYOUT = pb.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=16,
                     dtype="float16")
BLOCK = 2 * 2 * 16 * 2 * 64 * 2


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    d = start_daemon(tmp_path_factory.mktemp("fused"))
    try:
        yield d
    finally:
        cleanup(d)


def keys_for(n: int, seed: int) -> list[bytes]:
    return [xxhash.xxh3_128_digest(f"{seed}:{i}".encode()) for i in range(n)]


def code_of(call, *args, **kwargs) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as ei:
        call(*args, **kwargs)
    return ei.value.code()


def test_lookup_reserve_then_lookup_acquire(daemon) -> None:
    with daemon.channel() as ch:
        stub = pb_grpc.KVStoreStub(ch)
        reg = stub.RegisterNamespace(pb.RegisterNamespaceRequest(
            spec=pb.NamespaceSpec(model="fused", layout=LAYOUT)), timeout=10)
        ns = reg.namespace_id
        pool = attach(reg.host_pool.name, reg.host_pool.size)
        keys = keys_for(5, 1)
        data = [np.full(BLOCK, 10 + i, dtype=np.uint8) for i in range(5)]
        try:
            # Nothing cached: prefix 0 and slots for the first max_slots missing keys.
            r = stub.LookupReserve(pb.LookupReserveRequest(namespace_id=ns, keys=keys,
                                                           max_slots=3), timeout=10)
            assert r.prefix_blocks == 0 and r.per_tier["host"] == 0
            assert len(r.lease.slots) == 3 and r.lease.lease_id
            for s, d in zip(r.lease.slots, data, strict=False):
                pool.array[s.offset:s.offset + BLOCK] = d
            c = stub.Commit(pb.CommitRequest(
                lease_id=r.lease.lease_id, keys=keys[:3],
                checksums=[xxhash.xxh3_64_intdigest(d) for d in data[:3]]), timeout=10)
            assert c.stored == 3

            # Three cached: the lease covers keys[3:], every missing one when max_slots is 0.
            r = stub.LookupReserve(pb.LookupReserveRequest(namespace_id=ns, keys=keys),
                                   timeout=10)
            assert r.prefix_blocks == 3 and len(r.lease.slots) == 2
            for s, d in zip(r.lease.slots, data[3:], strict=True):
                pool.array[s.offset:s.offset + BLOCK] = d
            assert stub.Commit(pb.CommitRequest(
                lease_id=r.lease.lease_id, keys=keys[3:], parent=keys[2],
                checksums=[xxhash.xxh3_64_intdigest(d) for d in data[3:]]),
                timeout=10).stored == 2

            # All cached: no lease at all, so nothing to release.
            r = stub.LookupReserve(pb.LookupReserveRequest(namespace_id=ns, keys=keys),
                                   timeout=10)
            assert r.prefix_blocks == 5 and not r.HasField("lease")

            # LookupAcquire: the prefix, its slots, keys and checksums under a read lease.
            a = stub.LookupAcquire(pb.LookupAcquireRequest(
                namespace_id=ns, keys=keys + [b"x" * 16]), timeout=10)
            assert a.prefix_blocks == 5 and a.per_tier["host"] == 5
            assert list(a.lease.keys) == keys and len(a.lease.slots) == 5
            for s, d, cs in zip(a.lease.slots, data, a.lease.checksums, strict=True):
                assert bytes(pool.array[s.offset:s.offset + BLOCK]) == d.tobytes()
                assert cs == xxhash.xxh3_64_intdigest(d)
            stub.Release(pb.ReleaseRequest(lease_id=a.lease.lease_id), timeout=10)

            miss = stub.LookupAcquire(pb.LookupAcquireRequest(namespace_id=ns,
                                                              keys=keys_for(2, 99)), timeout=10)
            assert miss.prefix_blocks == 0 and not miss.HasField("lease")
            assert stub.Stats(pb.StatsRequest(), timeout=10).active_leases == 0
        finally:
            pool.close()


def test_fused_calls_check_their_input(daemon) -> None:
    with daemon.channel() as ch:
        stub = pb_grpc.KVStoreStub(ch)
        ns = stub.RegisterNamespace(pb.RegisterNamespaceRequest(
            spec=pb.NamespaceSpec(model="fused/bad", layout=LAYOUT)), timeout=10).namespace_id
        ok = keys_for(2, 2)
        bad = [
            (stub.LookupReserve, pb.LookupReserveRequest(namespace_id=ns, keys=[])),
            (stub.LookupReserve, pb.LookupReserveRequest(namespace_id=ns, keys=[b"short"])),
            (stub.LookupReserve, pb.LookupReserveRequest(namespace_id=ns, keys=ok, tier="ssd")),
            (stub.LookupReserve, pb.LookupReserveRequest(namespace_id=ns, keys=ok, ttl_s=-1)),
            (stub.LookupAcquire, pb.LookupAcquireRequest(namespace_id=b"x", keys=ok)),
            (stub.LookupAcquire, pb.LookupAcquireRequest(namespace_id=ns, keys=ok, tier="gpu")),
        ]
        for call, req in bad:
            assert code_of(call, req, timeout=10) == grpc.StatusCode.INVALID_ARGUMENT, req
        assert code_of(stub.LookupAcquire, pb.LookupAcquireRequest(
            namespace_id=b"\0" * 16, keys=ok), timeout=10) == grpc.StatusCode.NOT_FOUND


SDK_LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=16,
                      dtype="float16")


def _pin_and_load(c, ns) -> None:
    ids = np.arange(3 * 16) + 500
    kv = torch.randn(2, 2, len(ids), 2, 64).to(torch.float16)
    assert ns.store(ids, kv) == 3
    keys = ns.keys(ids) + [b"m" * 16]
    with ns.pin(keys) as pinned:
        assert pinned.lookup.prefix_blocks == 3 and pinned.lookup.per_tier["host"] == 3
        assert pinned.blocks == 3
        assert c.stats()["active_leases"] == 1            # held until released
        out = torch.zeros_like(kv)
        assert pinned.load_keys(out) == 3
        assert torch.equal(out.view(torch.int16), kv.view(torch.int16))
    assert c.stats()["active_leases"] == 0
    nothing = ns.pin([b"z" * 16])
    assert nothing.blocks == 0 and nothing.lookup.prefix_blocks == 0
    assert nothing.load_keys(torch.zeros_like(kv)) == 0
    nothing.release()


def test_pin_looks_up_and_pins_in_one_call(daemon) -> None:
    with connect(daemon.address, transport="shm") as c:
        ns = c.namespace(SDK_LAYOUT, model="fused/pin")
        _pin_and_load(c, ns)
        assert c.fused_rpcs


# ------------------------------------------------------------------ an older daemon

OLD_UNARY = ("RegisterNamespace", "Lookup", "Reserve", "Commit", "Acquire", "Release",
             "RenewLease", "Retain", "Delete", "Evict", "Flush", "Stats")


def _forward_unary(ch: grpc.Channel, name: str):
    call = ch.unary_unary(f"/kvstore.v1.KVStore/{name}")

    def handle(raw: bytes, ctx: grpc.ServicerContext) -> bytes:
        try:
            out = call(raw, timeout=30)
        except grpc.RpcError as e:
            ctx.abort(e.code(), e.details())
        if name == "RegisterNamespace":
            # An older daemon says nothing of its protocol: the SDK must release its leases
            # with Release calls, not by carrying them on Acquire/Commit (ignored there).
            resp = pb.RegisterNamespaceResponse.FromString(out)
            resp.ClearField("protocol")
            out = resp.SerializeToString()
        return out
    return handle


@pytest.fixture
def old_daemon(daemon, tmp_path):
    """The daemon as one that predates LookupReserve/LookupAcquire (they answer UNIMPLEMENTED)."""
    upstream = daemon.channel()
    get = upstream.unary_stream("/kvstore.v1.KVStore/Get")
    put = upstream.stream_unary("/kvstore.v1.KVStore/Put")
    handlers = {n: grpc.unary_unary_rpc_method_handler(_forward_unary(upstream, n))
                for n in OLD_UNARY}
    handlers["Get"] = grpc.unary_stream_rpc_method_handler(
        lambda raw, ctx: iter(get(raw, timeout=30)))
    handlers["Put"] = grpc.stream_unary_rpc_method_handler(
        lambda it, ctx: put(it, timeout=30))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=[
        ("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)])
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("kvstore.v1.KVStore", handlers),))
    sock = tmp_path / "old.sock"
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    try:
        yield str(sock)
    finally:
        server.stop(None)
        upstream.close()


def test_sdk_falls_back_against_an_older_daemon(old_daemon) -> None:
    lay = SDK_LAYOUT
    ids = np.arange(4 * 16)
    kv = torch.randn(2, 2, len(ids), 2, 64).to(torch.float16)
    with connect(old_daemon, transport="shm") as c:
        ns = c.namespace(lay, model="fused/old")
        assert c.fused_rpcs
        assert ns.store(ids[:32], kv[:, :, :32]) == 2
        assert not c.fused_rpcs                          # UNIMPLEMENTED seen once, remembered
        assert ns.store(ids, kv) == 2                    # Lookup + Reserve: the missing two
        out = torch.zeros_like(kv)
        assert ns.load(ids, out=out) == len(ids)
        assert torch.equal(out.view(torch.int16), kv.view(torch.int16))
        _pin_and_load(c, c.namespace(lay, model="fused/old/pin"))      # Lookup + Acquire
        assert not c.leases.carry
        assert c.stats()["active_leases"] == 0          # every read lease released by itself
