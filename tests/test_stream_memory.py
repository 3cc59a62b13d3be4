"""What a tenant's stalled Put and Get streams may make the daemon hold.

Why these tests: a client that stops sending the rest of a split block, or stops reading a Get,
keeps the daemon's buffers for that call alive until the call's deadline. Before the per-tenant
stream budget (limits.stream_bytes_per_tenant, kvstore/stream_budget.py) each such call
held up to three blocks of heap, and a tenant could register blocks larger than its own pool,
so 16 calls of one tenant held GiBs whatever its host_quota. These run a real daemon with two
tenants and check the refusals, and that the heap stays bounded while Gets are stalled.
"""

from __future__ import annotations

import textwrap
import threading
import time
from pathlib import Path

import grpc
import pytest
from kvstore_client import KVLayout, connect
from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client._proto import kvstore_pb2_grpc as pbg
from kvstore_client.common.errors import KVStoreError

from kvstore.tenants import hash_token
from tests.daemon import cleanup, start_daemon

TOKENS = {"a": "token-of-tenant-a", "b": "token-of-tenant-b"}
MIB = 1 << 20
PIECE = 4 * MIB - 64 * 1024          # under the 4 MiB receive limit
BLOCK16 = KVLayout(16, 8, 128, 256, "bfloat16")   # 16 MiB blocks


def md(tenant: str) -> tuple:
    return (("authorization", f"Bearer {TOKENS[tenant]}"),)


def daemon(tmp_path: Path, quota_a: str, quota_b: str, **extra: str):
    tf = tmp_path / "tenants.toml"
    tf.write_text(textwrap.dedent(f"""
        [tenants.a]
        token_sha256 = "{hash_token(TOKENS['a'])}"
        host_quota = "{quota_a}"
        [tenants.b]
        token_sha256 = "{hash_token(TOKENS['b'])}"
        host_quota = "{quota_b}"
    """))
    cfg = {"auth.tokens_file": str(tf), "host.capacity": "512MiB", "server.workers": "16",
           "limits.request_deadline_s": "20"}
    cfg.update(extra)
    return start_daemon(tmp_path, cfg)


def namespace(d, tenant: str, layout: KVLayout) -> tuple[bytes, int]:
    with connect(d.address, token=TOKENS[tenant], transport="grpc") as c:
        ns = c.namespace(layout, model="m")
        return bytes(ns.ns_id), layout.block_bytes


def key(i: int, tag: bytes = b"k") -> bytes:
    return (tag + i.to_bytes(8, "big")).ljust(16, b"\0")


def split_messages(ns: bytes, keys: list[bytes], bb: int, stall: threading.Event | None = None,
                   pieces: int | None = None):
    """Put messages of `keys`' blocks, each in pieces; with `stall`, the first `pieces` pieces
    of the first block only, then a wait (the block is never completed)."""
    first = True
    for k in keys:
        for n, off in enumerate(range(0, bb, PIECE)):
            if stall is not None and n == pieces:
                stall.wait()
                return
            yield pb.PutRequest(namespace_id=ns if first else b"",
                                blocks=[pb.Block(key=k if off == 0 else b"",
                                                 data=b"\x07" * min(PIECE, bb - off))])
            first = False


def rss_anon_mib(d) -> int:
    for line in open(f"/proc/{d.proc.pid}/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no RssAnon")


def test_block_larger_than_own_pool_is_refused(tmp_path):
    d = daemon(tmp_path, quota_a="64MiB", quota_b="8MiB")
    try:
        with pytest.raises(KVStoreError, match=r"tenants\.b\.host_quota"):
            namespace(d, "b", BLOCK16)            # 16 MiB blocks, an 8 MiB pool
        namespace(d, "b", KVLayout(4, 8, 128, 256, "bfloat16"))   # 4 MiB: fits
        namespace(d, "a", BLOCK16)                # a's own pool is 64 MiB
    finally:
        cleanup(d)


