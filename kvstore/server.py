"""gRPC front of the Store: run each call, map its errors to status codes, register the methods.

The handlers themselves live in kvstore/handlers/ by group (namespaces and lookups, leases,
the Put/Get byte streams, administration), with the request checks they share
(kvstore/handlers/validate.py). This module is what every call passes through on its way to
one of them.

Why every method takes an iterator of requests: the gate (kvstore/gate.py) registers them all
as request-streaming, so a handler's worker thread is not spent waiting for a request before
the caller is known; `unary` below reads the one message of a unary call itself, after the
gate let the call in. Why requests arrive as raw bytes: grpcio answers a request it cannot
deserialize with INTERNAL, which would make garbage from a client look like a daemon bug; the
handlers parse their requests themselves.

Error mapping: a `kvstore_client.errors` exception travels as the status its `.code` names;
anything else is a bug: INTERNAL, with the traceback logged, and the daemon keeps serving.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import Message
from kvstore_client.common.errors import InvalidArgument, KVStoreError, Unavailable

from . import gate, refusal
from .auth import OPEN, Auth
from .handlers import client_call
from .handlers.admin import AdminCalls
from .handlers.leases import LeaseCalls
from .handlers.namespaces import NamespaceCalls
from .handlers.state import CallState
from .handlers.streams import StreamCalls

log = logging.getLogger("kvstore.server")

SERVICE = "kvstore.v1.KVStore"
UNARY = ("RegisterNamespace", "Lookup", "Reserve", "Commit", "Acquire", "Release",
         "RenewLease", "Retain", "Delete", "Evict", "Flush", "Stats", "Locate",
         "LookupReserve", "LookupAcquire")

Observer = Callable[[str, str, float], None]


def _one(requests: Iterator[bytes], method: str) -> bytes:
    """The one request message of a unary call (the gate's deadline ends a wait for it)."""
    raw = next(requests, None)
    gate.received(len(raw) if raw is not None else 0)
    if raw is None:
        raise InvalidArgument(f"{method} carried no request message")
    return raw


def _status(code: str) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, code, grpc.StatusCode.INTERNAL)


class KVStoreServicer:
    """The RPCs of kvstore.v1.KVStore: each call timed, counted and its errors mapped here, its
    work done by one of the handler groups, which share `state`."""

    def __init__(self, store: Any, max_ttl_s: float = 600.0, gpu_enabled: bool = False,
                 observe: Observer | None = None, in_flight: Any = None,
                 auth: Auth | None = None) -> None:
        self.state = CallState(store, auth or OPEN, max_ttl_s, gpu_enabled)
        self.auth = self.state.auth
        self._observe = observe
        self._in_flight = in_flight   # optional prometheus Gauge
        self._closing = threading.Event()
        self._lane_lock = threading.Lock()
        self.namespaces = NamespaceCalls(self.state)
        self.leases = LeaseCalls(self.state)
        self.streams = StreamCalls(self.state)
        self.admin = AdminCalls(self.state)
        self.methods: dict[str, Callable[[bytes], Message]] = {
            name: getattr(group, name)
            for group in (self.namespaces, self.leases, self.admin)
            for name in UNARY if hasattr(group, name)}

    def start_shutdown(self) -> None:
        """New calls get UNAVAILABLE from now on; calls already running finish."""
        self._closing.set()
        self.namespaces.close()

    # -- plumbing -----------------------------------------------------------------------------
    def _enter(self) -> None:
        if self._closing.is_set():
            raise Unavailable("the daemon is shutting down; retry against its replacement")
        if self._in_flight is not None:
            self._in_flight.inc()

    def _done(self, method: str, code: str, t0: float, entered: bool) -> None:
        if entered and self._in_flight is not None:
            self._in_flight.dec()
        if self._observe is not None:
            self._observe(method, code, time.perf_counter() - t0)

    @staticmethod
    def _failure(method: str, exc: BaseException) -> tuple[str, str]:
        if isinstance(exc, KVStoreError) and exc.code != "INTERNAL":
            return exc.code, str(exc) or type(exc).__name__
        if isinstance(exc, grpc.RpcError):
            # From the request iterator: the call ended while its request was awaited (the
            # client went away, or the gate's deadline ended it and said so already).
            return "CANCELLED", f"{method}: the call ended before its request arrived"
        log.error("%s failed with an unexpected error", method, exc_info=exc)
        return "INTERNAL", f"internal error in {method}: {type(exc).__name__}: {exc}"

    def unary(self, method: str, fn: Callable[[Any], Message], stream: bool = False
              ) -> Callable:
        """Wrap `fn(request)` (`fn(requests)`, the iterator itself, for a client stream):
        timing, in-flight count, exception -> status. The one request of a unary call is read
        here, after the gate let the call in (module docstring)."""
        def handler(requests: Iterator[bytes], context: grpc.ServicerContext) -> Message:
            t0, entered = time.perf_counter(), False
            try:
                self._enter()
                entered = True
                with client_call.serving(context):
                    resp = fn(requests if stream else _one(requests, method))
            except Exception as exc:
                code, msg = self._failure(method, exc)
                self._done(method, code, t0, entered)
                context.abort(_status(code), msg)
            self._done(method, "OK", t0, entered)
            return resp
        return handler

    def lane_call(self, method: str, raw: bytes, tenant: Any) -> tuple[str, bytes]:
        """One call from the fast lane (kvstore/lane.py): as `unary`, with the caller known
        from the connection's hello; returns (status code, response or error message)."""
        t0, entered = time.perf_counter(), False
        try:
            self._enter()
            entered = True
            self.auth.bind(tenant)
            body = self.methods[method](raw).SerializeToString()
            with self._lane_lock:         # lane threads run at once; store.counters has no lock
                self.state.store.counters["lane_calls"] += 1
        except Exception as exc:
            code, msg = self._failure(method, exc)
            self._done(method, code, t0, entered)
            return code, msg.encode()
        self._done(method, "OK", t0, entered)
        return "OK", body

    def server_stream(self, method: str, fn: Callable[[bytes], Iterator[Message]]) -> Callable:
        """Like `unary` for a generator; an error after some messages ends the stream with it."""
        def handler(requests: Iterator[bytes], context: grpc.ServicerContext
                    ) -> Iterator[Message]:
            t0, entered = time.perf_counter(), False
            code, msg = "OK", ""
            try:
                self._enter()
                entered = True
                raw = next(requests, None)      # the deadline stays armed: a Get's reply
                if raw is None:                 # must be taken within it too
                    raise InvalidArgument(f"{method} carried no request message")
                gate.request_bytes(len(raw))
                yield from fn(raw)
            except GeneratorExit:   # the client went away mid-stream
                code = "CANCELLED"
                raise
            except Exception as exc:
                code, msg = self._failure(method, exc)
            finally:
                self._done(method, code, t0, entered)
            if code != "OK":
                context.abort(_status(code), msg)
        return handler

    # -- registration -------------------------------------------------------------------------
    def handler(self) -> grpc.GenericRpcHandler:
        """The generic handler with raw-bytes request deserializers (see module docstring)."""
        def ser(msg: Message | bytes) -> bytes:
            # Get replies arrive already encoded (one copy from the slab, no protobuf copies).
            return msg if isinstance(msg, bytes) else msg.SerializeToString()

        # All request-streaming: the handler reads its request itself (module docstring).
        handlers = {name: grpc.stream_unary_rpc_method_handler(
            self.unary(name, fn), response_serializer=ser) for name, fn in self.methods.items()}
        handlers["Put"] = grpc.stream_unary_rpc_method_handler(
            self.unary("Put", self.streams.Put, stream=True), response_serializer=ser)
        handlers["Get"] = grpc.stream_stream_rpc_method_handler(
            self.server_stream("Get", self.streams.Get), response_serializer=ser)
        return grpc.method_handlers_generic_handler(SERVICE, handlers)


