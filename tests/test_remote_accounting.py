"""What the daemon counts of the remote tier, against a real redis-server: the room
`remote.capacity` leaves, what an eviction the tier did not take drops, and how much a lookup
of unknown keys asks of Redis.

Why these: the capacity was a lifetime budget (bytes written, never given back by a delete or
by Redis dropping keys), so after `capacity` bytes a daemon stopped using Redis for good; an
eviction whose write did not land dropped its blocks without a trace; and a Lookup of 65,536
made-up keys sent Redis one EXISTS of each, costing the daemon about half a second of CPU.
"""

from __future__ import annotations

import numpy as np
import redis

from kvstore.lookup import REMOTE_LOCATE_KEYS
from kvstore.moves.host_remote import EXISTS_FIRST
from tests.redis_fixtures import redis_server_fixture  # noqa: F401  (fixture)

from .store_helpers import SMALL, kv_block, namespace, random_prompt
from .test_store_remote import remote_store

BLOCK = SMALL.block_bytes


def _remote_blocks(store) -> int:
    return store.stats()["tiers"]["remote"]["blocks"]


def test_capacity_room_comes_back_when_blocks_are_deleted_or_gone(tmp_path, redis_server):
    n = 24
    r = redis.Redis.from_url(redis_server.url)
    with remote_store(tmp_path / "a", redis_server.url, write_through=True,
                      capacity=n * BLOCK) as s:
        ns = namespace(s)
        for rnd in range(3):
            _, keys = random_prompt(np.random.default_rng(rnd), n)
            s.put(ns, keys, [kv_block(k) for k in keys])
            assert _remote_blocks(s) == n, rnd          # all landed: the room was given back
            assert r.dbsize() == n
            assert s.stats()["tiers"]["remote"]["used_bytes"] == n * BLOCK
            if rnd == 0:
                assert s.delete(ns) == n                # room back on delete
            else:                                       # or when Redis lost them
                r.flushall()
                s.evict("host")
                for k in keys:                          # found gone: forgotten
                    assert s.get(ns, [k]) == []
                assert _remote_blocks(s) == 0
        # past the capacity: left out, counted, the rest still lands
        _, more = random_prompt(np.random.default_rng(9), n + 6)
        s.put(ns, more, [kv_block(k) for k in more])
        assert _remote_blocks(s) == n
        assert s.stats()["counters"]["remote_capacity_refused_blocks"] >= 6


def test_an_eviction_redis_did_not_take_is_counted(tmp_path, redis_server):
    _, keys = random_prompt(np.random.default_rng(3), 16)
    with remote_store(tmp_path / "a", redis_server.url) as s:
        ns = namespace(s)
        s.put(ns, keys, [kv_block(k) for k in keys])
        redis_server.kill()
        s.evict("host")
        c = s.stats()["counters"]
        assert c["remote_dropped_blocks"] == 16
        assert c["remote_demotion_failures"] >= 1
        assert s.get(ns, keys) == []


def test_a_lookup_of_unknown_keys_asks_redis_a_little(tmp_path, redis_server):
    with remote_store(tmp_path / "a", redis_server.url, write_through=True) as a:
        ns = namespace(a)
        _, stored = random_prompt(np.random.default_rng(4), 100)
        a.put(ns, stored, [kv_block(k) for k in stored])
    with remote_store(tmp_path / "b", redis_server.url) as b:
        assert namespace(b) == ns
        made_up = [bytes([7]) * 8 + i.to_bytes(8, "big") for i in range(8192)]
        asked = b.remote.stats["lookup_misses"] + b.remote.stats["lookup_hits"]
        assert b.lookup(ns, made_up).prefix_blocks == 0
        now = b.remote.stats["lookup_misses"] + b.remote.stats["lookup_hits"]
        assert now - asked == EXISTS_FIRST                 # not 8,192
        # a long stored prefix is still found whole, in growing ranges
        assert b.lookup(ns, stored + made_up[:50]).prefix_blocks == 100
        # Locate asks about at most REMOTE_LOCATE_KEYS keys
        asked = b.remote.stats["lookup_misses"] + b.remote.stats["lookup_hits"]
        assert b.where(ns, made_up) == [None] * len(made_up)
        now = b.remote.stats["lookup_misses"] + b.remote.stats["lookup_hits"]
        assert now - asked == REMOTE_LOCATE_KEYS
