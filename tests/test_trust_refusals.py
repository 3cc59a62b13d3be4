"""Refused calls: what they cost the daemon, and the budget (kvstore/gate.py, RefusalBudget) that
limits them, against an honest engine and a flood.

A tenant's refused calls are budgeted so that a hostile tenant cannot buy daemon CPU with
requests the daemon must receive and refuse. Unknown ids (NOT_FOUND) were charged like
mistakes, so an honest engine holding leases when the daemon restarted met one "unknown
lease" per lease at once and was then refused for seconds. Unknown ids now spend from a
bucket as large as what a tenant may hold; mistakes keep the small one.
"""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from kvstore_client import KVLayout, connect
from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client._proto import kvstore_pb2_grpc as pbg

from kvstore.tenants import hash_token
from tests.daemon import cleanup, start_daemon
from tests.trust_net_helpers import TOKENS, channel, md, settled

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=16, dtype="bfloat16")
BURST = 5
LEASES = 40                          # limits.leases_per_tenant
NAMESPACES = 4                       # limits.namespaces_per_tenant


def settings(tmp: Path) -> dict:
    tokens = tmp / "tenants.toml"
    tokens.write_text(textwrap.dedent(f"""
        [tenants.a]
        token_sha256 = "{hash_token(TOKENS['a'])}"
        host_quota = "8MiB"     # a pool of its own: it may hold leases
        [tenants.b]
        token_sha256 = "{hash_token(TOKENS['b'])}"
    """))
    # a budget that refills slowly, so that a lockout would last the whole test
    return {"auth.tokens_file": str(tokens), "limits.refusals_per_s": 0.2,
            "limits.refusal_burst": BURST, "limits.leases_per_tenant": LEASES,
            "limits.namespaces_per_tenant": NAMESPACES}


def test_an_engine_holding_leases_through_a_restart_is_served_at_once(tmp_path: Path) -> None:
    """Every lease the engine held comes back unknown after the restart (more of them than the
    mistakes' burst); releasing them all must not lock the engine out of its next calls."""
    d = start_daemon(tmp_path, settings(tmp_path))
    try:
        with connect(d.address, token=TOKENS["a"], transport="grpc") as a:
            ns = a.namespace(LAYOUT, model="a-model")
            held = [a.call("Reserve", pb.ReserveRequest(namespace_id=ns.ns_id, count=1))
                    .lease.lease_id for _ in range(LEASES)]
            d.restart()
            codes = []
            for lease_id in held:
                try:
                    a.call("Release", pb.ReleaseRequest(lease_id=lease_id), timeout=5)
                    codes.append("OK")
                except Exception as e:  # noqa: BLE001 - the code is what is checked
                    codes.append(getattr(e, "code", type(e).__name__))
            assert set(codes) == {"NOT_FOUND"}, codes
            # at once: no call of the engine's is refused for the unknown ids it met
            ns2 = a.namespace(LAYOUT, model="a-model")
            assert ns2.lookup(np.arange(LAYOUT.block_tokens * 4)) == 0
            lease = a.call("Reserve", pb.ReserveRequest(namespace_id=ns2.ns_id, count=2)).lease
            assert len(lease.slots) == 2
            a.release(lease.lease_id)
    finally:
        cleanup(d)


