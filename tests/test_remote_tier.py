"""Remote tier against a real redis-server and a real 3-node Redis Cluster (no mocks).

What is pinned here: framed values round-trip, sealed to their key (tiers/remote/envelope.py: a
value in Redis is SEAL_BYTES longer than the frame, and every byte count includes the seal); a
value sealed for another key, or by a daemon without the same `auth_key_file`, is a counted
corrupt miss; a batch costs one round trip per node (checked
with our counter and with the servers' own command counts); keys spread over the cluster; a hung
or dead server costs at most the deadline and the tier recovers by itself; corrupt values are
counted misses; keys Redis evicted or flushed are ordinary misses; a slot that migrates to
another node (ASK while half-way, MOVED after) is at worst a counted miss, and once the tier has
refreshed its slot table the keys are found again on the new owner. TLS and passwords:
tests/test_remote_tls.py.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import xxhash
from kvstore_client.common.layout import KVLayout
from kvstore_client.errors import InvalidArgument, Unavailable
from redis.crc import key_slot

from tests.redis_fixtures import (  # noqa: F401 - pytest fixtures used by name
    ClusterProc,
    RedisProc,
    redis_cluster_fixture,
    redis_server_fixture,
    start_cluster,
    start_redis,
)
from tiers.frame import frame, unframe
from tiers.remote import SOCKET_GRACE_S, RemoteTier, make_key
from tiers.remote.envelope import SEAL_BYTES, Sealer, sealer_from_file
from tiers.remote.tier import Unframed

pytestmark = pytest.mark.redis

DEADLINE_MS = 200
# What a call may take beyond its deadline: waking the thread that waits, and the bookkeeping of
# a failed batch, on a loaded 2-core machine. A call that ignored the deadline would wait for the
# sockets (SOCKET_GRACE_S after it) or for ever; that the tier's own deadline ended the wait is
# checked by its `timeouts` counter, which does not depend on the load.
MARGIN_S = 1.0
assert MARGIN_S <= SOCKET_GRACE_S


def assert_bounded(t0: float, deadline_s: float = DEADLINE_MS / 1000) -> None:
    """The time since t0 is within the deadline plus MARGIN_S."""
    took = time.monotonic() - t0
    assert took < deadline_s + MARGIN_S, (f"took {took:.2f} s for a deadline of {deadline_s} s "
                                          f"(+ {MARGIN_S} s margin)")


@dataclass
class Cfg:
    """Duck-typed stand-in with RemoteConfig's field names (tiers never imports kvstore)."""

    urls: list[str] = field(default_factory=list)
    cluster: bool = False
    username: str = ""
    password: str = ""
    tls: bool = False
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    key_prefix: str = "kvs:"
    deadline_ms: int = DEADLINE_MS
    capacity: int = 0
    backoff_min_ms: int = 20
    backoff_max_ms: int = 300
    auth_key_file: str = ""


def gkeys(n: int, ns: bytes | None = None) -> list[bytes]:
    ns = ns or os.urandom(16)
    return [ns + os.urandom(16) for _ in range(n)]


def framed(size: int, seed: int = 0) -> bytes:
    payload = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    return frame("raw", size, payload)


def pairs(keys: list[bytes], vals: list[bytes]) -> list[tuple[bytes, bytes]]:
    return list(zip(keys, vals, strict=True))


def stored(vals: list[bytes]) -> int:
    """Bytes `vals` (frames) take in Redis once sealed: what put_many returns and counts."""
    return sum(len(v) + SEAL_BYTES for v in vals)


def sealed(gkey: bytes, frame_bytes: bytes, checksum: int = 0) -> bytes:
    """The value an unkeyed tier stores for `frame_bytes` under `gkey`: for planting values
    with redis-py that pass the seal, so a later check is what refuses them."""
    return Sealer(None).seal(gkey, checksum, frame_bytes)


