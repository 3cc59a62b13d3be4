"""A Unix-socket listener beside the gRPC socket (the handshake's and the fast lane's).

Why one module: both bind with the gRPC socket's file mode from the first instant (a umask
around bind, not a chmod after it that leaves a window with the default mode), replace a file
a dead daemon left (the daemon has checked the gRPC socket is free), accept on a thread of
their own that polls a stop flag, and remove their file when they close.

Why the first line is read here, on one thread for all connections: until a connection has
sent its first line (the handshake request, the lane hello) nobody knows who it is, and with
tenants the sockets are mode 0666, open to every local user. A connection served inline
blocked every other until it spoke; one thread per connection let a peer that never speaks
hold a thread each. So a selector reads every not-yet-authenticated connection at once, each
under one deadline from its connect (not per read), into a buffer that grows only as bytes
arrive (at most `max_line`), and the count of such connections is capped per peer uid (the
kernel's SO_PEERCRED, known at accept, before any byte) and in all: a user who opens hundreds
and stays silent fills only its own share, and is refused past it. Only a complete line goes
to `on_line`, which authenticates it and owns the connection from then on.

Why an answered connection may come back (`hold`): a reply that carries file descriptors
(SCM_RIGHTS) leaves them "in flight" until the peer reads it, and Linux charges in-flight fds
to the SENDING user, the daemon's: past its RLIMIT_NOFILE of them every later fd-carrying send
fails (ETOOMANYREFS) unless the daemon has CAP_SYS_RESOURCE/CAP_SYS_ADMIN. Closing our end frees
nothing (the fds sit in the peer's receive queue until it reads them or closes its socket), so
the daemon cannot take a reply back and a deadline could only blind its count. What bounds the
charge is counting, per owner (a tenant) and in fds, the connections whose reply the peer has
not consumed yet, for as long as that lasts, so the owner is refused past its cap instead of
spending the daemon-wide allowance. "Consumed" is SIOCOUTQ == 0 on our end: the kernel's count
of the bytes we sent that are still queued, which drops to 0 when the peer has read them (the
fds go with the bytes) or closed its socket (the kernel frees its queue), but not when it only
shuts down (its queue stays).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import selectors
import socket
import struct
import termios
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("kvstore.unix_listener")

ACCEPT_POLL_S = 0.5           # how often the loop looks at its stop flag
MAX_LINE = 8192               # the longest first line (a JSON object with a token)
REFUSE_SEND_S = 0.2           # a refusal line is sent with this timeout, then the socket closed
HELD_POLL_S = 0.25            # how often held connections are checked for a reply read (no event)
_UCRED = struct.Struct("3i")  # pid, uid, gid

OnLine = Callable[[socket.socket, int, bytes], None]


def listen_unix(path: str, mode: int, backlog: int = 128) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if os.path.exists(path):
            os.unlink(path)
        old = os.umask(0o777 & ~mode)
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        os.chmod(path, mode)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def peer_uid(conn: socket.socket) -> int:
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return _UCRED.unpack(raw)[1]


def unread_bytes(conn: socket.socket) -> int:
    """What we sent on `conn` that the peer has not consumed (SIOCOUTQ, Linux's TIOCOUTQ
    number); 0 also once the peer has closed, and for a socket the kernel cannot ask."""
    try:
        raw = fcntl.ioctl(conn.fileno(), termios.TIOCOUTQ, b"\0" * 4)
    except (OSError, ValueError):
        return 0
    return struct.unpack("i", raw)[0]


def _uncount(counts: dict, key: object) -> None:
    """One fewer for `key`, dropped at zero (the per-uid and per-owner counts stay small)."""
    n = counts[key] - 1
    if n:
        counts[key] = n
    else:
        del counts[key]


def refuse(conn: socket.socket, code: str, message: str) -> None:
    """One error line ({"error": CODE, "message": ...}, both protocols' form), then close."""
    try:
        conn.settimeout(REFUSE_SEND_S)
        conn.sendall((json.dumps({"error": code, "message": message}) + "\n").encode())
    except OSError:
        pass
    conn.close()


@dataclass
class Caps:
    """Limits on connections that have not sent their first line yet (limits.* config)."""
    deadline_s: float = 5.0
    per_uid: int = 16
    total: int = 1024
    max_line: int = MAX_LINE


@dataclass
class _Pending:
    conn: socket.socket
    uid: int
    deadline: float
    buf: bytearray = field(default_factory=bytearray)


@dataclass
class _Held:
    conn: socket.socket
    owner: str
    fds: int
    watched: bool = True      # on the selector (until an event that did not free it)


class UnixListener:
    """Accepts on `path`, reads each connection's first line (module docstring) and hands
    (connection, peer uid, line) to `on_line`, which owns the connection from then on, must
    not block for long (it runs on the listener's thread) and must not raise. `on_line` may
    give a connection whose reply carried fds back with `hold` (module docstring); `held` and
    `hold` are for `on_line` only, on the listener's thread, so nothing here takes a lock."""

    def __init__(self, path: str, mode: int, on_line: OnLine, name: str,
                 caps: Caps | None = None) -> None:
        self.path = path
        self.caps = caps or Caps()
        self.stopping = threading.Event()
        self.refused = 0                        # connections refused or timed out unheard
        self._on_line = on_line
        self._sock = listen_unix(path, mode)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ, None)
        # In accept order, which is deadline order (one allowance for all).
        self._pending: OrderedDict[int, _Pending] = OrderedDict()
        self._by_uid: dict[int, int] = {}
        self._held: dict[int, _Held] = {}
        self._held_by: dict[str, int] = {}
        self.held_fds = 0                       # fds sent on held connections, still unread
        self._next_sweep = 0.0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _loop(self) -> None:
        try:
            while not self.stopping.is_set():
                timeout = ACCEPT_POLL_S
                if self._pending:
                    first = next(iter(self._pending.values()))
                    timeout = max(0.0, min(timeout, first.deadline - time.monotonic()))
                if self._held:
                    timeout = max(0.0, min(timeout, self._next_sweep - time.monotonic()))
                for key, _ in self._sel.select(timeout):
                    if key.data is None:
                        self._accept()
                    elif isinstance(key.data, _Held):
                        self._held_event(key.data)
                    else:
                        self._read(key.data)
                self._expire()
                if self._held and time.monotonic() >= self._next_sweep:
                    self._sweep()
        except Exception:  # noqa: BLE001 - the listener must outlive any one peer
            if not self.stopping.is_set():
                log.exception("%s listener failed", self.path)
        finally:
            for p in list(self._pending.values()):
                self._drop(p)
                p.conn.close()
            for h in list(self._held.values()):
                self._release(h)

    def _accept(self) -> None:
        for _ in range(64):                      # a burst, then back to the others
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:                 # EMFILE and friends: not this loop's end
                if self.stopping.is_set():
                    return
                log.warning("%s: accept failed: %s", self.path, e)
                return
            try:
                uid = peer_uid(conn)
            except OSError:
                conn.close()
                continue
            c = self.caps
            mine = self._by_uid.get(uid, 0)
            if mine >= c.per_uid or len(self._pending) >= c.total:
                self.refused += 1
                why = (f"uid {uid} already has {mine} connections that have not authenticated "
                       f"(limits.pending_per_uid = {c.per_uid})" if mine >= c.per_uid else
                       f"{len(self._pending)} connections have not authenticated "
                       f"(limits.pending_total = {c.total})")
                refuse(conn, "RESOURCE_EXHAUSTED", why + "; retry in a moment")
                continue
            conn.setblocking(False)
            p = _Pending(conn, uid, time.monotonic() + c.deadline_s)
            self._pending[id(p)] = p
            self._by_uid[uid] = mine + 1
            self._sel.register(conn, selectors.EVENT_READ, p)

    def _drop(self, p: _Pending) -> None:
        """Stop tracking `p` (the caller closes or hands over its connection)."""
        if self._pending.pop(id(p), None) is None:
            return
        _uncount(self._by_uid, p.uid)
        try:
            self._sel.unregister(p.conn)
        except (KeyError, ValueError):
            pass

    def _read(self, p: _Pending) -> None:
        room = self.caps.max_line - len(p.buf)
        try:
            chunk = p.conn.recv(min(4096, room + 1))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(p)
            p.conn.close()
            return
        p.buf += chunk
        end = p.buf.find(b"\n")
        if end < 0:
            if len(p.buf) > self.caps.max_line:
                self._drop(p)
                self.refused += 1
                refuse(p.conn, "INVALID_ARGUMENT",
                       f"the first line is longer than {self.caps.max_line} bytes")
            return
        self._drop(p)
        if end + 1 != len(p.buf):
            refuse(p.conn, "INVALID_ARGUMENT", "bytes after the first line, before its answer")
            return
        p.conn.setblocking(True)
        try:
            self._on_line(p.conn, p.uid, bytes(p.buf))
        except Exception:  # noqa: BLE001 - one bad peer must not end the listener
            log.exception("%s: serving a connection failed", self.path)
            p.conn.close()

    def _expire(self) -> None:
        now = time.monotonic()
        while self._pending:
            p = next(iter(self._pending.values()))
            if p.deadline > now:
                return
            self._drop(p)
            self.refused += 1
            refuse(p.conn, "DEADLINE_EXCEEDED",
                   f"no complete first line within {self.caps.deadline_s:g} s of connecting "
                   "(limits.hello_deadline_s)")

    # -- answered connections whose reply carried fds (module docstring) ----------------------
    def hold(self, conn: socket.socket, owner: str, fds: int) -> None:
        """Keep `conn`, on which `fds` fds were sent (or may have been: a send that failed part
        way), counted against `owner` until the peer has consumed the reply."""
        if unread_bytes(conn) == 0:
            conn.close()
            return
        conn.setblocking(False)
        if not self._held:
            self._next_sweep = time.monotonic() + HELD_POLL_S
        h = _Held(conn, owner, fds)
        self._held[id(h)] = h
        self._held_by[owner] = self._held_by.get(owner, 0) + 1
        self.held_fds += fds
        self._sel.register(conn, selectors.EVENT_READ, h)

    def held(self, owner: str) -> int:
        """How many of `owner`'s replies are unread now. Its connections are looked at here,
        not left to the next sweep, so a refusal never counts a reply already read."""
        if self._held_by.get(owner):
            for h in [h for h in self._held.values() if h.owner == owner]:
                if unread_bytes(h.conn) == 0:
                    self._release(h)
        return self._held_by.get(owner, 0)

    def _held_event(self, h: _Held) -> None:
        """The peer closed, shut down its side or sent bytes it should not have. Only a close
        frees the fds, and the kernel empties the peer's queue just after waking us, so the
        sweep may be what sees it. The other two would wake the loop forever, so the connection
        leaves the selector and only the sweep watches it from then on."""
        if unread_bytes(h.conn) == 0:
            self._release(h)
            return
        h.watched = False
        try:
            self._sel.unregister(h.conn)
        except (KeyError, ValueError):
            pass

    def _sweep(self) -> None:
        """Release every held connection whose peer has read its reply or closed. Needed
        because a read does not wake the selector (our end stays as it was)."""
        for h in list(self._held.values()):
            if unread_bytes(h.conn) == 0:
                self._release(h)
        self._next_sweep = time.monotonic() + HELD_POLL_S

    def _release(self, h: _Held) -> None:
        if self._held.pop(id(h), None) is None:
            return
        _uncount(self._held_by, h.owner)
        self.held_fds -= h.fds
        if h.watched:
            try:
                self._sel.unregister(h.conn)
            except (KeyError, ValueError):
                pass
        h.conn.close()

    def close(self) -> None:
        """Stop accepting and remove the socket file (connections already handed out stay
        with their owner; held ones are closed, which frees nothing the peers have queued)."""
        self.stopping.set()
        self._thread.join(5)
        self._sock.close()
        self._sel.close()
        try:
            Path(self.path).unlink()
        except FileNotFoundError:
            pass
