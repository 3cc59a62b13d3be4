"""One event stream: a ZMQ PUB socket, its sequence numbers, replay buffer and replay socket.

Used by the publisher thread only (ZMQ sockets are not thread-safe); bound by the daemon's
start, so an address in use is an operator error there (EventsAddressError), not later.
Nothing here blocks: PUB drops messages for a subscriber past its high-water mark, ROUTER drops
replies to a peer past its own, and replay requests are served at a bounded rate. What peers
may hold of the daemon: connections, so many per peer and in all (peers.py, on a thread of its
own); replies queued unread, one replay per connection and `replay_bytes` in all (serve_replay).
"""

from __future__ import annotations

import errno
import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import zmq

from . import wire
from .errors import EventsAddressError
from .peers import ConnRef, Guard, connection_of, cut
from .seqfile import SeqFile

log = logging.getLogger("kvstore.events")

REPLAY_EVERY_S = 0.05       # one replay request per stream this often; the rest wait in ZMQ
# ...and, after one, as much longer as its batches take at this rate: a peer asking again and
# again for the whole buffer costs the publisher a bounded share of a core, not all of it.
REPLAY_BATCHES_PER_S = 50000
# Frames a peer may send, in bytes; a larger one makes libzmq drop that peer. A subscription
# is a topic prefix (a byte more on the wire), a replay request 8 bytes: legitimate ones are
# far below these.
SUB_MAX_BYTES = 4096
REPLAY_MAX_BYTES = 64
LOG_EVERY_S = 10.0          # bad replay requests: one log line this often, with the count
REPLAY_OVERHEAD = 64        # bytes counted per replayed batch beside its payload (frames, headers)
# A reply still unread this long after it was queued: its connection is cut when another
# request needs its room (a router reads a replay within seconds: vLLM's own waits 5 s).
REPLAY_UNREAD_S = 10.0


@dataclass
class _Unread:
    """A reply queued in ZMQ for one peer and not yet taken (serve_replay)."""

    tracker: zmq.MessageTracker     # of its end marker: done once the whole reply left ZMQ
    size: int                       # bytes counted against replay_bytes
    deadline: float                 # monotonic: past it, `conn` may be cut
    conn: ConnRef | None            # the peer's connection (None: not known, never cut)
    cut: bool = False


