"""Key lists checked in steps (kvstore/keychain.py): the largest requests are refused or served
exactly as before, whichever step the offending key falls in.

Why these cases: the daemon converts and checks a request's keys keychain.STEP at a time, so
that a request naming 65,536 keys never holds the GIL for one long C call while other tenants'
calls wait (bench/dos.py measures that). A repeat or a bad key must still be found wherever it
is: inside the first step, across a step boundary, in the last step, and the index named must
be the key's own.
"""

from __future__ import annotations

import os

import grpc
import pytest
from kvstore_client import KVLayout, connect
from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client._proto import kvstore_pb2_grpc as pbg
from kvstore_client.common.limits import MAX_KEYS
from kvstore_client.wire import encode_put

from kvstore.keychain import STEP
from tests.daemon import cleanup, start_daemon

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_tokens=16,
                  dtype="bfloat16")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("dos-keys"))
    try:
        yield d
    finally:
        cleanup(d)


def fresh(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def refusal(fn) -> str:
    with pytest.raises(grpc.RpcError) as ei:
        fn()
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value
    return ei.value.details()


def test_repeats_are_named_in_every_step(daemon) -> None:
    """A repeat inside one step, one across a step boundary, one of the very first key by the
    very last: Get and Acquire refuse each, naming both places."""
    with connect(daemon.address, transport="grpc") as c, daemon.channel() as ch:
        ns = c.namespace(LAYOUT, model="dos-keys").ns_id
        stub = pbg.KVStoreStub(ch)
        keys = fresh(MAX_KEYS)
        cases = {
            (5, 3): keys[:5] + [keys[3]],
            (STEP + 1, STEP - 1): keys[:STEP + 1] + [keys[STEP - 1]] + keys[STEP + 2:3 * STEP],
            (MAX_KEYS - 1, 0): keys[:MAX_KEYS - 1] + [keys[0]],
        }
        for (at, first), ks in cases.items():
            for name, call in {
                "Get": lambda k: list(stub.Get(pb.GetRequest(namespace_id=ns, keys=k),
                                               timeout=60)),
                "Acquire": lambda k: stub.Acquire(pb.AcquireRequest(namespace_id=ns, keys=k),
                                                  timeout=60),
                "Lookup": lambda k: stub.Lookup(pb.LookupRequest(namespace_id=ns, keys=k),
                                                timeout=60),
            }.items():
                msg = refusal(lambda call=call, ks=ks: call(ks))
                assert f"keys[{at}] repeats keys[{first}]" in msg, (name, at, msg)


def test_a_bad_key_is_named_in_its_step(daemon) -> None:
    """A key of the wrong length in a later step is named by its own index."""
    with connect(daemon.address, transport="grpc") as c, daemon.channel() as ch:
        ns = c.namespace(LAYOUT, model="dos-keys").ns_id
        stub = pbg.KVStoreStub(ch)
        for at in (0, STEP, 2 * STEP + 7, MAX_KEYS - 1):
            keys = fresh(MAX_KEYS)
            keys[at] = b"short"
            msg = refusal(lambda keys=keys: stub.Lookup(
                pb.LookupRequest(namespace_id=ns, keys=keys), timeout=60))
            assert f"keys[{at}] is 5 bytes" in msg, (at, msg)
        msg = refusal(lambda: stub.Lookup(pb.LookupRequest(
            namespace_id=ns, keys=fresh(MAX_KEYS + 1)), timeout=60))
        assert f"{MAX_KEYS + 1} keys in one request" in msg, msg


def test_the_largest_distinct_requests_are_served(daemon) -> None:
    """65,536 distinct keys: Lookup answers, Get streams the stored prefix, Acquire pins it."""
    with connect(daemon.address, transport="grpc") as c, daemon.channel() as ch:
        ns = c.namespace(LAYOUT, model="dos-keys").ns_id
        stub = pbg.KVStoreStub(ch)
        keys = fresh(MAX_KEYS)
        blocks = [(k, bytes([i % 251]) * LAYOUT.block_bytes) for i, k in enumerate(keys[:3])]
        put = ch.stream_unary("/kvstore.v1.KVStore/Put", request_serializer=lambda b: b,
                              response_deserializer=pb.PutResponse.FromString)
        assert put(iter([encode_put(ns, b"", blocks)]), timeout=30).stored == 3
        assert stub.Lookup(pb.LookupRequest(namespace_id=ns, keys=keys),
                           timeout=60).prefix_blocks == 3
        got = [(b.key, b.data) for r in stub.Get(pb.GetRequest(namespace_id=ns, keys=keys),
                                                  timeout=60) for b in r.blocks]
        assert got == blocks
        lease = stub.Acquire(pb.AcquireRequest(namespace_id=ns, keys=keys), timeout=60).lease
        assert len(lease.slots) == 3
        stub.Release(pb.ReleaseRequest(lease_id=lease.lease_id), timeout=30)
