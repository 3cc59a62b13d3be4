"""The gRPC front door: who may start a call, on whose budget of threads, and until when.

Why a gate before the handlers: grpcio runs a call's handler on a worker thread, and a unary
handler's thread first waits for the request message, however long the client takes to send
it. A peer holding calls open without sending their message (or sending it a byte at a time)
held every worker, and a body was buffered whole before the handler could check the token. So:

- Credentials are checked here, on the gRPC server's own thread, from the call's metadata
  (a dict lookup, or one SHA-256 per new token), before a worker is given to the call. A call
  without them is answered UNAUTHENTICATED without reading anything, on that same thread
  (kvstore/refusal.py), as is every other refusal of the gate.
- Every KVStore method is registered as request-streaming (the wire is the same for a unary
  client): grpcio then hands the handler an iterator instead of waiting for the message on the
  worker's behalf, and the servicer reads the message only after the gate has let the call in.
- Each tenant may have `limits.tenant_calls` calls in flight; the next is refused
  (RESOURCE_EXHAUSTED) at once. The pool has a thread for every call the caps let in, so a
  tenant that stalls its own calls stalls only them. Without tenants there is one implicit
  tenant and no cap (calls queue for `server.workers` threads, as a single-engine sidecar
  expects).
- Each tenant has a budget of refused calls (`limits.refusals_per_s`, a token bucket holding
  `limits.refusal_burst`): every call of its that ends INVALID_ARGUMENT, PERMISSION_DENIED or
  OUT_OF_RANGE spends one per CHARGE_BYTES (256 KiB) of its request message started, and
  while it has none left its calls are refused RESOURCE_EXHAUSTED here, before a worker reads
  a byte of them, one second late (kvstore/refusal.py, Held). NOT_FOUND (an unknown id) spends
  from a second bucket of the same rate holding what the tenant may hold at once
  (RefusalBudget says why). A correct client makes such mistakes rarely; a hostile one
  sending 1 MiB requests the daemon must receive and refuse (about 4-8 ms of daemon CPU each,
  nearly all of it receiving the bytes) bought that much of the daemon per request, in a
  loop: charged by size, it buys a fixed share of the daemon's time, not of its calls.
  Refusals for a cap or a full pool (RESOURCE_EXHAUSTED) are not charged: a busy engine
  meets them in normal work, and must not be locked out of the calls that free room.
- A call's request (every message of a Put) and a Get's reply must move within
  `limits.request_deadline_s` of the call's start: past it the watchdog cancels the call
  (DEADLINE_EXCEEDED), which wakes the thread waiting on it.
- gRPC's receive limit (`server.max_receive_bytes`, one limit for every method) is checked
  from a message's length prefix, before its body is buffered; every valid request but Put
  fits in 4 MiB, and Put streams blocks in messages of that size (kvstore/server.py).

Health checks stay open: Check answers from the daemon's one status without reading its
request, so it never waits on a client. Reflection and health Watch need credentials like
every other call where tenants are configured (Watch is not served: Check is what probes use).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from kvstore_client.common.errors import KVStoreError

from .auth import Auth
from .refusal import HOLD_S, Held, Refusal
from .tenants import Tenant

log = logging.getLogger("kvstore.gate")

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
SERVING, NOT_SERVING = 1, 2         # grpc.health.v1 HealthCheckResponse.ServingStatus
IMPLICIT = ""                       # the admission class of every call without tenants
PREAUTH = "\0preauth"               # mTLS calls whose certificate is not matched yet
CHARGE_BYTES = 256 << 10            # a refused request spends a refusal per these bytes
REFUSE_THREADS = 2                  # pool threads beyond the caps, for refusals (µs each)

Observer = Callable[[str, str, float], None]


class Deadlines:
    """Cancels calls that pass their absolute deadline (one thread for all of them).

    Every call gets the same allowance, so deadlines arrive in the order calls were armed: an
    insertion-ordered dict is a queue whose head is the next to expire, and disarming a call
    that finished is O(1).
    """

    def __init__(self, allowance_s: float) -> None:
        self.allowance_s = allowance_s
        self._armed: OrderedDict[int, tuple[float, Any, str]] = OrderedDict()
        self._cond = threading.Condition()
        self._next = 0
        self._closed = False
        self.cancelled = 0
        self._thread = threading.Thread(target=self._run, name="kvstore-deadlines",
                                        daemon=True)
        self._thread.start()

    def arm(self, context: Any, what: str) -> int:
        with self._cond:
            token = self._next
            self._next += 1
            self._armed[token] = (time.monotonic() + self.allowance_s, context, what)
            if len(self._armed) == 1:
                self._cond.notify()
            return token

    def disarm(self, token: int | None) -> None:
        if token is not None:
            with self._cond:
                self._armed.pop(token, None)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(2)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._armed and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                token = next(iter(self._armed))
                deadline, context, what = self._armed[token]
                left = deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                del self._armed[token]
                self.cancelled += 1
            cancel(context, f"{what} did not finish within limits.request_deadline_s "
                            f"({self.allowance_s:g} s of the call's start); the daemon ended it")


def cancel(context: Any, details: str) -> None:
    """End a call with DEADLINE_EXCEEDED from any thread, waking a handler blocked on it.

    grpcio's public `context.cancel()` ends it with CANCELLED, which reads as "the client went
    away"; the call object below it takes a status, and is used where it is there.
    """
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    try:
        from grpc._cython import cygrpc
        call.cancel(cygrpc.StatusCode.deadline_exceeded, details)
    except Exception:  # noqa: BLE001 - another grpcio: the public call, CANCELLED
        context.cancel()


class Admission:
    """Calls in flight per class (a tenant's name, PREAUTH), each class under its cap."""

    def __init__(self, caps: dict[str, int]) -> None:
        self.caps = caps                   # class -> most calls in flight (absent: no cap)
        self._in: dict[str, int] = {}
        self._lock = threading.Lock()
        self.refused = 0

    def enter(self, cls: str) -> bool:
        with self._lock:
            n = self._in.get(cls, 0)
            cap = self.caps.get(cls)
            if cap is not None and n >= cap:
                self.refused += 1
                return False
            self._in[cls] = n + 1
            return True

    def leave(self, cls: str) -> None:
        with self._lock:
            self._in[cls] -= 1

    def in_flight(self, cls: str) -> int:
        return self._in.get(cls, 0)

    @property
    def threads(self) -> int:
        """Threads that serve every call the caps admit at once, and the refusals."""
        return sum(self.caps.values()) + REFUSE_THREADS


class RefusalBudget:
    """Refused calls each tenant may make per second (module docstring): token buckets per
    admission class, refilled at `per_s`; `per_s` 0 turns it off.

    Two buckets, because two kinds of refusal come from different clients:
    - a mistake (INVALID_ARGUMENT, PERMISSION_DENIED, OUT_OF_RANGE) is the client's own: a
      correct one makes few, so `burst` of them is plenty;
    - an unknown id (NOT_FOUND) is what every honest engine meets after the daemon restarts or
      after a stall outlived its leases: each lease, namespace and session it held comes back
      unknown once, all at once. Its bucket holds `unknown_burst`, what a tenant may hold at
      once (its lease and namespace caps), so such an engine recovers without being refused,
      while a flood of unknown ids is refused once it has spent that.
    A call is let in while both buckets have a token left."""

    CHARGED = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                         grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OUT_OF_RANGE})

    def __init__(self, per_s: float, burst: int, unknown_burst: int | None = None) -> None:
        self.per_s = per_s
        self.burst = float(burst)
        self.unknown_burst = float(burst if unknown_burst is None
                                   else max(burst, unknown_burst))
        # (class, unknown?) -> (tokens, at monotonic); absent: a full bucket
        self._left: dict[tuple[str, bool], tuple[float, float]] = {}
        self._spent: set[str] = set()           # classes with a bucket below full
        self._lock = threading.Lock()
        self.refused = 0

    def _now_left(self, key: tuple[str, bool], now: float) -> float:
        full = self.unknown_burst if key[1] else self.burst
        tokens, at = self._left.get(key, (full, now))
        return min(full, tokens + (now - at) * self.per_s)

    def allows(self, cls: str) -> bool:
        """Whether `cls` has a refusal left to spend (counted as refused if not)."""
        if not self.per_s or cls not in self._spent:
            return True                 # the common case, no lock: it never spent one
        with self._lock:
            now = time.monotonic()
            if (self._now_left((cls, False), now) >= 1.0
                    and self._now_left((cls, True), now) >= 1.0):
                return True
            self.refused += 1
            return False

    def charge(self, cls: str, code: Any, request_bytes: int = 0) -> None:
        """A call of `cls` ended with `code` after a request of `request_bytes`: if it is a
        client's mistake or an unknown id, one token spent per CHARGE_BYTES started (what
        the daemon spent on it is mostly receiving those bytes)."""
        if not self.per_s or code not in self.CHARGED or cls == PREAUTH:
            return                  # PREAUTH: no tenant yet, nobody to charge
        key = (cls, code == grpc.StatusCode.NOT_FOUND)
        cost = 1.0 + max(0, request_bytes - 1) // CHARGE_BYTES
        with self._lock:
            now = time.monotonic()
            self._left[key] = (max(0.0, self._now_left(key, now) - cost), now)
            self._spent.add(cls)

    def wait_s(self, cls: str) -> float:
        """Seconds until `cls` has a refusal to spend again."""
        with self._lock:
            now = time.monotonic()
            short = max(1.0 - self._now_left((cls, k), now) for k in (False, True))
            return max(0.0, short / self.per_s)


