"""Two stores sharing blocks through a real redis-server, including pipelined promotion."""

from __future__ import annotations

import numpy as np
import redis

from kvstore.config import StoreConfig
from kvstore.store import REMOTE_CHUNK, Store
from tests.redis_fixtures import redis_server_fixture  # noqa: F401  (fixture)
from tiers import codecs, frame
from tiers.remote.envelope import Sealer

from .store_helpers import SMALL, kv_block, namespace, random_prompt


def remote_store(path, url: str, **remote) -> Store:
    cfg = StoreConfig(data_dir=str(path))
    cfg.host.capacity = 4 << 20
    cfg.ssd.enabled = False
    cfg.remote.enabled = True
    cfg.remote.urls = [url]
    cfg.remote.deadline_ms = 2000
    for k, v in remote.items():
        setattr(cfg.remote, k, v)
    return Store(cfg)


def test_pipelined_promotion_from_redis_is_byte_equal(tmp_path, redis_server):
    n = 3 * REMOTE_CHUNK + 5                    # several pipelined ranges, the last one short
    _, keys = random_prompt(np.random.default_rng(0), n)
    with remote_store(tmp_path / "a", redis_server.url, write_through=True) as a:
        ns = namespace(a)
        a.put(ns, keys, [kv_block(k) for k in keys])
    with remote_store(tmp_path / "b", redis_server.url) as b:
        assert namespace(b) == ns
        lease = b.acquire(ns, keys)                # B has never seen these keys
        assert lease.keys == keys
        for k, s in zip(lease.keys, lease.slots, strict=True):
            assert b.host.view(s.offset, s.length).tobytes() == kv_block(k)
        assert b.stats()["active_leases"] == 1     # the ranges' leases merged into one
        b.release(lease.id)
        assert b.stats()["active_leases"] == 0


def test_pipelined_promotion_stops_where_redis_lost_a_block(tmp_path, redis_server):
    n = 2 * REMOTE_CHUNK + 4
    _, keys = random_prompt(np.random.default_rng(1), n)
    with remote_store(tmp_path / "a", redis_server.url, write_through=True) as a:
        ns = namespace(a)
        a.put(ns, keys, [kv_block(k) for k in keys])
    lost = REMOTE_CHUNK + 3                        # inside the second range
    r = redis.Redis.from_url(redis_server.url)
    assert r.delete(f"kvs:{ns.hex()}:{keys[lost].hex()}") == 1
    with remote_store(tmp_path / "b", redis_server.url) as b:
        assert namespace(b) == ns
        assert b.lookup(ns, keys).prefix_blocks == lost   # one batched EXISTS sees the gap
        got = b.get(ns, keys)
        assert [k for k, _ in got] == keys[:lost]
        assert all(d == kv_block(k) for k, d in got)
        assert b.stats()["active_leases"] == 0
        assert b.lookup(ns, keys).prefix_blocks == lost


def test_daemon_exports_documented_remote_metrics(tmp_path, redis_server):
    import re
    import urllib.request

    import kvstore_client

    from tests.daemon import cleanup, start_daemon
    from tests.test_server import documented_metrics

    d = start_daemon(tmp_path / "d", {"remote.enabled": True, "remote.urls": redis_server.url,
                                      "remote.write_through": True})
    try:
        with kvstore_client.connect(d.address) as c:
            from .store_helpers import SMALL
            ns = c.namespace(SMALL, model="metrics")
            kv = np.zeros((2, 2, 32, 2, 16), np.float16)
            assert ns.store(np.arange(32), kv) == 4
            ns.lookup(np.arange(64))
        text = urllib.request.urlopen(d.metrics_url, timeout=10).read().decode()
    finally:
        cleanup(d)
    families = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    remote = {f for f in families if f.startswith("kvstore_remote_")}
    assert {"kvstore_remote_up", "kvstore_remote_events_total",
            "kvstore_remote_latency_seconds_sum_total"} <= remote
    documented = documented_metrics()
    assert all(f in documented or f + "_total" in documented for f in remote), remote
    assert re.search(r'kvstore_remote_events_total\{event="keys_written"\} [1-9]', text)
    assert re.search(r"^kvstore_remote_up 1\.0", text, re.M)


def test_default_write_back_demotes_evicted_blocks_to_redis(tmp_path, redis_server):
    """The default remote mode (no write-through): blocks reach Redis only when evicted,
    from host (no SSD tier) and from SSD (with one), and come back byte-equal elsewhere."""
    _, keys = random_prompt(np.random.default_rng(2), 40)
    blocks = [kv_block(k) for k in keys]
    r = redis.Redis.from_url(redis_server.url)
    with remote_store(tmp_path / "a", redis_server.url) as a:      # host -> Redis
        ns = namespace(a)
        a.put(ns, keys[:20], blocks[:20])
        assert r.dbsize() == 0                                      # nothing written through
        a.evict("host")
        assert r.dbsize() == 20
        assert a.stats()["tiers"]["remote"]["demotions_in"] == 20
    cfg = StoreConfig(data_dir=str(tmp_path / "c"))                 # host -> SSD -> Redis
    cfg.host.capacity = 4 << 20
    cfg.ssd.capacity = 64 << 20
    cfg.remote.enabled = True
    cfg.remote.urls = [redis_server.url]
    cfg.remote.deadline_ms = 2000
    with Store(cfg) as c:
        namespace(c)
        c.put(ns, keys[20:], blocks[20:])
        c.evict("host")
        assert r.dbsize() == 20                                     # on SSD, not in Redis
        c.evict("ssd")
        assert r.dbsize() == 40
    with remote_store(tmp_path / "b", redis_server.url) as b:
        assert namespace(b) == ns
        got = b.get(ns, keys)
        assert [k for k, _ in got] == keys and [d for _, d in got] == blocks


def test_a_lossy_value_under_a_lossless_key_is_a_counted_miss(tmp_path, redis_server):
    """Lossy copies skip the commit checksum, so a value framed with a codec the namespace did
    not choose (another build's or writer's, in a Redis many nodes share) must be refused
    before decoding: both by a store that knows the commit checksum and by one that knows the
    block only from Redis."""
    _, keys = random_prompt(np.random.default_rng(2), 3)
    r = redis.Redis.from_url(redis_server.url)
    with remote_store(tmp_path / "a", redis_server.url, write_through=True) as a:
        ns = namespace(a)
        a.put(ns, keys, [kv_block(k) for k in keys])
        raw = np.frombuffer(kv_block(keys[1]), np.uint8)
        # sealed to its key as any writer can (the unkeyed seal is no secret): the codec
        # check is what refuses it
        foreign = Sealer(None).seal(ns + keys[1], 0, frame.frame(
            "int8", len(raw), codecs.encode("int8", raw, SMALL)))
        r.set(f"kvs:{ns.hex()}:{keys[1].hex()}", foreign)
        assert a.evict("host")[0] > 0
        got = a.get(ns, keys)
        assert [k for k, _ in got] == keys[:1] and got[0][1] == kv_block(keys[0])
        assert a.stats()["counters"]["corrupt_blocks"] == 1
    r.set(f"kvs:{ns.hex()}:{keys[1].hex()}", foreign)      # the drop deleted it: write it again
    with remote_store(tmp_path / "b", redis_server.url) as b:
        assert namespace(b) == ns
        got = b.get(ns, keys)
        assert [k for k, _ in got] == keys[:1] and got[0][1] == kv_block(keys[0])
        assert b.stats()["counters"]["corrupt_blocks"] == 1
