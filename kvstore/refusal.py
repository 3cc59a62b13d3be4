"""Refusals answered on grpcio's serving thread, without a worker (kvstore/gate.py).

Why: the gate refuses calls a peer can make in a loop (no token, a tenant out of its refusal
budget or past its cap). Answered the ordinary way, a refusal is a handler: grpcio posts a
receive-close batch, builds a request iterator and a servicer context, hands the call to the
thread pool, wakes a worker, which takes the GIL, sets the status and posts a second batch;
two completions then come back to the serving thread. That is about 0.4-0.5 ms of daemon CPU
per refused call and a thread wake-up, paid on the cores and the GIL tenant A's calls need.
grpcio has a cheaper path of its own, the one it uses for an unknown method or a full server:
one batch (initial metadata, receive close, status) posted from the serving thread. `install`
routes the gate's `Refusal` handlers onto that path.

That path is grpcio's private `_server._reject_rpc`. `install` checks that the names it needs
are there; where they are not (another grpcio), a `Refusal` is still an ordinary handler of
the call's shape and is answered through the pool, as before: slower, never wrong.

A tenant out of its refusal budget is answered late (`Held`): its refusal is posted HOLD_S
after the call. Meanwhile the call holds no worker and no body past the stream's window, only
grpcio's record of it; a tenant has at most as many held as it may have calls in flight, and
the next is answered at once. Why: what a refusal still costs is mostly grpcio's per-call
work (HTTP/2 frames, a call set up and torn down, threads woken on both sides), which no
cheaper Python removes; a flood that waits for each answer before its next request (as a
client does) then sends one request per HOLD_S per thread instead of one per round trip, and
one that does not wait meets the cap and is no better off than before.
"""

from __future__ import annotations

import heapq
import inspect
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

log = logging.getLogger("kvstore.refusal")

HOLD_S = 1.0                  # the longest a held refusal waits (Held)


class Refusal(grpc.RpcMethodHandler):
    """A handler that answers `code` and `details` without reading the request."""

    def __init__(self, like: grpc.RpcMethodHandler, code: grpc.StatusCode,
                 details: str, hold: tuple[Held, str, float] | None = None) -> None:
        self.code = code
        self.details = details
        self.hold = hold              # (where, whose, seconds): answered that much later
        self.request_streaming = like.request_streaming
        self.response_streaming = like.response_streaming
        self.request_deserializer = None
        self.response_serializer = None
        self.unary_unary = self.unary_stream = None
        self.stream_unary = self.stream_stream = None
        # Through the pool (no fast path): set the status and return, without raising.
        if not self.request_streaming:
            self.unary_unary = self._answer
        elif self.response_streaming:
            self.stream_stream = self._answer_stream
        else:
            self.stream_unary = self._answer

    def _answer(self, _request: Any, context: Any) -> None:
        context.set_code(self.code)
        context.set_details(self.details)
        return None

    def _answer_stream(self, _requests: Any, context: Any) -> Iterator[Any]:
        context.set_code(self.code)
        context.set_details(self.details)
        yield from ()


class Held:
    """Refusals answered later, each at its due time, by one thread (module docstring).

    `hold` takes a refusal if its class has fewer than `caps[cls]` held (a class without a cap
    is never held); the thread posts each when due, all of them at `close`."""

    def __init__(self, caps: dict[str, int]) -> None:
        self.caps = caps
        self._held: dict[str, int] = {}
        self._due: list[tuple[float, int, str, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self.answered = 0
        self._thread = threading.Thread(target=self._run, name="kvstore-held-refusals",
                                        daemon=True)
        self._thread.start()

    def hold(self, cls: str, delay_s: float, answer: Callable[[], None]) -> bool:
        """Whether `answer` was taken, to be called in `delay_s` (at most HOLD_S)."""
        with self._cond:
            n = self._held.get(cls, 0)
            if self._closed or n >= self.caps.get(cls, 0):
                return False
            self._held[cls] = n + 1
            due = time.monotonic() + min(max(delay_s, 0.0), HOLD_S)
            heapq.heappush(self._due, (due, next(self._seq), cls, answer))
            if self._due[0][3] is answer:
                self._cond.notify()
            return True

    def held(self, cls: str) -> int:
        return self._held.get(cls, 0)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(2)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._due and not self._closed:
                    self._cond.wait()
                if not self._due:
                    return                              # closed, nothing held
                due, _, cls, answer = self._due[0]
                left = due - time.monotonic()
                if left > 0 and not self._closed:
                    self._cond.wait(left)
                    continue
                heapq.heappop(self._due)
                self._held[cls] -= 1
                self.answered += 1
            try:
                answer()
            except Exception:  # noqa: BLE001 - a call the client ended meanwhile
                log.debug("a held refusal could not be posted", exc_info=True)


_installed: bool | None = None
_lock = threading.Lock()


def install() -> bool:
    """Route `Refusal` handlers onto grpcio's own rejection path (once per process); whether
    that path is in use."""
    global _installed
    with _lock:
        if _installed is not None:
            return _installed
        _installed = False
        try:
            from grpc import _common, _server
            reject = _server._reject_rpc
            original = _server._handle_with_method_handler
            to_cygrpc = _common.STATUS_CODE_TO_CYGRPC_STATUS_CODE
        except (ImportError, AttributeError) as e:
            log.warning("refusals go through the worker pool (this grpcio lacks %s)", e)
            return False
        # A private path may change shape in any release: take it only where both functions
        # have the parameters this module calls them with, or every call would fail.
        if (_params(original) != ["rpc_event", "state", "method_handler", "thread_pool"]
                or len(_params(reject)) != 4):
            log.warning("refusals go through the worker pool (grpcio %s's private rejection "
                        "path differs from the one kvstore knows)", grpc.__version__)
            return False

        def handle(rpc_event: Any, state: Any, method_handler: Any, thread_pool: Any) -> Any:
            if type(method_handler) is Refusal:
                code = to_cygrpc[method_handler.code]
                details = method_handler.details.encode("utf-8", "replace")
                hold = method_handler.hold
                if hold is None or not hold[0].hold(
                        hold[1], hold[2], lambda: reject(rpc_event, state, code, details)):
                    reject(rpc_event, state, code, details)
                return None            # no future: grpcio counts no call in flight for it
            return original(rpc_event, state, method_handler, thread_pool)

        _server._handle_with_method_handler = handle
        _installed = True
        return True


def _params(fn: Callable[..., Any]) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []
