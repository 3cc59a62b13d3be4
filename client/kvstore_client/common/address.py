"""How an address names a daemon: a Unix socket path or "unix:..." (same host), or "host:port".

Shared because `kvstore status` (kvstore/cli.py) must read `$KVSTORE_ADDRESS` exactly as the SDK's
`connect()` does: a bare or relative path is a Unix socket.
"""

from __future__ import annotations

import os

from .errors import InvalidArgument


def grpc_target(address: str) -> tuple[str, bool]:
    """(gRPC target, same host?) for a socket path, "unix:..." or "host:port" address."""
    if not isinstance(address, str) or not address.strip():
        raise InvalidArgument("address must be a Unix socket path, 'unix:///path' or "
                              f"'host:port', got {address!r}")
    a = address.strip()
    if a.startswith("unix:"):
        path = a[len("unix:"):]
        if path.startswith("//"):
            path = path[2:]
        return "unix:" + os.path.abspath(path), True
    if a.startswith(("/", ".", "~")) or ":" not in a:
        return "unix:" + os.path.abspath(os.path.expanduser(a)), True
    host, sep, port = a.rpartition(":")
    if not sep or not port.isdigit():
        raise InvalidArgument(f"cannot read {address!r} as an address: use a Unix socket path, "
                              "'unix:///path' or 'host:port'")
    local = host.strip("[]") in ("localhost", "127.0.0.1", "::1", "")
    return a, local
