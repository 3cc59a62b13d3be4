"""The store's upkeep thread: ends expired leases and feeds the host policy's tuning.

Why one thread and short holds: both jobs need the store lock, and every call waits behind
whoever holds it. Expired leases are ended once every 0.25 s (a client that died holds its
slots no longer than its lease plus that), and the tuning the segmented policy deferred from
commits and loads is fed `TUNE_SLICE` accesses per hold, so no call waits long behind it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .state import StoreState

log = logging.getLogger("kvstore.store")

REAP_EVERY_S = 0.25
TUNE_SLICE = 256            # deferred policy-tuning accesses fed per hold of the store lock


class Upkeep:
    def __init__(self, state: StoreState, reap: Callable[[], None]) -> None:
        self._state = state
        self._reap = reap               # ends expired leases; called with the lock held
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kvstore-reaper",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        st = self._state
        while not self._stop.wait(REAP_EVERY_S):
            try:
                with st.lock:
                    if not st.closed:
                        self._reap()
                self._tune_policy()
            except Exception:  # the reaper must outlive any single bad lease
                log.exception("lease reaper")

    def _tune_policy(self) -> None:
        st = self._state
        tune = getattr(st.policies["host"], "tune", None)
        if tune is None:
            return
        while not self._stop.is_set():
            with st.lock:
                if st.closed or not tune(TUNE_SLICE):
                    return
