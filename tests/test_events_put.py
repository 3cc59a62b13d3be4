"""KV events of blocks stored over Put (the byte stream of clients without shared memory): a
real daemon, real ZMQ subscribers, the SDK over `transport="grpc"` and raw Put streams.

A prompt stored over Put is announced exactly as the same prompt stored over shared memory
(hashes, parents, token ids), split blocks included; token ids that do not fit are refused
and store nothing; and the SDK sends them only to a daemon that asks for them and knows the
field (a Put proxy reads every message the SDK sends).
"""

from __future__ import annotations

from concurrent import futures

import grpc
import numpy as np
import pytest
from kvstore_client import KVLayout, connect
from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client.wire import encode_put, split_put

from tests.daemon import cleanup, start_daemon
from tests.events_helpers import Sub, firsts, held, stored
from tests.test_events_daemon import EVENTS, LAYOUT, kv_for, streams_of

T = LAYOUT.block_tokens
# 5 MiB blocks: bigger than a Put message (2 MiB), so each goes alone, split across messages.
BIG = KVLayout(num_layers=40, num_kv_heads=8, head_dim=128, block_tokens=32, dtype="float16")


def announced(evs: list[dict]) -> list[tuple]:
    """What a router indexes of each host block announced: (hashes, parent, tokens, size)."""
    return [(tuple(e["block_hashes"]), e["parent_block_hash"], tuple(e["token_ids"]),
             e["block_size"]) for e in firsts(stored(evs, "CPU"))]


def raw_put(ch: grpc.Channel):
    return ch.stream_unary("/kvstore.v1.KVStore/Put", request_serializer=lambda b: b,
                           response_deserializer=pb.PutResponse.FromString)


def u32(ids) -> bytes:
    return np.asarray(ids, dtype="<u4").tobytes()


def test_a_put_is_announced_as_the_same_prompt_stored_over_shm(tmp_path):
    """Over grpc: a prompt of several Put messages (256 blocks a message here), then a longer
    one whose new blocks chain to the cached ones; deleted, then the same over shm: the two
    announce the same blocks, parents and token ids."""
    d = start_daemon(tmp_path, {**EVENTS, "host.capacity": "64MiB"})
    sub = None
    try:
        sub = Sub(*streams_of(d)["node"])
        n = 300                                             # two Put messages
        tokens = np.arange(7000, 7000 + n * T + 5)          # and a tail, not stored
        longer = np.concatenate([tokens[:n * T], np.arange(100, 100 + 3 * T)])
        kv, kv_longer = kv_for(len(tokens), 11), kv_for(len(longer), 12)
        got = {}
        for transport in ("grpc", "shm"):
            since = sub.last_seq() + 1
            with connect(d.address, transport=transport) as c:
                ns = c.namespace(model="llama", layout=LAYOUT)
                assert c.transport == transport
                assert ns.wants_token_ids
                assert ns.store(tokens, kv) == n
                assert ns.store(longer, kv_longer) == 3
                evs = sub.wait(lambda e: len(firsts(stored(e, "CPU"))) == n + 3, since,
                               what=f"{transport} stores")
                got[transport] = announced(evs)
                assert ns.delete(ns.keys(longer)) == n + 3
                sub.wait(lambda e: not held(e), since, what="deletion")
        g = got["grpc"]
        assert [t for b in g for t in b[2]] == longer.tolist()
        assert [b[1] for b in g[1:]] == [b[0][0] for b in g[:-1]]   # one chain, parents first
        assert g[0][1] is None
        assert g == got["shm"]
    finally:
        if sub is not None:
            sub.close()
        cleanup(d)


