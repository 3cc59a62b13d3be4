"""The DoS bench's attackers (bench/dos.py says what each sends and why it is written to spend
little CPU of its own): an unauthenticated local user holding stalled connections on every
listener, and tenant B flooding with its own token. Each runs as `bench/dos.py --role ...` in a
process of its own and stops when its stdin closes."""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import threading
import time

MARKER = b"A-SECRET-KVBLOCK"          # in every 64 bytes of A's blocks
ATTACK_CONNS = 300
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
TOKENS = {"a": "dos-token-a", "b": "dos-token-b"}
PACE_S = 0.05                         # between one flood request of B's and its next
FLOODS = ("unauthenticated", "empty_streams", "oversize", "repeated_keys", "namespaces", "leases",
          "shared_pool_read", "foreign_namespace")
TENANT_CALLS = 16                     # limits.tenant_calls of the bench's daemon
EMPTY_STREAMS = 12                    # B's Put streams held open with nothing sent: with B's
                                      # other floods, past its cap (some are refused)



# ------------------------------------------------------------------- the unauthenticated user

def run_unauth(sock: str, tcp: str, conns: int, other_uid: bool) -> None:
    """Hold `conns` stalled connections on each listener, trickling a byte per second each,
    reconnecting (at most once a second per slot) whatever the daemon closes; and keep gRPC
    calls without a token open. Runs until stdin closes.

    One epoll over all the sockets says which the daemon answered or closed; once a second
    each live one gets its next byte. The calls without a token are raw HTTP/2 streams
    (bench/h2_raw.py) on one connection: what the daemon receives is grpcio's call, without
    the thread grpcio starts for each client-streaming call."""
    import h2_raw
    h2 = h2_raw.Connection(sock) if conns else None     # opened before dropping privileges,
    if other_uid:                                       # as a channel made then would be
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    host, _, port = tcp.rpartition(":")
    targets = [("grpc-unix", (socket.AF_UNIX, sock), H2_PREFACE),
               ("grpc-tcp", (socket.AF_INET, (host, int(port))), H2_PREFACE),
               ("auth", (socket.AF_UNIX, sock + ".auth"), b" " * 64),
               ("lane", (socket.AF_UNIX, sock + ".lane"), b" " * 64)]
    slots = [[name, addr, trickle, None, 0, 0.0] for name, addr, trickle in targets
             for _ in range(conns)]       # name, addr, bytes, socket, sent, retry at
    closed = {name: 0 for name, _, _ in targets}      # connections the daemon ended
    ep = select.epoll()
    by_fd: dict[int, list] = {}
    waiting: list[list] = []                          # slots to reconnect once due

    def connect(slot: list) -> None:
        fam, a = slot[1]
        s = socket.socket(fam, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(a)
        except (BlockingIOError, InterruptedError):
            if fam == socket.AF_UNIX:   # EAGAIN: the listener's backlog is full, not
                s.close()               # connecting (TCP's EINPROGRESS goes on connecting)
                slot[5] = time.monotonic() + 1.0
                waiting.append(slot)
                return
        except OSError:
            s.close()
            slot[5] = time.monotonic() + 1.0
            waiting.append(slot)
            return
        slot[3], slot[4] = s, 0
        by_fd[s.fileno()] = slot
        ep.register(s.fileno(), select.EPOLLIN | select.EPOLLRDHUP)

    def drop(slot: list, now: float, by_daemon: bool) -> None:
        s = slot[3]
        by_fd.pop(s.fileno(), None)
        ep.unregister(s.fileno())
        s.close()
        slot[3], slot[5] = None, now + 1.0
        waiting.append(slot)
        if by_daemon:
            closed[slot[0]] += 1

    for slot in slots:
        connect(slot)
    stdin = sys.stdin.fileno()
    ep.register(stdin, select.EPOLLIN)
    live: set[int] = set()                            # the raw calls without a token
    md = ()                                           # no authorization header
    print("ready", flush=True)
    next_tick = time.monotonic()
    next_calls = next_tick
    while True:
        now = time.monotonic()
        if conns and now >= next_calls:
            # 32 calls whose message never comes, renewed as they end, looked at every 0.2 s
            try:
                if h2 is None or h2.closed:
                    h2, live = h2_raw.Connection(sock), set()
                h2.pump(0)
                for sid in list(h2.ended):
                    h2.cancel(sid)
                    live.discard(sid)
                if not h2.closed:
                    while len(live) < 32:
                        live.add(h2.headers("/kvstore.v1.KVStore/Put", md, 60))
            except OSError:                           # a new connection next time
                if h2 is not None:
                    h2.close()
            next_calls = now + 0.2
        if now >= next_tick:
            due = [sl for sl in waiting if now >= sl[5]]
            waiting[:] = [sl for sl in waiting if now < sl[5]]
            for slot in due:
                connect(slot)
            for slot in slots:
                s = slot[3]
                if s is None:
                    continue
                data = slot[2]
                try:
                    s.send(data[slot[4] % len(data):slot[4] % len(data) + 1])
                    slot[4] += 1
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError:
                    drop(slot, now, False)
            next_tick = now + 1.0
        wake = min(next_tick, next_calls) if conns else next_tick
        events = ep.poll(max(0.0, wake - time.monotonic()))
        now = time.monotonic()
        if any(fd == stdin for fd, _ in events):
            break
        for fd, _ev in events:
            slot = by_fd.get(fd)
            if slot is None:
                continue
            try:
                if slot[3].recv(4096, socket.MSG_DONTWAIT) != b"":
                    continue                          # a refusal line: its EOF follows
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                pass
            drop(slot, now, True)
    print(json.dumps({"closed_by_daemon": closed}), flush=True)


# ------------------------------------------------------------------------ tenant B, hostile

class Refused(Exception):
    """A raw call the daemon ended without an answer message (its status is not decoded)."""


def run_b(sock: str, a_ns_hex: str, block_bytes: int, without: set[str]) -> None:
    """Flood with B's own token until stdin closes (but the kinds in `without`); print B's
    findings as JSON."""
    import grpc
    import h2_raw
    from kvstore_client._proto import kvstore_pb2 as pb
    from kvstore_client._proto import kvstore_pb2_grpc as pbg
    from kvstore_client.common.lane_wire import HEADER, MAX_FRAME, METHOD_ID
    from kvstore_client.common.layout import KVLayout, NamespaceSpec
    from kvstore_client.wire import decode_get, encode_put, spec_to_proto

    md = (("authorization", f"Bearer {TOKENS['b']}"),)
    stop = threading.Event()
    found = {"cross_tenant_bytes_read": 0, "refused": 0, "namespaces": 0, "leases": 0,
             "errors": {}}
    lock = threading.Lock()
    ch = grpc.insecure_channel(f"unix:{sock}", options=[
        ("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)])
    stub = pbg.KVStoreStub(ch)
    tiny = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_tokens=16,
                    dtype="bfloat16")
    reg = stub.RegisterNamespace(pb.RegisterNamespaceRequest(spec=spec_to_proto(
        NamespaceSpec(model="b-tiny", layout=tiny))), timeout=30, metadata=md)
    ns_b, bb_b = reg.namespace_id, reg.block_bytes
    key = b"\x07" * 16
    put = ch.stream_unary("/kvstore.v1.KVStore/Put", request_serializer=lambda b: b,
                          response_deserializer=pb.PutResponse.FromString)
    put(iter([encode_put(ns_b, b"", [(key, bytes(bb_b))])]), timeout=30, metadata=md)
    a_ns = bytes.fromhex(a_ns_hex)

    def note(e: Exception, what: str = "") -> None:
        if stop.is_set():
            return                      # cancelled by the stop below, not refused
        name = e.code().name if isinstance(e, grpc.RpcError) else type(e).__name__
        name = f"{what}:{name}" if what else name
        with lock:
            found["errors"][name] = found["errors"].get(name, 0) + 1

    def loop(fn) -> None:
        """`fn` again and again, PACE_S apart: a sustained flood that leaves this process's
        own CPU (on the daemon's machine) to the daemon and tenant A."""
        while not stop.is_set():
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - a refusal is the expected answer
                note(e, fn.__name__)
            stop.wait(PACE_S)

    def empty_puts() -> None:
        def never():
            stop.wait()
            return
            yield b""
        live = []
        while not stop.is_set():
            live = [f for f in live if not f.done()]
            while len(live) < EMPTY_STREAMS:
                live.append(put.future(never(), timeout=60, metadata=md))
            stop.wait(0.2)

    lane_held: list[tuple[float, socket.socket]] = []     # lane sockets, closed at 15 s
    h2: list = []                                          # the raw HTTP/2 connection
    junk = b"\x38\x01" * ((4 << 20) // 2 - 512)           # unknown fields, built once
    raw_md = tuple(md)

    def oversize() -> None:
        now = time.monotonic()
        while lane_held and lane_held[0][0] <= now:
            lane_held.pop(0)[1].close()
        lane = sock + ".lane"
        for announce in (64 << 20, MAX_FRAME + 1, MAX_FRAME):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect(lane)
            s.sendall(json.dumps({"v": 1, "token": TOKENS["b"]}).encode() + b"\n")
            if b'"ok"' not in s.recv(4096):
                with lock:
                    found["refused"] += 1
                s.close()
                continue
            s.sendall(HEADER.pack(announce, METHOD_ID["Commit"]) + b"\0" * 4096)
            lane_held.append((time.monotonic() + 15, s))
        # a 64 MiB Lookup message: its prefix and what the windows let through (bench/h2_raw)
        if not h2 or h2[0].closed:
            h2[:] = [h2_raw.Connection(sock)]
        try:
            how = h2[0].oversize("/kvstore.v1.KVStore/Lookup", raw_md, 64 << 20, 30)
        except OSError:
            h2[0].close()
            how = "connection_lost"
        with lock:
            found["errors"][f"lookup_64mib:{how}"] = \
                found["errors"].get(f"lookup_64mib:{how}", 0) + 1
        try:
            put(iter([junk] * 4), timeout=30, metadata=md)
        except grpc.RpcError as e:
            note(e)

    local = threading.local()           # each flood thread's own raw HTTP/2 connection

    def call(method: str, msg: bytes, reply: type | None = None) -> list:
        """`msg` sent to `method` as raw HTTP/2 (bench/h2_raw.py); the answer's messages
        (parsed as `reply` if given), Refused if the daemon ended the call without one."""
        c = getattr(local, "h2", None)
        if c is None or c.closed:
            c = local.h2 = h2_raw.Connection(sock)
        try:
            got = c.call(f"/kvstore.v1.KVStore/{method}", raw_md, msg, 30)
        except OSError:
            c.close()
            raise
        if got is None:
            raise Refused(method)
        return [reply.FromString(m) for m in got] if reply else got

    get_repeated = pb.GetRequest(namespace_id=ns_b, keys=[key] * 65536).SerializeToString()
    acquire_repeated = pb.AcquireRequest(namespace_id=ns_b,
                                         keys=[key] * 65536).SerializeToString()

    def repeated_keys() -> None:
        # serialized once: the same 1 MiB messages each round, as the daemon sees them
        call("Get", get_repeated)
        lease = call("Acquire", acquire_repeated, pb.AcquireResponse)[0].lease
        call("Release", pb.ReleaseRequest(lease_id=lease.lease_id).SerializeToString())

    counter = [0]

    def namespaces() -> None:
        counter[0] += 1
        call("RegisterNamespace", pb.RegisterNamespaceRequest(spec=spec_to_proto(
            NamespaceSpec(model=f"b-flood-{counter[0]}", layout=tiny))).SerializeToString())
        with lock:
            found["namespaces"] += 1

    reserve_one = pb.ReserveRequest(namespace_id=ns_b, count=1).SerializeToString()

    def leases() -> None:
        call("Reserve", reserve_one)
        with lock:
            found["leases"] += 1

    get_of_a = pb.GetRequest(namespace_id=a_ns, keys=[key]).SerializeToString()

    def read_a_namespace() -> None:
        # A's namespace id (computed or leaked): refused as unknown, or bytes
        for msg in call("Get", get_of_a):
            count(msg)

    register_same_size = pb.RegisterNamespaceRequest(spec=spec_to_proto(NamespaceSpec(
        model="b-same-size", layout=KVLayout(num_layers=1, num_kv_heads=1,
                                             head_dim=block_bytes // 64, block_tokens=16,
                                             dtype="bfloat16")))).SerializeToString()

    def read_a() -> None:
        # shared-pool slots reserved and committed unwritten, read back (finding 1)
        big = call("RegisterNamespace", register_same_size,
                   pb.RegisterNamespaceResponse)[0].namespace_id
        lease = call("Reserve", pb.ReserveRequest(namespace_id=big, count=16)
                     .SerializeToString(), pb.ReserveResponse)[0].lease
        keys = [os.urandom(16) for _ in lease.slots]
        call("Commit", pb.CommitRequest(lease_id=lease.lease_id, keys=keys)
             .SerializeToString())
        for msg in call("Get", pb.GetRequest(namespace_id=big, keys=keys)
                        .SerializeToString()):
            count(msg)
        call("Delete", pb.DeleteRequest(namespace_id=big, all=True).SerializeToString())

    def count(raw: bytes) -> None:
        for _k, off, n in decode_get(raw):
            if MARKER in raw[off:off + n]:
                with lock:
                    found["cross_tenant_bytes_read"] += n

    floods = {"empty_streams": empty_puts, "oversize": lambda: loop(oversize),
              "repeated_keys": lambda: loop(repeated_keys),
              "namespaces": lambda: loop(namespaces), "leases": lambda: loop(leases),
              "shared_pool_read": lambda: loop(read_a),
              "foreign_namespace": lambda: loop(read_a_namespace)}
    threads = [threading.Thread(target=w, daemon=True) for k, w in floods.items()
               if k not in without]
    for t in threads:
        t.start()
    print("ready", flush=True)
    sys.stdin.read()
    stop.set()
    ch.close()                          # ends the calls in flight: the threads return now
    for t in threads:
        t.join(5)
    for _, s in lane_held:
        s.close()
    print(json.dumps(found), flush=True)
    os._exit(0)                         # leftover timers and channels
