"""A call's deadline holds against a daemon that stops answering (SIGSTOP).

A stopped daemon's kernel still accepts connections, so nothing but a deadline ends a wait:
each wait a call makes (a lane hello, the gRPC fallback after it, the lookup a store overlaps
with its copy, the release of a failed store's lease, an SGLang backend's first registration)
must come out of the call's one deadline. Each call that asks for t seconds must return
within t and a margin for a loaded 2-core machine; an extra wait of its own length (what these
tests catch) would take 2t or more. A deadline bound is a correctness property, not a speed
target.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from kvstore_client import connect, leases
from kvstore_client.common.errors import DeadlineExceeded, InvalidArgument
from kvstore_client.common.layout import KVLayout

from tests.daemon import Daemon, cleanup, start_daemon

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=16, dtype="float16")
MARGIN_S = 0.8


def _stopped(pid: int) -> bool:
    """Every thread of `pid` has taken the SIGSTOP (state T in /proc)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        return all(Path(f"/proc/{pid}/task/{t}/stat").read_text().rsplit(")", 1)[1].split()[0]
                   == "T" for t in tasks)
    except OSError:
        return False


@contextmanager
def stopped(d: Daemon) -> Iterator[None]:
    """The daemon stopped (SIGSTOP) for the block, continued (SIGCONT) whatever happens."""
    pid = d.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        end = time.monotonic() + 10
        while not _stopped(pid):
            assert time.monotonic() < end, "the daemon did not stop"
            time.sleep(0.005)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _keys(tag: bytes, n: int = 4) -> list[bytes]:
    return [tag + bytes([i]) * 15 for i in range(n)]


def _fill(base: np.ndarray, offsets: list[int], first: int) -> None:
    for j, off in enumerate(offsets):
        base[off:off + LAYOUT.block_bytes] = (first + j) % 251


def test_a_call_with_no_idle_lane_connection_keeps_its_deadline(daemon) -> None:
    """The first call that times out closes the lane's only idle connection; the next opens
    one, and its hello must not wait the client's whole timeout (5 s) and then leave gRPC a
    fresh deadline: every call asking for 1 s is a DeadlineExceeded within it."""
    c = connect(daemon.address, timeout=5.0)
    try:
        ns = c.namespace(LAYOUT, model="deadlines")
        keys = _keys(b"k")
        assert ns.locate(keys, timeout=1.0) == [None] * 4
        assert c._lane is not None, "the test needs the fast lane"
        took = []
        with stopped(daemon):
            for _ in range(3):
                t0 = time.monotonic()
                with pytest.raises(DeadlineExceeded):
                    ns.locate(keys, timeout=1.0)
                took.append(time.monotonic() - t0)
        assert max(took) < 1.0 + MARGIN_S, took
        assert ns.locate(keys, timeout=5.0) == [None] * 4       # answered again
    finally:
        c.close()


@pytest.mark.parametrize("cached_before", [False, True], ids=["commit", "lookup+commit"])
def test_a_failed_store_fails_within_its_deadline_with_its_own_error(
        daemon, monkeypatch: pytest.MonkeyPatch, cached_before: bool) -> None:
    """A store into the lease the previous Commit reserved (its one round trip the Commit;
    with blocks found cached last time, a Lookup overlapping the copy) fails within the
    client's timeout with the Commit's DeadlineExceeded: its lease is released off the call's
    path, not by a Release that waits on the stopped daemon again and replaces the error."""
    monkeypatch.setattr(leases, "SPARE_IDLE_S", 60.0)     # the spare waits for the store below
    c = connect(daemon.address, timeout=1.0)
    try:
        ns = c.namespace(LAYOUT, model="deadlines")
        a, b = _keys(b"a"), _keys(b"b")
        assert ns.store_blocks(a, _fill) == 4
        if cached_before:
            assert ns.store_blocks(a, _fill) == 0               # duplicates: next store looks up
        assert ns._writer.spare is not None and ns._writer.prefix_seen is cached_before
        with stopped(daemon):
            t0 = time.monotonic()
            with pytest.raises(DeadlineExceeded) as err:
                ns.store_blocks(b, _fill)
            took = time.monotonic() - t0
        assert took < 1.0 + MARGIN_S, took
        assert "Commit" in str(err.value) and "Release" not in str(err.value), err.value
        ns.store_blocks(b, _fill)             # the daemon may have committed the first one
        assert ns.lookup_keys(b) == 4
    finally:
        c.close()


