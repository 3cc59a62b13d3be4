"""A committed block overwritten through a client's writable mapping is never served again.

Real daemon, real shared memory: the client writes into a committed block's slot through its own
mapping of the host pool, as a buggy or hostile engine could, then reads the block back through
every path: its own shared-memory load, gRPC Get, after demotion to SSD, after demotion to
Redis. None may hand out the overwritten bytes, and the daemon's corruption counter moves.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvstore_client import KVLayout, connect
from kvstore_client._proto import kvstore_pb2 as pb

from kvstore.config import StoreConfig
from kvstore.store import Store
from tests.daemon import cleanup, start_daemon
from tests.redis_fixtures import redis_server_fixture  # noqa: F401  (fixture)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=16, dtype="bfloat16")
T = LAYOUT.block_tokens
N = 4


def make_kv(seed: int, tokens: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    L, _, _, H, D = LAYOUT.block_shape
    return torch.randn((L, 2, tokens, H, D), generator=g).to(torch.bfloat16)


def prompt(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, size=N * T, dtype=np.int64)


def overwrite(c, ns, keys: list[bytes], block: int) -> None:
    """Flip bytes of a committed block through this client's own mapping of the pool."""
    lease = c.call("Acquire", pb.AcquireRequest(namespace_id=ns.ns_id, keys=keys)).lease
    c.release(lease.lease_id)
    c.pool.slab.array[lease.slots[block].offset + 10:lease.slots[block].offset + 20] ^= 0x5A


def corrupt(c) -> float:
    return c.stats()["counters"].get("corrupt_blocks", 0.0)


def test_every_read_path_refuses_an_overwritten_block(tmp_path) -> None:
    d = start_daemon(tmp_path)
    try:
        with connect(d.address, transport="shm") as c, \
                connect(d.address, transport="grpc") as g:
            ns = c.namespace(LAYOUT, model="verify")
            ns_g = g.namespace(LAYOUT, model="verify")
            ids, kv = prompt(1), make_kv(1, N * T)
            keys = ns.keys(ids)
            assert ns.store(ids, kv) == N
            overwrite(c, ns, keys, 2)

            # 1. shared-memory load: the client's own check stops at block 2
            out = torch.zeros_like(kv)
            assert ns.load(ids, out=out) == 2 * T
            assert torch.equal(out[:, :, :2 * T], kv[:, :, :2 * T])
            assert c.counters["checksum_failures"] == 1

            # 2. gRPC Get: the daemon checks the bytes it sends, drops the block, counts it
            before = corrupt(c)
            out = torch.zeros_like(kv)
            assert ns_g.load(ids, out=out) == 2 * T
            assert torch.equal(out[:, :, :2 * T], kv[:, :, :2 * T])
            assert not out[:, :, 2 * T:].any()
            assert corrupt(c) == before + 1
            assert ns.lookup_keys(keys) == 2             # dropped: a miss from now on
            assert ns.store(ids, kv) == 1                # stored again (block 3 is a dup)
            out = torch.zeros_like(kv)
            assert ns_g.load(ids, out=out) == N * T
            assert torch.equal(out, kv)

            # 3. demotion to SSD: the overwritten block is dropped, not written down
            overwrite(c, ns, keys, 1)
            before = corrupt(c)
            c.evict("host")
            assert corrupt(c) == before + 1
            assert ns.lookup_keys(keys) == 1
            out = torch.zeros_like(kv)
            assert ns_g.load(ids, out=out) == T          # promoted from SSD: block 0 only
            assert torch.equal(out[:, :, :T], kv[:, :, :T])

            # 4. flush (the same path as write-through) refuses it as well
            ids2, kv2 = prompt(2), make_kv(2, N * T)
            keys2 = ns.keys(ids2)
            assert ns.store(ids2, kv2) == N
            overwrite(c, ns, keys2, 0)
            before = corrupt(c)
            c.flush()
            assert corrupt(c) == before + 1
            assert ns.lookup_keys(keys2) == 0
    finally:
        cleanup(d)


@pytest.mark.redis
def test_demotion_to_redis_refuses_an_overwritten_block(tmp_path, redis_server) -> None:
    d = start_daemon(tmp_path, {"ssd.enabled": False, "remote.enabled": True,
                                "remote.urls": redis_server.url, "remote.deadline_ms": 2000})
    try:
        with connect(d.address, transport="shm") as c, \
                connect(d.address, transport="grpc") as g:
            ns = c.namespace(LAYOUT, model="verify-remote")
            ns_g = g.namespace(LAYOUT, model="verify-remote")
            ids, kv = prompt(3), make_kv(3, N * T)
            keys = ns.keys(ids)
            assert ns.store(ids, kv) == N
            overwrite(c, ns, keys, 3)
            before = corrupt(c)
            c.evict("host")                              # host -> Redis
            assert corrupt(c) == before + 1
            assert ns.lookup_keys(keys) == 3
            out = torch.zeros_like(kv)
            assert ns_g.load(ids, out=out) == 3 * T      # promoted from Redis, intact
            assert torch.equal(out[:, :, :3 * T], kv[:, :, :3 * T])
            assert not out[:, :, 3 * T:].any()
    finally:
        cleanup(d)


def test_store_get_checks_the_copy_it_returns(tmp_path) -> None:
    """In process: Store.get (the bytes path) never returns a slot changed after commit."""
    cfg = StoreConfig(data_dir=str(tmp_path))
    cfg.host.capacity = 4 << 20
    cfg.ssd.enabled = False
    with Store(cfg) as store:
        from kvstore_client.common.layout import NamespaceSpec
        ns = store.register_namespace(NamespaceSpec(model="m", layout=LAYOUT)).ns_id
        keys = [bytes([i]) * 16 for i in range(3)]
        blocks = [bytes([i]) * LAYOUT.block_bytes for i in range(3)]
        store.put(ns, keys, blocks)
        e = store.index.get(ns + keys[1])
        store.host.view(e.host, 1)[0] ^= 1
        got = store.get(ns, keys)
        assert [k for k, _ in got] == keys[:1] and got[0][1] == blocks[0]
        assert store.stats()["counters"]["corrupt_blocks"] == 1
        assert store.index.get(ns + keys[1]) is None     # host-only: dropped from the index
        assert store.host.used_bytes == 2 * (-(-LAYOUT.block_bytes // 4096) * 4096)
