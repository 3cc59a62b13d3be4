"""The fast lane (`<socket>.lane`): the hot unary calls over a plain Unix socket.

Real daemons and real clients: the store and load path goes over the lane and gives the same
bytes; an error comes back as the same exception with the same message as over gRPC; a
daemon with tenants takes a connection only with a tenant's token and keeps tenants apart on
it; garbage on the socket is dropped without harming the daemon; a restart is survived.
"""

from __future__ import annotations

import json
import socket
import textwrap
import time
from pathlib import Path

import pytest
import torch
from kvstore_client import KVLayout, LeaseExpired, NotFound, connect
from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client.common.lane_frames import Frames
from kvstore_client.common.lane_wire import CODES, HEADER, METHOD_ID, lane_path

from kvstore.tenants import hash_token
from tests.daemon import cleanup, start_daemon
from tests.test_round_trips import bits, counter, make_kv, prompt

T = 16
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=T, dtype="float16")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    d = start_daemon(tmp_path_factory.mktemp("lane"))
    try:
        yield d
    finally:
        cleanup(d)


def hello(path: str, line: bytes) -> tuple[socket.socket, dict]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    s.sendall(line)
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = s.recv(4096)
        if not chunk:
            break
        buf += chunk
    return s, json.loads(buf)


def closed_by_peer(s: socket.socket) -> bool:
    try:
        return s.recv(16) == b""
    except ConnectionResetError:          # it closed with our bytes unread
        return True


def test_stores_and_loads_go_over_the_lane(daemon) -> None:
    assert Path(lane_path(daemon.socket)).exists()
    with connect(daemon.address) as c:
        ns = c.namespace(LAYOUT, model="lane")
        before = counter(daemon, "lane_calls")
        for i in range(4):
            ids, kv = prompt(i, 8), make_kv(i, 8)
            assert ns.store(ids, kv) == 8
            out = torch.zeros_like(kv)
            assert ns.load(ids, out=out) == 8 * T
            assert torch.equal(bits(out), bits(kv))
        assert c._lane is not None
        assert counter(daemon, "lane_calls") - before >= 8      # a Commit and an Acquire each


def test_lane_off_keeps_every_call_on_grpc(daemon) -> None:
    with connect(daemon.address, lane=False) as c:
        ns = c.namespace(LAYOUT, model="lane")
        before = counter(daemon, "lane_calls")
        ids, kv = prompt(10, 4), make_kv(10, 4)
        assert ns.store(ids, kv) == 4
        assert ns.load(ids, out=torch.zeros_like(kv)) == 4 * T
        assert c._lane is None
        assert counter(daemon, "lane_calls") == before


def test_a_daemon_without_the_lane_is_served_over_grpc(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, {"server.lane": "false"})
    try:
        assert not Path(lane_path(d.socket)).exists()
        with connect(d.address) as c:
            ns = c.namespace(LAYOUT, model="nolane")
            ids, kv = prompt(50, 4), make_kv(50, 4)
            assert ns.store(ids, kv) == 4
            out = torch.zeros_like(kv)
            assert ns.load(ids, out=out) == 4 * T and torch.equal(bits(out), bits(kv))
            assert c._lane is None
            assert c.stats()["counters"].get("lane_calls", 0) == 0
    finally:
        cleanup(d)


def test_errors_are_the_same_as_over_grpc(daemon) -> None:
    with connect(daemon.address) as lane, connect(daemon.address, lane=False) as plain:
        errors = []
        for c in (lane, plain):
            ns = c.namespace(LAYOUT, model="lane")
            with pytest.raises((NotFound, LeaseExpired)) as e:
                c.call("Commit", pb.CommitRequest(lease_id="0" * 32, keys=[b"k" * 16]))
            errors.append((type(e.value), str(e.value)))
            with pytest.raises(NotFound) as e2:
                c.call("Acquire", pb.AcquireRequest(namespace_id=b"\1" * 16, keys=[b"k" * 16]))
            errors.append((type(e2.value), str(e2.value)))
            assert ns.lookup(prompt(99, 2)) == 0
        assert errors[:2] == errors[2:]


