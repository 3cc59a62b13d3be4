"""gRPC calls spoken as raw HTTP/2 frames on one socket, for the DoS bench's attackers.

Why not grpcio: an attacker's oversize message is refused by the daemon from its 5-byte length
prefix, after at most one flow-control window of body, yet grpcio builds and copies the whole
message (64 MiB) for every call, and runs a thread per client-streaming call; on a machine of
few cores that CPU of the attacker's own delays tenant A as much as the daemon's work does.
What the daemon receives is the same: the HTTP/2 preface and SETTINGS, a HEADERS frame per
call with the method's path, `content-type: application/grpc`, `te: trailers`, the
`grpc-timeout` and the caller's metadata, and DATA frames carrying the gRPC length prefix and
body for as long as the windows the daemon grants allow (its WINDOW_UPDATEs are followed, as
grpcio follows them). Headers go as HPACK literals (never indexed): more bytes per call for the
daemon to decode than grpcio's indexed ones, never fewer.
"""

from __future__ import annotations

import select
import socket
import struct
import time

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
CANCEL = 0x8
INITIAL_WINDOW = 65535           # RFC 9113: every window before SETTINGS / WINDOW_UPDATE
MAX_FRAME = 16384                # the smallest frame size a peer must accept
_ZEROS = bytes(MAX_FRAME)


def _hpack_int(n: int, bits: int) -> bytes:
    top = (1 << bits) - 1
    if n < top:
        return bytes([n])
    out, n = bytearray([top]), n - top
    while n >= 128:
        out.append((n & 127) | 128)
        n >>= 7
    out.append(n)
    return bytes(out)


def header_block(headers: list[tuple[str, str]]) -> bytes:
    """HPACK literals without indexing, new names, no Huffman coding."""
    out = bytearray()
    for name, value in headers:
        n, v = name.encode(), value.encode()
        out += b"\x00" + _hpack_int(len(n), 7) + n + _hpack_int(len(v), 7) + v
    return bytes(out)


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + \
        struct.pack(">I", stream) + payload


