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

Why a connection whose reply carried fds is not closed and forgotten: until the peer reads
them, those fds are charged to the daemon's user, and past its RLIMIT_NOFILE of them the kernel
refuses every later fd-carrying reply, every tenant's (kvstore/unix_listener.py, `hold`). So the
listener keeps each such connection, counted against its tenant, until the peer has read the
reply or closed; a tenant with limits.pending_per_uid replies unread is refused
(RESOURCE_EXHAUSTED, no fd) until it reads or closes them, and all tenants together may leave at
most half the daemon's RLIMIT_NOFILE fds unread. There is no deadline on this: the kernel holds
the fds for the peer whatever the daemon does, so a slot frees only when the peer lets it go,
and the only tenant that waits for it is the one holding it.
"""

from __future__ import annotations

import json
import logging
import resource
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


def raise_nofile() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one and return the soft limit now in force.

    Why: the kernel compares the fds the daemon's user has in flight with this soft limit, and
    the usual default (1024) is low for a daemon that also holds its tier files and clients'
    connections, while the hard limit is what the operator allows. A complement to the caps
    (module docstring), not a replacement: a higher limit only makes an uncapped peer work
    harder. Here, not in the daemon's start, because only the handshake sends fds and the
    limit it raises is the one the handshake's budget is computed from."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError) as e:
            log.warning("cannot raise the open-files limit from %d to %d: %s", soft, hard, e)
    return soft


class Handoff:
    """The handshake listener: one short exchange per connection, answered on the listener's
    thread once the request line is in (identifying a caller is a few dict lookups).

    `inflight_fds`: the most fds all tenants' unread replies may hold (default: half the soft
    RLIMIT_NOFILE, raised first; the kernel's count is per user, so the other half is left to
    whatever else of the daemon's user sends fds)."""

    def __init__(self, path: str, auth: Auth, pool_for: PoolFor | None = None,
                 mode: int = 0o666, gpu_for: GpuFor | None = None,
                 caps: Caps | None = None, inflight_fds: int | None = None) -> None:
        self.path = path
        self.auth = auth
        self.pool_for = pool_for
        self.gpu_for = gpu_for
        self.inflight_fds = max(MAX_FDS, inflight_fds or raise_nofile() // 2)
        self._refused = 0
        self._listener = UnixListener(path, mode, self._handle, "kvstore-handoff", caps)

    def _handle(self, conn: socket.socket, uid: int, line: bytes) -> None:
        try:
            conn.settimeout(REPLY_SEND_S)
            answer = self._answer(conn, uid, line)
        except Exception as exc:   # one bad peer must not end the listener
            log.warning("handshake failed: %s", exc)
            answer = None
        if answer is None:
            conn.close()            # refused (refuse closed it already) or failed before a send
            return
        tenant, reply, fds = answer
        try:
            self._send(conn, reply, fds)
        except Exception as exc:
            log.warning("handshake failed: %s", exc)
        if fds:                     # even after a failed send: part of it may be in flight
            self._listener.hold(conn, tenant, len(fds))
        else:
            conn.close()

    def _answer(self, conn: socket.socket, uid: int, line: bytes
                ) -> tuple[str, dict, list[int]] | None:
        """(tenant, reply, fds to attach) for an authenticated caller with room for its reply;
        None once `conn` was refused."""
        try:
            req = json.loads(line)
            token = req.get("token") or ""
            if not isinstance(token, str):
                raise ValueError("token must be a string")
        except (ValueError, AttributeError) as exc:
            refuse(conn, "INVALID_ARGUMENT", f"handshake request is not a JSON object: {exc}")
            return None
        tenant = self.auth.by_token(token) if token else self.auth.by_uid(uid)
        if tenant is None:
            why = ("the token matches no tenant" if token else
                   f"no tenant lists uid {uid} in `uids` and no token was given")
            refuse(conn, "UNAUTHENTICATED", why)
            return None
        cap = self._listener.caps.per_uid
        unread = self._listener.held(tenant.name)
        if unread >= cap:
            return self._exhausted(
                conn, f"tenant {tenant.name} has {unread} handshake replies with file "
                f"descriptors that it has not read (limits.pending_per_uid = {cap}); read or "
                "close those connections, then retry")
        pool = self.pool_for(tenant) if self.pool_for is not None else None
        gpu = (self.gpu_for(tenant.name) if self.gpu_for is not None else [])[:MAX_FDS - 1]
        fds = ([pool[0]] if pool else []) + [fd for _, fd, _ in gpu]
        if fds and self._listener.held_fds + len(fds) > self.inflight_fds:
            return self._exhausted(
                conn, f"{self._listener.held_fds} file descriptors sent in handshake replies "
                f"are still unread, of at most {self.inflight_fds} (half the daemon's "
                "open-files limit); retry in a moment")
        reply = {"tenant": tenant.name, "session": self.auth.new_session(tenant),
                 "pool_size": pool[1] if pool else 0,
                 "gpu_pools": [{"device": d, "size": n} for d, _, n in gpu]}
        return tenant.name, reply, fds

    def _exhausted(self, conn: socket.socket, why: str) -> None:
        self._refused += 1
        refuse(conn, "RESOURCE_EXHAUSTED", why)

    @staticmethod
    def _send(conn: socket.socket, reply: dict, fds: list[int] | None = None) -> None:
        data = (json.dumps(reply) + "\n").encode()
        if not fds:
            conn.sendall(data)
        else:
            socket.send_fds(conn, [data], fds)

    @property
    def refused(self) -> int:
        return self._listener.refused + self._refused

    def close(self) -> None:
        self._listener.close()
