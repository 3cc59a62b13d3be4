"""SSD eviction: blocks leave the SSD tier, for the remote tier where there is one, else for good.

Three phases, as every move: pick a batch of victims under the lock (out of the SSD policy,
marked `moving`); without the lock, copy the ones the remote tier lacks there (their SSD value
read back as it is: already encoded) and delete the whole batch from LMDB in one commit; settle
under the lock (the index forgets the SSD copies, blocks no tier holds any more are dropped).

Why the delete runs without the lock: LMDB has one writer, so a delete waits for any other
thread's commit (a demotion's `put_filled`, a flush's sync) to finish; held under the store
lock, that wait stalled every call of every client for up to seconds (bench/tail.py). One
commit per batch, not per block, also makes the delete itself short.

While a victim is in flight, its SSD copy is still indexed: a lookup counts it, and an acquire
that wants it waits for the flight to land (then finds it gone and misses). Bytes being written
to SSD by demotions without the lock count as used (`pending`), so concurrent demotions never
overfill the tier.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore_client.common.errors import ResourceExhausted

from ..index import Entry
from ..state import StoreState
from .common import Flight, corrupt_host_copy, pick_victims

if TYPE_CHECKING:
    from .host_remote import HostRemote

# Victims per batch: one LMDB commit each. The pick (out of the SSD policy, an index read per
# victim) runs under the store lock; at 256 it was the one place the lock was held past 50 ms
# under bench/tail.py's load (150-300 ms, behind the worst loads), so batches stay small.
BATCH_BLOCKS = 64


class SSDRoom:
    """Room in the SSD tier: its accounting of writes in flight, and eviction."""

    def __init__(self, state: StoreState, to_remote: HostRemote | None) -> None:
        self.state = state
        self.to_remote = to_remote
        self.pending = 0            # bytes demotions are writing without the lock

    def make_room(self, need: int) -> None:
        """Evict so `need` more bytes fit (locked; may release the lock for a batch): past the
        high watermark, down to the low. A batch that has just committed may count twice
        until it settles (in `used_bytes` and in `pending`), which only errs towards evicting
        early."""
        st = self.state
        ssd, cfg = st.ssd, st.config.ssd
        cap = ssd.capacity
        high = cfg.high_watermark * cap
        used = ssd.used_bytes + self.pending
        if used + need <= high:
            return
        target = max(0.0, min(cfg.low_watermark * cap, high - need))
        self.evict(int(used + need - target))
        used = ssd.used_bytes + self.pending
        if used + need > cap:
            raise ResourceExhausted(f"ssd tier full ({used} of {cap} bytes) and nothing is "
                                    "evictable")

    def evict(self, nbytes: int | None, only: set[bytes] | None = None) -> tuple[int, int]:
        """Evict SSD blocks until `nbytes` are freed (None: everything evictable); with `only`,
        blocks of those namespaces alone. Returns (bytes freed, blocks). Locked; releases the
        lock for each batch's transfer."""
        st = self.state
        index, remote = st.index, st.remote
        # Children the batch being picked takes out of the index, by parent: a parent whose
        # indexed children all go with the batch is a leaf once it settles, so it may go in
        # it too (one LMDB commit deletes both, or neither). Why: the policy's oldest leaf is
        # usually the tail of a prompt, and its parent, as old, becomes the oldest leaf once
        # the tail is picked; refused, every later pick of the batch searched the heap past
        # all such parents (quadratic in the batch: 20-50 ms of CPU under the store lock per
        # 64-block batch, the longest hold under bench/tail.py's load).
        leaving: dict[bytes, int] = {}

        def can(g: bytes) -> bool:
            e = index.get(g)
            # A block being promoted or demoted keeps its copies until its move settles; one
            # whose children are indexed may go only if another tier keeps a copy.
            return (e is not None and e.ssd and e.moving is None
                    and (remote is not None or e.remote or e.host is not None
                         or e.gpu is not None or e.children == leaving.get(g, 0))
                    and (only is None or e.ns_id in only))

        def present(e: Entry) -> bool:
            if not e.ssd:
                return False
            p = e.parent_gkey
            if p is not None and e.host is None and e.gpu is None and not e.remote:
                leaving[p] = leaving.get(p, 0) + 1      # SSD was its last copy
            return True
        freed = blocks = 0
        while nbytes is None or freed < nbytes:
            leaving.clear()
            batch = pick_victims(st.policies["ssd"], can, index.get, present,
                                 BATCH_BLOCKS, float("inf") if nbytes is None
                                 else nbytes - freed)
            if not batch:
                break
            f = self._evict_batch(batch)
            freed, blocks = freed + f, blocks + len(batch)
        return freed, blocks

    def _evict_batch(self, batch: list[Entry]) -> int:
        st = self.state
        flight = Flight(st, batch)
        try:
            written: list[tuple[Entry, int]] = []
            corrupt: list[bytes] = []
            if self.to_remote is not None:
                todo = [e for e in batch if not e.remote]
                if todo:
                    written, corrupt = self.to_remote.write(todo)
            with st.unlocked():
                freed = st.ssd.delete_sized([e.gkey for e in batch])
        except BaseException:
            policy = st.policies["ssd"]
            for e in batch:                 # as it was: evictable again
                if e.ssd:
                    policy.insert(e.gkey, e.parent_gkey, e.size)
            flight.land()
            raise
        if self.to_remote is not None:
            self.to_remote.settle(written)
        ssd_counters = st.tier_counters["ssd"]
        for e in batch:
            st.index.set_ssd(e, False)
            ssd_counters["evictions"] += 1
        flight.land()
        for g in corrupt:       # a host copy that failed its checksum on the way down
            corrupt_host_copy(st, g, "demotion")
        for e in batch:
            st.index.drop_if_gone(e)
        return max(freed, len(batch))       # at least a byte a block: eviction always ends

    def drop(self, entries: list[Entry]) -> None:
        """Delete copies found corrupt from SSD (locked; the delete runs without the lock, the
        blocks in flight meanwhile). Their index bit and policy entry go first: never served."""
        st = self.state
        entries = [e for e in entries if e.ssd]
        if not entries:
            return
        for e in entries:
            st.policies["ssd"].remove(e.gkey)
        flight = Flight(st, [e for e in entries if e.moving is None])
        try:
            with st.unlocked():
                st.ssd.delete_many([e.gkey for e in entries])
        finally:
            for e in entries:
                st.index.set_ssd(e, False)
            flight.land()
            for e in entries:
                st.index.drop_if_gone(e)
