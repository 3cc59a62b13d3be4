"""The read path out of host: Acquire pins the longest cached prefix in host slots.

An acquire works in rounds. A round pins the host hits and reserves a host slot for each block
a lower tier holds, under the lock; the promotions fill those slots without it; the round
settles them under it again (kvstore/moves/promotion.py). The prefix ends at the first block
that is missing or fails to decode. A round also stops early at a block another acquire is
promoting: this one then waits for that promotion to settle, holding no reservation (so two
acquires never wait on each other), and goes on from that block, most likely a host hit by
then. Blocks only the remote tier holds are fetched before the rounds, without the lock, and
for long prefixes one range ahead of the decode (REMOTE_CHUNK blocks per range).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvstore_client.common.errors import LeaseExpired, ResourceExhausted
from kvstore_client.common.read_ahead import ReadAhead

from .index import Entry
from .leases import Lease, LeaseTable, Slot
from .moves import Moves
from .moves.promotion import Promotion
from .state import StoreState
from .verify import first_mismatch

PROMOTION_WAIT_S = 60.0     # an acquire waits this long for another's promotion of its block
REMOTE_CHUNK = 8            # remote blocks fetched per trip when an acquire pipelines its fetches


class HostReads:
    def __init__(self, state: StoreState, moves: Moves, leases: LeaseTable,
                 reap: Callable[[], None]) -> None:
        """`reap`: ends expired leases (the store's, locked), run at each round's start."""
        self.state = state
        self.moves = moves
        self.promoter = moves.promoter
        self.leases = leases
        self.reap = reap

    def acquire(self, ns_id: bytes, keys: list[bytes], ttl: float,
                device: int | None = None) -> Lease:
        """A read lease over the longest cached prefix of `keys`, in host slots."""
        remote = self.moves.host_remote
        if remote is None:
            return self.acquire_from(ns_id, keys, ttl, {})
        want = remote.wanted(ns_id, keys)
        if len(want) > REMOTE_CHUNK:
            return self._acquire_pipelined(ns_id, keys, ttl, want)
        return self.acquire_from(ns_id, keys, ttl, remote.fetch(want))

    def _acquire_pipelined(self, ns_id: bytes, keys: list[bytes], ttl: float,
                           want: list[bytes]) -> Lease:
        """Acquire in key ranges of REMOTE_CHUNK remote blocks, fetching range i+1 from Redis
        while range i is decoded; the ranges' leases are merged into one.

        Why a fetch thread per acquire, not one shared by all: with a shared one, every
        tenant's long remote loads queued behind each other (one tenant's 8 loads made
        another's 9x slower with Redis answering in time). All ranges share one absolute
        deadline, the one a single fetch of every wanted block would get."""
        remote = self.moves.host_remote
        chunks = [want[i:i + REMOTE_CHUNK] for i in range(0, len(want), REMOTE_CHUNK)]
        where = {ns_id + k: i for i, k in enumerate(keys)}      # (the keys are distinct)
        ends = [where[c[0]] for c in chunks[1:]] + [len(keys)]
        until = remote.deadline_for(ns_id, len(want))
        fetched = ReadAhead((remote.fetch(c, until) for c in chunks), depth=1,
                            name="kvstore-fetch")
        parts: list[Lease] = []
        start = 0
        try:
            for end, values in zip(ends, fetched, strict=False):
                part = self.acquire_from(ns_id, keys[start:end], ttl, values)
                parts.append(part)
                if len(part.keys) < end - start:
                    break                   # the prefix ends inside this range
                start = end
            with self.state.lock:
                for part in parts:
                    self.leases.pop(part.id)
                return self.leases.new("read", bytes(ns_id), "host",
                                       [s for p in parts for s in p.slots], ttl,
                                       keys=[k for p in parts for k in p.keys],
                                       checksums=[c for p in parts for c in p.checksums])
        except BaseException:
            with self.state.lock:
                for part in parts:
                    lease = self.leases.find(part.id)
                    if lease is not None:
                        self.leases.pop(part.id)
                        self.end_lease(lease)
            raise
        finally:
            fetched.close()

    def acquire_from(self, ns_id: bytes, keys: list[bytes], ttl: float,
                     remote_values: dict) -> Lease:
        """Pin the longest prefix in rounds, then lease it (`remote_values`: the blocks already
        fetched from the remote tier)."""
        st = self.state
        pinned: list[Entry] = []

        def lease(got: list[Entry]) -> Lease:
            return self._lease(ns_id, pinned + got, ttl)
        try:
            while True:
                try:
                    got, wait, done = self._round(ns_id, keys[len(pinned):], remote_values,
                                                  lease)
                except ResourceExhausted:
                    if not pinned:
                        raise
                    st.counters["acquire_cut_host_full"] += 1     # as in _plan
                    break
                if done is not None:
                    return done
                pinned += got
                if wait is None or not wait.wait(PROMOTION_WAIT_S):
                    break
            with st.lock:
                return self._lease(ns_id, pinned, ttl)
        except BaseException:
            with st.lock:
                _unpin(pinned)
            raise

    def _lease(self, ns_id: bytes, pinned: list[Entry], ttl: float) -> Lease:
        """The read lease over the pinned prefix (locked)."""
        st = self.state
        st.check_open()
        # one batch call per policy (the two policies are independent)
        st.policies["host"].touch_many([e.gkey for e in pinned])
        if any(e.ssd for e in pinned):
            st.policies["ssd"].touch_many([e.gkey for e in pinned if e.ssd])
        st.counters["acquired_blocks"] += len(pinned)
        return self.leases.new("read", bytes(ns_id), "host",
                               [Slot(e.host, e.size) for e in pinned], ttl,
                               keys=[e.key for e in pinned],
                               checksums=[e.checksum for e in pinned])

    def _round(self, ns_id: bytes, keys: list[bytes], remote_values: dict,
               lease: Callable[[list[Entry]], Lease]
               ) -> tuple[list[Entry], threading.Event | None, Lease | None]:
        """Pin the longest prefix of `keys` that host holds or this round can promote.

        Under the lock, pin host hits and reserve a slot for each block to promote, marking it
        in flight; without the lock, read, decode and verify into those slots; under the lock
        again, publish them or give them back. Returns the pinned entries in key order and,
        when the prefix stopped at a block another acquire is promoting, the event that
        promotion sets when it settles. A round that ends the acquire (no such wait) makes
        its lease, `lease(pinned)`, in the same hold of the lock and returns it third: under
        16 clients (bench/tail.py) each separate take of the lock is one more wait behind
        every other caller, and the slowest 1% of loads spent about 40% of their time in such
        waits, a quarter of that in the lease's own take.
        """
        st = self.state
        promoter = self.promoter
        flights: list[threading.Event] = []  # the round's event, made at its first promotion
        with st.lock:
            st.check_open()
            self.reap()
            info = st.namespace(ns_id)
            chain, wait = self._plan(ns_id, keys, remote_values, flights)
            jobs = [p for p in chain if isinstance(p, Promotion)]
            if not jobs:
                return chain, wait, self._end_round(chain, wait, lease)
            st.enter_busy()                  # close() waits for this round to settle
            flight = flights[0]
        try:
            promoter.fill(info, jobs)
        except BaseException:
            with st.lock:
                for p in jobs:
                    promoter.abandon(p)
                _unpin([x for x in chain if isinstance(x, Entry)])
                self._round_done(flight)
            raise
        with st.lock:
            pinned: list[Entry] = []
            dropped: list[tuple[str, Entry]] = []
            cut = False
            for x in chain:
                # Every promotion settles, even past the cut: a good copy is worth keeping.
                ok = promoter.settle(x, dropped) if isinstance(x, Promotion) else True
                e = x.entry if isinstance(x, Promotion) else x
                cut = cut or not ok
                if cut:
                    if isinstance(x, Entry):
                        e.pins -= 1          # a host hit past the end of the prefix
                    continue
                if isinstance(x, Promotion):
                    e.pins += 1
                pinned.append(e)
            self._round_done(flight)
            if dropped:
                try:
                    promoter.delete_dropped(dropped)
                except BaseException:
                    _unpin(pinned)
                    raise
            wait = None if cut else wait
            return pinned, wait, self._end_round(pinned, wait, lease)

    @staticmethod
    def _end_round(pinned: list[Entry], wait: threading.Event | None,
                   lease: Callable[[list[Entry]], Lease]) -> Lease | None:
        """The lease, where this round ends the acquire (locked); None where it goes on."""
        if wait is not None:
            return None
        try:
            return lease(pinned)
        except BaseException:
            _unpin(pinned)
            raise

    def _plan(self, ns_id: bytes, keys: list[bytes], remote_values: dict,
              flights: list[threading.Event]) -> tuple[list, threading.Event | None]:
        """Phase 1 of a round (locked): host hits pinned, promotions reserved, in key order.
        The round's event, which its promotions' waiters wait on, is made (into `flights`)
        at the first one: a round of host hits only, most loads, makes none (an Event is a
        lock and a condition, a microsecond and a half of every acquire)."""
        st = self.state
        chain: list[Entry | Promotion] = []
        try:
            for k in keys:
                e = st.index.get(ns_id + k)
                if e is None:
                    break
                if e.host is not None:
                    e.pins += 1              # pinned now: later room-making can't evict it
                    chain.append(e)
                    st.tier_counters["host"]["read_hits"] += 1
                    continue
                if e.moving is not None:
                    return chain, e.moving   # another acquire is promoting it
                if not flights:
                    flights.append(threading.Event())
                try:
                    p = self.promoter.reserve(e, remote_values, flights[0])
                except ResourceExhausted:
                    if not chain:
                        raise
                    # Host cannot make room beside what this acquire already pins (a prefix
                    # longer than the pool): the blocks that fit are the answer, not an error.
                    st.counters["acquire_cut_host_full"] += 1
                    break
                if p is None:
                    break
                chain.append(p)
        except BaseException:
            for x in chain:
                if isinstance(x, Promotion):
                    self.promoter.abandon(x)
            _unpin([x for x in chain if isinstance(x, Entry)])
            for flight in flights:
                flight.set()
            raise
        return chain, None

    def _round_done(self, flight: threading.Event) -> None:
        """A round's promotions have settled or been undone: wake its waiters and close()."""
        flight.set()
        self.state.busy -= 1
        self.state.idle.notify_all()

    # -- copies the daemon makes itself (Get) ---------------------------------------------------
    def _pin_for_copy(self, ns_id: bytes, keys: list[bytes]) -> Lease:
        """A read lease the daemon holds while it copies: allowed in any pool
        (kvstore/pools.py, check_lease_pool), counted in the tenant's caps."""
        self.leases.admit(ns_id, len(keys))
        return self.acquire(ns_id, keys, self.leases.ttl(None))

    def _let_go(self, lease: Lease) -> None:
        """End the daemon's own read lease; one past its deadline (a copy that outlasted it)
        is left to the reaper, which ends it within REAP_EVERY_S."""
        with self.state.lock:
            if self.leases.find(lease.id) is not None:
                try:
                    self.leases.pop(lease.id)
                except LeaseExpired:
                    return
                self.end_lease(lease)

    def with_prefix(self, ns_id: bytes, keys: list[bytes], fn, copies=None):
        """Call fn([(key, view), ...]) on the pinned host copies of the longest cached prefix.

        The views are valid only inside fn (the read lease is released after it), which lets a
        caller copy the bytes exactly once, straight into whatever it sends.
        `copies(result)` names the copies fn made, block by block; they are checked against the
        committed checksums (kvstore/verify.py) and a block that fails is counted, dropped and
        ends the prefix: fn is called again on the blocks before it.
        """
        st = self.state
        lease = self._pin_for_copy(ns_id, keys)
        bad: list[bytes] = []
        try:
            views = [(k, memoryview(st.host.view(s.offset, s.length)))
                     for k, s in zip(lease.keys, lease.slots, strict=True)]
            while True:
                out = fn(views)
                if not st.config.host.verify_reads or copies is None:
                    break
                n = first_mismatch(copies(out), lease.checksums[:len(views)])
                if n == len(views):
                    break
                bad.append(ns_id + views[n][0])
                views = views[:n]
            st.counters["bytes_host_to_client"] += sum(v.nbytes for _, v in views)
            return out
        finally:
            self._let_go(lease)
            if bad:
                with st.lock:
                    for g in bad:
                        self.moves.corrupt_host_copy(g, "Get")

    def read_prefix(self, ns_id: bytes, keys: list[bytes], fn):
        """fn(views, checksums) over the longest cached prefix, under a read lease: with_prefix
        without the check, for a caller that checks its own copies."""
        st = self.state
        lease = self._pin_for_copy(ns_id, keys)
        try:
            views = [(k, st.host.view(s.offset, s.length))
                     for k, s in zip(lease.keys, lease.slots, strict=True)]
            st.counters["bytes_host_to_client"] += sum(s.length for s in lease.slots)
            return fn(views, lease.checksums)
        finally:
            self._let_go(lease)

    def end_lease(self, lease: Lease) -> None:
        """A read lease ended: its blocks' host copies are unpinned."""
        index = self.state.index
        for k in lease.keys:
            e = index.get(lease.ns_id + k)
            if e is not None and e.pins > 0:
                e.pins -= 1


def _unpin(entries: list[Entry]) -> None:
    for e in entries:
        if e.pins > 0:
            e.pins -= 1
