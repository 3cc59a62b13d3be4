"""The lane's frames on a socket: each read and written with as few system calls as its bytes
allow (both ends: the daemon's kvstore/lane.py and the SDK's lane.py; wire format in
lane_wire.py).

Why not socket timeouts: a Python socket with a timeout polls before every read and write,
and each poll and each read gives up the GIL and must win it back. A process with many busy
threads (the daemon under 16 clients; an engine's scheduler beside the thread that calls
kvstore) gives the GIL to whichever thread asks first when it is free, not to the one that
waited longest, so a thread that gives it up often loses a round now and then and waits for
it. Under bench/tail.py a daemon call that gave it up five times (the header's poll and read,
the body's poll and read, the reply's poll) waited up to tens of milliseconds to win it back,
its own work taking a fraction of one. So the socket blocks, the kernel keeps the deadlines
(SO_RCVTIMEO and SO_SNDTIMEO, set to what is left where the one set would not do: setting them
does not give up the GIL), and a frame whose bytes have all arrived (each end writes header and
body at once) is read in one call.

Every wait is still bounded: the first bytes of a frame within `wait_s`, the whole frame within
`frame_s` of them and by `deadline` where one is given, a write by its deadline. A frame longer
than the reused read buffer is read into a buffer that grows as its bytes arrive, and one that
announces more than `limit` bytes is not read at all.
"""

from __future__ import annotations

import socket
import struct
import time

from .lane_wire import HEADER, RECV_CHUNK

FIRST_READ = 16 << 10       # a connection's reused read buffer: a frame up to this size, one read


class Frames:
    def __init__(self, sock: socket.socket, buffer: int = FIRST_READ) -> None:
        sock.settimeout(None)       # blocking: each read and write is one system call
        self.sock = sock
        self.buf = bytearray(buffer)
        self.view = memoryview(self.buf)
        self.have = 0               # bytes of the next frame already read
        self._rcv = self._snd = -1.0

    def read(self, wait_s: float, frame_s: float, limit: int | None = None,
             kinds: int | None = None, deadline: float | None = None
             ) -> tuple[int, bytes] | None:
        """The next frame as (its kind byte, its body). None, with the body unread, when it
        announces more than `limit` bytes or a kind byte of `kinds` or more. TimeoutError past
        a deadline, EOFError when the peer closed, OSError as the socket raises it."""
        if not self.have:
            self._recv_timeout(wait_s)
            self.have = self._read_into(self.view)
        end_by = time.monotonic() + frame_s
        if deadline is not None:
            end_by = min(end_by, deadline)
        while self.have < HEADER.size:
            self._recv_timeout(end_by - time.monotonic())
            self.have += self._read_into(self.view[self.have:])
        n, kind = HEADER.unpack_from(self.buf)
        if (limit is not None and n > limit) or (kinds is not None and kind >= kinds):
            return None
        end = HEADER.size + n
        if end > len(self.buf):
            body = bytearray(self.view[HEADER.size:self.have])
            chunk = memoryview(bytearray(min(n - len(body), RECV_CHUNK)))
            while len(body) < n:
                self._recv_timeout(end_by - time.monotonic())
                body += chunk[:self._read_into(chunk[:n - len(body)])]
            self.have = 0
            return kind, bytes(body)
        while self.have < end:
            self._recv_timeout(end_by - time.monotonic())
            self.have += self._read_into(self.view[self.have:])
        out = bytes(self.view[HEADER.size:end])
        left = self.have - end      # the start of a next frame sent early
        if left:
            self.buf[:left] = self.buf[end:self.have]
        self.have = left
        return kind, out

    def send(self, data: bytes, deadline: float) -> None:
        """All of `data`, by `deadline` (time.monotonic()).

        The send timeout set on the socket is kept while it ends by the deadline and is at
        least half of what is left: each reply's deadline is a little later than the last
        one's, and setting it anew for each (a system call) was a microsecond of every call.
        A timeout that ends before the deadline only wakes the send early: it sets the
        timeout to what is left and tries again."""
        view = memoryview(data)
        while view:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the lane peer did not take its bytes in time")
            if self._snd > left or self._snd < left / 2:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(left))
                self._snd = left
            try:
                view = view[self.sock.send(view):]
            except BlockingIOError:     # SO_SNDTIMEO ran out: the deadline, or a set one
                self._snd = -1.0        # shorter than it (set anew at the top)

    def close(self) -> None:
        self.sock.close()

    def _recv_timeout(self, seconds: float) -> None:
        if seconds <= 0:
            raise TimeoutError("the lane peer did not send in time")
        if seconds != self._rcv:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))
            self._rcv = seconds

    def _read_into(self, view: memoryview) -> int:
        try:
            k = self.sock.recv_into(view)
        except BlockingIOError:     # SO_RCVTIMEO ran out
            raise TimeoutError("the lane peer did not send in time") from None
        if not k:
            raise EOFError("the lane connection closed")
        return k


def _timeval(seconds: float) -> bytes:
    """A struct timeval for SO_RCVTIMEO / SO_SNDTIMEO (zero would mean no timeout at all)."""
    usec = max(1, int(seconds * 1e6))
    return struct.pack("@ll", usec // 1_000_000, usec % 1_000_000)
