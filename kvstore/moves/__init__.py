"""How blocks move between tiers: one module per tier edge, each in the same three phases.

Every move runs in three phases, the store lock's protocol (docs/internals.md, "Locking"):
1. pick, under the lock: choose the blocks, mark each `moving` (kvstore/moves/common.py,
   `Flight`), reserve the slots the bytes will land in;
2. transfer, without the lock: read, encode or decode, verify, write; nothing else touches a
   block in flight (no delete, eviction, other move or promotion), so no byte of I/O waits
   for the lock or makes another call wait for it;
3. settle, under the lock: publish what landed in the index and the policies, give back what
   did not, clear the marks.

| edge | module | when |
| --- | --- | --- |
| host -> SSD | host_to_ssd.py | host eviction, flush, write-through: the one way blocks reach SSD |
| SSD -> host | ssd_to_host.py | an acquire promotes a block only SSD holds (promotion.py) |
| host <-> remote | host_remote.py | eviction without SSD, write-through, SSD eviction; acquire |
| gpu <-> host | gpu_host.py | eviction from a device; Acquire on the gpu tier |
| gpu -> SSD | gpu_to_ssd.py | flush of blocks only a device holds |

Room in a tier is made by evicting: host_room.py (host victims go down to SSD, or the remote
tier without one), ssd_room.py (SSD victims go to the remote tier, or away), gpu_host.py
(device victims go to host). promotion.py reserves and settles every promotion into host,
whatever its source; encoding.py encodes and decodes blocks for the keyed tiers.

One name per act: *evict* makes room in a tier by taking victims out of it; *demote* copies a
block down a tier (eviction demotes its victims that have no lower copy yet, flush and
write-through demote without evicting); *promote* copies a block up a tier for an acquire;
*flush* demotes every block only host or a device holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..index import Entry
from ..pools import TenantPools
from ..state import StoreState
from .common import Flight, Workers, corrupt_host_copy
from .encoding import Encoder
from .gpu_host import GpuHost
from .gpu_to_ssd import GpuToSSD
from .host_remote import HostRemote
from .host_room import HostRoom
from .host_to_ssd import HostToSSD
from .promotion import Promoter
from .ssd_room import SSDRoom
from .ssd_to_host import SSDToHost


class Moves:
    """Every mover, built once the tiers are open, each given the state and the movers it
    uses (no mover reaches into another)."""

    def __init__(self, state: StoreState, pools: TenantPools) -> None:
        self.state = state
        self.workers = Workers(state)
        self.encoder = Encoder(state, self.workers)
        self.host_remote = HostRemote(state, pools, self.encoder) if state.remote else None
        self.ssd_room = SSDRoom(state, self.host_remote) if state.ssd is not None else None
        self.host_to_ssd = (HostToSSD(state, pools, self.ssd_room, self.encoder, self.workers)
                            if self.ssd_room is not None else None)
        self.host_room = HostRoom(state, pools, self.host_to_ssd, self.host_remote)
        self.gpu_host = GpuHost(state, pools, self.host_room) if state.gpu else None
        self.gpu_to_ssd = (GpuToSSD(state, self.gpu_host, self.host_to_ssd, self.encoder)
                           if self.gpu_host is not None and self.host_to_ssd is not None
                           else None)
        self.ssd_to_host = SSDToHost(state) if state.ssd is not None else None
        self.promoter = Promoter(state, self.workers, self.host_room, self.ssd_room,
                                 self.ssd_to_host, self.host_remote, self.gpu_host)

    def flush(self, budget_s: float | None = None,
              progress: Callable[[str], None] | None = None,
              only: set[bytes] | None = None, deadline: float | None = None,
              cancelled: Callable[[], bool] | None = None) -> int:
        """Demote every block only host (of the namespaces `only` names) or a device holds to
        SSD and sync (locked; released for each batch and for the sync); returns the blocks
        written. `budget_s` and `progress` (a stop's flush): HostToSSD.flush (gpu-only blocks
        go down only when the host ones all did).

        Otherwise (a call's flush): the host-only blocks there are now, those another move has
        in flight included (a background demotion's batch). Their flights are waited for, and
        their blocks written here if the move did not land them on SSD; blocks stored
        meanwhile are not this flush's, so a steady writer cannot keep it from ending (it used
        to wait for a moment with no demotion in flight, which such a writer never gave).
        `deadline` (time.monotonic()): past it, DeadlineExceeded; `cancelled()` true (the
        client went away): CallCancelled. Either way what was written stays on SSD, not yet
        synced (the next flush, or the stop, syncs it).

        Blocks of a namespace whose record is not on SSD yet (StoreState.unpersisted) are left
        out: a restart would not know the namespace (Store.flush writes the record first)."""
        from kvstore_client.common.errors import DeadlineExceeded

        from ..state import CallCancelled
        from .host_to_ssd import FLUSH_BATCH

        st = self.state
        if self.host_to_ssd is None:
            return 0
        if st.unpersisted:
            only = (set(st.namespaces) if only is None else set(only)) - st.unpersisted.keys()
        start = time.monotonic()
        if budget_s is not None or progress is not None:
            done, nbytes, finished, total = self.host_to_ssd.flush(budget_s, progress, only)
        else:
            index = st.index
            todo = [e for e in index.hot_entries() if e.host is not None and not e.ssd
                    and (only is None or e.ns_id in only)]
            done = nbytes = 0
            total, finished = len(todo), True
            tried: set[int] = set()         # blocks this flush handed to a demotion

            def host_only(e: Entry) -> bool:        # (not deleted meanwhile)
                return e.host is not None and not e.ssd and index.get(e.gkey) is e

            def ended(why: str) -> str:
                return (f"Flush ended after {time.monotonic() - start:.1f} s: {why}; {done} "
                        f"of the {total} host-only blocks it set out to write were written to "
                        "SSD (not yet synced); call Flush again for the rest")

            def check() -> None:
                if cancelled is not None and cancelled():
                    raise CallCancelled(ended("the client went away"))
                if deadline is not None and time.monotonic() >= deadline:
                    raise DeadlineExceeded(ended("it passed its deadline"))
            while True:
                ready = [e for e in todo if id(e) not in tried and host_only(e)
                         and e.moving is None]
                for i in range(0, len(ready), FLUSH_BATCH):
                    check()
                    batch = [e for e in ready[i:i + FLUSH_BATCH]
                             if host_only(e) and e.moving is None]
                    tried.update(id(e) for e in batch)
                    done += self.host_to_ssd.demote(batch)
                todo = [e for e in todo if host_only(e)]
                flights = {e.moving for e in todo if e.moving is not None}
                if not flights and all(id(e) in tried for e in todo):
                    break
                check()
                try:
                    st.wait_flights(flights, deadline, cancelled)
                except (DeadlineExceeded, CallCancelled):
                    check()
                    raise
        if finished and self.gpu_to_ssd is not None:
            done += self.gpu_to_ssd.flush(only, deadline, cancelled, written=done)
        snapshot = st.policies["ssd"].snapshot()
        with st.unlocked():
            st.ssd.put_state("policy.ssd", snapshot)
            st.ssd.sync()
        if progress is not None and total:
            progress(f"flushed {done} blocks ({nbytes / 1e9:.3f} GB) in "
                     f"{time.monotonic() - start:.3f} s")
        return done

    def delete(self, gkeys: list[bytes]) -> int:
        """Delete blocks from every tier (locked); returns the blocks deleted. A block leased,
        or in flight, is skipped: it goes when evicted later. Copies in memory go at once;
        lower copies are deleted without the lock, the blocks in flight meanwhile (a put of
        the same key may give one a host copy again: it then stays, with that copy)."""
        st = self.state
        index = st.index
        n = 0
        lower: list[Entry] = []
        for g in gkeys:
            e = index.get(g)
            if e is None or e.pins or e.gpu_pins or e.moving is not None:
                continue
            n += 1
            if self.gpu_host is not None:
                self.gpu_host.drop_copy(e)
            if not (e.ssd or e.remote):
                if e.host is not None:
                    st.host.free(e.host)
                    st.policies["host"].remove(g)
                    # The Entry leaves the index naming no slot: a caller still holding it (a
                    # flush's list) must not take it for a host copy and write the freed slot.
                    index.clear_host(e)
                index.discard(g)
                continue
            if e.host is not None:
                st.host.free(e.host)
                st.policies["host"].remove(g)
                index.clear_host(e)
            if e.ssd:
                st.policies["ssd"].remove(g)
            lower.append(e)
        if lower:
            flight = Flight(st, lower)
            try:
                with st.unlocked():
                    on_ssd = [e.gkey for e in lower if e.ssd]
                    if on_ssd:
                        st.ssd.delete_many(on_ssd)
                    remote = [e.gkey for e in lower if e.remote]
                if remote and self.host_remote is not None:
                    self.host_remote.delete(remote)     # (keeps what Redis did not answer)
            finally:
                for e in lower:
                    index.set_ssd(e, False)
                    index.set_remote(e, False)
                flight.land()
                for e in lower:
                    index.drop_if_gone(e)
        st.counters["deleted_blocks"] += n
        return n

    def corrupt_host_copy(self, gkey: bytes, path: str) -> None:
        """Count and drop a host copy found not to match its commit checksum (locked)."""
        corrupt_host_copy(self.state, gkey, path)

    def start_background(self) -> None:
        self.host_room.start_background()
        if self.host_remote is not None:
            self.host_remote.pending.start()

    def close(self) -> None:
        """Stop the demoter and the worker pools (after the store has let every call settle;
        the caller holds the lock)."""
        self.host_room.close()
        self.workers.close()
        if self.host_remote is not None:
            self.host_remote.close()
