"""A replay from an engine's replay socket (vLLM's protocol), read on a thread of its own.

The protocol, as vLLM's ZmqEventPublisher serves it on its ROUTER socket: a DEALER sends
[b"", start sequence number as 8 bytes big-endian]; the engine answers every batch it still
buffers (its `buffer_steps` last) numbered from `start` on, in order, each as [b"", topic, seq,
payload] (vLLM 0.32; other vLLM versions leave the topic out: both are read), then the end
marker, seq -1. The engine serves it on its publisher thread, all at once, and its ROUTER
silently drops what does not fit in the pipe to a slow reader (its SNDHWM, 1000 messages, and
ours, RCVHWM): a long answer to a reader that falls behind loses batches in the middle (a hole
in the numbers) or its tail, end marker included (the answer goes quiet).

Why ask again: the engine still buffers what its ROUTER dropped. A hole (a number past the
next one wanted, after a round's first batch) or an answer quiet for QUIET_S before its end
marker ends the round, and the next round asks, on a new DEALER (the old answer's rest dies
with the old one), from the first missing number; each round gets at least what the pipe
holds, so a replay of the whole buffer takes a few rounds even to a stalled reader. A round's
first batch may be past the number asked for: the engine's buffer no longer has those (the
relay counts them lost), which asking again cannot change.

Why a thread: an answer can be thousands of batches sent at once, and the publisher thread,
which reads the relays as seldom as once a second, would let them pile up in ZMQ (or make the
engine's ROUTER drop more). Read as they come, they are held here, counted against a byte
budget. The sockets are made, used and closed on that thread (ZMQ sockets are not
thread-safe); the publisher only reads the finished `result`.

Bounds: one absolute deadline from the first request for every round (a hung or silent engine
costs this thread that long, the publisher nothing), at most MAX_ROUNDS requests (and one
asks again only after it brought a batch); at most `max_bytes` of answer kept (the replay stops
there); a frame over MAX_FRAME drops the connection inside ZMQ before it is held, and ZMQ
queues at most RCVHWM frames ahead of the reader.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from .wire import END_SEQ

DEADLINE_S = 5.0            # from the first request to the end marker
MAX_ROUNDS = 16             # requests a replay makes (the engine's 10000 batches take ~8)
QUIET_S = 0.5               # an answer this long silent before its end marker: its tail dropped
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
    rounds: int = 0                             # requests made (more than 1: drops re-asked)


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
    `result` is None until the replay ended (its last round), then a ReplayResult; `wake` is
    called then."""

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
        self._size = 0                  # bytes kept, against max_bytes
        self._thread = threading.Thread(target=self._run, name="kvstore-events-replay",
                                        daemon=True)
        self._thread.start()

    def cancel(self, wait_s: float = 1.0) -> None:
        """Stop reading (the thread ends within POLL_S) and wait for it up to `wait_s`."""
        self._cancel.set()
        self._thread.join(wait_s)

    def _run(self) -> None:
        out = ReplayResult(self.start)
        try:
            while self._round(out):
                pass
        except zmq.ZMQError as e:
            out.why = f"ZMQ error: {e}"
        except Exception as e:  # noqa: BLE001 - the relay must learn that it ended
            out.why = f"{type(e).__name__}: {e}"
        finally:
            self.result = out
            self._wake()

    def _round(self, out: ReplayResult) -> bool:
        """One request, from the first number not yet in `out`, on a DEALER of its own; True
        when its answer lost batches and another round may fetch them."""
        if out.rounds >= MAX_ROUNDS:
            out.why = f"batches still dropped after {MAX_ROUNDS} requests"
            return False
        out.rounds += 1
        address, ipv6 = loopback(self.endpoint)
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, RCVHWM)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
            if ipv6:
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(address)
            want = out.batches[-1][0] + 1 if out.batches else self.start
            # queued until the connection is up (a DEALER that connected has its pipe at once)
            sock.send_multipart([b"", want.to_bytes(8, "big")], zmq.NOBLOCK)
            dropped = self._read(sock, out, want)
        finally:
            sock.close(0)
        return dropped

    def _read(self, sock: zmq.Socket, out: ReplayResult, want: int) -> bool:
        """Read one answer into `out`; True when the engine dropped some of it (module
        docstring), False when it ended (`complete`) or stopped (`why`). A drop is seen only
        after a batch of this answer was kept: a round that asks again brought something."""
        last = 0.0                      # when this answer's last message came (0: none yet)
        while True:
            now = time.monotonic()
            left = self.deadline - now
            if left <= 0:
                out.why = f"no end marker within {self.deadline_s:g} s"
                return False
            if self._cancel.is_set():
                out.why = "cancelled"
                return False
            if not sock.poll(int(min(left, POLL_S) * 1000) + 1):
                # (looked at only when nothing is queued: this thread may have been the slow one)
                if last and time.monotonic() - last >= QUIET_S:
                    return True         # the tail, end marker included, was dropped
                continue
            frames = sock.recv_multipart(zmq.NOBLOCK)
            out.answered = True
            if len(frames) not in (3, 4) or frames[0] != b"" or len(frames[-2]) != 8:
                out.why = "a malformed answer (not [b'', topic?, 8-byte seq, payload])"
                return False
            seq_b, payload = frames[-2], frames[-1]
            if seq_b == END_SEQ:
                out.complete = True
                return False
            seq = int.from_bytes(seq_b, "big", signed=True)
            if seq < want:
                # the engine answers its buffer in order, from the number asked for
                out.why = f"batch {seq} out of order"
                return False
            if seq > want and last:
                return True             # a hole: batches want..seq-1 dropped
            last = time.monotonic()
            self._size += len(payload) + OVERHEAD
            if self._size > self.max_bytes:
                out.why = f"an answer over events.replay_bytes ({self.max_bytes} bytes)"
                return False
            out.batches.append((seq, payload))
            want = seq + 1
