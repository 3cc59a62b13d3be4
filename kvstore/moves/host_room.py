"""Host eviction: room in the host pool, made by moving victims down a tier.

Writers (Reserve, Put, a promotion's reservation, a gpu victim's host copy) ask for room here;
past the high watermark the caller evicts down to the low one itself, and above the low
watermark background threads (`kvstore-demoter-N`, DEMOTERS of them) evict so writers rarely
have to. Victims are picked from the host policy in batches of up to BATCH_BLOCKS blocks and
about BATCH_BYTES (each batch ends with one SSD write and one index commit, so the disk idles
between one thread's batches: large blocks want few, large batches; small blocks many per
batch; for large blocks an assistant fills the idle time with its own batch).

A batch moves in three phases: picked under the lock (out of the host policy, marked
`moving`, their bytes counted in `evicting` so concurrent callers do not evict again for the
same shortfall); written down without the lock (host_to_ssd.py, or host_remote.py without an
SSD tier; victims that already have a lower copy need no write); settled under the lock: each
victim's host slot is freed, except one a reader acquired meanwhile, which keeps its host copy
and goes back in the host policy (it now has a lower copy too). On an error every victim goes
back as it was and the error propagates; a full disk drops the victims instead (host must keep
serving).

Promotions first. An acquire that promotes a block from a lower tier is a load an engine is
waiting on, while a writer's Reserve is backpressure on a store; so the room above the high
watermark is the promotions' (`promotion_share`): a writer's slot must leave it free, a
promotion's may take it, and a promotion leaves eviction to the background demoter where one
runs (a load never writes a batch of writers' blocks down itself). A promotion short of room
first takes back the host copies earlier promotions made that no reader holds any more
(`_reclaim_promoted`): they still have their lower copy, so dropping them needs no write. A
victim that already has a lower copy is freed as it is picked, not when its batch's write
lands. When there is no room at all, a caller waits for the first demotion in flight to land
(not for all of them: each landing frees a batch, and waiting for the last one held a load
behind every writer's batch), within ROOM_WAIT_S.

Tenants with a host quota evict only their own blocks in their own segment (kvstore/pools.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from kvstore_client.common.errors import ResourceExhausted

from tiers.ssd import DiskFull

from ..index import Entry
from ..pools import TenantPools
from ..state import StoreState, aligned
from .common import Flight, corrupt_host_copy, pick_victims
from .host_remote import HostRemote
from .host_to_ssd import HostToSSD
from .room_waits import RoomWaits, RoomWant

log = logging.getLogger("kvstore.store")
BATCH_BLOCKS = 64
BATCH_BYTES = 32 << 20
DISK_FULL_LOG_S = 60.0      # a full disk is logged at most this often
ROOM_WAIT_S = 30.0          # the longest an allocation waits for demotions in flight to land
# Background demotion threads: a demoter, and an assistant that works beside it only while
# the blocks being demoted are large. Why the assistant: with large blocks a batch is mostly
# disk time, and with one thread the disk idled while it filled the next batch and between
# batches (fdatasync, index commit, settle, next pick); two keep a batch filling, or syncing
# and settling, while the other's runs are written (the SSD tier still writes one run at a
# time on its one writer thread). Why only then: with small blocks a batch is mostly the
# threads' own Python (picking, a call per block to copy and check it, settling), so the
# interpreter is the limit, and a second such thread only queues the request threads behind
# one more holder of the GIL. Under bench/tail.py (64 KiB blocks, 16 clients, 2 cores) one
# thread demoted about as many bytes, and the loads' p99 fell from about 4.1 to 3.7 ms and
# their worst from about 18 to 14 ms (medians of 10 and 9 alternated runs,
# docs/performance.md).
DEMOTERS = 2
ASSIST_MIN_BLOCK = 512 << 10    # the assistant works while demoted blocks average this or more
PROMOTED_KEPT = 1024        # promoted blocks remembered for a promotion short of room to drop
RECLAIM_LOOKS = 64          # of those, the most one allocation looks at


class HostRoom:
    def __init__(self, state: StoreState, pools: TenantPools, to_ssd: HostToSSD | None,
                 to_remote: HostRemote | None) -> None:
        self.state = state
        self.pools = pools
        self.to_ssd = to_ssd
        self.to_remote = to_remote
        self.evicting = 0           # host bytes eviction batches in flight will free
        # The flights of those batches, and a condition notified as each lands: a caller
        # waiting for room wakes when room may have come, not at every settle of any call.
        self._flights: set[threading.Event] = set()
        self._room = threading.Condition(state.lock)
        self._waiting = 0           # callers in _wait_landing
        self._waits = RoomWaits(state)   # of those, the writers a landing hands a slot
        # Evictors' runs going on (an _evict_batches call; a demoter from waking to sleeping):
        # a run may pick its next batch in the hold its landing is served in, so a writer
        # the landing leaves short sleeps on until the run ends (room_waits.py).
        self._runs = 0
        # Blocks promotions copied into the shared slab, oldest first (keys only: an Entry
        # held here would never go back to packed form).
        self._promoted: deque[bytes] = deque(maxlen=PROMOTED_KEPT)
        self._disk_full_logged = -1e9
        self._remote_drop_logged = -1e9
        # Background demotion: woken when host use passes the low watermark; the assistant
        # only while demoted blocks are large (their mean size, weighted to recent batches).
        self._wake = threading.Condition(state.lock)
        self._assist = threading.Condition(state.lock)
        self._block_bytes: float | None = None
        self._demoters: list[threading.Thread] = []

    # -- background demotion --------------------------------------------------------------------
    def start_background(self) -> None:
        """Start demoting in the background, if there is a tier to demote to and it is on."""
        st = self.state
        if (self._demoters or not st.config.host.background_demotion
                or (st.ssd is None and st.remote is None)):
            return
        for i in range(DEMOTERS):
            t = threading.Thread(target=self._demote_loop, args=(i > 0,),
                                 name=f"kvstore-demoter-{i}", daemon=True)
            self._demoters.append(t)
            t.start()

    def _demote_loop(self, assistant: bool) -> None:
        """Keep host use at or under the low watermark, so writers rarely evict inline.

        Why: demotion (encode + SSD write) ran on the Reserve that needed room, so a spilling
        engine stored 10-30 blocks/s and every other engine's lookups waited behind it. Here
        it runs in batches on its own thread, releasing the store lock for each batch's encode
        and write exactly as an inline eviction does; a writer evicts inline only when use
        would pass the high watermark anyway (counted as `reserve_waits`). The `assistant`
        runs only while demoted blocks are large (DEMOTERS).
        """
        st = self.state
        wake = self._assist if assistant else self._wake
        with st.lock:
            while not st.closed:
                if not assistant or self._large_blocks():
                    self._runs += 1         # one run: from waking until nothing is freed
                    try:
                        while not st.closed and self._demote_round():
                            pass
                    finally:
                        self._runs -= 1
                        self._serve_waits()
                if not st.closed:
                    wake.wait(0.25)

    def _large_blocks(self) -> bool:
        return self._block_bytes is not None and self._block_bytes >= ASSIST_MIN_BLOCK

    def _wake_demoters(self) -> None:
        """Host use passed the low watermark (locked)."""
        self._wake.notify()
        if self._large_blocks():
            self._assist.notify()

    def _demote_round(self) -> int:
        """One pass of background demotion over the segments (locked); the bytes freed."""
        st = self.state
        freed = 0
        # Each tenant's own pool is kept under its own watermark with its own blocks: one
        # tenant's writes never demote another's (kvstore/pools.py).
        for seg in range(self.pools.segment_count()):
            cap, used = self.pools.segment_room(seg)
            host = st.config.host
            over = used - (self.evicting if seg == 0 else 0) - host.low_watermark * cap
            if over <= 0:
                continue
            if seg == 0 and self._waiting:
                # Callers wait for room: the disk is the limit, and each batch pays its pick,
                # LMDB commit and settle once, so batches are whole (the room between the
                # watermarks), not the few blocks just over.
                over = max(over, (host.high_watermark - host.low_watermark) * cap)
            try:
                f, _ = self.evict(int(over), self.pools.segment_namespaces(seg))
                freed += f
                st.counters["background_demotion_bytes"] += f
            except Exception as exc:  # the next round retries; inline eviction remains
                st.counters["background_demotion_errors"] += 1
                log.warning("background demotion failed: %s", exc)
        return freed

    def close(self) -> None:
        """Let the demoters exit (the caller holds the lock and has set state.closed)."""
        self._wake.notify_all()
        self._assist.notify_all()

    # -- room and allocation --------------------------------------------------------------------
    def make_room(self, need: int, ns_id: bytes | None = None, promotion: bool = False) -> None:
        """Evict from host so `need` more bytes fit: past the high watermark, down to the low
        (locked; may release the lock while victims are written down). `alloc` then gets the
        slot even if other threads took the room meanwhile. A `promotion` leaves the eviction
        to the background demoter (woken here) where one runs: a load never writes a batch of
        writers' blocks down on its own path (`alloc` finds it a slot, or waits for one)."""
        seg = self.pools.segment_of(ns_id)
        cap, used = self.pools.segment_room(seg)
        host = self.state.config.host
        high, low = host.high_watermark * cap, host.low_watermark * cap
        used -= self.evicting if seg == 0 else 0
        if promotion and self._demoters:
            if used + need > low:
                self._wake_demoters()
            return
        if used + need > low and self._demoters:
            self._wake_demoters()        # the background demoters make room from here on
        if used + need <= high:
            return
        target = max(0.0, min(low, high - need))
        self.evict(int(used + need - target), self.pools.segment_namespaces(seg))

    def has_room(self, need: int, ns_id: bytes | None = None) -> bool:
        """Whether `need` more host bytes fit under the high watermark without evicting."""
        seg = self.pools.segment_of(ns_id)
        cap, used = self.pools.segment_room(seg)
        used -= self.evicting if seg == 0 else 0
        return used + need <= self.state.config.host.high_watermark * cap

    def must_evict_inline(self, need: int) -> bool:
        """Whether making room for `need` more host bytes means evicting on the caller's
        thread now (background demotion has not kept up); a Reserve then waits."""
        host = self.state.host
        used = host.used_bytes - self.evicting
        return used + need > self.state.config.host.high_watermark * host.capacity

    def promotion_share(self, seg: int) -> int:
        """Bytes of the shared slab only promotions may take: the room above the high
        watermark (0 in a tenant's own segment, where the tenant's writes and loads share)."""
        if seg:
            return 0
        cap, _ = self.pools.segment_room(0)
        return int((1.0 - self.state.config.host.high_watermark) * cap)

    def _take(self, nbytes: int, seg: int, share: int) -> int | None:
        """A slot of `nbytes` that leaves `share` bytes free, or None (locked)."""
        host = self.state.host
        if share:
            cap, used = self.pools.segment_room(seg)
            if used + aligned(nbytes) + share > cap:
                return None
        try:
            return host.alloc(nbytes, seg) if seg else host.alloc(nbytes)
        except ResourceExhausted:
            return None

    def alloc(self, nbytes: int, ns_id: bytes | None = None, promotion: bool = False,
              wait: bool = True, count: int = 1, extra: list[int] | None = None) -> int:
        """A host slot of `nbytes`, evicting until one fits (locked; may release the lock).

        Other threads may take the room an eviction made while the lock was released, so this
        loops: evict what is missing, or wait for the first of the demotions in flight to
        land, and try again; ResourceExhausted when nothing is evictable and nothing is in
        flight, or after ROOM_WAIT_S. A writer's slot leaves the promotions' share free
        (`promotion_share`) unless nothing else is left; `promotion` may take it. Without
        `wait`, only a slot that is free now (a Reserve ahead of a store that may not come
        neither evicts nor waits). A caller that wants `count` slots in all and passes
        `extra` may be handed more than one by a landing: the rest are appended to `extra`.
        """
        st = self.state
        seg = self.pools.segment_of(ns_id)
        share = 0 if promotion else self.promotion_share(seg)
        need = aligned(nbytes)
        deadline = time.monotonic() + ROOM_WAIT_S
        waited: float | None = None     # when no slot was free at once
        try:
            while True:
                off = self._take(nbytes, seg, share)
                if off is not None:
                    return off
                if waited is None:
                    waited = time.perf_counter()
                if not wait:
                    raise ResourceExhausted(f"no free host room for {nbytes} bytes now")
                if promotion and not seg and self._reclaim_promoted(need):
                    continue
                short = self._short(seg, need, share)   # what is missing, the share kept
                if not seg and self.evicting >= short:
                    # Batches in flight free enough: no second writer on the disk. The landing
                    # hands this caller its slot (room_waits.py).
                    want = RoomWant(nbytes, share, promotion, count if extra is not None else 1)
                    if self._wait_landing(deadline, want):
                        if want.offs:
                            if extra is not None:
                                extra += want.offs[1:]
                            return want.offs[0]
                        continue
                _, _, picked = self._evict_batches(short, self.pools.segment_namespaces(seg))
                if picked or self._wait_landing(deadline):
                    continue
                off = self._take(nbytes, seg, 0)     # the share too: this is the real limit
                if off is not None:
                    return off
                if seg:
                    raise self.pools.segment_full(seg) from None
                host = st.host
                # Watermarks are a target, not a guarantee; this is the real limit.
                raise ResourceExhausted(
                    f"host tier full: {host.used_bytes} of {host.capacity} bytes are "
                    "leased or pinned and nothing is evictable; release leases or raise "
                    "host.capacity") from None
        finally:
            if promotion and waited is not None:
                # A load short of room: the wait an engine sees, counted apart from the
                # writers' backpressure (reserve_waits).
                st.counters["promotion_room_waits"] += 1
                st.counters["promotion_room_wait_seconds"] += time.perf_counter() - waited

    def alloc_many(self, nbytes: int, n: int, ns_id: bytes | None = None,
                   wait: bool = True) -> list[int]:
        """n writer's slots of `nbytes`, as n alloc() calls would take them (locked; may
        release the lock). Why: a Reserve of a batch paid alloc's checks per slot; when the
        batch fits free room now (the steady state: the previous batch's slots were freed),
        they are taken in one call; otherwise slot by slot, evicting or waiting as alloc."""
        seg = self.pools.segment_of(ns_id)
        share = self.promotion_share(seg)
        fits = True
        if share:
            cap, used = self.pools.segment_room(seg)
            fits = used + n * aligned(nbytes) + share <= cap
        host = self.state.host
        if fits:
            try:
                return host.alloc_many(nbytes, n, seg) if seg else host.alloc_many(nbytes, n)
            except ResourceExhausted:
                pass                    # fragmented: alloc below coalesces, evicts, waits
        offsets: list[int] = []
        try:
            while len(offsets) < n:
                more: list[int] = []
                offsets.append(self.alloc(nbytes, ns_id, wait=wait, count=n - len(offsets),
                                          extra=more))
                offsets += more
        except BaseException:           # full, or a demotion that failed
            for off in offsets:
                host.free(off)
            raise
        return offsets

    def note_promoted(self, gkey: bytes, seg: int) -> None:
        """A promotion published a host copy of `gkey` in segment `seg` (locked)."""
        if not seg:
            self._promoted.append(gkey)

    def _reclaim_promoted(self, need: int) -> bool:
        """Drop the host copies of earlier promotions until `need` bytes are free (locked):
        oldest first, only those no reader pins, not in flight and still holding a lower copy
        (so no write is needed and nothing is lost). A block still pinned is remembered
        again. At most RECLAIM_LOOKS looks: the cost under the lock stays bounded. True when
        anything was freed."""
        st = self.state
        index, policy, host = st.index, st.policies["host"], st.host
        freed = blocks = 0
        pinned: list[bytes] = []
        for _ in range(min(RECLAIM_LOOKS, len(self._promoted))):
            if host.capacity - host.used_bytes >= need:
                break
            g = self._promoted.popleft()
            e = index.peek(g)
            if e is None or e.host is None or e.moving is not None or not (e.ssd or e.remote):
                continue                    # gone from host already, or no lower copy
            if e.pins:
                pinned.append(g)
                continue
            policy.remove(g)
            host.free(e.host)
            index.clear_host(e)
            freed += aligned(e.size)
            blocks += 1
        self._promoted.extend(pinned)
        if freed:
            st.tier_counters["host"]["evictions"] += blocks
            st.counters["promotion_reclaimed_bytes"] += freed
        return freed > 0

    def _short(self, seg: int, need: int, share: int) -> int:
        """Bytes missing for a slot of `need` that leaves `share` free (locked)."""
        if not share:
            return need
        cap, used = self.pools.segment_room(seg)
        return max(need, used + need + share - cap)

    def _wait_landing(self, deadline: float, want: RoomWant | None = None) -> bool:
        """Wait (releasing the lock) until one of the demotions now in flight has landed;
        False when none was. With `want`, until a landing hands it a slot or wakes it
        (room_waits.py). ResourceExhausted past `deadline`. The caller counts as busy
        meanwhile, so close() waits for it to finish its call."""
        st = self.state
        pending = list(self._flights)
        if not pending:
            return False
        st.busy += 1
        self._waiting += 1
        try:
            if want is not None:
                if not self._waits.wait(want, pending, lambda: deadline - time.monotonic()):
                    self._timed_out()
                return True
            while not any(ev.is_set() for ev in pending):
                left = deadline - time.monotonic()
                if left <= 0:
                    self._timed_out()
                self._room.wait(left)
        finally:
            self._waiting -= 1
            st.busy -= 1
            st.idle.notify_all()
        return True

    def _timed_out(self) -> None:
        self.state.counters["host_room_wait_timeouts"] += 1
        raise ResourceExhausted(f"no host room after {ROOM_WAIT_S:g} s waiting for demotions "
                                "to SSD to land; the disk is slower than the writes")

    def _serve_waits(self) -> None:
        """A flight landed or a run ended (locked): hand the writers waiting for room their
        slots."""
        self._waits.serve(
            lambda w: self._take(w.nbytes, 0, w.share),
            lambda w: self.evicting >= self._short(0, aligned(w.nbytes), w.share),
            self._flights, self._runs > 0)

    # -- eviction ---------------------------------------------------------------------------------
    def evict(self, nbytes: int | None, only: set[bytes] | None = None,
              deadline: float | None = None) -> tuple[int, int]:
        """Evict host blocks until `nbytes` are freed (None: all evictable), in batches; with
        `only`, blocks of those namespaces alone (a tenant's own Evict, its quota). Returns
        (bytes freed, blocks freed). Locked; releases the lock for each batch's transfer.
        `deadline` (time.monotonic()): no batch starts past it (an Evict call: writers that
        outrun the disk would keep it finding victims for good)."""
        freed, blocks, _ = self._evict_batches(nbytes, only, deadline)
        return freed, blocks

    def _evict_batches(self, nbytes: int | None, only: set[bytes] | None = None,
                       deadline: float | None = None) -> tuple[int, int, int]:
        """evict, also returning how many victims were picked (a victim a reader pinned while
        it was demoted keeps its host copy: picked, but not freed)."""
        st = self.state
        index = st.index
        lower = st.ssd is not None or st.remote is not None

        def can(g: bytes) -> bool:
            # A block whose children are indexed may only go if a lower tier keeps a copy,
            # or its children would become unreachable. A block in flight (being demoted by
            # another eviction, or promoted) is not a victim.
            e = index.get(g)
            return (e is not None and e.pins == 0 and e.host is not None and e.moving is None
                    and (lower or e.ssd or e.remote or e.gpu is not None or e.children == 0)
                    and (only is None or e.ns_id in only))
        freed = blocks = picked = planned = 0
        self._runs += 1
        try:
            while nbytes is None or planned < nbytes:
                if deadline is not None and time.monotonic() >= deadline:
                    break
                room = BATCH_BYTES if nbytes is None else min(BATCH_BYTES, nbytes - planned)
                batch = pick_victims(st.policies["host"], can, index.get,
                                     lambda e: e.host is not None, BATCH_BLOCKS, room)
                if not batch:
                    break
                picked += len(batch)
                planned += sum(aligned(e.size) for e in batch)
                f, b = self._evict_batch(batch)
                freed, blocks = freed + f, blocks + b
        finally:
            self._runs -= 1
            self._serve_waits()             # the writers left waiting for this run's batches
        return freed, blocks, picked

    def _evict_batch(self, batch: list[Entry]) -> tuple[int, int]:
        """Write a batch of victims down and free their host slots; (bytes, blocks) freed.

        Victims without a lower copy are written without the store lock: they are marked
        `moving` first, so no delete, eviction or promotion touches them, and their host
        copies (immutable once published, the slots not freed until settle) stay readable and
        acquirable meanwhile.
        """
        st = self.state
        if self.to_ssd is not None:
            todo = [e for e in batch if not e.ssd]
        elif self.to_remote is not None:
            todo = [e for e in batch if not e.remote]
        else:
            todo = []
        if len(todo) < len(batch):
            # Victims with a lower copy need no write: their room is free now, not once the
            # batch's write lands (a promotion waiting for room gets it without the disk).
            busy = {id(e) for e in todo}
            freed, blocks = self._free_victims([e for e in batch if id(e) not in busy])
            batch = todo
        else:
            freed = blocks = 0
        if not todo:
            return freed, blocks
        flight = Flight(st, batch)
        size = sum(aligned(e.size) for e in batch)
        mean = size / len(batch)
        self._block_bytes = mean if self._block_bytes is None else (
            0.75 * self._block_bytes + 0.25 * mean)
        self.evicting += size
        st.demotions.add(flight.event)
        self._flights.add(flight.event)
        corrupt: list[bytes] = []
        try:
            if self.to_ssd is not None:
                try:
                    written, corrupt = self.to_ssd.write(todo, strict=False)
                except DiskFull as exc:
                    written = self._disk_full(batch, exc)
            else:
                written, corrupt = self.to_remote.write(todo)
        except BaseException:
            policy = st.policies["host"]
            for e in batch:                  # as it was: the host copy stays, evictable again
                policy.insert(e.gkey, e.parent_gkey, e.size)
            self._landed(flight, size)
            raise
        try:
            for e in batch:
                flight.clear(e)
            if self.to_ssd is not None:
                self.to_ssd.settle(written)
            else:
                self.to_remote.settle(written)
                self._remote_dropped(todo, corrupt)
            for g in corrupt:
                corrupt_host_copy(st, g, "demotion")
            f, b = self._free_victims(batch)
            return freed + f, blocks + b
        finally:
            self._landed(flight, size)

    def _landed(self, flight: Flight, size: int) -> None:
        self.evicting -= size
        self.state.demotions.discard(flight.event)
        self._flights.discard(flight.event)
        flight.land()
        self._room.notify_all()
        self._serve_waits()

    def _disk_full(self, batch: list[Entry], exc: DiskFull) -> list:
        """The SSD write of an eviction batch did not land (filesystem full): the victims
        without a lower copy are dropped rather than kept, so host keeps serving (a full disk
        must not stop every write and every promotion that needs room). Counted; logged at most
        once a minute, not once per batch."""
        st = self.state
        lost = sum(1 for e in batch if not e.ssd and not e.remote and not e.pins)
        st.counters["ssd_disk_full_errors"] += 1
        st.counters["ssd_disk_full_dropped_blocks"] += lost
        now = time.monotonic()
        if now - self._disk_full_logged > DISK_FULL_LOG_S:
            self._disk_full_logged = now
            log.warning("%s; dropping %d evicted host blocks instead of demoting them (logged "
                        "once a minute; counter ssd_disk_full_dropped_blocks)", exc, lost)
        return []

    def _remote_dropped(self, todo: list[Entry], corrupt: list[bytes]) -> None:
        """After an eviction's remote write (locked): the victims it did not land (Redis down
        or full, the tier's capacity or a tenant's remote quota reached) are about to be
        dropped, as a full disk's are (_disk_full) and for the same reason. Counted; logged
        at most once a minute."""
        bad = set(corrupt)
        lost = sum(1 for e in todo if not e.remote and not e.pins and e.gpu is None
                   and e.host is not None and e.gkey not in bad)
        if not lost:
            return
        st = self.state
        st.counters["remote_dropped_blocks"] += lost
        now = time.monotonic()
        if now - self._remote_drop_logged > DISK_FULL_LOG_S:
            self._remote_drop_logged = now
            log.warning("the remote tier did not take %d evicted host blocks (Redis down or "
                        "full, remote.capacity or a tenant's remote_quota reached; last Redis "
                        "error: %s); dropping them instead (logged once a minute; counter "
                        "remote_dropped_blocks)", lost,
                        st.remote.stats.get("last_error") or "none")

    def _free_victims(self, batch: list[Entry]) -> tuple[int, int]:
        """Phase 3 of an eviction (locked): free the victims' host slots. A victim a reader
        acquired while it was demoted keeps its host copy (it now has a lower copy too)."""
        st = self.state
        freed = blocks = 0
        for e in batch:
            if e.host is None:
                continue                     # a corrupt copy, dropped when it was encoded
            if e.pins:
                st.policies["host"].insert(e.gkey, e.parent_gkey, e.size)
                st.counters["demotions_kept_pinned"] += 1
                continue
            st.host.free(e.host)
            st.index.clear_host(e)
            st.index.drop_if_gone(e)
            freed += aligned(e.size)
            blocks += 1
        st.tier_counters["host"]["evictions"] += blocks
        return freed, blocks
