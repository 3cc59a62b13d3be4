"""Each tenant with a host quota maps its own pool, handed over as a memfd, and nothing else.

The central test runs tenant A's and tenant B's clients as separate processes under different
uids (root drops to them with setuid after importing). B stores and floods through its own pool,
then tries every name and fd it can find to reach A's blocks: every POSIX shm segment, the
daemon's and A's open fds and mappings under /proc. All must fail, B's pool must not hold A's
bytes, and A's blocks must still be resident and intact afterwards.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import grpc
import pytest
from kvstore_client import KVLayout, ResourceExhausted, connect
from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client._proto import kvstore_pb2_grpc as pbg

from kvstore.tenants import hash_token
from tests.daemon import cleanup, start_daemon
from tests.redis_fixtures import redis_server_fixture  # noqa: F401  (fixture)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=16, dtype="bfloat16")

CHILD = textwrap.dedent("""
    import glob, os, sys
    import numpy as np
    import json, socket, logging, mmap, secrets, numpy.random, kvstore_client.common.shm
    import kvstore_client.common.handoff
    from kvstore_client import connect, KVLayout
    role, uid, address = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    os.setgroups([]); os.setgid(uid); os.setuid(uid)      # from here on: another user
    lay = KVLayout(2, 2, 64, 16, "bfloat16")
    T, N = 16, 64

    def kv(seed, blocks):
        rng = np.random.default_rng(seed)
        bits = rng.integers(-2**15, 2**15, (2, 2, blocks * T, 2, 64), dtype=np.int16)
        return bits.view(np.uint16)     # the bits of bfloat16 (numpy has no bfloat16)

    def ids(seed, blocks):
        return np.random.default_rng(1000 + seed).integers(0, 50000, blocks * T)

    with connect(address, transport="shm") as c:
        ns = c.namespace(lay, model="m")
        assert c.transport == "shm" and c.pool.fd_backed, (c.transport, c.pool)
        print("TENANT", c.tenant, "POOL", c.pool.size, flush=True)
        if role == "a":
            x = kv(1, N)
            assert ns.store(ids(1, N), x) == N
            print("READY", os.getpid(), flush=True)
            sys.stdin.readline()                            # B does its worst meanwhile
            r = ns.lookup_result(ns.keys(ids(1, N)))
            out = np.zeros_like(x)
            got = ns.load(ids(1, N), out=out)
            same = np.array_equal(out.view(np.int16), x.view(np.int16))
            print("A", r.per_tier.get("host"), got // T, same, flush=True)
        else:
            a_pid, d_pid = int(sys.argv[4]), int(sys.argv[5])
            for seed in range(10, 16):                      # 6 x 1 MiB into a 2 MiB quota
                assert ns.store(ids(seed, N), kv(seed, N)) == N
            opened = []
            # Every segment of the daemon's (other programs' files in /dev/shm are not A's)
            names = (glob.glob("/dev/shm/kvstore*") + glob.glob(f"/proc/{d_pid}/fd/*")
                     + glob.glob(f"/proc/{a_pid}/fd/*") + glob.glob(f"/proc/{a_pid}/map_files/*")
                     + glob.glob(f"/proc/{d_pid}/map_files/*")
                     + [f"/proc/{a_pid}/mem", f"/proc/{d_pid}/mem"])
            tried = 0
            for p in names:
                for flags in (os.O_RDWR, os.O_RDONLY):
                    tried += 1
                    try:
                        fd = os.open(p, flags)
                    except OSError:
                        continue
                    # a pipe or socket of the daemon would not be A's memory; report any
                    opened.append(p)
                    os.close(fd)
            pool = c.pool.slab.array
            a_first = kv(1, N).view(np.uint8).reshape(-1)[:4096].tobytes()
            leak = pool.tobytes().find(a_first) >= 0
            print("B", "tried", tried, "opened", opened, "leak", leak, flush=True)
""")


def tokens(tmp: Path, extra: str) -> Path:
    p = tmp / "tenants.toml"
    p.write_text(extra)
    return p


def test_two_uids_cannot_reach_each_others_pool(other_uids: None) -> None:
    if not hasattr(os, "memfd_create"):
        pytest.skip("no memfd_create on this platform")
    base = Path(tempfile.mkdtemp(prefix="kvs-pools-"))
    base.chmod(0o755)
    tf = tokens(base, textwrap.dedent("""
        [tenants.a]
        uids = [5001]
        host_quota = "4MiB"
        [tenants.b]
        uids = [5002]
        host_quota = "2MiB"
    """))
    d = start_daemon(base, {"auth.tokens_file": str(tf), "host.capacity": "8MiB"})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    a = subprocess.Popen([sys.executable, "-c", CHILD, "a", "5001", d.address],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    try:
        lines = []
        for _ in range(2):
            line = a.stdout.readline()
            lines.append(line)
            if line.startswith("READY") or not line:
                break
        assert lines[0].startswith("TENANT a POOL 4194304"), lines + [a.stderr.read()]
        assert lines[-1].startswith("READY"), lines + [a.stderr.read()]
        a_pid = int(lines[-1].split()[1])
        b = subprocess.run([sys.executable, "-c", CHILD, "b", "5002", d.address, str(a_pid),
                            str(d.proc.pid)], capture_output=True, text=True, timeout=300,
                           env=env)
        assert "TENANT b POOL 2097152" in b.stdout, b.stdout + b.stderr
        last = b.stdout.strip().splitlines()[-1]
        assert last.startswith("B tried") and "opened [] leak False" in last, \
            b.stdout + b.stderr
        assert int(last.split()[2]) >= 6                 # it did find names to try
        out, err = a.communicate("go\n", timeout=120)
        # all 64 of A's blocks still in host (B's flood stayed in B's pool), loaded intact
        assert "A 64 64 True" in out, out + err
    finally:
        if a.poll() is None:
            a.kill()
        cleanup(d)
        shutil.rmtree(base, ignore_errors=True)


def test_quota_full_names_tenant_and_tier(tmp_path: Path) -> None:
    tf = tokens(tmp_path, textwrap.dedent(f"""
        [tenants.tiny]
        token_sha256 = "{hash_token('tiny-token')}"
        host_quota = "64KiB"
        [tenants.big]
        token_sha256 = "{hash_token('big-token')}"
    """))
    d = start_daemon(tmp_path, {"auth.tokens_file": str(tf)})
    try:
        with connect(d.address, token="tiny-token") as tiny, \
                connect(d.address, token="big-token", transport="grpc") as big:
            ns = tiny.namespace(LAYOUT, model="m")
            assert tiny.transport == "shm" and tiny.pool.size == 64 << 10
            nb = big.namespace(LAYOUT, model="m")
            with d.channel() as ch:
                stub = pbg.KVStoreStub(ch)
                with pytest.raises(grpc.RpcError) as ei:
                    stub.Reserve(pb.ReserveRequest(namespace_id=ns.ns_id, count=8), timeout=10,
                                 metadata=(("authorization", "Bearer tiny-token"),))
            assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "tenant tiny's host quota is full" in ei.value.details()
            # the slots a lease hands out are offsets into tiny's own 64 KiB pool
            lease = tiny.call("Reserve", pb.ReserveRequest(namespace_id=ns.ns_id, count=2)).lease
            assert all(s.offset + s.length <= 64 << 10 for s in lease.slots)
            tiny.release(lease.lease_id)
            # a tenant without a quota shares the main slab and gets no name of it
            assert big.pool is None
            import numpy as np
            x = np.ones((2, 2, 16 * 3, 2, 64), dtype=np.uint16)
            assert nb.store(np.arange(48), x) == 3
            assert tiny.stats()["tiers"]["host"]["blocks"] == 0
    finally:
        cleanup(d)


def test_ssd_quota_evicts_own_blocks_first_and_metrics_are_per_tenant(tmp_path: Path) -> None:
    import urllib.request

    import numpy as np

    bb = LAYOUT.block_bytes                           # 16 KiB
    tf = tokens(tmp_path, textwrap.dedent(f"""
        [tenants.a]
        token_sha256 = "{hash_token('a-token')}"
        ssd_quota = {8 * bb}
        [tenants.b]
        token_sha256 = "{hash_token('b-token')}"
    """))
    # per-tenant series are opt-in (the metrics endpoint has no authentication)
    d = start_daemon(tmp_path, {"auth.tokens_file": str(tf), "server.metrics_tenants": True})
    try:
        with connect(d.address, token="a-token", transport="grpc") as a, \
                connect(d.address, token="b-token", transport="grpc") as b:
            na, nb = a.namespace(LAYOUT, model="m"), b.namespace(LAYOUT, model="m")

            def kv(seed: int, blocks: int) -> np.ndarray:
                return np.random.default_rng(seed).integers(
                    0, 2**16, (2, 2, 16 * blocks, 2, 64), dtype=np.uint16)

            ids_b = np.arange(16 * 6) + 10**6
            assert nb.store(ids_b, kv(99, 6)) == 6
            b.evict("host")                                # B's 6 blocks go to SSD
            for round_ in range(3):                        # A demotes 3 x 6 blocks, quota 8
                ids = np.arange(16 * 6) + round_ * 10**4
                assert na.store(ids, kv(round_, 6)) == 6
                a.evict("host")
                used = a.stats()["tiers"]["ssd"]["used_bytes"]
                assert used <= 8 * bb, (round_, used)
            # B's SSD blocks were never touched by A's quota eviction
            assert b.stats()["tiers"]["ssd"]["blocks"] == 6
            assert nb.lookup_keys(nb.keys(ids_b)) == 6
            # Flush beyond the quota, with nothing of A's own left to evict: named refusal
            ids = np.arange(16 * 12) + 10**5
            na.store(ids, kv(7, 12))
            a.evict("ssd")                                 # A's own SSD blocks, all of them
            with pytest.raises(ResourceExhausted, match="tenant a's ssd quota is full"):
                a.flush()
        text = urllib.request.urlopen(d.metrics_url, timeout=10).read().decode()
        tenants = {line.split('tenant="')[1].split('"')[0]
                   for line in text.splitlines()
                   if line.startswith("kvstore_tenant_") and 'tenant="' in line}
        assert tenants == {"a", "b", "none"}
        assert 'kvstore_tenant_blocks{tenant="b",tier="ssd"} 6.0' in text
        assert 'kvstore_tenant_lookup_hit_blocks_total{tenant="b"} 6.0' in text
    finally:
        cleanup(d)


@pytest.mark.redis
def test_remote_quota_caps_what_a_tenant_writes_to_redis(tmp_path: Path, redis_server) -> None:
    import numpy as np

    bb = LAYOUT.block_bytes
    tf = tokens(tmp_path, textwrap.dedent(f"""
        [tenants.a]
        token_sha256 = "{hash_token('a-token')}"
        remote_quota = {4 * bb}
    """))
    d = start_daemon(tmp_path, {"auth.tokens_file": str(tf), "ssd.enabled": False,
                                "remote.enabled": True, "remote.urls": redis_server.url,
                                "remote.deadline_ms": 2000})
    try:
        with connect(d.address, token="a-token", transport="grpc") as a:
            na = a.namespace(LAYOUT, model="m")
            ids = np.arange(16 * 10)
            x = np.random.default_rng(1).integers(0, 2**16, (2, 2, 160, 2, 64), dtype=np.uint16)
            assert na.store(ids, x) == 10
            a.evict("host")
            s = a.stats()["tiers"]["remote"]
            assert s["blocks"] == 4 and s["used_bytes"] == 4 * bb
            # the other 6 were dropped (misses); eviction goes leaf-first, so which 4 made it
            # depends on the policy: at most 4 of the prefix can be served
            assert na.lookup_keys(na.keys(ids)) <= 4
    finally:
        cleanup(d)
