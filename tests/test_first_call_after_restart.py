"""A new client's first call right after a daemon restart that another client of the same
process saw.

grpc shares one connection state among a process's channels to a target. While a daemon
restarts, an engine's calls meet its socket missing (or refusing), and grpc answers that same
failure to every new call until its reconnect backoff ends, even once the new run listens. A
first call fails at once where no daemon is (a wrong address must say so, not wait), so it
took this stale failure for a wrong address: an engine started right after a restart said
"no kvstore daemon" with a daemon serving (a CI run of tests/test_pool_restart.py). Over TCP
too: there the old run's port refuses until the new run binds it.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest
from kvstore_client import connect
from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client.common.errors import KVStoreError, Unavailable

from tests.daemon import cleanup, start_daemon
from tests.events_helpers import free_port
from tests.kv_data import LAYOUT

RESTARTS = 3        # each misses about 4 times in 5 without the check of the socket


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_a_first_call_finds_the_new_run_another_client_saw_gone(tmp_path: Path,
                                                                 transport: str) -> None:
    tcp = f"127.0.0.1:{free_port()}" if transport == "tcp" else ""
    d = start_daemon(tmp_path / "run", {"server.tcp": tcp})
    address = tcp or d.address
    failures: list[str] = []
    try:
        with connect(address) as engine:
            engine.namespace(LAYOUT, model="m")
            for _ in range(RESTARTS):
                d.kill()
                if not tcp:
                    os.unlink(d.socket)     # as between a new run's removal of it and its bind
                stop = threading.Event()

                def poll(stop: threading.Event = stop) -> None:   # calls through the restart
                    while not stop.is_set():
                        try:
                            engine.call("Stats", pb.StatsRequest(), timeout=0.3)
                        except KVStoreError:
                            pass

                poller = threading.Thread(target=poll)
                poller.start()
                try:
                    d.start()
                    with connect(address) as late:
                        late.namespace(LAYOUT, model="m")
                except Unavailable as e:
                    failures.append(str(e))
                finally:
                    stop.set()
                    poller.join()
    finally:
        cleanup(d)
    assert not failures, failures


def test_a_first_call_still_fails_at_once_on_a_dead_socket(tmp_path: Path) -> None:
    """The check must not turn a crashed daemon's leftover socket into a wait."""
    path = str(tmp_path / "dead.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)                # bound, never listening: what a SIGKILLed daemon leaves
    s.close()
    t0 = time.monotonic()
    with connect(path, timeout=60) as client:
        with pytest.raises(Unavailable, match="no kvstore daemon at"):
            client.namespace(LAYOUT, model="m")
    assert time.monotonic() - t0 < 5.0


def test_a_first_call_still_fails_at_once_on_a_closed_port() -> None:
    """Nor a TCP port nothing listens on (a wrong port, a stopped daemon) into a wait."""
    t0 = time.monotonic()
    with connect(f"127.0.0.1:{free_port()}", timeout=60) as client:
        with pytest.raises(Unavailable, match="no kvstore daemon at"):
            client.namespace(LAYOUT, model="m")
    assert time.monotonic() - t0 < 5.0
