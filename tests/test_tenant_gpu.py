"""The gpu tier partitioned per tenant: a tenant with a gpu_quota maps only its own device slab.

Runs on the CPU device (its "device memory" is host memory, a memfd per tenant), with a real
daemon and real clients: the same daemon code runs for CUDA, where a tenant's slab is a
separate allocation with an IPC handle of its own. The last test runs tenant A's and tenant B's
engines as separate processes under different uids: B floods its own slab, then tries every
name and fd it can find; nothing opens, B's slab holds none of A's bytes, and A's gpu blocks
are still resident and intact.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from kvstore_client import KVLayout, PermissionDenied, ResourceExhausted, connect
from kvstore_client import gpu as cg
from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client.device_kv import DeviceKV

from kvstore.tenants import hash_token
from tests.daemon import cleanup, start_daemon

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=16, dtype="bfloat16")
T = LAYOUT.block_tokens
BB = LAYOUT.block_bytes                         # 16 KiB a block
TOKENS = {n: f"token-{n}" for n in ("a", "b", "c", "ops")}


def tenants_file(tmp: Path) -> Path:
    p = tmp / "tenants.toml"
    p.write_text(textwrap.dedent(f"""
        [tenants.a]
        token_sha256 = "{hash_token(TOKENS['a'])}"
        gpu_quota = "{16 * BB}"
        [tenants.b]
        token_sha256 = "{hash_token(TOKENS['b'])}"
        gpu_quota = "{8 * BB}"
        [tenants.c]
        token_sha256 = "{hash_token(TOKENS['c'])}"
        [tenants.ops]
        token_sha256 = "{hash_token(TOKENS['ops'])}"
        admin = true
    """))
    return p


def cache(num_blocks: int, seed: int | None) -> cg.PagedKVCache:
    L = LAYOUT
    shape = (2, num_blocks, T, L.num_kv_heads, L.head_dim)
    if seed is None:
        raw = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(L.num_layers)]
    else:
        g = torch.Generator().manual_seed(seed)
        raw = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(L.num_layers)]
    return cg.PagedKVCache.from_vllm(raw)


def block_bits(c: cg.PagedKVCache, b: int) -> bytes:
    """Block b's bytes in the canonical order the daemon stores them."""
    ts = c.tensors
    return torch.stack([torch.stack([ts[2 * i][b], ts[2 * i + 1][b]])
                        for i in range(len(ts) // 2)]).contiguous().view(torch.int16
                                                                          ).numpy().tobytes()


def keys_for(ns, seed: int, n: int) -> list[bytes]:
    return ns.keys(np.random.default_rng(seed).integers(0, 50_000, size=n * T))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("tenantgpu")
    d = start_daemon(tmp, {"gpu.enabled": "true", "gpu.backend": "cpu",
                           "gpu.capacity": str(16 * BB), "host.capacity": "8MiB",
                           "ssd.capacity": "64MiB", "auth.tokens_file": str(tenants_file(tmp))})
    try:
        yield d
    finally:
        cleanup(d)


def test_each_tenant_gets_its_own_device_slab_and_only_admins_the_shared_one(daemon) -> None:
    with connect(daemon.address, token=TOKENS["a"]) as a, \
            connect(daemon.address, token=TOKENS["b"]) as b, \
            connect(daemon.address, token=TOKENS["c"]) as c, \
            connect(daemon.address, token=TOKENS["ops"]) as ops:
        for cl in (a, b, c, ops):
            cl.namespace(LAYOUT, model="m")
        (pa,), (pb_,) = a.gpu_pools, b.gpu_pools
        # Own slabs: no name anywhere, an fd from the handshake, the quota's size.
        assert (pa["kind"], pa["name"], pa["size"]) == (cg.CPU_MEMFD_KIND, "", 16 * BB)
        assert (pb_["kind"], pb_["name"], pb_["size"]) == (cg.CPU_MEMFD_KIND, "", 8 * BB)
        assert os.fstat(pa["fd"]).st_ino != os.fstat(pb_["fd"]).st_ino
        assert c.gpu_pools == []                      # no gpu_quota: no slab at all
        (shared,) = ops.gpu_pools
        assert shared["kind"] == cg.CPU_POOL_KIND and shared["name"]
        nc = c.namespace(LAYOUT, model="m")
        with pytest.raises(PermissionDenied, match="no gpu_quota"):
            c.call("Reserve", pb.ReserveRequest(namespace_id=nc.ns_id, count=1, tier="gpu"))


def test_a_tenants_flood_evicts_only_its_own_gpu_blocks(daemon) -> None:
    with connect(daemon.address, token=TOKENS["a"]) as a, \
            connect(daemon.address, token=TOKENS["b"]) as b:
        na, nb = a.namespace(LAYOUT, model="flood"), b.namespace(LAYOUT, model="flood")
        ca = cache(8, seed=1)
        ka = keys_for(na, 1, 8)
        assert DeviceKV(na, ca).store_keys(ka, list(range(8))) == 8
        assert na.lookup_result(ka).per_tier["gpu"] == 8
        # B writes 3x its 8-slot slab: its own blocks are demoted to make room, never A's.
        cb = cache(24, seed=2)
        dkb = DeviceKV(nb, cb)
        kb = keys_for(nb, 2, 24)
        for i in range(0, 24, 4):
            assert dkb.store_keys(kb[:i + 4], list(range(i + 4))) >= 4
        assert na.lookup_result(ka).per_tier["gpu"] == 8
        assert nb.lookup_result(kb).prefix_blocks == 24         # demoted, not lost
        # B's slab holds none of A's bytes; A's slab holds A's blocks.
        pool_b = cg.open_pool(b.gpu_pools[0]).array.tobytes()
        assert all(pool_b.find(block_bits(ca, i)[:4096]) < 0 for i in range(8))
        pool_a = cg.open_pool(a.gpu_pools[0]).array.tobytes()
        assert all(pool_a.find(block_bits(ca, i)) >= 0 for i in range(8))
        # A reads its blocks back through its own slab, bit for bit.
        mine = cache(8, seed=None)
        assert DeviceKV(na, mine).load_keys(ka, list(range(8))) == 8
        assert all(block_bits(mine, i) == block_bits(ca, i) for i in range(8))
        # A's Evict of the gpu tier evicts A's blocks only.
        lease_b = b.call("Acquire", pb.AcquireRequest(namespace_id=nb.ns_id, keys=kb[:1],
                                                      tier="gpu")).lease
        b.release(lease_b.lease_id)
        on_b = nb.lookup_result(kb).per_tier["gpu"]
        assert on_b > 0
        a.evict("gpu")
        assert na.lookup_result(ka).per_tier["gpu"] == 0
        assert nb.lookup_result(kb).per_tier["gpu"] == on_b
        # Slots leave the daemon as offsets into the tenant's own slab.
        assert all(0 <= s.offset < 8 * BB for s in lease_b.slots)


def test_a_tenants_flush_writes_only_its_own_device_only_blocks(daemon) -> None:
    """A Flush writes the blocks only a device holds down to SSD: a tenant's, only its own
    (another's would cost its disk share and its call's time, and say what it holds)."""
    with connect(daemon.address, token=TOKENS["a"]) as a, \
            connect(daemon.address, token=TOKENS["b"]) as b:
        na = a.namespace(LAYOUT, model="flush-scope")
        nb = b.namespace(LAYOUT, model="flush-scope")
        ka, kb = keys_for(na, 11, 4), keys_for(nb, 12, 4)
        assert DeviceKV(na, cache(4, seed=11)).store_keys(ka, list(range(4))) == 4
        assert DeviceKV(nb, cache(4, seed=12)).store_keys(kb, list(range(4))) == 4
        assert na.lookup_result(ka).per_tier.get("ssd", 0) == 0
        assert nb.lookup_result(kb).per_tier.get("ssd", 0) == 0
        assert b.flush() >= 4              # (with B's blocks of the tests before)
        assert nb.lookup_result(kb).per_tier["ssd"] == 4
        assert na.lookup_result(ka).per_tier.get("ssd", 0) == 0, "B's Flush wrote A's blocks"
        assert a.flush() >= 4
        assert na.lookup_result(ka).per_tier["ssd"] == 4


def test_a_full_gpu_quota_names_the_tenant(daemon) -> None:
    with connect(daemon.address, token=TOKENS["b"]) as b:
        nb = b.namespace(LAYOUT, model="full")
        b.evict("gpu")
        held = b.call("Reserve", pb.ReserveRequest(namespace_id=nb.ns_id, count=7, tier="gpu"))
        try:
            with pytest.raises(ResourceExhausted, match="tenant b's gpu quota is full"):
                b.call("Reserve", pb.ReserveRequest(namespace_id=nb.ns_id, count=2, tier="gpu"))
            with pytest.raises(ResourceExhausted, match="tenant b's gpu quota"):
                b.call("Reserve", pb.ReserveRequest(namespace_id=nb.ns_id, count=9, tier="gpu"))
        finally:
            b.release(held.lease.lease_id)


CHILD = textwrap.dedent("""
    import glob, os, sys
    import numpy as np, torch, kvstore_client
    from kvstore_client import gpu as cg
    from kvstore_client.device_kv import DeviceKV
    from tests.test_tenant_gpu import LAYOUT, cache, block_bits, keys_for
    # What the run needs is imported before dropping to the other uid (it cannot read the
    # interpreter's files then).
    import json, socket, logging, mmap, secrets, numpy.random, kvstore_client.common.shm
    import kvstore_client.common.handoff, kvstore_client.common.pools
    block_bits(cache(1, seed=0), 0)
    role, uid, address = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    os.setgroups([]); os.setgid(uid); os.setuid(uid)      # from here on: another user
    with kvstore_client.connect(address) as c:
        ns = c.namespace(LAYOUT, model="m")
        (pool,) = c.gpu_pools
        print("TENANT", c.tenant, pool["kind"], pool["size"], flush=True)
        if role == "a":
            ca = cache(12, seed=1)
            keys = keys_for(ns, 1, 12)
            assert DeviceKV(ns, ca).store_keys(keys, list(range(12))) == 12
            print("READY", os.getpid(), flush=True)
            sys.stdin.readline()                            # B does its worst meanwhile
            on_gpu = ns.lookup_result(keys).per_tier.get("gpu")
            mine = cache(12, seed=None)
            got = DeviceKV(ns, mine).load_keys(keys, list(range(12)))
            same = all(block_bits(mine, i) == block_bits(ca, i) for i in range(12))
            print("A", on_gpu, got, same, flush=True)
        else:
            a_pid, d_pid = int(sys.argv[4]), int(sys.argv[5])
            dk = DeviceKV(ns, cache(24, seed=2))
            keys = keys_for(ns, 2, 24)
            for i in range(0, 24, 4):                       # 3x its 8-slot slab
                assert dk.store_keys(keys[:i + 4], list(range(i + 4))) >= 4
            names = (glob.glob("/dev/shm/kvstore*") + glob.glob(f"/proc/{d_pid}/fd/*")
                     + glob.glob(f"/proc/{a_pid}/fd/*") + glob.glob(f"/proc/{a_pid}/map_files/*")
                     + glob.glob(f"/proc/{d_pid}/map_files/*")
                     + [f"/proc/{a_pid}/mem", f"/proc/{d_pid}/mem"])
            opened, tried = [], 0
            for p in names:
                for flags in (os.O_RDWR, os.O_RDONLY):
                    tried += 1
                    try:
                        fd = os.open(p, flags)
                    except OSError:
                        continue
                    opened.append(p)
                    os.close(fd)
            mine = cg.open_pool(pool).array.tobytes()
            ref = cache(12, seed=1)
            leak = any(mine.find(block_bits(ref, i)[:4096]) >= 0 for i in range(12))
            print("B", "tried", tried, "opened", opened, "leak", leak, flush=True)
""")


def test_two_uids_cannot_reach_each_others_device_slab(other_uids: None) -> None:
    if not hasattr(os, "memfd_create"):
        pytest.skip("no memfd_create on this platform")
    base = Path(tempfile.mkdtemp(prefix="kvs-gpuseg-"))
    base.chmod(0o755)
    tf = base / "tenants.toml"
    tf.write_text(textwrap.dedent(f"""
        [tenants.a]
        uids = [5011]
        gpu_quota = "{16 * BB}"
        [tenants.b]
        uids = [5012]
        gpu_quota = "{8 * BB}"
    """))
    d = start_daemon(base, {"auth.tokens_file": str(tf), "gpu.enabled": "true",
                            "gpu.backend": "cpu", "gpu.capacity": str(16 * BB),
                            "host.capacity": "8MiB"})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    root = str(Path(__file__).resolve().parent.parent)
    a = subprocess.Popen([sys.executable, "-c", CHILD, "a", "5011", d.address],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env, cwd=root)
    try:
        lines = []
        for _ in range(2):
            line = a.stdout.readline()
            lines.append(line)
            if line.startswith("READY") or not line:
                break
        assert lines[0].startswith(f"TENANT a cpu_memfd {16 * BB}"), lines + [a.stderr.read()]
        assert lines[-1].startswith("READY"), lines + [a.stderr.read()]
        a_pid = int(lines[-1].split()[1])
        b = subprocess.run([sys.executable, "-c", CHILD, "b", "5012", d.address, str(a_pid),
                            str(d.proc.pid)], capture_output=True, text=True, timeout=300,
                           env=env, cwd=root)
        assert f"TENANT b cpu_memfd {8 * BB}" in b.stdout, b.stdout + b.stderr
        last = b.stdout.strip().splitlines()[-1]
        assert last.startswith("B tried") and "opened [] leak False" in last, \
            b.stdout + b.stderr
        assert int(last.split()[2]) >= 6                 # it did find names to try
        out, err = a.communicate("go\n", timeout=120)
        # all 12 of A's blocks still in its gpu slab (B's flood stayed in B's), intact
        assert "A 12 12 True" in out, out + err
    finally:
        if a.poll() is None:
            a.kill()
        cleanup(d)
        shutil.rmtree(base, ignore_errors=True)


def test_own_host_pool_and_own_device_slab_together(tmp_path: Path) -> None:
    # A tenant with both quotas: its gpu blocks are demoted into its own host pool (a memfd
    # the client maps), promoted back from there, and read through the host path too.
    tf = tmp_path / "tenants.toml"
    tf.write_text(textwrap.dedent(f"""
        [tenants.a]
        token_sha256 = "{hash_token(TOKENS['a'])}"
        host_quota = "{32 * BB}"
        gpu_quota = "{8 * BB}"
    """))
    d = start_daemon(tmp_path / "d", {"gpu.enabled": "true", "gpu.backend": "cpu",
                                      "gpu.capacity": str(4 * BB), "host.capacity": "4MiB",
                                      "ssd.capacity": "64MiB", "auth.tokens_file": str(tf)})
    try:
        with connect(d.address, token=TOKENS["a"], transport="shm") as a:
            ns = a.namespace(LAYOUT, model="both")
            assert a.pool.fd_backed and a.pool.size == 32 * BB
            assert a.gpu_pools[0]["kind"] == cg.CPU_MEMFD_KIND
            ref = cache(16, seed=5)
            keys = keys_for(ns, 5, 16)
            dk = DeviceKV(ns, ref)
            for i in range(0, 16, 4):           # 2x its 8-slot slab: the first go to host
                assert dk.store_keys(keys[:i + 4], list(range(i + 4))) >= 4
            per = ns.lookup_result(keys).per_tier
            assert per["host"] > 0 and ns.lookup_result(keys).prefix_blocks == 16
            host = a.pool.slab.array.tobytes()      # demoted into the tenant's own pool
            assert host.find(block_bits(ref, 0)) >= 0
            # Host path: the same bytes, through the tenant's pool.
            kv = torch.zeros((LAYOUT.num_layers, 2, 16 * T, LAYOUT.num_kv_heads,
                              LAYOUT.head_dim), dtype=torch.bfloat16)
            assert ns.load_keys(keys, kv) == 16
            first = kv[:, :, :T].contiguous().view(torch.int16).numpy().tobytes()
            assert first == block_bits(ref, 0)
            # Promotion back to its slab from its host pool, bit for bit.
            mine = cache(4, seed=None)
            assert DeviceKV(ns, mine).load_keys(keys[:4], list(range(4))) == 4
            assert all(block_bits(mine, i) == block_bits(ref, i) for i in range(4))
            assert ns.lookup_result(keys[:4]).per_tier["gpu"] == 4
    finally:
        cleanup(d)


def test_segmented_device_splits_batches_by_segment_in_order() -> None:
    from tiers.device_cpu import CpuDeviceTier
    from tiers.device_open import open_tenant_segment
    from tiers.device_segments import SegmentedDevice

    shared = CpuDeviceTier(8 * 4096, 0, slab_name=f"kvs-test-segdev-{os.getpid()}")
    dev = SegmentedDevice(shared, {"a": 4 * 4096, "b": 2 * 4096},
                          lambda t, n, d: open_tenant_segment("cpu", n, d, f"seg-{t}"))
    try:
        assert dev.capacity == 14 * 4096 and dev.base(1) == 8 * 4096 and dev.base(2) == 12 * 4096
        offs = [dev.alloc(4096, seg) for seg in (1, 0, 2, 1)]
        assert [dev.segment_of(o) for o in offs] == [1, 0, 2, 1]
        host = np.random.default_rng(9).integers(0, 256, 4 * 4096, dtype=np.uint8)
        items = [(o, i * 4096, 4096) for i, o in enumerate(offs)]
        sums = dev.copy_from_host_checked(items, host)
        import xxhash
        assert sums == [xxhash.xxh3_64_intdigest(host[i * 4096:(i + 1) * 4096]) for i in range(4)]
        assert dev.checksums([(o, 4096) for o in offs]) == sums
        back = np.zeros_like(host)
        assert dev.copy_to_host_checked(items, back) == sums and np.array_equal(back, host)
        back[:] = 0
        dev.copy_to_host_batch(items, back).wait(10)        # a batch across segments
        assert np.array_equal(back, host)
        # Each tenant's bytes are in its own slab only.
        assert dev.tier(1).view(0, 4096).tobytes() == host[:4096].tobytes()
        assert host[:4096].tobytes() not in dev.tier(2).view(0, 2 * 4096).tobytes()
        from kvstore_client.errors import InvalidArgument
        with pytest.raises(InvalidArgument, match="crosses a segment"):
            dev.copy_to_host_checked([(dev.base(2) - 4096, 0, 8192)], back)
        with pytest.raises(InvalidArgument, match="cross tenants"):
            dev.gather([(offs[0], offs[2], 4096)])
        assert dev.describe_segment(1)["kind"] == cg.CPU_MEMFD_KIND
        assert dev.describe()["kind"] == cg.CPU_POOL_KIND
    finally:
        dev.close()
    assert dev.closed and dev.tier(1).closed


def test_a_tenants_device_slab_follows_a_daemon_restart(tmp_path: Path) -> None:
    # The new daemon run hands out a new memfd; the client must map that one, never keep
    # copying through the dead run's slab.
    d = start_daemon(tmp_path, {"gpu.enabled": "true", "gpu.backend": "cpu",
                                "gpu.capacity": str(4 * BB), "host.capacity": "4MiB",
                                "auth.tokens_file": str(tenants_file(tmp_path))})
    try:
        with connect(d.address, token=TOKENS["a"]) as a:
            ns = a.namespace(LAYOUT, model="restart")
            ref = cache(4, seed=7)
            keys = keys_for(ns, 7, 4)
            dk = DeviceKV(ns, ref)
            assert dk.store_keys(keys[:2], [0, 1]) == 2
            old = dk.pool
            d.restart()
            assert dk.store_keys(keys, [0, 1, 2, 3]) >= 2   # after a resync, into the new slab
            assert dk.pool is not old and not old.current()
            mine = cache(4, seed=None)
            assert DeviceKV(ns, mine).load_keys(keys, [0, 1, 2, 3]) == 4
            assert all(block_bits(mine, i) == block_bits(ref, i) for i in range(4))
    finally:
        cleanup(d)
