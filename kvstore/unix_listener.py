"""A Unix-socket listener beside the gRPC socket (the handshake's and the fast lane's).

Why one module: both bind with the gRPC socket's file mode from the first instant (a umask
around bind, not a chmod after it that leaves a window with the default mode), replace a file
a dead daemon left (the daemon has checked the gRPC socket is free), accept on a thread of
their own that polls a stop flag, and remove their file when they close.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path

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


class UnixListener:
    """Accepts on `path` on a thread of its own and hands each connection to `serve` (which
    owns it from then on and must not raise)."""

    def __init__(self, path: str, mode: int, serve: Callable[[socket.socket], None],
                 name: str) -> None:
        self.path = path
        self.stopping = threading.Event()
        self._serve = serve
        self._sock = listen_unix(path, mode)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self.stopping.is_set():
                    return
                continue
            self._serve(conn)

    def close(self) -> None:
        """Stop accepting and remove the socket file (connections already handed out stay
        with their owner)."""
        self.stopping.set()
        self._sock.close()
        self._thread.join(5)
        try:
            Path(self.path).unlink()
        except FileNotFoundError:
            pass