OPEN_BUDGET = RefusalBudget(0.0, 1)
"""No budget: without tenants, or turned off (limits.refusals_per_s = 0)."""


class Health:
    """The daemon's serving status, answered by Check without reading the request (the daemon
    serves one status for "" and for its service; see the module docstring)."""

    def __init__(self) -> None:
        self.status = NOT_SERVING

    def set(self, _service: str, status: int) -> None:
        self.status = int(status)

    def enter_graceful_shutdown(self) -> None:
        self.status = NOT_SERVING

    def handler(self) -> grpc.RpcMethodHandler:
        def check(_requests: Iterator[bytes], _context: Any) -> bytes:
            return b"\x08" + bytes([self.status])      # HealthCheckResponse{status}
        return grpc.stream_unary_rpc_method_handler(check)


def _method_name(full: str) -> str:
    return full.rpartition("/")[2] or full


class Gate(grpc.ServerInterceptor):
    """Admits each call before a worker thread is spent on it (module docstring)."""

    def __init__(self, auth: Auth, admission: Admission, deadlines: Deadlines,
                 health: Health, observe: Observer | None = None,
                 budget: RefusalBudget = OPEN_BUDGET, held: Held | None = None) -> None:
        self.auth = auth
        self.budget = budget
        self.held = held
        self.admission = admission
        self.deadlines = deadlines
        self.health = health
        self._observe = observe
        self._health_handler = health.handler()

    def intercept_service(self, continuation: Callable, details: Any) -> Any:
        method = details.method
        if method == HEALTH_CHECK:
            return self._health_handler
        handler = continuation(details)
        if handler is None:
            return None                     # grpcio answers UNIMPLEMENTED (Health.Watch too)
        tenant: Tenant | None = None
        if not self.auth.enabled:
            cls = IMPLICIT
        else:
            try:
                tenant = self.auth.from_metadata(details.invocation_metadata or ())
            except KVStoreError as e:
                return self._refuse(handler, method, e.code, str(e))
            if tenant is not None:
                cls = tenant.name
            elif self.auth.mtls:
                cls = PREAUTH               # matched from its certificate, on its thread
            else:
                e = self.auth.no_credentials()
                return self._refuse(handler, method, e.code, str(e))
        if not self.budget.allows(cls):
            # answered HOLD_S late, holding no worker: a flood that waits for its answers
            # is slowed to that pace (kvstore/refusal.py)
            return self._refuse(handler, method, "RESOURCE_EXHAUSTED",
                                f"tenant {cls}'s calls were refused (invalid, unknown or not "
                                f"its own) more than {self.budget.per_s:g} times a second "
                                f"(limits.refusals_per_s); its calls are refused for "
                                f"{self.budget.wait_s(cls):.1f} s more",
                                (self.held, cls, HOLD_S) if self.held is not None else None)
        if not self.admission.enter(cls):
            who = "calls without a token" if cls == PREAUTH else f"tenant {cls}'s calls"
            return self._refuse(handler, method, "RESOURCE_EXHAUSTED",
                                f"{who} already fill their {self.admission.caps[cls]} "
                                "concurrent calls (limits.tenant_calls); retry when one ends")
        return self._admitted(handler, cls, tenant)

    def _refuse(self, handler: Any, method: str, code: str, message: str,
                hold: tuple[Held, str, float] | None = None) -> Any:
        if self._observe is not None:
            self._observe(_method_name(method), code, 0.0)
        return _refusal(handler, code, message, hold)

    def _admitted(self, handler: Any, cls: str, tenant: Tenant | None) -> Any:
        """`handler` with the caller bound, the call counted under `cls` until it ends, and
        its deadline armed (the servicer disarms it once it has what it waits for)."""
        if not handler.request_streaming:
            # Every handler of ours reads its own request (KVStoreServicer.handler); one that
            # does not would wait for it on a worker, unguarded: refuse instead.
            self.admission.leave(cls)
            return _refusal(handler, "UNIMPLEMENTED", "method not served through the gate")
        gate = self

        def enter(context: Any) -> tuple[str, int]:
            now_cls = cls
            if cls == PREAUTH:
                t = gate.auth.from_certificate(context)
                if t is None:
                    raise gate.auth.no_credentials()
                if not gate.admission.enter(t.name):
                    raise _exhausted(t.name, gate.admission.caps[t.name])
                gate.admission.leave(PREAUTH)
                now_cls = t.name
                gate.auth.bind(t)
            else:
                gate.auth.bind(tenant)
            token = gate.deadlines.arm(context, "the call")
            _current.armed = (gate.deadlines, token)
            _current.request_bytes = 0
            return now_cls, token

        if handler.response_streaming:
            inner = handler.stream_stream

            def streaming(requests: Iterator[Any], context: Any) -> Iterator[Any]:
                held, token = cls, None
                try:
                    held, token = enter(context)
                    yield from inner(requests, context)
                except KVStoreError as e:
                    context.abort(_code(e.code), str(e))
                finally:
                    _current.armed = None
                    gate.deadlines.disarm(token)
                    gate.admission.leave(held)
                    gate.budget.charge(held, context.code(), _request_bytes())
            return grpc.stream_stream_rpc_method_handler(
                streaming, handler.request_deserializer, handler.response_serializer)
        inner_unary = handler.stream_unary

        def unary(requests: Iterator[Any], context: Any) -> Any:
            held, token = cls, None
            try:
                held, token = enter(context)
                return inner_unary(requests, context)
            except KVStoreError as e:
                context.abort(_code(e.code), str(e))
            finally:
                _current.armed = None
                gate.deadlines.disarm(token)
                gate.admission.leave(held)
                gate.budget.charge(held, context.code(), _request_bytes())
        return grpc.stream_unary_rpc_method_handler(
            unary, handler.request_deserializer, handler.response_serializer)


