"""Daemon lifecycle: lock the data folder, start store + gRPC + metrics, stop cleanly on a signal.

Why a lock file: two daemons on one data folder would share one LMDB environment and one
shared-memory slab name and silently corrupt each other's index. `fcntl.flock` is released by
the kernel when the holder dies (even on SIGKILL), so a crashed daemon never leaves a stale lock
behind, and the file carries the holder's pid for the error message.

Shutdown order on SIGTERM/SIGINT: health flips to NOT_SERVING and new calls get UNAVAILABLE;
the gRPC server stops accepting and gives in-flight calls `server.shutdown_grace_s`; only then
is the store closed (flush to SSD, close LMDB, unlink the shm slab) and the socket removed.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import logging
import os
import signal
import socket as socketlib
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from kvstore_client.errors import KVStoreError

from .config import StoreConfig

log = logging.getLogger("kvstore.daemon")


def _one_torch_thread() -> None:
    """One intra-op thread per torch call: the store runs codecs on its own worker threads.

    torch's own pool on top of ours oversubscribed the cores; with any neighbour busy, single
    codec ops ran 10-100x slower. torch itself is not imported here: a daemon whose namespaces
    never quantize never loads it (tiers/codecs.py); the lossy codecs apply this on import.
    """
    from tiers import codec_common

    codec_common.TORCH_THREADS = 1
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)

LOCK_NAME = "LOCK"
AFTER_READY_S = 0.2     # the daemon's own warm-up waits this long after SERVING (_after_ready)


class StartupError(Exception):
    """The daemon cannot start; the message says why in one line. `exit_code` for the CLI."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class DataDirLock:
    """An exclusive flock on <data_dir>/LOCK holding the owner's pid."""

    def __init__(self, data_dir: str | os.PathLike) -> None:
        self.path = Path(data_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:   # preflight checked; this is the race or an odd filesystem
            raise _fs_error(self.path.parent, e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise StartupError(
                    f"data folder {self.path.parent} is in use by another kvstore daemon "
                    f"(pid {holder}, lock {self.path}); stop it or pass another --data-dir"
                ) from None
            raise
        # The pid is written first and the file cut to it after: on a full filesystem the
        # write fails and the previous holder's pid stays readable, never an empty LOCK.
        pid = f"{os.getpid()}\n".encode()
        try:
            if os.pwrite(fd, pid, 0) != len(pid):
                raise OSError(errno.ENOSPC, "short write")
            os.ftruncate(fd, len(pid))
        except OSError as e:
            os.close(fd)
            raise _fs_error(self.path.parent, e) from None
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        finally:
            os.close(self._fd)    # closing drops the flock
            self._fd = None


FS_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO)


def _fs_error(folder: Path, e: OSError) -> StartupError:
    """A data folder the daemon cannot write: exit 2, one line naming folder and cause."""
    if e.errno == errno.EROFS:
        why = "is on a read-only filesystem"
    elif e.errno in (errno.ENOSPC, errno.EDQUOT):
        why = f"is on a full filesystem ({_free(folder)} bytes free)"
    else:
        why = f"cannot be written ({e.strerror or e})"
    return StartupError(f"data folder {folder} {why}; free space, remount it read-write or "
                        "pass another --data-dir", exit_code=2)


def _free(folder: Path) -> int:
    try:
        st = os.statvfs(folder)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def check_data_dir_writable(folder: Path) -> None:
    """The preflight check of the data folder (full, read-only, not writable), for a Daemon
    started without the CLI: exit 2 and one line, before LOCK is touched."""
    from .preflight import PreflightError, check_data_dir

    try:
        check_data_dir(str(folder))
    except PreflightError as e:
        raise StartupError(str(e), exit_code=2) from None


def check_socket_free(path: str) -> None:
    """Refuse a socket path another live process listens on; remove a dead leftover."""
    if not os.path.exists(path):
        return
    s = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)       # left behind by a crashed daemon
        return
    except OSError as e:
        raise StartupError(f"cannot use socket path {path}: {e}") from None
    finally:
        s.close()
    raise StartupError(f"another process is listening on {path}; stop it or set "
                       "server.socket / --socket to another path")


