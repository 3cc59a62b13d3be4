"""Blocks read back from the shared Redis, against a real redis-server: sealed values, reads
that fail, and deletes Redis did not answer.

Why these: Redis is written by every daemon of a fleet and by anyone else with access, and a
daemon reads blocks it never committed (another node's, its own after a restart). A
well-framed value of one block copied under another's key used to be served as that block;
a read that failed (Redis stalled for half a second) made the daemon forget the block's commit
checksum, so the next copy it found was trusted; and a Delete while Redis was down answered
"deleted" while the blocks came back, and were served, once Redis did.
"""

from __future__ import annotations

import os

import numpy as np
import redis
import xxhash

from tests.redis_fixtures import redis_server_fixture  # noqa: F401  (fixture)

from .store_helpers import kv_block, namespace, random_prompt
from .test_store_remote import remote_store


def _key(ns: bytes, k: bytes) -> str:
    return f"kvs:{ns.hex()}:{k.hex()}"


def test_a_value_copied_under_another_key_is_refused(tmp_path, redis_server):
    _, keys = random_prompt(np.random.default_rng(0), 3)
    r = redis.Redis.from_url(redis_server.url)
    with remote_store(tmp_path / "a", redis_server.url, write_through=True) as a:
        ns = namespace(a)
        a.put(ns, keys, [kv_block(k) for k in keys])
    r.copy(_key(ns, keys[1]), _key(ns, keys[0]), replace=True)  # block 1's value as block 0
    with remote_store(tmp_path / "b", redis_server.url) as b:          # knows only Redis
        assert namespace(b) == ns
        assert b.get(ns, keys) == []
        assert b.remote.stats["corrupt"] == 1
        assert r.exists(_key(ns, keys[0])) == 0 or _wait_gone(r, _key(ns, keys[0]))
        assert b.get(ns, keys[1:]) == [(k, kv_block(k)) for k in keys[1:]]
        # the blocks read carry the checksum they were committed with, from their seal
        with b.state.lock:
            sums = [b.state.index.get(ns + k).checksum for k in keys[1:]]
        assert sums == [xxhash.xxh3_64_intdigest(kv_block(k)) for k in keys[1:]]


def _wait_gone(r, key: str) -> bool:
    import time
    end = time.monotonic() + 5
    while r.exists(key):
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def test_with_a_shared_secret_only_its_holders_values_are_read(tmp_path, redis_server):
    secret, other = tmp_path / "secret", tmp_path / "other"
    secret.write_bytes(os.urandom(48))
    other.write_bytes(os.urandom(48))
    _, keys = random_prompt(np.random.default_rng(1), 4)
    with remote_store(tmp_path / "a", redis_server.url, write_through=True,
                      auth_key_file=str(secret)) as a:
        ns = namespace(a)
        a.put(ns, keys, [kv_block(k) for k in keys])
    with remote_store(tmp_path / "c", redis_server.url, auth_key_file=str(other)) as c:
        assert namespace(c) == ns and c.get(ns, keys) == []           # another secret
    with remote_store(tmp_path / "a", redis_server.url, write_through=True,
                      auth_key_file=str(secret)) as a:
        assert namespace(a) == ns
        a.put(ns, keys, [kv_block(k) for k in keys])                   # (c deleted block 0)
    with remote_store(tmp_path / "n", redis_server.url) as n:
        assert namespace(n) == ns and n.get(ns, keys) == []           # no secret
    with remote_store(tmp_path / "a", redis_server.url, write_through=True,
                      auth_key_file=str(secret)) as a:
        assert namespace(a) == ns
        a.put(ns, keys, [kv_block(k) for k in keys])
    with remote_store(tmp_path / "b", redis_server.url, auth_key_file=str(secret)) as b:
        assert namespace(b) == ns
        assert b.get(ns, keys) == [(k, kv_block(k)) for k in keys]


def test_a_failed_read_keeps_the_block_and_its_checksum(tmp_path, redis_server):
    _, keys = random_prompt(np.random.default_rng(2), 2)
    with remote_store(tmp_path / "a", redis_server.url, write_through=True,
                      deadline_ms=200) as s:
        ns = namespace(s)
        s.put(ns, keys, [kv_block(k) for k in keys])
        s.evict("host")
        with s.state.lock:
            committed = s.state.index.get(ns + keys[0]).checksum
        redis_server.pause()
        try:
            assert s.get(ns, keys[:1]) == []                # no answer: a miss now
        finally:
            redis_server.resume()
        assert s.stats()["counters"]["remote_read_failed_blocks"] >= 1
        with s.state.lock:
            e = s.state.index.get(ns + keys[0])
            assert e is not None and e.remote and e.checksum == committed
        s.remote.wait_ready(5)
        _until(lambda: s.get(ns, keys) == [(k, kv_block(k)) for k in keys])


