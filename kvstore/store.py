"""The store: the in-process API the gRPC server wraps, as a facade over explicit state.

The facade checks every call's input, keeps the books on namespaces and leases, and hands the
work to its collaborators, each built here with the shared state (kvstore/state.py) and the
collaborators it uses:
- the tenant pools (kvstore/pools.py): which segment and quota a namespace's blocks live under;
- the write and read paths of each slot tier a client leases: host (kvstore/host_writes.py,
  kvstore/host_reads.py) and gpu (kvstore/gpu_slots.py), chosen by the lease's tier;
- the moves between tiers (kvstore/moves/): eviction, demotion, promotion, flush.
Every call that changes the index does so under the state's lock; slow work runs without it
in the moves' three phases (docs/internals.md, "Locking").
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import blake3
from kvstore_client.common.errors import (
    DeadlineExceeded,
    InvalidArgument,
    LeaseExpired,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvstore_client.common.layout import NamespaceSpec, check_retention

from .carried import Carried
from .config import StoreConfig
from .gpu_slots import GpuSlots
from .held_writes import HeldWrites
from .host_reads import REMOTE_CHUNK, HostReads
from .host_writes import CommitResult, HostWrites
from .leases import Lease, LeaseTable
from .lookup import LookupResult, Queries
from .moves import Moves
from .namespaces import Registry
from .opening import close_tiers, open_tiers
from .state import CallCancelled, NamespaceInfo, StoreState
from .store_stats import namespace_list, stats
from .upkeep import Upkeep
from .validate import (
    MAX_KEYS_PER_CALL,
    check_checksums,
    check_commit,
    checked_keys,
    checked_parent,
    checked_token_ids,
)

log = logging.getLogger("kvstore.store")

# Keys a Retain or Delete handles per hold of the store lock, released between slices: one
# hold over 65,536 keys stalled every tenant's calls for 2.4 s (Retain) and a 120k-block
# Delete(all) for 1.4 s. A slice costs a few tens of milliseconds at most (docs/security.md).
SLICE_KEYS = 2048
EVICT_ALL_ROUNDS = 8        # an Evict of all host blocks: rounds of evicting, then waiting

__all__ = ["MAX_KEYS_PER_CALL", "REMOTE_CHUNK", "CommitResult", "LookupResult", "Store"]


class Store:
    def __init__(self, config: StoreConfig, background: bool = True) -> None:
        """Open every tier and rebuild the index from SSD.

        `background=False` leaves the background threads (slab prefault, SSD write buffers,
        demoter, lease reaper) to `start_background()`: the daemon starts them once it reports
        SERVING, so its start does not wait for threads to be scheduled on a busy machine.
        """
        st = self.state = StoreState(config.check())
        self.daemon_id = secrets.token_hex(16)     # (uuid would import platform: start time)
        data = Path(config.data_dir)
        data.mkdir(parents=True, exist_ok=True)
        shm_name = config.host.shm_name or "kvstore-" + blake3.blake3(
            str(data.resolve()).encode()).hexdigest()[:16]
        self.pools, self._host_pin = open_tiers(st, data, shm_name)
        self._slab = st.host if not self.pools.segmented else st.host.shared
        lim = config.limits
        # Leases are counted per tenant; without tenants all are the implicit tenant's, and
        # finding the owner costs nothing.
        self.leases = LeaseTable(config.leases.default_ttl_s, config.leases.max_ttl_s,
                                 max_leases=lim.leases_per_tenant,
                                 max_slots=lim.lease_slots_per_tenant,
                                 owner_of=self.pools.owner if self.pools.tenants else None)
        self.held_writes = HeldWrites(config.leases.expired_write_hold_s)
        self.moves = Moves(st, self.pools)
        reap, leases = self.reap_expired, self.leases
        self.host_writes = HostWrites(st, self.moves, leases, reap)
        self.host_reads = HostReads(st, self.moves, leases, reap)
        # The slot tiers a lease can name, by the name it carries on the wire.
        self.writers: dict[str, Any] = {"host": self.host_writes}
        self.readers: dict[str, Any] = {"host": self.host_reads}
        self.gpu_slots: GpuSlots | None = None
        if st.gpu:
            self.gpu_slots = GpuSlots(st, self.pools, self.moves.gpu_host, self.host_reads,
                                      leases, reap, self.release)
            self.writers["gpu"] = self.readers["gpu"] = self.gpu_slots
        # The tiers an Evict can name, by that name: each one's room-maker.
        moves = self.moves
        self._evictors: dict[str, Callable[..., tuple[int, int]]] = {
            "host": moves.host_room.evict}
        if moves.ssd_room is not None:
            self._evictors["ssd"] = moves.ssd_room.evict
        if moves.gpu_host is not None:
            self._evictors["gpu"] = moves.gpu_host.evict_all
        self.registry = Registry(st, self.pools, self.leases)
        self.queries = Queries(st, self.moves.host_remote)
        # The state's parts, for readers of the facade (the same objects; never rebound).
        self.config, self.index, self.counters = st.config, st.index, st.counters
        self.tier_counters, self.namespaces, self.policies = (st.tier_counters, st.namespaces,
                                                              st.policies)
        self.host, self.ssd, self.remote, self.gpu, self.events = (st.host, st.ssd, st.remote,
                                                                   st.gpu, st.events)
        self.carried = Carried(st, self.leases, self._end_lease)
        self.upkeep = Upkeep(st, self.reap_expired)
        self._starting = False
        if background:
            self.start_background()

    def start_background(self) -> None:
        """Start the background work (see __init__); a second call does nothing.

        Outside the lock: registering the slab spawns the resource tracker process and each
        thread start waits for the thread to be scheduled, which on a busy machine took
        seconds that every first call then waited for."""
        st = self.state
        with st.lock:
            if self._starting or st.closed:
                return
            self._starting = True
        self._slab.start_prefault()
        if st.ssd is not None:
            st.ssd.warm_up()
        with st.lock:
            if st.closed:
                return
            self.moves.start_background()
        if st.events is not None:
            st.events.start()
        self.upkeep.start()

    # ----------------------------------------------------------------- lifecycle

    def close(self, flush: bool = True, flush_budget_s: float | None = None,
              progress: Callable[[str], None] | None = None) -> None:
        """Refuse new calls, let the calls and moves in flight settle (they use the slabs and
        LMDB without the lock), then flush and release everything. A second caller waits
        for the first.

        `flush_budget_s` bounds the flush (a stop must not hang on a full host pool): blocks
        not written by then are dropped, which is safe because host-only blocks were never
        promised durable. `progress` gets a line about once a second while it flushes.
        """
        st = self.state
        dump = getattr(st.lock, "dump", None)      # KVS_LOCK_TIMING (lock_timing.py)
        if dump is not None:
            dump()
        with st.lock:
            if st.closed:
                while not st.shut:
                    st.idle.wait()
                return
            st.closed = True
            self.upkeep.stop()
            while st.busy:
                st.idle.wait()
            try:
                if flush and st.ssd is not None:
                    self.registry.persist_pending(strict=False)
                    if st.unpersisted:      # (their host blocks are not flushed: Moves.flush)
                        log.warning("%d namespaces are still not persisted (the SSD "
                                    "filesystem is full); their host blocks are not flushed",
                                    len(st.unpersisted))
                    self.moves.flush(flush_budget_s, progress)
            except ResourceExhausted as exc:   # disk or a tenant's quota full: the host-only
                log.warning("not every host block was flushed at close: %s", exc)  # blocks go
            finally:
                try:
                    close_tiers(st, self.moves, self._host_pin)
                finally:
                    st.shut = True
                    st.idle.notify_all()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- validation

    def _tier(self, tier: str) -> str:
        """The slot tier a lease is asked for (the key of `writers` / `readers`)."""
        tier = tier or "host"
        if tier in self.writers:
            return tier
        if tier == "gpu":
            raise Unavailable("the gpu tier is not enabled on this daemon")
        raise InvalidArgument(f"tier {tier!r} cannot hold leased slots; use 'host' or 'gpu'")

    def _admit_lease(self, ns_id: bytes, tier: str, slots: int) -> None:
        """Before a client's lease is made: its namespace's slots lie in a pool its owner maps
        (kvstore/pools.py) and its tenant is under its lease caps (kvstore/leases.py).

        Reads only (a namespace's owner, the tenant's lease counts), so without the lock: the
        caps are soft by what calls running at once hold, and an unknown namespace is left to
        the call to answer NOT_FOUND."""
        self.pools.check_lease_pool(ns_id, tier)
        self._admit(ns_id, slots)

    def _admit(self, ns_id: bytes, slots: int) -> None:
        """leases.admit, counting no lease a client already gave back (release_carried)."""
        try:
            self.leases.admit(ns_id, slots)
        except ResourceExhausted:
            if not self.carried:
                raise
            with self.state.lock:
                self.carried.end_all()
            self.leases.admit(ns_id, slots)

    # ----------------------------------------------------------------- namespaces

    def register_namespace(self, spec: NamespaceSpec) -> NamespaceInfo:
        """Register a namespace (idempotent: the same spec gives the same id and info)."""
        return self.registry.register(spec)

    def wants_token_ids(self, ns_id: bytes) -> bool:
        """Whether a stream publishes this namespace's blocks, so Commit should carry their
        token ids (RegisterNamespace tells the client)."""
        st = self.state
        if st.events is None:
            return False
        with st.lock:
            return st.events.wants_tokens(ns_id)

    def namespace(self, ns_id: bytes) -> NamespaceInfo:
        with self.state.lock:
            return self.state.namespace(ns_id)

    def owner(self, ns_id: bytes) -> str | None:
        return self.pools.owner(ns_id)

    # ----------------------------------------------------------------- lookup

    def lookup(self, ns_id: bytes, keys: Sequence[bytes], counted: bool = True) -> LookupResult:
        """The longest cached prefix of `keys`, overall and per tier; `counted`: in the hit
        and miss counts (False: a store's lookup of what not to write, kvstore/lookup.py)."""
        return self.queries.lookup(ns_id, checked_keys(keys, allow_empty=True, chain=True),
                                   counted)

    def where(self, ns_id: bytes, keys: Sequence[bytes]) -> list[str | None]:
        """The fastest tier holding each key, or None (kvstore/lookup.py)."""
        return self.queries.where(ns_id, checked_keys(keys, allow_empty=True, chain=True))

    # ----------------------------------------------------------------- write path

    def reserve(self, ns_id: bytes, n: int, tier: str = "host",
                ttl_s: float | None = None, device: int | None = None,
                ahead: bool = False) -> Lease:
        """A write lease over n slots. `ahead` (a Commit reserving for the client's next
        store): only from free room, never evicting, since that store may not come."""
        tier = self._tier(tier)
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise InvalidArgument(f"count must be a positive integer, got {n!r}")
        if n > MAX_KEYS_PER_CALL:
            raise InvalidArgument(f"count {n} is above the per-call limit {MAX_KEYS_PER_CALL}")
        self._admit_lease(ns_id, tier, n)
        return self.writers[tier].reserve(ns_id, n, ttl_s, device, ahead)

    def commit(self, lease_id: str, keys: Sequence[bytes], parent: bytes | None = None,
               checksums: Sequence[int] | None = None, first_slot: int = 0,
               token_ids: bytes | Sequence[int] | None = None) -> CommitResult:
        """Publish keys[i] from slot first_slot + i of a write lease; free its other slots.

        A checksum of 0 is refused: every host or gpu copy's checksum is checked on every read
        as it is, so a client may not mark a block "unknown"; without checksums the daemon
        hashes every block itself. `token_ids` (block_tokens per key: little-endian uint32
        bytes as Commit carries them, or a sequence of ints) name the blocks' tokens for KV
        events; kept only where a stream publishes the namespace (kvstore/events/)."""
        st = self.state
        keys = checked_keys(keys, allow_empty=True, chain=True)
        parent = checked_parent(parent)
        check_checksums(checksums)
        token_ids = checked_token_ids(token_ids)
        # The checks run in the writer's own first hold of the lock (one take fewer; each take
        # is a wait behind every other caller under load), token ids or not. Which writer: the
        # lease's tier, which never changes (read without the lock; a lease not found goes the
        # long way, which raises). A commit's event texts are lazy (nothing is packed until
        # the publisher reads them), so they are made here before the checks: texts of a
        # commit the checks refuse are never kept.
        found = self.leases.find(lease_id)
        if found is not None:
            texts = None
            if token_ids and st.events is not None:
                info = st.namespaces.get(found.ns_id)
                if info is not None:        # (else the checks raise NotFound)
                    texts = st.events.texts(found.ns_id, keys, parent, token_ids,
                                            info.spec.layout.block_tokens)

            def check(lease: Lease) -> None:
                self._check_commit(lease, keys, first_slot, checksums, token_ids)
            return self.writers[found.tier].commit(lease_id, keys, parent, checksums,
                                                   first_slot, texts, check)
        with st.lock:
            st.check_open()
            lease = self.leases.get(lease_id)
            self._check_commit(lease, keys, first_slot, checksums, token_ids)
            writer = self.writers[lease.tier]
        texts = (st.events.texts(lease.ns_id, keys, parent, token_ids,
                                 st.namespaces[lease.ns_id].spec.layout.block_tokens)
                 if token_ids and st.events is not None else None)
        return writer.commit(lease_id, keys, parent, checksums, first_slot, texts)

    def _check_commit(self, lease: Lease, keys: list[bytes], first_slot: int,
                      checksums: Sequence[int] | None, token_ids: bytes | None) -> None:
        """What Commit asks of its lease (locked): kvstore/validate.py's check_commit."""
        bt = self.state.namespace(lease.ns_id).spec.layout.block_tokens if token_ids else 0
        check_commit(lease, len(keys), first_slot, checksums, token_ids, bt)

    def put(self, ns_id: bytes, keys: Sequence[bytes], blocks: Sequence,
            parent: bytes | None = None, token_ids: bytes | None = None) -> CommitResult:
        """Bytes path: store blocks sent over the network (dedup before copying). `token_ids`
        (little-endian uint32 bytes, block_tokens per key) as commit's."""
        keys = checked_keys(keys, chain=True)
        parent = checked_parent(parent)
        if len(blocks) != len(keys):
            raise InvalidArgument(f"{len(blocks)} blocks for {len(keys)} keys")
        texts = None
        if token_ids and (ev := self.state.events) is not None:
            bt = self.namespace(ns_id).spec.layout.block_tokens
            if len(token_ids) != 4 * len(keys) * bt:
                raise InvalidArgument(f"{len(token_ids)} bytes of token ids for {len(keys)} "
                                      f"keys; send {bt} per key, 4 bytes each, or none")
            texts = ev.texts(ns_id, keys, parent, token_ids, bt)
        return self.host_writes.put(ns_id, keys, blocks, parent, texts)

    # ----------------------------------------------------------------- read path

    def acquire(self, ns_id: bytes, keys: Sequence[bytes], tier: str = "host",
                ttl_s: float | None = None, device: int | None = None,
                for_client: bool = True) -> Lease:
        """Pin the longest cached prefix in the tier's slots, promoting from lower tiers.

        Blocks to promote get their slots first, then are read and decoded in parallel
        without the store lock, then installed in order; the prefix ends at the first block
        that is missing or fails to decode (kvstore/host_reads.py).
        `for_client=False`: a lease the daemon holds itself while it copies (Get, prefetch),
        allowed in any pool (kvstore/pools.py, check_lease_pool).
        """
        tier = self._tier(tier)
        keys = checked_keys(keys, chain=True)
        ttl = self.leases.ttl(ttl_s)
        if for_client:
            self._admit_lease(ns_id, tier, len(keys))
        else:
            self._admit(ns_id, len(keys))
        return self.readers[tier].acquire(ns_id, keys, ttl, device)

    def with_prefix(self, ns_id: bytes, keys: Sequence[bytes], fn, copies=None):
        """fn([(key, view), ...]) on the pinned host copies of the longest cached prefix,
        checked (kvstore/host_reads.py)."""
        return self.host_reads.with_prefix(ns_id, checked_keys(keys, chain=True), fn, copies)

    def read_prefix(self, ns_id: bytes, keys: Sequence[bytes], fn):
        """fn(views, checksums) over the longest cached prefix, for a caller that checks its
        own copies (Get, kvstore/getcopy.py) and reports a failure with corrupt_host_copy."""
        return self.host_reads.read_prefix(ns_id, checked_keys(keys, chain=True), fn)

    def corrupt_host_copy(self, ns_id: bytes, key: bytes, path: str) -> None:
        """Count and drop a host copy a reader found not to match its commit checksum."""
        st = self.state
        with st.lock:
            if path == "Get":
                st.counters["get_checksum_mismatch"] += 1    # a Get stream was cut there
            self.moves.corrupt_host_copy(ns_id + key, path)

    def get(self, ns_id: bytes, keys: Sequence[bytes]) -> list[tuple[bytes, bytes]]:
        """Bytes path: copies of the longest cached prefix."""
        return self.with_prefix(ns_id, keys, lambda views: [(k, bytes(v)) for k, v in views],
                                copies=lambda out: [b for _, b in out])

    # ----------------------------------------------------------------- leases

    def release(self, lease_id: str, missing_ok: bool = False) -> None:
        """End a lease. `missing_ok` (the daemon's own leases: prefetch): one already ended,
        or past its deadline (the reaper ends it within REAP_EVERY_S), is no error."""
        with self.state.lock:
            try:
                lease = self.leases.pop(lease_id)
            except (NotFound, LeaseExpired):
                if missing_ok:
                    return
                raise
            self._end_lease(lease)

    def renew(self, lease_id: str, ttl_s: float | None = None) -> float:
        with self.state.lock:
            self.state.check_open()
            return self.leases.renew(lease_id, ttl_s)

    def release_carried(self, lease_ids: Iterable[str]) -> None:
        """End leases a call carries, checked as the caller's (kvstore/carried.py)."""
        self.carried.give_back(lease_ids)

    def reap_expired(self) -> None:
        """End every lease past its deadline, and those clients gave back in passing
        (locked)."""
        if self.carried:
            self.carried.end_all()
        for lease in self.leases.reap():
            self.state.counters["leases_expired"] += 1
            if lease.kind == "write" and self.held_writes.hold_s > 0:
                self.held_writes.hold(lease)    # kvstore/held_writes.py: a stalled writer
            else:
                self._end_lease(lease)
        held = self.held_writes
        if held:
            for lease in held.due():
                self._end_lease(lease)
            self.state.counters["expired_write_slots_held"] = held.slots
        elif self.state.counters.get("expired_write_slots_held"):
            self.state.counters["expired_write_slots_held"] = 0

    def _end_lease(self, lease: Lease) -> None:
        paths = self.writers if lease.kind == "write" else self.readers
        paths[lease.tier].end_lease(lease)

    # ----------------------------------------------------------------- admin

    def delete(self, ns_id: bytes, keys: Sequence[bytes] | None = None) -> int:
        """Delete the keys' blocks (all the namespace's with None); returns the blocks deleted.

        Why in slices of SLICE_KEYS, the lock released between them: one hold over a whole
        namespace stalled every tenant for as long as it took (1.4 s at 120k blocks). The keys
        are those the namespace held when the call began; a block deleted meanwhile by another
        caller is skipped and not counted, one stored again meanwhile under a listed key is
        deleted, and one stored under a new key stays (as a put just after the call would)."""
        st = self.state
        with st.lock:
            st.check_open()
            st.namespace(ns_id)
            gkeys = (st.index.namespace_keys(ns_id) if keys is None
                     else [ns_id + k for k in checked_keys(keys)])
            n = 0
            for start in range(0, len(gkeys), SLICE_KEYS):
                if start:
                    self._let_others_in()
                n += self.moves.delete(gkeys[start:start + SLICE_KEYS])
            return n

    def retain(self, ns_id: bytes, keys: Sequence[bytes], level: str) -> int:
        """Pass the engine's expectation of reuse to every tier's policy; returns the stored
        blocks it reached. Why: whether a request body will be reused (the conversation goes on,
        or the session was closed) is what decides a prefix cache's hit ratio, the engine may
        know it, and the store cannot guess it (docs/eviction.md).

        Why in slices of SLICE_KEYS, the lock released between them: one policy heap update
        per key under one hold stalled every tenant for 2.4 s at 65,536 keys. Each slice is
        looked up when its turn comes, so a key deleted meanwhile is skipped and not counted,
        and one stored again meanwhile gets the hint (a hint is advice: no slice depends on
        another)."""
        keys = checked_keys(keys)
        level = check_retention(level)
        st = self.state
        with st.lock:
            st.check_open()
            st.namespace(ns_id)
            n = 0
            for start in range(0, len(keys), SLICE_KEYS):
                if start:
                    self._let_others_in()
                found = [g for g in (ns_id + k for k in keys[start:start + SLICE_KEYS])
                         if st.index.get(g) is not None]
                for policy in st.policies.values():
                    hook = getattr(policy, "note_retention", None)
                    if hook is not None:
                        hook(found, level)      # a policy skips the keys it does not hold
                st.counters["retention_hint_blocks"] += len(found)
                n += len(found)
            return n

    def _let_others_in(self) -> None:
        """Release the store lock between two slices of a long call, and take it back (locked).

        Why state.unlocked: the call counts as busy meanwhile, so close() waits for it to end
        rather than tearing the tiers down under it. Why the sleep(0): a bare release and
        acquire hands the GIL to no one, so this thread would take the lock back before a
        waiter woke; yielding lets the waiting calls in first."""
        with self.state.unlocked():
            time.sleep(0)

    def evict(self, tier: str, nbytes: int = 0, only: set[bytes] | None = None,
              deadline: float | None = None, cancelled: Callable[[], bool] | None = None
              ) -> tuple[int, int]:
        """Evict from `tier` until `nbytes` are freed (0: everything evictable); with `only`,
        blocks of those namespaces alone (a tenant's Evict). `deadline` (time.monotonic()):
        an Evict of all host blocks stops waiting for the demotions in flight then, and
        answers what it freed (a disk slower than the writers would otherwise hold the call
        for every round); `cancelled()` true (the client went away): it stops likewise."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise InvalidArgument(f"bytes must be a non-negative integer, got {nbytes!r}")
        st = self.state
        with st.lock:
            st.check_open()
            evict = self._evictors.get(tier)
            if evict is None:
                if tier == "ssd":
                    raise Unavailable("the ssd tier is not enabled")
                raise InvalidArgument(f"cannot evict from tier {tier!r}; use 'host', 'ssd' or "
                                      "'gpu' (where enabled)")
            if nbytes or tier != "host":
                return evict(nbytes or None, only)
            # Everything evictable: blocks the background demoter has in flight are no victims
            # of this call, so wait for them to land (and evict what came meanwhile), or they
            # would still be on host when it returns. Rounds are bounded under a steady writer.
            freed = blocks = 0
            for _ in range(EVICT_ALL_ROUNDS):
                f, b = evict(None, only, deadline)
                freed, blocks = freed + f, blocks + b
                try:
                    if not st.wait_demotions(deadline, cancelled):
                        break
                except (DeadlineExceeded, CallCancelled):
                    break
            return freed, blocks

    def flush(self, only: set[bytes] | None = None, deadline: float | None = None,
              cancelled: Callable[[], bool] | None = None) -> int:
        """Write every host-only block (of the namespaces `only` names) down to SSD and sync;
        returns blocks written.

        The blocks a demotion has in flight when it starts are waited for, so they are synced
        too (or, if their write failed, written here); blocks stored meanwhile are not waited
        for, so a steady writer cannot keep it from ending. `deadline` (time.monotonic()):
        DeadlineExceeded once past it; `cancelled()` true: CallCancelled; either way what was
        written stays written (Moves.flush). First the records of the namespaces it covers
        that are not on SSD yet are written (ResourceExhausted while they cannot be: their
        blocks on SSD would be lost to a restart)."""
        st = self.state
        with st.lock:
            st.check_open()
            self.registry.persist_pending(only)
            return self.moves.flush(only=only, deadline=deadline, cancelled=cancelled)

    # ----------------------------------------------------------------- reporting

    def host_info(self) -> dict:
        return self.state.host.describe()

    def gpu_info(self, own: list | None = None) -> list[dict]:
        """GPU pools for RegisterNamespace replies (empty without CUDA or with gpu disabled):
        the shared slabs, or a tenant's own (`own`: gpu_segments_of(tenant))."""
        return self.gpu_slots.info(own) if self.gpu_slots is not None else []

    def gpu_segments_of(self, tenant: str | None) -> list[tuple[int, int, dict]]:
        return self.pools.gpu_segments_of(tenant)

    def gpu_segment_fds(self, tenant: str | None) -> list[tuple[int, int, int]]:
        return self.pools.gpu_segment_fds(tenant)

    def tenant_pool(self, tenant: Any) -> tuple[int, int] | None:
        return self.pools.tenant_pool(tenant)

    def tenant_base(self, tenant: str | None) -> int | None:
        return self.pools.tenant_base(tenant)

    def stats(self) -> dict:
        with self.state.lock:
            return stats(self.state, self.leases, self.gpu_slots, self.daemon_id)

    def namespace_list(self, only: set[bytes] | None = None) -> list[dict]:
        """Each namespace (of `only`) and what it holds: kvstore/store_stats.py."""
        with self.state.lock:
            return namespace_list(self.state, self.leases, only)
