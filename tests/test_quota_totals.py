"""A tenant's SSD quota, checked from the index's running totals (BlockIndex.tier_usage)
rather than a walk of its blocks, still caps what it holds on SSD, evicts only its own
blocks, and refuses a Flush that cannot fit; the totals match a walk of the blocks after
every round and after a restart.

Why: the quota check runs under the store lock once per demotion batch; a walk of the
tenant's blocks there held the lock for 0.1-0.3 s per batch at a million SSD blocks, stalling
every other tenant. The check is structural (no walk during demotion; totals equal a walk).
"""

from __future__ import annotations

import numpy as np
import pytest
from kvstore_client import NamespaceSpec
from kvstore_client.errors import ResourceExhausted

from kvstore.config import StoreConfig
from kvstore.index import BlockIndex
from kvstore.scoped import scoped_stats
from kvstore.state import aligned
from kvstore.store import Store
from kvstore.tenants import TENANT_KEY, hash_token

from .store_helpers import SMALL, kv_block, quiet, random_prompt

BB = SMALL.block_bytes
QUOTA = 8 * BB


def _store(tmp_path) -> Store:
    cfg = StoreConfig(data_dir=str(tmp_path / "data"))
    cfg.host.capacity = 1 << 20
    cfg.ssd.capacity = 64 << 20
    cfg.leases.default_ttl_s = 30
    cfg.tenants = {"a": {"token_sha256": hash_token("a"), "ssd_quota": QUOTA},
                   "b": {"token_sha256": hash_token("b")}}
    return Store(cfg)


def _ns(store: Store, tenant: str, model: str = "m") -> bytes:
    spec = NamespaceSpec(model=model, layout=SMALL, extra={TENANT_KEY: tenant})
    return store.register_namespace(spec).ns_id


def _walk(store: Store, ns_ids: set[bytes], tier: str) -> int:
    """Raw bytes the namespaces hold in `tier`, recounted block by block."""
    return sum(size for ns in ns_ids for _, ssd, remote, size in
               store.index.namespace_residency(ns) if (ssd if tier == "ssd" else remote))


def _put(store: Store, ns: bytes, seed: int, blocks: int) -> list[bytes]:
    _, keys = random_prompt(np.random.default_rng(seed), blocks)
    assert store.put(ns, keys, [kv_block(k) for k in keys]).stored == blocks
    return keys


def test_ssd_quota_from_totals_caps_evicts_own_and_refuses(tmp_path, monkeypatch):
    with _store(tmp_path) as s:
        a1, a2, b = _ns(s, "a", "m1"), _ns(s, "a", "m2"), _ns(s, "b")
        own = s.pools.owned_namespaces("a")
        assert own == {a1, a2}
        b_keys = _put(s, b, 99, 6)
        s.evict("host")
        walks = []
        real = BlockIndex.namespace_residency

        def counted(self, ns_id):
            walks.append(ns_id)
            return real(self, ns_id)
        monkeypatch.setattr(BlockIndex, "namespace_residency", counted)
        for round_ in range(4):         # 4 x 5 blocks demoted into a quota of 8
            _put(s, a1 if round_ % 2 else a2, round_, 5)
            s.evict("host")
            with quiet(s):
                assert not walks        # demotion checked the quota without a walk
                used = s.pools.tier_bytes(own, "ssd")
                assert used == _walk(s, own, "ssd") and 0 < used <= QUOTA, (round_, used)
                assert s.pools.tier_bytes({b}, "ssd") == _walk(s, {b}, "ssd") == 6 * BB
            walks.clear()
        _put(s, a1, 50, 3)                  # host copies too
        tiers = scoped_stats(s, own)["tiers"]
        assert not walks, "a tenant's Stats walked its blocks"
        stats = tiers["ssd"]
        assert stats["used_bytes"] == used and stats["blocks"] == used // BB
        host = sum(h for ns in own for h, *_ in real(s.index, ns))
        assert host >= 3 and tiers["host"]["blocks"] == host
        assert tiers["host"]["used_bytes"] == host * aligned(BB)
        assert s.lookup(b, b_keys).prefix_blocks == 6     # b's blocks never evicted for a
        # Nothing of a's own left to evict and 12 blocks to flush: a named refusal.
        _put(s, a1, 7, 12)
        s.evict("ssd", only=own)
        with quiet(s):
            assert s.pools.tier_bytes(own, "ssd") == _walk(s, own, "ssd") == 0
        with pytest.raises(ResourceExhausted, match="tenant a's ssd quota is full"):
            s.flush(only=own)
        with quiet(s):
            assert s.pools.tier_bytes(own, "ssd") == _walk(s, own, "ssd") <= QUOTA
        monkeypatch.undo()
        before = {ns: s.index.tier_usage(ns, "ssd") for ns in (a1, a2, b)}
    with _store(tmp_path) as s:         # a restart rebuilds the totals (image or scan)
        after = {ns: s.index.tier_usage(ns, "ssd") for ns in (a1, a2, b)}
        assert after == {ns: (_walk(s, {ns}, "ssd") // BB, _walk(s, {ns}, "ssd"))
                         for ns in (a1, a2, b)}
        assert after == before and after[b] == (6, 6 * BB)
        assert sum(after[ns][1] for ns in own) <= QUOTA
