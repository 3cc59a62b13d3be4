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
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import grpc

log = logging.getLogger("kvstore.refusal")


class Refusal(grpc.RpcMethodHandler):
    """A handler that answers `code` and `details` without reading the request."""

    def __init__(self, like: grpc.RpcMethodHandler, code: grpc.StatusCode,
                 details: str) -> None:
        self.code = code
        self.details = details
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

        def handle(rpc_event: Any, state: Any, method_handler: Any, thread_pool: Any) -> Any:
            if type(method_handler) is Refusal:
                reject(rpc_event, state, to_cygrpc[method_handler.code],
                       method_handler.details.encode("utf-8", "replace"))
                return None            # no future: grpcio counts no call in flight for it
            return original(rpc_event, state, method_handler, thread_pool)

        _server._handle_with_method_handler = handle
        _installed = True
        return True
