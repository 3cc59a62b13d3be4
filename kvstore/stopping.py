"""What a stop tells the operator while it waits: a progress line a second, and the count of
calls in flight it is waiting for.

Why: a stop waits for in-flight calls (up to `server.shutdown_grace_s`) and then for the host
pool's write-down to SSD, each of which can take a while; a silent wait looks like a hang.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


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