def test_a_flood_of_unknown_ids_is_still_refused(tmp_path: Path) -> None:
    """B naming ids it does not hold (A's namespace, leases it never had) gets NOT_FOUND until
    it has spent what a tenant may hold, then RESOURCE_EXHAUSTED, unread; its mistakes are
    refused after the small burst as before; A is charged for neither."""
    d = start_daemon(tmp_path, settings(tmp_path))
    try:
        with connect(d.address, token=TOKENS["a"], transport="grpc") as a, \
                channel(d.address) as ch:
            a_ns = a.namespace(LAYOUT, model="a-model").ns_id
            stub = pbg.KVStoreStub(ch)
            foreign = pb.LookupRequest(namespace_id=a_ns, keys=[b"\x01" * 16])
            codes = []
            for _ in range(BURST + LEASES + NAMESPACES + 5):
                with pytest.raises(grpc.RpcError) as ei:
                    stub.Lookup(foreign, timeout=10, metadata=md("b"))
                codes.append(ei.value.code())
            allowance = BURST + LEASES + NAMESPACES
            assert set(codes[:allowance]) == {grpc.StatusCode.NOT_FOUND}, codes
            assert set(codes[allowance:]) == {grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
            assert a.namespace(LAYOUT, model="a-model").lookup(np.arange(16)) == 0
    finally:
        cleanup(d)


def test_refusals_take_no_worker_thread(tmp_path: Path) -> None:
    """A peer without a token can make the daemon refuse calls in a loop. Each refusal went
    through grpcio's thread pool (a worker woken, a context built, two batches posted); it is
    answered on grpcio's serving thread instead (kvstore/refusal.py), so a flood of them
    starts no worker thread and wakes none, whatever grpcio is pinned to."""
    from concurrent.futures import ThreadPoolExecutor

    from kvstore import refusal
    assert refusal.install(), "this grpcio lacks the rejection path kvstore/refusal.py uses"
    d = start_daemon(tmp_path, settings(tmp_path))
    try:
        settled(d)                           # its after-start threads have come and gone
        with channel(d.address) as ch:
            lookup = ch.unary_unary("/kvstore.v1.KVStore/Lookup",
                                    request_serializer=lambda b: b,
                                    response_deserializer=lambda b: b)
            put = ch.stream_unary("/kvstore.v1.KVStore/Put", request_serializer=lambda b: b,
                                  response_deserializer=lambda b: b)

            def refused(i: int) -> tuple:
                with pytest.raises(grpc.RpcError) as ei:
                    if i % 2:
                        lookup(b"\x0a\x10" + b"\x01" * 16, timeout=10)
                    else:
                        put(iter([b"\x0a\x10" + b"\x01" * 16]), timeout=10)
                return ei.value.code(), "no credentials" in ei.value.details()

            refused(0)                       # the channel connected, grpcio's threads up
            tasks = Path(f"/proc/{d.proc.pid}/task")
            before = len(list(tasks.iterdir()))
            with ThreadPoolExecutor(16) as pool:
                answers = set(pool.map(refused, range(256)))
            after = len(list(tasks.iterdir()))
        assert answers == {(grpc.StatusCode.UNAUTHENTICATED, True)}, answers
        assert after <= before + 1, (before, after)
    finally:
        cleanup(d)


def test_a_tenant_out_of_budget_is_answered_late_and_holds_little(tmp_path: Path) -> None:
    """Past its budget a tenant's refusals are posted a second late (kvstore/refusal.py,
    Held), so a flood that waits for its answers is slowed to that pace; it may have at most
    its call cap of them held, and past that it is answered at once. A is not slowed."""
    import threading
    s = settings(tmp_path)
    s["limits.tenant_calls"] = 4
    d = start_daemon(tmp_path, s)
    try:
        with connect(d.address, token=TOKENS["a"], transport="grpc") as a, \
                channel(d.address) as ch:
            ns = a.namespace(LAYOUT, model="a-model")
            stub = pbg.KVStoreStub(ch)
            garbage = pb.LookupRequest(namespace_id=b"", keys=[b"\x01" * 16])
            for _ in range(BURST):                      # B's mistakes: its budget spent
                with pytest.raises(grpc.RpcError) as ei:
                    stub.Lookup(garbage, timeout=10, metadata=md("b"))
                assert ei.value.code() != grpc.StatusCode.RESOURCE_EXHAUSTED
            t0 = time.monotonic()
            answered: list[tuple[float, object]] = []

            def call() -> None:
                try:
                    stub.Lookup(garbage, timeout=10, metadata=md("b"))
                except grpc.RpcError as e:
                    answered.append((time.monotonic() - t0, e.code()))
            threads = [threading.Thread(target=call) for _ in range(4 + 3)]
            for t in threads:
                t.start()
            assert ns.lookup(np.arange(16)) == 0        # A is served meanwhile
            for t in threads:
                t.join(10)
            assert {c for _, c in answered} == {grpc.StatusCode.RESOURCE_EXHAUSTED}, answered
            late = [at for at, _ in answered if at >= 0.9]
            assert len(answered) == 7 and len(late) == 4, answered   # the cap's worth held
    finally:
        cleanup(d)


def test_the_lane_spends_from_the_same_budget(tmp_path: Path) -> None:
    """The fast lane answered every refused call at once, uncharged: a tenant flooding its
    own lane connections with mistakes was never slowed. Its refusals now spend the budget
    its gRPC calls spend; past it a lane call is answered RESOURCE_EXHAUSTED unread, a
    second late, and its gRPC calls are refused too. A is served meanwhile."""
    import json
    import socket

    from kvstore_client.common.lane_frames import Frames
    from kvstore_client.common.lane_wire import CODES, HEADER, METHOD_ID, lane_path
    d = start_daemon(tmp_path, settings(tmp_path))
    try:
        with connect(d.address, token=TOKENS["a"]) as a, channel(d.address) as ch:
            ns = a.namespace(LAYOUT, model="a-model")
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(10)
            s.connect(lane_path(d.socket))
            s.sendall(json.dumps({"v": 1, "token": TOKENS["b"]}).encode() + b"\n")
            assert b'"ok"' in s.recv(4096)
            bad = pb.LookupRequest(namespace_id=b"", keys=[b"\x01" * 16]).SerializeToString()
            frames, answers = Frames(s), []
            for _ in range(BURST + 2):
                t0 = time.monotonic()
                s.sendall(HEADER.pack(len(bad), METHOD_ID["Lookup"]) + bad)
                code, body = frames.read(10, 10)
                answers.append((CODES[code], time.monotonic() - t0))
            s.close()
            codes = [c for c, _ in answers]
            assert set(codes[:BURST]) == {"INVALID_ARGUMENT"}, answers
            assert set(codes[BURST:]) == {"RESOURCE_EXHAUSTED"}, answers
            assert all(at >= 0.9 for _, at in answers[BURST:]), answers     # held
            # one budget: B's gRPC calls are out of it too
            with pytest.raises(grpc.RpcError) as ei:
                pbg.KVStoreStub(ch).Lookup(pb.LookupRequest(namespace_id=b"", keys=[]),
                                           timeout=10, metadata=md("b"))
            assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert ns.lookup(np.arange(16)) == 0
    finally:
        cleanup(d)
