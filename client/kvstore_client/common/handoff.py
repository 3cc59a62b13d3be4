"""The client half of the daemon's Unix-socket handshake (daemon side: kvstore/handoff.py).

Why: on a daemon with tenants, a process on the same host proves who it is by its uid (the
kernel reports it to the daemon, nothing to configure or leak) or by its token, and receives a
session token for its gRPC calls and, where its tenant has one, its own host pool as a file
descriptor: memory no other tenant's process can open by any name.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass, field

from .errors import DeadlineExceeded, KVStoreError, ResourceExhausted, Unavailable, from_code

SUFFIX = ".auth"
MAX_REPLY = 8192
MAX_FDS = 17          # the host pool and up to 16 devices' slabs
RETRY_S = (0.02, 0.5)  # back-off after RESOURCE_EXHAUSTED: first wait, longest wait


@dataclass
class Session:
    tenant: str
    token: str
    pool_fd: int | None       # the tenant's own host pool (memfd), owned by the caller
    pool_size: int
    # device -> (fd, size): the tenant's own CPU-device slabs (memfds), owned by the caller
    gpu_fds: dict[int, tuple[int, int]] = field(default_factory=dict)
    # The handshake socket file's identity: each daemon run binds a new one, so a changed one
    # says the fds above belong to a run that is gone (a token client sees no other sign).
    socket_id: tuple[int, int, int] | None = None

    def current(self, path: str) -> bool:
        try:
            return socket_id(path) == self.socket_id
        except OSError:
            return False

    def close_fds(self) -> None:
        """Close the fds nobody mapped (a fresh handshake hands out new ones)."""
        fds = [f for f, _ in self.gpu_fds.values()]
        if self.pool_fd is not None:
            fds.append(self.pool_fd)
        self.pool_fd, self.gpu_fds = None, {}
        for fd in fds:
            os.close(fd)


def socket_id(path: str) -> tuple[int, int, int]:
    """(device, inode, modification time in ns) of a socket file. The inode alone is not
    enough: a filesystem may give the next run's socket the inode just freed by the last
    one's, and a client that took that for the same run copied into a dead run's pool. The
    time is set when the socket is bound and never touched after (a chmod changes ctime)."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_mtime_ns


def handshake_path(socket_path: str) -> str:
    return socket_path + SUFFIX


def handshake(path: str, token: str = "", timeout: float = 5.0) -> Session:
    """The daemon's handshake, whole within `timeout` seconds (one deadline, not one per read
    or per try). Raises only the SDK's errors: Unavailable (no daemon there, or it closed the
    connection), DeadlineExceeded (no answer in time), or the status the daemon refused with
    (Unauthenticated, ResourceExhausted, ...).

    RESOURCE_EXHAUSTED is tried again, backing off, until the deadline: the daemon answers it
    while a user has `limits.pending_per_uid` handshakes in progress, which is what more
    processes of one tenant than that starting at once meet; each waits a moment, not fails.
    """
    deadline = time.monotonic() + timeout
    wait = RETRY_S[0]
    while True:
        try:
            return _exchange(path, token, timeout, deadline)
        except ResourceExhausted:
            left = deadline - time.monotonic()
            if left <= wait:
                raise
            time.sleep(wait)
            wait = min(RETRY_S[1], wait * 2)


def _exchange(path: str, token: str, timeout: float, deadline: float) -> Session:
    """One connection's exchange (handshake)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fds: list[int] = []
    try:
        try:
            ident = socket_id(path)
            s.settimeout(max(0.001, deadline - time.monotonic()))
            s.connect(path)
        except TimeoutError:
            raise DeadlineExceeded(f"the daemon's handshake socket {path} did not accept the "
                                   f"connection within {timeout:g} s") from None
        except OSError as e:
            raise Unavailable(f"cannot reach the daemon's handshake socket {path}: "
                              f"{e.strerror or e}") from None
        try:
            s.settimeout(max(0.001, deadline - time.monotonic()))
            s.sendall((json.dumps({"v": 1, "token": token}) + "\n").encode())
            data = b""
            while not data.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                s.settimeout(left)
                msg, got, _flags, _addr = socket.recv_fds(s, MAX_REPLY, MAX_FDS)
                fds += got
                if not msg:
                    break
                data += msg
                if len(data) > MAX_REPLY:
                    raise ValueError("reply too long")
        except TimeoutError:
            raise DeadlineExceeded(f"the daemon's handshake at {path} did not answer within "
                                   f"{timeout:g} s") from None
        except (OSError, ValueError) as e:
            raise Unavailable(f"the daemon's handshake at {path} failed: {e}") from None
    except KVStoreError:
        for fd in fds:
            os.close(fd)
        raise
    finally:
        s.close()
    try:
        reply = json.loads(data)
        if not isinstance(reply, dict):
            raise ValueError("not an object")
    except ValueError:
        for fd in fds:
            os.close(fd)
        raise Unavailable(f"the daemon's handshake at {path} answered no JSON line") from None
    if "error" in reply:
        for fd in fds:
            os.close(fd)
        raise from_code(str(reply["error"]),
                        f"handshake with {path}: {reply.get('message', reply['error'])}")
    try:
        size = int(reply.get("pool_size") or 0)
        tenant, session = str(reply["tenant"]), str(reply["session"])
        devices = [(int(e["device"]), int(e["size"])) for e in reply.get("gpu_pools") or []]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        for fd in fds:
            os.close(fd)
        raise Unavailable(f"the daemon's handshake at {path} answered a malformed reply "
                          f"({type(e).__name__}: {e})") from None
    fd = fds[0] if fds and size else None
    rest = fds[1 if fd is not None else 0:]
    gpu: dict[int, tuple[int, int]] = {}
    for device, nbytes in devices:
        if not rest:
            break
        gpu[device] = (rest.pop(0), nbytes)
    for extra in rest:
        os.close(extra)
    return Session(tenant=tenant, token=session, pool_fd=fd, pool_size=size, gpu_fds=gpu,
                   socket_id=ident)
