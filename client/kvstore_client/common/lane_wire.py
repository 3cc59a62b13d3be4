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
MAX_FRAME = 64 << 20          # the daemon's default max message size
MAX_HELLO = 8192


def lane_path(socket_path: str) -> str:
    return socket_path + SUFFIX


def recv_exact(sock, n: int) -> bytes:
    """n bytes from a blocking socket; EOFError when the peer closed first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError("the lane connection closed")
        got += k
    return bytes(buf)


def recv_line(sock, limit: int = MAX_HELLO) -> bytes:
    """One newline-terminated line (the hello), at most `limit` bytes."""
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(1)
        if not chunk:
            raise EOFError("the lane connection closed during the hello")
        buf += chunk
        if len(buf) > limit:
            raise ValueError(f"lane hello longer than {limit} bytes")
    return buf