def test_blocks_split_across_messages_are_announced_with_their_tokens(tmp_path):
    """A block bigger than a message goes alone in pieces; its token ids ride on its first
    piece. The SDK's store of two such blocks is announced with each one's tokens; token ids
    on a piece that continues a block are refused."""
    d = start_daemon(tmp_path, {**EVENTS, "host.capacity": "64MiB"})
    sub = None
    try:
        sub = Sub(*streams_of(d)["node"])
        bt = BIG.block_tokens
        ids = np.arange(500, 500 + 2 * bt)
        rng = np.random.default_rng(5)
        kv = rng.standard_normal((BIG.num_layers, 2, 2 * bt, BIG.num_kv_heads, BIG.head_dim),
                                 dtype=np.float32).astype(np.float16)
        with connect(d.address, transport="grpc") as c:
            ns = c.namespace(model="big", layout=BIG)
            assert ns.store(ids, kv) == 2
            evs = sub.wait(lambda e: len(firsts(stored(e, "CPU"))) == 2, what="split stores")
            a = announced(evs)
            assert [list(b[2]) for b in a] == [ids[:bt].tolist(), ids[bt:].tolist()]
            assert a[1][1] == a[0][0][0]
            nid, key = ns.ns_id, b"\x07" * 16
        size = ns.block_bytes
        msgs = list(split_put(nid, b"", (key, bytes(size)), 2 << 20, u32(range(bt))))
        assert len(msgs) == 3
        bad = msgs[:1] + [encode_put(b"", b"", [(b"", bytes(2 << 20))], u32(range(bt)))]
        with d.channel() as ch:
            with pytest.raises(grpc.RpcError) as ei:
                raw_put(ch)(iter(bad), timeout=30)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "message 1 continues a split block: its token_ids go on the block's first " \
                   "message (message 0)" in ei.value.details()
            look = pb.LookupRequest(namespace_id=nid, keys=[key])
            assert ch.unary_unary("/kvstore.v1.KVStore/Lookup",
                                  request_serializer=pb.LookupRequest.SerializeToString,
                                  response_deserializer=pb.LookupResponse.FromString)(
                look, timeout=10).prefix_blocks == 0
    finally:
        if sub is not None:
            sub.close()
        cleanup(d)


def test_token_ids_that_do_not_fit_a_put_are_refused_and_nothing_is_stored(tmp_path):
    d = start_daemon(tmp_path, {**EVENTS, "host.capacity": "16MiB"})
    sub = None
    try:
        sub = Sub(*streams_of(d)["node"])
        with connect(d.address, transport="grpc") as c:
            ns = c.namespace(model="llama", layout=LAYOUT)
            keys = ns.keys(np.arange(2 * T))
            bb = ns.block_bytes
            two = [(k, bytes(bb)) for k in keys]
            with d.channel() as ch:
                put = raw_put(ch)
                for msgs, words in (
                        ([encode_put(ns.ns_id, b"", two, bytes(12))],
                         "message 0 token_ids: 3 token ids for 2 blocks; send 16 per block"),
                        ([encode_put(ns.ns_id, b"", two, bytes(4 * T * 2 + 1))],
                         "message 0 token_ids: 129 bytes of token ids (4 a token) for 2 "
                         "blocks"),
                        ([encode_put(ns.ns_id, b"", two, u32(range(3 * T)))],
                         "48 token ids for 2 blocks"),
                        ([encode_put(ns.ns_id, b"", [], u32(range(T)))],
                         "16 token ids for 0 blocks"),
                        ([encode_put(ns.ns_id, b"", two, u32(range(2 * T)))
                          + encode_put(b"", b"", [], u32(range(2 * T)))],
                         "field 4 appears more than once")):
                    with pytest.raises(grpc.RpcError) as ei:
                        put(iter(msgs), timeout=30)
                    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert words in ei.value.details(), ei.value.details()
                    assert ns.lookup_keys(keys) == 0          # nothing of it stored
            # the daemon goes on serving, and announces what a good Put stores
            assert ns.store(np.arange(2 * T), kv_for(2 * T, 7)) == 2
            evs = sub.wait(lambda e: len(firsts(stored(e, "CPU"))) == 2, what="good store")
            assert [t for b in announced(evs) for t in b[2]] == list(range(2 * T))
    finally:
        if sub is not None:
            sub.close()
        cleanup(d)


def test_messages_with_and_without_token_ids_in_one_stream(tmp_path):
    """Token ids belong to their own message's blocks: a stream whose middle message carries
    none stores all its blocks and announces those of the others, with their own tokens and
    the chain running through the unannounced ones."""
    d = start_daemon(tmp_path, {**EVENTS, "host.capacity": "16MiB"})
    sub = None
    try:
        sub = Sub(*streams_of(d)["node"])
        with connect(d.address, transport="grpc") as c:
            ns = c.namespace(model="llama", layout=LAYOUT)
            ids = np.arange(900, 900 + 6 * T)
            keys, bb = ns.keys(ids), ns.block_bytes
            data = [bytes([i]) * bb for i in range(6)]
            pairs = list(zip(keys, data, strict=True))
            msgs = [encode_put(ns.ns_id, b"", pairs[:2], u32(ids[:2 * T])),
                    encode_put(b"", b"", pairs[2:4]),
                    encode_put(b"", b"", pairs[4:], u32(ids[4 * T:]))]
            with d.channel() as ch:
                assert raw_put(ch)(iter(msgs), timeout=30).stored == 6
            evs = sub.wait(lambda e: len(firsts(stored(e, "CPU"))) == 4, what="announced")
            a = announced(evs)
            assert [t for b in a for t in b[2]] == ids[:2 * T].tolist() + ids[4 * T:].tolist()
            assert a[1][1] == a[0][0][0] and a[3][1] == a[2][0][0]
            assert a[2][1] not in {a[0][0][0], a[1][0][0], None}    # block 3's, not announced
            assert ns.lookup_keys(keys) == 6
    finally:
        if sub is not None:
            sub.close()
        cleanup(d)


