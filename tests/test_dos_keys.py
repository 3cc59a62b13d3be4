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


# ------------------------------------------------------- repeats found in the raw request bytes

def _reference_first_repeat(keys: list[bytes]) -> tuple[int, int] | None:
    first: dict[bytes, int] = {}
    for i, k in enumerate(keys):
        if k in first:
            return i, first[k]
        first[k] = i
    return None


def test_the_raw_scan_names_the_first_repeat_or_leaves_the_request_alone() -> None:
    """kvstore/handlers/key_scan.py reads keys where they lie in the message: wherever it
    answers, it names the same pair as a scan of the parsed keys; where it cannot read the
    message as one run of equal-length key records, or two different keys share its 64-bit
    mix, it answers None and protobuf decides."""
    import random

    import numpy as np

    from kvstore.handlers.key_scan import first_repeat

    rnd = random.Random(5)
    ns = os.urandom(16)
    for size in (16, 24, 32):
        keys = [os.urandom(size) for _ in range(4096)]
        cases = [list(keys), keys[:1] * 4096, keys[:2048] * 2,
                 keys[:4095] + [keys[4094]], keys[:100] + [keys[7]] + keys[101:]]
        for _ in range(20):
            ks = list(keys)
            for _ in range(rnd.randint(1, 5)):
                ks[rnd.randrange(4096)] = ks[rnd.randrange(4096)]
            cases.append(ks)
        for ks in cases:
            raw = pb.GetRequest(namespace_id=ns, keys=ks).SerializeToString()
            assert first_repeat(raw, 2) == _reference_first_repeat(ks)
            # keys first, the namespace after them: read the same way
            after = pb.GetRequest(keys=ks).SerializeToString() + \
                pb.GetRequest(namespace_id=ns).SerializeToString()
            assert first_repeat(after, 2) == _reference_first_repeat(ks)
    mixed = [os.urandom(16 + i % 2) for i in range(4096)]
    mixed[9] = mixed[1]                   # a repeat past the run of one length: not read
    assert first_repeat(pb.GetRequest(namespace_id=ns, keys=mixed).SerializeToString(), 2) \
        is None
    # two different keys with one mix ((w0 ^ salt) * m ^ w1, salted per daemon run): the scan
    # must not call them equal
    from kvstore.handlers import key_scan
    salt, m, full = int(key_scan._SALT), int(key_scan._MIX), 2**64 - 1
    w0, w1, w0b = (int.from_bytes(os.urandom(8), "little") for _ in range(3))
    w1b = (((w0b ^ salt) * m) & full) ^ (((w0 ^ salt) * m) & full) ^ w1
    k1 = np.array([w0, w1], dtype=np.uint64).tobytes()
    k2 = np.array([w0b, w1b], dtype=np.uint64).tobytes()
    ks = [os.urandom(16) for _ in range(4096)]
    ks[100], ks[200] = k1, k2
    assert first_repeat(pb.GetRequest(namespace_id=ns, keys=ks).SerializeToString(), 2) is None


def test_a_large_repeat_is_refused_before_the_message_is_parsed(daemon) -> None:
    """A 1 MiB Get, Acquire or Lookup naming one block 65,536 times is refused from its raw
    bytes (key_scan.py): a message whose tail is not valid protobuf is refused for the repeat,
    not for the garbage protobuf would have found first."""
    with connect(daemon.address, transport="grpc") as c, daemon.channel() as ch:
        ns = c.namespace(LAYOUT, model="dos-keys").ns_id
        key = os.urandom(16)
        for method, cls in (("Get", pb.GetRequest), ("Acquire", pb.AcquireRequest),
                            ("Lookup", pb.LookupRequest)):
            raw = cls(namespace_id=ns, keys=[key] * MAX_KEYS).SerializeToString() + b"\x12\xff"
            if method == "Get":
                fn = ch.unary_stream(f"/kvstore.v1.KVStore/{method}",
                                     request_serializer=lambda b: b,
                                     response_deserializer=lambda b: b)
                msg = refusal(lambda fn=fn, raw=raw: list(fn(raw, timeout=60)))
            else:
                fn = ch.unary_unary(f"/kvstore.v1.KVStore/{method}",
                                    request_serializer=lambda b: b,
                                    response_deserializer=lambda b: b)
                msg = refusal(lambda fn=fn, raw=raw: fn(raw, timeout=60))
            assert "keys[1] repeats keys[0]" in msg, (method, msg)
