"""The Unix-socket handshake: prove who you are by your uid (or a token), get a session and,
where your tenant has one, your own host pool as a file descriptor.

Why a socket of its own next to the gRPC one: gRPC does not tell a Python servicer the peer's
credentials, and it cannot carry file descriptors. This socket (`<server.socket>.auth`) does
both with plain kernel mechanisms: SO_PEERCRED gives the connecting process's uid, which the
kernel vouches for, and SCM_RIGHTS hands over a memfd, which no other process can open by any
name (docs/security.md). The session token it returns is then the caller's bearer token on the
gRPC socket.

Protocol, one exchange per connection, every step under a deadline:
  client -> daemon   one JSON line: {"v": 1, "token": "<bearer token or empty>"}
  daemon -> client   one JSON line: {"tenant": ..., "session": ..., "pool_size": N or 0,
                     "gpu_pools": [{"device": D, "size": N}, ...]}
                     with fds attached (SCM_RIGHTS): the host pool's first when pool_size > 0,
                     then one per gpu_pools entry (the tenant's own CPU-device slabs),
                     or {"error": "UNAUTHENTICATED", "message": ...}
"""

from __future__ import annotations

import json
import logging
import socket
import struct
from collections.abc import Callable

from .auth import Auth
from .tenants import Tenant
from .unix_listener import UnixListener

log = logging.getLogger("kvstore.handoff")

SUFFIX = ".auth"
MAX_REQUEST = 8192
DEADLINE_S = 5.0
_UCRED = struct.Struct("3i")      # pid, uid, gid

PoolFor = Callable[[Tenant], tuple[int, int] | None]   # tenant -> (fd, size) of its own pool
GpuFor = Callable[[str], list[tuple[int, int, int]]]   # tenant -> [(device, fd, size)]
MAX_FDS = 17          # the host pool and up to 16 devices' slabs


def peer_uid(conn: socket.socket) -> int:
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return _UCRED.unpack(raw)[1]


class Handoff:
    """The handshake listener: one thread, one short exchange per connection."""

    def __init__(self, path: str, auth: Auth, pool_for: PoolFor | None = None,
                 mode: int = 0o666, gpu_for: GpuFor | None = None) -> None:
        self.path = path
        self.auth = auth
        self.pool_for = pool_for
        self.gpu_for = gpu_for
        self._listener = UnixListener(path, mode, self._handle, "kvstore-handoff")

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(DEADLINE_S)
                self._serve(conn)
            except Exception as exc:   # one bad peer must not end the listener
                log.warning("handshake failed: %s", exc)

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        while not buf.endswith(b"\n") and len(buf) <= MAX_REQUEST:
            chunk = conn.recv(MAX_REQUEST)
            if not chunk:
                return
            buf += chunk
        try:
            req = json.loads(buf)
            token = req.get("token") or ""
            if not isinstance(token, str):
                raise ValueError("token must be a string")
        except (ValueError, AttributeError) as exc:
            self._send(conn, {"error": "INVALID_ARGUMENT",
                              "message": f"handshake request is not a JSON object: {exc}"})
            return
        uid = peer_uid(conn)
        tenant = self.auth.by_token(token) if token else self.auth.by_uid(uid)
        if tenant is None:
            why = ("the token matches no tenant" if token else
                   f"no tenant lists uid {uid} in `uids` and no token was given")
            self._send(conn, {"error": "UNAUTHENTICATED", "message": why})
            return
        pool = self.pool_for(tenant) if self.pool_for is not None else None
        gpu = (self.gpu_for(tenant.name) if self.gpu_for is not None else [])[:MAX_FDS - 1]
        reply = {"tenant": tenant.name, "session": self.auth.new_session(tenant),
                 "pool_size": pool[1] if pool else 0,
                 "gpu_pools": [{"device": d, "size": n} for d, _, n in gpu]}
        self._send(conn, reply, ([pool[0]] if pool else []) + [fd for _, fd, _ in gpu])

    @staticmethod
    def _send(conn: socket.socket, reply: dict, fds: list[int] | None = None) -> None:
        data = (json.dumps(reply) + "\n").encode()
        if not fds:
            conn.sendall(data)
        else:
            socket.send_fds(conn, [data], fds)

    def close(self) -> None:
        self._listener.close()
