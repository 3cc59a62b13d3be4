"""The KV-events sockets cannot be held against the daemon or against other users' routers.

Before, the PUB and replay sockets accepted every connection from anyone who could reach them
and kept it as long as the peer liked (a descriptor each): one local user could run the
daemon out of descriptors, and so make it refuse its engines' gRPC calls too. Now each bound
socket keeps at most events.max_connections_per_peer connections of one peer (a uid on this
host, else an address) and events.max_connections in all, a new peer past the total taking
the newest place of the peer holding the most (kvstore/events/peers.py). And a replay peer
that asks and never reads holds one reply at most, and all such replies together at most
events.replay_bytes (kvstore/events/stream.py).

Real daemons, real sockets: raw TCP connections (what an attacker needs: libzmq accepts
before any greeting), users told apart by their uid (forked children that setuid), and a
real pyzmq SUB and DEALER for the router that must still get in.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from kvstore_client import connect

from tests.daemon import Daemon, cleanup, start_daemon
from tests.events_helpers import zmq
from tests.test_events_daemon import streams_of
from tests.test_metrics_endpoint import _fds

NOBODY = 65534
DEADLINE_S = 20.0
END = (-1).to_bytes(8, "big", signed=True)
# ZMTP 3.0: signature, version, mechanism NULL, as-server 0, filler (a SUB's opening)
GREETING = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" * 32

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="connecting as other uids needs root")


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _open(port: int, n: int) -> list[socket.socket]:
    out = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(GREETING)
        out.append(s)
    return out


def _closed(s: socket.socket) -> bool:
    """Whether the daemon closed `s` (EOF or reset); what it sent is read and thrown away."""
    try:
        while True:
            r, _, _ = select.select([s], [], [], 0)
            if not r:
                return False
            if not s.recv(65536):
                return True
    except OSError:
        return True


def _wait_open(socks: list[socket.socket], want: int) -> int:
    """How many of `socks` the daemon keeps, once it has closed all but `want` (deadline)."""
    end = time.monotonic() + DEADLINE_S
    while True:
        left = sum(not _closed(s) for s in socks)
        if left <= want or time.monotonic() > end:
            return left
        time.sleep(0.1)


def _hold_as(uid: int, port: int, n: int, ready, stop, kept) -> None:
    """In a forked child: become `uid`, open n raw connections, say how many the daemon
    kept, hold them until `stop`."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    socks = _open(port, n)
    _wait_open(socks, 3)
    time.sleep(1.0)                 # ...and the last ones, past the total, are shut too
    kept.put(sum(not _closed(s) for s in socks))
    ready.set()
    stop.wait(120)
    for s in socks:
        s.close()


