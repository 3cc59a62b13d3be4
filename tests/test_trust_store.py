"""The store's side of the trust boundary, attacked as a tenant would, against real daemons.

- A tenant without a pool of its own may not lease slots of the shared pool: leased and
  committed unwritten, they would publish another tenant's freed or demoted blocks as its own.
- A client may not commit a checksum of 0 ("unknown"): the read paths would skip the check and
  promotion would take a new checksum from whatever the slot then held.
- A call naming one block many times is refused: it would stream or pin it that many times.
- A tenant's namespaces and leases are capped, and a namespace's spec is capped in size.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
import xxhash
from kvstore_client import (
    InvalidArgument,
    KVLayout,
    PermissionDenied,
    ResourceExhausted,
    connect,
)
from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client._proto import kvstore_pb2_grpc as pbg

from kvstore.tenants import hash_token
from tests.daemon import cleanup, start_daemon
from tests.kv_data import LAYOUT, T, make_kv, prompt

BB = LAYOUT.block_bytes                     # 16 KiB
TOKENS = {"a": "token-of-a", "b": "token-of-b", "c": "token-of-c", "ops": "token-of-ops"}
NS_CAP, LEASE_CAP, SLOT_CAP = 8, 16, 128


def md(tenant: str) -> tuple:
    return (("authorization", f"Bearer {TOKENS[tenant]}"),)


def fresh_keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def get_blocks(ch: grpc.Channel, tenant: str | None, ns_id: bytes, keys: list[bytes]
               ) -> list[tuple[bytes, bytes]]:
    stub = pbg.KVStoreStub(ch)
    kw = {"metadata": md(tenant)} if tenant else {}
    return [(b.key, b.data) for r in stub.Get(pb.GetRequest(namespace_id=ns_id, keys=keys),
                                              timeout=30, **kw) for b in r.blocks]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Tenants a and b without a host quota (the shared pool), c with a pool of its own, and
    an admin; small caps so the tests reach them."""
    tmp = tmp_path_factory.mktemp("trust-store")
    tf = tmp / "tenants.toml"
    tf.write_text(textwrap.dedent(f"""
        [tenants.a]
        token_sha256 = "{hash_token(TOKENS['a'])}"
        [tenants.b]
        token_sha256 = "{hash_token(TOKENS['b'])}"
        [tenants.c]
        token_sha256 = "{hash_token(TOKENS['c'])}"
        host_quota = "4MiB"
        [tenants.ops]
        token_sha256 = "{hash_token(TOKENS['ops'])}"
        admin = true
    """))
    d = start_daemon(tmp, {"auth.tokens_file": str(tf), "host.capacity": "8MiB",
                           "limits.namespaces_per_tenant": NS_CAP,
                           "limits.leases_per_tenant": LEASE_CAP,
                           "limits.lease_slots_per_tenant": SLOT_CAP})
    try:
        yield d
    finally:
        cleanup(d)


