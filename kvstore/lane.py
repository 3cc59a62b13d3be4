"""The daemon's fast lane: the hot unary calls over a plain Unix socket (wire format and why:
kvstore_client/common/lane_wire.py).

Each connection is authenticated once, at its hello, exactly as a gRPC call is (a tenant's
bearer or session token; without tenants the socket's file mode is the guard, as for the gRPC
socket), and then served by a thread of its own: a client thread waits on its own call only,
and the servicer methods run unchanged (KVStoreServicer.lane_call: the same checks, metrics and
errors as over gRPC). Connections are bounded (MAX_CONNECTIONS, the rest are refused with a
line saying so, and the SDK stays on gRPC) and an idle one is closed after IDLE_S.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from typing import Any

from kvstore_client.common.lane_wire import (
    CODE_ID,
    HEADER,
    MAX_FRAME,
    METHODS,
    VERSION,
    recv_exact,
    recv_line,
)

from .unix_listener import UnixListener

log = logging.getLogger("kvstore.lane")

MAX_CONNECTIONS = 256
HELLO_DEADLINE_S = 5.0
IDLE_S = 300.0                # an idle connection is closed (the SDK drops its own sooner)
CLOSE_WAIT_S = 5.0            # at stop: how long calls being served may take to finish


class Lane:
    """The listener and its connection threads."""

    def __init__(self, path: str, servicer: Any, mode: int = 0o600) -> None:
        self.path = path
        self.servicer = servicer
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._listener = UnixListener(path, mode, self._accept, "kvstore-lane")
        self._stop = self._listener.stopping

    def _accept(self, conn: socket.socket) -> None:
        with self._lock:
            full = len(self._conns) >= MAX_CONNECTIONS
            if not full:
                self._conns.add(conn)
        if full:
            _refuse(conn, "RESOURCE_EXHAUSTED",
                    f"the daemon serves at most {MAX_CONNECTIONS} lane connections")
            return
        t = threading.Thread(target=self._serve, args=(conn,), name="kvstore-lane-conn",
                             daemon=True)
        with self._lock:
            self._threads.add(t)
        t.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            tenant = self._hello(conn)
            if tenant is False:
                return
            conn.settimeout(IDLE_S)
            while not self._stop.is_set():
                try:
                    n, method = HEADER.unpack(recv_exact(conn, HEADER.size))
                except (EOFError, TimeoutError, OSError):
                    return
                if n > MAX_FRAME or method >= len(METHODS):
                    return                # not our protocol: drop the connection
                raw = recv_exact(conn, n)
                code, body = self.servicer.lane_call(METHODS[method], raw, tenant)
                if self._stop.is_set():
                    return                # stopping: this answer would race the teardown
                conn.sendall(HEADER.pack(len(body), CODE_ID.get(code, CODE_ID["INTERNAL"]))
                             + body)
        except (EOFError, OSError):
            return
        except Exception as exc:          # one bad peer must not end the daemon
            log.warning("lane connection failed: %s", exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())
            conn.close()

    def _hello(self, conn: socket.socket) -> Any:
        """The connection's tenant (None: no tenants), or False after refusing it."""
        conn.settimeout(HELLO_DEADLINE_S)
        try:
            req = json.loads(recv_line(conn))
            token = req.get("token") or ""
            if req.get("v") != VERSION or not isinstance(token, str):
                raise ValueError(f"expected {{'v': {VERSION}, 'token': str}}")
        except (ValueError, AttributeError) as exc:
            _refuse(conn, "INVALID_ARGUMENT", f"lane hello is not valid: {exc}")
            return False
        auth = self.servicer.auth
        tenant = None
        if auth.enabled:
            tenant = auth.by_bearer(token) if token else None
            if tenant is None:
                _refuse(conn, "UNAUTHENTICATED", "the lane needs the bearer or session token "
                        "the gRPC calls carry; none given or it matches no tenant")
                return False
        conn.sendall(b'{"ok": true}\n')
        return tenant

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


def _refuse(conn: socket.socket, code: str, message: str) -> None:
    try:
        conn.sendall((json.dumps({"error": code, "message": message}) + "\n").encode())
    except OSError:
        pass
    conn.close()
