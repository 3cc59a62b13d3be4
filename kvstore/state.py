"""What the store's parts share: one object, handed to every collaborator.

The store (kvstore/store.py) is a facade; the work is done by collaborators (the tenant pools,
the read and write paths, one mover per tier edge in kvstore/moves/), and each receives this
object instead of reaching into another's attributes. It holds the configuration, the block
index, the eviction policy of each tier, the counters, the tiers themselves, the KV events
hookup and the lock with its busy/idle protocol.

The lock. One RLock guards the index, the policies, the leases, the slab allocators and the
counters, so the invariants the tests check (no leased block evicted, byte accounting equal to
the resident sizes plus reserved and in-flight slots, no tier over its cap) hold between any
two calls. Slow work runs without it, in the three phases every move has: pick under the lock
(the blocks are marked `moving`), transfer without it, settle under it again
(docs/internals.md, "Locking"). A call that releases the lock mid-way counts itself in `busy`
while it is out, and `idle` is notified whenever one of those settles: `close()` refuses new
calls, then waits on `idle` until `busy` is zero, because those calls still use the slabs and
LMDB.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore_client.common.errors import (
    DeadlineExceeded,
    InvalidArgument,
    KVStoreError,
    NotFound,
    Unavailable,
)
from kvstore_client.common.layout import NamespaceSpec

from .config import StoreConfig
from .index import NS_ID_BYTES, BlockIndex
from .lock_timing import make_lock

if TYPE_CHECKING:
    from tiers.base import DeviceSlotTier, DiskTier, NetworkTier, SlotTier

    from .policies import EvictionPolicy

TIERS = ("gpu", "host", "ssd", "remote")
CANCEL_POLL_S = 0.1         # how often a wait with a `cancelled` check looks at it
SLAB_ALIGN = 4096           # host and device slots are whole pages (tiers/slab.py)


class CallCancelled(KVStoreError):
    """The client went away while its call waited (the call ends; nothing is lost)."""
    code = "CANCELLED"


def aligned(n: int) -> int:
    """Bytes a slot of `n` bytes takes in a slab (a whole number of pages)."""
    return -(-n // SLAB_ALIGN) * SLAB_ALIGN


@dataclass(frozen=True)
class NamespaceInfo:
    """A registered namespace: its id and spec (layout, codec, owner)."""
    ns_id: bytes
    spec: NamespaceSpec

    @property
    def block_bytes(self) -> int:
        return self.spec.layout.block_bytes


class StoreState:
    """The store's shared state. Fields are read and written under `lock` unless a method
    says otherwise; the tiers are set once while the store opens."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.lock = make_lock()     # a plain RLock; timed where KVS_LOCK_TIMING is set
        self.idle = threading.Condition(self.lock)   # notified when a busy call settles
        self.busy = 0               # calls that released the lock mid-way and will take it back
        self.closed = False         # close() has started: no new call begins
        self.shut = False           # close() has released every resource
        self.counters: Counter = Counter()
        self.tier_counters: dict[str, Counter] = {t: Counter() for t in TIERS}
        self.device_counters: dict[int, Counter] = {}
        self.namespaces: dict[bytes, NamespaceInfo] = {}
        # When each namespace was last named by a call (time.monotonic()): a tenant at its
        # namespace cap gets room by reclaiming its least recently used empty one.
        self.ns_used: dict[bytes, float] = {}
        self.index = BlockIndex()
        self.policies: dict[str, EvictionPolicy] = {}   # "host", "ssd", "gpu<device>"
        self.host: SlotTier = None  # type: ignore[assignment]    # set while opening
        self.ssd: DiskTier | None = None
        self.remote: NetworkTier | None = None
        self.gpu: dict[int, DeviceSlotTier] = {}
        self.events: Any = None     # KV events (kvstore/events/), where [events] is on
        # Demotions out of host in flight (their blocks marked moving): an allocation that
        # needs their room, and a flush that must sync their blocks, wait for them.
        self.demotions: set[threading.Event] = set()
        # Namespaces whose LMDB record did not land (the SSD filesystem was full when they
        # were registered): id -> the record, written again until it lands
        # (kvstore/namespaces.py). No flush writes their blocks to SSD meanwhile: a restart
        # would not know the namespace, and those blocks would be misses whose bytes leak.
        self.unpersisted: dict[bytes, bytes] = {}

    def attach(self, **tiers: Any) -> None:
        """Set the tiers by name (host, ssd, remote, gpu) while the store opens; the tiers
        are fixed from then on. (A method, not assignments: outside kvstore/index.py, an
        assignment to `.host`, `.ssd`, `.remote` or `.gpu` reads as a block's residency
        changing behind the index's back, which tests/test_events_residency.py forbids.)"""
        for name, tier in tiers.items():
            if name not in ("host", "ssd", "remote", "gpu"):
                raise ValueError(f"no tier {name!r}")
            setattr(self, name, tier)

    # -- the busy/idle protocol ----------------------------------------------------------------
    def check_open(self) -> None:
        if self.closed:
            raise Unavailable("the store is shutting down")

    def enter_busy(self) -> None:
        """Count a call that is about to work without the lock (locked)."""
        self.busy += 1

    def leave_busy(self) -> None:
        """That call is done (takes the lock): wake close() and anyone waiting for it."""
        with self.lock:
            self.busy -= 1
            self.idle.notify_all()

    @contextmanager
    def unlocked(self) -> Iterator[None]:
        """Release the lock for the block's duration, counted busy, and take it back.

        Releases one level only: a caller holding the lock more than once keeps it, and the
        slow part then runs locked (safe, just not concurrent)."""
        self.busy += 1
        self.lock.release()
        try:
            yield
        finally:
            self.lock.acquire()
            self.busy -= 1
            self.idle.notify_all()

    def wait_demotions(self, deadline: float | None = None,
                       cancelled: Callable[[], bool] | None = None) -> bool:
        """Wait (releasing the lock) until the demotions now in flight have settled; False when
        none was. They never wait on anything but the lock, so this cannot deadlock; the
        caller counts as busy meanwhile, so close() waits for it to finish its call.
        `deadline`, `cancelled`: as wait_flights."""
        pending = list(self.demotions)
        if not pending:
            return False
        self.wait_flights(pending, deadline, cancelled)
        return True

    def wait_flights(self, events: Iterable[threading.Event], deadline: float | None = None,
                     cancelled: Callable[[], bool] | None = None) -> None:
        """Wait (releasing the lock) until each of these flights (an Entry's `moving`) has
        landed (locked), counted busy meanwhile. Only the flights named: moves that start
        meanwhile are not waited for, so a steady writer cannot make this wait forever.

        `deadline` (time.monotonic()): past it, DeadlineExceeded; `cancelled()` true (the
        caller went away): CallCancelled. Either leaves the flights to land on their own."""
        pending = [ev for ev in events if not ev.is_set()]
        if not pending:
            return
        self.busy += 1
        try:
            while not all(ev.is_set() for ev in pending):
                if cancelled is not None and cancelled():
                    raise CallCancelled("the client went away while its call waited for "
                                        "block moves in flight")
                timeout = None if cancelled is None else CANCEL_POLL_S
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise DeadlineExceeded(
                            f"{sum(not ev.is_set() for ev in pending)} block moves in flight "
                            "had not landed by the call's deadline")
                    timeout = left if timeout is None else min(left, timeout)
                self.idle.wait(timeout)
        finally:
            self.busy -= 1
            self.idle.notify_all()

    # -- small shared readings -------------------------------------------------------------------
    def namespace(self, ns_id: bytes) -> NamespaceInfo:
        """The registered namespace `ns_id` names (locked); InvalidArgument or NotFound."""
        if not isinstance(ns_id, (bytes, bytearray)) or len(ns_id) != NS_ID_BYTES:
            raise InvalidArgument(f"namespace_id must be {NS_ID_BYTES} bytes as returned by "
                                  "RegisterNamespace")
        info = self.namespaces.get(bytes(ns_id))
        if info is None:
            raise NotFound(f"unknown namespace {bytes(ns_id).hex()}; register it first")
        self.ns_used[info.ns_id] = time.monotonic()
        return info

    def policy_of_device(self, dev: int) -> EvictionPolicy:
        return self.policies[f"gpu{dev}"]

    def texts(self) -> dict | None:
        """KV-event texts of blocks with a host or gpu copy (their SSD meta keeps them), or
        None where events are off (locked)."""
        return self.events.book if self.events is not None else None