def test_a_tenant_without_a_pool_reads_no_other_tenants_blocks(world) -> None:
    """B (no pool) reserves slots of the shared pool, commits them unwritten and reads them
    back: before the fix it got A's deleted blocks and A's live blocks its reservations had
    pushed down to SSD. Now it gets no slot of the shared pool at all."""
    with connect(world.address, token=TOKENS["a"], transport="grpc") as a, \
            connect(world.address, token=TOKENS["b"], transport="grpc") as b, \
            world.channel() as ch:
        ns_a = a.namespace(LAYOUT, model="victim")
        ids_gone, ids_live = prompt(1, 64), prompt(2, 64)
        kv_live = make_kv(2, 64)
        assert ns_a.store(ids_gone, make_kv(1, 64)) == 64
        assert ns_a.store(ids_live, kv_live) == 64
        secret = {d: which for which, ids in (("deleted", ids_gone), ("live", ids_live))
                  for _, d in get_blocks(ch, "a", ns_a.ns_id, ns_a.keys(ids))}
        assert len(secret) == 128
        assert ns_a.delete(ns_a.keys(ids_gone)) == 64      # freed slots keep their bytes

        ns_b = b.namespace(LAYOUT, model="attacker")
        leaked: dict[bytes, str] = {}
        refused: dict[str, str] = {}
        # 8 x 64 slots: the whole 8 MiB pool, so A's live blocks are pushed out on the way
        for method in ("Reserve", "LookupReserve"):
            for _ in range(8):
                keys = fresh_keys(64)
                try:
                    if method == "Reserve":
                        lease = b.call("Reserve", pb.ReserveRequest(namespace_id=ns_b.ns_id,
                                                                    count=64)).lease
                    else:
                        lease = b.call("LookupReserve", pb.LookupReserveRequest(
                            namespace_id=ns_b.ns_id, keys=keys)).lease
                except PermissionDenied as e:
                    refused[method] = str(e)
                    break
                # committed unwritten, without checksums: the daemon hashes what is there
                b.call("Commit", pb.CommitRequest(lease_id=lease.lease_id, keys=keys))
                leaked.update((d, secret[d]) for _, d in get_blocks(ch, "b", ns_b.ns_id, keys)
                              if d in secret)
        got = sorted(leaked.values())
        assert not leaked, (f"tenant b read {got.count('deleted')} of tenant a's 64 deleted "
                            f"and {got.count('live')} of its 64 live blocks")
        assert set(refused) == {"Reserve", "LookupReserve"}, refused
        assert all("may not lease host pool slots" in m and "host_quota" in m
                   for m in refused.values()), refused
        # B still stores and loads its own blocks over Put/Get; A's live blocks are intact
        ids_b, kv_b = prompt(3, 8), make_kv(3, 8)
        assert ns_b.store(ids_b, kv_b) == 8
        out = torch.zeros_like(kv_b)
        assert ns_b.load(ids_b, out=out) == 8 * T and torch.equal(out, kv_b)
        # read leases in the shared pool are refused too (they would pin the pool's blocks)
        for method, req in (("Acquire", pb.AcquireRequest(namespace_id=ns_b.ns_id,
                                                           keys=ns_b.keys(ids_b))),
                            ("LookupAcquire", pb.LookupAcquireRequest(
                                namespace_id=ns_b.ns_id, keys=ns_b.keys(ids_b)))):
            with pytest.raises(PermissionDenied, match="may not lease host pool slots"):
                b.call(method, req)
        out = torch.zeros_like(kv_live)
        assert ns_a.load(ids_live, out=out) == 64 * T
        assert torch.equal(out.view(torch.int16), kv_live.view(torch.int16))

    # who may lease: an admin in the shared pool, a tenant with a quota in its own pool
    with connect(world.address, token=TOKENS["ops"], transport="grpc") as ops, \
            connect(world.address, token=TOKENS["c"], transport="grpc") as c:
        for client, model in ((ops, "admin-model"), (c, "own-pool")):
            ns = client.namespace(LAYOUT, model=model)
            lease = client.call("Reserve", pb.ReserveRequest(namespace_id=ns.ns_id,
                                                             count=2)).lease
            assert len(lease.slots) == 2
            client.release(lease.lease_id)


def test_leases_are_capped_per_tenant(world) -> None:
    """C holds leases up to its cap; the next is refused while the admin's are not, and one
    released makes room again. A lease over more slots than the cap is refused."""
    with connect(world.address, token=TOKENS["c"], transport="grpc") as c, \
            connect(world.address, token=TOKENS["ops"], transport="grpc") as ops:
        ns_c = c.namespace(LAYOUT, model="leases-c")
        ns_o = ops.namespace(LAYOUT, model="leases-ops")
        held = []
        for _ in range(LEASE_CAP + 4):
            try:
                held.append(c.call("Reserve", pb.ReserveRequest(namespace_id=ns_c.ns_id,
                                                                count=1)).lease.lease_id)
            except ResourceExhausted as e:
                assert "tenant c already holds 16 leases" in str(e), e
                assert "limits.leases_per_tenant" in str(e)
                break
        assert len(held) == LEASE_CAP
        lease = ops.call("Reserve", pb.ReserveRequest(namespace_id=ns_o.ns_id, count=1)).lease
        ops.release(lease.lease_id)
        c.release(held.pop())
        held.append(c.call("Reserve", pb.ReserveRequest(namespace_id=ns_c.ns_id,
                                                        count=1)).lease.lease_id)
        for lid in held:
            c.release(lid)
        with pytest.raises(ResourceExhausted, match="limits.lease_slots_per_tenant"):
            c.call("Reserve", pb.ReserveRequest(namespace_id=ns_c.ns_id, count=SLOT_CAP + 1))
        lease = c.call("Reserve", pb.ReserveRequest(namespace_id=ns_c.ns_id,
                                                    count=SLOT_CAP)).lease
        c.release(lease.lease_id)


