"""Attacks on the gRPC front of a daemon with tenants (docs/security.md, Limits).

Each test is an attack that worked on the daemon before the gate (kvstore/gate.py): calls that
never send their message held every worker; a body was buffered whole before its token was
checked; a Put of unknown fields cost seconds of daemon time; the error code told a tenant
whether another had registered a model; `127.evil.com` passed for loopback.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from kvstore_client import KVLayout, connect
from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client._proto import kvstore_pb2_grpc as pbg
from kvstore_client.common.layout import NamespaceSpec
from kvstore_client.wire import encode_put

from kvstore.binding import is_loopback
from kvstore.tenants import TENANT_KEY
from tests.daemon import DaemonError, cleanup, start_daemon
from tests.trust_net_helpers import (
    TOKENS,
    Stall,
    channel,
    code_of,
    cpu_s,
    md,
    settled,
    stalled_calls,
    status,
    tenants_file,
)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=16, dtype="bfloat16")
WORKERS = 4


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trust-net-grpc")
    d = start_daemon(tmp, {"auth.tokens_file": str(tenants_file(tmp)),
                           "server.workers": WORKERS, "limits.request_deadline_s": 2})
    try:
        yield d
    finally:
        cleanup(d)


def a_call(stub: pbg.KVStoreStub) -> None:
    """Tenant A's ordinary call: answers within a few seconds, or the test fails."""
    assert stub.Stats(pb.StatsRequest(), timeout=5, metadata=md("a")).namespaces >= 0


def test_calls_without_credentials_hold_no_worker(world) -> None:
    """Finding 2: 8x as many silent calls as workers, no token, on every kind of method."""
    stall = Stall()
    with channel(world.address) as ch:
        stub = pbg.KVStoreStub(ch)
        held = []
        for method in ("Put", "Lookup", "Commit", "Get"):
            held += stalled_calls(ch, method, 2 * WORKERS, stall)
        try:
            for _ in range(3):
                a_call(stub)
            # each was answered at once, without its message
            assert {code_of(f, 10) for f in held} == {grpc.StatusCode.UNAUTHENTICATED}
        finally:
            stall.release.set()


def test_a_tenant_stalling_its_calls_stalls_only_them(world) -> None:
    """Finding 2: tenant B's empty Put streams fill B's own calls (limits.tenant_calls =
    server.workers), the rest are refused at once, A is served, and the held ones end at the
    absolute deadline (limits.request_deadline_s = 2 here) even though B never closes them."""
    stall = Stall()
    with channel(world.address) as ch:
        stub = pbg.KVStoreStub(ch)
        held = stalled_calls(ch, "Put", 3 * WORKERS, stall, md("b"))
        try:
            for _ in range(3):
                a_call(stub)
            codes = [code_of(f, 20) for f in held]
        finally:
            stall.release.set()
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 2 * WORKERS, codes
    assert codes.count(grpc.StatusCode.DEADLINE_EXCEEDED) >= 1, codes
    assert set(codes) <= {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}
    # B itself is served again, once the daemon's threads of its ended calls have left (the
    # client hears DEADLINE_EXCEEDED as the gate ends a call, a moment before that).
    end = time.monotonic() + 5
    with channel(world.address) as ch:
        while True:
            try:
                assert pbg.KVStoreStub(ch).Stats(pb.StatsRequest(), timeout=5,
                                                 metadata=md("b")).namespaces >= 0
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                assert time.monotonic() < end, "B's calls were not let in again within 5 s"
                time.sleep(0.05)


def test_no_body_is_buffered_before_its_token_is_checked(world) -> None:
    """Finding 5: two 192 MiB requests without a token, then a tenant's 64 MiB Lookup (past
    server.max_receive_bytes): refused, and the daemon's peak memory barely moves."""
    pid = world.proc.pid
    settled(world)
    before = status(pid)["VmHWM"]
    big = bytes(192 << 20)                                          # a 192 MiB "Lookup"
    with channel(world.address) as ch:
        lookup = ch.unary_unary("/kvstore.v1.KVStore/Lookup", request_serializer=lambda b: b,
                                response_deserializer=lambda b: b)
        for _ in range(2):
            with pytest.raises(grpc.RpcError) as ei:
                lookup(big, timeout=30)
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as ei:
            lookup(big[:64 << 20], timeout=30, metadata=md("a"))
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        a_call(pbg.KVStoreStub(ch))
    grew_mib = (status(pid)["VmHWM"] - before) / 1024
    assert grew_mib < 32, f"daemon peak memory grew by {grew_mib:.0f} MiB"


