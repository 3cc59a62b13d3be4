"""An empty namespace makes room at limits.namespaces_per_tenant (kvstore/namespaces.py).

Why: a long-running daemon sees models, revisions, layouts and codecs come and go. With every
namespace kept for good, a tenant that reached its cap could register nothing new until its
data folder was wiped. Now a registration at the cap forgets the tenant's least recently used
namespace that holds no block and no lease, and a client still holding it is answered by the
SDK registering it again, unseen. Namespaces that hold blocks or leases still count, and the
cap still refuses when all of them do.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvstore_client import NamespaceSpec, ResourceExhausted, connect
from kvstore_client._proto import kvstore_pb2 as pb

from kvstore.events.recorder import Recorder
from kvstore.index import BlockIndex
from kvstore.state import NamespaceInfo
from tests.daemon import cleanup, start_daemon
from tests.kv_data import LAYOUT, T, make_kv, prompt
from tests.store_helpers import SMALL, kv_block, make_store, random_prompt

CAP = 3


def reclaimed(c) -> int:
    return int(c.stats()["counters"].get("namespaces_reclaimed", 0))


def test_a_tenant_at_its_cap_gets_room_from_its_empty_namespaces(tmp_path) -> None:
    d = start_daemon(tmp_path, {"limits.namespaces_per_tenant": CAP})
    try:
        with connect(d.address) as c:
            a = c.namespace(LAYOUT, model="m-a")
            kv_a = make_kv(1, 2)
            assert a.store(prompt(1, 2), kv_a) == 2
            b = c.namespace(LAYOUT, model="m-b")            # empty, used before m-c
            b_id = b.ns_id
            c.namespace(LAYOUT, model="m-c")                # empty
            # At the cap: m-b, the least recently used empty one, makes room.
            dd = c.namespace(LAYOUT, model="m-d")
            assert c.stats()["namespaces"] == CAP and reclaimed(c) == 1
            # Its client never notices: the SDK registers it again (reclaiming m-c) and
            # retries, and its id is its spec's, as before.
            assert b.lookup(prompt(2, 1)) == 0
            assert b.ns_id == b_id and reclaimed(c) == 2
            assert b.store(prompt(2, 1), make_kv(2, 1)) == 1
            # Blocks of the namespace that held them all along are untouched.
            out = torch.zeros_like(kv_a)
            assert a.load(prompt(1, 2), out) == 2 * T and torch.equal(out, kv_a)

            # A lease keeps an empty namespace: with m-a and m-b holding blocks and m-d held
            # by a lease, the cap refuses, and says why.
            lease = c.call("Reserve", pb.ReserveRequest(namespace_id=dd.ns_id, count=1)).lease
            with pytest.raises(ResourceExhausted, match="every one holds blocks or leases"):
                c.namespace(LAYOUT, model="m-e")
            c.release(lease.lease_id)
            # (Over Put: a store through the pool keeps a spare lease, which counts as use.)
            with connect(d.address, transport="grpc") as g:
                e = g.namespace(LAYOUT, model="m-e")        # m-d had nothing left
                assert reclaimed(c) == 3
                assert e.store(prompt(3, 1), make_kv(3, 1)) == 1
                with pytest.raises(ResourceExhausted, match="limits.namespaces_per_tenant"):
                    c.namespace(LAYOUT, model="m-f")
                # Deleting a namespace's blocks makes it reclaimable.
                assert e.delete() == 1
                c.namespace(LAYOUT, model="m-f")
                assert reclaimed(c) == 4
        # The reclaimed ones' records left LMDB: a restart reads back m-a, m-b (their blocks
        # on SSD now) and m-f only; m-g makes m-f go, and the others keep their blocks.
        d.restart()
        with connect(d.address) as c:
            assert c.stats()["namespaces"] == CAP
            c.namespace(LAYOUT, model="m-g")
            assert c.stats()["namespaces"] == CAP and reclaimed(c) == 1
            assert c.namespace(LAYOUT, model="m-b").lookup(prompt(2, 1)) == T
            a = c.namespace(LAYOUT, model="m-a")
            out = torch.zeros_like(kv_a)
            assert a.load(prompt(1, 2), out) == 2 * T and torch.equal(out, kv_a)
            assert reclaimed(c) == 1
    finally:
        cleanup(d)


def test_namespace_numbers_are_reused_and_survive_the_index_image(tmp_path) -> None:
    """The index numbers namespaces in 16 bits; a reclaimed one's number goes back, and an
    index image holding a free number loads with it free (the next namespace takes it)."""
    store = make_store(tmp_path)
    store.config.limits.namespaces_per_tenant = 2
    rng = np.random.default_rng(7)
    try:
        kept = store.register_namespace(NamespaceSpec(model="kept", layout=SMALL)).ns_id
        _, kk = random_prompt(rng, 3)
        store.put(kept, kk, [kv_block(k) for k in kk])
        gone = store.register_namespace(NamespaceSpec(model="gone", layout=SMALL)).ns_id
        _, gk = random_prompt(rng, 2)
        store.put(gone, gk, [kv_block(k) for k in gk])
        index = store.state.index
        number = index._ns_no[gone]
        with pytest.raises(ValueError, match="still holds 2 blocks"):
            index.forget_namespace(gone)
        assert store.delete(gone) == 2
        third = store.register_namespace(NamespaceSpec(model="third", layout=SMALL)).ns_id
        assert gone not in store.state.namespaces and gone not in index._ns_no
        assert index._ns_free == [number] and index.holds(third) == 0
        store.flush()
    finally:
        store.close()
    store = make_store(tmp_path)            # from the index image written at the close
    store.config.limits.namespaces_per_tenant = 2
    try:
        index = store.state.index
        assert index._ns_free == [number] and gone not in index._ns_no
        third = store.register_namespace(NamespaceSpec(model="third", layout=SMALL)).ns_id
        _, tk = random_prompt(rng, 2)
        store.put(third, tk, [kv_block(k) for k in tk])
        assert index._ns_no[third] == number and index._ns_free == []
        assert index.holds(third) == 2 and index.holds(kept) == 3
        assert [v for _, v in store.get(kept, kk)] == [kv_block(k) for k in kk]
        assert [v for _, v in store.get(third, tk)] == [kv_block(k) for k in tk]
    finally:
        store.close()


def test_numbers_do_not_run_out_when_namespaces_come_and_go() -> None:
    """70,000 namespaces, one at a time, each holding a block and then none: 16-bit numbers
    would run out without reuse."""
    from kvstore.entry import Entry
    index = BlockIndex()
    for i in range(70_000):
        ns = i.to_bytes(16, "little")
        e = Entry(ns, b"k" * 16, None, 64, 1)
        index.add(e)
        index.discard(e.gkey)
        index.forget_namespace(ns)
    assert len(index._ns_ids) == 1


def test_a_removal_recorded_before_a_reclaim_still_reaches_its_streams() -> None:
    """The publisher reads a block's streams when it sends the change, which may be after the
    namespace was reclaimed: the recorder keeps the answers of namespaces gone lately."""
    spec = NamespaceSpec(model="m", layout=SMALL)
    info = NamespaceInfo(spec.digest, spec)
    namespaces = {info.ns_id: info}
    rec = Recorder(namespaces, [[]], 1024, lambda g: None)
    before = rec.ns(info.ns_id)
    assert before[1] == 1
    rec.forget_namespace(info.ns_id)
    del namespaces[info.ns_id]
    assert rec.ns(info.ns_id) == before


def test_reclaims_racing_every_call_leave_no_block_without_its_namespace(tmp_path) -> None:
    """Threads register, store, read, delete, lease and move blocks of seven models under a
    cap of three for a few seconds, so namespaces are reclaimed under calls in flight (a Put
    copying without the lock, a lease being filled). Only NOT_FOUND (the namespace went
    between a thread's register and its call) and RESOURCE_EXHAUSTED may come back; every
    block read is the one stored, and no block is left indexed under an unknown namespace."""
    import random
    import threading
    import time

    from kvstore_client.common.errors import NotFound

    store = make_store(tmp_path, host_capacity=256 << 10)
    store.config.limits.namespaces_per_tenant = 3
    errors: list[BaseException] = []
    end = time.monotonic() + 3.0

    def worker(seed: int) -> None:
        r = random.Random(seed)
        while time.monotonic() < end:
            try:
                ns = store.register_namespace(
                    NamespaceSpec(model=f"m{r.randrange(7)}", layout=SMALL)).ns_id
                _, keys = random_prompt(np.random.default_rng(r.randrange(20)),
                                        r.randrange(1, 5))
                op = r.randrange(7)
                if op <= 1:
                    store.put(ns, keys, [kv_block(k) for k in keys])
                elif op == 2:
                    for k, v in store.get(ns, keys):
                        assert v == kv_block(k)
                elif op == 3:
                    store.delete(ns)
                elif op == 4:
                    lease = store.reserve(ns, len(keys))
                    for k, s in zip(keys, lease.slots, strict=True):
                        store.state.host.view(s.offset, s.length)[:] = np.frombuffer(
                            kv_block(k), np.uint8)
                    store.commit(lease.id, keys)
                elif op == 5:
                    store.release(store.acquire(ns, keys).id)
                else:
                    store.evict("host", 64 << 10)
            except (NotFound, ResourceExhausted):
                pass
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[:3]
        st = store.state
        with st.lock:
            assert st.counters["namespaces_reclaimed"] > 0
            assert all(e.ns_id in st.namespaces for e in st.index.entries())
            assert len(st.namespaces) <= 3
    finally:
        store.close()


def test_a_gpu_tier_engine_whose_namespace_was_reclaimed_stores_and_loads_on(tmp_path) -> None:
    """DeviceKV calls Reserve, Commit and Acquire itself: a NOT_FOUND naming its reclaimed
    namespace must register it again, as the host path does, not fail every call after."""
    from kvstore_client.device_kv import DeviceKV

    from tests.test_gpu_tier_cpu import LAYOUT as GPU_LAYOUT
    from tests.test_gpu_tier_cpu import canonical, engine_cache, gpu_daemon, keys_for

    d = gpu_daemon(tmp_path, **{"limits.namespaces_per_tenant": 2})
    try:
        with connect(d.address, transport="shm") as c:
            ns = c.namespace(GPU_LAYOUT, model="gpu/reclaimed")
            _, cache = engine_cache(8, seed=3)
            dkv = DeviceKV(ns, cache)
            c.namespace(GPU_LAYOUT, model="gpu/other")
            c.namespace(GPU_LAYOUT, model="gpu/third")      # reclaims gpu/reclaimed (LRU)
            assert reclaimed(c) == 1
            assert dkv.store_keys(keys_for(ns, 1, 2), [3, 0]) == 2
            c.namespace(GPU_LAYOUT, model="gpu/fourth")     # reclaims another, not ours
            _, mine = engine_cache(8, seed=None)
            assert DeviceKV(ns, mine).load_keys(keys_for(ns, 1, 2), [5, 6]) == 2
            assert torch.equal(canonical(mine, 5).view(torch.int16),
                               canonical(cache, 3).view(torch.int16))
    finally:
        cleanup(d)
