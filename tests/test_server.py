"""The daemon over raw gRPC stubs: every RPC, big messages, restarts, shutdown, lock, metrics.

Everything runs against a real `python -m kvstore serve` subprocess (tests/daemon.py).
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import xxhash
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client._proto import kvstore_pb2_grpc as pb_grpc
from kvstore_client.common.shm import attach

from tests.daemon import cleanup, start_daemon

ROOT = Path(__file__).resolve().parent.parent
SMALL = pb.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=16, dtype="float16")
SMALL_BYTES = 2 * 2 * 16 * 2 * 64 * 2                     # 16 KiB
BIG = pb.KVLayout(num_layers=40, num_kv_heads=8, head_dim=128, block_tokens=16, dtype="bfloat16")
BIG_BYTES = 40 * 2 * 16 * 8 * 128 * 2                     # 2.5 MiB


def register(stub: pb_grpc.KVStoreStub, layout: pb.KVLayout = SMALL,
             model: str = "test/model") -> pb.RegisterNamespaceResponse:
    spec = pb.NamespaceSpec(model=model, layout=layout)
    return stub.RegisterNamespace(pb.RegisterNamespaceRequest(spec=spec), timeout=10)


def chain(n: int, seed: int = 0) -> list[bytes]:
    """n distinct 16-byte keys (their chaining is the store's business, not the test's)."""
    return [xxhash.xxh3_128_digest(f"{seed}:{i}".encode()) for i in range(n)]


def blocks(n: int, size: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]


def put(stub: pb_grpc.KVStoreStub, ns: bytes, keys: list[bytes], data: list[bytes],
        per_message: int = 4) -> pb.PutResponse:
    def messages():
        for i in range(0, len(keys), per_message):
            first = i == 0
            yield pb.PutRequest(namespace_id=ns if first else b"",
                                blocks=[pb.Block(key=k, data=d) for k, d in
                                        zip(keys[i:i + per_message], data[i:i + per_message],
                                            strict=True)])
    return stub.Put(messages(), timeout=30)


def get(stub: pb_grpc.KVStoreStub, ns: bytes, keys: list[bytes]) -> tuple[list, int]:
    """(blocks as (key, data), number of stream messages)."""
    out, n = [], 0
    for msg in stub.Get(pb.GetRequest(namespace_id=ns, keys=keys), timeout=30):
        n += 1
        out.extend((b.key, b.data) for b in msg.blocks)
    return out, n


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One daemon for the tests that do not restart it (each uses its own namespace)."""
    d = start_daemon(tmp_path_factory.mktemp("shared"))
    try:
        yield d
    finally:
        cleanup(d)


def code_of(call, *args, **kwargs) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as ei:
        call(*args, **kwargs)
    return ei.value.code()