def _exhausted(name: str, cap: int) -> KVStoreError:
    from kvstore_client.common.errors import ResourceExhausted
    return ResourceExhausted(f"tenant {name}'s calls already fill their {cap} concurrent calls "
                             "(limits.tenant_calls); retry when one ends")


def _code(name: str) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, name, grpc.StatusCode.INTERNAL)


def _refusal(handler: Any, code: str, message: str,
             hold: tuple[Held, str, float] | None = None) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s shape that answers `code` without reading the request, on
    grpcio's serving thread where kvstore/refusal.py could install that path (a refusal is
    what an unauthenticated peer can make the daemon do in a loop), `hold` later if given."""
    return Refusal(handler, _code(code), message, hold)


_current = threading.local()          # (Deadlines, token) of the call on this worker thread


def request_bytes(n: int) -> None:
    """The call on this thread received a request of `n` bytes (RefusalBudget.charge)."""
    _current.request_bytes = n


def _request_bytes() -> int:
    n = getattr(_current, "request_bytes", 0)
    _current.request_bytes = 0
    return n


def received(nbytes: int = 0) -> None:
    """The call on this thread has read what it waited for from its client (`nbytes` of
    request, if it was one message): its deadline no longer applies (its own work, a Flush
    say, is not cut short by it)."""
    if nbytes:
        _current.request_bytes = nbytes
    armed = getattr(_current, "armed", None)
    if armed is not None:
        _current.armed = None
        armed[0].disarm(armed[1])
