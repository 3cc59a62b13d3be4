"""Flush under a disk that writes slower than engines store, and on a disk that was full.

- A Flush ends by its deadline (`limits.request_deadline_s` of its start) with
  DEADLINE_EXCEEDED, having written what it could, instead of waiting for a moment with no
  demotion in flight, which a steady writer never gives; a tenant runs one Flush at a time, so
  Flushes whose clients gave up cannot take every gRPC worker from the daemon's other calls.
- A namespace registered while the SSD filesystem is full has its record written once space
  comes back: blocks flushed into it are still served after a clean restart.

The slow disk is the daemon's own SSD writes slowed in the daemon process (every batch it writes
sleeps first, as a write to a throttled device waits), so it needs no device or privilege.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client.errors import DeadlineExceeded

from tests.daemon import Daemon, cleanup, start_daemon
from tests.store_helpers import kv_block, make_store, namespace
from tests.test_disk_full import fill

LAYOUT = pb.KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=16,
                     dtype="float16")
BLOCK = 4 * 2 * 16 * 2 * 64 * 2          # 32 KiB
DEADLINE_S = 2.0                         # limits.request_deadline_s of the slow-disk daemon
SLACK_S = 1.5                            # a loaded machine's scheduling, on top of it
WRITE_SLEEP_S = 0.4                      # each SSD batch write of the slow-disk daemon

# The daemon, with every SSD batch write (SSDTier.put_filled: demotions and flushes alike)
# slowed by WRITE_SLEEP_S, run as `python -c SLOW_DAEMON serve ...`.
SLOW_DAEMON = f"""
import sys, time
from tiers.ssd import tier
_put_filled = tier.SSDTier.put_filled
def put_filled(self, items, fill):
    time.sleep({WRITE_SLEEP_S})
    return _put_filled(self, items, fill)
