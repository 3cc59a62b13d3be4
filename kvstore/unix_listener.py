"""A Unix-socket listener beside the gRPC socket (the handshake's and the fast lane's).

Why its own function: both bind with the gRPC socket's file mode from the first instant (a
umask around bind, not a chmod after it that leaves a window with the default mode), and
both replace a file a dead daemon left (the daemon has checked the gRPC socket is free).
"""

from __future__ import annotations

import os
import socket

ACCEPT_POLL_S = 0.5           # how often an accept loop looks at its stop flag


def listen_unix(path: str, mode: int, backlog: int = 64) -> socket.socket:
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
        sock.settimeout(ACCEPT_POLL_S)
    except BaseException:
        sock.close()
        raise
    return sock