# -------------------------------------------------------------------------- the server

# The HTTP/2 receive window of every stream, fixed: what a peer may send on a call (and, about,
# on all its calls of one connection) before the daemon reads it, token or not. grpc's
# bandwidth-delay probing, on by default, grew it from the rate bytes arrived at, which a peer
# controls: one pumping bytes into refused calls made its next streams' windows 8 MiB. A handler
# reading a message still opens its stream's window to that message's length, so a Put of
# 2-4 MiB messages is not held to 256 KiB round trips.
STREAM_WINDOW_BYTES = 256 << 10


def grpc_options(max_message_bytes: int, max_receive_bytes: int) -> list[tuple[str, Any]]:
    return [
        # gRPC checks this from a message's length prefix, before it buffers the body: the
        # one receive limit it has, for every method (kvstore/gate.py).
        ("grpc.max_receive_message_length", max_receive_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # Two daemons must never share a TCP port silently: bind fails instead.
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
    ]


@dataclass
class Front:
    """What build_server made besides the server: the gate's parts the daemon keeps."""
    health: gate.Health
    admission: gate.Admission
    deadlines: gate.Deadlines
    budget: gate.RefusalBudget
    held: refusal.Held | None       # refusals answered late (kvstore/refusal.py)

    def close(self) -> None:
        """Post the held refusals now and stop the gate's threads (before the server stops:
        a held call is one grpcio waits for)."""
        if self.held is not None:
            self.held.close()
        self.deadlines.close()


def build_server(servicer: KVStoreServicer, workers: int, max_message_bytes: int,
                 max_receive_bytes: int = 4 << 20, request_deadline_s: float = 30.0,
                 tenant_calls: int = 0, preauth_calls: int = 8,
                 refusals: tuple[float, int, int] = (10.0, 50, 50)
                 ) -> tuple[grpc.Server, Front]:
    """A thread-pool gRPC server with the KVStore service behind the gate (kvstore/gate.py),
    health checking and reflection.

    Returns (server, front); the caller binds ports, starts it and flips front.health to
    SERVING once it is really ready. With tenants each has `tenant_calls` (0: `workers`)
    calls in flight and the pool a thread for each, and `refusals` (per second, burst, burst of
    unknown ids: gate.RefusalBudget) calls refused as its own mistake before the gate refuses
    its calls unread; without tenants, `workers` threads serve all.
    """
    from grpc_health.v1 import health
    from grpc_reflection.v1alpha import reflection

    auth = servicer.auth
    if auth.enabled:
        per = tenant_calls or workers
        caps = {name: per for name in auth.tenants}
        if auth.mtls:
            caps[gate.PREAUTH] = preauth_calls
        admission = gate.Admission(caps)
        threads = admission.threads
        budget = gate.RefusalBudget(*refusals)
        held = refusal.Held({name: per for name in auth.tenants})
    else:
        admission, threads, budget = gate.Admission({}), workers, gate.OPEN_BUDGET
        held = None
    refusal.install()
    deadlines = gate.Deadlines(request_deadline_s)
    health_state = gate.Health()
    interceptor = gate.Gate(auth, admission, deadlines, health_state, servicer._observe,
                            budget, held)
    server = grpc.server(ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rpc"),
                         options=grpc_options(max_message_bytes, max_receive_bytes),
                         interceptors=(interceptor,), maximum_concurrent_rpcs=None)
    server.add_generic_rpc_handlers((servicer.handler(),))
    reflection.enable_server_reflection(
        (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return server, Front(health_state, admission, deadlines, budget, held)