tier.SSDTier.put_filled = put_filled
from kvstore.cli import main
sys.argv = ["kvstore"] + sys.argv[1:]
sys.exit(main())
"""


# -- raw gRPC, as any client sees the daemon ------------------------------------------------------
def block_bytes(key: bytes) -> bytes:
    import hashlib
    return hashlib.shake_128(key).digest(BLOCK)


def unary(ch: grpc.Channel, method: str, req, resp_cls, timeout: float = 30):
    call = ch.unary_unary(f"/kvstore.v1.KVStore/{method}",
                          request_serializer=lambda m: m.SerializeToString(),
                          response_deserializer=resp_cls.FromString)
    return call(req, timeout=timeout)


def register(ch: grpc.Channel, model: str) -> bytes:
    spec = pb.NamespaceSpec(model=model, layout=LAYOUT)
    return unary(ch, "RegisterNamespace", pb.RegisterNamespaceRequest(spec=spec),
                 pb.RegisterNamespaceResponse).namespace_id


def put(ch: grpc.Channel, ns: bytes, keys: list[bytes], timeout: float = 30) -> None:
    call = ch.stream_unary("/kvstore.v1.KVStore/Put",
                           request_serializer=lambda m: m.SerializeToString(),
                           response_deserializer=pb.PutResponse.FromString)
    per = (2 << 20) // BLOCK

    def msgs():
        for i in range(0, len(keys), per):
            m = pb.PutRequest(blocks=[pb.Block(key=k, data=block_bytes(k))
                                      for k in keys[i:i + per]])
            if i == 0:
                m.namespace_id = ns
            yield m
    call(msgs(), timeout=timeout)


def flush(ch: grpc.Channel, timeout: float = 60) -> int:
    return unary(ch, "Flush", pb.FlushRequest(), pb.FlushResponse, timeout).demoted


def served(ch: grpc.Channel, ns: bytes, keys: list[bytes]) -> int:
    """How many leading blocks of the chain Get serves, each checked bit-exact."""
    call = ch.unary_stream("/kvstore.v1.KVStore/Get",
                           request_serializer=lambda m: m.SerializeToString(),
                           response_deserializer=pb.GetResponse.FromString)
    got: list[list] = []
    for r in call(pb.GetRequest(namespace_id=ns, keys=keys), timeout=30):
        for b in r.blocks:
            if b.key:
                got.append([b.key, bytearray(b.data)])
            else:
                got[-1][1] += b.data
    for i, (k, data) in enumerate(got):
        assert k == keys[i] and bytes(data) == block_bytes(k), "a wrong block was served"
    return len(got)


def chains(n: int, blocks: int = 4) -> list[list[bytes]]:
    return [[os.urandom(16) for _ in range(blocks)] for _ in range(n)]


def timed_flush(d: Daemon, timeout: float) -> tuple[str, float, str]:
    """(status name, seconds, details) of one Flush on a channel of its own."""
    t0 = time.monotonic()
    try:
        with d.channel() as ch:
            flush(ch, timeout)
        return "OK", time.monotonic() - t0, ""
    except grpc.RpcError as e:
        return e.code().name, time.monotonic() - t0, e.details() or ""


# -- a Flush has a deadline, and a tenant one Flush at a time ---------------------------------
def test_store_flush_ends_at_its_deadline_or_cancel_and_loses_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.state import CallCancelled
    with make_store(tmp_path) as store:
        ns = namespace(store)
        keys = [os.urandom(16) for _ in range(200)]       # 4 flush batches, host-only
        store.put(ns, keys, [kv_block(k) for k in keys])
        slow = store.ssd.put_filled

        def put_filled(items, fill):
            time.sleep(0.2)
            return slow(items, fill)
        monkeypatch.setattr(store.ssd, "put_filled", put_filled)

        with pytest.raises(CallCancelled, match="client went away"):
            store.flush(cancelled=lambda: True)
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="passed its deadline"):
            store.flush(deadline=t0 + 0.3)
        assert time.monotonic() - t0 < 0.3 + 0.2 + SLACK_S
        assert 0 < store.stats()["tiers"]["ssd"]["blocks"] < len(keys)
        assert store.flush() > 0                          # the rest, no deadline
        assert store.stats()["tiers"]["ssd"]["blocks"] == len(keys)
        got = store.get(ns, keys)
        assert [k for k, _ in got] == keys
        assert all(bytes(v) == kv_block(k) for k, v in got)


def start_slow_daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                      deadline_s: float = DEADLINE_S, host: str = "24MiB") -> Daemon:
    plain = Daemon.argv

    def argv(self: Daemon) -> list[str]:
        args = plain(self)
        assert args[1:3] == ["-m", "kvstore"], args
        return [args[0], "-c", SLOW_DAEMON, *args[3:]]
    monkeypatch.setattr(Daemon, "argv", argv)
    return start_daemon(tmp_path, {"host.capacity": host, "server.workers": "8",
                                   "limits.request_deadline_s": str(deadline_s),
                                   "server.stop_flush_s": "1"})


@pytest.fixture
def slow_disk_daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Daemon]:
    d = start_slow_daemon(tmp_path, monkeypatch)
    try:
        yield d
    finally:
        cleanup(d)


def test_flush_ends_by_its_deadline_and_leaves_workers_to_other_calls(
        slow_disk_daemon: Daemon) -> None:
    d = slow_disk_daemon
    ch = d.channel()
    ns = register(ch, "flush-deadline")
    probe = chains(1)[0]
    put(ch, ns, probe)

    # 512 host-only blocks: eight flush batches, 3.2 s of writes at least, past the deadline.
    for keys in chains(128):
        put(ch, ns, keys)
    code, took, details = timed_flush(d, timeout=20)
    assert code == "DEADLINE_EXCEEDED", (code, took, details)
    assert took < DEADLINE_S + SLACK_S, took
    assert "passed its deadline" in details and "written to SSD" in details, details

    # Writers that outrun the disk keep background demotion busy for good.
    stop = threading.Event()

    def writer() -> None:
        with d.channel() as wch:
            while not stop.is_set():
                try:
                    put(wch, ns, chains(1, 8)[0], timeout=10)
                except grpc.RpcError:
                    pass
    writers = [threading.Thread(target=writer, daemon=True) for _ in range(2)]
    try:
        for t in writers:
            t.start()
        time.sleep(2)

        # Eight Flushes at once, whose clients give up after a second (one per gRPC worker).
        outcomes: list[tuple[str, float, str]] = []
        flushes = [threading.Thread(target=lambda: outcomes.append(timed_flush(d, 1.0)))
                   for _ in range(8)]
        started = time.monotonic()
        for t in flushes:
            t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        with d.channel() as lch:               # still served while they are pending
            r = unary(lch, "Lookup", pb.LookupRequest(namespace_id=ns, keys=probe),
                      pb.LookupResponse, timeout=5)
        assert time.monotonic() - t0 < 1.5
        assert r.prefix_blocks == 4
        for t in flushes:
            t.join(10)
        codes = sorted(c for c, _, _ in outcomes)
        # One ran (its client gave up first); the others were refused at once.
        assert codes.count("RESOURCE_EXHAUSTED") == 7, outcomes
        assert all(s < 0.9 for c, s, _ in outcomes if c == "RESOURCE_EXHAUSTED"), outcomes
        assert any("already running" in m for _, _, m in outcomes), outcomes

        # The abandoned one ended by its own deadline even though writers never stopped: a
        # Flush now is let in, and it too ends by its deadline.
        time.sleep(max(0.0, started + DEADLINE_S + 0.5 - time.monotonic()))
        code, took, details = timed_flush(d, timeout=20)
        assert code in ("OK", "DEADLINE_EXCEEDED"), (code, details)
        assert took < DEADLINE_S + SLACK_S, took

        # An Evict of all host blocks waits for the demotions in flight, round after round:
        # under these writers it too stops at the deadline and answers what it freed.
        t0 = time.monotonic()
        with d.channel() as ech:
            unary(ech, "Evict", pb.EvictRequest(tier="host"), pb.EvictResponse, timeout=20)
        assert time.monotonic() - t0 < DEADLINE_S + SLACK_S
    finally:
        stop.set()
        for t in writers:
            t.join(15)

    # Once writes stop, Flushes that each end by the deadline get every block down.
    for _ in range(10):
        code, took, details = timed_flush(d, timeout=20)
        assert took < DEADLINE_S + SLACK_S, took
        if code == "OK":
            break
        assert code == "DEADLINE_EXCEEDED", (code, details)
    else:
        pytest.fail("ten Flushes on an idle daemon did not get the host blocks down")
    ch.close()
    assert "Traceback" not in d.output()


def test_a_flush_ends_with_its_client_not_at_the_daemons_deadline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that gives up (its own shorter deadline) or goes away (cancels) ends its
    Flush: the tenant's next Flush is let in at once, not refused as "already running" until
    the daemon's own deadline (8 s here) ends the abandoned one."""
    own_deadline_s = 8.0
    d = start_slow_daemon(tmp_path, monkeypatch, deadline_s=own_deadline_s, host="96MiB")
    try:
        ch = d.channel()
        ns = register(ch, "flush-client-gone")
        for keys in chains(384):            # 1536 host-only blocks: 24 batches, 9.6 s at least
            put(ch, ns, keys)
        ch.close()

        def let_in_after(start_flush) -> tuple[float, list[str]]:
            """Seconds from starting a Flush that is then abandoned until a new Flush is let
            in (anything but RESOURCE_EXHAUSTED), and the codes met on the way."""
            t0 = time.monotonic()
            start_flush()
            codes: list[str] = []
            while time.monotonic() - t0 < own_deadline_s + 4:
                code, _, details = timed_flush(d, timeout=0.3)
                codes.append(code)
                if code != "RESOURCE_EXHAUSTED":
                    return time.monotonic() - t0, codes
                assert "already running" in details, details
                time.sleep(0.05)
            return time.monotonic() - t0, codes

        # Its client's deadline (0.3 s) is far shorter than the daemon's.
        took, codes = let_in_after(lambda: timed_flush(d, timeout=0.3))
        assert took < own_deadline_s / 2, (took, codes)

        # Its client cancels it, having set no deadline at all (after the Flush let in above,
        # whose client gave up after 0.3 s too, has ended its batch in flight).
        time.sleep(1.0)
        with d.channel() as cch:
            call = cch.unary_unary("/kvstore.v1.KVStore/Flush",
                                   request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=pb.FlushResponse.FromString)

            def start_and_cancel() -> None:
                fut = call.future(pb.FlushRequest())
                time.sleep(0.3)
                assert fut.cancel()
            took, codes = let_in_after(start_and_cancel)
        assert took < own_deadline_s / 2, (took, codes)
        assert "Traceback" not in d.output()
    finally:
        cleanup(d)