def test_namespaces_are_capped_per_tenant_and_in_size(world) -> None:
    """A tenant registering namespaces without end is stopped at its cap once each holds a
    block (and the cap still holds after a restart, counting the persisted ones); a spec of
    hundreds of KiB is refused; other tenants register as before. (Empty ones make room:
    tests/test_namespace_reclaim.py.)"""
    big = {f"k{i:02d}": "\u4e00" * 1000 for i in range(64)}     # ~375 KiB as stored (JSON)
    with connect(world.address, token=TOKENS["b"], transport="grpc") as b:
        with pytest.raises(InvalidArgument, match="limits.namespace_spec_bytes"):
            b.namespace(LAYOUT, model="huge", extra=big)
        made = []
        for i in range(NS_CAP + 4):
            try:
                ns = b.namespace(LAYOUT, model=f"flood-{i}")
            except ResourceExhausted as e:
                assert "tenant b has registered 8 namespaces" in str(e), e
                assert "limits.namespaces_per_tenant = 8" in str(e)
                break
            assert ns.store(prompt(i, 1), make_kv(i, 1)) == 1
            made.append(ns.ns_id)
        assert b.stats()["namespaces"] == NS_CAP
        assert made and b.namespace(LAYOUT, model="flood-0").ns_id == made[0]  # not new
    world.restart()
    with connect(world.address, token=TOKENS["b"], transport="grpc") as b, \
            connect(world.address, token=TOKENS["ops"], transport="grpc") as ops:
        with pytest.raises(ResourceExhausted, match="limits.namespaces_per_tenant"):
            b.namespace(LAYOUT, model="after-restart")
        assert ops.namespace(LAYOUT, model="admin-after-restart").ns_id


# -------------------------------------------------------------------------- one tenant

@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """No tenants (the implicit tenant), with the gpu tier on the CPU device."""
    d = start_daemon(tmp_path_factory.mktemp("trust-store-plain"),
                     {"gpu.enabled": True, "gpu.backend": "cpu", "gpu.capacity": "2MiB"})
    try:
        yield d
    finally:
        cleanup(d)


def test_a_commit_may_not_send_checksum_zero(plain) -> None:
    """A client commits 64 blocks, one of them with checksum 0, then overwrites that block's
    slot. Before: the one-block sample check passed 63 times in 64, Get served the new bytes,
    demotion wrote them to SSD unchecked and promotion took their hash as the block's checksum,
    so even the SDK's verified load accepted them. Now the commit is refused."""
    with connect(plain.address, transport="shm") as c, plain.channel() as ch:
        ns = c.namespace(LAYOUT, model="zero")
        keys = fresh_keys(64)
        rng = np.random.default_rng(7)
        blocks = [rng.integers(0, 256, BB, dtype=np.uint8) for _ in keys]
        pool = c.pool.slab.array
        lease = c.call("Reserve", pb.ReserveRequest(namespace_id=ns.ns_id, count=64)).lease
        for s, blk in zip(lease.slots, blocks, strict=True):
            pool[s.offset:s.offset + BB] = blk
        sums = [xxhash.xxh3_64_intdigest(blk) for blk in blocks]
        sums[5] = 0
        refused = None
        try:
            c.call("Commit", pb.CommitRequest(lease_id=lease.lease_id, keys=keys,
                                              checksums=sums))
        except InvalidArgument as e:
            refused = str(e)
            c.release(lease.lease_id)   # a refused Commit leaves the lease as it was
        served = []
        if refused is None:             # what that let through
            pool[lease.slots[5].offset:lease.slots[5].offset + 64] ^= 0x5A
            bad = pool[lease.slots[5].offset:lease.slots[5].offset + BB].tobytes()
            served += [k for k, d in get_blocks(ch, None, ns.ns_id, keys) if d == bad]
            c.evict("host")             # down to SSD, and promoted again by the Acquire
            pin = c.call("Acquire", pb.AcquireRequest(namespace_id=ns.ns_id, keys=keys)).lease
            if len(pin.slots) > 5 and xxhash.xxh3_64_intdigest(bad) == pin.checksums[5]:
                served.append(b"laundered")
            c.release(pin.lease_id)
        assert not served, f"overwritten block served: {served}"
        assert refused is not None and "checksums[5] is 0" in refused, refused
        assert ns.lookup_keys(keys) == 0              # nothing of that lease was stored
        # the same blocks with their real checksums are stored, and a gpu commit refuses 0 too
        lease = c.call("Reserve", pb.ReserveRequest(namespace_id=ns.ns_id, count=64)).lease
        for s, blk in zip(lease.slots, blocks, strict=True):
            pool[s.offset:s.offset + BB] = blk
        sums[5] = xxhash.xxh3_64_intdigest(blocks[5])
        assert c.call("Commit", pb.CommitRequest(lease_id=lease.lease_id, keys=keys,
                                                 checksums=sums)).stored == 64
        glease = c.call("Reserve", pb.ReserveRequest(namespace_id=ns.ns_id, count=2,
                                                     tier="gpu")).lease
        with pytest.raises(InvalidArgument, match=r"checksums\[1\] is 0"):
            c.call("Commit", pb.CommitRequest(lease_id=glease.lease_id, keys=fresh_keys(2),
                                              checksums=[1, 0]))
        c.release(glease.lease_id)


