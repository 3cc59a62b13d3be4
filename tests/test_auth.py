"""Tenants against a real daemon: tokens, uid handshake, mTLS, ownership, scoped admin calls.

Tenant B, holding its own valid token, tries to read, overwrite, evict, delete and see the
stats of tenant A's blocks by every RPC, with A's namespace id and A's lease ids (copied, as a
leaked id would be): every attempt is refused as an unknown id would be (NOT_FOUND) or touches
only B's own blocks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import grpc
import pytest
import torch
from kvstore_client import (
    InvalidArgument,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
    connect,
)
from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client._proto import kvstore_pb2_grpc as pbg
from kvstore_client.wire import encode_put

from kvstore.tenants import hash_token
from tests import optional_deps
from tests.daemon import DaemonError, cleanup, start_daemon
from tests.kv_data import LAYOUT, T, make_kv, prompt

TOKENS = {"team-a": "token-of-a", "team-b": "token-of-b", "ops": "token-of-ops"}


def tokens_file(tmp_path: Path, extra: str = "") -> Path:
    p = tmp_path / "tenants.toml"
    p.write_text(textwrap.dedent(f"""
        [tenants.team-a]
        token_sha256 = "{hash_token(TOKENS['team-a'])}"
        models = ["a-*"]
        host_quota = "8MiB"     # its own pool: it may hold leases (the shared pool's are admins')
        [tenants.team-b]
        token_sha256 = ["{hash_token(TOKENS['team-b'])}"]
        models = ["a-*", "b-*"]
        [tenants.ops]
        token_sha256 = "{hash_token(TOKENS['ops'])}"
        admin = true
    """) + extra)
    return p


def world_readable_dir() -> Path:
    """A folder other uids can reach (pytest's tmp_path sits under a 0700 folder of root)."""
    base = Path(tempfile.mkdtemp(prefix="kvs-uid-"))
    base.chmod(0o755)
    return base


def md(tenant: str) -> tuple:
    return (("authorization", f"Bearer {TOKENS[tenant]}"),)


def code(fn, *args, **kw) -> tuple[grpc.StatusCode, str]:
    try:
        out = fn(*args, **kw)
        if hasattr(out, "__iter__") and not hasattr(out, "SerializeToString"):
            list(out)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth")
    d = start_daemon(tmp, {"auth.tokens_file": str(tokens_file(tmp))})
    try:
        yield d
    finally:
        cleanup(d)


def test_no_or_wrong_token_is_unauthenticated(world) -> None:
    with world.channel() as ch:
        stub = pbg.KVStoreStub(ch)
        c, msg = code(stub.Stats, pb.StatsRequest(), timeout=10)
        assert c == grpc.StatusCode.UNAUTHENTICATED
        assert "no credentials" in msg and "authorization: Bearer" in msg
        c, msg = code(stub.Stats, pb.StatsRequest(), timeout=10,
                      metadata=(("authorization", "Bearer nope"),))
        assert c == grpc.StatusCode.UNAUTHENTICATED and "matches no tenant" in msg
        c, msg = code(stub.Stats, pb.StatsRequest(), timeout=10,
                      metadata=(("authorization", "Basic x"),))
        assert c == grpc.StatusCode.UNAUTHENTICATED and "'Bearer <token>'" in msg
    # the SDK: this process's uid (root) is in no tenant's `uids`, and it sent no token
    with connect(world.address) as c:
        with pytest.raises(Unauthenticated, match="no tenant lists uid 0"):
            c.stats()


def test_tenant_b_cannot_touch_tenant_a(world) -> None:
    ids, kv = prompt(1, 4), make_kv(1, 4)
    with connect(world.address, token=TOKENS["team-a"], transport="grpc") as a, \
            connect(world.address, token=TOKENS["team-b"], transport="grpc") as b:
        ns_a = a.namespace(LAYOUT, model="a-model")
        assert ns_a.store(ids, kv) == 4
        keys = ns_a.keys(ids)
        # B registering the very same model gets its own namespace: A's blocks are not there
        ns_b = b.namespace(LAYOUT, model="a-model")
        assert a.tenant == "team-a" and b.tenant == "team-b"     # the handshake's answer
        assert ns_b.ns_id != ns_a.ns_id
        assert ns_b.lookup_keys(keys) == 0
        assert ns_b.load(ids, out=torch.zeros_like(kv)) == 0
        ids_b, kv_b = prompt(2, 3), make_kv(2, 3)
        assert ns_b.store(ids_b, kv_b) == 3

        lease = a.call("Acquire", pb.AcquireRequest(namespace_id=ns_a.ns_id, keys=keys)).lease
        wlease = a.call("Reserve", pb.ReserveRequest(namespace_id=ns_a.ns_id, count=1)).lease
        with world.channel() as ch:
            stub = pbg.KVStoreStub(ch)
            m = md("team-b")
            foreign = ns_a.ns_id                    # a copied (or forged) namespace id
            attempts = {
                "Lookup": lambda: stub.Lookup(pb.LookupRequest(namespace_id=foreign, keys=keys),
                                              timeout=10, metadata=m),
                "Get": lambda: stub.Get(pb.GetRequest(namespace_id=foreign, keys=keys),
                                        timeout=10, metadata=m),
                "Acquire": lambda: stub.Acquire(pb.AcquireRequest(namespace_id=foreign,
                                                                  keys=keys),
                                                timeout=10, metadata=m),
                "Reserve": lambda: stub.Reserve(pb.ReserveRequest(namespace_id=foreign, count=1),
                                                timeout=10, metadata=m),
                "Delete": lambda: stub.Delete(pb.DeleteRequest(namespace_id=foreign, all=True),
                                              timeout=10, metadata=m),
                "Retain": lambda: stub.Retain(pb.RetainRequest(namespace_id=foreign, keys=keys,
                                                               level="low"),
                                              timeout=10, metadata=m),
                "Put": lambda: ch.stream_unary(
                    "/kvstore.v1.KVStore/Put", request_serializer=lambda x: x,
                    response_deserializer=pb.PutResponse.FromString)(
                    iter([encode_put(foreign, b"", [(keys[0], bytes(LAYOUT.block_bytes))])]),
                    timeout=10, metadata=m),
                "Commit": lambda: stub.Commit(pb.CommitRequest(lease_id=wlease.lease_id,
                                                               keys=keys[:1]),
                                              timeout=10, metadata=m),
                "RenewLease": lambda: stub.RenewLease(pb.RenewLeaseRequest(
                    lease_id=lease.lease_id), timeout=10, metadata=m),
                "Release": lambda: stub.Release(pb.ReleaseRequest(lease_id=lease.lease_id),
                                                timeout=10, metadata=m),
                "Locate": lambda: stub.Locate(pb.LocateRequest(namespace_id=foreign, keys=keys,
                                                               prefetch=True),
                                              timeout=10, metadata=m),
                "LookupReserve": lambda: stub.LookupReserve(pb.LookupReserveRequest(
                    namespace_id=foreign, keys=keys), timeout=10, metadata=m),
                "LookupAcquire": lambda: stub.LookupAcquire(pb.LookupAcquireRequest(
                    namespace_id=foreign, keys=keys), timeout=10, metadata=m),
                # A's lease carried for release in a call on B's own namespace
                "Acquire.release_leases": lambda: stub.Acquire(pb.AcquireRequest(
                    namespace_id=ns_b.ns_id, keys=keys, release_leases=[lease.lease_id]),
                    timeout=10, metadata=m),
            }
            # refused as unknown ids are: the answer does not say whether A registered it
            for name, call in attempts.items():
                c, msg = code(call)
                assert c == grpc.StatusCode.NOT_FOUND, (name, c, msg)
                assert ("unknown namespace" in msg or "unknown lease" in msg), (name, msg)
                assert "team-a" not in msg, (name, msg)

            # Evict, Flush and Stats act on B's own namespaces only
            freed = stub.Evict(pb.EvictRequest(tier="host"), timeout=30, metadata=m)
            assert freed.blocks == 3
            s = stub.Stats(pb.StatsRequest(), timeout=10, metadata=m)
            assert s.namespaces == 1
            assert {t.name: t.blocks for t in s.tiers}["ssd"] == 3
            assert not s.counters                   # no daemon-wide activity figures
            assert stub.Flush(pb.FlushRequest(), timeout=30, metadata=m).demoted == 0
        a.release(lease.lease_id)
        a.release(wlease.lease_id)
        # A's blocks are all still in host, intact
        r = ns_a.lookup_result(keys)
        assert r.prefix_blocks == 4 and r.per_tier["host"] == 4
        out = torch.zeros_like(kv)
        assert ns_a.load(ids, out=out) == 4 * T
        assert torch.equal(out.view(torch.int16), kv.view(torch.int16))
        # deleting all of B's own namespace leaves A's alone
        assert ns_b.delete() == 3
        assert ns_a.lookup_keys(keys) == 4


def test_models_admin_and_reserved_extra(world) -> None:
    with connect(world.address, token=TOKENS["team-a"], transport="grpc") as a:
        with pytest.raises(PermissionDenied, match="tenant team-a may not register model "
                                                   "'b-model'"):
            a.namespace(LAYOUT, model="b-model")
        with pytest.raises(InvalidArgument, match="set by the daemon"):
            a.namespace(LAYOUT, model="a-x", extra={"kvstore.tenant": "team-b"})
        ns = a.namespace(LAYOUT, model="a-admin-test")
        ns.store(prompt(5, 2), make_kv(5, 2))
        keys = ns.keys(prompt(5, 2))
    with connect(world.address, token=TOKENS["ops"], transport="grpc") as ops:
        s = ops.stats()
        assert s["namespaces"] >= 2 and "host" in s["tiers"]
        ops.evict("host")                            # admin: every tenant's blocks
    with connect(world.address, token=TOKENS["team-a"], transport="grpc") as a:
        ns = a.namespace(LAYOUT, model="a-admin-test")
        assert ns.lookup_result(keys).per_tier["host"] == 0
        assert ns.lookup_keys(keys) == 2             # demoted to SSD, not lost


def test_uid_handshake_and_other_uids(tmp_path: Path, other_uids: None) -> None:
    tf = tokens_file(tmp_path, textwrap.dedent("""
        [tenants.root-procs]
        uids = [0]
        [tenants.svc]
        uids = [4242]
    """))
    base = world_readable_dir()
    d = start_daemon(base, {"auth.tokens_file": str(tf)})
    try:
        assert os.stat(d.socket).st_mode & 0o777 == 0o666
        with connect(d.address, transport="grpc") as c:      # no token: proven by uid 0
            ns = c.namespace(LAYOUT, model="m")
            assert c.tenant == "root-procs"
            assert ns.store(prompt(3, 2), make_kv(3, 2)) == 2
        script = textwrap.dedent(f"""
            import os, sys
            # Everything imported while still root: the interpreter's files may not be
            # readable by the uid the rest runs under.
            import json, socket, logging, kvstore_client.common.shm
            from kvstore_client import connect, KVLayout, Unauthenticated
            os.setgid(4242); os.setuid({{uid}})
            lay = KVLayout(2, 2, 64, 16, "bfloat16")
            try:
                with connect({d.address!r}, transport="grpc") as c:
                    ns = c.namespace(lay, model="m")
                    print("TENANT", c.tenant, ns.lookup_keys([b"\\x01" * 16]))
            except Unauthenticated as e:
                print("UNAUTHENTICATED", e)
        """)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        for uid, want in ((4242, "TENANT svc 0"), (4343, "UNAUTHENTICATED")):
            r = subprocess.run([sys.executable, "-c", script.replace("{uid}", str(uid))],
                               capture_output=True, text=True, timeout=120, env=env)
            assert want in r.stdout, r.stdout + r.stderr
            if uid == 4343:
                assert "no tenant lists uid 4343" in r.stdout
    finally:
        cleanup(d)
        shutil.rmtree(base, ignore_errors=True)


def test_tcp_beyond_loopback_needs_auth(tmp_path: Path) -> None:
    with pytest.raises(DaemonError) as ei:
        start_daemon(tmp_path / "plain", {"server.tcp": "0.0.0.0:0"})
    assert "exited with code 2" in str(ei.value)
    assert "listens beyond loopback with no authentication" in str(ei.value)
    d = start_daemon(tmp_path / "insecure", {"server.tcp": "0.0.0.0:0",
                                             "auth.insecure_tcp": True})
    try:
        assert "INSECURE: server.tcp=0.0.0.0:0 accepts unauthenticated calls" in d.output()
    finally:
        cleanup(d)
    d = start_daemon(tmp_path / "tenants", {"server.tcp": "0.0.0.0:0",
                                            "auth.tokens_file": str(tokens_file(tmp_path))})
    try:
        port = d.tcp.rpartition(":")[2]
        with connect(f"127.0.0.1:{port}", token=TOKENS["team-a"]) as a:
            assert a.stats()["namespaces"] == 0
        assert "INSECURE" not in d.output()
    finally:
        cleanup(d)


def test_tcp_loopback_round_trip(tmp_path: Path) -> None:
    """The TCP listener itself (the default config has one on loopback)."""
    d = start_daemon(tmp_path, {"server.tcp": "127.0.0.1:0"})
    try:
        assert d.tcp and d.tcp.startswith("127.0.0.1:")
        # loopback counts as this host: control over TCP, blocks through the mapped pool;
        # transport="grpc": every byte over the TCP connection
        for seed, transport in ((7, "auto"), (8, "grpc")):
            ids, kv = prompt(seed, 5), make_kv(seed, 5)
            with connect(d.tcp, transport=transport) as c:
                ns = c.namespace(LAYOUT, model=f"tcp-{transport}")
                assert c.transport == ("shm" if transport == "auto" else "grpc")
                assert ns.store(ids, kv) == 5
                out = torch.zeros_like(kv)
                assert ns.load(ids, out=out) == 5 * T
                assert torch.equal(out.view(torch.int16), kv.view(torch.int16))
        with connect(d.tcp) as c:
            assert c.stats()["namespaces"] == 2
    finally:
        cleanup(d)


def test_mtls_with_trustme(tmp_path: Path) -> None:
    trustme = optional_deps.module("trustme")
    ca = trustme.CA()
    server = ca.issue_cert("localhost", "127.0.0.1")
    alice = ca.issue_cert("alice", common_name="team-a")
    stranger = ca.issue_cert("mallory", common_name="mallory")
    other_ca = trustme.CA().issue_cert("team-a", common_name="team-a")
    files = {}
    for name, cert in (("server", server), ("alice", alice), ("stranger", stranger),
                       ("forged", other_ca)):
        files[name] = (tmp_path / f"{name}.pem", tmp_path / f"{name}.key")
        cert.cert_chain_pems[0].write_to_path(files[name][0])
        cert.private_key_pem.write_to_path(files[name][1])
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(ca_file)
    tf = tokens_file(tmp_path, textwrap.dedent("""
        [tenants.certs]
        cert_names = ["team-a"]
    """))
    d = start_daemon(tmp_path, {"server.tcp": "0.0.0.0:0", "auth.tokens_file": str(tf),
                                "auth.tls_cert_file": str(files["server"][0]),
                                "auth.tls_key_file": str(files["server"][1]),
                                "auth.tls_client_ca_file": str(ca_file)})
    try:
        assert "(mTLS)" in d.output()
        addr = f"127.0.0.1:{d.tcp.rpartition(':')[2]}"

        def client(who: str | None, **kw):
            cert, key = files[who] if who else (None, None)
            return connect(addr, tls_ca_file=str(ca_file), tls_cert_file=cert and str(cert),
                           tls_key_file=key and str(key), timeout=5, **kw)
        with client("alice") as c:                     # the certificate names the tenant
            ns = c.namespace(LAYOUT, model="a-tls")
            assert ns.store(prompt(8, 2), make_kv(8, 2)) == 2
            assert c.stats()["namespaces"] == 1
        with client("stranger") as c:                  # a valid certificate of no tenant
            with pytest.raises(Unauthenticated, match="no credentials"):
                c.stats()
        with client("stranger", token=TOKENS["team-b"]) as c:   # ... plus a token
            assert c.stats()["namespaces"] == 0
        # A client whose TLS does not match is told so at once, not after its deadline with
        # "Deadline Exceeded" (the daemon closes each such connection before any gRPC).
        mismatched = [client(None), client("forged"),     # no client cert / another CA's
                      connect(addr, timeout=5),           # plaintext to a TLS port
                      connect(addr, tls_ca_file=str(files["forged"][0]), timeout=5)]
        for c in mismatched:
            with c:
                t0 = time.monotonic()
                with pytest.raises(Unavailable, match="TLS|tls_ca_file"):
                    c.stats()
                assert time.monotonic() - t0 < 2.5
    finally:
        cleanup(d)


def test_status_command_sends_credentials(world) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    argv = [sys.executable, "-m", "kvstore", "status", "--address", world.socket, "--json"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                       env={**env, "KVSTORE_TOKEN": TOKENS["ops"]})
    assert r.returncode == 0, r.stderr
    assert '"daemon_id"' in r.stdout and '"tiers"' in r.stdout
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode != 0
    assert "no tenant lists uid 0" in r.stderr


def test_shared_gpu_slabs_are_admin_only_with_tenants(tmp_path: Path) -> None:
    # A tenant without a gpu_quota has no device slab of its own (tests/test_tenant_gpu.py
    # covers those that do): it may not lease gpu slots, and its Evict finds nothing there.
    gpu = {"gpu.enabled": "true", "gpu.backend": "cpu", "gpu.capacity": "1MiB"}
    tf = tokens_file(tmp_path)
    d = start_daemon(tmp_path / "d", {"auth.tokens_file": str(tf), **gpu})
    try:
        with connect(d.address, token=TOKENS["team-a"], transport="grpc") as a:
            ns = a.namespace(LAYOUT, model="a-gpu")
            for method, req in (
                    ("Reserve", pb.ReserveRequest(namespace_id=ns.ns_id, count=1, tier="gpu")),
                    ("Acquire", pb.AcquireRequest(namespace_id=ns.ns_id, keys=[b"\1" * 16],
                                                  tier="gpu"))):
                with pytest.raises(PermissionDenied, match="may not lease gpu slots"):
                    a.call(method, req)
            assert a.gpu_pools == []
            assert a.evict("gpu") == (0, 0)
    finally:
        cleanup(d)


def test_quotas_that_cannot_isolate_tenants_are_said_at_start(world, tmp_path: Path) -> None:
    from kvstore.config import StoreConfig
    from kvstore.tenants import load_tenants, quota_overcommit

    # The world's tenants have no ssd_quota: the running daemon said so once, naming them.
    lines = [ln for ln in world.output().splitlines() if "quotas do not isolate" in ln]
    assert len(lines) == 1 and "ssd" in lines[0] and "team-a" in lines[0], lines

    cfg = StoreConfig(data_dir=str(tmp_path))
    cfg.ssd.capacity = 10 << 20
    cfg.tenants = {n: {"token_sha256": hash_token(n), "ssd_quota": q}
                   for n, q in (("a", "6MiB"), ("b", "4MiB"))}
    assert quota_overcommit(cfg, load_tenants(cfg)) == []           # 6 + 4 fit 10
    cfg.tenants["b"]["ssd_quota"] = "5MiB"
    (warn,) = quota_overcommit(cfg, load_tenants(cfg))
    assert "add up to 11534336 bytes, more than ssd.capacity (10485760)" in warn
    cfg.remote.enabled = True                                       # no remote quotas at all
    assert len(quota_overcommit(cfg, load_tenants(cfg))) == 2
    assert quota_overcommit(cfg, {}) == []                          # no tenants: one trust domain
    cfg.remote.enabled = False                                      # quotas of tiers that are off
    cfg.ssd.enabled = False
    cfg.tenants["a"]["gpu_quota"] = "1MiB"
    assert sorted(quota_overcommit(cfg, load_tenants(cfg))) == [
        "gpu_quota of tenant(s) a has no effect: the gpu tier is off (gpu.enabled = false)",
        "ssd_quota of tenant(s) a, b has no effect: the ssd tier is off (ssd.enabled = false)"]
