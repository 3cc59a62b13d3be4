"""A block the index places on SSD but LMDB no longer holds (deleted under the daemon, a
damaged record dropped), while Redis still holds it: a read misses there, the next one has
it from Redis, byte-exact, and the block leaves the SSD tier whole, index bit and eviction
policy both. Before, the policy kept it (the entry stays indexed for its remote copy): the
SSD policy then counted a block it could never evict, until the key left the index."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.config import StoreConfig
from kvstore.store import Store
from tests.redis_fixtures import redis_server_fixture  # noqa: F401  (fixture)

from .store_helpers import kv_block, namespace, random_prompt
from .test_flush_races import check_ssd_policy

pytestmark = pytest.mark.redis


def test_a_block_lost_from_lmdb_leaves_the_ssd_policy_too(tmp_path, redis_server):
    cfg = StoreConfig(data_dir=str(tmp_path / "data"))
    cfg.host.capacity = 4 << 20
    cfg.host.background_demotion = False
    cfg.ssd.capacity = 64 << 20
    cfg.ssd.write_through = True
    cfg.remote.enabled = True
    cfg.remote.urls = [redis_server.url]
    cfg.remote.deadline_ms = 2000
    cfg.remote.write_through = True
    with Store(cfg) as store:
        ns = namespace(store)
        keys = random_prompt(np.random.default_rng(7), 6)[1]
        store.put(ns, keys, [kv_block(k) for k in keys])
        store.evict("host", 1 << 30)                    # SSD and Redis copies only
        assert all(store.ssd.contains(ns + k) for k in keys)
        lost = keys[3:]
        store.ssd.delete_many([ns + k for k in lost])   # as a disk losing them would

        # The read stops at the first block LMDB lost (a miss; never other bytes)...
        got = store.get(ns, keys)
        assert [k for k, _ in got] == keys[:3]
        assert store.where(ns, lost) == ["remote"] * len(lost)
        check_ssd_policy(store)
        # ...and the next one has them from Redis, byte-exact.
        got = store.get(ns, keys)
        assert [k for k, _ in got] == keys
        assert all(b == kv_block(k) for k, b in got), "a block came back with other bytes"
        check_ssd_policy(store)