def test_a_put_of_unknown_fields_is_refused_at_the_first(world) -> None:
    """Finding 8: Put messages of nothing but unknown fields (~4 MiB each, the receive limit)
    are refused at the first field, costing the daemon far less than a second; a 16 MiB
    message is refused from its length prefix."""
    junk = b"\x38\x01" * ((4 << 20) // 2 - 512)                    # field 7 = 1, repeated
    pid = world.proc.pid
    settled(world)
    t0 = cpu_s(pid)
    with channel(world.address) as ch:
        put = ch.stream_unary("/kvstore.v1.KVStore/Put", request_serializer=lambda b: b,
                              response_deserializer=pb.PutResponse.FromString)
        for _ in range(4):
            with pytest.raises(grpc.RpcError) as ei:
                put(iter([junk] * 4), timeout=30, metadata=md("a"))
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "field 7 is not part of the protocol" in ei.value.details()
        with pytest.raises(grpc.RpcError) as ei:
            put(iter([junk * 4]), timeout=30, metadata=md("a"))
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    used = cpu_s(pid) - t0
    assert used < 1.0, f"refusing 64 MiB of unknown fields cost the daemon {used:.2f} s of CPU"


def test_blocks_bigger_than_a_message_are_put_in_pieces(tmp_path: Path) -> None:
    """The receive limit is 4 MiB for every method, Put included: a 5 MiB block travels in
    pieces (protocol 3) and comes back bit for bit; a piece that does not continue a split
    block, or a stream that ends inside one, is refused. (A daemon of its own: the first Get
    loads its copy kernel, longer than the 2 s deadline the stall tests use.)"""
    d = start_daemon(tmp_path, {"auth.tokens_file": str(tenants_file(tmp_path))})
    try:
        _put_in_pieces(d)
    finally:
        cleanup(d)


def _put_in_pieces(world) -> None:
    lay = KVLayout(num_layers=40, num_kv_heads=8, head_dim=128, block_tokens=32,
                   dtype="bfloat16")                        # 5 MiB blocks
    ids = np.arange(2 * 32)
    kv = torch.randn(40, 2, 64, 8, 128).to(torch.bfloat16)
    with connect(world.address, token=TOKENS["a"], transport="grpc") as c:
        ns = c.namespace(lay, model="big-blocks")
        assert ns.store(ids, kv) == 2
        out = torch.zeros_like(kv)
        assert ns.load(ids, out=out) == 64
        assert torch.equal(out.view(torch.int16), kv.view(torch.int16))
        nid = ns.ns_id
    with channel(world.address) as ch:
        put = ch.stream_unary("/kvstore.v1.KVStore/Put", request_serializer=lambda b: b,
                              response_deserializer=pb.PutResponse.FromString)
        piece = bytes(2 << 20)
        for msgs, words in (
                ([encode_put(nid, b"", [(b"", piece)])], "no key"),
                ([encode_put(nid, b"", [(b"\x01" * 16, piece)])], "stream ended"),
                ([encode_put(nid, b"", [(b"\x01" * 16, piece)]),
                  encode_put(b"", b"", [(b"\x02" * 16, piece)])], "continue")):
            with pytest.raises(grpc.RpcError) as ei:
                put(iter(msgs), timeout=30, metadata=md("a"))
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert words in ei.value.details(), ei.value.details()


def test_unknown_and_foreign_namespaces_get_one_answer(world) -> None:
    """Finding 11: tenant B computes the id A's registration of a model would have (ids are
    derived from the spec, owner included) and asks about it and about one A never
    registered: the same code and the same words, so B learns nothing of what A runs."""
    with connect(world.address, token=TOKENS["a"], transport="grpc") as a:
        ns = a.namespace(LAYOUT, model="a-secret-model")
        ns.lookup(np.arange(16))
        registered = ns.ns_id
    spec = NamespaceSpec(model="a-secret-model", layout=LAYOUT)
    assert dataclasses.replace(spec, extra={TENANT_KEY: "a"}).digest == registered
    answers = []
    with channel(world.address) as ch:
        stub = pbg.KVStoreStub(ch)
        for model in ("a-secret-model", "a-model-nobody-runs"):
            spec = NamespaceSpec(model=model, layout=LAYOUT)
            guess = dataclasses.replace(spec, extra={TENANT_KEY: "a"}).digest
            for method, req in (
                    ("Lookup", pb.LookupRequest(namespace_id=guess, keys=[b"\x01" * 16])),
                    ("Reserve", pb.ReserveRequest(namespace_id=guess, count=1))):
                with pytest.raises(grpc.RpcError) as ei:
                    getattr(stub, method)(req, timeout=10, metadata=md("b"))
                answers.append((ei.value.code(),
                                ei.value.details().replace(guess.hex(), "<id>")))
    assert answers[:2] == answers[2:], answers
    assert answers[0][0] == grpc.StatusCode.NOT_FOUND


def test_a_tenant_refused_past_its_budget_is_refused_unread(tmp_path: Path) -> None:
    """A hostile tenant sending requests the daemon must receive and refuse (a 1 MiB Get of
    one key repeated) bought ~8 ms of daemon CPU each, in a loop. Past
    `limits.refusals_per_s` (burst `limits.refusal_burst`, one spent per 256 KiB of a refused
    request) of its calls refused as its own mistake, its calls are refused at the gate,
    unread; tenant A is not charged for B's, and B is served again once the bucket refills.
    (Unknown ids have a larger bucket of their own: tests/test_trust_refusals.py.)"""
    d = start_daemon(tmp_path, {"auth.tokens_file": str(tenants_file(tmp_path)),
                                "limits.refusals_per_s": 0.5, "limits.refusal_burst": 5})
    try:
        with connect(d.address, token=TOKENS["a"], transport="grpc") as a, \
                connect(d.address, token=TOKENS["b"], transport="grpc") as b, \
                channel(d.address) as ch:
            a.namespace(LAYOUT, model="a-model")
            b_ns = b.namespace(LAYOUT, model="b-model").ns_id
            stub = pbg.KVStoreStub(ch)
            repeated = pb.GetRequest(namespace_id=b_ns, keys=[b"\x07" * 16] * 65536)
            codes = []
            for _ in range(2):
                with pytest.raises(grpc.RpcError) as ei:
                    list(stub.Get(repeated, timeout=10, metadata=md("b")))
                codes.append(ei.value.code())
            # the 1.1 MiB request spends all 5 (one per 256 KiB started): the next is not read
            assert codes == [grpc.StatusCode.INVALID_ARGUMENT,
                             grpc.StatusCode.RESOURCE_EXHAUSTED], codes
            # past the budget, even a valid call of B's is refused, unread, and says why
            with pytest.raises(grpc.RpcError) as ei:
                stub.Lookup(pb.LookupRequest(namespace_id=b_ns, keys=[b"\x01" * 16]),
                            timeout=10, metadata=md("b"))
            assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "limits.refusals_per_s" in ei.value.details()
            # A was not charged for B's refusals
            assert a.namespace(LAYOUT, model="a-model").lookup(np.arange(16)) == 0
            # the bucket refills at 0.5 a second: B is served again within a few seconds
            end = time.monotonic() + 15
            while True:
                try:
                    stub.Lookup(pb.LookupRequest(namespace_id=b_ns, keys=[b"\x01" * 16]),
                                timeout=10, metadata=md("b"))
                    break
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                    assert time.monotonic() < end, "B was not served again"
                    time.sleep(0.1)
    finally:
        cleanup(d)


def test_loopback_is_checked_on_the_parsed_address(tmp_path: Path) -> None:
    """Finding 11: a host name that starts with 127. is a name, not a loopback address."""
    for addr, want in (("127.0.0.1:1", True), ("127.3.4.5:1", True), ("[::1]:1", True),
                       ("localhost:1", True), ("127.evil.com:1", False),
                       ("127.0.0.1.nip.io:1", False), ("0.0.0.0:1", False),
                       ("[::]:1", False), ("10.0.0.1:1", False)):
        assert is_loopback(addr) is want, addr
    with pytest.raises(DaemonError) as ei:
        start_daemon(tmp_path, {"server.tcp": "127.evil.com:0"})
    assert "listens beyond loopback with no authentication" in str(ei.value)
    shutil.rmtree(tmp_path / "data", ignore_errors=True)
