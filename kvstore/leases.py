"""Leases: every slot handed to a client is held by one, and every lease has a deadline.

A client that dies simply stops renewing; the reaper then takes its slots back. Expired ids are
remembered for a while so a late call on one gets "expired" (FAILED_PRECONDITION) rather than a
confusing "unknown lease" (NOT_FOUND).

Why a deadline heap: the reaper runs under the store lock before every Reserve and Acquire, so
a scan of all leases made one tenant's thousands of held leases every other tenant's cost. The
heap hands over only the leases whose deadline has passed. A renewal does not touch the heap:
when the old entry comes up, the lease is pushed again at its new deadline, so a lease has at
most one entry (two while a renewal shortened it). A released lease leaves its entry behind
until it comes up; the heap is rebuilt from the live leases once such leftovers outnumber
them, so it never grows past a constant times what is held.

Why caps per tenant: a lease costs the daemon memory (its slot records) and, for a read lease,
pins blocks that then cannot be evicted. A tenant (the implicit one too) may hold at most
`max_leases` leases over at most `max_slots` slots at once; the store asks `admit` before it
makes one. The check is done before the store allocates or pins anything, so a refusal undoes
nothing; calls of one tenant running at once may each pass it, so the caps can be passed by at
most what those calls hold.

Why lease ids are a keyed hash of a counter and not `secrets.token_hex`: a lease is made under
the store lock, and `os.urandom` is a system call that gives up the GIL; the thread that holds
the lock must then win the GIL back before anyone else can take the lock, and under many
clients it loses that race now and then, with every caller of the store waiting behind it.
BLAKE2b keyed with 32 random bytes drawn once is as unguessable to a client that sees other
ids, and costs no system call.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore_client.common.errors import (
    InvalidArgument,
    LeaseExpired,
    NotFound,
    ResourceExhausted,
)

COMPACT_SLACK = 1024        # leftover heap entries tolerated beyond the live leases


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
    owner: str | None = None       # the tenant its namespace belongs to (None: implicit, nobody)


class LeaseTable:
    """Lease bookkeeping only; what a lease holds is released by the store."""

    def __init__(self, default_ttl_s: float, max_ttl_s: float,
                 clock: Callable[[], float] = time.time, remember_expired: int = 4096,
                 max_leases: int = 0, max_slots: int = 0,
                 owner_of: Callable[[bytes], str | None] | None = None) -> None:
        self.default_ttl_s = default_ttl_s
        self.max_ttl_s = max_ttl_s
        self.clock = clock
        self.max_leases = max_leases        # per tenant; 0: no cap
        self.max_slots = max_slots          # per tenant, across its leases; 0: no cap
        self.owner_of = owner_of or (lambda ns_id: None)
        self._leases: dict[str, Lease] = {}
        self._id_key = secrets.token_bytes(32)
        self._id_count = itertools.count()
        self._heap: list[tuple[float, str]] = []
        self._held: Counter = Counter()     # owner -> leases held
        self._slots: Counter = Counter()    # owner -> slots across them
        self._of_ns: Counter = Counter()    # ns_id -> leases held on it
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

    def held(self, owner: str | None) -> tuple[int, int]:
        """(leases, slots) a tenant holds now."""
        return self._held[owner], self._slots[owner]

    def on_namespace(self, ns_id: bytes) -> int:
        """Leases held on a namespace (one with any is in use: never reclaimed)."""
        return self._of_ns[ns_id]

    def admit(self, ns_id: bytes, slots: int) -> None:
        """ResourceExhausted when a new lease of up to `slots` slots on this namespace would
        take its tenant past its caps (limits.leases_per_tenant, lease_slots_per_tenant)."""
        owner = self.owner_of(ns_id)
        who = f"tenant {owner}" if owner else "this daemon's clients"
        if self.max_leases and self._held[owner] >= self.max_leases:
            raise ResourceExhausted(
                f"{who} already hold{'s' if owner else ''} {self._held[owner]} leases, the "
                f"limit (limits.leases_per_tenant = {self.max_leases}); release leases (or let "
                "them expire) before taking more")
        if self.max_slots and self._slots[owner] + slots > self.max_slots:
            raise ResourceExhausted(
                f"{who} hold{'s' if owner else ''} {self._slots[owner]} slots under leases and "
                f"{slots} more would pass the limit (limits.lease_slots_per_tenant = "
                f"{self.max_slots}); release leases, or lease fewer blocks at once")

    def new(self, kind: str, ns_id: bytes, tier: str, slots: list[Slot],
            ttl_s: float | None = None, keys: list[bytes] | None = None,
            checksums: list[int] | None = None) -> Lease:
        owner = self.owner_of(ns_id)
        lease = Lease(id=self._new_id(), ns_id=ns_id, kind=kind, tier=tier, slots=slots,
                      deadline=self.clock() + self.ttl(ttl_s), keys=keys or [],
                      checksums=checksums or [], owner=owner)
        self._leases[lease.id] = lease
        self._held[owner] += 1
        self._of_ns[ns_id] += 1
        self._slots[owner] += len(slots)
        heapq.heappush(self._heap, (lease.deadline, lease.id))
        return lease

    def _new_id(self) -> str:
        n = next(self._id_count).to_bytes(8, "little")
        return hashlib.blake2b(n, key=self._id_key, digest_size=16).hexdigest()

    def _forget(self, lease: Lease) -> None:
        del self._leases[lease.id]
        owner = lease.owner
        self._held[owner] -= 1
        self._slots[owner] -= len(lease.slots)
        if not self._held[owner]:
            del self._held[owner], self._slots[owner]
        self._of_ns[lease.ns_id] -= 1
        if not self._of_ns[lease.ns_id]:
            del self._of_ns[lease.ns_id]

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
        self._forget(lease)
        if len(self._heap) > 2 * len(self._leases) + COMPACT_SLACK:
            self._heap = [(x.deadline, x.id) for x in self._leases.values()]
            heapq.heapify(self._heap)
        return lease

    def renew(self, lease_id: str, ttl_s: float | None = None) -> float:
        lease = self._live(lease_id)
        deadline = self.clock() + self.ttl(ttl_s)
        if deadline < lease.deadline:       # sooner than its heap entry says: one more entry
            heapq.heappush(self._heap, (deadline, lease_id))
        lease.deadline = deadline
        return deadline

    def reap(self) -> list[Lease]:
        """Remove and return every lease past its deadline (only those: see the docstring)."""
        now = self.clock()
        heap = self._heap
        dead: list[Lease] = []
        while heap and heap[0][0] < now:
            _, lease_id = heapq.heappop(heap)
            lease = self._leases.get(lease_id)
            if lease is None:
                continue                    # released before its deadline
            if lease.deadline >= now:       # renewed: due again at its new deadline
                heapq.heappush(heap, (lease.deadline, lease_id))
                continue
            self._forget(lease)
            dead.append(lease)
            self._expired[lease.id] = None
            if len(self._expired) > self._remember:
                self._expired.popitem(last=False)
        return dead

    def all(self) -> list[Lease]:
        return list(self._leases.values())
