"""The Unix-socket handshake: prove who you are by your uid (or a token), get a session and,
where your tenant has one, your own host pool as a file descriptor.

Why a socket of its own next to the gRPC one: gRPC does not tell a Python servicer the peer's
credentials, and it cannot carry file descriptors. This socket (`<server.socket>.auth`) does
both with plain kernel mechanisms: SO_PEERCRED gives the connecting process's uid, which the
kernel vouches for, and SCM_RIGHTS hands over a memfd, which no other process can open by any
name (docs/security.md). The session token it returns is then the caller's bearer token on the
gRPC socket.

Protocol, one exchange per connection, under one deadline from the connect
(limits.hello_deadline_s; kvstore/unix_listener.py reads the request of every connection at
once, so a silent one holds nothing but its own socket):
  client -> daemon   one JSON line: {"v": 1, "token": "<bearer token or empty>"}
  daemon -> client   one JSON line: {"tenant": ..., "session": ..., "pool_size": N or 0,
                     "gpu_pools": [{"device": D, "size": N}, ...]}
                     with fds attached (SCM_RIGHTS): the host pool's first when pool_size > 0,
                     then one per gpu_pools entry (the tenant's own CPU-device slabs),
                     or {"error": "UNAUTHENTICATED" (or another status name), "message": ...}
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Callable

from .auth import Auth
from .tenants import Tenant
from .unix_listener import Caps, UnixListener, refuse

log = logging.getLogger("kvstore.handoff")

SUFFIX = ".auth"
REPLY_SEND_S = 1.0    # the reply (one short line and its fds) fits the socket's buffer

PoolFor = Callable[[Tenant], tuple[int, int] | None]   # tenant -> (fd, size) of its own pool
GpuFor = Callable[[str], list[tuple[int, int, int]]]   # tenant -> [(device, fd, size)]
MAX_FDS = 17          # the host pool and up to 16 devices' slabs


class Handoff:
    """The handshake listener: one short exchange per connection, answered on the listener's
    thread once the request line is in (identifying a caller is a few dict lookups)."""

    def __init__(self, path: str, auth: Auth, pool_for: PoolFor | None = None,
                 mode: int = 0o666, gpu_for: GpuFor | None = None,
                 caps: Caps | None = None) -> None:
        self.path = path
        self.auth = auth
        self.pool_for = pool_for
        self.gpu_for = gpu_for
        self._listener = UnixListener(path, mode, self._handle, "kvstore-handoff", caps)

    def _handle(self, conn: socket.socket, uid: int, line: bytes) -> None:
        with conn:
            try:
                conn.settimeout(REPLY_SEND_S)
                self._serve(conn, uid, line)
            except Exception as exc:   # one bad peer must not end the listener
                log.warning("handshake failed: %s", exc)

    def _serve(self, conn: socket.socket, uid: int, line: bytes) -> None:
        try:
            req = json.loads(line)
            token = req.get("token") or ""
            if not isinstance(token, str):
                raise ValueError("token must be a string")
        except (ValueError, AttributeError) as exc:
            refuse(conn, "INVALID_ARGUMENT", f"handshake request is not a JSON object: {exc}")
            return
        tenant = self.auth.by_token(token) if token else self.auth.by_uid(uid)
        if tenant is None:
            why = ("the token matches no tenant" if token else
                   f"no tenant lists uid {uid} in `uids` and no token was given")
            refuse(conn, "UNAUTHENTICATED", why)
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

    @property
    def refused(self) -> int:
        return self._listener.refused

    def close(self) -> None:
        self._listener.close()