def wait_until(pred, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return False


def cmd_calls(client, cmd: str) -> int:
    """How many times this server ran `cmd` (INFO commandstats): the server's own count."""
    return int(client.info("commandstats").get(f"cmdstat_{cmd}", {}).get("calls", 0))


# ---------------------------------------------------------------------------------- config


def test_config_errors_name_the_setting():
    with pytest.raises(InvalidArgument, match="urls"):
        RemoteTier(Cfg(urls=[]))
    with pytest.raises(InvalidArgument, match="cluster"):
        RemoteTier(Cfg(urls=["redis://127.0.0.1:1", "redis://127.0.0.1:2"]))
    with pytest.raises(InvalidArgument, match="hash tag"):
        RemoteTier(Cfg(urls=["redis://127.0.0.1:1"], cluster=True, key_prefix="{kvs}:"))


def test_key_naming_is_prefix_ns_hex_block_hex():
    g = bytes(range(16)) + b"\xab" * 20
    assert make_key(b"kvs:", g) == b"kvs:" + bytes(range(16)).hex().encode() + b":" + b"ab" * 20


# ---------------------------------------------------------------------------------- standalone


def test_standalone_round_trip_and_counters(redis_server):
    r = redis_server.client()
    with RemoteTier(Cfg(urls=[redis_server.url])) as t:
        keys = gkeys(16)
        vals = [framed(50_000 + i, seed=i) for i in range(16)]
        # (gkey, frame) items and (gkey, frame, commit checksum) items, in one batch
        sums = [xxhash.xxh3_64_intdigest(unframe(v)[2]) for v in vals[:8]]
        items = [(k, v, c) for k, v, c in zip(keys[:8], vals[:8], sums, strict=True)]
        items += pairs(keys[8:], vals[8:])
        assert t.put_many(items) == stored(vals)          # Redis acknowledged the seals too
        missing = gkeys(3)
        assert t.exists_many(keys + missing) == [True] * 16 + [False] * 3
        gone: set[bytes] = set()
        got = t.get_many(keys + missing, gone=gone)
        assert got[:16] == vals and got[16:] == [None] * 3   # frames, seals stripped
        assert all(type(g) is bytes for g in got[:16])
        assert gone == set(missing)                         # Redis said: not there
        u = t.get_many([keys[0], keys[8]], unframed=True)
        assert all(isinstance(x, Unframed) and x.note == b"" for x in u)
        assert (u[0].codec, u[0].raw_len, bytes(u[0].payload), u[0].checksum) == (
            "raw", 50_000, bytes(unframe(vals[0])[2]), sums[0])
        assert (u[1].codec, u[1].raw_len, u[1].checksum) == ("raw", 50_008, 0)  # none given
        # stored under the documented name, readable with redis-cli: seal + frame
        k0 = make_key(b"kvs:", keys[0])
        assert r.strlen(k0) == len(vals[0]) + SEAL_BYTES
        assert r.get(k0) == sealed(keys[0], vals[0], sums[0])
        assert r.get(k0)[:4] == b"KVR1" and r.get(k0)[SEAL_BYTES:] == vals[0]
        s = t.stats
        assert s["hits"] == 18 and s["misses"] == 3 and s["corrupt"] == 0 and s["errors"] == 0
        assert s["bytes_written"] == t.used_bytes == stored(vals)
        assert s["bytes_read"] == stored(vals) + stored([vals[0], vals[8]])
        assert s["round_trips"] == s["calls"] == 4 and s["up"]
        assert s["latency"]["get"]["count"] == 2 and len(t.latency_samples("get")) == 2
        failed: list[bytes] = []
        assert t.delete_many(keys[:4], sizes=[len(v) + SEAL_BYTES for v in vals[:4]],
                             failed=failed) == 4
        assert failed == []                                 # the node answered
        assert t.used_bytes == stored(vals[4:])
        assert t.exists_many(keys[:5]) == [False] * 4 + [True]
        gone.clear()
        assert t.get_many(keys[:5], gone=gone) == [None] * 4 + [vals[4]]
        assert gone == set(keys[:4])


def test_unix_socket_url_round_trip(tmp_path):
    """A unix:// URL (the docs allow it for standalone) builds a working client; redis-py's
    URL parser speaks ConnectionPool options, which once made this a TypeError."""
    sock = tmp_path / "r.sock"
    proc = start_redis(tmp_path, unixsocket=str(sock), unixsocketperm="700")
    try:
        with RemoteTier(Cfg(urls=[f"unix://{sock}"])) as t:
            keys = gkeys(4)
            vals = [framed(5000, seed=i) for i in range(4)]
            assert t.put_many(pairs(keys, vals)) == stored(vals)
            assert t.get_many(keys) == vals and t.stats["up"]
        assert proc.client().get(make_key(b"kvs:", keys[0])) == sealed(keys[0], vals[0])
    finally:
        proc.kill()


def test_standalone_batch_is_one_pipeline(redis_server):
    """64 keys: the server runs 64 EXISTS/GET but the tier counts one round trip per call."""
    r = redis_server.client()
    with RemoteTier(Cfg(urls=[redis_server.url])) as t:
        keys = gkeys(64)
        t.put_many([(k, framed(1000)) for k in keys])
        before = t.stats["round_trips"], cmd_calls(r, "exists"), cmd_calls(r, "getrange")
        t.exists_many(keys)
        t.get_many(keys)
        after = t.stats["round_trips"], cmd_calls(r, "exists"), cmd_calls(r, "getrange")
        assert after[0] - before[0] == 2
        assert (after[1] - before[1], after[2] - before[2]) == (64, 64)


def test_corrupt_values_are_counted_misses_never_served(redis_server):
    r = redis_server.client()
    with RemoteTier(Cfg(urls=[redis_server.url])) as t:
        keys = gkeys(4)
        vals = [framed(10_000, seed=i) for i in range(4)]
        t.put_many(pairs(keys, vals))
        k = [make_key(b"kvs:", g) for g in keys]
        flipped = bytearray(vals[0])
        flipped[5000] ^= 0x01
        # sealed for their keys (as a daemon would have): the frame check refuses them
        r.set(k[0], sealed(keys[0], bytes(flipped)))    # one bit in the payload
        r.set(k[1], sealed(keys[1], vals[1][:-100]))    # truncated
        r.set(k[2], b"not a frame at all")      # foreign value under our key
        gone: set[bytes] = set()
        got = t.get_many(keys, gone=gone)
        assert got[:3] == [None, None, None] and got[3] == vals[3]
        assert gone == set(keys[:3])            # corrupt and deleted: the copy is no more
        s = t.stats
        assert s["corrupt"] == 3 and s["hits"] == 1 and s["misses"] == 3
        assert t.get_many(keys[:1], unframed=True) == [None]
        # the tier drops the bad values (in the background) so a writer can store good ones
        assert wait_until(lambda: r.exists(*k[:3]) == 0)
        assert r.get(k[3]) == sealed(keys[3], vals[3])


def test_value_sealed_for_another_key_is_a_corrupt_miss_and_deleted(redis_server):
    """A whole, well-framed value of block A copied under block B's key (a script, a restore
    of the wrong snapshot): its seal names A, so under B it is a counted corrupt miss, never
    returned, and deleted; A itself is untouched and still served."""
    r = redis_server.client()
    with RemoteTier(Cfg(urls=[redis_server.url])) as t:
        a, b = gkeys(2)                          # same namespace, another block
        c = gkeys(1)[0]                          # another namespace
        va = framed(8000, seed=1)
        t.put_many([(a, va)])
        ka, kb, kc = (make_key(b"kvs:", g) for g in (a, b, c))
        assert r.copy(ka, kb)                    # COPY: the stored bytes, seal and all
        r.set(kc, r.get(ka))                     # GET + SET
        gone: set[bytes] = set()
        assert t.get_many([b, c], gone=gone) == [None, None]
        assert gone == {b, c}
        s = t.stats
        assert s["corrupt"] == 2 and s["hits"] == 0 and s["misses"] == 2 and s["errors"] == 0
        assert wait_until(lambda: r.exists(kb, kc) == 0)
        assert r.get(ka) == sealed(a, va)
        assert t.get_many([a, b]) == [va, None] and t.stats["corrupt"] == 2


def test_auth_key_file_refuses_values_sealed_without_the_key(redis_server, tmp_path):
    """With `auth_key_file` set, only a value sealed with the same secret is read back: one
    sealed without a key (the default) or with another key file is a corrupt miss, deleted."""
    key_file, other_file = tmp_path / "remote.key", tmp_path / "other.key"
    key_file.write_bytes(os.urandom(48))
    other_file.write_bytes(os.urandom(48))
    r = redis_server.client()
    url = redis_server.url
    keyed = Cfg(urls=[url], auth_key_file=str(key_file))
    with (RemoteTier(keyed) as writer, RemoteTier(keyed) as reader,
          RemoteTier(Cfg(urls=[url], auth_key_file=str(other_file))) as other,
          RemoteTier(Cfg(urls=[url])) as unkeyed):
        keys = gkeys(4)
        vals = [framed(5000, seed=i) for i in range(4)]
        k = [make_key(b"kvs:", g) for g in keys]
        assert writer.put_many([(keys[0], vals[0], 77)]) == stored(vals[:1])  # same key file
        assert other.put_many([(keys[1], vals[1])]) == stored(vals[1:2])      # another key file
        assert unkeyed.put_many([(keys[2], vals[2])]) == stored(vals[2:3])    # no key
        r.set(k[3], sealed(keys[3], vals[3]))              # Sealer(None), planted by hand
        assert r.get(k[0]) == sealer_from_file(str(key_file)).seal(keys[0], 77, vals[0])
        gone: set[bytes] = set()
        assert reader.get_many(keys, gone=gone) == [vals[0], None, None, None]
        assert gone == set(keys[1:])
        s = reader.stats
        assert s["hits"] == 1 and s["corrupt"] == 3 and s["errors"] == 0
        assert wait_until(lambda: r.exists(*k[1:]) == 0)
        u = reader.get_many(keys[:1], unframed=True)[0]
        assert (u.codec, u.raw_len, bytes(u.payload), u.checksum) == (
            "raw", 5000, bytes(unframe(vals[0])[2]), 77)
        assert writer.get_many(keys[:1]) == [vals[0]]     # the writer reads its own back
    # a key file too short to be a secret, or missing, is refused when the tier is built
    short = tmp_path / "short.key"
    short.write_bytes(b"0123456789abcdef")
    for path in (short, tmp_path / "missing.key"):
        with pytest.raises(InvalidArgument, match="auth_key_file"):
            RemoteTier(Cfg(urls=[url], auth_key_file=str(path)))


def test_flushed_keys_are_ordinary_misses(redis_server):
    with RemoteTier(Cfg(urls=[redis_server.url])) as t:
        keys = gkeys(8)
        t.put_many([(k, framed(1000)) for k in keys])
        redis_server.client().flushall()
        assert t.exists_many(keys) == [False] * 8
        assert t.get_many(keys) == [None] * 8
        s = t.stats
        assert s["errors"] == 0 and s["corrupt"] == 0 and s["up"]


def test_maxmemory_eviction_is_ordinary_misses(tmp_path):
    """A small Redis with allkeys-lru drops old blocks; they read as misses, never errors."""
    proc = start_redis(tmp_path, maxmemory="2mb", **{"maxmemory-policy": "allkeys-lru"})
    try:
        # Not a deadline test: a loaded machine must not turn a slow write into a dropped one.
        with RemoteTier(Cfg(urls=[proc.url], deadline_ms=2000)) as t:
            keys = gkeys(24)
            vals = [framed(200_000, seed=i) for i in range(24)]
            for k, v in pairs(keys, vals):               # one by one so LRU has an order
                assert t.put_many([(k, v)]) == len(v) + SEAL_BYTES
            got = t.get_many(keys)
            present = [g is not None for g in got]
            assert 0 < sum(present) < 24                 # some evicted, some kept
            assert all(g == v for g, v in zip(got, vals, strict=True) if g is not None)
            assert present[-1]                           # the newest survived
            # Redis may evict more at any command (the big GET reply used memory): what EXISTS
            # sees now is a subset of what GET found, and nothing is an error
            assert all(p or not e for p, e in zip(present, t.exists_many(keys), strict=True))
            s = t.stats
            assert s["errors"] == 0 and s["corrupt"] == 0
            assert s["bytes_written"] == stored(vals)   # what we wrote, not what stayed
    finally:
        proc.kill()


def test_hung_server_costs_at_most_the_deadline_then_recovers(redis_server):
    with RemoteTier(Cfg(urls=[redis_server.url])) as t:
        keys = gkeys(8)
        vals = [framed(1000, seed=i) for i in range(8)]
        t.put_many(pairs(keys, vals))
        redis_server.pause()                             # SIGSTOP: accepts, never answers
        try:
            before = t.stats
            t0 = time.monotonic()
            assert t.exists_many(keys) == [False] * 8
            assert_bounded(t0)
            s = t.stats
            # The tier's own deadline ended the wait (not a socket timeout): a timeout counted.
            assert s["timeouts"] == before["timeouts"] + 1, s
            assert s["errors"] == before["errors"] + 1
            # A PING within the deadline (Nodes.check_slow) gets no answer either: down.
            assert wait_until(lambda: not t.stats["up"], timeout=5)
            s = t.stats
            t0 = time.monotonic()
            assert t.get_many(keys, deadline_s=DEADLINE_MS / 1000) == [None] * 8
            assert t.exists_many(keys) == [False] * 8    # down: skipped, no new wait
            assert_bounded(t0)
            s2 = t.stats
            assert s2["skipped_down"] >= s["skipped_down"] + 1
            assert s2["timeouts"] == s["timeouts"]        # nothing waited on the down node
        finally:
            redis_server.resume()
        assert wait_until(lambda: t.exists_many(keys) == [True] * 8)
        assert t.get_many(keys) == vals and t.stats["up"] and t.stats["reconnects"] >= 1


def test_dead_server_never_raises_and_reconnects_after_restart(redis_server):
    with RemoteTier(Cfg(urls=[redis_server.url])) as t:
        keys = gkeys(4)
        vals = [framed(1000, seed=i) for i in range(4)]
        assert t.put_many(pairs(keys, vals)) > 0
        redis_server.kill()                              # SIGKILL: connections reset
        for _ in range(20):                              # a busy engine keeps asking
            t0 = time.monotonic()
            assert t.exists_many(keys) == [False] * 4
            assert t.get_many(keys) == [None] * 4
            assert t.put_many(pairs(keys, vals)) == 0
            assert_bounded(t0)                           # refused at once, or skipped
        assert not t.stats["up"] and t.stats["errors"] >= 1
        # no answer is not an answer: the keys are neither `gone` nor deleted (`failed`)
        gone: set[bytes] = set()
        failed: list[bytes] = []
        assert t.get_many(keys, gone=gone) == [None] * 4 and gone == set()
        assert t.delete_many(keys, failed=failed) == 0 and failed == keys
        redis_server.start()                             # same port, empty (no persistence)
        assert wait_until(lambda: t.put_many(pairs(keys, vals)) == stored(vals))
        assert t.get_many(keys) == vals and t.stats["up"]


def test_raise_errors_mode_raises_unavailable(redis_server):
    with RemoteTier(Cfg(urls=[redis_server.url]), raise_errors=True) as t:
        redis_server.kill()
        with pytest.raises(Unavailable):
            t.exists_many(gkeys(2))
        # the node is marked down now: later calls skip it without waiting, and still say so
        skipped = t.stats["skipped_down"]
        with pytest.raises(Unavailable, match="down"):
            t.get_many(gkeys(2))
        assert t.stats["skipped_down"] > skipped         # skipped, not waited for


def test_constructed_while_server_is_down(tmp_path):
    """The daemon starts even if Redis is not up yet; the tier joins when Redis appears."""
    proc = start_redis(tmp_path)
    proc.stop()
    try:
        with RemoteTier(Cfg(urls=[proc.url])) as t:
            keys = gkeys(2)
            t0 = time.monotonic()
            assert t.exists_many(keys) == [False, False]
            assert_bounded(t0)
            proc.start()
            v = framed(100)
            assert wait_until(lambda: t.put_many([(keys[0], v)]) == len(v) + SEAL_BYTES)
            assert t.get_many(keys) == [v, None]
    finally:
        proc.kill()


# ---------------------------------------------------------------------------------- cluster


def per_node_counts(cluster, prefix: bytes) -> list[int]:
    return [sum(1 for _ in n.client().scan_iter(match=prefix + b"*", count=1000))
            for n in cluster.nodes]


def test_cluster_spreads_keys_and_sends_one_batch_per_node(redis_cluster):
    prefix = b"spread:"
    with RemoteTier(Cfg(urls=redis_cluster.urls, cluster=True, key_prefix="spread:")) as t:
        assert t.wait_ready()
        keys = gkeys(96)                                  # one namespace
        vals = [framed(2000, seed=i) for i in range(96)]
        assert t.put_many(pairs(keys, vals)) == stored(vals)
        counts = per_node_counts(redis_cluster, prefix)
        assert sum(counts) == 96 and sum(1 for c in counts if c) >= 2, counts
        clients = [n.client() for n in redis_cluster.nodes]
        before_rt = t.stats["round_trips"]
        before = [cmd_calls(c, "getrange") for c in clients]
        assert t.get_many(keys) == vals
        after = [cmd_calls(c, "getrange") for c in clients]
        # each node ran exactly the GETs for its own keys
        assert [a - b for a, b in zip(after, before, strict=True)] == counts
        nodes_used = sum(1 for c in counts if c)
        assert t.stats["round_trips"] - before_rt == nodes_used   # not 96
        before_rt = t.stats["round_trips"]
        assert t.exists_many(keys) == [True] * 96
        assert t.stats["round_trips"] - before_rt == nodes_used
        # a namespace is not pinned to a node: keys of one ns_id land on several slots
        slots = {clients[0].execute_command("CLUSTER KEYSLOT", make_key(prefix, k))
                 for k in keys[:8]}
        assert len(slots) > 1


def test_two_daemons_share_a_prefix_through_the_cluster(redis_cluster):
    """Daemon A (own local tiers) encodes and stores; daemon B (separate process state) loads
    through its own RemoteTier: lossless is bit-exact, int8 within the codec's error, and B
    learns each block's commit checksum from its seal (the lossless bytes match it)."""
    from tiers.codecs import decode, encode, relative_error

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=16,
                      dtype="bfloat16")
    rng = np.random.default_rng(7)
    blocks = [rng.standard_normal(layout.block_bytes // 2).astype(np.float32)
              .view(np.uint32).__rshift__(16).astype(np.uint16).view(np.uint8)
              for _ in range(8)]
    cfg = Cfg(urls=redis_cluster.urls, cluster=True, key_prefix="share:")
    with RemoteTier(cfg) as a, RemoteTier(cfg) as b:
        assert a.wait_ready() and b.wait_ready()
        for codec in ("lossless", "int8"):
            keys = gkeys(8)
            sums = [xxhash.xxh3_64_intdigest(blk) for blk in blocks]
            a.put_many([(k, frame(codec, layout.block_bytes, encode(codec, blk, layout)), c)
                        for k, blk, c in zip(keys, blocks, sums, strict=True)])
            assert b.exists_many(keys) == [True] * 8
            got = b.get_many(keys, unframed=True)
            for (c, raw_len, payload, checksum, _), blk, want in zip(got, blocks, sums,
                                                                  strict=True):
                out = np.empty(layout.block_bytes, np.uint8)
                assert (c, raw_len, checksum) == (codec, layout.block_bytes, want)
                decode(c, payload, layout, out)
                if codec == "lossless":
                    assert np.array_equal(out, blk)
                    assert xxhash.xxh3_64_intdigest(out) == checksum
                else:
                    x = blk.view(np.uint16).astype(np.uint32) << 16
                    y = out.view(np.uint16).astype(np.uint32) << 16
                    assert relative_error(x.view(np.float32), y.view(np.float32)) < 0.02
        assert b.stats["hits"] == 16 and b.stats["corrupt"] == 0


def test_cluster_node_down_misses_only_its_keys_then_recovers(redis_cluster):
    cfg = Cfg(urls=redis_cluster.urls, cluster=True, key_prefix="down:")
    with RemoteTier(cfg) as t:
        assert t.wait_ready()
        keys = gkeys(48)
        vals = [framed(1000, seed=i) for i in range(48)]
        t.put_many(pairs(keys, vals))
        victim = redis_cluster.nodes[1]
        on_victim = [redis_cluster.node_for_key(make_key(b"down:", k)) is victim for k in keys]
        assert any(on_victim) and not all(on_victim)
        victim.kill()
        try:
            for _ in range(3):
                t0 = time.monotonic()
                found = t.exists_many(keys)
                assert_bounded(t0)
                assert found == [not v for v in on_victim]   # live nodes still serve
            got = t.get_many(keys)
            assert all((g is None) if v else (g == val)
                       for g, v, val in zip(got, on_victim, vals, strict=True))
            assert not t.stats["up"] and t.stats["errors"] >= 1
        finally:
            redis_cluster.start()                          # same port + nodes.conf
        # the restarted node is empty (no persistence): rewrite, then everything is back
        assert wait_until(lambda: t.put_many(pairs(keys, vals)) == stored(vals),
                          timeout=20)
        assert t.get_many(keys) == vals and t.stats["up"]


def test_cluster_hung_node_is_bounded_by_the_deadline(redis_cluster):
    cfg = Cfg(urls=redis_cluster.urls, cluster=True, key_prefix="hung:")
    with RemoteTier(cfg) as t:
        assert t.wait_ready()
        keys = gkeys(24)
        t.put_many([(k, framed(500)) for k in keys])
        victim = redis_cluster.nodes[2]
        on_victim = [redis_cluster.node_for_key(make_key(b"hung:", k)) is victim for k in keys]
        victim.pause()
        try:
            before = t.stats["timeouts"]
            t0 = time.monotonic()
            found = t.exists_many(keys)
            assert_bounded(t0)
            assert t.stats["timeouts"] == before + 1     # the hung node's batch, by the deadline
            assert found == [not v for v in on_victim]
        finally:
            victim.resume()
        assert wait_until(lambda: t.exists_many(keys) == [True] * 24)


# ---------------------------------------------------------------------------------- slot migration
# Each test migrates a slot on its own cluster: the shared module cluster keeps its layout.
# These are about routing, not deadlines: a generous one keeps a loaded machine from turning a
# slow batch into a "down" node and a miss the assertions do not expect.
ROUTING_DEADLINE_MS = 2000


@pytest.fixture(name="own_cluster")
def own_cluster_fixture(tmp_path):
    cluster = start_cluster(tmp_path)
    yield cluster
    for node in cluster.nodes:
        node.kill()


def keys_in_slot(prefix: bytes, ns: bytes, slot: int, n: int) -> list[bytes]:
    """`n` block keys of namespace `ns` whose Redis keys hash to `slot` (found by trying; keys
    carry no hash tag, so that is the only way to put several of them in one slot)."""
    out: list[bytes] = []
    while len(out) < n:
        g = ns + os.urandom(16)
        if key_slot(make_key(prefix, g)) == slot:
            out.append(g)
    return out


@dataclass
class SlotSetup:
    """Blocks written through the tier: `moving` all hash to `slot` (owned by `src`), `rest`
    spread over the cluster; `dst` is the node the slot will move to."""

    keys: list[bytes]
    vals: list[bytes]
    n_moving: int
    slot: int
    src: RedisProc
    dst: RedisProc

    @property
    def moving(self) -> list[bytes]:
        return self.keys[:self.n_moving]


def write_slot_setup(t: RemoteTier, cluster: ClusterProc, prefix: bytes) -> SlotSetup:
    ns = os.urandom(16)
    first = gkeys(1, ns)[0]
    slot = key_slot(make_key(prefix, first))
    # the others must miss the slot: one of 23 random keys lands in it about once in 700 runs,
    # and would move with it
    rest = [k for k in gkeys(40, ns) if key_slot(make_key(prefix, k)) != slot][:23]
    keys = [first, *keys_in_slot(prefix, ns, slot, 3), *rest]
    vals = [framed(3000, seed=i) for i in range(len(keys))]
    assert t.put_many(pairs(keys, vals)) == stored(vals)
    assert t.get_many(keys) == vals                       # the tier's slot table is warm
    src = cluster.node_for_key(make_key(prefix, keys[0]))
    dst = next(n for n in cluster.nodes if n is not src)
    return SlotSetup(keys, vals, 4, slot, src, dst)


def never_wrong(got: list, vals: list[bytes]) -> bool:
    """Every answer is the value written or a miss: a redirect never yields a wrong value."""
    return all(g is None or g == v for g, v in zip(got, vals, strict=True))


def test_cluster_moved_slot_is_a_miss_then_routes_to_the_new_owner(own_cluster):
    """docs/remote.md: a MOVED reply is a miss for that key and triggers a background refresh
    of the slot table; the next calls route to the new owner, one batch per node."""
    cluster = own_cluster
    prefix = b"mv:"
    cfg = Cfg(urls=cluster.urls, cluster=True, key_prefix="mv:",
              deadline_ms=ROUTING_DEADLINE_MS)
    with RemoteTier(cfg) as t:
        assert t.wait_ready()
        su = write_slot_setup(t, cluster, prefix)
        moved_keys = cluster.move_slot(su.slot, su.src, su.dst)
        assert sorted(moved_keys) == sorted(make_key(prefix, k) for k in su.moving)
        assert cluster.node_for_key(make_key(prefix, su.moving[0])) is su.dst
        before = t.stats
        got = t.get_many(su.keys)                          # old table: the slot's keys -> src
        assert never_wrong(got, su.vals)
        assert got[:su.n_moving] == [None] * su.n_moving  # MOVED: a miss, not an error
        assert got[su.n_moving:] == su.vals[su.n_moving:]  # other keys unaffected
        s = t.stats
        assert s["moved"] - before["moved"] == su.n_moving
        assert s["errors"] == before["errors"] and s["timeouts"] == 0 and s["up"]
        # bounded wait for the background refresh; every answer meanwhile is right or a miss
        answers: list[list] = []
        assert wait_until(lambda: answers.append(t.get_many(su.keys)) or answers[-1] == su.vals,
                          timeout=5)
        assert all(never_wrong(a, su.vals) for a in answers)
        # routed to the new owner: each node runs exactly the GETs for the keys it owns now,
        # in one batch per node
        owners = [cluster.node_for_key(make_key(prefix, k)) for k in su.keys]
        clients = [n.client() for n in cluster.nodes]
        rt0, gets0 = t.stats["round_trips"], [cmd_calls(c, "getrange") for c in clients]
        assert t.get_many(su.keys) == su.vals
        gets = [cmd_calls(c, "getrange") - g0 for c, g0 in zip(clients, gets0, strict=True)]
        assert gets == [sum(1 for o in owners if o is n) for n in cluster.nodes]
        assert gets[cluster.nodes.index(su.dst)] >= su.n_moving
        assert t.stats["round_trips"] - rt0 == sum(1 for g in gets if g)
        assert t.exists_many(su.keys) == [True] * len(su.keys)
        assert t.stats["errors"] == before["errors"]


def test_cluster_ask_during_migration_is_a_counted_miss_then_found(own_cluster):
    """A slot half-way through a migration: keys still on the old owner are served, keys that
    already moved get -ASK, which the tier does not follow: a counted miss, never an error or a
    wrong value. Writes to the slot are dropped or land, never raise. Once the migration
    finishes (MOVED, refresh) every key is found on the new owner."""
    cluster = own_cluster
    prefix = b"ask:"
    cfg = Cfg(urls=cluster.urls, cluster=True, key_prefix="ask:",
              deadline_ms=ROUTING_DEADLINE_MS)
    with RemoteTier(cfg) as t, RemoteTier(cfg, raise_errors=True) as strict:
        assert t.wait_ready() and strict.wait_ready()
        su = write_slot_setup(t, cluster, prefix)
        cluster.begin_migration(su.slot, su.src, su.dst)
        half = [make_key(prefix, k) for k in su.moving[:2]]
        cluster.migrate_keys(su.src, su.dst, half)
        before = t.stats
        for _ in range(3):                                 # repeated calls: each a clean miss
            got = t.get_many(su.keys)
            assert never_wrong(got, su.vals)
            assert got[:2] == [None, None]                 # -ASK: on the importing node now
            assert got[2:] == su.vals[2:]                  # still on src, or another slot
            assert t.exists_many(su.keys) == [False, False] + [True] * (len(su.keys) - 2)
        s = t.stats
        assert s["moved"] - before["moved"] == 3 * 2 * 2   # 3 rounds x (get + exists) x 2 keys
        assert s["errors"] == before["errors"] and s["up"]
        # even a tier that raises on failures treats a redirect as a miss, not as an outage
        assert never_wrong(strict.get_many(su.keys), su.vals)
        # a write into the migrating slot: the moved keys are refused with ASK (not written),
        # the rest lands; nothing raises
        new = [framed(3000, seed=100 + i) for i in range(su.n_moving)]
        written = t.put_many(pairs(su.moving, new))
        assert written == stored(new[2:])
        su.vals[2:su.n_moving] = new[2:]
        cluster.migrate_keys(su.src, su.dst, [make_key(prefix, k) for k in su.moving[2:]])
        cluster.finish_migration(su.slot, su.dst)
        answers: list[list] = []
        assert wait_until(lambda: answers.append(t.get_many(su.keys)) or answers[-1] == su.vals,
                          timeout=5)
        assert all(never_wrong(a, su.vals) for a in answers)
        assert t.stats["errors"] == before["errors"]


# ---------------------------------------------------------------------------------- daemons


def test_two_daemons_share_a_prefix_and_survive_redis_outage(redis_cluster, tmp_path):
    """Daemon A stores (write-through to the cluster); daemon B, with its own empty local tiers,
    loads the same prefix bit-exact. Then the whole cluster goes away: B still answers lookups
    from its local copy within the deadline, keeps serving, and uses Redis again once it is back.
    """
    import kvstore_client
    import torch

    from tests.daemon import cleanup, start_daemon

    # The routing deadline: a write-through that a loaded machine makes miss 200 ms is
    # dropped, and B could never find that block (deadlines are pinned by the tests above).
    remote = {"remote.enabled": True, "remote.urls": ",".join(redis_cluster.urls),
              "remote.cluster": True, "remote.key_prefix": "dmn:",
              "remote.deadline_ms": ROUTING_DEADLINE_MS}
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=16)
    a = start_daemon(tmp_path / "a", {**remote, "remote.write_through": True})
    b = None
    try:
        b = start_daemon(tmp_path / "b", {**remote, "ssd.enabled": False})
        # 60 s client deadlines: B's first load promotes from Redis while the fresh daemon
        # still loads its codec kernels, which a starved machine stretches past 10 s.
        na = kvstore_client.connect(a.address, timeout=60).namespace(layout, model="shared-model")
        nb = kvstore_client.connect(b.address, timeout=60).namespace(layout, model="shared-model")
        toks = list(range(16 * 6))
        kv = torch.randn(2, 2, 96, 2, 64).to(torch.bfloat16)
        assert na.store(toks, kv) == 6
        assert nb.lookup(toks) == 96                      # B found it in Redis
        out = torch.zeros_like(kv)
        assert nb.load(toks, out) == 96 and torch.equal(out, kv)

        more = toks + list(range(1000, 1032))             # 2 more blocks only A would know
        redis_cluster.stop()
        try:
            t0 = time.monotonic()
            assert nb.lookup(more) == 96                  # local prefix, remote part a miss
            assert_bounded(t0, ROUTING_DEADLINE_MS / 1000 + 1.0)   # and an RPC to the daemon
            out2 = torch.zeros_like(kv)
            assert nb.load(toks, out2) == 96 and torch.equal(out2, kv)   # still serving
            assert b.alive()
        finally:
            redis_cluster.start()
        kv2 = torch.randn(2, 2, 128, 2, 64).to(torch.bfloat16)
        kv2[:, :, :96] = kv
        assert wait_until(lambda: na.store(more, kv2) == 2 or nb.lookup(more) == 128, 20)
        assert wait_until(lambda: nb.lookup(more) == 128, 20)   # B reconnected by itself
    finally:
        for d in (a, b):
            if d is not None:
                cleanup(d)
