"""What a peer without a token can make the daemon buffer on one HTTP/2 stream and one connection
(docs/security.md, Limits: the gRPC receive window).

Why: gRPC lets a peer send as many bytes on a stream as the window the daemon granted it, and the
daemon holds them until the stream's handler reads them or the stream ends. grpc's
bandwidth-delay probing, on by default, grows that window (for every new stream of the
connection, and the connection's own) from the rate data arrives at, which a peer controls: one
pumping bytes into calls that are refused got windows of 4-8 MiB, so that each stalled stream
could park that much in the daemon before its refusal. The daemon turns the probing off and
fixes the window (kvstore/server.py, STREAM_WINDOW_BYTES), whatever the traffic.

The attacker here speaks HTTP/2 by hand on the daemon's Unix socket (the SDK never does this):
Put calls without a token, each sent as much DATA as its window allows, the daemon's PINGs
answered at once (what makes its bandwidth probe estimate a fast link), for a few seconds.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from kvstore.server import STREAM_WINDOW_BYTES
from tests.daemon import cleanup, start_daemon
from tests.trust_net_helpers import tenants_file

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
ACK, END_HEADERS = 0x1, 0x4
INITIAL_WINDOW_SIZE = 0x4
PUMP_S = 3.0


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + \
        struct.pack(">I", stream) + payload


def literal(name: bytes, value: bytes) -> bytes:
    """An HPACK header field, literal without indexing, no Huffman coding (RFC 7541 6.2.2);
    the strings here are all shorter than 127 bytes."""
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


PUT_HEADERS = b"".join(literal(n, v) for n, v in (
    (b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/kvstore.v1.KVStore/Put"),
    (b":authority", b"localhost"), (b"content-type", b"application/grpc"),
    (b"te", b"trailers")))


class Peer:
    """One raw HTTP/2 connection: a reader thread that answers SETTINGS and PING and records
    every window the daemon grants."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.lock = threading.Lock()
        self.initial = 65_535                 # SETTINGS_INITIAL_WINDOW_SIZE the daemon sent
        self.conn_window = 65_535
        self.granted: dict[int, int] = {}      # stream -> initial + its WINDOW_UPDATEs
        self.sent: dict[int, int] = {}
        self.closed_streams: set[int] = set()
        self.most_granted = 0
        self.most_conn = 65_535               # the most the connection's window ever was
        self.alive = True
        self.send(PREFACE + frame(SETTINGS, 0, 0))
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _exact(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            got = self.sock.recv(n - len(buf))
            if not got:
                raise ConnectionError("closed")
            buf += got
        return buf

    def _read(self) -> None:
        try:
            while True:
                head = self._exact(9)
                length = int.from_bytes(head[:3], "big")
                kind, flags = head[3], head[4]
                stream = int.from_bytes(head[5:9], "big") & 0x7FFF_FFFF
                body = self._exact(length)
                with self.lock:
                    self._on(kind, flags, stream, body)
        except OSError:
            pass
        finally:
            self.alive = False

    def _on(self, kind: int, flags: int, stream: int, body: bytes) -> None:
        if kind == SETTINGS and not flags & ACK:
            for i in range(0, len(body), 6):
                ident, value = struct.unpack(">HI", body[i:i + 6])
                if ident == INITIAL_WINDOW_SIZE:
                    for s in self.granted:
                        self.granted[s] += value - self.initial
                    self.initial = value
            self.sock.sendall(frame(SETTINGS, ACK, 0))
            self._note()
        elif kind == PING and not flags & ACK:
            self.sock.sendall(frame(PING, ACK, 0, body))
        elif kind == WINDOW_UPDATE:
            inc = int.from_bytes(body[:4], "big") & 0x7FFF_FFFF
            if stream == 0:
                self.conn_window += inc
                self.most_conn = max(self.most_conn, self.conn_window)
            elif stream in self.granted:
                self.granted[stream] += inc
                self._note()
        elif kind in (RST_STREAM, HEADERS) and stream:
            self.closed_streams.add(stream)       # the refusal (trailers-only or reset)
        elif kind == GOAWAY:
            self.alive = False

    def _note(self) -> None:
        if self.granted:
            self.most_granted = max(self.most_granted, *self.granted.values())
        self.most_granted = max(self.most_granted, self.initial)

    def pump(self, stream: int, chunk: bytes) -> None:
        """Open a Put without a token on `stream` and send as much as the windows allow."""
        with self.lock:
            self.granted[stream] = self.initial
            self.sent[stream] = 0
            self._note()
        self.send(frame(HEADERS, END_HEADERS, stream, PUT_HEADERS))
        while self.alive and stream not in self.closed_streams:
            with self.lock:
                room = min(self.granted[stream] - self.sent[stream], self.conn_window,
                           len(chunk))
                if room > 0:
                    self.sent[stream] += room
                    self.conn_window -= room
            if room <= 0:
                break
            self.send(frame(DATA, 0, stream, chunk[:room]))

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dos-windows")
    d = start_daemon(tmp, {"auth.tokens_file": str(tenants_file(tmp))})
    try:
        yield d
    finally:
        cleanup(d)


def test_a_peer_without_a_token_cannot_grow_its_windows(daemon) -> None:
    peer = Peer(daemon.socket)
    chunk = bytes(16 << 10)                  # the largest DATA frame a peer may send unasked
    stream, end = 1, time.monotonic() + PUMP_S
    try:
        while time.monotonic() < end and peer.alive:
            peer.pump(stream, chunk)
            stream += 2
        with peer.lock:
            most, most_conn = peer.most_granted, peer.most_conn
    finally:
        peer.close()
    assert stream > 21, "too few streams were opened for the test to mean anything"
    # A message's length prefix may open a stream's window to that message once its handler
    # reads it (a Put's 4 MiB pieces); a refused stream is never read.
    assert most <= STREAM_WINDOW_BYTES, (
        f"the daemon let a stream without a token send {most} bytes "
        f"(kvstore.server.STREAM_WINDOW_BYTES is {STREAM_WINDOW_BYTES})")
    assert most_conn <= STREAM_WINDOW_BYTES, (
        f"the daemon let a connection without a token have {most_conn} bytes in flight "
        f"(kvstore.server.STREAM_WINDOW_BYTES is {STREAM_WINDOW_BYTES})")