class Connection:
    """One HTTP/2 connection to a gRPC server's Unix socket, its calls made by hand."""

    def __init__(self, path: str, timeout_s: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        self.sock.connect(path)
        self.sock.sendall(PREFACE + frame(SETTINGS, 0, 0))
        self.buf = bytearray()
        self.next_id = 1
        self.conn_window = INITIAL_WINDOW
        self.initial_window = INITIAL_WINDOW
        self.windows: dict[int, int] = {}      # open stream -> what we may still send on it
        self.ended: dict[int, bool] = {}        # stream the server ended -> whether by reset
        self.closed = False                     # GOAWAY or EOF: make a new connection
        self.received: dict[int, bytearray] = {}  # stream -> its DATA so far (calls only)

    def close(self) -> None:
        self.closed = True
        self.sock.close()

    def headers(self, path: str, metadata: tuple[tuple[str, str], ...], timeout_s: int
                ) -> int:
        """Open a call: its HEADERS, no END_STREAM (the message is still to come)."""
        sid, self.next_id = self.next_id, self.next_id + 2
        block = header_block([(":method", "POST"), (":scheme", "http"), (":path", path),
                              (":authority", "localhost"), ("te", "trailers"),
                              ("content-type", "application/grpc"),
                              ("grpc-timeout", f"{timeout_s}S"), *metadata])
        self.windows[sid] = self.initial_window
        self.sock.sendall(frame(HEADERS, END_HEADERS, sid, block))
        return sid

    def cancel(self, sid: int) -> None:
        """RST_STREAM(CANCEL), as grpcio ends a call whose message it is still sending (not
        after the server's own reset)."""
        self.windows.pop(sid, None)
        if not self.ended.pop(sid, False) and not self.closed:
            self.sock.sendall(frame(RST_STREAM, 0, sid, struct.pack(">I", CANCEL)))

    def pump(self, wait_s: float) -> None:
        """Read what the server sent within `wait_s` (at least what is there now): answer its
        SETTINGS and PINGs, take its window updates, note the streams it ended."""
        if self.closed:
            return
        r, _, _ = select.select([self.sock], [], [], max(0.0, wait_s))
        while r:
            try:
                got = self.sock.recv(65536, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                got = b""
            if not got:
                self.close()
                return
            self.buf += got
            r, _, _ = select.select([self.sock], [], [], 0)
        self._frames()

    def _frames(self) -> None:
        buf = self.buf
        while len(buf) >= 9:
            n = int.from_bytes(buf[:3], "big")
            if len(buf) < 9 + n:
                break
            kind, flags = buf[3], buf[4]
            sid = int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
            body = bytes(buf[9:9 + n])
            del buf[:9 + n]
            if kind == SETTINGS and not flags & ACK:
                for i in range(0, len(body) - 5, 6):
                    key, value = struct.unpack(">HI", body[i:i + 6])
                    if key == 0x4:                      # SETTINGS_INITIAL_WINDOW_SIZE
                        for s in self.windows:
                            self.windows[s] += value - self.initial_window
                        self.initial_window = value
                self.sock.sendall(frame(SETTINGS, ACK, 0))
            elif kind == PING and not flags & ACK:
                self.sock.sendall(frame(PING, ACK, 0, body))
            elif kind == WINDOW_UPDATE:
                inc = int.from_bytes(body[:4], "big") & 0x7FFFFFFF
                if sid == 0:
                    self.conn_window += inc
                elif sid in self.windows:
                    self.windows[sid] += inc
            elif kind == GOAWAY:
                self.close()
                return
            elif kind == DATA and n:
                # our receive windows opened again at once, as a reader that keeps up does
                inc = struct.pack(">I", n)
                self.sock.sendall(frame(WINDOW_UPDATE, 0, 0, inc) + (
                    frame(WINDOW_UPDATE, 0, sid, inc) if not flags & END_STREAM else b""))
                if sid in self.received:
                    if flags & 0x8:                             # PADDED
                        body = body[1:len(body) - body[0]]
                    self.received[sid] += body
            if sid in self.windows and (kind == RST_STREAM or
                                        kind in (DATA, HEADERS) and flags & END_STREAM):
                self.ended[sid] = kind == RST_STREAM

    def oversize(self, path: str, metadata: tuple[tuple[str, str], ...], announce: int,
                 timeout_s: int) -> str:
        """A unary call whose message prefix announces `announce` bytes; zeros follow while
        the windows allow. Returns how it ended: 'answered' (the server ended or reset the
        stream), 'goaway' or 'timeout'."""
        deadline = time.monotonic() + timeout_s
        sid = self.headers(path, metadata, timeout_s)
        head = b"\0" + struct.pack(">I", announce)
        left = len(head) + announce
        while True:
            if self.closed:
                return "goaway"
            if sid in self.ended:
                self.cancel(sid)
                return "answered"
            room = min(self.conn_window, self.windows[sid], left)
            while room > 0:
                n = min(room, MAX_FRAME)
                payload = head + _ZEROS[:n - len(head)] if head else _ZEROS[:n]
                head = b""
                left -= n
                room -= n
                self.conn_window -= n
                self.windows[sid] -= n
                self.sock.sendall(frame(DATA, END_STREAM if left == 0 else 0, sid, payload))
            now = time.monotonic()
            if now >= deadline:
                self.cancel(sid)
                return "timeout"
            self.pump(min(1.0, deadline - now))

    def call(self, path: str, metadata: tuple[tuple[str, str], ...], message: bytes,
             timeout_s: int) -> list[bytes] | None:
        """A call sending one message: the messages of its answer, or None when it ended
        without one (refused: every call of the bench that succeeds answers a message)."""
        deadline = time.monotonic() + timeout_s
        sid = self.headers(path, metadata, timeout_s)
        self.received[sid] = bytearray()
        body = memoryview(b"\0" + struct.pack(">I", len(message)) + message)
        try:
            while True:
                if self.closed:
                    return None
                room = min(self.conn_window, self.windows.get(sid, 0), len(body))
                while room > 0 and sid not in self.ended:
                    n = min(room, MAX_FRAME)
                    chunk, body = body[:n], body[n:]
                    room -= n
                    self.conn_window -= n
                    self.windows[sid] -= n
                    self.sock.sendall(frame(DATA, 0 if len(body) else END_STREAM, sid,
                                            bytes(chunk)))
                if sid in self.ended:
                    data = bytes(self.received[sid])
                    out, i = [], 0
                    while i + 5 <= len(data):
                        n = int.from_bytes(data[i + 1:i + 5], "big")
                        out.append(data[i + 5:i + 5 + n])
                        i += 5 + n
                    if len(body):
                        self.cancel(sid)            # answered before all was sent
                    else:
                        self.windows.pop(sid, None)
                        self.ended.pop(sid, None)
                    return out or None
                now = time.monotonic()
                if now >= deadline:
                    self.cancel(sid)
                    return None
                self.pump(min(1.0, deadline - now))
        finally:
            self.received.pop(sid, None)
