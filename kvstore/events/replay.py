"""One request to an engine's replay socket (vLLM's protocol), answered on a thread of its own.

The protocol, as vLLM's ZmqEventPublisher serves it on its ROUTER socket: a DEALER sends
[b"", start sequence number as 8 bytes big-endian]; the engine answers every batch it still
buffers (its `buffer_steps` last) numbered from `start` on, in order, each as [b"", topic, seq,
payload] (vLLM 0.32; other vLLM versions leave the topic out: both are read), then the end
marker, seq -1. The engine serves it on its publisher thread, all at once; its ROUTER drops
what does not fit in the pipe to a slow reader (a hole in the numbers, counted as missed).

Why a thread: an answer can be thousands of batches sent at once, and the publisher thread,
which reads the relays as seldom as once a second, would let them pile up in ZMQ (or make the
engine's ROUTER drop the rest past its high-water mark). Read as they come, they are held
here, counted against a byte budget. The socket is made, used and closed on that thread (ZMQ
sockets are not thread-safe); the publisher only reads the finished `result`.

Bounds: one request, one absolute deadline from it (a hung or silent engine costs this thread
that long, the publisher nothing), at most `max_bytes` of answer kept (the request stops
there), a frame over MAX_FRAME drops the connection inside ZMQ before it is held, and ZMQ
queues at most RCVHWM frames ahead of the reader.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from .wire import END_SEQ

DEADLINE_S = 5.0            # from the request to the end marker
MAX_FRAME = 8 << 20         # one batch, in bytes (vLLM's are a scheduler step's events)
RCVHWM = 256
POLL_S = 0.1                # how often the thread looks at `cancel`
OVERHEAD = 64               # bytes counted per batch beside its payload (the record kept)


@dataclass
class ReplayResult:
    start: int                                  # the first sequence number asked for
    batches: list[tuple[int, bytes]] = field(default_factory=list)     # (seq, payload)
    complete: bool = False                      # the end marker came
    answered: bool = False                      # anything came
    why: str = ""                               # why it stopped early, for the log


def loopback(endpoint: str) -> tuple[str, bool]:
    """Where to connect to an engine's socket given its own endpoint, verbatim: a wildcard
    host (the engine binds every interface) on this machine; (address, IPv6?)."""
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://"):].rpartition(":")
        if host in ("[::]", "::"):
            return f"tcp://[::1]:{port}", True
        if host == "*":
            return f"tcp://127.0.0.1:{port}", False
        return endpoint, host.startswith("[")
    return endpoint, False


class Replay:
    """Ask `endpoint` (the engine's replay_endpoint, verbatim) for its batches from `start`;
    `result` is None until the answer ended, then a ReplayResult; `wake` is called then."""

    def __init__(self, ctx: zmq.Context, endpoint: str, start: int, max_bytes: int,
                 wake: Callable[[], None], deadline_s: float = DEADLINE_S) -> None:
        self.start = start
        self.endpoint = endpoint
        self.max_bytes = max_bytes
        self.deadline_s = deadline_s
        self.deadline = time.monotonic() + deadline_s
        self.result: ReplayResult | None = None
        self._ctx = ctx
        self._wake = wake
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-events-replay",
                                        daemon=True)
        self._thread.start()

    def cancel(self, wait_s: float = 1.0) -> None:
        """Stop reading (the thread ends within POLL_S) and wait for it up to `wait_s`."""
        self._cancel.set()
        self._thread.join(wait_s)

    def _run(self) -> None:
        out = ReplayResult(self.start)
        sock: zmq.Socket | None = None
        try:
            address, ipv6 = loopback(self.endpoint)
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, RCVHWM)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
            if ipv6:
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(address)
            # queued until the connection is up (a DEALER that connected has its pipe at once)
            sock.send_multipart([b"", self.start.to_bytes(8, "big")], zmq.NOBLOCK)
            self._read(sock, out)
        except zmq.ZMQError as e:
            out.why = f"ZMQ error: {e}"
        except Exception as e:  # noqa: BLE001 - the relay must learn that it ended
            out.why = f"{type(e).__name__}: {e}"
        finally:
            if sock is not None:
                sock.close(0)
            self.result = out
            self._wake()

    def _read(self, sock: zmq.Socket, out: ReplayResult) -> None:
        size = 0
        while True:
            left = self.deadline - time.monotonic()
            if left <= 0:
                out.why = f"no end marker within {self.deadline_s:g} s"
                return
            if self._cancel.is_set():
                out.why = "cancelled"
                return
            if not sock.poll(int(min(left, POLL_S) * 1000) + 1):
                continue
            frames = sock.recv_multipart(zmq.NOBLOCK)
            out.answered = True
            if len(frames) not in (3, 4) or frames[0] != b"" or len(frames[-2]) != 8:
                out.why = "a malformed answer (not [b'', topic?, 8-byte seq, payload])"
                return
            seq_b, payload = frames[-2], frames[-1]
            if seq_b == END_SEQ:
                out.complete = True
                return
            seq = int.from_bytes(seq_b, "big", signed=True)
            if seq < (out.batches[-1][0] + 1 if out.batches else self.start):
                # the engine answers its buffer in order, from `start`
                out.why = f"batch {seq} out of order"
                return
            size += len(payload) + OVERHEAD
            if size > self.max_bytes:
                out.why = f"an answer over events.replay_bytes ({self.max_bytes} bytes)"
                return
            out.batches.append((seq, payload))
