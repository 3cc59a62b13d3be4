"""Attacks on the Unix sockets beside the gRPC one: the handshake (`<socket>.auth`) and the
fast lane (`<socket>.lane`), by a local user with no credential (another uid) and by a tenant
with its own token (docs/security.md, Limits).

Before: the handshake served one connection at a time with a timeout per read (three silent
connections locked every client out, one trickling byte kept it so for hours, and the SDK
raised a raw TimeoutError); the lane allocated whatever frame length a peer announced (up to
64 MiB) before reading it, gave its 256 slots to connections that had not said hello, and a
client refused once stayed off the lane for good; one FIFO of 4,096 sessions let tenant B
push A's session out.
"""

from __future__ import annotations

import shutil
import socket
import time

import numpy as np
import pytest
from kvstore_client import DeadlineExceeded, KVLayout, KVStoreError, Unavailable, connect
from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client._proto import kvstore_pb2_grpc as pbg
from kvstore_client.common.handoff import handshake, handshake_path
from kvstore_client.common.lane_wire import HEADER, MAX_FRAME, METHOD_ID, lane_path

from tests import other_uid
from tests.daemon import cleanup, start_daemon
from tests.trust_net_helpers import (
    TOKENS,
    channel,
    closed_within,
    hello,
    other_uid_child,
    read_line,
    settled,
    status,
    tenants_file,
    world_readable_dir,
)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=16, dtype="bfloat16")
DEADLINE_S = 2.0            # limits.hello_deadline_s and limits.frame_deadline_s here

# Run under another uid: open N connections to PATH, trickle a byte every 0.3 s on the first,
# say how many the daemon let wait, then report how long the longest took to be closed.
SILENT = """
path, n = sys.argv[1], int(sys.argv[2])
socks, refused = [], 0
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    socks.append(s)
t0 = time.monotonic()
open_ = list(socks)
for s in socks:                 # a refusal is an answer line and a close, at once
    r, _, _ = select.select([s], [], [], 0.2)
    if r and s.recv(4096, socket.MSG_PEEK).startswith(b'{"error": "RESOURCE_EXHAUSTED"'):
        refused += 1
        open_.remove(s)
print("waiting", len(open_), "refused", refused, flush=True)
last = 0.0
while open_ and time.monotonic() - t0 < 30:
    try:
        open_[0].send(b" ")     # the trickle: a byte at a time, never a line
    except OSError:
        pass
    r, _, _ = select.select(open_, [], [], 0.3)
    for s in r:
        try:
            got = s.recv(65536, socket.MSG_PEEK)
        except OSError:
            got = b""
        if not got or b"\\n" in got:       # closed, or the daemon's last line before it
            open_.remove(s)
            last = time.monotonic() - t0
print("closed", len(socks) - len(open_), "of", len(socks), "last", round(last, 2), flush=True)
sys.stdin.read()
"""


def other_uid_or_skip() -> None:
    why = other_uid.skip_reason()
    if why:
        pytest.skip(why)


@pytest.fixture(scope="module")
def world():
    base = world_readable_dir()
    d = start_daemon(base, {"auth.tokens_file": str(tenants_file(base)),
                            "limits.hello_deadline_s": DEADLINE_S,
                            "limits.frame_deadline_s": DEADLINE_S})
    try:
        yield d
    finally:
        cleanup(d)
        shutil.rmtree(base, ignore_errors=True)


def lane_calls(d) -> int:
    import urllib.request
    text = urllib.request.urlopen(d.metrics_url, timeout=10).read().decode()
    line = next(x for x in text.splitlines() if x.startswith("kvstore_lane_calls_total "))
    return int(float(line.split()[1]))


def test_silent_handshakes_of_another_user_block_no_one(world) -> None:
    """Finding 3: another uid opens 40 connections to `<socket>.auth` and never finishes a
    line (one trickles a byte every 0.3 s): it may keep limits.pending_per_uid of them waiting,
    the rest are refused at once, every one is closed at the deadline from its connect, and
    meanwhile every handshake of ours is answered at once."""
    other_uid_or_skip()
    child = other_uid_child(SILENT, handshake_path(world.socket), "40")
    path = handshake_path(world.socket)
    try:
        waiting = read_line(child, 30).split()
        assert waiting[0] == "waiting" and int(waiting[1]) <= 16 and int(waiting[3]) >= 24
        for _ in range(5):
            s = handshake(path, "", timeout=5)              # uid 0: tenant a
            assert s.tenant == "a"
            s.close_fds()
        closed = read_line(child, 40).split()
        assert closed[1] == closed[3], closed                # every one closed by the daemon
        assert float(closed[5]) <= DEADLINE_S + 3, closed    # at the deadline, not per read
    finally:
        child.kill()


def test_the_sdk_handshake_raises_only_its_own_errors(tmp_path) -> None:
    """Finding 3: a handshake socket that accepts and never answers is a DeadlineExceeded
    after the timeout (one deadline, not one per read), one that hangs up is Unavailable:
    both the SDK's documented errors, never a bare TimeoutError or OSError."""
    path = str(tmp_path / "x.sock.auth")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)
    try:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded) as ei:
            handshake(path, "", timeout=0.5)
        assert isinstance(ei.value, KVStoreError) and time.monotonic() - t0 < 3
        conn, _ = srv.accept()
        conn.close()
        srv.settimeout(5)

        def hang_up() -> None:
            c, _ = srv.accept()
            c.close()
        import threading
        t = threading.Thread(target=hang_up)
        t.start()
        with pytest.raises(Unavailable):
            handshake(path, "", timeout=5)
        t.join(5)
    finally:
        srv.close()