# -- a namespace registered on a full disk is persisted once space comes back -----------------
@pytest.fixture
def small_ssd_fs(tmp_path: Path) -> Iterator[Path]:
    """A 40 MiB tmpfs as the daemon's SSD folder (its data folder stays on the big disk)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where = tmp_path / "run" / "data" / "ssd"
    where.mkdir(parents=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(where)],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode})")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], timeout=30)


@pytest.mark.tmpfs
def test_namespace_registered_on_a_full_disk_keeps_its_flushed_blocks(
        small_ssd_fs: Path, tmp_path: Path) -> None:
    d = start_daemon(tmp_path / "run", {"host.capacity": "4MiB", "ssd.capacity": "256MiB"})
    try:
        ch = d.channel()
        ballast = fill(small_ssd_fs)
        ns = register(ch, "registered-while-full")     # host serves it meanwhile
        early = chains(1)[0]
        put(ch, ns, early)
        # A Flush cannot put the namespace's blocks on SSD before its record: a clear error.
        with pytest.raises(grpc.RpcError) as ei:
            flush(ch)
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"namespace {ns.hex()} is not persisted yet" in ei.value.details()

        ballast.unlink()                               # space comes back
        stored = chains(32)
        for keys in stored:
            put(ch, ns, keys)
        assert flush(ch) > 0
        ch.close()

        d.restart()                                    # clean: from the index image
        ch = d.channel()
        assert register(ch, "registered-while-full") == ns
        assert sum(served(ch, ns, keys) for keys in stored) == 4 * len(stored)
        ch.close()

        d.kill()                                       # and from an LMDB scan
        d.start()
        ch = d.channel()
        assert register(ch, "registered-while-full") == ns
        assert sum(served(ch, ns, keys) for keys in stored) == 4 * len(stored)
        ch.close()
        assert "Traceback" not in d.output()
    finally:
        cleanup(d)



@pytest.mark.tmpfs
def test_an_eviction_writes_a_pending_namespace_record_before_its_blocks(
        small_ssd_fs: Path, tmp_path: Path) -> None:
    """Space came back but the record of a namespace registered on the full disk had not
    landed yet (its retry runs every 0.5 s): an eviction then put the namespace's blocks on SSD
    before their record, lost to a crash in that window. It now writes the record first."""
    from kvstore.config import StoreConfig
    from kvstore.store import Store
    from tests.store_helpers import random_prompt
    cfg = StoreConfig(data_dir=str(tmp_path / "run" / "data"))
    cfg.host.capacity, cfg.ssd.capacity = 4 << 20, 256 << 20
    store = Store(cfg)
    try:
        ballast = fill(small_ssd_fs)
        ns = namespace(store)
        assert ns in store.state.unpersisted
        _, keys = random_prompt(np.random.default_rng(5), 8)
        store.put(ns, keys, [kv_block(k) for k in keys])
        ballast.unlink()
        assert store.evict("host")[1] == 8          # well within the retry's 0.5 s
        assert ns not in store.state.unpersisted    # the record went first
        assert store.state.counters["ssd_unpersisted_namespace_blocks"] == 0
        assert store.lookup(ns, keys).per_tier["ssd"] == 8
    finally:
        store.close()