def test_garbage_on_the_lane_is_dropped_and_the_daemon_serves_on(daemon) -> None:
    path = lane_path(daemon.socket)
    s, reply = hello(path, b"not json\n")
    assert reply["error"] == "INVALID_ARGUMENT"
    s.close()
    s, reply = hello(path, b'{"v": 1, "token": ""}\n')
    assert reply == {"ok": True}
    s.sendall(HEADER.pack(4, 200) + b"xxxx")             # no such method: dropped
    assert closed_by_peer(s)
    s.close()
    s, _ = hello(path, b'{"v": 1, "token": ""}\n')
    s.sendall(HEADER.pack(7, METHOD_ID["Lookup"]) + b"\xff" * 7)   # not a LookupRequest
    n, code = HEADER.unpack(s.recv(HEADER.size))
    assert code != 0 and b"LookupRequest" in s.recv(n)
    s.close()
    with connect(daemon.address) as c:
        ns = c.namespace(LAYOUT, model="lane")
        ids, kv = prompt(20, 2), make_kv(20, 2)
        assert ns.store(ids, kv) == 2


def test_frames_are_read_however_their_bytes_arrive(daemon) -> None:
    """The daemon reads a frame in as few reads as its bytes allow: a frame split across
    writes, two frames in one write, and a frame larger than one read all get their answers,
    in order."""
    with connect(daemon.address) as c:
        ns = c.namespace(LAYOUT, model="lane-frames")
        ids = prompt(21, 3)
        assert ns.store(ids, make_kv(21, 3)) == 3
        keys = ns.keys(ids)
        ns_id = ns.ns_id
    def frame(keys: list[bytes]) -> bytes:
        raw = pb.LookupRequest(namespace_id=ns_id, keys=keys).SerializeToString()
        return HEADER.pack(len(raw), METHOD_ID["Lookup"]) + raw

    s, reply = hello(lane_path(daemon.socket), b'{"v": 1, "token": ""}\n')
    assert reply == {"ok": True}
    answers = Frames(s)         # the test's own reader: answers may arrive in one read

    def answer(s: socket.socket) -> int:
        code, body = answers.read(10, 10)
        assert CODES[code] == "OK", body
        return pb.LookupResponse.FromString(body).prefix_blocks

    one = frame(keys[:2])
    for cut in (2, HEADER.size, HEADER.size + 3):             # split inside and after the header
        s.sendall(one[:cut])
        time.sleep(0.05)
        s.sendall(one[cut:])
        assert answer(s) == 2
    s.sendall(frame(keys[:1]) + frame(keys))                  # two frames in one write
    assert (answer(s), answer(s)) == (1, 3)
    big = keys + [bytes([i % 256, i // 256]) * 8 for i in range(2000)]   # ~40 KB of keys
    assert len(frame(big)) > 16 << 10
    s.sendall(frame(big))
    assert answer(s) == 3
    s.close()


def test_a_restarted_daemon_is_reached_again(tmp_path: Path) -> None:
    d = start_daemon(tmp_path)
    try:
        with connect(d.address) as c:
            ns = c.namespace(LAYOUT, model="lane")
            ids, kv = prompt(30, 4), make_kv(30, 4)
            assert ns.store(ids, kv) == 4
            d.restart()
            ids2, kv2 = prompt(31, 4), make_kv(31, 4)
            assert ns.store(ids2, kv2) == 4          # first call finds the old lane closed
            out = torch.zeros_like(kv2)
            assert ns.load(ids2, out=out) == 4 * T
            assert torch.equal(bits(out), bits(kv2))
            assert c._lane is not None
    finally:
        cleanup(d)


def test_tenants_need_a_token_and_stay_apart_on_the_lane(tmp_path: Path) -> None:
    tokens = {"a": "token-a", "b": "token-b", "ops": "token-ops"}
    f = tmp_path / "tenants.toml"
    f.write_text(textwrap.dedent(f"""
        [tenants.a]
        token_sha256 = "{hash_token(tokens['a'])}"
        host_quota = "8MiB"     # its own pool: it may hold leases (the shared pool's are admins')
        [tenants.b]
        token_sha256 = "{hash_token(tokens['b'])}"
        [tenants.ops]
        token_sha256 = "{hash_token(tokens['ops'])}"
        admin = true
    """))

    def lane_calls() -> int:
        with connect(d.address, transport="grpc", token=tokens["ops"]) as ops:
            return int(ops.stats()["counters"].get("lane_calls", 0))

    d = start_daemon(tmp_path, {"auth.tokens_file": str(f)})
    try:
        path = lane_path(d.socket)
        for line in (b'{"v": 1, "token": ""}\n', b'{"v": 1, "token": "wrong"}\n'):
            s, reply = hello(path, line)
            assert reply["error"] == "UNAUTHENTICATED"
            assert closed_by_peer(s)
            s.close()
        # A 60 s deadline: this is about who may do what, not how fast, and the first Get of a
        # fresh daemon waits for its copy kernel to load, which a starved machine stretches
        # past the default 10 s.
        with connect(d.address, token=tokens["a"], timeout=60) as a, \
                connect(d.address, token=tokens["b"], timeout=60) as b:
            na, nb = a.namespace(LAYOUT, model="m"), b.namespace(LAYOUT, model="m")
            ids, kv = prompt(40, 4), make_kv(40, 4)
            assert na.store(ids, kv) == 4
            assert a._lane is not None and b._lane is not None
            a.leases.flush(spares=True)     # A's store leaves no lease for its thread to send
            before = lane_calls()
            lease = a.call("Acquire", pb.AcquireRequest(namespace_id=na.ns_id,
                                                         keys=na.keys(ids))).lease
            assert lane_calls() - before == 1                   # A's Acquire took the lane
            # B's attempts, sent on B's own lane connection (its SDK lane client, so they
            # cannot go over gRPC instead): each answers as an unknown id does (no oracle of
            # what A registered), as it does over gRPC.
            for method, req, what in (
                    ("Acquire", pb.AcquireRequest(namespace_id=na.ns_id, keys=na.keys(ids)),
                     "unknown namespace"),
                    ("Release", pb.ReleaseRequest(lease_id=lease.lease_id), "unknown lease"),
                    ("RenewLease", pb.RenewLeaseRequest(lease_id=lease.lease_id, ttl_s=60),
                     "unknown lease"),
                    ("Lookup", pb.LookupRequest(namespace_id=na.ns_id, keys=na.keys(ids)),
                     "unknown namespace")):
                with pytest.raises(NotFound, match=what):
                    b._lane.call(method, req.SerializeToString(), 10)
                with pytest.raises(NotFound, match=what):
                    b.call(method, req)                         # the SDK's own route
            # On a raw lane connection that said only B's token, too.
            s, reply = hello(path, json.dumps({"v": 1, "token": tokens["b"]}).encode() + b"\n")
            assert reply.get("ok") is True, reply
            raw = pb.AcquireRequest(namespace_id=na.ns_id, keys=na.keys(ids)).SerializeToString()
            s.sendall(HEADER.pack(len(raw), METHOD_ID["Acquire"]) + raw)
            code, body = Frames(s).read(10, 10)
            assert CODES[code] == "NOT_FOUND", (code, body)
            assert b"unknown namespace" in body
            s.close()
            # None of it was served: only A's call counts as a lane call.
            assert lane_calls() - before == 1
            a.release(lease.lease_id)
            assert nb.lookup(ids) == 0
            out = torch.zeros_like(kv)
            assert na.load(ids, out=out) == 4 * T and torch.equal(bits(out), bits(kv))
    finally:
        cleanup(d)


def test_lane_wire_constants_are_stable() -> None:
    # Both sides index these tables on the wire: appending is compatible, reordering is not.
    assert METHOD_ID["Commit"] == 0 and METHOD_ID["Acquire"] == 1
    assert HEADER.pack(1, 2) == b"\1\0\0\0\2"
