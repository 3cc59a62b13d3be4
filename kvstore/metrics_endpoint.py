"""The metrics endpoint: HTTP/1.x for Prometheus, with bounds on what a connection may hold.

Why a server of its own (MetricsServer) and not prometheus_client's start_http_server: that one
starts a thread per connection and waits for a request for ever, so any local user (the endpoint
has no authentication) could hold a thread and a descriptor per idle or slow connection until
the daemon ran out of descriptors and refused its engines too. This one serves every
connection from one thread (a selector) and builds replies on a second, keeps at most
METRICS_MAX_CONNECTIONS open and METRICS_MAX_PER_PEER from one peer (a new one takes the place
of that peer's oldest, or of the oldest of the peer holding the most: whoever holds
connections only pushes out its own, and a scrape gets in at once), gives each an absolute
deadline to send its request, another for its reply to be built and another to take it, and
buffers at most METRICS_MAX_REQUEST bytes of request; the reply is prometheus_client's own WSGI
app's, byte for byte. The figures it serves are metrics.py's.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import email.utils
import logging
import os
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

from .peer_names import PeerNames

log = logging.getLogger("kvstore.metrics")

# The endpoint's bounds (MetricsServer): connections open at once, and from one peer (a uid
# on this host, else an address: peer_names.py); seconds a connection has to send its whole
# request (from its accept), for its reply to be built (from then) and to take the whole
# reply (from when it is ready: the write deadline, twice); the longest request (line and
# headers) read.
METRICS_MAX_CONNECTIONS = 64
METRICS_MAX_PER_PEER = 4
METRICS_READ_DEADLINE_S = 5.0
METRICS_WRITE_DEADLINE_S = 10.0
METRICS_MAX_REQUEST = 8192

_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
            b"Connection: close\r\n\r\n")
_TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Length: 0\r\n"
              b"Connection: close\r\n\r\n")
READING, BUILDING, WRITING = "reading", "building", "writing"


@dataclasses.dataclass(eq=False)
class _Conn:
    """One connection of the endpoint, from its accept to its close."""

    sock: socket.socket
    peer: str                       # whose share it counts in (peer_key)
    accepted: float                 # monotonic
    deadline: float                 # of the phase it is in
    state: str = READING
    buf: bytearray = dataclasses.field(default_factory=bytearray)
    out: memoryview | None = None   # the reply's bytes not yet sent
    dropped: bool = False           # closed by the loop: the builder skips it


class MetricsServer:
    """HTTP/1.x for the metrics endpoint, one request per connection, with bounds (module
    docstring).

    Why one thread reads and writes every connection (a selector) instead of a thread each:
    a connection that sends nothing then costs a descriptor, not a thread, and the endpoint
    can let many wait without running out of anything. Why a new connection is never refused
    for room but takes the place of the oldest connection of the peer holding the most (its
    own peer first, at that peer's cap): whoever holds connections open, idle or dribbling a
    byte at a time, only ever pushes out its own, and a scrape from anyone else gets in at
    once instead of waiting for a deadline. Peers are told apart by uid where the peer's end is
    a socket of this host (the kernel's sock_diag says whose: every local user reaches
    loopback, from any of 127/8's addresses), else by address (an IPv6 peer by its /64).
    Replies are built one at a time on a second thread, so neither a slow collection nor a
    flood of requests holds up accepting or the deadlines.
    """

    def __init__(self, host: str, port: int, app: Callable[..., Any],
                 max_connections: int = METRICS_MAX_CONNECTIONS,
                 read_deadline_s: float = METRICS_READ_DEADLINE_S,
                 write_deadline_s: float = METRICS_WRITE_DEADLINE_S,
                 max_request: int = METRICS_MAX_REQUEST,
                 max_per_peer: int = METRICS_MAX_PER_PEER) -> None:
        self._app = app
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self.read_deadline_s = read_deadline_s
        self.write_deadline_s = write_deadline_s
        self.max_request = max_request
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, sockaddr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
            sock.listen(64)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self.server_port = sock.getsockname()[1]
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._lock = threading.Lock()
        self._conns: list[_Conn] = []                # oldest first; the loop's own
        self._built: list[_Conn] = []                # replies ready (under _lock)
        self._requests: queue.SimpleQueue[_Conn | None] = queue.SimpleQueue()
        self._closing = False
        self._peers = PeerNames()
        self._builder = threading.Thread(target=self._build_loop, name="kvstore-metrics-reply",
                                         daemon=True)
        self._builder.start()
        self._thread = threading.Thread(target=self._loop, name="kvstore-metrics", daemon=True)
        self._thread.start()

    @property
    def connections(self) -> int:
        """Connections open now."""
        return len(self._conns)

    def close(self) -> None:
        """Stop accepting and close every connection; returns within a few seconds (a reply
        being built finishes on its own thread, and is dropped).

        Why the loop closes the listening socket and the pipe's read end itself, and the
        write end is closed under the lock: a descriptor closed while another thread may
        still use it can be reused at once by anything the daemon opens (a file, an engine's
        connection), which would then get that thread's bytes."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._wake_locked()
        self._requests.put(None)
        self._thread.join(5.0)
        if self._thread.is_alive():
            log.warning("metrics endpoint: its loop did not stop within 5 s")
        with self._lock:
            os.close(self._wake_w)
            self._wake_w = -1

    def _wake_locked(self) -> None:
        """Wake the loop (under _lock, so never after close() closed the pipe)."""
        if self._wake_w < 0:
            return
        try:
            os.write(self._wake_w, b"x")
        except OSError:                 # full: the loop wakes anyway
            pass

    # -- the loop -----------------------------------------------------------------------------
    def _loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._closing:
                now = time.monotonic()
                for c in [c for c in self._conns if c.deadline <= now]:
                    self._drop(sel, c)
                soonest = min((c.deadline for c in self._conns), default=now + 1.0)
                # New connections last: a request already here is read (and so no longer
                # evictable) before the connections that arrived with it are admitted.
                ready = sorted(sel.select(max(0.0, soonest - now)),
                               key=lambda kv: kv[0].fileobj is self._sock)
                for key, _ in ready:
                    if key.fileobj is self._wake_r:
                        self._take_built(sel)
                    elif key.fileobj is self._sock:
                        self._accept_all(sel)
                    elif key.data in self._conns:
                        self._step(sel, key.data)
        except Exception:               # noqa: BLE001 - said once; the endpoint is then shut
            log.exception("metrics endpoint: its loop failed; scrapes are refused from now on")
        finally:
            for c in self._conns:
                c.dropped = True
                c.sock.close()
            self._conns.clear()
            sel.close()
            self._peers.close()
            self._sock.close()
            os.close(self._wake_r)

    def _take_built(self, sel: selectors.BaseSelector) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        with self._lock:
            built, self._built = self._built, []
        for c in built:
            if c in self._conns:
                c.state, c.deadline = WRITING, time.monotonic() + self.write_deadline_s
                sel.register(c.sock, selectors.EVENT_WRITE, c)

    def _accept_all(self, sel: selectors.BaseSelector) -> None:
        """Accept what is waiting, at most max_connections a round: a peer connecting as fast
        as it can must not keep the loop from deadlines and replies."""
        for _ in range(self.max_connections):
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as e:        # out of descriptors: let the peers' closes catch up
                log.warning("metrics endpoint cannot accept a connection: %s", e)
                time.sleep(0.1)
                return
            try:
                sock.setblocking(False)
                peer = self._peers.key(sock)
            except OSError:             # gone already
                sock.close()
                continue
            self._admit(sel, sock, peer)

    def _admit(self, sel: selectors.BaseSelector, sock: socket.socket, peer: str) -> None:
        """Make room by the class docstring's rule, then serve `sock`; refused (503) only when
        every candidate's reply is being built."""
        mine = [c for c in self._conns if c.peer == peer]
        if len(mine) >= self.max_per_peer or len(self._conns) >= self.max_connections:
            if len(mine) >= self.max_per_peer:
                victim = _oldest(mine)
            else:               # the peers holding the most first; ties: the oldest first
                counts = collections.Counter(c.peer for c in self._conns)
                ranked = sorted(self._conns, key=lambda c: -counts[c.peer])   # stable
                victim = _oldest(ranked)
            if victim is None:
                _refuse(sock)
                return
            self._drop(sel, victim)
        now = time.monotonic()
        c = _Conn(sock, peer, now, now + self.read_deadline_s)
        self._conns.append(c)
        sel.register(sock, selectors.EVENT_READ, c)
        self._step(sel, c)      # a request already here is taken before the next accept

    def _drop(self, sel: selectors.BaseSelector, c: _Conn) -> None:
        """Close `c` in any state. One being built is safe to close: the builder never
        touches a socket, skips a dropped request, and its reply is then thrown away."""
        c.dropped = True
        self._conns.remove(c)
        try:
            sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.sock.close()

    def _step(self, sel: selectors.BaseSelector, c: _Conn) -> None:
        """Read what a connection sent, or send it what it can take of its reply."""
        try:
            if c.state == WRITING:
                assert c.out is not None
                c.out = c.out[c.sock.send(c.out):]
                if not c.out:
                    with contextlib.suppress(OSError):
                        c.sock.shutdown(socket.SHUT_WR)
                    self._drop(sel, c)
                return
            data = c.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:                 # the peer went away
            self._drop(sel, c)
            return
        if not data:
            self._drop(sel, c)
            return
        c.buf += data
        end = _head_end(c.buf)
        if end < 0 and len(c.buf) <= self.max_request:
            return
        sel.unregister(c.sock)
        if end < 0:                     # too long: told so, then closed, the rest unread
            c.out, c.state = memoryview(_TOO_LARGE), WRITING
            c.deadline = time.monotonic() + 1.0
            sel.register(c.sock, selectors.EVENT_WRITE, c)
            return
        c.buf = c.buf[:end]
        # Why a deadline while queued too: a collection that hangs (the store's lock held)
        # must not hold descriptors for ever. A peer that closes meanwhile is not noticed
        # (unregistered: its end may be only half-closed, still waiting for the reply);
        # sending the reply then fails and drops it.
        c.state, c.deadline = BUILDING, time.monotonic() + self.write_deadline_s
        self._requests.put(c)

    # -- replies ------------------------------------------------------------------------------
    def _build_loop(self) -> None:
        while (c := self._requests.get()) is not None and not self._closing:
            if c.dropped:               # cut at its deadline, or evicted, while queued
                continue
            try:
                reply = self._reply(bytes(c.buf))
            except Exception:           # noqa: BLE001 - one bad request must not end the thread
                log.exception("metrics endpoint: serving a request failed")
                reply = _response("500 Internal Server Error", [], b"")
            c.out = memoryview(reply)
            with self._lock:
                if self._closing:
                    return
                self._built.append(c)
                self._wake_locked()

    def _reply(self, head: bytes) -> bytes:
        """The whole HTTP reply to one request, from prometheus_client's WSGI app."""
        lines = head.decode("latin-1").split("\n")
        words = lines[0].strip().split()
        if len(words) != 3 or not words[2].startswith("HTTP/"):
            return _response("400 Bad Request", [], b"")
        method, target, _ = words
        path, _, query = target.partition("?")
        if "://" in path:               # absolute form: http://host/path
            path = "/" + path.split("://", 1)[1].partition("/")[2]
        environ: dict[str, Any] = {"REQUEST_METHOD": method, "PATH_INFO": unquote(path),
                                   "QUERY_STRING": query, "SERVER_PROTOCOL": "HTTP/1.1"}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                key = "HTTP_" + name.strip().upper().replace("-", "_")
                environ[key] = value.strip()
        started: list[Any] = []

        def start_response(status: str, headers: list[tuple[str, str]], _exc: Any = None
                           ) -> None:
            started[:] = [status, headers]

        try:
            body = b"".join(self._app(environ, start_response))
        except Exception:  # noqa: BLE001 - a failed collection is a 500, as under wsgiref
            if not self._closing:       # (at a stop the store may be gone: no alarm)
                log.exception("metrics endpoint: building the reply failed")
            return _response("500 Internal Server Error", [], b"")
        status, headers = started
        return _response(status, headers, body)


def _head_end(buf: bytearray) -> int:
    """Where the request's headers end (before the empty line), or -1."""
    ends = [i for i in (buf.find(b"\r\n\r\n"), buf.find(b"\n\n")) if i >= 0]
    return min(ends) if ends else -1


def _response(status: str, headers: list[tuple[str, str]], body: bytes) -> bytes:
    lines = [f"HTTP/1.1 {status}", f"Date: {email.utils.formatdate(usegmt=True)}",
             "Server: kvstore"]
    lines += [f"{k}: {v}" for k, v in headers]
    lines += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1") + body


def _refuse(conn: socket.socket) -> None:
    """No room: a 503 if the socket takes it at once, then closed."""
    try:
        conn.setblocking(False)
        conn.send(_REFUSED)
    except OSError:
        pass
    conn.close()


def _oldest(conns: list[_Conn]) -> _Conn | None:
    """The one accepted first of `conns` (in accept order) whose reply is not being built."""
    return next((c for c in conns if c.state != BUILDING), None)