def test_a_call_may_not_name_one_block_twice(plain) -> None:
    """Get naming one stored block 512 times streamed it 512 times; Acquire pinned it as
    often. Every call taking a key chain (and Locate) now refuses a repeated key, also when
    the repeats fall in different batches of a Get stream."""
    big = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, block_tokens=64,
                   dtype="bfloat16")                  # 1 MiB blocks: 4 per Get batch
    with connect(plain.address, transport="grpc") as c, plain.channel() as ch:
        ns = c.namespace(big, model="repeats")
        rng = np.random.default_rng(3)
        keys = fresh_keys(4)
        data = [rng.integers(0, 256, big.block_bytes, dtype=np.uint8).tobytes() for _ in keys]
        put = ch.stream_unary("/kvstore.v1.KVStore/Put", request_serializer=lambda x: x,
                              response_deserializer=pb.PutResponse.FromString)
        from kvstore_client.wire import encode_put
        msgs = [encode_put(ns.ns_id if i == 0 else b"", b"", [(k, d)])   # a block a message
                for i, (k, d) in enumerate(zip(keys, data, strict=True))]
        assert put(iter(msgs), timeout=30).stored == 4
        stub = pbg.KVStoreStub(ch)
        one = [keys[0]] * 512
        in_step = keys * 4          # each batch of 4 distinct, the stream 4 times the same
        calls = {
            "Get": lambda k: list(stub.Get(pb.GetRequest(namespace_id=ns.ns_id, keys=k),
                                           timeout=30)),
            "Acquire": lambda k: stub.Acquire(pb.AcquireRequest(namespace_id=ns.ns_id,
                                                                keys=k), timeout=30),
            "Lookup": lambda k: stub.Lookup(pb.LookupRequest(namespace_id=ns.ns_id, keys=k),
                                            timeout=30),
            "LookupAcquire": lambda k: stub.LookupAcquire(pb.LookupAcquireRequest(
                namespace_id=ns.ns_id, keys=k), timeout=30),
            "LookupReserve": lambda k: stub.LookupReserve(pb.LookupReserveRequest(
                namespace_id=ns.ns_id, keys=k + fresh_keys(1), max_slots=1), timeout=30),
            "Locate": lambda k: stub.Locate(pb.LocateRequest(namespace_id=ns.ns_id, keys=k),
                                            timeout=30),
        }
        answers = {}
        for name, call in calls.items():
            for ks in (one, in_step):
                try:
                    out = call(ks)
                    sent = (sum(len(r.blocks) for r in out) if name == "Get"
                            else len(out.lease.slots) if name == "Acquire" else "OK")
                    answers[(name, len(ks))] = sent
                    if name in ("Acquire", "LookupAcquire", "LookupReserve") and \
                            out.lease.lease_id:
                        stub.Release(pb.ReleaseRequest(lease_id=out.lease.lease_id),
                                     timeout=30)
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, e)
                    assert "repeats keys[" in e.details(), (name, e.details())
        assert not answers, f"served despite repeated keys: {answers}"
        # distinct keys: as before
        assert sum(len(r.blocks) for r in stub.Get(pb.GetRequest(namespace_id=ns.ns_id,
                                                                 keys=keys), timeout=30)) == 4


