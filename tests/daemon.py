"""Start a real kvstore daemon as a subprocess for integration tests.

Why a subprocess and not an in-process server: the tests must see what an engine sees — a real
Unix socket, a real shared-memory slab, signals, the data-folder lock, restarts that lose all
in-memory state — and a daemon crash must fail the test instead of taking pytest down with it.

Usage:
    from tests.daemon import daemon_fixture, start_daemon  # noqa: F401  (fixture `daemon`)

    def test_x(daemon):
        client = kvstore_client.connect(daemon.address)

    def test_y(tmp_path):
        d = start_daemon(tmp_path, {"host": {"capacity": "16MiB"}, "server.tcp": "127.0.0.1:0"})
        ...
        d.stop()

Defaults for tests: a small host pool (64 MiB) and SSD tier (256 MiB) under `tmp_path/data`,
TCP disabled, metrics on a free port (`127.0.0.1:0`; the daemon reports the port it got).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

START_DEADLINE_S = 60.0     # importing torch on a loaded 2-core machine can take a while
STOP_DEADLINE_S = 30.0
DUMP_DEADLINE_S = 10.0     # for a hung daemon to write its threads' stacks (stop())
MAX_MESSAGE = 256 << 20
# Longest path a sockaddr_un holds is 107 bytes; pytest's tmp_path can be longer than that.
_MAX_SOCKET_PATH = 100

TEST_DEFAULTS: dict[str, Any] = {
    "host.capacity": "64MiB",
    "ssd.capacity": "256MiB",
    "server.tcp": "",
    "server.metrics": "127.0.0.1:0",
    "server.workers": "8",
    "log_level": "info",
}

_RE_UNIX = re.compile(r"serving gRPC on unix:(\S+)")
_RE_TCP = re.compile(r"serving gRPC on (?!unix:)(\S+)")
_RE_METRICS = re.compile(r"metrics on (http://\S+)")


def flatten(overrides: dict[str, Any] | None, prefix: str = "") -> dict[str, str | None]:
    """{"host": {"capacity": "1GiB"}, "server.tcp": ""} -> {"host.capacity": "1GiB", ...}."""
    out: dict[str, str | None] = {}
    for k, v in (overrides or {}).items():
        key = f"{prefix}{k}"
        if v is None:
            out[key] = None
        elif isinstance(v, dict):
            out.update(flatten(v, key + "."))
        elif isinstance(v, bool):
            out[key] = "true" if v else "false"
        elif isinstance(v, (list, tuple)):
            out[key] = ",".join(str(x) for x in v)
        else:
            out[key] = str(v)
    return out


class DaemonError(RuntimeError):
    """The daemon did not start (or stop) as expected; the message carries its stderr."""


class Daemon:
    """One daemon subprocess; `restart()` starts a new process on the same folder and socket."""

    def __init__(self, data_dir: Path, socket: str, settings: dict[str, str],
                 env: dict[str, str], log_dir: Path) -> None:
        self.data_dir = data_dir
        self.socket = socket
        self.settings = settings
        self.env = env
        self.log_dir = log_dir
        self.proc: subprocess.Popen | None = None
        self.tcp: str | None = None
        self.metrics_url: str | None = None
        self.starts = 0
        self._log_path: Path | None = None

    # -- addresses ----------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """gRPC target for `kvstore_client.connect` / `grpc.insecure_channel`."""
        return f"unix:{self.socket}"

    def argv(self) -> list[str]:
        args = [sys.executable, "-m", "kvstore", "serve", "--data-dir", str(self.data_dir),
                "--socket", self.socket]
        for k, v in self.settings.items():
            args += ["--set", f"{k}={v}"]
        return args

    def channel(self) -> grpc.Channel:
        """A raw channel to the Unix socket with message limits that fit big batches."""
        return grpc.insecure_channel(self.address, options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.max_send_message_length", MAX_MESSAGE),
        ])

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self, deadline_s: float = START_DEADLINE_S) -> Daemon:
        self.starts += 1
        self._log_path = self.log_dir / f"daemon-{self.starts}.log"
        log = open(self._log_path, "wb")
        try:
            self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, stdin=subprocess.DEVNULL)
        finally:
            log.close()
        try:
            self._wait_ready(deadline_s)
        except BaseException:
            self.kill()
            raise
        text = self.output()
        m = _RE_TCP.search(text)
        self.tcp = m.group(1) if m else None
        m = _RE_METRICS.search(text)
        self.metrics_url = m.group(1) if m else None
        return self

    def _wait_ready(self, deadline_s: float) -> None:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            rc = self.proc.poll()
            if rc is not None:
                raise DaemonError(f"daemon exited with code {rc} before it was ready; "
                                  f"output:\n{self.output()}")
            if os.path.exists(self.socket) and _RE_UNIX.search(self.output()):
                if self._serving():
                    return
            time.sleep(0.05)
        raise DaemonError(f"daemon not SERVING within {deadline_s:.0f} s; output:\n"
                          f"{self.output()}")

    def _serving(self) -> bool:
        try:
            with grpc.insecure_channel(self.address) as ch:
                resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                            timeout=2)
            return resp.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def output(self) -> str:
        """Everything the current (or last) daemon process printed."""
        if self._log_path is None or not self._log_path.exists():
            return ""
        return self._log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = STOP_DEADLINE_S) -> int:
        """SIGTERM and wait; returns the exit code. Kills and raises if it does not stop."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._dump_threads()
                self.kill()
                raise DaemonError(f"daemon ignored SIGTERM for {timeout:.0f} s; output "
                                  f"(ending with its threads' stacks):\n{self.output()}"
                                  ) from None
        return self.proc.returncode

    def _dump_threads(self) -> None:
        """Have a hung daemon print every thread's stack into its log (faulthandler, enabled
        by PYTHONFAULTHANDLER, writes them on SIGABRT), so the failure says where it hung."""
        try:
            self.proc.send_signal(signal.SIGABRT)
            self.proc.wait(DUMP_DEADLINE_S)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass

    def kill(self) -> None:
        """SIGKILL, as a crash would: no flush, the socket file and shm segment stay behind."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self) -> Daemon:
        """Graceful stop, then a new process on the same data folder and socket."""
        self.stop()
        return self.start()


def _socket_path(tmp_path: Path) -> tuple[str, Path | None]:
    """A socket path short enough for sockaddr_un; returns (path, temp dir to remove or None)."""
    candidate = tmp_path / "kvs.sock"
    if len(str(candidate)) <= _MAX_SOCKET_PATH:
        return str(candidate), None
    short = Path(tempfile.mkdtemp(prefix="kvs-"))
    return str(short / "kvs.sock"), short


def start_daemon(tmp_path: Path, config_overrides: dict[str, Any] | None = None,
                 env: dict[str, str] | None = None) -> Daemon:
    """Start a daemon on `tmp_path/data`; returns once its health check says SERVING.

    config_overrides: nested ({"host": {"capacity": "16MiB"}}) or dotted ({"host.capacity": ..})
    settings passed as `--set`; they win over the test defaults, and a value of None drops a
    test default (so a KVSTORE_* variable or config file can set it). env: extra variables (e.g.
    KVSTORE_*), added to a copy of os.environ from which inherited KVSTORE_* are removed.
    """
    tmp_path = Path(tmp_path)
    data_dir = tmp_path / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    settings = dict(TEST_DEFAULTS)
    settings.update(flatten(config_overrides))
    settings = {k: v for k, v in settings.items() if v is not None}
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    full_env["PYTHONFAULTHANDLER"] = "1"     # a stop that hangs dumps its stacks (stop())
    full_env.update(env or {})
    sock, short_dir = _socket_path(tmp_path)
    d = Daemon(data_dir, sock, settings, full_env, tmp_path)
    d._short_dir = short_dir  # type: ignore[attr-defined]
    return d.start()


def cleanup(d: Daemon) -> None:
    """Stop (or kill) the daemon and remove the short socket folder if one was made, and the
    shared-memory segments a daemon that did not stop cleanly left (a SIGKILLed one's pool
    stays in /dev/shm, in RAM, until a daemon starts on its folder again)."""
    try:
        if d.alive():
            d.stop()
    finally:
        d.kill()
        short = getattr(d, "_short_dir", None)
        if short is not None:
            shutil.rmtree(short, ignore_errors=True)
        name = segment_name(d)
        for p in Path("/dev/shm").glob(f"{name}*"):
            if p.name == name or p.name.startswith(name + "-"):
                p.unlink(missing_ok=True)


def segment_name(d: Daemon) -> str:
    """The daemon's host pool segment in /dev/shm (kvstore/store.py names it so); its other
    segments (gpu slabs on the CPU device) start with it and a dash."""
    import blake3
    return d.settings.get("host.shm_name") or "kvstore-" + blake3.blake3(
        str(Path(d.data_dir).resolve()).encode()).hexdigest()[:16]


@pytest.fixture(name="daemon")
def daemon_fixture(tmp_path: Path) -> Iterator[Daemon]:
    """A running daemon with test defaults, stopped gracefully after the test."""
    d = start_daemon(tmp_path)
    try:
        yield d
    finally:
        cleanup(d)


daemon = daemon_fixture   # also importable by its fixture name


_RPC = re.compile(r'^kvstore_rpcs_total\{code="(\w+)",method="(\w+)"\} (\S+)$')


def rpc_counts(d: Daemon) -> Counter:
    """RPCs the daemon finished, by (status code, method): its own count, from /metrics."""
    with urllib.request.urlopen(d.metrics_url, timeout=30) as r:
        text = r.read().decode()
    out: Counter = Counter()
    for line in text.splitlines():
        m = _RPC.match(line)
        if m:
            out[m.group(1), m.group(2)] = int(float(m.group(3)))
    return out
