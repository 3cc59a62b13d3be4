"""Remote tier against hostile or broken Redis contents and settings (real redis-server, no mocks).

What is pinned here:
- a value longer than the caller's bound is never read whole: at most bound + 1 bytes cross the
  wire, it is a counted `corrupt`/`oversize` miss and it is deleted, also when the caller
  stopped waiting before the answer came;
- a read's deadline grows with the bytes the caller expects, and a bulk read that comes late
  does not mark an answering node down for every caller; a hung one still goes down;
- a node going down logs one WARNING naming the cause, never the password, and one INFO when
  it answers again; a node that keeps failing the same way does not repeat it;
- a URL redis-py cannot use is refused when the tier is built, standalone or cluster, naming
  `remote.urls` and the URL with its password masked; the daemon says so in one line;
- a non-string value (WRONGTYPE) or an empty one under a block key is a counted `corrupt` miss
  and is deleted; a missing key is a plain miss.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import redis
from kvstore_client.errors import InvalidArgument

from tests.daemon import DaemonError, cleanup, start_daemon
from tests.redis_fixtures import redis_server_fixture, start_redis  # noqa: F401 - fixture
from tests.test_remote_tier import Cfg, framed, gkeys, pairs, sealed, wait_until
from tiers import remote
from tiers.remote import RemoteTier, describe_error, make_key
from tiers.remote import tier as tier_module
from tiers.remote.envelope import SEAL_BYTES

pytestmark = pytest.mark.redis

PASSWORD = "Pw-faults-s3cret"
MiB = 1 << 20
SLACK = getattr(remote, "VALUE_SLACK_BYTES", 256)


def mask_url(url: str) -> str:
    return remote.mask_url(url)


@dataclass
class BoundCfg(Cfg):
    max_value_bytes: int | None = None
    max_workers: int = 8


@contextmanager
def worker_held(t: RemoteTier) -> Iterator[None]:
    """Keep the tier's only worker (max_workers=1) busy: the next batch waits in the queue, so
    its caller's deadline passes before it starts, however loaded the machine is. The batch
    runs once the block ends."""
    gate = threading.Event()
    t._pool.submit(gate.wait, 10)
    try:
        yield
    finally:
        gate.set()


def net_out(r: redis.Redis) -> int:
    """Bytes the server has sent to its clients so far (its own count)."""
    return int(r.info("stats")["total_net_output_bytes"])


# ----------------------------------------------------------------------------------


def test_value_over_the_bound_is_read_bounded_counted_and_deleted(redis_server):
    r = redis_server.client()
    with RemoteTier(Cfg(urls=[redis_server.url], deadline_ms=2000)) as t:
        keys = gkeys(3)
        good = framed(40_000, seed=1)
        edge = framed(64 * 1024 - 32 - SEAL_BYTES, seed=2)   # sealed: exactly the bound: served
        assert len(edge) + SEAL_BYTES == 64 * 1024
        t.put_many(pairs(keys[:2], [good, edge]))
        assert r.strlen(make_key(b"kvs:", keys[1])) == 64 * 1024
        big = make_key(b"kvs:", keys[2])
        # 8 MiB planted under a block key: a well-sealed, well-framed value, so the bound alone
        # is what refuses it
        r.set(big, sealed(keys[2], framed(8 * MiB - 32 - SEAL_BYTES, seed=3)))
        assert r.strlen(big) == 8 * MiB
        sent = net_out(r)
        got = t.get_many(keys, max_value_bytes=64 * 1024)
        # well under the planted 8 MiB crossed the wire: bound + 1 per key, and small replies
        assert net_out(r) - sent < 3 * 64 * 1024 + 4096
        assert got == [good, edge, None]
        s = t.stats
        assert (s["corrupt"], s["oversize"], s["wrong_type"], s["errors"]) == (1, 1, 0, 0), s
        assert s["hits"] == 2 and s["misses"] == 1 and s["up"]
        assert wait_until(lambda: r.exists(big) == 0)  # deleted in the background
        assert t.exists_many(keys) == [True, True, False]

    # the config's bound where the caller gives none, and a per-key bound
    with RemoteTier(BoundCfg(urls=[redis_server.url], deadline_ms=2000,
                             max_value_bytes=50_000)) as t:
        assert t.get_many(keys[:2]) == [good, None]
        assert t.stats["oversize"] == 1
        assert wait_until(lambda: r.exists(make_key(b"kvs:", keys[1])) == 0)
        # the bound is on the value Redis holds: the frame and its seal
        assert t.get_many(keys[:1], max_value_bytes=[len(good) + SEAL_BYTES - 1]) == [None]
        assert t.stats["oversize"] == 2
        assert wait_until(lambda: r.exists(make_key(b"kvs:", keys[0])) == 0)
        t.put_many(pairs(keys[:1], [good]))
        assert t.get_many(keys[:1], max_value_bytes=[len(good) + SEAL_BYTES]) == [good]


def test_oversize_value_is_deleted_even_when_the_caller_gave_up(redis_server):
    """The caller stops waiting (deadline) before the node's answer: the value is still found
    too long and deleted by the batch itself, so the next read does not pay for it again; the
    node, which answers a PING, is not marked down for everyone."""
    r = redis_server.client()
    with RemoteTier(BoundCfg(urls=[redis_server.url], max_workers=1)) as t:
        k = gkeys(1)
        big = make_key(b"kvs:", k[0])
        r.set(big, sealed(k[0], framed(4 * MiB - 32 - SEAL_BYTES)))   # sealed: only too long
        with worker_held(t):
            assert t.get_many(k, deadline_s=0.05, max_value_bytes=64 * 1024) == [None]
            assert t.stats["up"] and r.exists(big) == 1
        assert wait_until(lambda: r.exists(big) == 0)
        assert wait_until(lambda: t.stats["oversize"] == 1)
        assert wait_until(lambda: t.stats["slow"] == 1)  # the background PING answered
        assert t.stats["up"] and t.stats["timeouts"] == 1


# ----------------------------------------------------------------------------------


def test_read_deadline_follows_the_expected_bytes(redis_server, monkeypatch):
    """The bulk deadline is deadline_ms + bulk_ms_per_mib x the bytes the caller expects: 8 keys
    of up to 32 MiB get 256 MiB's allowance, not the 2 MiB a key assumed when nothing is said."""
    waits: list[float] = []
    real_wait = tier_module.wait_futures

    def spy(fs, timeout=None, **kw):
        waits.append(timeout)
        return real_wait(fs, timeout=timeout, **kw)

    monkeypatch.setattr(tier_module, "wait_futures", spy)
    with RemoteTier(Cfg(urls=[redis_server.url])) as t:
        keys = gkeys(8)
        t.put_many([(k, framed(1000)) for k in keys])
        waits.clear()
        t.get_many(keys)
        t.get_many(keys, max_value_bytes=32 * MiB + SLACK)
        t.get_many(keys, max_value_bytes=32 * MiB, expected_bytes=MiB)
        t.get_many(keys, deadline_s=0.7, max_value_bytes=32 * MiB)
    per_mib = t.bulk_s_per_mib
    assert waits == pytest.approx([
        t.deadline_s + per_mib * 8 * 2,
        t.deadline_s + per_mib * 8 * (32 + SLACK / MiB),
        t.deadline_s + per_mib * 1,
        0.7])