def _bind_unix(server: Any, path: str, mode: int = 0o600) -> None:
    """Bind the socket with its mode from the first instant (umask), not chmod-after.

    0600 without tenants (the daemon's own user only); 0666 with tenants, where every call is
    authenticated and other uids are exactly who the socket is for.
    """
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    old = os.umask(0o777 & ~mode)
    try:
        server.add_insecure_port(f"unix:{path}")
    finally:
        os.umask(old)
    os.chmod(path, mode)


def is_loopback(address: str) -> bool:
    host = address.rpartition(":")[0].strip("[]").lower()
    return host in ("localhost", "::1") or host.startswith("127.")


def _warm_codecs(stop: threading.Event) -> None:
    """Load the compiled codec kernels (numba: from its on-disk cache, or a compile of several
    seconds in a fresh checkout) after the daemon is ready, so the first demotion or Evict does
    not wait for them inside its deadline. Failure only logs: the codecs load on first use.
    A stop ends it between codecs: the stop's flush would otherwise share the cores and the
    GIL with compiles nothing will use."""
    try:
        t0 = time.monotonic()
        from tiers.codecs import warm_up
        for name in ("lossless", "int8"):
            if stop.is_set():
                return
            warm_up((name,))
        log.info("codec kernels loaded in %.1f s", time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001 - best effort, off the serving path
        log.warning("codec warm-up failed (they load on first use instead): %s", e)


def _warm_get() -> None:
    """Load Get's copy-and-check kernel (kvstore/getcopy.py) after the daemon is ready, so the
    first Get does not pay numba's import and cache load (or a compile in a fresh checkout)."""
    try:
        from . import getcopy
        getcopy.warm_up()
    except Exception as e:  # noqa: BLE001 - best effort, off the serving path
        log.warning("Get kernel warm-up failed (it loads on first use instead): %s", e)


def check_exposure(cfg: StoreConfig, tenants: dict) -> str | None:
    """Refuse a TCP listener beyond loopback that nobody authenticates; returns the warning
    to log at every start when the operator insisted (auth.insecure_tcp)."""
    tcp = cfg.server.tcp
    if not tcp or is_loopback(tcp) or tenants or cfg.auth.tls_client_ca_file:
        return None
    if not cfg.auth.insecure_tcp:
        raise StartupError(
            f"config error: server.tcp={tcp} listens beyond loopback with no authentication; "
            "configure [tenants.*] (bearer tokens) or mTLS (auth.tls_cert_file, "
            "auth.tls_key_file, auth.tls_client_ca_file), bind 127.0.0.1, or set "
            "auth.insecure_tcp=true to accept that anyone who reaches the port can read, "
            "write and evict every block", exit_code=2)
    return (f"INSECURE: server.tcp={tcp} accepts unauthenticated calls from the network "
            "(auth.insecure_tcp=true): anyone who reaches it can read, write and evict every "
            "block")


def _tls_credentials(cfg: StoreConfig) -> Any:
    """grpcio server credentials for the TCP listener (None: plaintext)."""
    import grpc

    a = cfg.auth
    if not a.tls_cert_file:
        return None
    try:
        key = Path(a.tls_key_file).read_bytes()
        cert = Path(a.tls_cert_file).read_bytes()
        ca = Path(a.tls_client_ca_file).read_bytes() if a.tls_client_ca_file else None
    except OSError as e:
        raise StartupError(f"config error: cannot read a TLS file ({e.filename}): "
                           f"{e.strerror}", exit_code=2) from None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                       require_client_auth=ca is not None)


def _bind_tcp(server: Any, address: str, creds: Any = None) -> str:
    try:
        port = (server.add_secure_port(address, creds) if creds is not None
                else server.add_insecure_port(address))
    except RuntimeError as e:
        raise StartupError(f"cannot listen on TCP {address}: {e} (is the port in use? set "
                           "server.tcp / --tcp, or '' to disable)") from None
    if not port:
        raise StartupError(f"cannot listen on TCP {address} (is the port in use?)")
    host = address.rpartition(":")[0]
    return f"{host}:{port}"


