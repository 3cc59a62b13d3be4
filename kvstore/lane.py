"""The daemon's fast lane: the hot unary calls over a plain Unix socket (wire format and why:
kvstore_client/common/lane_wire.py).

Each connection is authenticated once, at its hello, exactly as a gRPC call is (a tenant's
bearer or session token; without tenants the socket's file mode is the guard, as for the gRPC
socket), and then served by a thread of its own: a client thread waits on its own call only,
and the servicer methods run unchanged (KVStoreServicer.lane_call: the same checks, metrics and
errors as over gRPC).

What a peer can hold (docs/security.md, Limits): before its hello, only a socket on the
listener's one selector thread, under the hello deadline and the per-uid cap on connections
that have not authenticated (kvstore/unix_listener.py); after it, a thread, and each tenant
holds at most `limits.lane_per_tenant` of those (256 in all without tenants), so one tenant's
connections never take another's room. A refused client goes on over gRPC and tries the lane
again later. A frame longer than the largest valid request drops the connection unread, the
body is read into a buffer that grows as its bytes arrive, whole within
`limits.frame_deadline_s` of its first byte; an idle connection is closed after IDLE_S.

A tenant's refused lane calls spend from the same refusal budget as its gRPC calls
(kvstore/gate.py, RefusalBudget): without that, the lane was the way around it, 64
connections each sending requests the daemon must read and refuse as fast as it answers.
Past the budget a lane call is answered RESOURCE_EXHAUSTED unread, HOLD_S late, as the gate
answers a gRPC one; the wait holds only the tenant's own connection thread.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from typing import Any

import grpc
from kvstore_client.common.lane_frames import Frames
from kvstore_client.common.lane_wire import (
    CODE_ID,
    HEADER,
    MAX_FRAME,
    METHODS,
    VERSION,
)

from .gate import OPEN_BUDGET, RefusalBudget
from .refusal import HOLD_S
from .unix_listener import Caps, UnixListener, refuse

log = logging.getLogger("kvstore.lane")

MAX_CONNECTIONS = 256         # without tenants: authenticated connections in all
IDLE_S = 300.0                # an idle connection is closed (the SDK drops its own sooner)
FRAME_DEADLINE_S = 10.0       # a frame, whole, from its first byte (limits.frame_deadline_s)
CLOSE_WAIT_S = 5.0            # at stop: how long calls being served may take to finish
ANY = ""                      # the connection count's key without tenants


class Lane:
    """The listener and its connection threads."""

    def __init__(self, path: str, servicer: Any, mode: int = 0o600, caps: Caps | None = None,
                 per_tenant: int = 64, frame_deadline_s: float = FRAME_DEADLINE_S,
                 budget: RefusalBudget = OPEN_BUDGET) -> None:
        self.path = path
        self.servicer = servicer
        self.budget = budget
        self.per_tenant = per_tenant
        self.frame_deadline_s = frame_deadline_s
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._held: dict[str, int] = {}            # tenant name (ANY) -> connections
        self._lock = threading.Lock()
        self.refused = 0
        self._listener = UnixListener(path, mode, self._hello, "kvstore-lane", caps)
        self._stop = self._listener.stopping

    def _hello(self, conn: socket.socket, _uid: int, line: bytes) -> None:
        """The connection's first line is in: authenticate it, and serve it on a thread of
        its own if its tenant has room (on the listener's thread: no waiting here)."""
        try:
            req = json.loads(line)
            token = req.get("token") or ""
            if req.get("v") != VERSION or not isinstance(token, str):
                raise ValueError(f"expected {{'v': {VERSION}, 'token': str}}")
        except (ValueError, AttributeError) as exc:
            refuse(conn, "INVALID_ARGUMENT", f"lane hello is not valid: {exc}")
            return
        auth = self.servicer.auth
        tenant = None
        if auth.enabled:
            tenant = auth.by_bearer(token) if token else None
            if tenant is None:
                refuse(conn, "UNAUTHENTICATED", "the lane needs the bearer or session token "
                       "the gRPC calls carry; none given or it matches no tenant")
                return
        who = tenant.name if tenant is not None else ANY
        cap = self.per_tenant if tenant is not None else MAX_CONNECTIONS
        with self._lock:
            full = self._held.get(who, 0) >= cap
            if not full:
                self._held[who] = self._held.get(who, 0) + 1
                self._conns.add(conn)
        if full:
            self.refused += 1
            refuse(conn, "RESOURCE_EXHAUSTED",
                   (f"tenant {who} already holds {cap} lane connections "
                    "(limits.lane_per_tenant)" if tenant is not None else
                    f"the daemon serves at most {cap} lane connections")
                   + "; its calls go over gRPC meanwhile")
            return
        try:
            conn.settimeout(1.0)
            conn.sendall(b'{"ok": true}\n')
        except OSError:
            self._release(conn, who, None)
            conn.close()
            return
        t = threading.Thread(target=self._serve, args=(conn, tenant, who),
                             name="kvstore-lane-conn", daemon=True)
        with self._lock:
            self._threads.add(t)
        t.start()

    def _serve(self, conn: socket.socket, tenant: Any, who: str) -> None:
        frames = Frames(conn)       # one read a frame where its bytes allow (lane_frames.py)
        try:
            while not self._stop.is_set():
                try:            # IDLE_S between frames; a frame whole within the deadline
                    got = frames.read(IDLE_S, self.frame_deadline_s, MAX_FRAME, len(METHODS))
                except (EOFError, TimeoutError, OSError):
                    return
                if got is None:
                    return                # not a request of ours: drop the connection unread
                method, raw = got
                code, body = self._call(METHODS[method], raw, tenant)
                if self._stop.is_set():
                    return                # stopping: this answer would race the teardown
                frames.send(HEADER.pack(len(body), CODE_ID.get(code, CODE_ID["INTERNAL"]))
                            + body, time.monotonic() + self.frame_deadline_s)
        except (EOFError, OSError):
            return
        except Exception as exc:          # one bad peer must not end the daemon
            log.warning("lane connection failed: %s", exc)
        finally:
            self._release(conn, who, threading.current_thread())
            conn.close()

    def _call(self, method: str, raw: bytes, tenant: Any) -> tuple[str, bytes]:
        """One call, through the tenant's refusal budget (module docstring)."""
        if tenant is None:
            return self.servicer.lane_call(method, raw, None)
        if not self.budget.allows(tenant.name):
            self._stop.wait(HOLD_S)
            return "RESOURCE_EXHAUSTED", (
                f"tenant {tenant.name}'s calls were refused (invalid, unknown or not allowed) "
                "faster than its budget allows (limits.refusals_per_s); its calls are refused "
                f"for {self.budget.wait_s(tenant.name):.1f} s more").encode()
        code, body = self.servicer.lane_call(method, raw, tenant)
        self.budget.charge(tenant.name, getattr(grpc.StatusCode, code, None), len(raw))
        return code, body

    def _release(self, conn: socket.socket, who: str, thread: threading.Thread | None) -> None:
        with self._lock:
            if conn in self._conns:
                self._conns.discard(conn)
                self._held[who] -= 1
            if thread is not None:
                self._threads.discard(thread)

    def held(self, tenant: str = ANY) -> int:
        """Authenticated connections `tenant` holds now."""
        return self._held.get(tenant, 0)

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:                   # wakes their threads out of recv
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        # A call being served finishes before the store behind it closes (bounded).
        deadline = time.monotonic() + CLOSE_WAIT_S
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
