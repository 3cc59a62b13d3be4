"""The lane's frame writer on a real socket pair: a send ends by its deadline, never before it.

Why: Frames.send keeps the send timeout it set while that still ends by the new deadline (one
system call fewer a frame), so a send may be woken by a timeout shorter than what its own
deadline allows; it must then go on until that deadline, not give up early, and the bytes of a
peer that does read must all arrive.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
from kvstore_client.common.lane_frames import Frames

BIG = 8 << 20          # far more than a Unix socket's buffers hold


def _fill(sock: socket.socket) -> None:
    """Fill the socket's send buffer (the peer reads nothing)."""
    sock.setblocking(False)             # O_NONBLOCK only: the send timeout set stays
    try:
        while True:
            sock.send(b"f" * 4096)
    except BlockingIOError:
        pass
    sock.setblocking(True)


def test_a_send_to_a_peer_that_does_not_read_ends_at_its_deadline_not_before() -> None:
    a, b = socket.socketpair()
    try:
        out = Frames(a)
        out.send(b"x" * 16, time.monotonic() + 0.3)      # sets a 0.3 s send timeout
        assert b.recv(16) == b"x" * 16
        _fill(a)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            out.send(b"y" * 16, t0 + 0.5)                # the kept 0.3 s ends first
        took = time.monotonic() - t0
        assert took >= 0.5, f"gave up after {took:.3f} s, before its 0.5 s deadline"
        assert took < 5.0
    finally:
        a.close()
        b.close()


def test_every_byte_arrives_at_a_peer_that_reads_slowly() -> None:
    a, b = socket.socketpair()
    got = bytearray()

    def read() -> None:
        while len(got) < BIG:
            time.sleep(0.001)
            chunk = b.recv(1 << 16)
            if not chunk:
                return
            got.extend(chunk)
    t = threading.Thread(target=read, daemon=True)
    try:
        out = Frames(a)
        out.send(b"x", time.monotonic() + 0.05)       # a short timeout, kept if it fits
        b.recv(1)
        t.start()
        payload = bytes(range(256)) * (BIG // 256)
        out.send(payload, time.monotonic() + 30.0)
        t.join(30.0)
        assert bytes(got) == payload
    finally:
        a.close()
        b.close()

