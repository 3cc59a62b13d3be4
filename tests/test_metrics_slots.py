"""The metrics endpoint's connections cannot be held against Prometheus.

Before, it served 16 connections at once and refused the next: 16 idle connections (or 16
requests dribbled a byte at a time) from any local user made every scrape a 503 until their
5 s deadline, and a peer that opened new ones as the old were cut kept Prometheus out for as
long as it liked. Now a peer (a uid on this host, else an address) keeps at most
METRICS_MAX_PER_PEER connections, a new connection takes the place of the oldest one of its
own peer (or of the peer holding the most), and each is still closed at its absolute read
deadline. Real sockets against a real daemon.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from kvstore import metrics_endpoint
from kvstore.peer_names import PeerNames
from tests.daemon import Daemon, cleanup, start_daemon
from tests.test_metrics_endpoint import _fds, _port

READ_DEADLINE_S = metrics_endpoint.METRICS_READ_DEADLINE_S
PER_PEER = metrics_endpoint.METRICS_MAX_PER_PEER
NOBODY = 65534
SCRAPE_DEADLINE_S = 5.0         # each scrape's own: no retry, it must succeed at its first try


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon(tmp_path_factory.mktemp("slots"))
    try:
        yield d
    finally:
        cleanup(d)


def _scrape(d: Daemon) -> str:
    with urllib.request.urlopen(d.metrics_url, timeout=SCRAPE_DEADLINE_S) as r:
        return r.read().decode()


def _closed(s: socket.socket) -> bool:
    """Whether the server closed `s` (EOF, reset, or a refusal it answered), not waiting."""
    try:
        r, _, _ = select.select([s], [], [], 0)
        return bool(r) and not s.recv(4096, socket.MSG_PEEK)
    except OSError:
        return True


@dataclass
class Holder:
    """Keeps `n` connections open to the endpoint, idle or sending a request a byte at a time,
    opening a new one whenever one is closed; records how long each lived."""

    port: int
    n: int
    dribble: bool = False
    source: str = "127.0.0.1"       # "spread": a different 127/8 address for each connection
    lived: list[float] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def connect(self, i: int) -> socket.socket:
        s = socket.socket()
        s.bind((f"127.0.{1 + i // 250}.{2 + i % 250}" if self.source == "spread"
                else self.source, 0))
        s.settimeout(5)
        s.connect(("127.0.0.1", self.port))
        if self.dribble:
            s.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
        return s

    def run(self) -> None:
        held: list[tuple[float, socket.socket]] = []
        opened = 0
        try:
            while not self.stop.is_set():
                while len(held) < self.n:
                    held.append((time.monotonic(), self.connect(opened)))
                    opened += 1
                for t, s in list(held):
                    if _closed(s):
                        self.lived.append(time.monotonic() - t)
                        s.close()
                        held.remove((t, s))
                    elif self.dribble:
                        try:
                            s.send(b"x")
                        except OSError:
                            pass
                self.stop.wait(0.05)
        finally:
            for _, s in held:
                s.close()


def _hold_as(uid: int, port: int, n: int, dribble: bool, ready, stop, lived) -> None:
    """In a forked child: become `uid` (its sockets are then that user's), hold n connections
    until `stop`, then put how many were cut and how long the longest-lived one lived on
    `lived`."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    h = Holder(port, n, dribble=dribble)
    t = threading.Thread(target=h.run)
    t.start()
    ready.set()
    stop.wait(120)
    h.stop.set()
    t.join(10)
    lived.put((len(h.lived), max(h.lived, default=0.0)))


def _scrape_within(d: Daemon, deadline_s: float) -> str:
    """Scrape until one succeeds, by an absolute deadline (for scrapes that share their peer
    with a holder: see test_one_peer_keeps_only_its_share)."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            return _scrape(d)
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.1)


@pytest.mark.skipif(os.geteuid() != 0, reason="holding connections as another uid needs root")
@pytest.mark.parametrize(("dribble", "n"), [(False, 64), (True, 16)], ids=["idle", "dribbling"])
def test_another_user_cannot_push_out_scrapes(daemon, dribble, n):
    """User nobody holds n connections, idle or sending a request a byte at a time, and
    re-opens each one cut at once: it keeps only its own share, every scrape (ours, uid 0)
    succeeds at its first try, the daemon holds at most that share of descriptors, and every
    one of nobody's connections is closed by its read deadline."""
    pid = daemon.proc.pid
    _scrape(daemon)
    time.sleep(1.0)                 # the after-ready warm-ups' threads come and go
    fds0 = _fds(pid)
    ctx = multiprocessing.get_context("fork")
    ready, stop, lived = ctx.Event(), ctx.Event(), ctx.SimpleQueue()
    child = ctx.Process(target=_hold_as,
                        args=(NOBODY, _port(daemon), n, dribble, ready, stop, lived))
    child.start()
    try:
        assert ready.wait(30)
        time.sleep(0.5)
        for _ in range(10):
            assert "kvstore_rpcs_total" in _scrape(daemon)
            assert _fds(pid) <= fds0 + PER_PEER + 2, (fds0, _fds(pid))
            time.sleep(0.2)
        end = time.monotonic() + READ_DEADLINE_S + 3    # outlive one deadline
        while time.monotonic() < end:
            assert _fds(pid) <= fds0 + PER_PEER + 2, (fds0, _fds(pid))
            time.sleep(0.2)
    finally:
        stop.set()
        child.join(30)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    cut, longest = lived.get()
    assert cut > 0 and longest <= READ_DEADLINE_S + 1.5, (cut, longest)


def test_one_peer_keeps_only_its_share(daemon):
    """16 connections (the old cap) of this very uid, re-opened as they are cut: the daemon
    holds at most one peer's share of descriptors, each is closed by its read deadline, and a
    scrape gets through. (Of the same uid, a scrape races the holder: a connection is pushed
    out by its own peer's newer ones, so here it may need another try; across uids, above,
    it never does.)"""
    pid = daemon.proc.pid
    _scrape(daemon)
    time.sleep(1.0)
    fds0 = _fds(pid)
    h = Holder(_port(daemon), 16)
    t = threading.Thread(target=h.run)
    t.start()
    try:
        time.sleep(0.5)
        assert "kvstore_rpcs_total" in _scrape_within(daemon, 10.0)
        end = time.monotonic() + READ_DEADLINE_S + 3    # outlive one deadline
        while time.monotonic() < end:
            assert _fds(pid) <= fds0 + PER_PEER + 2, (fds0, _fds(pid))
            time.sleep(0.2)
    finally:
        h.stop.set()
        t.join(10)
    assert h.lived and max(h.lived) <= READ_DEADLINE_S + 1.5, sorted(h.lived)[-5:]


def test_many_loopback_addresses_are_one_peer(daemon):
    """Connections of one local user from 40 different 127/8 addresses count as one peer
    (its uid), not as 40."""
    pid = daemon.proc.pid
    _scrape(daemon)
    time.sleep(1.0)
    fds0 = _fds(pid)
    h = Holder(_port(daemon), 40, source="spread")
    t = threading.Thread(target=h.run)
    t.start()
    try:
        time.sleep(1.0)
        assert _fds(pid) <= fds0 + PER_PEER + 2, (fds0, _fds(pid))
        assert "kvstore_rpcs_total" in _scrape_within(daemon, 10.0)
    finally:
        h.stop.set()
        t.join(10)

def _connect_as(uid: int, port: int, ready, stop) -> None:
    """In a forked child: become `uid`, connect to `port` and keep the connection until
    `stop`."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    ready.set()
    stop.wait(60)
    s.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="connecting as another uid needs root")
def test_local_peers_are_told_apart_by_their_uid():
    """The kernel's sock_diag record of the peer's own socket names its owner: a connection
    of user nobody is "uid 65534", one of ours "uid 0" (this checks the request's and the
    reply's layout, and that the record asked for is the peer's end, not ours)."""
    lst = socket.create_server(("127.0.0.1", 0))
    lst.settimeout(10)
    port = lst.getsockname()[1]
    names = PeerNames()
    ctx = multiprocessing.get_context("fork")
    ready, stop = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_connect_as, args=(NOBODY, port, ready, stop))
    child.start()
    try:
        assert ready.wait(30)
        theirs, _ = lst.accept()
        with theirs:
            assert names.key(theirs) == f"uid {NOBODY}"
        with socket.create_connection(("127.0.0.1", port), timeout=5) as mine:
            ours, _ = lst.accept()
            with ours:
                assert names.key(ours) == f"uid {os.geteuid()}"
            assert mine
    finally:
        stop.set()
        child.join(30)
        if child.is_alive():
            child.kill()
        names.close()
        lst.close()


def test_close_gives_back_every_descriptor():
    """A server that served, held and queued connections closes all of its descriptors (the
    listening socket, the wake pipe, sock_diag's, every connection) by the time close()
    returns, and its port is free."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import make_wsgi_app

    fds0 = _fds(os.getpid())
    srv = metrics_endpoint.MetricsServer("127.0.0.1", 0, make_wsgi_app(CollectorRegistry()))
    port = srv.server_port
    held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(6)]
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert r.status == 200
        srv.close()
        assert _fds(os.getpid()) == fds0 + len(held), (fds0, _fds(os.getpid()))
    finally:
        for s in held:
            s.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2)