def _until(check, timeout: float = 10.0) -> None:
    import time
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "not true within the deadline"
        time.sleep(0.1)


def deleted_while_redis_is_down(s, keys: list[bytes], r, redis_server) -> bytes:
    """Store `keys` (written through to Redis), evict host, snapshot Redis, stop it, and
    Delete the blocks: the deletes wait, and Redis comes back from its RDB with the blocks.
    Returns the namespace."""
    ns = namespace(s)
    s.put(ns, keys, [kv_block(k) for k in keys])
    s.evict("host")
    r.save()
    redis_server.kill()                                      # down; back later from its RDB
    assert s.delete(ns, keys) == 4
    return ns


def test_a_delete_redis_did_not_answer_is_sent_again(tmp_path, redis_server):
    _, keys = random_prompt(np.random.default_rng(3), 4)
    _, more = random_prompt(np.random.default_rng(4), 2)
    r = redis.Redis.from_url(redis_server.url)
    with remote_store(tmp_path / "a", redis_server.url, write_through=True,
                      deadline_ms=200) as s:
        ns = deleted_while_redis_is_down(s, keys, r, redis_server)
        assert s.stats()["counters"]["remote_deletes_waiting"] == 4
        redis_server.start()
        assert r.dbsize() == 4                               # back, with the blocks
        # not found again meanwhile, by Lookup or Locate
        _until(lambda: s.remote.exists_many([b"\0" * 32]) == [False] and s.remote.up)
        assert s.lookup(ns, keys).prefix_blocks == 0
        assert s.where(ns, keys) == [None] * 4
        assert s.get(ns, keys) == []
        # the next write that lands sends them
        s.put(ns, more, [kv_block(k) for k in more])
        _until(lambda: r.dbsize() == 2)
        assert s.stats()["counters"]["remote_deletes_waiting"] == 0


def test_waiting_deletes_are_kept_across_a_restart_and_sent_without_traffic(
        tmp_path, redis_server):
    """A restart used to forget the deletes Redis had not answered, so the blocks came back
    with the next start; and they were sent again only with a later delete or write."""
    import msgpack

    from kvstore.moves.remote_deletes import FILE_NAME, RETRY_S
    _, keys = random_prompt(np.random.default_rng(5), 4)
    r = redis.Redis.from_url(redis_server.url)
    kept = tmp_path / "a" / FILE_NAME
    with remote_store(tmp_path / "a", redis_server.url, write_through=True,
                      deadline_ms=200) as s:
        ns = deleted_while_redis_is_down(s, keys, r, redis_server)
        # written while the daemon runs (a crash loses at most RETRY_S of changes)
        _until(lambda: kept.exists(), timeout=RETRY_S + 5)
        assert sorted(msgpack.unpackb(kept.read_bytes())) == sorted(ns + k for k in keys)
    redis_server.start()
    assert r.dbsize() == 4                                   # back, with the blocks
    with remote_store(tmp_path / "a", redis_server.url, write_through=True,
                      deadline_ms=200) as s:
        assert s.stats()["counters"]["remote_deletes_waiting"] == 4
        assert namespace(s) == ns
        _until(lambda: s.remote.up)
        assert s.lookup(ns, keys).prefix_blocks == 0       # absent meanwhile
        assert s.get(ns, keys) == []
        _until(lambda: r.dbsize() == 0, timeout=RETRY_S + 5)    # sent with no traffic at all
        assert s.stats()["counters"]["remote_deletes_waiting"] == 0
        _until(lambda: not kept.exists(), timeout=RETRY_S + 5)


def test_a_damaged_file_of_waiting_deletes_is_removed(tmp_path, redis_server):
    from kvstore.moves.remote_deletes import FILE_NAME
    (tmp_path / "a").mkdir()
    kept = tmp_path / "a" / FILE_NAME
    for junk in (b"\xc1junk", msgpack_of([1, 2]), os.urandom(64)):
        kept.write_bytes(junk)
        with remote_store(tmp_path / "a", redis_server.url) as s:
            assert not kept.exists()
            assert s.stats()["counters"].get("remote_deletes_waiting", 0) == 0


def msgpack_of(obj) -> bytes:
    import msgpack
    return msgpack.packb(obj)