def test_lane_frames_cost_only_the_bytes_they_carry(world) -> None:
    """Finding 4: a tenant's lane connections announce frames they never send. Past the
    largest valid request (lane_wire.MAX_FRAME, from the protocol's limits) the daemon hangs
    up unread; below it, it holds only what arrived, and hangs up at the frame deadline."""
    path = lane_path(world.socket)
    pid = world.proc.pid
    settled(world)
    before = status(pid)["VmHWM"]
    token_line = b'{"v": 1, "token": "%s"}\n' % TOKENS["a"].encode()
    socks = []
    for announce in [64 << 20] * 6 + [MAX_FRAME + 1] + [MAX_FRAME] * 6:
        s, reply = hello(path, token_line)
        assert reply == {"ok": True}
        s.sendall(HEADER.pack(announce, METHOD_ID["Commit"]) + b"\x00" * 1024)
        socks.append((announce, s))
    t0 = time.monotonic()
    for announce, s in socks:
        assert closed_within(s, DEADLINE_S + 5) == b""
        if announce > MAX_FRAME:
            assert time.monotonic() - t0 < DEADLINE_S, "an oversize frame was waited for"
        s.close()
    grew_mib = (status(pid)["VmHWM"] - before) / 1024
    assert grew_mib < 24, f"daemon peak memory grew by {grew_mib:.0f} MiB"
    with connect(world.address, token=TOKENS["a"]) as c:      # the lane still serves
        before_calls = lane_calls(world)
        c.namespace(LAYOUT, model="m").lookup(np.arange(32))
        assert lane_calls(world) > before_calls


def test_silent_lane_connections_leave_room_for_others(world) -> None:
    """Finding 6: another uid opens 300 lane connections and says no hello: it holds its own
    limits.pending_per_uid of them at most, and a tenant's client still gets the lane."""
    other_uid_or_skip()
    child = other_uid_child(SILENT, lane_path(world.socket), "300")
    try:
        waiting = read_line(child, 60).split()
        assert int(waiting[1]) <= 16 and int(waiting[3]) >= 284, waiting
        before = lane_calls(world)
        with connect(world.address, token=TOKENS["a"]) as c:
            ns = c.namespace(LAYOUT, model="m")
            for _ in range(3):
                ns.lookup(np.arange(32))
            assert c._lane is not None and c._lane.refusals == 0
        assert lane_calls(world) - before >= 3
        closed = read_line(child, 40).split()
        assert closed[1] == closed[3] and float(closed[5]) <= DEADLINE_S + 3, closed
    finally:
        child.kill()


def test_the_sdk_retries_the_lane_after_a_refusal(tmp_path) -> None:
    """Finding 6: a client refused by the lane (its tenant's connections are all in use)
    serves its calls over gRPC meanwhile and is back on the lane once there is room."""
    d = start_daemon(tmp_path, {"auth.tokens_file": str(tenants_file(tmp_path)),
                                "limits.lane_per_tenant": 1})
    try:
        path = lane_path(d.socket)
        holder, reply = hello(path, b'{"v": 1, "token": "%s"}\n' % TOKENS["a"].encode())
        assert reply == {"ok": True}
        with connect(d.address, token=TOKENS["a"]) as c:
            ns = c.namespace(LAYOUT, model="m")
            before = lane_calls(d)
            assert ns.lookup(np.arange(32)) == 0                 # served, over gRPC
            assert c._lane is not None and c._lane.refusals == 1
            assert lane_calls(d) == before
            holder.close()                                       # room again
            end = time.monotonic() + 15
            while lane_calls(d) == before:
                assert time.monotonic() < end, "the client never went back to the lane"
                ns.lookup(np.arange(32))
                time.sleep(0.2)     # the client's back-off runs on its own clock
    finally:
        cleanup(d)


def test_sessions_and_lane_connections_are_capped_per_tenant(world) -> None:
    """Finding 10: tenant B makes more handshake sessions than the daemon keeps
    (limits.sessions_per_tenant, 4,096) and opens more lane connections than its share
    (limits.lane_per_tenant, 64): it forgets its own oldest sessions and is refused lane
    connections, while A's session and A's lane stay good."""
    path = handshake_path(world.socket)
    mine = handshake(path, TOKENS["a"], timeout=10)
    first_b = handshake(path, TOKENS["b"], timeout=10)
    for _ in range(4100):
        handshake(path, TOKENS["b"], timeout=10)
    with channel(world.address) as ch:
        stub = pbg.KVStoreStub(ch)
        ok = stub.Stats(pb.StatsRequest(), timeout=10,
                        metadata=(("authorization", f"Bearer {mine.token}"),))
        assert ok.namespaces >= 0
        with pytest.raises(Exception, match="matches no tenant"):
            stub.Stats(pb.StatsRequest(), timeout=10,
                       metadata=(("authorization", f"Bearer {first_b.token}"),))
    lane = lane_path(world.socket)
    held, refused = [], 0
    try:
        for _ in range(70):
            s, reply = hello(lane, b'{"v": 1, "token": "%s"}\n' % TOKENS["b"].encode())
            if reply.get("error") == "RESOURCE_EXHAUSTED":
                refused += 1
                s.close()
            else:
                assert reply == {"ok": True}
                held.append(s)
        assert len(held) == 64 and refused == 6
        s, reply = hello(lane, b'{"v": 1, "token": "%s"}\n' % mine.token.encode())
        assert reply == {"ok": True}
        s.close()
    finally:
        for s in held:
            s.close()