def test_every_rpc_round_trip(shared):
    with shared.channel() as ch:
        stub = pb_grpc.KVStoreStub(ch)
        reg = register(stub)
        assert len(reg.namespace_id) == 16 and reg.block_bytes == SMALL_BYTES
        assert reg.host_pool.kind == "shm" and reg.host_pool.size > 0 and reg.daemon_id
        assert register(stub).namespace_id == reg.namespace_id       # idempotent
        ns = reg.namespace_id
        keys = chain(6)
        data = blocks(6, SMALL_BYTES)

        # Zero-copy write path: Reserve -> fill the slots through the mapped pool -> Commit.
        lease = stub.Reserve(pb.ReserveRequest(namespace_id=ns, count=4), timeout=10).lease
        assert lease.lease_id and len(lease.slots) == 4 and lease.tier == "host"
        slab = attach(reg.host_pool.name, reg.host_pool.size)
        try:
            for s, d in zip(lease.slots, data[:4], strict=True):
                assert s.length == SMALL_BYTES
                slab.array[s.offset:s.offset + s.length] = np.frombuffer(d, np.uint8)
            committed = stub.Commit(pb.CommitRequest(
                lease_id=lease.lease_id, keys=keys[:3],
                checksums=[xxhash.xxh3_64_intdigest(d) for d in data[:3]]), timeout=10)
            assert (committed.stored, committed.duplicates) == (3, 0)

            # Bytes path: Put the rest of the chain (one duplicate) over the stream.
            res = put(stub, ns, keys[2:], data[2:], per_message=2)
            assert (res.stored, res.duplicates) == (3, 1)

            look = stub.Lookup(pb.LookupRequest(namespace_id=ns, keys=keys + chain(2, 9)),
                               timeout=10)
            assert look.prefix_blocks == 6 and look.per_tier["host"] == 6

            # Read path: Acquire pins the prefix; the slots hold exactly the bytes written.
            acq = stub.Acquire(pb.AcquireRequest(namespace_id=ns, keys=keys), timeout=10).lease
            assert list(acq.keys) == keys
            for s, d, c in zip(acq.slots, data, acq.checksums, strict=True):
                assert bytes(slab.array[s.offset:s.offset + s.length]) == d
                assert c == xxhash.xxh3_64_intdigest(d)
            renewed = stub.RenewLease(pb.RenewLeaseRequest(lease_id=acq.lease_id, ttl_s=60),
                                      timeout=10)
            assert renewed.deadline >= acq.deadline
            stats = stub.Stats(pb.StatsRequest(), timeout=10)
            assert stats.active_leases == 1
            stub.Release(pb.ReleaseRequest(lease_id=acq.lease_id), timeout=10)
            assert code_of(stub.Release, pb.ReleaseRequest(lease_id=acq.lease_id),
                           timeout=10) == grpc.StatusCode.NOT_FOUND
        finally:
            slab.close()

        got, _ = get(stub, ns, keys)
        assert got == list(zip(keys, data, strict=True))

        stats = stub.Stats(pb.StatsRequest(), timeout=10)
        tiers = {t.name: t for t in stats.tiers}
        assert tiers["host"].blocks >= 6 and tiers["host"].capacity_bytes == 64 << 20
        assert "ssd" in tiers and stats.namespaces >= 1 and stats.active_leases == 0
        assert stats.daemon_id == reg.daemon_id and stats.counters

        assert stub.Flush(pb.FlushRequest(), timeout=30).demoted >= 6
        ev = stub.Evict(pb.EvictRequest(tier="host"), timeout=30)
        assert ev.blocks >= 6 and ev.freed_bytes >= 6 * SMALL_BYTES
        look = stub.Lookup(pb.LookupRequest(namespace_id=ns, keys=keys), timeout=10)
        assert look.per_tier["host"] == 0 and look.per_tier["ssd"] == 6
        got, _ = get(stub, ns, keys)                 # promoted back from SSD
        assert [d for _, d in got] == data

        assert stub.Delete(pb.DeleteRequest(namespace_id=ns, keys=keys[4:]),
                           timeout=10).deleted == 2
        assert stub.Lookup(pb.LookupRequest(namespace_id=ns, keys=keys),
                           timeout=10).prefix_blocks == 4
        assert stub.Delete(pb.DeleteRequest(namespace_id=ns, all=True), timeout=10).deleted == 4
        got, n = get(stub, ns, keys)
        assert got == [] and n == 1                  # a miss is one empty message


def test_health_reflection_and_socket_mode(shared):
    assert stat.S_IMODE(os.stat(shared.socket).st_mode) == 0o600
    with shared.channel() as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "kvstore.v1.KVStore"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        replies = refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        names = {s.name for r in replies for s in r.list_services_response.service}
        assert {"kvstore.v1.KVStore", "grpc.health.v1.Health"} <= names


def test_big_blocks_and_batches_pass(shared):
    """2.5 MiB blocks, one per Put message, and back in Get batches of several; a Put message
    above the receive limit (server.max_receive_bytes, 4 MiB) is refused from its length."""
    with shared.channel() as ch:
        stub = pb_grpc.KVStoreStub(ch)
        ns = register(stub, BIG, "test/big").namespace_id
        keys, data = chain(8, 1), blocks(8, BIG_BYTES, 1)
        with pytest.raises(grpc.RpcError) as ei:
            put(stub, ns, keys, data, per_message=8)        # 20 MiB in one message
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in ei.value.details()
        res = put(stub, ns, keys, data, per_message=1)
        assert res.stored == 8
        got, messages = get(stub, ns, keys)
        assert [k for k, _ in got] == keys
        assert all(a == b for (_, a), b in zip(got, data, strict=True))
        assert 2 <= messages <= 8          # batched, each message below ~8 MiB