def test_stalled_split_puts_are_refused_past_the_tenant_budget(tmp_path):
    d = daemon(tmp_path, quota_a="64MiB", quota_b="64MiB",
               **{"limits.stream_bytes_per_tenant": "32MiB"})
    gate = threading.Event()
    errors: list[str] = []

    def stalled(i: int, ns: bytes, bb: int) -> None:
        try:
            pbg.KVStoreStub(d.channel()).Put(
                split_messages(ns, [key(i)], bb, gate, pieces=1), metadata=md("b"), timeout=20)
        except grpc.RpcError as e:
            errors.append(e.code().name)

    try:
        ns_b, bb = namespace(d, "b", BLOCK16)
        ns_a, _ = namespace(d, "a", BLOCK16)
        threads = [threading.Thread(target=stalled, args=(i, ns_b, bb), daemon=True)
                   for i in range(2)]                 # 2 x 16 MiB: b's whole budget
        for t in threads:
            t.start()
        time.sleep(1.5)
        stub = pbg.KVStoreStub(d.channel())
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as exc:
            stub.Put(split_messages(ns_b, [key(9)], bb, threading.Event(), pieces=1),
                     metadata=md("b"), timeout=20)
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "stream_bytes_per_tenant" in exc.value.details()
        assert time.monotonic() - t0 < 5               # at once, not at the deadline
        # Another tenant's budget is its own.
        r = stub.Put(split_messages(ns_a, [key(1, b"a")], bb), metadata=md("a"), timeout=20)
        assert r.stored == 1
        # The stalled streams end (their block unfinished) and give their charge back.
        gate.set()
        for t in threads:
            t.join(20)
        assert errors == ["INVALID_ARGUMENT"] * 2
        r = stub.Put(split_messages(ns_b, [key(1)], bb), metadata=md("b"), timeout=20)
        assert r.stored == 1
    finally:
        gate.set()
        cleanup(d)


def test_stalled_gets_hold_at_most_the_tenant_budget(tmp_path):
    d = daemon(tmp_path, quota_a="64MiB", quota_b="64MiB",
               **{"limits.stream_bytes_per_tenant": "64MiB"})
    calls = []
    try:
        ns_b, bb = namespace(d, "b", BLOCK16)
        ns_a, _ = namespace(d, "a", BLOCK16)
        stub = pbg.KVStoreStub(d.channel())
        keys = [key(1), key(2)]
        assert stub.Put(split_messages(ns_b, keys, bb), metadata=md("b"), timeout=30).stored == 2
        assert stub.Put(split_messages(ns_a, [key(1, b"a")], bb), metadata=md("a"),
                        timeout=30).stored == 1
        time.sleep(0.5)
        before = rss_anon_mib(d)
        for _ in range(8):           # never read: before the budget ~3 blocks (48 MiB) each
            calls.append(pbg.KVStoreStub(d.channel()).Get(
                pb.GetRequest(namespace_id=ns_b, keys=keys), metadata=md("b"), timeout=20))
        time.sleep(3)
        grown = rss_anon_mib(d) - before
        # 64 MiB of budget (a batch counts twice: the daemon's bytes and grpc's copy), plus
        # slack for the allocator; without the budget this was ~8 x 48 = 384 MiB.
        assert grown < 160, f"daemon heap grew {grown} MiB with 8 stalled Gets"
        # Tenant a's Get is not held up by b's.
        got = list(stub.Get(pb.GetRequest(namespace_id=ns_a, keys=[key(1, b"a")]),
                            metadata=md("a"), timeout=10))
        assert sum(len(m.blocks) for m in got) == 1
        for c in calls:
            c.cancel()
        calls.clear()
        # b's budget comes back once its stalled calls end.
        got = list(stub.Get(pb.GetRequest(namespace_id=ns_b, keys=keys), metadata=md("b"),
                            timeout=10))
        assert sum(len(m.blocks) for m in got) == 2
    finally:
        for c in calls:
            c.cancel()
        cleanup(d)


BLOCK1 = KVLayout(4, 8, 128, 64, "bfloat16")      # 1 MiB blocks


def whole_messages(ns: bytes, keys: list[bytes], stall: threading.Event | None = None):
    """One 1 MiB block a message; with `stall`, a wait after the last (the stream stays open)."""
    for i, k in enumerate(keys):
        yield pb.PutRequest(namespace_id=ns if i == 0 else b"",
                            blocks=[pb.Block(key=k, data=bytes([i % 251]) * MIB)])
    if stall is not None:
        stall.wait()


