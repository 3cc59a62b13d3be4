"""Write leases that expired, kept for a while before their slots go back to the allocator.

Why: a client whose write lease expired is not always dead. One that was stalled (stopped,
cgroup-frozen, swapping, starved) resumes the copy it was in the middle of, into slots it no
longer owns. Freed at once, those slots were often leased to another writer already, whose
committed blocks the late copy then overwrote: readers that verify lost those blocks, readers
that do not got another prompt's bytes. Kept unused for `leases.expired_write_hold_s` after the
deadline, the slots take such a late copy harmlessly; the SDK also checks its lease between
fill chunks, so a resumed client stops after the chunk it was in. A stall longer than the lease
and the hold together still reaches reused slots: verifying readers drop what it overwrote.

Read leases need no hold: the daemon never lets a client write through one.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from .leases import Lease


class HeldWrites:
    """Expired write leases in the order they expired; each comes due `hold_s` later."""

    def __init__(self, hold_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.hold_s = hold_s
        self._clock = clock
        self._held: deque[tuple[float, Lease]] = deque()
        self.slots = 0                  # slots the held leases keep from the allocator

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, lease: Lease) -> None:
        self._held.append((self._clock() + self.hold_s, lease))
        self.slots += len(lease.slots)

    def leases(self) -> list[Lease]:
        return [lease for _, lease in self._held]

    def due(self) -> list[Lease]:
        """The held leases whose hold has passed, removed (one hold for all: FIFO order)."""
        now, held, out = self._clock(), self._held, []
        while held and held[0][0] <= now:
            lease = held.popleft()[1]
            self.slots -= len(lease.slots)
            out.append(lease)
        return out