def test_a_late_existence_check_or_delete_does_not_mark_a_live_node_down(redis_server):
    """An existence check or a delete late behind a busy machine (here: the tier's one worker
    held) used to mark the node down for every caller at once; the node is PINGed first."""
    with RemoteTier(BoundCfg(urls=[redis_server.url], max_workers=1)) as t:
        keys = gkeys(4)
        t.put_many(pairs(keys, [framed(1000, seed=i) for i in range(4)]))
        with worker_held(t):
            assert t.exists_many(keys, deadline_s=0.05) == [False] * 4     # late: a miss
            assert t.stats["timeouts"] == 1
        assert wait_until(lambda: t.stats.get("slow") == 1)
        assert t.stats["up"] and t.exists_many(keys) == [True] * 4
        with worker_held(t):
            t.delete_many(keys[:1], deadline_s=0.05)
        assert wait_until(lambda: t.stats.get("slow") == 2)
        assert t.stats["up"] and t.stats["skipped_down"] == 0
        assert t.exists_many(keys) == [False, True, True, True]


def test_late_bulk_read_marks_down_only_a_node_that_stops_answering(redis_server):
    with RemoteTier(BoundCfg(urls=[redis_server.url], max_workers=1)) as t:
        keys = gkeys(4)
        vals = [framed(200_000, seed=i) for i in range(4)]
        t.put_many(pairs(keys, vals))
        # late for this caller only: the node answers a PING (sent from its own thread)
        with worker_held(t):
            assert t.get_many(keys, deadline_s=0.05) == [None] * 4
            assert t.stats["up"] and t.stats["timeouts"] == 1
        assert wait_until(lambda: t.stats.get("slow") == 1)
        assert t.stats["up"] and t.stats["skipped_down"] == 0
        assert t.get_many(keys) == vals
        # a hung server: the PING is late too, and the node goes down
        redis_server.pause()
        try:
            assert t.get_many(keys) == [None] * 4
            assert wait_until(lambda: not t.stats["up"], timeout=5)
            assert t.get_many(keys) == [None] * 4
            assert t.stats["skipped_down"] >= 1
        finally:
            redis_server.resume()
        assert wait_until(lambda: t.get_many(keys) == vals)