def bind(sock: zmq.Socket, address: str, key: str) -> str:
    """Bind, or EventsAddressError naming the setting; the address actually bound."""
    try:
        sock.bind(address)
    except zmq.ZMQError as e:
        why = {errno.EADDRINUSE: "is already in use by another process",
               errno.EADDRNOTAVAIL: "names an address that is not on this machine",
               errno.EACCES: "needs privileges (ports below 1024)",
               errno.ENODEV: "names no interface of this machine"}.get(
                   e.errno, f"cannot be bound ({e.strerror})")
        raise EventsAddressError(f"{key} = {address!r} {why}; set it to another address") \
            from None
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class Stream:
    def __init__(self, ctx: zmq.Context, name: str, key: str, endpoint: str, replay: str,
                 topic: str, dp_rank: int, hwm: int, buffer_steps: int, seq_dir: Path,
                 models: list[str], replay_bytes: int = 64 << 20,
                 guard: Guard | None = None) -> None:
        self.name = name
        self.dp_rank = dp_rank
        self.models = models
        self.topic = topic.encode()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=max(buffer_steps, 1))
        self.buffer_bytes = 0
        self.max_buffer_bytes = replay_bytes
        # XPUB: a PUB that also hands up each subscription (VERBOSE: repeats too), so a
        # router that (re)subscribes is told what the daemon holds (publisher.py).
        # MAXMSGSIZE: libzmq keeps each subscription in its trie (about a node per byte, for
        # the whole connection); a peer sending a frame past it is dropped before it is held.
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.pub.setsockopt(zmq.MAXMSGSIZE, max(SUB_MAX_BYTES, len(self.topic) + 64))
        self.pub.setsockopt(zmq.SNDHWM, hwm)
        self.pub.setsockopt(zmq.RCVHWM, 1000)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.replay: zmq.Socket | None = None
        self.guard = guard
        try:
            self.address = bind(self.pub, endpoint, key + "endpoint")
            if guard is not None:
                guard.watch(self.pub, self.address, f"{key}endpoint {self.address}")
            if replay:
                self.replay = ctx.socket(zmq.ROUTER)
                self.replay.setsockopt(zmq.LINGER, 0)
                self.replay.setsockopt(zmq.MAXMSGSIZE, REPLAY_MAX_BYTES)
                # a peer whose queue is full raises zmq.Again at once (MANDATORY), so one that
                # does not read its last replay costs one failed send, not a walk of the buffer
                self.replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                # room for one whole replay per peer (a peer gets one at a time)
                self.replay.setsockopt(zmq.SNDHWM, (self.buffer.maxlen or 0) + 2)
                self.replay_address = bind(self.replay, replay, key + "replay_endpoint")
                if guard is not None:
                    guard.watch(self.replay, self.replay_address,
                                f"{key}replay_endpoint {self.replay_address}")
        except BaseException:
            self.close(linger_s=0)
            raise
        self.seq = SeqFile(seq_dir / f"{name}.seq")
        self.counters: dict[str, int] = {"batches": 0, "events": 0, "replays": 0,
                                         "bad_replay_requests": 0, "subscriptions": 0,
                                         "replays_refused": 0, "replays_cut": 0}
        # Replies queued in ZMQ and not yet taken by their peer: peer identity -> (tracker of
        # the reply's end marker, its bytes). A peer's messages leave its pipe in order, so
        # once the end marker is released (sent to the kernel, or dropped with the peer) the
        # whole reply is.
        self._unread: dict[bytes, _Unread] = {}
        self.replay_at = 0.0            # when the next replay request may be served
        self.sent_at = time.monotonic()
        self._bad_logged = 0.0
        self._bad_unlogged = 0
        self._refused_logged = 0.0
        self._refused_unlogged = 0

    def send(self, events: list[bytes], ts: float | None = None,
             dp_rank: int | None = None, empty_ok: bool = False) -> None:
        """One batch of encoded events (wire.py); an empty one only with `empty_ok` (a
        heartbeat, publisher.py)."""
        if not events and not empty_ok:
            return
        self.sent_at = time.monotonic()
        payload = wire.encode_batch(time.time() if ts is None else ts, events,
                                    self.dp_rank if dp_rank is None else dp_rank)
        seq = self.seq.take()
        try:
            # copy=False: every subscriber's queue and the replay buffer share one payload,
            # so a subscriber that never reads costs hwm message headers, not hwm payloads
            self.pub.send_multipart((self.topic, wire.seq_bytes(seq), payload), zmq.NOBLOCK,
                                    copy=False)
        except zmq.Again:
            pass                        # nobody can take it now: replay still has it
        if len(self.buffer) == self.buffer.maxlen:
            self.buffer_bytes -= len(self.buffer[0][1])
        self.buffer.append((seq, payload))
        self.buffer_bytes += len(payload)
        while self.buffer_bytes > self.max_buffer_bytes and len(self.buffer) > 1:
            self.buffer_bytes -= len(self.buffer.popleft()[1])
        self.counters["batches"] += 1
        self.counters["events"] += len(events)

    def subscribed(self) -> bool:
        """Whether a consumer subscribed since the last call (the messages are drained)."""
        got = False
        for _ in range(1000):
            try:
                msg = self.pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            got = got or msg[:1] == b"\x01"
        if got:
            self.counters["subscriptions"] += 1
        return got

    def serve_replay(self) -> None:
        """Answer one waiting replay request (vLLM's protocol), at most every REPLAY_EVERY_S
        and no faster than REPLAY_BATCHES_PER_S batches; the publisher polls the socket only
        once `replay_at` has come (a request left unread would otherwise make it spin).

        A request is [identity, b"", 8-byte start sequence number]; the answer is every
        buffered batch from that number on (all of them when it is long gone), then the end
        marker. Anything else is dropped and counted, logged once per LOG_EVERY_S.

        Why replies are bounded by bytes too: pyzmq copies every frame under 64 KiB (its copy
        threshold) into each reply, and the larger ones it shares pin payloads the buffer has
        since let go, so each peer that asks and never reads would hold up to `replay_bytes`
        of the daemon's memory (its pipe holds a whole replay), for as long as it stays
        connected. So a peer gets one replay at a time (a request while its last reply is
        unread is refused), and a request is refused while the replies queued unread and
        its own would pass `replay_bytes` (one is always served when none is queued). A
        refused request gets no answer (the router's own deadline tells it); counted
        (replays_refused), logged once per LOG_EVERY_S. A reply left unread REPLAY_UNREAD_S
        has its connection cut (through peers.cut, checked against the socket's inode) when
        a request is refused, so a peer that asks and never reads holds the room for that
        long, not for as long as it stays connected; counted (replays_cut)."""
        if self.replay is None:
            return
        now = time.monotonic()
        if now < self.replay_at:
            return
        try:
            msg = self.replay.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        frames = [f.bytes for f in msg]
        self.replay_at = now + REPLAY_EVERY_S
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self._bad(f"{len(frames)} frames" if len(frames) != 3 else
                      f"a start of {len(frames[2])} bytes, not 8")
            return
        cid, start = frames[0], int.from_bytes(frames[2], "big")
        answer = [(seq, buf) for seq, buf in self.buffer if seq >= start]
        size = sum(len(buf) + REPLAY_OVERHEAD for _, buf in answer) + REPLAY_OVERHEAD
        self._unread = {k: u for k, u in self._unread.items() if not u.tracker.done}
        queued = sum(u.size for u in self._unread.values())
        if cid in self._unread or (queued and queued + size > self.max_buffer_bytes):
            self._refused(cid in self._unread, queued)
            self._cut_stale(now)
            return
        self.counters["replays"] += 1
        sent = 0
        try:
            for seq, buf in answer:
                self.replay.send_multipart((cid, b"", self.topic, wire.seq_bytes(seq), buf),
                                           zmq.NOBLOCK, copy=False)
                sent += 1
            end = zmq.Frame(wire.END_SEQ, track=True, copy=False)
            self.replay.send_multipart((cid, b"", b"", end, b""), zmq.NOBLOCK)
            self._unread[cid] = _Unread(end.tracker, size, now + REPLAY_UNREAD_S,
                                        self._conn(msg[-1]))
        except zmq.ZMQError:
            pass                        # that peer left (EHOSTUNREACH), or its pipe is full
                                        # (not of ours: one replay at a time): the rest is
                                        # dropped
        self.replay_at += sent / REPLAY_BATCHES_PER_S

    def _conn(self, frame: zmq.Frame) -> ConnRef | None:
        """The connection a request came on (libzmq's ZMQ_SRCFD of its message)."""
        try:
            return connection_of(frame.get(zmq.SRCFD), self.replay_address)
        except (zmq.ZMQError, OSError, ValueError):
            return None

    def _cut_stale(self, now: float) -> None:
        """Cut the connections whose replies sat unread past their deadlines: libzmq then
        drops the reply, and its room is free for the next request."""
        for u in self._unread.values():
            if not u.cut and u.conn is not None and now >= u.deadline:
                u.cut = True
                if cut(u.conn):
                    self.counters["replays_cut"] += 1
                    log.warning("events: stream %s: cut a replay peer that left its reply "
                                "(%d bytes) unread for %g s", self.name, u.size,
                                REPLAY_UNREAD_S)

    def _refused(self, own: bool, queued: int) -> None:
        self.counters["replays_refused"] += 1
        self._refused_unlogged += 1
        now = time.monotonic()
        if now - self._refused_logged >= LOG_EVERY_S:
            log.warning("events: stream %s: refused %d replay request(s) (last: %s)", self.name,
                        self._refused_unlogged,
                        "its peer had not read its last reply yet" if own else
                        f"{queued} bytes of replies queued unread; events.replay_bytes = "
                        f"{self.max_buffer_bytes}")
            self._refused_logged, self._refused_unlogged = now, 0

    def _bad(self, what: str) -> None:
        self.counters["bad_replay_requests"] += 1
        self._bad_unlogged += 1
        now = time.monotonic()
        if now - self._bad_logged >= LOG_EVERY_S:
            log.warning("events: stream %s: dropped %d malformed replay request(s) (last: %s); "
                        "a request is one 8-byte big-endian start sequence number", self.name,
                        self._bad_unlogged, what)
            self._bad_logged, self._bad_unlogged = now, 0

    def close(self, linger_s: float = 1.0) -> None:
        """Close the sockets, giving what is queued `linger_s` to leave (the guard's
        monitors first: the context waits for them)."""
        if self.guard is not None:
            self.guard.close()
        if getattr(self, "seq", None) is not None:
            self.seq.close()
        for sock in (self.pub, self.replay):
            if sock is not None and not sock.closed:
                sock.close(linger=int(linger_s * 1000))
