"""The metrics endpoint under idle, slow and oversized connections: it has no authentication, so
every local user reaches it, and it must never hold more than a few of the daemon's threads and
descriptors, nor any of them for long.

Also: what it answers is prometheus_client's own exposition, byte for byte.
"""

from __future__ import annotations

import gzip
import os
import select
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.exposition import generate_latest, make_wsgi_app

from kvstore import metrics_endpoint
from kvstore.metrics_endpoint import (
    METRICS_MAX_CONNECTIONS,
    METRICS_MAX_PER_PEER,
    METRICS_MAX_REQUEST,
    METRICS_READ_DEADLINE_S,
)
from tests.daemon import Daemon, cleanup, start_daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon(tmp_path_factory.mktemp("metrics"))
    try:
        yield d
    finally:
        cleanup(d)


def _port(d: Daemon) -> int:
    return int(d.metrics_url.rsplit(":", 1)[1].split("/")[0])


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _scrape(url: str, within_s: float) -> tuple[str, float]:
    """Scrape until one succeeds (a 503 or a reset: the endpoint is full); (body, seconds)."""
    t0 = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.read().decode(), time.monotonic() - t0
        except (urllib.error.URLError, OSError):
            if time.monotonic() - t0 > within_s:
                raise
            time.sleep(0.2)


def _closed_within(s: socket.socket, timeout: float) -> bool:
    """Whether the server closes `s` (EOF or reset) within `timeout`, reading what it sent."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        r, _, _ = select.select([s], [], [], max(0.0, end - time.monotonic()))
        if not r:
            continue
        try:
            if not s.recv(65536):
                return True
        except (ConnectionResetError, OSError):
            return True
    return False


def test_idle_connections_past_the_cap_hold_nothing(daemon):
    """Idle connections (sending nothing) from one peer (this uid) beyond its share,
    METRICS_MAX_PER_PEER, are closed at once (each new one takes the oldest one's place);
    those kept are cut at the read deadline; the daemon's descriptors and threads stay
    bounded throughout, gRPC is untouched, and a scrape succeeds at once."""
    pid, port = daemon.proc.pid, _port(daemon)
    _scrape(daemon.metrics_url, 10)
    time.sleep(1.0)              # the after-ready warm-ups' threads come and go
    fds0, threads0 = _fds(pid), _threads(pid)
    n = 3 * METRICS_MAX_CONNECTIONS
    held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(n)]
    cut_by = time.monotonic() + METRICS_READ_DEADLINE_S + 1.5   # the last ones' deadline
    try:
        time.sleep(0.5)
        assert _fds(pid) <= fds0 + METRICS_MAX_PER_PEER + 2, (fds0, _fds(pid))
        assert _threads(pid) <= threads0 + 2
        refused = sum(_closed_within(s, 0.05) for s in held)
        assert refused >= n - METRICS_MAX_PER_PEER, refused
        with daemon.channel() as ch:        # gRPC has descriptors to spare
            from grpc_health.v1 import health_pb2, health_pb2_grpc
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        with urllib.request.urlopen(daemon.metrics_url, timeout=5) as r:   # first try
            assert "kvstore_rpcs_total" in r.read().decode()
        assert all(_closed_within(s, max(0.05, cut_by - time.monotonic())) for s in held)
        assert _fds(pid) <= fds0 + 2
    finally:
        for s in held:
            s.close()


def test_slow_loris_is_cut_at_the_read_deadline(daemon):
    """A request trickled a byte at a time never completes: the connection is closed at the
    absolute read deadline however often bytes arrive."""
    s = socket.create_connection(("127.0.0.1", _port(daemon)), timeout=5)
    try:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        cut = None
        while time.monotonic() - t0 < METRICS_READ_DEADLINE_S + 5:
            try:
                s.sendall(b"X")
            except OSError:
                cut = time.monotonic() - t0
                break
            if _closed_within(s, 0.3):
                cut = time.monotonic() - t0
                break
        assert cut is not None, "the slow request was never cut"
        assert METRICS_READ_DEADLINE_S - 1 <= cut <= METRICS_READ_DEADLINE_S + 2, cut
    finally:
        s.close()


def test_an_oversized_request_is_refused_not_buffered(daemon):
    """Headers past METRICS_MAX_REQUEST without their end: a 431 and the connection closed,
    nothing more read."""
    s = socket.create_connection(("127.0.0.1", _port(daemon)), timeout=5)
    try:
        s.sendall(b"GET /metrics HTTP/1.1\r\n")
        junk = b"X-Junk: " + b"a" * 1000 + b"\r\n"
        try:
            for _ in range(4 * METRICS_MAX_REQUEST // len(junk)):
                s.sendall(junk)
        except OSError:
            pass                       # cut while still sending: as good
        s.settimeout(3.0)               # answered and closed at once, not at the deadline
        got = b""
        try:
            while chunk := s.recv(4096):
                got += chunk
        except TimeoutError:
            pytest.fail("an oversized request was still being read")
        except OSError:
            pass                        # reset: it closed with our bytes unread
        assert got == b"" or got.startswith(b"HTTP/1.1 431"), got[:80]
    finally:
        s.close()


def test_reply_is_prometheus_clients_exposition():
    """Same bytes as prometheus_client's generate_latest; gzip, OpenMetrics, name[] filters,
    OPTIONS and 405 as its WSGI app answers them."""
    reg = CollectorRegistry()
    Counter("kvs_test_things", "Things", ["kind"], registry=reg).labels("a").inc(3)
    Counter("kvs_test_other", "Other", registry=reg).inc()
    srv = metrics_endpoint.MetricsServer("127.0.0.1", 0, make_wsgi_app(reg))
    url = f"http://127.0.0.1:{srv.server_port}"
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            assert r.status == 200 and r.read() == generate_latest(reg)
            assert r.headers["Content-Type"].startswith("text/plain")
        req = urllib.request.Request(url + "/metrics", headers={"Accept-Encoding": "gzip"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.headers["Content-Encoding"] == "gzip"
            assert gzip.decompress(r.read()) == generate_latest(reg)
        req = urllib.request.Request(
            url + "/metrics", headers={"Accept": "application/openmetrics-text"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.headers["Content-Type"].startswith("application/openmetrics-text")
            assert r.read().endswith(b"# EOF\n")
        with urllib.request.urlopen(url + "/metrics?name[]=kvs_test_other_total",
                                    timeout=10) as r:
            body = r.read()
            assert b"kvs_test_other_total" in body and b"kvs_test_things" not in body
        req = urllib.request.Request(url + "/metrics", method="POST", data=b"")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 405
        with urllib.request.urlopen(urllib.request.Request(url, method="OPTIONS"),
                                    timeout=10) as r:
            assert r.headers["Allow"] == "OPTIONS,GET"
    finally:
        srv.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", srv.server_port), timeout=2)
