"""Promotion into host: a block a lower tier holds gets a host copy for an acquire.

One round of an acquire (kvstore/host_reads.py) promotes its blocks in the three phases every
move has. Reserve (locked): mark the block `moving` and allocate its host slot, making room
first. Fill (no lock): read the lower copy and decode and verify it into the slot, in parallel
on the worker pool; each source has its own edge module: SSD (ssd_to_host.py, adjacent extents
read together), remote (host_remote.py, values the acquire prefetched) and a device
(gpu_host.py, exact bytes copied down). Settle (locked): publish the slot as the block's host
copy, or give it back; a copy that does not decode or verify is dropped from its tier, never
served.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import xxhash
from kvstore_client.common.errors import DataLoss
from kvstore_client.common.layout import KVLayout
from kvstore_client.common.lazy import lazy_module

from tiers import frame

from ..index import Entry
from ..state import NamespaceInfo, StoreState, aligned
from .common import GONE, Workers
from .encoding import LOSSY, decode_block

if TYPE_CHECKING:
    import numpy as np

    from .gpu_host import GpuHost
    from .host_remote import HostRemote
    from .host_room import HostRoom
    from .ssd_room import SSDRoom
    from .ssd_to_host import SSDToHost
else:
    np = lazy_module("numpy", globals(), "np")

log = logging.getLogger("kvstore.store")
SSD_READ_CHUNK = 8 << 20     # promotion reads about this many adjacent SSD bytes per task


@dataclass(slots=True, eq=False)
class Promotion:
    """One block an acquire promotes: reserved under the lock, filled without it, settled
    under it again."""
    entry: Entry
    offset: int                     # the reserved host slot; nothing else writes or frees it
    checksum: int                   # the entry's checksum when reserved: what the copy must match
    codec: str                      # the namespace's codec: the only lossy one its copies may use
    ssd: bool                       # read the SSD copy (else the remote one)
    remote_value: object = None     # the remote prefetch: the source, or SSD's fallback
    # Verdicts, written by the fill outside the lock and applied by settle:
    source: str | None = None       # where the bytes came from; None: no copy was found
    error: DataLoss | None = None   # the copy did not decode or verify
    lossy: bool = False
    new_checksum: int = 0           # the slot's checksum, where the entry needs a new one
    nbytes: int = 0                 # encoded bytes read
    ssd_missed: bool = False        # the index said SSD but LMDB had no value
    gpu: bool = False               # copy the gpu copy down (gpu_host.py)
    note: bytes = b""               # a remote value's note: the block's KV-event text


def decode_into(host: Any, p: Promotion, value: object, layout: KVLayout) -> None:
    """Decode a framed value (or a verified (codec, raw_len, payload) triple) into the
    promotion's reserved slot and verify it; the verdict is left on `p` (no lock needed: the
    slot is the promotion's alone)."""
    p.nbytes = len(value[2]) if isinstance(value, tuple) else len(value)
    out = host.view(p.offset, p.entry.size)
    try:
        if isinstance(value, tuple):
            codec = value[0]
            sealed = value[3] if len(value) > 3 else 0      # a remote value's seal
            p.note = value[4] if len(value) > 4 else b""
            if sealed and p.checksum and sealed != p.checksum:
                raise DataLoss("the remote value was sealed with another commit checksum "
                               "than this block's")
            if sealed and not p.checksum and codec not in LOSSY:
                p.checksum = p.new_checksum = sealed    # checked by the decode below
        else:
            value = frame.unframe(value)        # (checks the payload's hash)
            codec = value[0]
        if codec in LOSSY and codec != p.codec:
            # A lossy copy skips the commit checksum below, so a frame naming a codec the
            # namespace never chose (another node's or build's value under our key in a shared
            # Redis) would be served unchecked. The codec is part of the namespace's id, so no
            # writer of this namespace ever made such a copy.
            raise DataLoss(f"stored block is {codec}-encoded; its namespace stores {p.codec}")
        if p.checksum and codec not in LOSSY:
            decode_block(value, layout, out, p.checksum)
            return                      # verified against the committed checksum
        # The block's checksum is to be taken now: after a lossy decode the slot holds
        # dequantized bytes, and a block known only from Redis has none yet. It is taken of a
        # private copy of what was decoded (verified by the frame's hash), never of the slot,
        # which clients map writable: a hash of the slot would vouch for whatever was written
        # there meanwhile.
        own = np.empty(p.entry.size, np.uint8)
        p.lossy = decode_block(value, layout, own, p.checksum) in LOSSY
    except DataLoss as exc:
        p.error = exc
        return
    p.new_checksum = xxhash.xxh3_64_intdigest(own)
    out[:] = own


