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
              only: set[bytes] | None = None) -> int:
        """Demote every block only host (of the namespaces `only` names) or a device holds to
        SSD and sync (locked; released for each batch and for the sync); returns the blocks
        written. `budget_s` and `progress`: HostToSSD.flush (gpu-only blocks go down only when
        the host ones all did)."""
        st = self.state
        if self.host_to_ssd is None:
            return 0
        start = time.monotonic()
        done, nbytes, finished, total = self.host_to_ssd.flush(budget_s, progress, only)
        if finished and self.gpu_to_ssd is not None:
            done += self.gpu_to_ssd.flush()
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

    def close(self) -> None:
        """Stop the demoter and the worker pools (after the store has let every call settle;
        the caller holds the lock)."""
        self.host_room.close()
        self.workers.close()
        if self.host_remote is not None:
            self.host_remote.close()
