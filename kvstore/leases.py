"""Leases: every slot handed to a client is held by one, and every lease has a deadline.

A client that dies simply stops renewing; the reaper then takes its slots back. Expired ids are
remembered for a while so a late call on one gets "expired" (FAILED_PRECONDITION) rather than a
confusing "unknown lease" (NOT_FOUND).
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore_client.common.errors import InvalidArgument, LeaseExpired, NotFound


@dataclass
class Slot:
    offset: int
    length: int
    device: int = 0                # which device's slab (gpu tier); 0 for host


@dataclass
class Lease:
    id: str
    ns_id: bytes
    kind: str                      # "read" pins published blocks; "write" holds reserved slots
    tier: str
    slots: list[Slot]
    deadline: float
    keys: list[bytes] = field(default_factory=list)
    checksums: list[int] = field(default_factory=list)


class LeaseTable:
    """Lease bookkeeping only; what a lease holds is released by the store."""

    def __init__(self, default_ttl_s: float, max_ttl_s: float,
                 clock: Callable[[], float] = time.time, remember_expired: int = 4096) -> None:
        self.default_ttl_s = default_ttl_s
        self.max_ttl_s = max_ttl_s
        self.clock = clock
        self._leases: dict[str, Lease] = {}
        self._expired: OrderedDict[str, None] = OrderedDict()
        self._remember = remember_expired

    def __len__(self) -> int:
        return len(self._leases)

    def ttl(self, ttl_s: float | None) -> float:
        if ttl_s is None or ttl_s == 0:
            return self.default_ttl_s
        if not (isinstance(ttl_s, (int, float)) and ttl_s > 0) or ttl_s != ttl_s:
            raise InvalidArgument(f"ttl_s must be a positive number of seconds, got {ttl_s!r}")
        if ttl_s > self.max_ttl_s:
            raise InvalidArgument(f"ttl_s={ttl_s} is above the daemon's maximum lease of "
                                  f"{self.max_ttl_s} s; renew the lease instead")
        return float(ttl_s)

    def new(self, kind: str, ns_id: bytes, tier: str, slots: list[Slot],
            ttl_s: float | None = None, keys: list[bytes] | None = None,
            checksums: list[int] | None = None) -> Lease:
        lease = Lease(id=secrets.token_hex(16), ns_id=ns_id, kind=kind, tier=tier, slots=slots,
                      deadline=self.clock() + self.ttl(ttl_s), keys=keys or [],
                      checksums=checksums or [])
        self._leases[lease.id] = lease
        return lease

    def _live(self, lease_id: str) -> Lease:
        if not isinstance(lease_id, str) or not lease_id:
            raise InvalidArgument("lease_id must be the non-empty id Reserve or Acquire returned")
        lease = self._leases.get(lease_id)
        if lease is None:
            if lease_id in self._expired:
                raise LeaseExpired(f"lease {lease_id} expired and its slots were reclaimed; "
                                   "reserve or acquire again")
            raise NotFound(f"unknown lease {lease_id!r} (released already, or from another "
                           "daemon run)")
        if lease.deadline < self.clock():
            raise LeaseExpired(f"lease {lease_id} expired at {lease.deadline:.3f}; reserve or "
                               "acquire again")
        return lease

    def find(self, lease_id: str) -> Lease | None:
        """The lease if held (expired or not), else None: for a caller that only needs to
        know whose it is, and lets the call that acts on it raise."""
        return self._leases.get(lease_id)

    def get(self, lease_id: str) -> Lease:
        return self._live(lease_id)

    def pop(self, lease_id: str) -> Lease:
        lease = self._live(lease_id)
        del self._leases[lease_id]
        return lease

    def renew(self, lease_id: str, ttl_s: float | None = None) -> float:
        lease = self._live(lease_id)
        lease.deadline = self.clock() + self.ttl(ttl_s)
        return lease.deadline

    def reap(self) -> list[Lease]:
        """Remove and return every lease past its deadline."""
        now = self.clock()
        dead = [lease for lease in self._leases.values() if lease.deadline < now]
        for lease in dead:
            del self._leases[lease.id]
            self._expired[lease.id] = None
            if len(self._expired) > self._remember:
                self._expired.popitem(last=False)
        return dead

    def all(self) -> list[Lease]:
        return list(self._leases.values())