def test_sglang_backend_calls_keep_their_bounds(tmp_path: Path) -> None:
    """SGLang's backend (built by SGLang's factory, tests/sglang_runner.py) against a stopped
    daemon: a first batch_exists, whose namespace is not registered yet, is a miss within
    exists_deadline_s (1 s), not after the registration's timeout_s (2 s); after a warm
    start every batch_exists is a miss within exists_deadline_s and every transfer fails
    within timeout_s, with its own error."""
    from tests.test_sglang import run, sglang_python

    sglang_python()
    d = start_daemon(tmp_path)
    try:
        pid = d.proc.pid
        r = run(d.address, [
            {"op": "stopped", "layout": "page_first", "pid": pid,
             "steps": [{"op": "exists", "seed": 1, "pages": 4}]},
            {"op": "set", "seed": 1, "pages": 4},
            {"op": "exists", "seed": 1, "pages": 4},
            {"op": "get", "seed": 1, "pages": 4},
            {"op": "set", "seed": 1, "pages": 4},   # duplicates: the next store looks up
            {"op": "stopped", "pid": pid, "steps": [
                {"op": "set", "seed": 2, "pages": 4},
                {"op": "exists", "seed": 1, "pages": 4},
                {"op": "get", "seed": 1, "pages": 4},
                {"op": "exists", "seed": 1, "pages": 4}]},
        ], layouts="layer_first,page_first",
            args=("--timeout-s", "2", "--exists-deadline-s", "1"))
    finally:
        cleanup(d)
    first, _, warm, got, _, steady = r["steps"]
    (exists,) = first["steps"]
    assert exists["n"] == 0 and exists["batch_s"] < 1.0 + MARGIN_S, exists
    assert warm["n"] == 4 and all(got["ok"]) and all(got["equal"])
    s_set, s_exists, s_get, s_exists2 = steady["steps"]
    assert not any(s_set["ok"]) and s_set["s"] < 2.0 + MARGIN_S, s_set
    assert "Release" not in s_set["last_error"], s_set
    for e in (s_exists, s_exists2):
        assert e["n"] == 0 and e["batch_s"] < 1.0 + MARGIN_S, e
    assert not any(s_get["ok"]) and s_get["s"] < 2.0 + MARGIN_S, s_get


# What the calls below took before they shared one deadline: a timeout per lease released
# first (4 spares: 5 s; 6 pins: 7 s), or Flush's 60 s floor whatever the caller asked for.
SHARED_BOUND_S = 2.5


def test_stats_after_stores_releases_within_its_own_deadline(
        daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stats (and Evict) first give back the spare write lease of each namespace that stored
    lately, so its answer counts them as free. Against a stopped daemon those releases come
    out of the call's one deadline: not a timeout each and then the call's own."""
    monkeypatch.setattr(leases, "SPARE_IDLE_S", 60.0)     # the spares wait for the Stats
    c = connect(daemon.address, timeout=1.0)
    try:
        for i in range(4):
            ns = c.namespace(LAYOUT, model=f"deadlines-spares-{i}")
            assert ns.store_blocks(_keys(b"s"), _fill) == 4
        with stopped(daemon):
            t0 = time.monotonic()
            with pytest.raises(DeadlineExceeded, match="Stats"):
                c.stats()
            took = time.monotonic() - t0
        assert took < SHARED_BOUND_S, took
        # Answered again. Spares the stopped daemon was not sent end at their lease deadline.
        assert c.stats()["daemon_id"] == c.daemon_id
    finally:
        c.close()


def test_close_with_many_pins_takes_one_deadline(daemon) -> None:
    """close() releases every lease it holds; against a stopped daemon all of them share one
    deadline (the daemon ends the rest at theirs), so six pins do not cost six timeouts."""
    c = connect(daemon.address, timeout=1.0)
    ns = c.namespace(LAYOUT, model="deadlines-pins")
    keys = _keys(b"p")
    assert ns.store_blocks(keys, _fill) == 4
    pins = [ns.pin(keys) for _ in range(6)]
    assert all(p.blocks == 4 for p in pins) and len(c.leases.held) >= 6
    with stopped(daemon):
        t0 = time.monotonic()
        c.close()
        took = time.monotonic() - t0
    assert took < SHARED_BOUND_S, took


def test_flush_and_evict_keep_a_timeout_the_caller_passes(daemon) -> None:
    """flush() waits at least 60 s by default (a whole host tier goes to SSD), but a timeout
    passed to it, or to evict(), is the call's deadline; a bad one is refused at once."""
    c = connect(daemon.address, timeout=5.0)
    try:
        ns = c.namespace(LAYOUT, model="deadlines-flush")
        assert ns.store_blocks(_keys(b"f"), _fill) == 4
        with stopped(daemon):
            for call in (lambda: c.flush(timeout=1.0), lambda: c.evict("host", timeout=1.0)):
                t0 = time.monotonic()
                with pytest.raises(DeadlineExceeded):
                    call()
                took = time.monotonic() - t0
                assert took < SHARED_BOUND_S, took
        for bad in (0, -1.0, "1"):
            with pytest.raises(InvalidArgument, match="timeout"):
                c.flush(timeout=bad)
        assert c.flush(timeout=30.0) >= 4           # answered again, within what it was given
    finally:
        c.close()
