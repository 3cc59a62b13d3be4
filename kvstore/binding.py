"""Where the daemon listens: its Unix socket, an optional TCP port (with TLS), and the refusal
to expose an unauthenticated port beyond loopback.

Why binds are checked here and not only in preflight (kvstore/preflight.py): a port can be
taken, or a socket path claimed by another daemon, between the check and the bind; the bind is
the authority, and each failure is one line (StartupError) naming what to change.
"""

from __future__ import annotations

import os
import socket as socketlib
from pathlib import Path
from typing import Any

from .config import StoreConfig
from .datadir import StartupError


def check_socket_free(path: str) -> None:
    """Refuse a socket path another live process listens on; remove a dead leftover."""
    if not os.path.exists(path):
        return
    s = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)       # left behind by a crashed daemon
        return
    except OSError as e:
        raise StartupError(f"cannot use socket path {path}: {e}") from None
    finally:
        s.close()
    raise StartupError(f"another process is listening on {path}; stop it or set "
                       "server.socket / --socket to another path")


def bind_unix(server: Any, path: str, mode: int = 0o600) -> None:
    """Bind the socket with its mode from the first instant (umask), not chmod-after.

    0600 without tenants (the daemon's own user only); 0666 with tenants, where every call is
    authenticated and other uids are exactly who the socket is for.
    """
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    old = os.umask(0o777 & ~mode)
    try:
        server.add_insecure_port(f"unix:{path}")
    finally:
        os.umask(old)
    os.chmod(path, mode)


def is_loopback(address: str) -> bool:
    """Whether "host:port" listens on loopback only: an IP address in 127.0.0.0/8 or ::1, or
    the name localhost. Any other name counts as beyond loopback, whatever it resolves to
    (a name like 127.evil.com is a name, not an address)."""
    import ipaddress

    host = address.rpartition(":")[0].strip().lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(cfg: StoreConfig, tenants: dict) -> str | None:
    """Refuse a TCP listener beyond loopback that nobody authenticates; returns the warning
    to log at every start when the operator insisted (auth.insecure_tcp)."""
    tcp = cfg.server.tcp
    if not tcp or is_loopback(tcp) or tenants or cfg.auth.tls_client_ca_file:
        return None
    if not cfg.auth.insecure_tcp:
        raise StartupError(
            f"config error: server.tcp={tcp} listens beyond loopback with no authentication; "
            "configure [tenants.*] (bearer tokens) or mTLS (auth.tls_cert_file, "
            "auth.tls_key_file, auth.tls_client_ca_file), bind 127.0.0.1, or set "
            "auth.insecure_tcp=true to accept that anyone who reaches the port can read, "
            "write and evict every block", exit_code=2)
    return (f"INSECURE: server.tcp={tcp} accepts unauthenticated calls from the network "
            "(auth.insecure_tcp=true): anyone who reaches it can read, write and evict every "
            "block")


def tls_credentials(cfg: StoreConfig) -> Any:
    """grpcio server credentials for the TCP listener (None: plaintext)."""
    import grpc

    a = cfg.auth
    if not a.tls_cert_file:
        return None
    try:
        key = Path(a.tls_key_file).read_bytes()
        cert = Path(a.tls_cert_file).read_bytes()
        ca = Path(a.tls_client_ca_file).read_bytes() if a.tls_client_ca_file else None
    except OSError as e:
        raise StartupError(f"config error: cannot read a TLS file ({e.filename}): "
                           f"{e.strerror}", exit_code=2) from None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                       require_client_auth=ca is not None)


def bind_tcp(server: Any, address: str, creds: Any = None) -> str:
    try:
        port = (server.add_secure_port(address, creds) if creds is not None
                else server.add_insecure_port(address))
    except RuntimeError as e:
        raise StartupError(f"cannot listen on TCP {address}: {e} (is the port in use? set "
                           "server.tcp / --tcp, or '' to disable)") from None
    if not port:
        raise StartupError(f"cannot listen on TCP {address} (is the port in use?)")
    host = address.rpartition(":")[0]
    return f"{host}:{port}"
