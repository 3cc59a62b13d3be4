"""The write path into host: Reserve and Commit on host slots, and Put's bytes.

A zero-copy store is Reserve (a write lease over host slots, room made first: host_room.py),
the client's copy into the slots it maps, then Commit: the slots are hashed without the lock
(they belong to the write lease alone; a lease that expires meanwhile fails the check after),
then published under it as the blocks' host copies, one per key (a key already in host is a
duplicate and its slot goes back). Put is the same for bytes sent over the network: the daemon
copies each block into a slot itself, hashing the bytes it was sent. Either way a namespace
with write-through on then demotes what it published (host_to_ssd.py, host_remote.py).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash
from kvstore_client.common.errors import DataLoss, InvalidArgument, NotFound, ResourceExhausted

from .checksums import xxh3_many
from .index import Entry
from .leases import Lease, LeaseTable, Slot
from .moves import Moves
from .moves.encoding import LOSSY
from .state import StoreState, aligned


@dataclass
class CommitResult:
    stored: int
    duplicates: int


class HostWrites:
    def __init__(self, state: StoreState, moves: Moves, leases: LeaseTable,
                 reap: Callable[[], None]) -> None:
        """`reap`: ends expired leases (the store's, locked), run before slots are handed out."""
        self.state = state
        self.moves = moves
        self.leases = leases
        self.reap = reap

    def reserve(self, ns_id: bytes, n: int, ttl_s: float | None, device: int | None = None,
                ahead: bool = False) -> Lease:
        """A write lease over n host slots. `ahead` (a Commit reserving for the client's next
        store): only from free room, never evicting, since that store may not come."""
        st = self.state
        room = self.moves.host_room
        with st.lock:
            st.check_open()
            self.reap()
            info = st.namespace(ns_id)
            size = info.block_bytes
            host = st.host
            if n * aligned(size) > host.capacity * st.config.host.high_watermark:
                raise ResourceExhausted(
                    f"{n} blocks of {size} bytes do not fit the host tier "
                    f"({host.capacity} bytes); reserve in smaller batches")
            ttl = self.leases.ttl(ttl_s)
            if ahead and not room.has_room(n * aligned(size), ns_id):
                raise ResourceExhausted(f"no free room for {n} slots ahead")
            t0 = time.perf_counter()
            waits = room.must_evict_inline(n * aligned(size))
            room.make_room(n * aligned(size), ns_id)
            offsets = room.alloc_many(size, n, ns_id, wait=not ahead)
            if waits:                        # made room inline: this Reserve waited for it
                st.counters["reserve_waits"] += 1
                st.counters["reserve_wait_seconds"] += time.perf_counter() - t0
            return self.leases.new("write", bytes(ns_id), "host",
                                   [Slot(o, size) for o in offsets], ttl)

    def commit(self, lease_id: str, keys: list[bytes], parent: bytes | None,
               checksums: Sequence[int] | None, first_slot: int = 0,
               texts: list | None = None,
               check: Callable[[Lease], None] | None = None) -> CommitResult:
        """Publish keys[i] from slot first_slot + i of a write lease (checked by the store, or
        by `check` in this call's first hold of the lock); free its other slots. `texts`: the
        blocks' KV-event texts, kept as they are published."""
        st = self.state
        with st.lock:
            st.check_open()
            lease = self.leases.get(lease_id)
            if check is not None:
                check(lease)
            used = lease.slots[first_slot:first_slot + len(keys)]
            checked = self._commit_sample(len(used), checksums)
            views = [st.host.view(used[i].offset, used[i].length) for i in checked]
        # Hashing (the slow part) runs outside the lock, so one client's commit does not stall
        # every other call: the slots belong to this write lease alone, and a lease that
        # expires meanwhile fails the get below.
        hashed = xxh3_many(views)
        with st.lock:
            st.check_open()
            lease = self.leases.get(lease_id)
            for i, got in zip(checked, hashed, strict=True):
                if checksums and got != checksums[i]:
                    self.leases.pop(lease_id)
                    self.end_lease(lease)
                    st.counters["commit_checksum_mismatch"] += 1
                    raise DataLoss(f"block {i}'s bytes in the slot do not match the checksum "
                                   "sent with Commit (torn or overlapping write, or a client "
                                   "writing into a stale mapping of the pool); nothing from "
                                   "this lease was stored")
            sums = [int(c) for c in checksums] if checksums else hashed
            self.leases.pop(lease_id)
            stored = dups = 0
            published: list[Entry] = []
            batch: list[tuple[bytes, bytes | None, int]] = []    # host policy inserts, in order
            if texts:
                st.events.recorder.remember(lease.ns_id, keys, texts)
            fresh = self._publish_new(lease.ns_id, keys, parent, used, sums)
            if fresh is not None:
                stored, published = len(fresh), fresh
            else:
                for i, (k, slot) in enumerate(zip(keys, used, strict=True)):
                    prev = parent if i == 0 else keys[i - 1]
                    placed, e = self.publish(lease.ns_id, k, prev, slot.offset, slot.length,
                                             sums[i], batch)
                    if placed:
                        stored += 1
                        published.append(e)
                    else:
                        dups += 1
                        st.host.free(slot.offset)
                st.policies["host"].insert_many(batch)
            for slot in lease.slots[:first_slot] + lease.slots[first_slot + len(keys):]:
                st.host.free(slot.offset)
            st.counters["bytes_client_to_host"] += stored * (lease.slots[0].length
                                                             if lease.slots else 0)
            self._note_put(lease.ns_id, keys)
            self._write_through(published)
            return CommitResult(stored, dups)

    def _lossy(self, ns_id: bytes) -> bool:
        info = self.state.namespaces.get(ns_id)
        return info is not None and info.spec.codec in LOSSY

    def _commit_sample(self, n: int, checksums: Sequence[int] | None) -> list[int]:
        """Which committed slots Commit hashes itself.

        Every block's checksum is checked again before its bytes leave the pool (verify_reads:
        Get, demotion, write-through; clients verify their own loads), so hashing all of them
        here too would be a third pass over the bytes on the engine's store path. One block per
        commit, chosen at random, still tells a client at once that it wrote into a mapping
        the daemon no longer uses (every block differs then). Without checksums from the
        client, or with verify_reads off, the daemon's own hash is the only one: all of them.
        """
        host = self.state.config.host
        if not checksums or not host.verify_reads or host.commit_check == "all" or n <= 1:
            return list(range(n))
        return [random.randrange(n)]

    def _publish_new(self, ns_id: bytes, keys: list[bytes], parent: bytes | None,
                     used: Sequence[Slot], sums: Sequence[int]) -> list[Entry] | None:
        """publish() for every key of a commit at once, when none is indexed yet (locked):
        the steady state of an engine storing new blocks. Why: per block, publish's lookups,
        the residency listener's call and the counters cost more than the index row and the
        policy insert themselves. None when a key is indexed already: the caller then
        publishes key by key (duplicates, blocks held in a lower tier)."""
        st = self.state
        index = st.index
        if any(ns_id + k in index for k in keys):
            return None
        prevs = [parent, *keys[:-1]]
        entries = [Entry(ns_id, k, p, s.length, c)
                   for k, p, s, c in zip(keys, prevs, used, sums, strict=True)]
        index.add_host_many(entries, [s.offset for s in used])
        # (parent_gkey after the adds: the index drops a parent that would close a cycle)
        st.policies["host"].insert_many([(e.gkey, e.parent_gkey, e.size) for e in entries])
        st.tier_counters["host"]["stored"] += len(entries)
        return entries

    def publish(self, ns_id: bytes, key: bytes, parent: bytes | None, offset: int, size: int,
                checksum: int, batch: list | None = None) -> tuple[bool, Entry]:
        """Make a filled slot the host copy of `key` (locked); False when host already has one
        (dedup). With `batch`, the host policy's insert is appended there for one insert_many
        call (the policy's per-call cost is then paid once per commit); the caller makes it."""
        st = self.state
        g = ns_id + key
        e = st.index.get(g)
        policy = st.policies["host"]
        if e is not None and e.host is not None:
            if batch:                        # keep the policy's order of accesses
                policy.insert_many(batch)
                batch.clear()
            policy.touch(g)
            st.counters["duplicate_blocks"] += 1
            return False, e
        if e is None:
            e = Entry(ns_id, key, parent, size, checksum)
            st.index.add(e)
        else:
            if e.checksum and e.checksum != checksum:
                if e.gpu is not None or not self._lossy(ns_id):
                    # Same key, other bytes than the copies it has (engines differ in low
                    # bits): one block never holds two versions, so the copy it has stays.
                    st.counters["duplicate_blocks_differing"] += 1
                    return False, e
                # A lossy promotion left the checksum of dequantized bytes; the client's raw
                # bytes are the block (its lower copies are codes, checked by their frames).
            e.checksum = checksum
            st.index.set_parent(e, parent)
        st.index.set_host(e, offset)
        if batch is None:
            policy.insert(g, e.parent_gkey, size)
        else:
            batch.append((g, e.parent_gkey, size))
        st.tier_counters["host"]["stored"] += 1
        return True, e

    def _note_put(self, ns_id: bytes, keys: list[bytes]) -> None:
        """Tell the host policy which keys one write carried (it learns whether a write's last
        block, usually a prompt's partial tail, is worth keeping)."""
        hook = getattr(self.state.policies["host"], "note_put", None)
        if hook is not None and keys:
            hook([ns_id + k for k in keys])

    def _write_through(self, entries: list[Entry]) -> None:
        """Demote what a write published, where write-through is on (locked; the transfers
        run without the lock)."""
        st = self.state
        if not entries:
            return
        if self.moves.host_to_ssd is not None and st.config.ssd.write_through:
            self.moves.host_to_ssd.demote(entries)
        if self.moves.host_remote is not None and st.config.remote.write_through:
            # Each block's source is its host copy if it still has one, else its SSD copy
            # (put's room-making may have evicted an entry it published earlier).
            # Only blocks still the index's own: the SSD write above released the lock, and
            # a block deleted meanwhile must not reach Redis under a key no one holds.
            get = st.index.get
            self.moves.host_remote.demote([e for e in entries if not e.remote and e.resident
                                           and get(e.gkey) is e])

    def put(self, ns_id: bytes, keys: list[bytes], blocks: Sequence,
            parent: bytes | None, texts: list | None = None) -> CommitResult:
        """Bytes path: store blocks sent over the network (keys and parent checked by the
        store). Three phases: slots for the keys host lacks are allocated under the lock (dedup
        before copying), the bytes are copied in and hashed without it (the slots are this
        call's alone until published), and published under it again. `texts`: the blocks'
        KV-event texts, as commit's."""
        st = self.state
        room = self.moves.host_room
        with st.lock:
            st.check_open()
            size = st.namespace(ns_id).block_bytes
            for i, b in enumerate(blocks):
                if len(b) != size:
                    raise InvalidArgument(f"block {i} is {len(b)} bytes; this namespace's "
                                          f"blocks are {size} bytes")
            dups = 0
            todo: list[tuple[int, int]] = []        # (index into keys, slot)
            failed: BaseException | None = None
            done = len(keys)                        # keys stored or found: those before it
            for i, k in enumerate(keys):
                e = st.index.get(ns_id + k)
                if e is not None and e.host is not None:
                    st.policies["host"].touch(e.gkey)
                    st.counters["duplicate_blocks"] += 1
                    dups += 1
                    continue
                # Making room may release the lock while victims are demoted (another call may
                # store this key meanwhile: publish then dedups and the slot goes back).
                try:
                    room.make_room(aligned(size), ns_id)
                    todo.append((i, room.alloc(size, ns_id)))
                except BaseException as exc:   # full, or a demotion that failed: the
                    failed, done = exc, i       # blocks before this one are still stored
                    break
            sums: list[int] = []
            try:
                with st.unlocked():
                    for i, off in todo:
                        src = memoryview(blocks[i]).cast("B")
                        st.host.view(off, size)[:] = src
                        # The checksum is of the bytes sent, not of the slot: a client mapping
                        # the pool could change the slot meanwhile, and its hash would vouch
                        # for that.
                        sums.append(xxhash.xxh3_64_intdigest(src))
            except BaseException:
                for _, off in todo:          # nothing published yet: every slot goes back
                    st.host.free(off)
                raise
            if bytes(ns_id) not in st.namespaces:   # reclaimed while the lock was released (its id
                for _, off in todo:          # is its spec's: a re-registration may publish)
                    st.host.free(off)
                raise NotFound(f"namespace {bytes(ns_id).hex()} was reclaimed during this Put; "
                               "register it again")
            stored = 0
            published = []
            if texts and done:
                self._remember(bytes(ns_id), keys[:done], texts, {i for i, _ in todo})
            for (i, off), checksum in zip(todo, sums, strict=True):
                prev = parent if i == 0 else keys[i - 1]
                placed, e = self.publish(bytes(ns_id), keys[i], prev, off, size, checksum)
                if not placed:
                    st.host.free(off)
                    dups += 1
                    continue
                published.append(e)
                stored += 1
            if failed is not None:
                raise failed
            st.counters["bytes_client_to_host"] += stored * size
            self._note_put(bytes(ns_id), keys)
            self._write_through(published)
            return CommitResult(stored, dups)

    def _remember(self, ns_id: bytes, keys: list[bytes], texts: list, mine: set[int]) -> None:
        """Keep the texts of a put's blocks about to be published (mine) or already held in
        host or gpu (locked): the recorder keeps texts of such blocks only, and a duplicate
        found earlier may have been evicted while room was made without the lock."""
        idx = self.state.index
        keep = [i for i, k in enumerate(keys) if i in mine or (
            (e := idx.get(ns_id + k)) is not None and (e.host is not None or e.gpu is not None))]
        self.state.events.recorder.remember(ns_id, [keys[i] for i in keep],
                                            [texts[i] for i in keep])

    def end_lease(self, lease: Lease) -> None:
        """A write lease ended uncommitted (released, expired, refused): its slots go back."""
        for s in lease.slots:
            self.state.host.free(s.offset)
