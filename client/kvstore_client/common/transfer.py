"""Transfers: an enqueued copy and how to wait for it.

Why one type for both devices: a CUDA copy completes with an event on a stream, a CPU-device
copy with a Future on a worker thread; callers wait the same way (`done`, `wait` with a
deadline, `wait_stream`), so the store and the SDK never branch on the device.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

from .errors import DeadlineExceeded


class FutureEvent:
    """A Future seen as an event (`query`), for copies a CPU thread runs; errors re-raise."""

    def __init__(self, future: Future) -> None:
        self.future = future

    def query(self) -> bool:
        return self.future.done()

    def check(self) -> None:
        """Raise what the copy raised (called once it is done)."""
        self.future.result(timeout=0)


class Transfer:
    """An enqueued copy: `event` is a CUDA event, a FutureEvent (CPU-device worker thread), or
    None for a copy that completed before the call returned."""

    def __init__(self, event: Any = None, keepalive: object = None, method: str = "",
                 nbytes: int = 0) -> None:
        self.event = event
        self.method = method
        self.nbytes = nbytes
        self._keep = keepalive   # index tensors, views: alive until the copy is done

    def done(self) -> bool:
        if self.event is None or self.event.query():
            self._keep = None
            return True
        return False

    def wait(self, timeout_s: float | None = 30.0) -> None:
        """Block the host until done; DeadlineExceeded after `timeout_s` (every wait has one).
        A CPU-device copy that failed raises its error here."""
        if isinstance(self.event, FutureEvent):
            try:
                self.event.future.result(timeout=timeout_s)
            except TimeoutError:
                raise DeadlineExceeded(f"device transfer of {self.nbytes} bytes not done after "
                                       f"{timeout_s}s") from None
            self._keep = None
            return
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        delay = 20e-6
        while not self.done():
            if deadline is not None and time.monotonic() > deadline:
                raise DeadlineExceeded(f"GPU transfer of {self.nbytes} bytes not done after "
                                       f"{timeout_s}s")
            time.sleep(delay)
            delay = min(delay * 2, 2e-3)

    def wait_stream(self, stream: Any) -> None:
        """Make `stream` (e.g. the engine's compute stream) wait for this copy, GPU-side."""
        if isinstance(self.event, FutureEvent):
            self.wait()                 # a CPU copy has no stream: the host waits instead
        elif self.event is not None:
            stream.wait_event(self.event)