# ----------------------------------------------------------------------------------


def test_node_down_is_logged_once_with_its_cause_and_no_password(tmp_path, caplog):
    proc = start_redis(tmp_path, password=PASSWORD)
    try:
        wrong = f"redis://:{PASSWORD}-x@127.0.0.1:{proc.port}"
        # (a deadline a handshake on a loaded machine meets: the cause, not a timeout)
        cfg = Cfg(urls=[wrong], deadline_ms=2000, backoff_min_ms=10, backoff_max_ms=20)
        with caplog.at_level(logging.INFO, logger="kvstore.remote"):
            with RemoteTier(cfg) as t:
                keys = gkeys(2)
                end = time.monotonic() + 0.5          # calls and probes fail the same way
                while time.monotonic() < end or t.stats["probes"] < 3:
                    t.exists_many(keys)
                    time.sleep(0.02)
                s = t.stats
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings
        assert "authentication failed" in warnings[0] and "remote.username/password" in warnings[0]
        assert PASSWORD not in caplog.text and PASSWORD not in str(s)
        assert f"redis://:***@127.0.0.1:{proc.port}" in warnings[0]
        # a server that goes away and comes back: one WARNING, then one INFO
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kvstore.remote"):
            with RemoteTier(Cfg(urls=[proc.url], password=PASSWORD, backoff_min_ms=10,
                                backoff_max_ms=50)) as t:
                assert t.exists_many(gkeys(1)) == [False] and t.stats["up"]
                for _ in range(3):                    # flapping: told once
                    proc.kill()
                    for _ in range(3):
                        t.exists_many(gkeys(1))
                    assert not t.stats["up"]
                    proc.start()
                    assert wait_until(lambda: t.exists_many(gkeys(1)) == [False]
                                      and t.stats["up"])
                assert t.stats["reconnects"] == 3
        lines = [(r.levelname, r.getMessage()) for r in caplog.records]
        assert [lv for lv, _ in lines] == ["WARNING", "INFO"], lines
        assert "is down" in lines[0][1] and "answering again" in lines[1][1]
        assert PASSWORD not in caplog.text
    finally:
        proc.kill()