class Promoter:
    """Reserves, fills and settles promotions into host for the acquire rounds."""

    def __init__(self, state: StoreState, workers: Workers, host_room: HostRoom,
                 ssd_room: SSDRoom | None, from_ssd: SSDToHost | None,
                 remote: HostRemote | None, gpu: GpuHost | None) -> None:
        self.state = state
        self.workers = workers
        self.host_room = host_room
        self.ssd_room = ssd_room
        self.from_ssd = from_ssd
        self.remote = remote
        self.gpu = gpu

    def reserve(self, e: Entry, remote_values: dict, flight: threading.Event
                ) -> Promotion | None:
        """Phase 1 (locked): mark a block a lower tier holds in flight and reserve its host slot.

        None when no lower copy is known (the block is a miss). The mark goes on before room is
        made: eviction run by make_room may reach the SSD tier, and must not take this copy.
        """
        index = self.state.index
        remote_value = remote_values.get(e.gkey) if e.remote else None
        from_gpu = e.gpu is not None    # exact bytes, and faster than any lower tier
        if not e.ssd and not from_gpu and (remote_value is None or remote_value is GONE):
            if remote_value is None and e.remote:
                # unreachable or late: a miss now, the copy (and its checksum) still known
                self.state.counters["remote_read_failed_blocks"] += 1
                return None
            index.set_remote(e, False)      # Redis answered it has no (good) copy any more
            index.drop_if_gone(e)
            return None
        if remote_value is GONE:
            remote_value = None
            index.set_remote(e, False)
        e.moving = flight
        try:
            self.host_room.make_room(aligned(e.size), e.ns_id, promotion=True)
            off = self.host_room.alloc(e.size, e.ns_id, promotion=True)
        except BaseException:
            e.moving = None
            raise
        codec = self.state.namespaces[e.ns_id].spec.codec
        return Promotion(e, off, e.checksum, codec, e.ssd and not from_gpu, remote_value,
                         gpu=from_gpu)

    def fill(self, info: NamespaceInfo, jobs: list[Promotion]) -> None:
        """Phase 2 (no lock held): read each block's lower copy and decode and verify it into
        its reserved slot, in parallel (LMDB reads, zstd, torch and numpy copies release the
        GIL). Touches only the jobs, their slots and the thread-safe tiers; every verdict is
        left on the job for settle."""
        layout = info.spec.layout
        tasks: list[tuple[str, Any]] = []
        chunk: list[Promotion] = []
        for p in jobs:
            if p.ssd and not p.gpu:
                if chunk and sum(q.entry.size for q in chunk) + p.entry.size > SSD_READ_CHUNK:
                    tasks.append(("ssd", chunk))
                    chunk = []
                chunk.append(p)
            else:
                tasks.append(("gpu" if p.gpu else "remote", p))
        if chunk:
            tasks.append(("ssd", chunk))

        def one(task: tuple[str, Any]) -> None:
            kind, x = task
            if kind == "ssd":
                self.from_ssd.fill(x, layout, self.fill_remote)
            elif kind == "gpu":
                self.gpu.fill_down(x)
            else:
                self.fill_remote(x, layout)
        self.workers.parallel(one, tasks)

    def fill_remote(self, p: Promotion, layout: KVLayout) -> None:
        """The remote prefetch as the source (none: no copy found)."""
        if p.remote_value is not None:
            p.source = "remote"
            decode_into(self.state.host, p, p.remote_value, layout)

    def settle(self, p: Promotion, dropped: list[tuple[str, Entry]]) -> bool:
        """Phase 3 (locked): publish a filled slot as the block's host copy, or give it back.

        True when the block may be served from host; a copy that failed to decode or verify is
        dropped from its tier and is a counted miss, never served: it leaves the index and
        policy here, and its bytes are deleted by `delete_dropped` once the round has settled
        (`dropped` collects them).
        """
        st = self.state
        e = p.entry
        e.moving = None
        if p.ssd_missed and not st.ssd.contains(e.gkey):
            # Gone from LMDB under us: off the policy too, or it stays there, never picked
            # (nothing to evict), until its row is freed.
            st.policies["ssd"].remove(e.gkey)
            st.index.set_ssd(e, False)
        if p.source is None:
            st.host.free(p.offset)
            st.index.drop_if_gone(e)
            return e.host is not None
        if p.error is not None:
            self._drop_corrupt(e, p.offset, p.source, p.error, dropped)
            return False
        if e.host is not None:
            # A put or commit stored this key while we decoded: keep that copy (same key, same
            # bytes) and free ours, so no block ever owns two slots.
            st.host.free(p.offset)
            st.counters["promotion_duplicates"] += 1
            return True
        if p.new_checksum:
            e.checksum = p.new_checksum
        if p.note and st.events is not None:
            st.events.learn_note(e.gkey, p.note)    # (announced as this copy is indexed)
        st.index.set_host(e, p.offset)
        st.policies["host"].insert(e.gkey, e.parent_gkey, e.size)
        self.host_room.note_promoted(e.gkey, self.host_room.pools.segment_of(e.ns_id))
        st.tier_counters["host"]["promotions"] += 1
        st.counters[f"bytes_{p.source}_to_host"] += p.nbytes
        return True

    def abandon(self, p: Promotion) -> None:
        """Undo a reservation whose fill did not finish (locked); the lower copy stays."""
        p.entry.moving = None
        self.state.host.free(p.offset)

    def delete_dropped(self, dropped: list[tuple[str, Entry]]) -> None:
        """Delete the lower copies settle found corrupt (locked; the deletes run without it:
        an SSD delete waits for LMDB's one writer, a remote one for a round trip)."""
        ssd = [e for source, e in dropped if source == "ssd"]
        if ssd:
            self.ssd_room.drop(ssd)
        remote = [e.gkey for source, e in dropped if source == "remote"]
        if remote:
            self.remote.delete(remote)

    def _drop_corrupt(self, e: Entry, off: int, source: str, exc: DataLoss,
                      dropped: list[tuple[str, Entry]]) -> None:
        """A copy that does not decode or verify leaves its tier: never served."""
        st = self.state
        st.host.free(off)
        st.counters["corrupt_blocks"] += 1
        log.warning("dropping corrupt %s copy of block %s: %s", source, e.key.hex(), exc)
        if source == "gpu":
            self.gpu.drop_copy(e)
        elif source == "ssd":
            st.policies["ssd"].remove(e.gkey)   # the index bit goes with the delete (ssd_room)
            dropped.append((source, e))
            return
        else:
            st.index.set_remote(e, False)
            dropped.append((source, e))
        st.index.drop_if_gone(e)