def test_a_note_is_sealed_with_the_value():
    """A value's note (the block's KV-event text) is covered by its tag: changed, the value is
    refused; a value without one is the KVR1 layout it always was."""
    import pytest
    from kvstore_client.common.errors import DataLoss

    from tiers import frame
    from tiers.remote.envelope import MAX_NOTE_BYTES, Sealer, sealed_bytes
    s = Sealer(None)
    fr = frame.frame("raw", 4096, os.urandom(4096))
    g = os.urandom(32)
    plain, noted = s.seal(g, 7, fr), s.seal(g, 7, fr, b"tokens")
    assert plain[:4] == b"KVR1" and len(plain) == sealed_bytes(len(fr))
    assert noted[:4] == b"KVR2" and len(noted) == sealed_bytes(len(fr), b"tokens")
    assert s.open_noted(g, plain)[0::2] == (7, b"")
    assert s.open_noted(g, noted)[0::2] == (7, b"tokens")
    assert bytes(s.open(g, noted)[1]) == fr
    forged = noted.replace(b"tokens", b"tokenz")
    with pytest.raises(DataLoss, match="seal does not match"):
        s.open_noted(g, forged)
    too_long = b"x" * (MAX_NOTE_BYTES + 1)
    assert s.seal(g, 7, fr, too_long) == plain          # left out, not truncated


def test_a_waiting_delete_is_not_sent_while_a_new_copy_is_written(tmp_path, redis_server):
    """A delete waiting since Redis was down, sent again (every second) while a new copy of
    the same block was being written, landed after the write: Redis lost the copy the index
    named, and a Get after host eviction found nothing. A new copy now replaces the waiting
    delete, and no DEL of a key goes out while its SET is in flight. The write is slowed after
    Redis took it (a slow pipeline) so a retry round falls inside it."""
    import time

    from kvstore.moves.remote_deletes import RETRY_S
    _, keys = random_prompt(np.random.default_rng(6), 4)
    r = redis.Redis.from_url(redis_server.url)
    with remote_store(tmp_path / "a", redis_server.url, write_through=True,
                      deadline_ms=200) as s:
        ns = deleted_while_redis_is_down(s, keys, r, redis_server)
        redis_server.start()
        _until(lambda: s.remote.up)
        plain = s.remote.put_many

        def slow_put_many(items, *a, **kw):
            n = plain(items, *a, **kw)
            time.sleep(RETRY_S * 1.2)
            return n
        s.remote.put_many = slow_put_many
        try:
            s.put(ns, keys, [kv_block(k) for k in keys])        # stored again: written through
        finally:
            s.remote.put_many = plain
        time.sleep(RETRY_S * 1.5)
        assert r.dbsize() == 4, "the waiting delete dropped the new copies"
        s.evict("host")
        assert s.get(ns, keys) == [(k, kv_block(k)) for k in keys]
        assert s.stats()["counters"]["remote_deletes_waiting"] == 0


def test_values_carry_no_note_unless_value_notes_is_on(tmp_path, redis_server):
    """Daemons from before notes existed delete a KVR2 value as corrupt, so in a Redis shared
    with them a daemon writes KVR1 values, events on or not, until remote.value_notes."""
    _, keys = random_prompt(np.random.default_rng(8), 2)
    r = redis.Redis.from_url(redis_server.url)
    from kvstore.config import StoreConfig
    from kvstore.store import Store
    for notes in (False, True):
        prefix = f"n{int(notes)}:"
        cfg = StoreConfig(data_dir=str(tmp_path / f"n{notes}"))
        cfg.host.capacity, cfg.ssd.enabled = 4 << 20, False
        cfg.remote.enabled, cfg.remote.urls = True, [redis_server.url]
        cfg.remote.write_through, cfg.remote.value_notes = True, notes
        cfg.remote.key_prefix = prefix
        cfg.events.enabled, cfg.events.endpoint = True, "tcp://127.0.0.1:0"
        with Store(cfg.check()) as s:
            ns = namespace(s)
            lease = s.reserve(ns, 2)
            for k, sl in zip(keys, lease.slots, strict=True):
                s.host.view(sl.offset, sl.length)[:] = np.frombuffer(kv_block(k), np.uint8)
            s.commit(lease.id, keys, checksums=None, token_ids=list(range(2 * 8)))
            _until(lambda p=prefix: len(r.keys(p + "*")) == 2)
        magics = {r.get(k)[:4] for k in r.keys(prefix + "*")}
        assert magics == ({b"KVR2"} if notes else {b"KVR1"}), (notes, magics)
