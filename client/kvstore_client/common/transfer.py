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

# A GPU transfer's wait polls its event without sleeping for this long, then sleeps in steps.
SPIN_S = 2e-3
MAX_SLEEP_S = 2e-3


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
        start = time.monotonic()
        deadline = None if timeout_s is None else start + timeout_s
        while not self.done():
            now = time.monotonic()
            if deadline is not None and now > deadline:
                raise DeadlineExceeded(f"GPU transfer of {self.nbytes} bytes not done after "
                                       f"{timeout_s}s")
            # Poll without sleeping at first (sleep(0) only lets other threads take the GIL):
            # a gather of hundreds of MiB is done in a fraction of a millisecond, and one
            # sleep costs 60-100 us of timer slack. Past that, sleep a fiftieth of the time
            # waited so far, so a long copy is noticed at most ~2% late.
            elapsed = now - start
            time.sleep(0 if elapsed < SPIN_S else min(MAX_SLEEP_S, elapsed / 50))

    def wait_stream(self, stream: Any) -> None:
        """Make `stream` (e.g. the engine's compute stream) wait for this copy, GPU-side."""
        if isinstance(self.event, FutureEvent):
            self.wait()                 # a CPU copy has no stream: the host waits instead
        elif self.event is not None:
            stream.wait_event(self.event)