class ShutdownProgress:
    """Says once a second what a stop is waiting for: a silent wait looks like a hang."""

    def __init__(self, say: Callable[[str], None], describe: Callable[[], str],
                 interval_s: float = 1.0) -> None:
        self._say, self._describe, self._interval = say, describe, interval_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-stop-progress",
                                        daemon=True)

    def __enter__(self) -> ShutdownProgress:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(2.0)

    def _run(self) -> None:
        while not self._done.wait(self._interval):
            try:
                what = self._describe()
            except Exception as e:  # a progress line must never break the stop
                what = f"(cannot say: {e})"
            self._say(f"stopping ({time.monotonic() - self._t0:.0f} s): {what}")


class CallCount:
    """Calls in flight, for the stop's progress line, where no metrics endpoint is configured
    (so the daemon never loads prometheus_client). Same inc/dec as the metrics' gauge."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def inc(self) -> None:
        with self._lock:
            self.value += 1

    def dec(self) -> None:
        with self._lock:
            self.value -= 1


class Daemon:
    """Owns the lock, store, gRPC server and metrics endpoint of one daemon run."""

    def __init__(self, config: StoreConfig, store_factory: Callable[[StoreConfig], Any] | None
                 = None, out: TextIO | None = None) -> None:
        self.config = config
        self._store_factory = store_factory
        self.out = out or sys.stderr
        self.lock = DataDirLock(config.data_dir)
        self.stop_requested = threading.Event()
        self.store: Any = None
        self.server: Any = None
        self.health: Any = None
        self.servicer: Any = None
        self.auth: Any = None
        self.handoff: Any = None
        self.lane: Any = None
        self.metrics: Any = None
        self.socket_path = os.path.abspath(config.socket_path)
        self.tcp_address: str | None = None
        self.metrics_url: str | None = None
        self._phase: tuple[str, float] = ("starting", time.monotonic())
        self._calls: Any = None         # calls in flight: CallCount, or the metrics' gauge
        self._demoted_before = 0

    def _say(self, line: str) -> None:
        print(f"kvstore: {line}", file=self.out, flush=True)

    def start(self) -> None:
        """Everything up to SERVING; raises StartupError (after undoing what it did)."""
        from grpc_health.v1 import health_pb2

        from .auth import store_auth
        from .config import ConfigError
        from .events.errors import EventsAddressError
        from .handoff import SUFFIX, Handoff
        from .server import SERVICE, KVStoreServicer, build_server
        from .tenants import load_tenants, quota_overcommit

        cfg = self.config
        try:
            tenants = load_tenants(cfg)
        except ConfigError as e:
            raise StartupError(f"config error: {e}", exit_code=2) from None
        insecure = check_exposure(cfg, tenants)
        for line in quota_overcommit(cfg, tenants):
            log.warning("%s", line)
        tls = _tls_credentials(cfg) if cfg.server.tcp else None
        check_data_dir_writable(self.lock.path.parent)    # before LOCK is touched at all
        self.lock.acquire()
        try:
            check_socket_free(self.socket_path)
            factory = self._store_factory
            if factory is None:
                from .store import Store

                def factory(c: StoreConfig) -> Any:
                    return Store(c, background=False)   # started once SERVING (below)

                _one_torch_thread()
            try:
                self.store = factory(cfg)
            except EventsAddressError as e:
                raise StartupError(str(e), exit_code=2) from None
            except KVStoreError as e:
                raise StartupError(f"cannot open the store: {e}") from None
            except OSError as e:
                if e.errno in FS_ERRNOS:
                    raise _fs_error(Path(cfg.data_dir), e) from None
                raise StartupError(f"cannot open the store in {cfg.data_dir}: {e}") from None
            # Prometheus (about as much CPU as a bare gRPC server's whole start) only where an
            # endpoint can show it; without one, calls in flight are counted for the stop line.
            if cfg.server.metrics:
                from .metrics import Metrics

                self.metrics = Metrics(self.store)
                observe, self._calls = self.metrics.observe, self.metrics.in_flight
            else:
                observe, self._calls = None, CallCount()
            self.auth = store_auth(self.store, tenants, mtls=bool(cfg.auth.tls_client_ca_file))
            self.servicer = KVStoreServicer(
                self.store, max_ttl_s=cfg.leases.max_ttl_s, gpu_enabled=bool(self.store.gpu),
                observe=observe, in_flight=self._calls, auth=self.auth)
            self.server, self.health = build_server(self.servicer, cfg.server.workers,
                                                    cfg.server.max_message_bytes)
            _bind_unix(self.server, self.socket_path, 0o666 if tenants else 0o600)
            if cfg.server.lane:
                from kvstore_client.lane_wire import lane_path

                from .lane import Lane

                try:
                    self.lane = Lane(lane_path(self.socket_path), self.servicer,
                                     0o666 if tenants else 0o600)
                except OSError as e:     # e.g. a socket path too long for the suffix
                    log.warning("fast lane off (%s: %s); clients use gRPC for every call",
                                lane_path(self.socket_path), e)
            if tenants:
                from .tenant_metrics import TenantCollector, TenantCounters
                self.servicer.tenant_counters = TenantCounters()
                if self.metrics is not None:
                    self.metrics.registry.register(TenantCollector(
                        self.store, sorted(tenants), self.servicer.tenant_counters))
                self.handoff = Handoff(self.socket_path + SUFFIX, self.auth,
                                       getattr(self.store, "tenant_pool", None),
                                       gpu_for=getattr(self.store, "gpu_segment_fds", None))
            if cfg.server.tcp:
                self.tcp_address = _bind_tcp(self.server, cfg.server.tcp, tls)
            if cfg.server.metrics:
                try:
                    self.metrics_url = self.metrics.serve(cfg.server.metrics)
                except OSError as e:
                    raise StartupError(f"cannot serve metrics on {cfg.server.metrics}: {e} "
                                       "(set server.metrics / --metrics, or '' to disable)"
                                       ) from None
            self.server.start()
        except BaseException:
            self._teardown()
            raise
        self._say(f"serving gRPC on unix:{self.socket_path}")
        if self.tcp_address:
            self._say(f"serving gRPC on {self.tcp_address}"
                      + (" (mTLS)" if cfg.auth.tls_client_ca_file else
                         " (TLS)" if tls is not None else ""))
        if insecure:
            log.warning("%s", insecure)
        if tenants:
            self._say(f"{len(tenants)} tenants; every call is authenticated (uid handshake on "
                      f"unix:{self.socket_path}{SUFFIX})")
        self._say(f"metrics on {self.metrics_url}" if self.metrics_url else "metrics disabled")
        events = getattr(self.store, "events", None)
        for name, (addr, replay) in (events.addresses.items() if events is not None else ()):
            self._say(f"KV events ({name} stream) on {addr}"
                      + (f", replay on {replay}" if replay else ""))
        for name in ("", SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("daemon %s ready (pid %d, data %s)", self.store.daemon_id, os.getpid(),
                 cfg.data_dir)
        threading.Thread(target=self._after_ready, name="kvstore-after-ready",
                         daemon=True).start()

    def _after_ready(self) -> None:
        """What the daemon does once it reports SERVING, off the path to it: the store's
        background threads, freezing the startup objects, loading numpy and the codecs.

        It waits AFTER_READY_S first (or until a stop): the calls that come right after
        SERVING (a readiness probe, an engine registering) would otherwise compete with this
        speculative work for the GIL and the cores. On the shared 2-core machine at load 8,
        starting it at once delayed the first health check by about 0.15 s. Nothing waits for
        it: a writer that finds the host pool full evicts inline, a copy into a page not yet
        prefaulted takes the fault, the first block that moves imports what it needs.
        """
        if self.stop_requested.wait(AFTER_READY_S):
            return
        start = getattr(self.store, "start_background", None)
        if start is not None:
            start()
        # The objects made at startup (modules, a warm restart's index) stay for the daemon's
        # life; frozen, the cyclic GC's full collections no longer walk them. Unfrozen, one
        # took 14-22 ms of CPU (about 40k objects) inside whichever call tripped it: a Reserve
        # or Acquire of 1,024 blocks then cost 20x its usual time (issue 19).
        gc.collect()
        gc.freeze()
        import numpy  # noqa: F401 - the first data call would otherwise load it
        if not self.stop_requested.is_set():
            _warm_get()
        if self.config.ssd.enabled or self.config.remote.enabled:
            _warm_codecs(self.stop_requested)

    def request_stop(self, signum: int | None = None, _frame: Any = None) -> None:
        if signum is not None and self.stop_requested.is_set():
            log.warning("second signal while stopping; still waiting for in-flight calls")
        self.stop_requested.set()

    def wait(self) -> None:
        while not self.stop_requested.wait(1.0):
            pass

    def _in_flight(self) -> int:
        if isinstance(self._calls, CallCount):
            return self._calls.value
        if self.metrics is None:
            return 0
        return int(self.metrics.registry.get_sample_value("kvstore_rpcs_in_flight") or 0)

    def _stop_status(self) -> str:
        """What the stop waits for now (ShutdownProgress prints it)."""
        phase, since = self._phase
        if phase == "calls":
            left = max(0.0, self.config.server.shutdown_grace_s - (time.monotonic() - since))
            return (f"waiting for {self._in_flight()} in-flight calls to finish (cancelled in "
                    f"{left:.0f} s)")
        if phase == "store" and self.store is not None:
            written = self.store.tier_counters["host"]["demotions"] - self._demoted_before
            return (f"writing host blocks down to SSD, then closing the store ({written} "
                    "written so far)")
        return phase

    def shutdown(self) -> None:
        """Graceful stop: see the module docstring for the order.

        Idle, this takes well under a second: the metrics endpoint's own shutdown (it polls
        every 0.5 s) runs beside the rest instead of before it.
        """
        from grpc_health.v1 import health_pb2

        grace = self.config.server.shutdown_grace_s
        log.info("stopping: finishing in-flight calls (grace %.1f s)", grace)
        metrics_closing = None
        if self.metrics is not None:
            metrics_closing = threading.Thread(target=self.metrics.close, daemon=True,
                                               name="kvstore-metrics-close")
            metrics_closing.start()
        self._phase = ("calls", time.monotonic())
        self._demoted_before = (self.store.tier_counters["host"]["demotions"]
                                if self.store is not None else 0)
        with ShutdownProgress(self._say, self._stop_status):
            if self.health is not None:
                self.health.enter_graceful_shutdown()
                self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            if self.servicer is not None:
                self.servicer.start_shutdown()
            if self.server is not None:
                self.server.stop(grace).wait(grace + 5)
                self.server = None
            self._phase = ("store", time.monotonic())
            self._teardown(close_metrics=metrics_closing is None)
            if metrics_closing is not None:
                metrics_closing.join(5.0)
                self.metrics = None
        self._say("stopped")

    def _teardown(self, close_metrics: bool = True) -> None:
        if self.lane is not None:
            self.lane.close()
            self.lane = None
        if self.handoff is not None:
            self.handoff.close()
            self.handoff = None
        if self.server is not None:
            self.server.stop(None)
            self.server = None
        if self.metrics is not None and close_metrics:
            self.metrics.close()
        if self.store is not None:
            try:
                if self._store_factory is None:     # our Store: bounded flush, with progress
                    self.store.close(flush_budget_s=self.config.server.stop_flush_s,
                                     progress=self._say)
                else:
                    self.store.close()
            except Exception:
                log.exception("closing the store failed")
            self.store = None
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        self.lock.release()


def run(config: StoreConfig, store_factory: Callable[[StoreConfig], Any] | None = None) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit code."""
    d = Daemon(config, store_factory)
    signal.signal(signal.SIGTERM, d.request_stop)
    signal.signal(signal.SIGINT, d.request_stop)
    try:
        d.start()
    except StartupError as e:
        print(f"kvstore: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    try:
        d.wait()
    finally:
        d.shutdown()
    return 0