# ------------------------------------------------------------ what the SDK sends, and to whom

class PutProxy:
    """A gRPC server in front of a daemon that forwards every call and keeps each Put
    message the SDK sends; `protocol` (when set) replaces RegisterNamespace's answer, as an
    older daemon would give it."""

    def __init__(self, upstream: grpc.Channel, sock: str, protocol: int | None = None) -> None:
        self.messages: list[pb.PutRequest] = []
        self.protocol = protocol
        service = pb.DESCRIPTOR.services_by_name["KVStore"]
        handlers = {}
        for m in service.methods:
            path = f"/kvstore.v1.KVStore/{m.name}"
            if m.client_streaming:
                handlers[m.name] = grpc.stream_unary_rpc_method_handler(
                    self._put(upstream.stream_unary(path)))
            elif m.server_streaming:
                handlers[m.name] = grpc.unary_stream_rpc_method_handler(
                    self._stream(upstream.unary_stream(path)))
            else:
                handlers[m.name] = grpc.unary_unary_rpc_method_handler(
                    self._unary(m.name, upstream.unary_unary(path)))
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=[
            ("grpc.max_receive_message_length", 8 << 20),
            ("grpc.max_send_message_length", 8 << 20)])
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("kvstore.v1.KVStore", handlers),))
        self.server.add_insecure_port(f"unix:{sock}")
        self.address = f"unix:{sock}"
        self.server.start()

    def _unary(self, name: str, call):
        def handle(raw: bytes, ctx: grpc.ServicerContext) -> bytes:
            try:
                out = call(raw, timeout=30)
            except grpc.RpcError as e:
                ctx.abort(e.code(), e.details())
            if name == "RegisterNamespace" and self.protocol is not None:
                resp = pb.RegisterNamespaceResponse.FromString(out)
                resp.protocol = self.protocol
                out = resp.SerializeToString()
            return out
        return handle

    def _stream(self, call):
        def handle(raw: bytes, ctx: grpc.ServicerContext):
            yield from call(raw, timeout=30)
        return handle

    def _put(self, call):
        def handle(raws, ctx: grpc.ServicerContext) -> bytes:
            def kept():
                for raw in raws:
                    self.messages.append(pb.PutRequest.FromString(raw))
                    yield raw
            try:
                return call(kept(), timeout=30)
            except grpc.RpcError as e:
                ctx.abort(e.code(), e.details())
        return handle

    def close(self) -> None:
        self.server.stop(None)


@pytest.mark.parametrize("events,protocol,sent", [
    (True, None, True),        # publishes, knows the field: every Put message carries them
    (True, 3, False),          # publishes, but a daemon of protocol 3 refuses the field
    (False, None, False),      # events off: nothing is sent
])
def test_the_sdk_sends_put_token_ids_only_where_wanted_and_known(tmp_path, events, protocol,
                                                                 sent):
    d = start_daemon(tmp_path, {**EVENTS, "host.capacity": "16MiB"} if events else {})
    upstream = d.channel()
    proxy = PutProxy(upstream, str(tmp_path / "proxy.sock"), protocol)
    try:
        with connect(proxy.address, transport="grpc") as c:
            ns = c.namespace(model="llama", layout=LAYOUT)
            assert ns.wants_token_ids == events
            ids = np.arange(40, 40 + 3 * T)
            assert ns.store(ids, kv_for(3 * T, 8)) == 3
            keys = ns.keys(np.arange(60, 60 + 2 * T))
            assert ns.store_keys(keys, kv_for(2 * T, 9), token_ids=np.arange(60, 60 + 2 * T)) == 2
        with_blocks = [m for m in proxy.messages if m.blocks]
        assert len(with_blocks) == 2
        got = [np.frombuffer(m.token_ids, "<u4").tolist() for m in with_blocks]
        if sent:
            assert got == [ids.tolist(), list(range(60, 60 + 2 * T))]
        else:
            assert got == [[], []]
    finally:
        proxy.close()
        upstream.close()
        cleanup(d)
