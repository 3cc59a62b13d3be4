"""Keep the leases a client holds alive while it uses them, and give them all back at the end.

A lease pins slots in the daemon only until its deadline, so a copy that outlives the deadline
could read a slot the daemon has already reused. One background thread per client renews every
lease still in use once half its lifetime has passed (the DHCP rule: one lost renewal still leaves
time for another), and remembers leases whose renewal failed so the copy that owns them can
refuse its result. `close()` releases whatever is still held, so a client that exits through
`close()` (or a `with` block) frees its slots at once instead of after the deadline.

Deadlines are kept on the local monotonic clock: the daemon's unix-time deadline is converted to
"seconds left" on receipt, so clock steps and skew between hosts do not matter.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .errors import KVStoreError

log = logging.getLogger(__name__)

# Renew when this fraction of the time left at the last grant has passed.
RENEW_FRACTION = 0.5
# Never plan a renewal closer than this to the deadline (an RPC needs time to arrive).
MIN_MARGIN_S = 0.05


@dataclass
class _Held:
    lease_id: str
    granted_at: float   # monotonic
    expires_at: float   # monotonic

    @property
    def renew_at(self) -> float:
        life = self.expires_at - self.granted_at
        return min(self.granted_at + life * RENEW_FRACTION, self.expires_at - MIN_MARGIN_S)


def seconds_left(deadline_unix: float) -> float:
    """Time left on a lease whose deadline the daemon gave as unix time (never negative)."""
    return max(0.0, deadline_unix - time.time())


class LeaseKeeper:
    """Tracks held leases; renews them in the background; releases them on close.

    `renew(lease_id) -> new deadline (unix time)` and `release(lease_id)` are the client's RPCs.
    """

    def __init__(self, renew: Callable[[str], float], release: Callable[[str], None]) -> None:
        self._renew = renew
        self._release = release
        self._held: dict[str, _Held] = {}
        self._lost: set[str] = set()
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    # -- bookkeeping ------------------------------------------------------------------------
    def add(self, lease_id: str, deadline_unix: float) -> None:
        """Start keeping `lease_id` alive."""
        now = time.monotonic()
        with self._cond:
            if self._closed:
                raise KVStoreError("client is closed")
            self._held[lease_id] = _Held(lease_id, now, now + seconds_left(deadline_unix))
            self._lost.discard(lease_id)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvstore-lease-keeper",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def remove(self, lease_id: str) -> bool:
        """Stop tracking; True if the lease stayed valid the whole time it was held."""
        with self._cond:
            self._held.pop(lease_id, None)
            lost = lease_id in self._lost
            self._lost.discard(lease_id)
            return not lost

    def ok(self, lease_id: str) -> bool:
        """False once a renewal failed or the deadline passed without one."""
        with self._cond:
            if lease_id in self._lost:
                return False
            h = self._held.get(lease_id)
            return h is None or time.monotonic() < h.expires_at

    @property
    def held(self) -> list[str]:
        with self._cond:
            return list(self._held)

    # -- the renewal thread -------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    due = [h for h in self._held.values() if h.renew_at <= time.monotonic()]
                    if due:
                        break
                    nxt = min((h.renew_at for h in self._held.values()), default=None)
                    self._cond.wait(None if nxt is None else max(0.0, nxt - time.monotonic()))
                if self._closed:
                    return
            for h in due:
                self._renew_one(h.lease_id)

    def _renew_one(self, lease_id: str) -> None:
        sent = time.monotonic()
        try:
            deadline = self._renew(lease_id)
        except KVStoreError as e:
            # Expired or unknown (daemon restarted): the owner must not trust the slots.
            log.warning("kvstore: could not renew lease %s: %s", lease_id, e)
            with self._cond:
                if lease_id in self._held:
                    self._lost.add(lease_id)
                    del self._held[lease_id]
            return
        except Exception:  # noqa: BLE001 - a renewal bug must not kill the thread
            log.exception("kvstore: lease renewal failed")
            with self._cond:
                if lease_id in self._held:
                    self._lost.add(lease_id)
                    del self._held[lease_id]
            return
        with self._cond:
            h = self._held.get(lease_id)
            if h is not None:
                h.granted_at = sent
                h.expires_at = sent + seconds_left(deadline)

    # -- shutdown -----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop renewing and release every lease still held (best effort, errors logged)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            held = list(self._held)
            self._held.clear()
            self._cond.notify_all()
        for lease_id in held:
            try:
                self._release(lease_id)
            except Exception as e:  # noqa: BLE001 - the daemon reaps it at the deadline anyway
                log.debug("kvstore: release of %s at close failed: %s", lease_id, e)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
