"""The connections each bound events socket may hold: so many in all, so many from one peer.

Why: the PUB and replay sockets have no authentication, and libzmq accepts every connection
and keeps it (with a descriptor of the daemon's) for as long as the peer likes. One local user
(or any host, on an address beyond loopback) could open thousands, run the daemon out of
descriptors and so make it refuse its engines' gRPC calls too. The metrics endpoint solved the
same problem for HTTP (metrics_endpoint.MetricsServer); libzmq has no accept hook, so here a socket
monitor reports each accepted connection (EVENT_ACCEPTED, with its descriptor) to a thread of
our own, which names its peer and shuts it (shutdown(2): libzmq reads its end, drops it, closes
the descriptor) when the peer, or the endpoint, is over its cap.

A peer is whoever owns the connecting socket: "uid N" for a socket of this host (sock_diag
for TCP, peer_names.PeerNames; SO_PEERCRED for ipc://), else its address (an IPv6 one by its
/64).
Each endpoint keeps at most `max_per_peer` connections of one peer (its next ones are shut at
once: an established subscription keeps its stream, and a peer holding connections only ever
holds its own share), and `max_total` in all; a new peer past that takes the place of the
newest connection of the peer holding the most, when that peer holds more than it would.

Why this is exact although the descriptor number in an event may name another file by the
time it is read: every decision is made on a duplicate of the descriptor (os.dup), checked to
be a connection to this very endpoint (its local port or path) and identified by its socket
inode, which no other socket has while it is open. A connection is counted once per inode,
and counted as gone once its descriptor no longer names that inode (closed by libzmq, or
reused): the monitor's DISCONNECTED events only say when to look (SWEEP_S at most
otherwise), so a lost or late event costs nothing. Shutting an older connection goes through
a fresh duplicate, checked against its inode, so it can never hit another socket.

Why each kept TCP connection gets keepalives and a user timeout (KEEPALIVE_*, USER_TIMEOUT_S,
set on the same duplicate): a router host that vanishes (power, network) leaves its connection
half-open, counted against its address's share and holding a descriptor. Idle (a replay
socket), nothing would ever tell; streaming (the PUB socket), the kernel would retransmit for
about 15 minutes (tcp_retries2). Both happen below ZMTP, so no peer needs to know of them
(a ZMTP heartbeat could break peers of ZMTP 3.0). A router that is alive but stalled with its
receive window shut is dropped after USER_TIMEOUT_S as well; it reconnects when it runs again,
and what it missed meanwhile its PUB queue would have dropped anyway.

The monitor's pipe: libzmq's I/O thread waits when 1000 events are queued unread, so the
thread must never stall: it waits on nothing but the monitor sockets and sock_diag (a reply in
the same system call, 0.2 s at most).
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..peer_names import PeerNames

log = logging.getLogger("kvstore.events")

SWEEP_S = 0.25              # a closed connection is counted gone within this at most
LOG_EVERY_S = 10.0          # connections shut for a cap: one log line this often, with counts
_UCRED = struct.Struct("=iII")          # SO_PEERCRED: pid, uid, gid
KEEPALIVE_IDLE_S = 30       # a silent connection is probed after this long...
KEEPALIVE_INTVL_S = 10      # ...this often...
KEEPALIVE_CNT = 3           # ...and dropped after this many probes unanswered
USER_TIMEOUT_S = 60         # sent bytes unacknowledged this long (a window shut): dropped


@dataclass
class _Conn:
    fd: int                 # libzmq's descriptor of the connection (not ours: never closed)
    ino: tuple[int, int]    # (st_dev, st_ino) of its socket
    peer: str
    order: int              # accept order


@dataclass
class _Endpoint:
    name: str                       # "<stream> <key>" for the log
    sock: zmq.Socket                # the bound socket (its owner's; only disable_monitor here)
    mon: zmq.Socket                 # its monitor (this module's thread's)
    port: int | None                # TCP: the bound port
    path: str | bytes | None        # ipc: the bound path (abstract: b"\0name")
    conns: dict[int, _Conn] = field(default_factory=dict)      # by libzmq's descriptor
    shut: int = 0                   # connections shut for a cap, since the last log line

    def mine(self, s: socket.socket) -> bool:
        return _accepted_on(s, self.port, self.path)


def _accepted_on(s: socket.socket, port: int | None, path: str | bytes | None) -> bool:
    """Whether `s` is a connection accepted on the endpoint bound at `port` or `path` (not
    its listener, not a connection the daemon made, not another endpoint's)."""
    if s.type != socket.SOCK_STREAM or s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        return False
    local = s.getsockname()
    if s.family in (socket.AF_INET, socket.AF_INET6):
        return port is not None and local[1] == port and bool(s.getpeername())
    if s.family == socket.AF_UNIX:
        return path is not None and local == path
    return False


# One connection of a bound events socket, as libzmq's descriptor of it and the inode of its
# socket: what `cut` checks before it shuts anything (the number may name another file later).
ConnRef = tuple[int, tuple[int, int]]


def connection_of(fd: int, address: str) -> ConnRef | None:
    """The connection libzmq holds at `fd` (a message's ZMQ_SRCFD), if it is one accepted on
    the socket bound at `address`; None if the number names anything else by now."""
    port, path = _bound(address)
    s = _dup_socket(fd)
    if s is None:
        return None
    with s:
        try:
            if not _accepted_on(s, port, path):
                return None
        except OSError:
            return None
        ino = _inode(s.fileno())
    return None if ino is None else (fd, ino)


def cut(ref: ConnRef) -> bool:
    """Shut a connection (libzmq then drops it and what it queued for the peer), through a
    duplicate that still names its socket; False if it is gone already."""
    fd, ino = ref
    s = _dup_socket(fd)
    if s is None:
        return False
    with s:
        if _inode(s.fileno()) != ino:
            return False
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
    return True


def _bound(address: str) -> tuple[int | None, str | bytes | None]:
    """(port, path) of a bound socket's LAST_ENDPOINT."""
    if address.startswith("tcp://"):
        return int(address.rpartition(":")[2]), None
    if address.startswith("ipc://"):
        path = address[len("ipc://"):]
        return None, (b"\0" + path[1:].encode()) if path.startswith("@") else path
    return None, None


class Guard:
    """Caps the connections of the sockets given to `watch`, on a thread of its own."""

    def __init__(self, max_total: int, max_per_peer: int) -> None:
        self.max_total = max_total
        self.max_per_peer = max_per_peer
        self._eps: list[_Endpoint] = []
        self._peers = PeerNames()
        self._order = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._logged = 0.0
        # connections shut for a cap since the start; written by the guard's thread only, read
        # by the publisher's into the counter events_connections_shut
        self.shut_total = 0

    def watch(self, sock: zmq.Socket, address: str, name: str) -> None:
        """Cap `sock`'s connections (bound to `address`, its LAST_ENDPOINT); on the thread
        that owns `sock`, before start()."""
        port, path = _bound(address)
        if port is None and path is None:
            return                      # inproc and the like: nothing to cap
        mon = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._eps.append(_Endpoint(name, sock, mon, port, path))

    def start(self) -> None:
        if self._thread is None and self._eps and not self._closed:
            self._thread = threading.Thread(target=self._run, name="kvstore-events-peers",
                                            daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop monitoring: on the thread that owns the watched sockets (the publisher's has
        ended by then), before they and the context are closed (the context waits for the
        monitor sockets). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for ep in self._eps:            # libzmq stops sending events first
            if not ep.sock.closed:
                try:
                    ep.sock.disable_monitor()
                except zmq.ZMQError:
                    pass
        self._stop.set()
        if self._thread is None:
            self._close_monitors()
            return
        self._thread.join(5.0)          # the thread closes its monitor sockets as it ends
        if self._thread.is_alive():
            log.warning("events: the connection guard did not stop within 5 s")

    def _close_monitors(self) -> None:
        for ep in self._eps:
            ep.mon.close(0)
        self._peers.close()

    # -- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        for ep in self._eps:
            poller.register(ep.mon, zmq.POLLIN)
        by_mon = {ep.mon: ep for ep in self._eps}
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(int(SWEEP_S * 1000)))
                for ep in self._eps:
                    try:
                        if ep.mon in ready:
                            self._events(by_mon[ep.mon])
                        self._sweep(ep)
                    except Exception:   # noqa: BLE001 - the monitor must go on being read
                        log.exception("events: checking %s's connections failed", ep.name)
                self._log()
        finally:
            self._close_monitors()

    def _events(self, ep: _Endpoint) -> None:
        """Read every event queued; then admit each accepted connection still there."""
        accepted: list[int] = []
        for _ in range(10000):
            try:
                ev = recv_monitor_message(ep.mon, zmq.NOBLOCK)
            except zmq.Again:
                break
            if ev["event"] == zmq.EVENT_ACCEPTED:
                accepted.append(int(ev["value"]))
        if accepted:
            self._sweep(ep)
        for fd in accepted:
            self._accepted(ep, fd)

    def _sweep(self, ep: _Endpoint) -> None:
        """Forget the connections whose descriptor no longer names their socket."""
        for fd, c in list(ep.conns.items()):
            if _inode(fd) != c.ino:
                del ep.conns[fd]

    def _accepted(self, ep: _Endpoint, fd: int) -> None:
        try:
            dup = os.dup(fd)
        except OSError:
            return                      # closed already
        try:
            s = socket.socket(fileno=dup)
        except OSError:                 # not a socket (the number names another file now)
            os.close(dup)
            return
        with s:
            try:
                if not ep.mine(s):
                    return
                ino = _inode(s.fileno())
                if ino is None or any(c.ino == ino for c in ep.conns.values()):
                    return              # counted already (under an earlier event)
                peer = self._peer(s)
            except OSError:             # gone meanwhile
                return
            mine = [c for c in ep.conns.values() if c.peer == peer]
            if len(mine) >= self.max_per_peer:
                self._shut(ep, s)
                return
            if len(ep.conns) >= self.max_total:
                counts = collections.Counter(c.peer for c in ep.conns.values())
                top, n = counts.most_common(1)[0]
                if n <= len(mine) + 1:
                    self._shut(ep, s)
                    return
                self._shut_held(ep, max((c for c in ep.conns.values() if c.peer == top),
                                        key=lambda c: c.order))
            _tune(s)
            ep.conns.pop(fd, None)      # (an earlier socket at that number is gone)
            self._order += 1
            ep.conns[fd] = _Conn(fd, ino, peer, self._order)

    def _peer(self, s: socket.socket) -> str:
        if s.family == socket.AF_UNIX:
            _, uid, _ = _UCRED.unpack(s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                   _UCRED.size))
            return f"uid {uid}"
        return self._peers.key(s)

    def _shut(self, ep: _Endpoint, s: socket.socket) -> None:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        ep.shut += 1
        self.shut_total += 1

    def _shut_held(self, ep: _Endpoint, c: _Conn) -> None:
        """Shut a counted connection, through a duplicate that names its socket still (else
        it is gone already, and its place free all the same)."""
        ep.conns.pop(c.fd, None)
        try:
            dup = os.dup(c.fd)
        except OSError:
            return
        try:
            s = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            return
        with s:
            if _inode(s.fileno()) == c.ino:
                self._shut(ep, s)

    def _log(self) -> None:
        now = time.monotonic()
        if now - self._logged < LOG_EVERY_S or not any(ep.shut for ep in self._eps):
            return
        self._logged = now
        for ep in self._eps:
            if ep.shut:
                log.warning("events: %s: shut %d connection(s) over events.max_connections "
                            "(%d) or events.max_connections_per_peer (%d); held now: %s",
                            ep.name, ep.shut, self.max_total, self.max_per_peer,
                            dict(collections.Counter(c.peer for c in ep.conns.values())))
                ep.shut = 0


def _tune(s: socket.socket) -> None:
    """Keepalives and a user timeout on a kept TCP connection (module docstring)."""
    if s.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTVL_S)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_CNT)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_S * 1000)
    except OSError:
        pass                            # gone meanwhile: nothing to tune


def _dup_socket(fd: int) -> socket.socket | None:
    """A socket object on a duplicate of `fd` (closing it leaves `fd` alone), or None: `fd`
    is closed, or names something other than a socket by now."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        return socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None


def _inode(fd: int) -> tuple[int, int] | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino
