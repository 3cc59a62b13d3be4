"""host -> SSD: the one way blocks leave host for the SSD tier.

Host eviction (host_room.py), flush and write-through all demote here, and the gpu tier's
flush (gpu_to_ssd.py) writes its encoded blocks through `put` here, so every block reaches SSD
by the same code. Three phases, as every move: the blocks are marked `moving` under the lock
(by the eviction that picked them, or by `demote`); without the lock each block is encoded and
the batch is written; under the lock again the written blocks are indexed as SSD copies.

The write itself: SSD room is made under the lock for the encoded size (SSD eviction, which
releases the lock for its own deletes) and counted in `ssd_room.pending` until the write
lands, so concurrent demotions never overfill SSD; then `put_filled` runs without the lock:
each value is copied into the tier's page-aligned write buffer and written in runs of
adjacent extents, with one LMDB commit for the batch.

Whether a lossless block is compressed is decided per batch (kvstore/encode_choice.py): only
while compressing does not slow demotion down; otherwise it is stored `raw`, and its
"encode" is the write buffer's fill: copied from its slot, checked against its commit
checksum there (the slot is client-writable), framed. A block whose host copy fails its
checksum is never written; the caller drops it once its flight has landed.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvstore_client.common.layout import KVLayout
from kvstore_client.common.lazy import lazy_module

from tiers import frame
from tiers.ssd import CapacityFull, DiskFull, extent_size

from ..encode_choice import EncodeChoice
from ..index import Entry
from ..pools import TenantPools
from ..state import StoreState
from ..verify import matches
from .common import WORKERS, Flight, Workers, corrupt_host_copy
from .encoding import Encoder
from .ssd_room import SSDRoom

if TYPE_CHECKING:
    import numpy as np

    from tiers import codecs
else:
    np = lazy_module("numpy", globals(), "np")
    codecs = lazy_module("tiers.codecs", globals(), "codecs")

log = logging.getLogger("kvstore.store")
FLUSH_BATCH = 64            # blocks a flush demotes per flight

SSDCopies = list[tuple[Entry, int]]     # (block, stored bytes) written to SSD


def meta(e: Entry, texts: dict | None = None) -> bytes:
    """A block's SSD meta record; with `texts` (KV events on: kvstore/events/), its text
    where one is known, so a restart can announce it again."""
    import msgpack

    m = {"p": e.parent, "s": e.size, "c": e.checksum, "t": time.time()}
    if texts is not None and (text := texts.get(e.gkey)) is not None:
        # A text is a tuple (BlockText) or a commit's LazyText, made now (importing
        # events/texts.py here would load numpy before the daemon serves).
        m["e"] = (text if isinstance(text, tuple) else text.get()).pack()
    return msgpack.packb(m)


class HostToSSD:
    def __init__(self, state: StoreState, pools: TenantPools, ssd_room: SSDRoom,
                 encoder: Encoder, workers: Workers) -> None:
        self.state = state
        self.pools = pools
        self.ssd_room = ssd_room
        self.encoder = encoder
        self.workers = workers
        self._encode_choice: EncodeChoice | None = None
        self._last_write_end = float("-inf")   # perf_counter when the last batch landed

    @property
    def encode_choice(self) -> EncodeChoice:
        """Whether lossless blocks are compressed on their way to SSD (made on first use)."""
        if self._encode_choice is None:
            self._encode_choice = EncodeChoice(self.state.config.ssd.compress,
                                               min(WORKERS + 1, os.cpu_count() or 1))
        return self._encode_choice

    # -- the three phases for a caller that has not marked the blocks -----------------------
    def demote(self, entries: list[Entry], strict: bool = True) -> int:
        """Write the host copies among `entries` that have no SSD copy yet to SSD (locked;
        releases the lock for the encode and the write): flush and write-through. Skips blocks
        in flight (another thread's move will settle them) and blocks no longer indexed as
        these entries (deleted since the caller listed them, the lock released meanwhile: a
        flush's earlier batches): their slots are not theirs, and settling one would put a key
        the index does not hold into the SSD policy. `strict`: a tenant's SSD quota that
        cannot fit them raises. Returns the blocks written."""
        return len(self._demote(entries, strict))

    def _demote(self, entries: list[Entry], strict: bool = True) -> SSDCopies:
        """`demote`, returning the copies written."""
        st = self.state
        get = st.index.get
        todo = [e for e in entries if not e.ssd and e.host is not None and e.moving is None
                and get(e.gkey) is e]
        if not todo:
            return []
        flight = Flight(st, todo)
        st.demotions.add(flight.event)
        try:
            written, corrupt = self.write(todo, strict)
        finally:
            st.demotions.discard(flight.event)
            flight.land()
        self.settle(written)
        for g in corrupt:
            corrupt_host_copy(st, g, "demotion")
        return written

    # -- phase 2 --------------------------------------------------------------------------------
    def write(self, todo: list[Entry], strict: bool) -> tuple[SSDCopies, list[bytes]]:
        """Encode `todo`'s host copies and write them to SSD (locked on entry and return; the
        lock is released for the encode and for the write; the caller has marked `todo`
        moving). Returns the copies written, for `settle`, and the keys whose host copy
        failed its checksum. `strict`: see `demote` (else those blocks are left out)."""
        st = self.state
        jobs = self.encoder.host_jobs(todo)
        choice = self.encode_choice
        plain = [not choice.compress(j[2]) for j in jobs]
        # No probe in a stop's flush: nothing is left to use what it measures, and its encode
        # (on a worker, the codec kernels' first load if not yet warm) competed with the flush.
        if any(plain) and not st.closed and choice.probe():
            job = jobs[plain.index(True)]
            self._probe_encode(np.array(job[0]), job[1])
        enc = [i for i, p in enumerate(plain) if not p]
        values: list = [None] * len(todo)
        corrupt: list[bytes] = []
        if enc:
            with st.unlocked():
                t = time.perf_counter()
                vals, local = self.encoder.encode([jobs[i] for i in enc])
                dt = time.perf_counter() - t
            st.counters.update(local)
            for i, v in zip(enc, vals, strict=True):
                values[i] = v
            if all(jobs[i][2] == "lossless" for i in enc):
                choice.note_encode(sum(todo[i].size for i in enc if values[i] is not None),
                                   sum(len(v) for v in vals if v is not None), dt,
                                   one_thread=len(enc) == 1)
            corrupt = [todo[i].gkey for i in enc if values[i] is None]
        idx = [i for i in range(len(todo)) if plain[i] or values[i] is not None]
        lengths = [frame.HEADER_BYTES + e.size if p else (len(v) if v is not None else 0)
                   for e, p, v in zip(todo, plain, values, strict=True)]

        def fill(i: int, dst: memoryview) -> bool:
            if not plain[i]:
                dst[:] = values[i]
                return True
            view, checksum = jobs[i][0], jobs[i][4]
            payload = dst[frame.HEADER_BYTES:]
            # The copy is what gets checked (the slot is client-writable, kvstore/verify.py).
            np.copyto(np.frombuffer(payload, np.uint8), view)
            if not matches(payload, checksum):
                return False
            dst[:frame.HEADER_BYTES] = frame.header("raw", len(view), payload)
            return True

        stored = self.put(todo, idx, lengths, fill, strict)
        written = []
        for i, ok in stored:
            e = todo[i]
            if not ok:
                corrupt.append(e.gkey)
                continue
            written.append((e, lengths[i]))
            if plain[i]:
                st.counters["codec_in_bytes_raw"] += e.size
                st.counters["codec_out_bytes_raw"] += lengths[i]
                st.counters["codec_blocks_raw"] += 1
        return written, corrupt

    def put(self, entries: list[Entry], idx: list[int], lengths: list[int],
            fill: Callable[[int, memoryview], bool], strict: bool) -> list[tuple[int, bool]]:
        """Write blocks `entries[i]` for i in `idx` to SSD (locked on entry and return; the
        write runs without the lock): `fill(i, dst)` writes block i's `lengths[i]`-byte value
        (False: leave it out). Tenants' SSD quotas and SSD room are made first. Returns
        (i, written) for each block the quotas let through."""
        st = self.state
        if st.unpersisted:
            idx = self._persisted_only(entries, idx)
        _, idx = self.pools.fit_quota("ssd", [entries[i] for i in idx], idx, strict,
                                      self.ssd_room.evict)
        if not idx:
            return []
        # Room for what the SSD tier will count: each value's extent (tiers/ssd/tier.py).
        need = sum(extent_size(lengths[i]) for i in idx)
        self.ssd_room.make_room(need)
        texts = st.texts()
        items = [(entries[i].gkey, lengths[i], meta(entries[i], texts)) for i in idx]
        self.ssd_room.pending += need
        try:
            for retry in (False, True):
                try:
                    with st.unlocked():
                        t = time.perf_counter()
                        stored = st.ssd.put_filled(items, lambda k, dst: fill(idx[k], dst))
                        end = time.perf_counter()
                    break
                except CapacityFull:
                    if retry:
                        raise
                # The payload file is at ssd.capacity and its free room is in pieces too
                # small for this batch (values of mixed sizes), so used_bytes sits under the
                # watermark and make_room evicts nothing: evict twice the batch's extents and
                # try once more. Where that still fails, the caller drops the batch as on a
                # full disk, and the next batch evicts again, so the room comes back.
                st.counters["ssd_capacity_full_evictions"] += 1
                self.ssd_room.evict(2 * need)
        finally:
            self.ssd_room.pending -= need
        # Batches overlap (two demoters, inline evictions): one batch's wall time includes the
        # other's writes, so its rate counts only the time since the last batch landed.
        self.encode_choice.note_write(sum(lengths[i] for i in idx),
                                      end - max(t, self._last_write_end))
        self._last_write_end = end
        return list(zip(idx, stored, strict=True))

    def _persisted_only(self, entries: list[Entry], idx: list[int]) -> list[int]:
        """`idx` without the blocks of namespaces whose record is not on SSD yet (registered
        on a full disk, kvstore/namespaces.py): such a block on SSD would not be found again
        after a restart. Their records are written first, here (locked; released for the
        writes); the blocks of one that still does not land are left out (counted)."""
        st = self.state
        pending = {entries[i].ns_id for i in idx} & st.unpersisted.keys()
        if not pending:
            return idx
        landed = []
        with st.unlocked():
            for ns_id in pending:
                blob = st.unpersisted.get(ns_id)
                try:
                    if blob is not None:
                        st.ssd.put_namespace(ns_id, blob)
                    landed.append(ns_id)
                except DiskFull:
                    pass
        for ns_id in landed:
            st.unpersisted.pop(ns_id, None)
        keep = [i for i in idx if entries[i].ns_id not in st.unpersisted]
        st.counters["ssd_unpersisted_namespace_blocks"] += len(idx) - len(keep)
        return keep

    def _probe_encode(self, block: np.ndarray, layout: KVLayout) -> None:
        """Time one lossless encode of (a copy of) a block on a worker thread, for
        encode_choice, while the demotion itself goes on storing raw: the probe adds no
        latency to it. The result is thrown away. Needs no lock (see EncodeChoice)."""
        choice = self.encode_choice

        def run() -> None:
            try:
                t = time.perf_counter()
                out = codecs.encode("lossless", block, layout)
                choice.note_encode(block.nbytes, len(out), time.perf_counter() - t,
                                   one_thread=True)
            except Exception as exc:    # a measurement only; the next probe tries again
                log.debug("lossless encode probe failed: %s", exc)
        self.workers.pool().submit(run)

    # -- phase 3 --------------------------------------------------------------------------------
    def settle(self, written: SSDCopies, source: str = "host") -> None:
        """Blocks just written to SSD (locked): index, SSD policy, counters."""
        st = self.state
        ssd_counters = st.tier_counters["ssd"]
        for e, nbytes in written:
            st.index.set_ssd(e)
            st.policies["ssd"].insert(e.gkey, e.parent_gkey, e.size)
            ssd_counters["demotions_in"] += 1
            st.counters[f"bytes_{source}_to_ssd"] += nbytes
        if source == "host":
            st.tier_counters["host"]["demotions"] += len(written)

    # -- flush ----------------------------------------------------------------------------------
    def flush(self, budget_s: float | None = None,
              progress: Callable[[str], None] | None = None,
              only: set[bytes] | None = None) -> tuple[int, int, bool, int]:
        """Demote every host-only block (of the namespaces `only` names) in batches (locked;
        released for each batch's transfer). With `budget_s`, stops starting batches once that
        many seconds have passed and says how many blocks it dropped; with `progress`,
        reports about once a second. Returns (blocks written, their raw bytes, whether it
        finished, blocks it set out to write). Written, not tried: a batch's blocks deleted
        since it was listed, in another move's flight or whose host copy fails its checksum are
        not written by it, and a count of tried blocks told the operator they were on SSD."""
        st = self.state
        get = st.index.get
        todo = [e for e in st.index.hot_entries() if e.host is not None and not e.ssd
                and (only is None or e.ns_id in only)]
        start = last = time.monotonic()
        done = nbytes = 0
        if progress is not None and todo:
            limit = "" if budget_s is None else f", at most {budget_s:g} s"
            progress(f"flushing {len(todo)} host blocks to SSD{limit}")
        for i in range(0, len(todo), FLUSH_BATCH):
            now = time.monotonic()
            if budget_s is not None and now - start >= budget_s:
                left = sum(1 for e in todo[i:] if e.host is not None and not e.ssd
                           and get(e.gkey) is e)
                st.counters["stop_flush_dropped_blocks"] += left
                msg = (f"flush stopped after {now - start:.1f} s (server.stop_flush_s): "
                       f"{left} host-only blocks not written to SSD are dropped")
                log.warning(msg)
                if progress is not None:
                    progress(msg)
                return done, nbytes, False, len(todo)
            if progress is not None and now - last >= 1.0:
                last = now
                progress(f"flushed {done}/{len(todo)} blocks, "
                         f"{nbytes / max(now - start, 1e-9) / 1e9:.2f} GB/s")
            written = self._demote(todo[i:i + FLUSH_BATCH])
            done += len(written)
            nbytes += sum(e.size for e, _ in written)
        return done, nbytes, True, len(todo)
