"""The SDK's side of the fast lane (why and wire format: lane_wire.py).

A small pool of connections: a call takes an idle one (or opens one), so threads never wait on
each other's calls. A connection whose daemon went away is found at the call's send (a Unix
socket reports a closed peer at once), before the request left: the call then goes over gRPC
instead and the pool is dropped. Once the request is out, a lost connection is an Unavailable
error (the daemon may or may not have served it), a late answer a DeadlineExceeded error, and
that connection is closed (an answer must never reach the wrong call). Every wait is bounded
by one deadline for the whole call, a new connection's hello included, not one per read.

A daemon that refuses a new connection (its tenant's lane connections are all in use, too many
connections wait to authenticate, a token it does not take) is asked again after a back-off
that doubles from RETRY_S to RETRY_MAX_S; calls go over gRPC meanwhile, which says the same
things per call where they apply.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import threading
import time

from .common.errors import from_code
from .common.lane_frames import Frames
from .common.lane_wire import CODES, HEADER, METHOD_ID, VERSION, recv_line

log = logging.getLogger(__name__)

MAX_IDLE = 8                  # idle connections kept per client
# An idle connection older than this is closed rather than used: the daemon closes its end
# after 300 s idle (kvstore/lane.py), and a request sent as it does so would be lost in flight.
IDLE_S = 60.0
RETRY_S = 1.0                 # after a refused hello: first back-off, doubled per refusal
RETRY_MAX_S = 60.0


class NotSent(Exception):
    """The request did not leave: the caller may send it another way."""


class LaneClient:
    def __init__(self, path: str, token: str, timeout: float) -> None:
        self.path = path
        self.token = token
        self.timeout = timeout
        self._idle: list[tuple[Frames, float]] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self.broken = False             # closed: the lane is not used again
        self._retry_at = 0.0            # refused: not asked again before this (monotonic)
        self._backoff = RETRY_S
        self.refusals = 0

    def call(self, method: str, raw: bytes, timeout: float) -> bytes:
        """The response bytes of `method`; errors as the SDK's exceptions; NotSent when the
        request could not be sent (no lane, or the daemon behind it is gone)."""
        deadline = time.monotonic() + timeout
        conn = self._take(deadline)
        try:
            conn.send(HEADER.pack(len(raw), METHOD_ID[method]) + raw, deadline)
        except OSError as e:
            conn.close()
            self.drop()
            raise NotSent(str(e)) from None
        try:
            left = deadline - time.monotonic()
            got = conn.read(left, left, deadline=deadline)
            assert got is not None      # no limit on an answer: it is always read
        except TimeoutError:
            conn.close()
            raise from_code("DEADLINE_EXCEEDED", f"{method} over the lane {self.path} did not "
                            f"finish within its deadline ({timeout:.3g} s)") from None
        except (EOFError, OSError) as e:
            conn.close()
            self.drop()
            raise from_code("UNAVAILABLE", f"{method}: the daemon at {self.path} closed the "
                            f"lane during the call ({e}); it may or may not have served it"
                            ) from None
        self._give(conn)
        code, body = got
        if code:
            name = CODES[code] if code < len(CODES) else "UNKNOWN"
            raise from_code(name, f"{method}: {body.decode(errors='replace')}")
        return body

    def _take(self, deadline: float) -> Frames:
        if self.broken:
            raise NotSent("lane closed")
        if self._retry_at and time.monotonic() < self._retry_at:
            raise NotSent("lane refused a connection a moment ago")
        with self._lock:
            if self._pid != os.getpid():         # a forked child: the parent's sockets
                self._idle, self._pid = [], os.getpid()
            now = time.monotonic()
            while self._idle:
                conn, since = self._idle.pop()
                if now - since < IDLE_S:
                    return conn
                conn.close()
        return self._open(deadline)

    def _give(self, conn: Frames) -> None:
        with self._lock:
            if len(self._idle) < MAX_IDLE and self._pid == os.getpid():
                self._idle.append((conn, time.monotonic()))
                return
        conn.close()

    def _open(self, deadline: float) -> Frames:
        """A new connection, its hello answered by the call's deadline (`deadline`), and
        within the client's timeout: a stopped daemon's kernel still accepts the connection,
        so only the deadline ends the wait, and the call must keep what the hello did not use
        for its other way (gRPC) rather than lose a whole timeout to it."""
        now = time.monotonic()
        end = min(now + self.timeout, deadline)
        cut = end < now + self.timeout     # the call's deadline, not the daemon, may end it
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            _left(sock, end)
            sock.connect(self.path)
            _left(sock, end)
            sock.sendall((json.dumps({"v": VERSION, "token": self.token}) + "\n").encode())
            reply = json.loads(recv_line(sock, deadline=end))
        except (OSError, EOFError, ValueError) as e:
            sock.close()
            if cut and isinstance(e, TimeoutError):
                # A short call ran out of time, which says nothing of the daemon: no back-off.
                raise NotSent(f"the lane {self.path} did not answer its hello within the "
                              f"call's deadline") from None
            self._refused(f"cannot open the lane {self.path}: {e}")
            raise NotSent(f"cannot open the lane {self.path}: {e}") from None
        if not isinstance(reply, dict) or reply.get("ok") is not True:
            sock.close()
            self._refused(f"lane {self.path} refused: {reply}")
            raise NotSent(f"lane refused: {reply}")
        self._backoff, self._retry_at = RETRY_S, 0.0
        return Frames(sock)     # blocking from here: one read an answer (lane_frames.py)

    def renew(self, token: str) -> None:
        """A new session token (the client made a fresh handshake): new connections say it,
        the ones opened with the old are dropped, and a refusal's back-off is over."""
        self.token = token
        self._backoff, self._retry_at = RETRY_S, 0.0
        self.drop()

    def _refused(self, why: str) -> None:
        """Go over gRPC for a while, then ask the lane again (module docstring)."""
        self.refusals += 1
        self._retry_at = time.monotonic() + self._backoff
        log.info("kvstore: %s; calls go over gRPC, the lane is tried again in %.0f s", why,
                 self._backoff)
        self._backoff = min(self._backoff * 2, RETRY_MAX_S)

    def drop(self) -> None:
        """Close the idle connections (the daemon behind them went away)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            conn.close()

    def close(self) -> None:
        self.broken = True
        self.drop()


def _left(sock: socket.socket, end: float) -> None:
    """Give the next blocking step only what is left before `end` (one deadline for the
    whole hello, not one per step)."""
    left = end - time.monotonic()
    if left <= 0:
        raise TimeoutError("no time left for the lane hello")
    sock.settimeout(left)


def available(path: str) -> bool:
    """Whether a daemon's lane socket is there (a daemon before the lane has none)."""
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False
