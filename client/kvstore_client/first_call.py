"""A client's first call: a wrong address said at once, a restarting or slow daemon waited for.

Until a daemon has answered once, a refused connection means the address is wrong, and the
engine's operator should hear that at once ("no kvstore daemon at ..."), not after a timeout.
Other failures of the same call mean a daemon is there: a connection attempt that timed out (a
daemon slow to answer the HTTP/2 handshake on a loaded machine), or a connection that broke
under the call (grpc shares one connection among a process's channels to a target, so a new
client's first call can go out on the connection to a daemon run that just ended). The call
then waits for the daemon within the same deadline.

grpc's refusal can also be stale: the connection state is shared, and a refusal (or a missing
socket file) that another client of this process met while a daemon restarted is answered,
until its reconnect backoff ends, to every new call, though the new run listens by now. So a
refusal is checked against the address itself before it is believed.

After the first answer, `Client.call` waits for the channel on every call (a restart is waited
for), so none of this applies.
"""

from __future__ import annotations

import os
import socket
import stat
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from .common.errors import Unavailable

# Client._invoke: (method, request, timeout, wait_for_ready) -> response.
Invoke = Callable[[str, Any, "float | None", bool], Any]

# What grpc says when a daemon was there to connect to: the first call waits for it then.
DAEMON_THERE = ("timed out", "stream removed", "broken pipe", "connection reset",
                "socket closed")
# A refusal, which may be stale (module docstring): believed only where the address refuses too.
REFUSED = ("connection refused", "no such file or directory")
# A first call's UNAVAILABLE that is the TLS handshake failing, not a missing daemon.
TLS_FAILED = ("tls handshake", "ssl_error", "certificate_verify_failed")
CLOSED_TRIES = 2            # retries of a TCP connection closed at once (closed_again)
CLOSED_PAUSE_S = 0.1
LISTENING_CHECK_S = 1.0     # the longest a first call's own connect to its address takes


def check_address(target: str) -> None:
    """A Unix socket that is not there cannot be a daemon: say so without a round trip."""
    if not target.startswith("unix:"):
        return
    path = target[len("unix:"):]
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise Unavailable(f"no kvstore daemon at {path}: the socket does not exist; start "
                          "one with `kvstore serve` or pass the socket path it printed"
                          ) from None
    except OSError as e:
        raise Unavailable(f"no kvstore daemon at {path}: {e.strerror}") from None
    if not stat.S_ISSOCK(mode):
        raise Unavailable(f"no kvstore daemon at {path}: that is not a socket")


def invoke(call: Invoke, target: str, address: str, method: str, request: Any,
           timeout: float | None, t_end: float) -> Any:
    """The first call: once without waiting for the channel, then (module docstring) waited
    for where the failure says, or the address shows, that a daemon is there. Raises the
    grpc.RpcError of a daemon that is not there; `unavailable` words it."""
    try:
        return call(method, request, timeout, False)
    except grpc.RpcError as e:
        left = t_end - time.monotonic()
        why = (e.details() or "").lower()
        if e.code() != grpc.StatusCode.UNAVAILABLE or left <= 0 or not (
                any(w in why for w in DAEMON_THERE)
                or (any(w in why for w in REFUSED) and listening(target, left))):
            raise
        if "socket closed" in why and not target.startswith("unix:"):
            return closed_again(call, address, method, request, t_end)
        return call(method, request, left, True)


def closed_again(call: Invoke, address: str, method: str, request: Any, t_end: float) -> Any:
    """A TCP connection closed before the first call went through. Once, that is a
    connection to a daemon run that just ended (above); again and again, it is the daemon's
    TLS refusing this client before a byte of gRPC: plaintext to a TLS port, or no client
    certificate (or one of another CA) where the daemon requires mTLS. Waiting for the
    deadline then said only "Deadline Exceeded", so the call is tried again, CLOSED_PAUSE_S
    apart: closed the next CLOSED_TRIES times in a row, it fails at once saying why; any
    other answer is waited for as before."""
    for _ in range(CLOSED_TRIES):
        left = t_end - time.monotonic() - CLOSED_PAUSE_S
        if left <= 0:
            break
        time.sleep(CLOSED_PAUSE_S)
        try:
            return call(method, request, left, False)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            if "socket closed" not in (e.details() or "").lower():
                break
    else:
        raise Unavailable(
            f"the daemon at {address} closed every connection before a call went "
            "through: its TCP port serves TLS and this client does not match it "
            "(plaintext to a TLS port, or no client certificate, or one from another "
            "CA, where the daemon requires mTLS); pass tls_ca_file, and tls_cert_file "
            "and tls_key_file for mTLS")
    return call(method, request, max(t_end - time.monotonic(), 0.001), True)


def listening(target: str, timeout: float) -> bool:
    """Whether something accepts connections at `target` now: its Unix socket, or its TCP
    host and port (the name resolved, and connected, in a thread that is waited for at most
    the check's time: a slow resolver does not hold the call)."""
    wait = min(timeout, LISTENING_CHECK_S)
    if target.startswith("unix:"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(wait)
        try:
            s.connect(target[len("unix:"):])
            return True
        except OSError:
            return False
        finally:
            s.close()
    host, _, port = target.rpartition(":")
    accepted: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=wait).close()
            accepted.append(True)
        except (OSError, ValueError):
            pass

    t = threading.Thread(target=probe, name="kvstore-listening-check", daemon=True)
    t.start()
    t.join(wait)
    return bool(accepted)


def unavailable(address: str, e: grpc.RpcError) -> Unavailable:
    """The error of a first call that found no daemon (or one whose TLS refused it)."""
    if any(w in (e.details() or "").lower() for w in TLS_FAILED):
        return Unavailable(f"the TLS handshake with the daemon at {address} failed "
                           f"({e.details()}); check tls_ca_file (the CA that signed the "
                           "daemon's certificate) and tls_server_name, or drop TLS where the "
                           "daemon's TCP port serves none")
    return Unavailable(f"no kvstore daemon at {address} ({e.details()}); start one with "
                       "`kvstore serve` or pass the address it printed")
