"""The remote tier across a slow network: a real redis-server (with a password) behind a proxy
that delays every byte by half a round trip, and a deadline between one round trip and two.

What is pinned here: a call on an open connection takes one round trip, so it hits; a new
connection's setup (AUTH, and redis-py's CLIENT SETINFO unless told not to) would push a call
past its deadline. So the tier must have its connections open before the calls come: the
first calls after a start, as many at once as it has workers, all hit and mark no node down,
and so do the first ones after an outage that dropped every connection.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis

from tests.redis_fixtures import start_redis
from tests.test_remote_tier import Cfg, gkeys, wait_until
from tiers.remote import RemoteTier, make_key

pytestmark = pytest.mark.redis

PASSWORD = "Pw-rtt-s3cret"
ONE_WAY_S = 0.05            # a 100 ms round trip
DEADLINE_MS = 190           # one round trip and room to spare; two do not fit
WORKERS = 8                 # the tier's threads, and so the connections it opens per node
CALLS = 4                   # calls at once: each needs a connection of its own


class DelayProxy:
    """TCP on loopback that forwards each chunk, in order, ONE_WAY_S after it arrived (each
    direction), as a far server's network would; in a process of its own, so its timing does
    not share the test's interpreter with the tier's threads. `drop_all` cuts every
    connection."""

    def __init__(self, upstream_port: int, one_way_s: float) -> None:
        ctx = multiprocessing.get_context("fork")
        self._drop, self._stop = ctx.Event(), ctx.Event()
        ours, theirs = ctx.Pipe()
        self._proc = ctx.Process(target=_proxy_main, daemon=True,
                                 args=(upstream_port, one_way_s, theirs, self._drop, self._stop))
        self._proc.start()
        assert ours.poll(10), "the delay proxy did not start"
        self.port = ours.recv()

    def drop_all(self) -> None:
        self._drop.set()
        end = time.monotonic() + 5
        while self._drop.is_set() and time.monotonic() < end:
            time.sleep(0.01)
        assert not self._drop.is_set(), "the delay proxy did not cut its connections"

    def close(self) -> None:
        self._stop.set()
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()


def _proxy_main(upstream_port: int, one_way_s: float, conn, drop, stop) -> None:
    asyncio.run(_proxy(upstream_port, one_way_s, conn, drop, stop))


async def _proxy(upstream_port: int, one_way_s: float, conn, drop, stop) -> None:
    loop = asyncio.get_running_loop()
    writers: set[asyncio.StreamWriter] = set()

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def send() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                await asyncio.sleep(max(0.0, due - loop.time()))
                w.write(data)
                await w.drain()
            w.close()

        sender = asyncio.create_task(send())
        try:
            while data := await r.read(65536):
                queue.put_nowait((loop.time() + one_way_s, data))
        finally:
            queue.put_nowait((0.0, b""))
            await sender

    async def serve(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", upstream_port)
        except OSError:
            cw.close()
            return
        writers.update((cw, uw))
        await asyncio.gather(pipe(cr, uw), pipe(ur, cw), return_exceptions=True)
        for w in (cw, uw):
            writers.discard(w)
            w.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    conn.send(server.sockets[0].getsockname()[1])
    while not stop.is_set():
        if drop.is_set():
            for w in list(writers):
                w.transport.abort()
            drop.clear()
        await asyncio.sleep(0.01)
    server.close()


@dataclass
class RttCfg(Cfg):
    max_workers: int = WORKERS


@pytest.fixture
def far(tmp_path) -> Iterator[tuple[redis.Redis, DelayProxy]]:
    proc = start_redis(tmp_path, password=PASSWORD)
    proxy = DelayProxy(proc.port, ONE_WAY_S)
    try:
        yield proc.client(), proxy
    finally:
        proxy.close()
        proc.stop()


def _all_at_once(t: RemoteTier, keysets: list[list[bytes]]) -> list[list[bool]]:
    """One exists_many per key set, each on its own thread, started together."""
    out: list[list[bool]] = [[] for _ in keysets]
    go = threading.Barrier(len(keysets))

    def one(i: int) -> None:
        go.wait(5)
        out[i] = t.exists_many(keysets[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(keysets))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    return out


def test_first_calls_after_a_start_and_after_an_outage_hit_at_a_far_server(far):
    r, proxy = far
    keysets = [gkeys(3) for _ in range(CALLS)]
    for keys in keysets:
        for g in keys:
            r.set(make_key(b"kvs:", g), b"x")
    cfg = RttCfg(urls=[f"redis://127.0.0.1:{proxy.port}"], password=PASSWORD,
                 deadline_ms=DEADLINE_MS, backoff_min_ms=50, backoff_max_ms=200)
    with RemoteTier(cfg) as t:
        assert t.wait_ready(10)
        # Calls at once: each needs a connection of its own.
        found = _all_at_once(t, keysets)
        s = t.stats
        assert found == [[True] * 3] * CALLS, (found, s)
        assert s["timeouts"] == 0 and s["up"], s

        # An outage that drops every connection: calls fail until a probe finds the node
        # answering again, which opens the connections anew before the calls need them.
        proxy.drop_all()
        assert wait_until(lambda: not any(t.exists_many(keysets[0])) and not t.up, 10), \
            t.stats
        # (a call to a down node past its back-off starts the probe)
        assert wait_until(lambda: t.exists_many(keysets[0][:1]) is not None and t.up, 10), \
            t.stats
        assert t.wait_ready(10)
        timeouts = t.stats["timeouts"]
        found = _all_at_once(t, keysets)
        s = t.stats
        assert found == [[True] * 3] * CALLS, (found, s)
        assert s["timeouts"] == timeouts and s["up"], s