def test_stalled_puts_hold_at_most_the_tenant_budget(tmp_path):
    """Messages a Put received but has not stored yet (a group gathers 8 MiB before it stores
    one; more are read ahead) were never charged: each stalled Put held up to a group and the
    messages read ahead, times the calls a tenant may make. They are charged from arrival
    until stored, and a tenant at half its budget stores what each Put gathered at once, so
    stalled Puts hold little beyond what they stored, and another tenant's Puts go on."""
    budget = 24
    d = daemon(tmp_path, quota_a="128MiB", quota_b="128MiB",
               **{"limits.stream_bytes_per_tenant": f"{budget}MiB"})
    gate = threading.Event()
    outcomes: list[str] = []

    def stalled(i: int, ns: bytes) -> None:
        try:
            pbg.KVStoreStub(d.channel()).Put(
                whole_messages(ns, [key(100 * i + j) for j in range(7)], gate),
                metadata=md("b"), timeout=20)
            outcomes.append("OK")
        except grpc.RpcError as e:
            outcomes.append(e.code().name)

    try:
        ns_b, _ = namespace(d, "b", BLOCK1)
        ns_a, _ = namespace(d, "a", BLOCK1)
        time.sleep(0.5)
        before = rss_anon_mib(d)
        threads = [threading.Thread(target=stalled, args=(i, ns_b), daemon=True)
                   for i in range(12)]                  # 12 x 7 MiB held before: 84 MiB
        for t in threads:
            t.start()
        time.sleep(4)                                   # past the 2 s wait for room
        grown = rss_anon_mib(d) - before
        # Per call what arrived before it could be charged (a message on the handler's thread,
        # one on the reader's) and grpc's own copies, beside the budget: 61-89 MiB here, 171
        # MiB before messages were charged.
        assert grown < 120, f"daemon heap grew {grown} MiB with 12 stalled Puts"
        assert "OK" not in outcomes, outcomes           # (still open, stalled)
        # Another tenant's budget is its own.
        stub = pbg.KVStoreStub(d.channel())
        r = stub.Put(whole_messages(ns_a, [key(j, b"a") for j in range(16)]), metadata=md("a"),
                     timeout=20)
        assert r.stored == 16
        # The stalled streams end, store what they sent, and give their charge back.
        gate.set()
        for t in threads:
            t.join(20)
        assert outcomes.count("OK") + outcomes.count("RESOURCE_EXHAUSTED") == 12, outcomes
        r = stub.Put(whole_messages(ns_b, [key(j, b"n") for j in range(16)]), metadata=md("b"),
                     timeout=20)
        assert r.stored == 16
    finally:
        gate.set()
        cleanup(d)


def test_many_honest_puts_at_once_all_land_under_the_budget(tmp_path):
    """Puts that keep sending, more at once than the budget holds groups for: each stores what
    it gathered as soon as the tenant's budget is half used, instead of holding a group while
    the others wait for room (and are refused after 2 s)."""
    d = daemon(tmp_path, quota_a="256MiB", quota_b="64MiB",
               **{"limits.stream_bytes_per_tenant": "24MiB", "host.capacity": "512MiB"})
    results: list[object] = []

    def writer(i: int, ns: bytes) -> None:
        try:
            r = pbg.KVStoreStub(d.channel()).Put(
                whole_messages(ns, [key(1000 * i + j, b"h") for j in range(16)]),
                metadata=md("a"), timeout=30)
            results.append(r.stored)
        except grpc.RpcError as e:
            results.append(e.code().name)

    try:
        ns_a, _ = namespace(d, "a", BLOCK1)
        threads = [threading.Thread(target=writer, args=(i, ns_a), daemon=True)
                   for i in range(8)]                  # 8 x 16 MiB, a 24 MiB budget
        for t in threads:
            t.start()
        for t in threads:
            t.join(40)
        assert results == [16] * 8, results
    finally:
        cleanup(d)
