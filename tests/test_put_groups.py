"""A Put stream stored a group of messages at a time (kvstore/put_groups.py) while its next
messages are received on a thread of their own: a real daemon, raw Put streams of 1 MiB blocks
spanning several groups (8 MiB each), read back with Get and checked byte for byte.
"""

from __future__ import annotations

import grpc
import pytest
import xxhash
from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client._proto import kvstore_pb2_grpc as pb_grpc
from kvstore_client.wire import encode_put

from kvstore.put_groups import GROUP_BYTES
from tests.daemon import cleanup, start_daemon
from tests.test_early_refusal import put_raw
from tests.test_server import blocks, chain, get, register

MIB = pb.KVLayout(num_layers=16, num_kv_heads=8, head_dim=128, block_tokens=16,
                  dtype="bfloat16")
MIB_BYTES = 1 << 20
N = 2 * GROUP_BYTES // MIB_BYTES + 3           # two whole groups and part of a third


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("put-groups"), {"host.capacity": "96MiB"})
    ch = d.channel()
    try:
        yield d, ch, pb_grpc.KVStoreStub(ch)
    finally:
        ch.close()
        cleanup(d)


def one_a_message(ns: bytes, keys: list[bytes], data: list[bytes]) -> list[bytes]:
    return [encode_put(ns if i == 0 else b"", b"", [(k, d)])
            for i, (k, d) in enumerate(zip(keys, data, strict=True))]


def test_a_stream_of_several_groups_stores_every_block_intact(world) -> None:
    _, ch, stub = world
    ns = register(stub, MIB, "groups/intact").namespace_id
    keys, data = chain(N, 1), blocks(N, MIB_BYTES, 1)
    msgs = one_a_message(ns, keys[:N - 3], data[:N - 3])
    msgs.append(encode_put(b"", b"", list(zip(keys[N - 3:], data[N - 3:], strict=True))))
    r = put_raw(ch, msgs)
    assert (r.stored, r.duplicates) == (N, 0)
    got, _ = get(stub, ns, keys)
    assert [k for k, _ in got] == keys
    assert [xxhash.xxh3_64_intdigest(d) for _, d in got] == \
        [xxhash.xxh3_64_intdigest(d) for d in data]
    # the chain is the one sent: each block's parent is the block before it
    r = put_raw(ch, one_a_message(ns, keys, data))
    assert (r.stored, r.duplicates) == (0, N)


def test_a_key_sent_again_in_a_later_message_is_a_duplicate(world) -> None:
    _, ch, stub = world
    ns = register(stub, MIB, "groups/again").namespace_id
    keys, data = chain(3, 2), blocks(3, MIB_BYTES, 2)
    msgs = one_a_message(ns, keys, data) + [encode_put(b"", b"", [(keys[0], data[0])])]
    r = put_raw(ch, msgs)
    assert (r.stored, r.duplicates) == (3, 1)
    got, _ = get(stub, ns, keys)
    assert [d for _, d in got] == data


def test_blocks_received_before_a_bad_message_are_stored(world) -> None:
    _, ch, stub = world
    ns = register(stub, MIB, "groups/bad").namespace_id
    good = GROUP_BYTES // MIB_BYTES + 2         # a whole group and part of the next
    keys, data = chain(good + 1, 3), blocks(good, MIB_BYTES, 3)
    msgs = one_a_message(ns, keys[:good], data)
    msgs.append(encode_put(b"", b"", [(keys[good], b"\x01" * 10)]))
    with pytest.raises(grpc.RpcError) as ei:
        put_raw(ch, msgs)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ei.value.details().startswith(f"message {good} blocks[0].data is 10 bytes")
    look = stub.Lookup(pb.LookupRequest(namespace_id=ns, keys=keys), timeout=10)
    assert look.prefix_blocks == good
    got, _ = get(stub, ns, keys[:good])
    assert [d for _, d in got] == data


def test_a_put_cut_off_by_its_client_leaves_the_daemon_serving(world) -> None:
    d, ch, stub = world
    ns = register(stub, MIB, "groups/cut").namespace_id
    keys, data = chain(N, 4), blocks(N, MIB_BYTES, 4)
    call = ch.stream_unary("/kvstore.v1.KVStore/Put", request_serializer=lambda b: b,
                           response_deserializer=pb.PutResponse.FromString)
    msgs = one_a_message(ns, keys, data)

    def then_fail():
        yield from msgs[:N // 2]
        raise RuntimeError("client gives up mid-stream")
    with pytest.raises(grpc.RpcError):
        call(then_fail(), timeout=60)
    # whatever prefix landed is intact, and a whole Put of the same blocks completes it
    r = put_raw(ch, msgs)
    assert r.stored + r.duplicates == N
    got, _ = get(stub, ns, keys)
    assert [d for _, d in got] == data
    assert d.alive() and "Traceback" not in d.output()
