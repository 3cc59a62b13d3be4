"""Keep the leases a client holds alive while it uses them, and give them all back at the end.

A lease pins slots in the daemon only until its deadline, so a copy that outlives the deadline
could read a slot the daemon has already reused. One background thread per client renews every
lease still in use once half its lifetime has passed (the DHCP rule: one lost renewal still leaves
time for another), and remembers leases whose renewal failed so the copy that owns them can
refuse its result. `close()` releases whatever is still held, so a client that exits through
`close()` (or a `with` block) frees its slots at once instead of after the deadline.

Deadlines are kept on the local monotonic clock: the daemon's unix-time deadline is converted to
"seconds left" on receipt, so clock steps and skew between hosts do not matter.

The same thread takes two round trips off the engine's path:
- a load's read lease is released after the copy (`release_later`), so the load returns as
  soon as its bytes are verified: the client's next Acquire or Commit carries the release
  (`take_pending`), or this thread sends it after `CARRY_WAIT_S`; a call whose answer depends
  on it (a Delete, an Evict, Stats: `flush`) sends what is still pending first;
- a spare write lease that a Commit reserved ahead (`keep_spare`) waits here for the next
  store; one left unused is released after `SPARE_IDLE_S`, so an idle client does not keep
  pool space from other engines.

Releases sent together (a flush before a call, a batch of the thread's, `close()`) go in one
Release call (its `lease_ids`) and share one absolute deadline, not one each: against a daemon
that stopped answering, N leases would otherwise hold the caller (or the renewals behind them)
for N timeouts. One not sent in time is no loss: the daemon ends it at its deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .common.errors import KVStoreError
from .common.limits import MAX_CARRIED_RELEASES

log = logging.getLogger(__name__)

# Renew when this fraction of the time left at the last grant has passed.
RENEW_FRACTION = 0.5
# Never plan a renewal closer than this to the deadline (an RPC needs time to arrive).
MIN_MARGIN_S = 0.05
# A spare write lease not taken by a store within this long is given back.
SPARE_IDLE_S = 1.0
# A finished lease waits this long for the client's next Acquire or Commit to carry its release
# (no round trip of its own); then the thread sends a Release.
CARRY_WAIT_S = 0.05


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

    `renew(lease_id) -> new deadline (unix time)` and `release(lease_id)` are the client's RPCs;
    `release_many(lease_ids, deadline)`, where given, releases a batch within one deadline
    (monotonic; None: the client's default for releases).
    """

    def __init__(self, renew: Callable[[str], float], release: Callable[[str], None],
                 release_many: Callable[[list[str], float | None], None] | None = None
                 ) -> None:
        self._renew = renew
        self._release = release
        self._release_many = release_many
        self._held: dict[str, _Held] = {}
        self._lost: set[str] = set()
        self._pending: list[tuple[str, float]] = []  # (id, when the thread sends it)
        self.carry = False          # the daemon takes releases carried by other calls
        self._spares: dict[str, tuple[float, float]] = {}   # id -> (release at, expires at)
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    # -- bookkeeping ------------------------------------------------------------------------
    def add(self, lease_id: str, deadline_unix: float) -> None:
        """Start keeping `lease_id` alive."""
        now = time.monotonic()
        with self._cond:
            self._check_open()
            self._held[lease_id] = _Held(lease_id, now, now + seconds_left(deadline_unix))
            self._lost.discard(lease_id)
            self._wake()

    def _check_open(self) -> None:
        if self._closed:
            raise KVStoreError("client is closed")

    def _wake(self) -> None:
        """Start the thread once; tell it the schedule changed (caller holds the lock)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvstore-lease-keeper",
                                            daemon=True)
            self._thread.start()
        self._cond.notify()

    def release_later(self, lease_id: str) -> bool:
        """Stop tracking and release from the thread; True as `remove`."""
        with self._cond:
            ok = self.remove(lease_id)
            if self._closed:
                return ok
            due = time.monotonic() + (CARRY_WAIT_S if self.carry else 0.0)
            self._pending.append((lease_id, due))
            self._wake()
            return ok

    def take_pending(self) -> list[str]:
        """The finished leases for the next call to carry (empty when the daemon cannot);
        `requeue` them if that call fails."""
        if not self.carry:
            return []
        with self._cond:
            if not self._pending:
                return []
            taken = self._pending[:MAX_CARRIED_RELEASES]
            self._pending = self._pending[MAX_CARRIED_RELEASES:]
            if self._pending:
                self._wake()            # the rest are due too: the thread sends them
            return [lid for lid, _ in taken]

    def requeue(self, lease_ids: list[str]) -> None:
        if not lease_ids:
            return
        now = time.monotonic()
        with self._cond:
            if self._closed:
                return
            self._pending += [(lid, now) for lid in lease_ids]
            self._wake()

    def flush(self, spares: bool = False, deadline: float | None = None) -> None:
        """Send the pending releases now (and with `spares`, give the spares back), in the
        caller's thread: before a call whose answer depends on what this client holds (a
        Delete skips blocks a read lease still pins; an Evict cannot free reserved slots;
        Stats counts leases). `deadline` (monotonic) is that call's own, so the releases
        come out of its time rather than adding their own."""
        with self._cond:
            pending = [lid for lid, _ in self._pending]
            self._pending = []
            if spares:
                pending += list(self._spares)
                self._spares.clear()
        self._release_all(pending, deadline)

    def keep_spare(self, lease_id: str, deadline_unix: float) -> None:
        """Hold an unused write lease for the next store; release it if none comes."""
        now = time.monotonic()
        idle_s = SPARE_IDLE_S
        life = seconds_left(deadline_unix)
        with self._cond:
            if self._closed:
                self._pending.append((lease_id, now))   # close() has run: give it back below
            else:
                self._spares[lease_id] = (now + min(idle_s, life / 2), now + life)
                self._wake()
                return
        self.flush()

    def take_spare(self, lease_id: str, margin_s: float) -> bool:
        """Claim a spare for a store: False once the thread released it, or when less than
        `margin_s` of its life is left (the store reserves instead; the spare goes back)."""
        with self._cond:
            spare = self._spares.pop(lease_id, None)
            if spare is None:
                return False
            now = time.monotonic()
            if spare[1] - now >= margin_s:
                return True
            self._pending.append((lease_id, now))
            self._wake()
            return False

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
                    now = time.monotonic()
                    due = [h for h in self._held.values() if h.renew_at <= now]
                    idle = [lid for lid, (at, _) in self._spares.items() if at <= now]
                    for lid in idle:
                        del self._spares[lid]
                    pending = idle + [lid for lid, at in self._pending if at <= now]
                    if len(pending) > len(idle):
                        self._pending = [p for p in self._pending if p[1] > now]
                    if due or pending:
                        break
                    nxt = min([h.renew_at for h in self._held.values()]
                              + [at for at, _ in self._spares.values()]
                              + [at for _, at in self._pending], default=None)
                    self._cond.wait(None if nxt is None else max(0.0, nxt - now))
                if self._closed:
                    return
            self._release_all(pending)
            for h in due:
                self._renew_one(h.lease_id)

    def _release_all(self, lease_ids: list[str], deadline: float | None = None) -> None:
        if not lease_ids:
            return
        if self._release_many is not None:
            try:
                self._release_many(lease_ids, deadline)
            except Exception as e:  # noqa: BLE001 - the daemon reaps them at the deadline anyway
                log.debug("kvstore: release of %d leases failed: %s", len(lease_ids), e)
            return
        for lease_id in lease_ids:
            try:
                self._release(lease_id)
            except Exception as e:  # noqa: BLE001 - the daemon reaps it at the deadline anyway
                log.debug("kvstore: release of %s failed: %s", lease_id, e)

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
    def close(self, deadline: float | None = None) -> None:
        """Stop renewing and release every lease still held (best effort, errors logged), all
        within `deadline` (monotonic; None: the client's default for releases, and up to 5 s
        for the thread)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            held = ([lid for lid, _ in self._pending] + list(self._held)
                    + list(self._spares))
            self._held.clear()
            self._spares.clear()
            self._pending = []
            self._cond.notify_all()
        self._release_all(held, deadline)
        if self._thread is not None and self._thread is not threading.current_thread():
            # A thread still in a renewal or release ends with the channel close() closes.
            self._thread.join(timeout=5 if deadline is None
                              else max(0.0, deadline - time.monotonic()))
