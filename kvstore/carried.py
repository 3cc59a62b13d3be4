"""Leases clients give back in passing: the finished loads a later call carries
(`release_leases` on Commit, Acquire, LookupAcquire), ended at the store's next hold of the lock
rather than in one of their own.

Why: under many clients each separate take of the store lock is one more wait behind every
other caller, and the carried releases were a third of the takes of the slowest loads
(bench/tail.py). Every reserve and acquire round reaps first thing under its own hold
(Store.reap_expired), so the carrying call's own slots come back before it plans; the reaper
thread ends the rest within a quarter of a second. Where the lock is free the leases end at
once, as a Release would end them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from kvstore_client.common.errors import LeaseExpired, NotFound

from .leases import Lease, LeaseTable


class Carried:
    """The queue of lease ids given back and not yet ended."""

    def __init__(self, state: Any, leases: LeaseTable,
                 end_lease: Callable[[Lease], None]) -> None:
        self.state = state
        self.leases = leases
        self.end_lease = end_lease
        self._ids: deque[str] = deque()

    def __bool__(self) -> bool:
        return bool(self._ids)

    def give_back(self, lease_ids: Iterable[str]) -> None:
        """Queue leases the caller owns (checked by the caller); end them now if the lock is
        free."""
        self._ids.extend(lease_ids)
        lock = self.state.lock
        if self._ids and lock.acquire(blocking=False):
            try:
                self.end_all()
            finally:
                lock.release()

    def end_all(self) -> None:
        """End every queued lease still held (locked): one no longer held (expired, or the
        daemon restarted) is already free."""
        q = self._ids
        while q:
            try:
                lease_id = q.popleft()
            except IndexError:          # emptied meanwhile by another holder of the RLock
                break
            if self.leases.find(lease_id) is None:
                continue                # already ended: a dict probe, not a raised NotFound
            try:
                lease = self.leases.pop(lease_id)
            except (NotFound, LeaseExpired):
                continue
            self.end_lease(lease)
            self.state.counters["releases_carried"] += 1
