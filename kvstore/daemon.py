"""Daemon lifecycle: lock the data folder, start store + gRPC + metrics, stop cleanly on a signal.

Start order: the data folder's lock (kvstore/datadir.py), the store, the gRPC server behind its
gate with the listeners (kvstore/binding.py), the fast lane and the tenants' handoff socket,
metrics; SERVING; then, off the path to it, the store's background threads and the warm-ups
(kvstore/warmup.py). Any step that fails undoes the ones before it and ends the start with one
line (StartupError).

Shutdown order on SIGTERM/SIGINT: health flips to NOT_SERVING and new calls get UNAVAILABLE;
the gRPC server stops accepting and gives in-flight calls `server.shutdown_grace_s`; only then
is the store closed (flush to SSD, close LMDB, unlink the shm slab) and the socket removed.
A progress line a second says what the stop waits for (kvstore/stopping.py).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from kvstore_client.common.errors import InvalidArgument, KVStoreError

from .binding import bind_tcp, bind_unix, check_exposure, check_socket_free, tls_credentials
from .config import StoreConfig
from .datadir import (
    FS_ERRNOS,
    DataDirLock,
    StartupError,
    check_data_dir_writable,
    fs_error,
    tighten_modes,
)
from .gc_pauses import freeze_long_lived, walked_objects
from .stopping import CallCount, ShutdownProgress
from .warmup import one_torch_thread, warm_codecs, warm_get

log = logging.getLogger("kvstore.daemon")

AFTER_READY_S = 0.2     # the daemon's own warm-up waits this long after SERVING (_after_ready)


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
        self.front: Any = None          # the gate's parts (kvstore/gate.py)
        self.servicer: Any = None
        self.auth: Any = None
        self.handoff: Any = None
        self.lane: Any = None
        self.metrics: Any = None
        self.socket_path = os.path.abspath(config.socket_path)
        # (st_dev, st_ino) of the socket file this run bound; None: it bound none, so a stop
        # or a refused start removes nothing at socket_path (it may be a live daemon's).
        self._bound_socket: tuple[int, int] | None = None
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
        from .unix_listener import Caps

        cfg = self.config
        try:
            tenants = load_tenants(cfg)
        except ConfigError as e:
            raise StartupError(f"config error: {e}", exit_code=2) from None
        insecure = check_exposure(cfg, tenants)
        for line in quota_overcommit(cfg, tenants):
            log.warning("%s", line)
        tls = tls_credentials(cfg) if cfg.server.tcp else None
        check_data_dir_writable(self.lock.path.parent)    # before LOCK is touched at all
        self.lock.acquire()
        # Other users reach nothing in the folder (docs/security.md), but a tenants' socket in
        # it (the default path) must stay reachable: then the folder is 0711, never listable.
        data = Path(cfg.data_dir).resolve()
        searchable = bool(tenants) and data in Path(self.socket_path).resolve().parents
        try:
            self._tighten(searchable)
            check_socket_free(self.socket_path)
            factory = self._store_factory
            if factory is None:
                from .store import Store

                def factory(c: StoreConfig) -> Any:
                    return Store(c, background=False)   # started once SERVING (below)

                one_torch_thread()
            try:
                self.store = factory(cfg)
            except EventsAddressError as e:
                raise StartupError(str(e), exit_code=2) from None
            except KVStoreError as e:
                # A setting the store refused (InvalidArgument) is the operator's: exit 2.
                raise StartupError(f"cannot open the store: {e}",
                                   exit_code=2 if isinstance(e, InvalidArgument) else 1
                                   ) from None
            except OSError as e:
                if e.errno in FS_ERRNOS:
                    raise fs_error(Path(cfg.data_dir), e) from None
                raise StartupError(f"cannot open the store in {cfg.data_dir}: {e}") from None
            self._tighten(searchable)       # what the store just made (an older build's modes)
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
            lim = cfg.limits
            self.auth.sessions_per_tenant = lim.sessions_per_tenant
            self.server, self.front = build_server(
                self.servicer, cfg.server.workers, cfg.server.max_message_bytes,
                cfg.server.max_receive_bytes, lim.request_deadline_s, lim.tenant_calls,
                lim.preauth_calls,
                (lim.refusals_per_s, lim.refusal_burst, lim.unknown_id_burst()))
            self.health = self.front.health
            pending = Caps(deadline_s=lim.hello_deadline_s, per_uid=lim.pending_per_uid,
                           total=lim.pending_total)
            bind_unix(self.server, self.socket_path, 0o666 if tenants else 0o600)
            st = os.lstat(self.socket_path)
            self._bound_socket = (st.st_dev, st.st_ino)
            if cfg.server.lane:
                from kvstore_client.common.lane_wire import lane_path

                from .lane import Lane

                try:
                    self.lane = Lane(lane_path(self.socket_path), self.servicer,
                                     0o666 if tenants else 0o600, pending,
                                     lim.lane_per_tenant, lim.frame_deadline_s,
                                     self.front.budget)
                except OSError as e:     # e.g. a socket path too long for the suffix
                    log.warning("fast lane off (%s: %s); clients use gRPC for every call",
                                lane_path(self.socket_path), e)
            if tenants:
                from .tenant_metrics import TenantCollector, TenantCounters
                self.servicer.state.tenant_counters = TenantCounters()
                if self.metrics is not None and cfg.server.metrics_tenants:
                    self.metrics.registry.register(TenantCollector(
                        self.store, sorted(tenants), self.servicer.state.tenant_counters))
                self.handoff = Handoff(self.socket_path + SUFFIX, self.auth,
                                       getattr(self.store, "tenant_pool", None),
                                       gpu_for=getattr(self.store, "gpu_segment_fds", None),
                                       caps=pending)
            if cfg.server.tcp:
                self.tcp_address = bind_tcp(self.server, cfg.server.tcp, tls)
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

    def _tighten(self, searchable: bool) -> None:
        for change in tighten_modes(self.config.data_dir, searchable):
            log.info("made owner-only: %s", change)

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
        # or Acquire of 1,024 blocks then cost 20x its usual time. Frozen again once the
        # warm-ups are done: what they load (numpy, numba, the kernels) is as long-lived, and
        # left unfrozen it made each full collection under load 70-90 ms (kvstore/gc_pauses.py).
        freeze_long_lived()
        import numpy  # noqa: F401 - the first data call would otherwise load it
        if not self.stop_requested.is_set():
            warm_get()
        if self.config.ssd.enabled or self.config.remote.enabled:
            warm_codecs(self.stop_requested)
        frozen = freeze_long_lived()
        counters = getattr(self.store, "counters", None)
        if counters is not None and not self.stop_requested.is_set():
            counters["gc_frozen_objects"] = frozen
            counters["gc_walked_objects"] = walked_objects()

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

        Idle, this takes well under a second: the metrics endpoint's own shutdown runs beside
        the rest instead of before it.
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
            if self.front is not None and self.front.held is not None:
                self.front.held.close()         # held refusals answered now: grpcio waits
            if self.server is not None:       # for every call it has not ended
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
        if self.front is not None:
            self.front.close()
            self.front = None
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
        self._unlink_socket()
        self.lock.release()

    def _unlink_socket(self) -> None:
        """Remove the socket file only if it is the one this run bound: a start refused because
        another daemon listens there must leave that daemon's socket alone."""
        bound, self._bound_socket = self._bound_socket, None
        if bound is None:
            return
        try:
            st = os.lstat(self.socket_path)
            if (st.st_dev, st.st_ino) == bound:
                os.unlink(self.socket_path)
        except FileNotFoundError:
            pass


def run(config: StoreConfig, store_factory: Callable[[StoreConfig], Any] | None = None) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit code."""
    d = Daemon(config, store_factory)
    signal.signal(signal.SIGTERM, d.request_stop)
    signal.signal(signal.SIGINT, d.request_stop)
    # Whatever the daemon creates (LMDB, the events' sequence file, an index image) is its
    # user's alone; the sockets set their own modes (kvstore/binding.py).
    umask = os.umask(0o077)
    os.umask(umask | 0o077)
    try:
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
    finally:
        os.umask(umask)