def test_error_texts_never_carry_the_password():
    err = redis.ConnectionError(f"Error connecting to redis://:{PASSWORD}@h:1 ({PASSWORD})")
    text = describe_error(err, secrets=[PASSWORD])
    assert PASSWORD not in text and "***" in text
    assert mask_url(f"redis://u:{PASSWORD}@h:6379/0") == "redis://u:***@h:6379/0"
    assert mask_url(f"redis://h:6379?password={PASSWORD}&db=1") == "redis://h:6379?password=***&db=1"
    assert PASSWORD not in mask_url(f"nonsense:{PASSWORD}@h")


# ----------------------------------------------------------------------------------

BAD_URLS = [f"redis://:{PASSWORD}@127.0.0.1:notaport", f"http://:{PASSWORD}@127.0.0.1:6379",
            "redis://127.0.0.1:99999"]


@pytest.mark.parametrize("cluster", [False, True])
@pytest.mark.parametrize("url", BAD_URLS)
def test_unusable_url_is_refused_at_construction(url, cluster):
    urls = [url] if not cluster else ["redis://127.0.0.1:7000", url]
    with pytest.raises(InvalidArgument, match=r"^remote\.urls: ") as e:
        RemoteTier(Cfg(urls=urls, cluster=cluster))
    assert PASSWORD not in str(e.value)
    assert mask_url(url) in str(e.value)


def test_cluster_seed_must_be_host_port():
    with pytest.raises(InvalidArgument, match=r"remote\.urls: .*unix"):
        RemoteTier(Cfg(urls=["unix:///tmp/r.sock"], cluster=True))


@pytest.mark.parametrize("cluster", [False, True])
def test_daemon_refuses_an_unusable_url_in_one_line(tmp_path, cluster):
    url = f"redis://:{PASSWORD}@127.0.0.1:notaport"
    settings = {"remote.enabled": True, "remote.urls": url, "remote.cluster": cluster,
                "server.metrics": ""}
    d = None
    try:
        d = start_daemon(tmp_path, settings)          # returns only if the daemon serves
    except DaemonError as e:
        text = str(e)
    else:
        pytest.fail("the daemon started with an unusable remote.urls")
    finally:
        if d is not None:
            cleanup(d)
    m = re.search(r"exited with code (\d+)", text)
    assert m and int(m.group(1)) == 2, text          # a setting refused: exit 2
    assert "Traceback" not in text and PASSWORD not in text, text
    named = [line for line in text.splitlines() if "remote.urls" in line]
    assert len(named) == 1, text
    assert named[0].startswith("kvstore: ") and "redis://:***@127.0.0.1:notaport" in named[0]


# ----------------------------------------------------------------------------------


def test_non_string_or_empty_value_is_a_counted_corrupt_miss_and_deleted(redis_server):
    r = redis_server.client()
    with RemoteTier(Cfg(urls=[redis_server.url])) as t:
        keys = gkeys(5)
        good = framed(5000)
        k = [make_key(b"kvs:", g) for g in keys]
        t.put_many([(keys[0], good)])
        r.hset(k[1], "f", "v")                         # WRONGTYPE under a block key
        r.rpush(k[2], "x")
        r.set(k[3], b"")                               # empty: not a frame
        # keys[4] is missing: a plain miss
        assert t.get_many(keys) == [good, None, None, None, None]
        s = t.stats
        assert (s["corrupt"], s.get("wrong_type"), s["errors"]) == (3, 2, 0), s
        assert s["hits"] == 1 and s["misses"] == 4 and s["up"]
        assert wait_until(lambda: r.exists(*k[1:4]) == 0)
        assert t.exists_many(keys) == [True, False, False, False, False]
        assert t.get_many(keys[1:]) == [None] * 4 and t.stats["corrupt"] == 3