def _router_as(uid: int, pub: str, replay: str, out) -> None:
    """In a forked child: become `uid` and do what a router does: subscribe, and ask the
    replay socket for everything; put (a message came on the SUB, the replay ended) on
    `out`."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    ctx = zmq.Context()
    got_sub = got_end = False
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub)
        req = ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(replay)
        req.send_multipart([b"", (0).to_bytes(8, "big")])
        end = time.monotonic() + DEADLINE_S     # the daemon's heartbeat is every 5 s
        while time.monotonic() < end and not (got_sub and got_end):
            if not got_sub and sub.poll(100):
                sub.recv_multipart()
                got_sub = True
            while not got_end and req.poll(0):
                got_end = req.recv_multipart()[-2] == END
    finally:
        out.put((got_sub, got_end))
        ctx.destroy(0)


def _replay(replay: str) -> None:
    """One replay, asked and read by us: the daemon's first starts pyzmq's thread that frees
    the frames it shares with libzmq (its own context: a few descriptors, once)."""
    ctx = zmq.Context()
    try:
        req = ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(replay)
        req.send_multipart([b"", (0).to_bytes(8, "big")])
        end = time.monotonic() + DEADLINE_S
        while time.monotonic() < end:
            if req.poll(100) and req.recv_multipart()[-2] == END:
                return
        raise AssertionError("no replay within the deadline")
    finally:
        ctx.destroy(0)


@contextmanager
def _daemon(tmp_path: Path, total: int, per_peer: int) -> Iterator[tuple[Daemon, str, str]]:
    d = start_daemon(tmp_path, {"events.enabled": "true",
                                "events.endpoint": "tcp://127.0.0.1:0",
                                "events.replay_endpoint": "tcp://127.0.0.1:0",
                                "events.max_connections": str(total),
                                "events.max_connections_per_peer": str(per_peer)})
    try:
        pub, replay = streams_of(d)["node"]
        _replay(replay)
        time.sleep(1.0)             # the after-ready warm-ups' threads come and go
        yield d, pub, replay
    finally:
        cleanup(d)


def _router_gets_in(uid: int, pub: str, replay: str) -> tuple[bool, bool]:
    ctx = multiprocessing.get_context("fork")
    out = ctx.SimpleQueue()
    child = ctx.Process(target=_router_as, args=(uid, pub, replay, out))
    child.start()
    child.join(DEADLINE_S + 10)
    if child.is_alive():
        child.kill()
    return out.get() if not out.empty() else (False, False)


@needs_root
def test_one_user_holds_only_its_share(tmp_path):
    """200 connections of ours (uid 0) to each socket: the daemon keeps 3 of each (its
    descriptors grow by that much, not by 400), and a router of user nobody still subscribes
    and gets a replay."""
    with _daemon(tmp_path, total=16, per_peer=3) as (d, pub, replay):
        pid = d.proc.pid
        fds0 = _fds(pid)
        socks = _open(_port(pub), 200) + _open(_port(replay), 200)
        try:
            assert _wait_open(socks[:200], 3) == 3
            assert _wait_open(socks[200:], 3) == 3
            assert _fds(pid) <= fds0 + 2 * 3 + 4, (fds0, _fds(pid))
            assert _router_gets_in(NOBODY, pub, replay) == (True, True)
            assert _fds(pid) <= fds0 + 2 * 3 + 4, (fds0, _fds(pid))
        finally:
            for s in socks:
                s.close()
        assert "shut" in d.output() and "events.max_connections_per_peer" in d.output()
        # 197 + 197 shut, counted for operators (the publisher copies the count once a tick)
        end = time.monotonic() + DEADLINE_S
        with connect(d.address) as c:
            while (shut := c.stats()["counters"].get("events_connections_shut", 0)) < 394:
                assert time.monotonic() < end, f"events_connections_shut {shut}, want >= 394"
                time.sleep(0.1)


@needs_root
def test_a_new_user_gets_in_past_the_total(tmp_path):
    """Three users fill the PUB socket's total (8: 3 + 3 + 2 kept, the third user's last
    refused); a router of a fourth user takes the place of the newest connection of a user
    holding the most, and the daemon holds 8 connections still."""
    with _daemon(tmp_path, total=8, per_peer=3) as (d, pub, replay):
        pid = d.proc.pid
        fds0 = _fds(pid)
        ctx = multiprocessing.get_context("fork")
        stop, kept = ctx.Event(), ctx.SimpleQueue()
        children = []
        try:
            for uid in (60001, 60002, 60003):       # one after the other: the order is known
                ready = ctx.Event()
                child = ctx.Process(target=_hold_as,
                                    args=(uid, _port(pub), 5, ready, stop, kept))
                child.start()
                children.append(child)
                assert ready.wait(DEADLINE_S + 5)
            assert sorted(kept.get() for _ in children) == [2, 3, 3]
            assert _fds(pid) <= fds0 + 8 + 2, (fds0, _fds(pid))
            assert _router_gets_in(NOBODY, pub, replay) == (True, True)
            assert _fds(pid) <= fds0 + 8 + 2, (fds0, _fds(pid))
        finally:
            stop.set()
            for child in children:
                child.join(30)
                if child.is_alive():
                    child.kill()


class ReplayPeers:
    """A real Stream holding eight 4 MiB batches (replay_bytes 48 MiB), and DEALER peers of
    its replay socket that read no further than they must (they never read here)."""

    def __init__(self, tmp_path) -> None:
        from kvstore.events.stream import Stream

        self.ctx = zmq.Context()
        self.stream = Stream(self.ctx, "node", "events.", "tcp://127.0.0.1:0",
                             "tcp://127.0.0.1:0", "", 0, 1000, 100, tmp_path, [],
                             replay_bytes=48 << 20)
        self.peers: list[zmq.Socket] = []
        for i in range(8):
            self.stream.send([bytes([0xC6]) + (4 << 20).to_bytes(4, "big")
                              + bytes([i]) * (4 << 20)])

    def peer(self) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, 1)
        s.setsockopt(zmq.RCVBUF, 4096)
        s.connect(self.stream.replay_address)
        self.peers.append(s)
        return s

    def ask(self, s: zmq.Socket) -> str:
        """Ask from 0; "served" or "refused", once the stream has read the request."""
        counters = self.stream.counters
        before = dict(counters)
        s.send_multipart([b"", (0).to_bytes(8, "big")])
        end = time.monotonic() + DEADLINE_S
        while time.monotonic() < end:
            self.stream.serve_replay()
            if counters["replays"] > before["replays"]:
                return "served"
            if counters.get("replays_refused", 0) > before.get("replays_refused", 0):
                return "refused"
            time.sleep(0.01)
        raise AssertionError("the request was not read within the deadline")

    def close(self) -> None:
        for s in self.peers:
            s.close(0)
        self.stream.close(linger_s=0)
        self.ctx.term()


def test_unread_replays_are_bounded_in_bytes(tmp_path):
    """Peers that ask the replay socket for 32 MiB and never read: the first is served and
    holds it (ZMQ queues what the kernel does not take), its second request and another
    peer's are refused (32 + 32 MiB would pass replay_bytes, 48 MiB), and once the first peer
    leaves, the other is served. Before, each was served: N peers, N x 32 MiB queued."""
    rp = ReplayPeers(tmp_path)
    try:
        a, b = rp.peer(), rp.peer()
        assert rp.ask(a) == "served"
        assert rp.ask(a) == "refused"       # its last reply is unread
        assert rp.ask(b) == "refused"       # a's 32 MiB + b's 32 MiB > 48 MiB
        a.close(0)
        end = time.monotonic() + DEADLINE_S
        while (result := rp.ask(b)) == "refused" and time.monotonic() < end:
            time.sleep(0.1)                 # a's pipe goes with it, and its reply
        assert result == "served"
        assert b.poll(int(DEADLINE_S * 1000))   # ...and that reply is there to be read
    finally:
        rp.close()


def test_a_replay_left_unread_has_its_connection_cut_for_the_next(tmp_path, monkeypatch):
    """A peer that asks for 32 MiB and neither reads nor leaves: another peer's request is
    refused while that reply sits unread, and once it has sat REPLAY_UNREAD_S the refusal
    cuts the idle peer's connection (checked against its socket's inode), libzmq drops its
    reply, and the other peer is served. Before, the idle peer held the room for as long as
    it stayed connected."""
    from kvstore.events import stream as stream_mod

    monkeypatch.setattr(stream_mod, "REPLAY_UNREAD_S", 0.5)
    rp = ReplayPeers(tmp_path)
    try:
        idle, other = rp.peer(), rp.peer()
        assert rp.ask(idle) == "served"
        assert rp.ask(other) == "refused"       # within the deadline: the room is idle's
        assert rp.stream.counters.get("replays_cut", 0) == 0
        time.sleep(0.6)
        end = time.monotonic() + DEADLINE_S
        while (result := rp.ask(other)) == "refused" and time.monotonic() < end:
            time.sleep(0.1)
        assert result == "served"
        assert rp.stream.counters.get("replays_cut", 0) == 1
        assert other.poll(int(DEADLINE_S * 1000))
    finally:
        rp.close()


def _daemon_end(pid: int, mine: socket.socket) -> socket.socket | None:
    """The daemon's end of our connection `mine`: a duplicate of its descriptor, taken with
    pidfd_getfd(2) (root), whose peer is our socket's own address."""
    import ctypes

    want = mine.getsockname()
    pidfd = os.pidfd_open(pid)
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        for name in os.listdir(f"/proc/{pid}/fd"):
            try:
                if not os.readlink(f"/proc/{pid}/fd/{name}").startswith("socket:"):
                    continue
            except OSError:
                continue
            fd = libc.syscall(438, pidfd, int(name), 0)  # SYS_pidfd_getfd, on every arch
            if fd < 0:
                continue
            s = socket.socket(fileno=fd)
            try:
                if s.family == socket.AF_INET and s.getpeername() == want:
                    return s
            except OSError:
                pass
            s.close()
        return None
    finally:
        os.close(pidfd)


@needs_root
def test_kept_tcp_connections_get_keepalives_and_a_user_timeout(tmp_path):
    """A router host that vanishes leaves its connections half-open: with keepalives and
    TCP_USER_TIMEOUT on the daemon's end of each connection it keeps, the kernel drops them
    within about a minute instead of never (idle) or ~15 minutes of retransmits (streaming)."""
    from kvstore.events import peers

    with _daemon(tmp_path, total=16, per_peer=3) as (d, pub, replay):
        for port in (_port(pub), _port(replay)):
            (mine,) = _open(port, 1)
            try:
                end, got = time.monotonic() + DEADLINE_S, None
                while True:
                    theirs = _daemon_end(d.proc.pid, mine)
                    if theirs is not None:
                        with theirs:
                            opt = theirs.getsockopt
                            got = (opt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                                   opt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                                   opt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT))
                        if got[0]:      # (tuned by the guard's thread, after the accept)
                            break
                    assert time.monotonic() < end, f"port {port}: not tuned: {got}"
                    time.sleep(0.1)
                assert got == (1, peers.KEEPALIVE_IDLE_S, peers.USER_TIMEOUT_S * 1000)
                assert not _closed(mine)
            finally:
                mine.close()
