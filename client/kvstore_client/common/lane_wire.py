"""The fast lane's wire format, shared by the daemon (kvstore/lane.py) and the SDK (lane.py).

Why a lane beside gRPC: on the Unix socket one gRPC unary call costs about 185 µs of framework
time on this project's reference machine (HTTP/2 framing and a thread hand-off each way), as
much as the daemon's own work for a warm store's Commit; a length-prefixed frame on a plain
Unix socket costs about 15 µs. The lane carries the hot unary calls of a store and a load with
the same protobuf messages, checks, metrics and errors; everything else stays on gRPC.

Socket `<server.socket>.lane`, one connection per client thread in use, frames little-endian:
  client -> daemon, once   one JSON line {"v": 1, "token": "<bearer or session token, or "">"}
  daemon -> client, once   one JSON line {"ok": true}, or {"error": CODE, "message": ...} and
                           the daemon closes the connection
  then, per call           request:  u32 n, u8 method (index in METHODS), n bytes of request
                           response: u32 n, u8 status (index in CODES, 0 = OK), n bytes: the
                           response message, or the error message in UTF-8
"""

from __future__ import annotations

import struct
import time

from .limits import MAX_REQUEST_BYTES

SUFFIX = ".lane"
VERSION = 1
METHODS = ("Commit", "Acquire", "Release", "Lookup", "LookupReserve", "LookupAcquire",
           "Reserve", "RenewLease", "Locate")
METHOD_ID = {m: i for i, m in enumerate(METHODS)}
CODES = ("OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
         "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
         "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
         "UNAUTHENTICATED")
CODE_ID = {c: i for i, c in enumerate(CODES)}
HEADER = struct.Struct("<IB")
# The largest valid request of any lane method: every lane method is a key-list call, so
# none is larger than the daemon's bound for requests other than Put (limits.py: 65,536 keys
# of up to 32 bytes with a checksum each, plus 256 KiB of small fields: 3,211,264 bytes). A
# frame announcing more is not a request of ours: the daemon drops the connection unread.
MAX_FRAME = MAX_REQUEST_BYTES
MAX_HELLO = 8192
# Reads are at most this much at a time, into a buffer that grows as the bytes arrive: a peer
# that announces a large frame and sends nothing costs nothing.
RECV_CHUNK = 256 << 10


def lane_path(socket_path: str) -> str:
    return socket_path + SUFFIX


def _wait(sock, deadline: float | None) -> None:
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the lane peer did not send in time")
        sock.settimeout(left)


def recv_line(sock, limit: int = MAX_HELLO, deadline: float | None = None) -> bytes:
    """One newline-terminated line (a hello or its answer), at most `limit` bytes, whole
    before `deadline`."""
    buf = b""
    while not buf.endswith(b"\n"):
        _wait(sock, deadline)
        chunk = sock.recv(1)
        if not chunk:
            raise EOFError("the lane connection closed during the hello")
        buf += chunk
        if len(buf) > limit:
            raise ValueError(f"lane hello longer than {limit} bytes")
    return buf