def test_restart_sigterm_lock_and_crash(tmp_path):
    """One daemon's life: data survives a restart (served from SSD), SIGTERM removes the
    socket, a second daemon on the folder is refused while the first runs, and after SIGKILL
    (stale socket left behind) a new one starts."""
    d = start_daemon(tmp_path)
    try:
        with d.channel() as ch:
            stub = pb_grpc.KVStoreStub(ch)
            reg = register(stub)
            keys, data = chain(5, 2), blocks(5, SMALL_BYTES, 2)
            assert put(stub, reg.namespace_id, keys, data).stored == 5

        other_sock = str(Path(d.socket).with_name("other.sock"))
        second = subprocess.run(
            [sys.executable, "-m", "kvstore", "serve", "--data-dir", str(d.data_dir),
             "--socket", other_sock, "--tcp", "", "--metrics", "", "--host-capacity", "16MiB"],
            capture_output=True, text=True, timeout=60, env=d.env)
        assert second.returncode == 1, second.stderr
        assert f"pid {d.proc.pid}" in second.stderr and "in use" in second.stderr
        assert "Traceback" not in second.stderr and not os.path.exists(other_sock)
        assert d.alive() and os.path.exists(d.socket)

        assert d.stop() == 0
        assert not os.path.exists(d.socket) and "stopped" in d.output()

        d.start()                     # the lock went with the process
        with d.channel() as ch:
            stub = pb_grpc.KVStoreStub(ch)
            look = stub.Lookup(pb.LookupRequest(namespace_id=reg.namespace_id, keys=keys),
                               timeout=10)
            assert look.prefix_blocks == 5
            assert look.per_tier["ssd"] == 5 and look.per_tier["host"] == 0
            got, _ = get(stub, reg.namespace_id, keys)
            assert got == list(zip(keys, data, strict=True))
            reg2 = register(stub)
            assert reg2.namespace_id == reg.namespace_id and reg2.daemon_id != reg.daemon_id

        d.kill()
        assert os.path.exists(d.socket)          # SIGKILL: nobody removed it
        d.start()                                # flock died with the process; socket reused
        with d.channel() as ch:
            got, _ = get(pb_grpc.KVStoreStub(ch), reg.namespace_id, keys)
            assert got == list(zip(keys, data, strict=True))
    finally:
        cleanup(d)


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def documented_metrics() -> set[str]:
    text = (ROOT / "README.md").read_text()
    return set(re.findall(r"^\| `(kvstore_[a-z0-9_]+)`", text, re.M))


def test_metrics_endpoint_lists_documented_metrics(shared):
    with shared.channel() as ch:
        stub = pb_grpc.KVStoreStub(ch)
        ns = register(stub).namespace_id
        keys, data = chain(3, 3), blocks(3, SMALL_BYTES, 3)
        put(stub, ns, keys, data)
        stub.Lookup(pb.LookupRequest(namespace_id=ns, keys=keys), timeout=10)
        code_of(stub.Lookup, pb.LookupRequest(namespace_id=b"x", keys=keys), timeout=10)
        stub.Flush(pb.FlushRequest(), timeout=10)
        stub.Evict(pb.EvictRequest(tier="host"), timeout=10)
        get(stub, ns, keys)
    text = _scrape(shared.metrics_url)
    families = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    exposed = {f for f in families if f.startswith("kvstore_")}
    documented = documented_metrics()
    assert len(documented) >= 20
    # Every metric the daemon exposes is documented (documenting the base name of counters).
    undocumented = {f for f in exposed if f not in documented and f + "_total" not in documented}
    assert not undocumented, f"add these to README.md, Metrics: {sorted(undocumented)}"
    # The core set is there after this workload.
    for name in ("kvstore_rpc_duration_seconds", "kvstore_rpc_errors_total",
                 "kvstore_tier_hits_total", "kvstore_tier_misses_total",
                 "kvstore_tier_used_bytes", "kvstore_tier_capacity_bytes", "kvstore_tier_blocks",
                 "kvstore_tier_evictions_total",
                 "kvstore_tier_demotions_total", "kvstore_tier_promotions_total",
                 "kvstore_bytes_moved_total", "kvstore_codec_bytes_in_total",
                 "kvstore_corrupt_blocks_total", "kvstore_active_leases"):
        assert name in families, name
    assert re.search(r'kvstore_rpc_errors_total\{code="INVALID_ARGUMENT",method="Lookup"\} '
                     r'[1-9]', text)
    assert 'kvstore_rpc_duration_seconds_bucket{le="5e-05",method="Put"}' in text
    assert re.search(r'kvstore_tier_blocks\{tier="ssd"\} [1-9]', text)