# -------------------------------------------------------------------------- lease reaping

def test_leases_are_reaped_from_a_deadline_heap() -> None:
    """Only leases past their deadline are reaped, renewals (longer or shorter) are honoured,
    and leftover heap entries of released or renewed leases stay bounded."""
    from kvstore.leases import COMPACT_SLACK, LeaseTable, Slot
    now = [1000.0]
    owners = {b"a" * 16: "a", b"b" * 16: "b"}
    table = LeaseTable(30, 600, clock=lambda: now[0], max_leases=0, max_slots=0,
                       owner_of=owners.get)
    a = [table.new("read", b"a" * 16, "host", [Slot(0, 1)], ttl_s=10 + i) for i in range(5)]
    b = [table.new("read", b"b" * 16, "host", [Slot(0, 1), Slot(1, 1)], ttl_s=100)
         for _ in range(1000)]
    assert table.held("a") == (5, 5) and table.held("b") == (1000, 2000)
    table.renew(a[0].id, 500)           # later: must survive its first deadline
    table.renew(a[4].id, 1)             # sooner: reaped at the new deadline
    now[0] += 2
    assert [x.id for x in table.reap()] == [a[4].id]
    now[0] += 11.5                      # past a[1..3] (11..13 s), not a[0] (renewed)
    assert sorted(x.id for x in table.reap()) == sorted(x.id for x in a[1:4])
    assert table.reap() == [] and table.held("a") == (1, 1)
    for _ in range(20_000):             # a lease renewed without end: one heap entry
        table.renew(a[0].id, 500)
    for x in b:                         # released: their entries are compacted away
        table.pop(x.id)
    assert len(table) == 1 and table.held("b") == (0, 0)
    assert len(table._heap) <= 2 * len(table) + COMPACT_SLACK
    now[0] += 1000
    assert [x.id for x in table.reap()] == [a[0].id] and len(table) == 0

    capped = LeaseTable(30, 600, max_leases=2, max_slots=3, owner_of=owners.get)
    capped.new("read", b"a" * 16, "host", [Slot(0, 1)])
    capped.admit(b"a" * 16, 2)
    with pytest.raises(ResourceExhausted, match="lease_slots_per_tenant"):
        capped.admit(b"a" * 16, 3)
    capped.new("read", b"a" * 16, "host", [Slot(0, 1)])
    with pytest.raises(ResourceExhausted, match="tenant a already holds 2 leases"):
        capped.admit(b"a" * 16, 1)
    capped.admit(b"b" * 16, 3)          # another tenant's caps are its own


def test_tenant_pools_keep_namespace_sets_not_walks(tmp_path: Path) -> None:
    """Eviction in a tenant's pool asks which namespaces share it; the answer is kept as
    namespaces register (and rebuilt from LMDB at start), not found by walking every
    tenant's namespaces at each eviction."""
    from kvstore_client import NamespaceSpec

    from kvstore.config import StoreConfig
    from kvstore.store import Store
    cfg = StoreConfig(data_dir=str(tmp_path / "d"))
    cfg.host.capacity = 8 << 20
    cfg.tenants = {"a": {"token_sha256": hash_token("a"), "host_quota": "2MiB"},
                   "b": {"token_sha256": hash_token("b")}}

    def spec(tenant: str, model: str) -> NamespaceSpec:
        return NamespaceSpec(model=model, layout=LAYOUT, extra={"kvstore.tenant": tenant})
    with Store(cfg) as s:
        na = s.register_namespace(spec("a", "m")).ns_id
        nb = [s.register_namespace(spec("b", f"m{i}")).ns_id for i in range(50)]
        seg_a = s.pools.segment_of(na)
        assert seg_a and s.pools.segment_namespaces(seg_a) == {na}
        assert s.pools.segment_namespaces(0) == set(nb)
        assert s.pools.namespace_count("b") == 50 and s.pools.owned_namespaces("a") == {na}
    with Store(cfg) as s:                # after a restart, from LMDB
        assert s.pools.segment_namespaces(s.pools.segment_of(na)) == {na}
        assert s.pools.namespace_count("b") == 50
