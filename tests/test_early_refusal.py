"""Oversized requests are refused where the limit is crossed, not after everything is parsed.

A Put message of a million blocks used to be parsed whole (33 s of daemon time) before the
block count was checked. The error message says where the parse stopped, which is what proves
the refusal came early: block 65536, or the first block of the wrong size.
"""

from __future__ import annotations

import grpc
import pytest
from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client._proto import kvstore_pb2_grpc as pb_grpc
from kvstore_client.common.limits import MAX_KEYS, MAX_REQUEST_BYTES
from kvstore_client.wire import encode_put

from tests.daemon import cleanup, start_daemon
from tests.test_server import SMALL_BYTES, chain, register


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    # A receive limit above the 4 MiB default, as an operator may set it, so that a message
    # of a million blocks reaches the parser (by default gRPC refuses it from its length).
    d = start_daemon(tmp_path_factory.mktemp("limits"), {"server.max_receive_bytes": "64MiB"})
    ch = d.channel()
    try:
        stub = pb_grpc.KVStoreStub(ch)
        yield d, ch, stub, register(stub).namespace_id
    finally:
        ch.close()
        cleanup(d)


def put_raw(ch: grpc.Channel, messages: list[bytes]) -> pb.PutResponse:
    call = ch.stream_unary("/kvstore.v1.KVStore/Put", request_serializer=lambda b: b,
                           response_deserializer=pb.PutResponse.FromString)
    return call(iter(messages), timeout=60)


def test_put_with_a_million_blocks_is_refused_at_the_limit(world) -> None:
    _, ch, _, ns = world
    key = b"\x01" * 16
    # namespace_id last (protobuf fields may come in any order): the block size is not known
    # while the blocks are read, so only their count can stop the parse
    msg = encode_put(b"", b"", [(key, b"")] * 1_000_000) + encode_put(ns, b"", [])
    with pytest.raises(grpc.RpcError) as ei:
        put_raw(ch, [msg])
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"more than {MAX_KEYS} blocks (refused at block {MAX_KEYS})" in ei.value.details()
    # namespace_id first, as the SDK sends it: refused at the first block of the wrong size
    with pytest.raises(grpc.RpcError) as ei:
        put_raw(ch, [encode_put(ns, b"", [(key, b"")] * 100_000)])
    assert ei.value.details().startswith("message 0 blocks[0].data is 0 bytes")


def test_put_refused_at_the_first_block_of_the_wrong_size(world) -> None:
    _, ch, _, ns = world
    keys = chain(50_000, 9)
    blocks = [(keys[0], b"\x00" * 10)] + [(k, b"") for k in keys[1:]]
    with pytest.raises(grpc.RpcError) as ei:
        put_raw(ch, [encode_put(ns, b"", blocks)])
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ei.value.details().startswith(
        f"message 0 blocks[0].data is 10 bytes; this namespace's blocks are {SMALL_BYTES}")


def test_later_put_messages_are_checked_as_they_stream(world) -> None:
    _, ch, stub, ns = world
    keys = chain(3, 11)
    first = encode_put(ns, b"", [(keys[0], b"\x07" * SMALL_BYTES)])
    second = encode_put(b"", b"", [(keys[1], b"\x07" * SMALL_BYTES), (keys[2], b"\x07")])
    with pytest.raises(grpc.RpcError) as ei:
        put_raw(ch, [first, second])
    assert "message 1 blocks[1].data is 1 bytes" in ei.value.details()
    # the first message had landed already: messages are stored as they arrive
    assert stub.Lookup(pb.LookupRequest(namespace_id=ns, keys=keys), timeout=10
                       ).prefix_blocks == 1


def test_key_requests_above_the_largest_valid_size_are_refused_unparsed(world) -> None:
    _, _, stub, ns = world
    keys = [b"\x02" * 32] * (MAX_REQUEST_BYTES // 34 + 10)
    for method, req in (("Lookup", pb.LookupRequest(namespace_id=ns, keys=keys)),
                        ("Delete", pb.DeleteRequest(namespace_id=ns, keys=keys))):
        with pytest.raises(grpc.RpcError) as ei:
            getattr(stub, method)(req, timeout=30)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
        assert f"no valid kvstore.v1.{method}Request is larger than" in ei.value.details()
    # the largest valid request still passes (distinct keys: a chain names each block once)
    ok = stub.Lookup(pb.LookupRequest(namespace_id=ns, keys=[i.to_bytes(32, "big")
                                                             for i in range(MAX_KEYS)]),
                     timeout=30)
    assert ok.prefix_blocks == 0
