"""host <-> remote: blocks written to the shared remote tier (Redis/Valkey), and found there.

Down: host eviction without an SSD tier, write-through, and SSD eviction (a block SSD drops
keeps its remote copy) write blocks here. A block with a host copy is encoded from it (checked
against its checksum first: the slot is client-writable); an SSD-only block's value is read
back from SSD as it is, already encoded. The caller has marked the blocks `moving`; the
encode, the SSD reads and the round trip run without the lock, and only the room and quota
checks take it in between. A write that does not land whole (Redis down or full) indexes none
of the batch as remote: a write-through leaves the blocks where they were (a later demotion
retries), an eviction drops them (kvstore/moves/host_room.py, counted and logged).

`remote.capacity` bounds the raw bytes of the blocks the index holds as remote (the running
totals of kvstore/index.py, tier_total): blocks deleted, or found gone from Redis, give their
room back at once. It is checked per batch, so batches in flight at once may pass it by a
batch each.

Up: an acquire asks which of its blocks only the remote tier holds (`wanted`, asking the
remote tier about keys the index has never seen: another node may have written them), fetches
them in batched round trips without the lock (`fetch`, pipelined one range ahead for long
prefixes) and decodes them into reserved host slots (promotion.py, `fill_remote`).
"""

from __future__ import annotations

import time
from collections import Counter

from kvstore_client.common.errors import DataLoss

from tiers.remote.envelope import sealed_bytes
from tiers.remote.tier import DEFAULT_MAX_VALUE_BYTES, VALUE_SLACK_BYTES

from ..entry import NS_ID_BYTES
from ..index import Entry
from ..pools import TenantPools
from ..state import StoreState
from .common import GONE, Flight, corrupt_host_copy
from .encoding import Encoder
from .remote_deletes import PendingDeletes

EncodedCopies = list[tuple[Entry, int]]      # (block, encoded bytes) that landed
CODEC_SLACK_BYTES = 4096  # a codec payload's headers and a frame's, beyond its share of the block
EXISTS_FIRST = 32        # keys of the first existence check past the local prefix (extend)


class HostRemote:
    def __init__(self, state: StoreState, pools: TenantPools, encoder: Encoder) -> None:
        self.state = state
        self.pools = pools
        self.encoder = encoder
        # Keys whose remote delete Redis did not answer (remote_deletes.py).
        self.pending = PendingDeletes(state, lambda: self.delete([]))
        # Keys with a SET, and keys with a DEL, in flight (the round trips run unlocked). A
        # key is never in both: a DEL of a waiting delete sent while a new copy's SET is in
        # flight could land after it and drop the new copy, which the index then names.
        self._writing: Counter[bytes] = Counter()
        self._deleting: Counter[bytes] = Counter()

    # -- down -----------------------------------------------------------------------------------
    def demote(self, entries: list[Entry]) -> None:
        """Write `entries` to the remote tier in three phases (locked; released for the
        transfer): write-through. Skips blocks in flight (another move will settle them)."""
        st = self.state
        todo = [e for e in entries if e.moving is None]
        if not todo:
            return
        flight = Flight(st, todo)
        try:
            written, corrupt = self.write(todo)
        finally:
            flight.land()
        self.settle(written)
        for g in corrupt:
            corrupt_host_copy(st, g, "demotion")

    def write(self, entries: list[Entry]) -> tuple[EncodedCopies, list[bytes]]:
        """Phase 2 of a demotion to the remote tier (locked on entry and return; released for
        the encode, the SSD reads and the round trip; the caller has marked `entries` moving).
        Returns the copies that landed, for `settle`, and the keys whose host copy failed its
        checksum (never written: the caller drops them once the flight has landed)."""
        st = self.state
        in_host = [e for e in entries if e.host is not None]
        on_ssd = [e for e in entries if e.host is None]
        jobs = self.encoder.host_jobs(in_host)
        lower_corrupt = 0
        with st.unlocked():
            values, local = self.encoder.encode(jobs)
            stored: list[bytes | None] = []
            for e in on_ssd:
                try:
                    stored.append(st.ssd.get(e.gkey))
                except DataLoss:
                    stored.append(None)
                    lower_corrupt += 1      # a corrupt copy is not passed down
        st.counters.update(local)
        st.counters["corrupt_blocks"] += lower_corrupt
        corrupt = [e.gkey for e, v in zip(in_host, values, strict=True) if v is None]
        items = [(e, v) for e, v in zip(in_host, values, strict=True) if v is not None]
        items += [(e, v) for e, v in zip(on_ssd, stored, strict=True) if v is not None]
        remote = st.remote
        items = self._fit_capacity(items)
        kept, vals = self.pools.fit_quota("remote", [e for e, _ in items],
                                          [v for _, v in items], strict=False)
        if self._deleting and any(e.gkey in self._deleting for e in kept):
            # A DEL of the same key is in flight: not written now (a later demotion is).
            pairs = [(e, v) for e, v in zip(kept, vals, strict=True)
                     if e.gkey not in self._deleting]
            kept, vals = [e for e, _ in pairs], [v for _, v in pairs]
        if not kept:
            return [], corrupt
        keys = [e.gkey for e in kept]
        replaced = self.pending.take(keys)      # a new copy supersedes a waiting delete
        retry = [g for g in self.pending.keys() if g not in self._writing][:4096]
        self._writing.update(keys)
        self._deleting.update(retry)
        failed: list[bytes] = []
        # With remote.value_notes, each value carries the block's KV-event text, where events
        # know one: Redis kept none, so a block loaded back from it was never announced
        # (events/service.py). Off by default: daemons before it delete such values.
        ev = st.events if st.config.remote.value_notes else None
        notes = ([ev.note(e.gkey, e.host is None) for e in kept] if ev is not None
                 else [b""] * len(kept))
        try:
            with st.unlocked():
                written = remote.put_many([(e.gkey, v, e.checksum, n)
                                           for e, v, n in zip(kept, vals, notes, strict=True)])
                if retry and written:
                    remote.delete_many(retry, failed=failed)
        finally:
            self._writing.subtract(keys)
            self._deleting.subtract(retry)
            self._writing += Counter()          # (drops the keys back at zero)
            self._deleting += Counter()
        if retry and written:
            self.pending.settle(retry, failed)
        if written < sum(sealed_bytes(len(v), n) for v, n in zip(vals, notes, strict=True)):
            st.counters["remote_demotion_failures"] += 1
            self.pending.settle([], replaced)   # the old copy may still be there
            return [], corrupt      # Redis down or full: the blocks stay local
        return [(e, len(v)) for e, v in zip(kept, vals, strict=True)], corrupt

    def _fit_capacity(self, items: list[tuple[Entry, bytes]]) -> list[tuple[Entry, bytes]]:
        """The items that fit `remote.capacity` (locked; module docstring); the rest are
        left out and counted."""
        st = self.state
        cap = int(st.config.remote.capacity or 0)
        if cap <= 0:
            return items
        _, used = st.index.tier_total("remote")
        fit = []
        for e, v in items:
            if used + e.size <= cap:
                used += e.size
                fit.append((e, v))
        if len(fit) < len(items):
            st.counters["remote_capacity_refused_blocks"] += len(items) - len(fit)
        return fit

    def settle(self, written: EncodedCopies) -> None:
        """Phase 3 (locked): the copies that landed are indexed as remote."""
        st = self.state
        for e, nbytes in written:
            st.index.set_remote(e)
            st.counters["bytes_to_remote"] += nbytes
        st.tier_counters["remote"]["demotions_in"] += len(written)

    def delete(self, gkeys: list[bytes]) -> None:
        """Delete remote copies the index no longer names (locked; the round trip runs
        without the lock).

        Deletes Redis did not answer wait in `pending` (remote_deletes.py): read as absent,
        sent again with this one."""
        st = self.state
        writing = self._writing
        todo = list(dict.fromkeys([*gkeys, *(g for g in self.pending.keys()
                                             if g not in writing)]))
        if not todo:
            return
        failed: list[bytes] = []
        self._deleting.update(todo)
        try:
            with st.unlocked():
                st.remote.delete_many(todo, failed=failed)
        finally:
            self._deleting.subtract(todo)
            self._deleting += Counter()
        self.pending.settle(todo, failed)

    def not_deleted(self, gkeys: list[bytes], found: list[bool]) -> list[bool]:
        """`found` with the keys whose delete has not reached Redis read as absent."""
        pending = self.pending
        if not pending:
            return found
        return [f and g not in pending for g, f in zip(gkeys, found, strict=True)]

    # -- up -------------------------------------------------------------------------------------
    def wanted(self, ns_id: bytes, keys: list[bytes]) -> list[bytes]:
        """Global keys of the prefix blocks only the remote tier holds, in order (no lock held).

        Keys the index has never seen may still be remote (another node wrote them): the first
        unknown key starts a remote existence check, as Lookup does.
        """
        st = self.state
        with st.lock:
            want, first_unknown = [], None
            for i, k in enumerate(keys):
                e = st.index.get(ns_id + k)
                if e is None:
                    first_unknown = i
                    break
                if e.host is None and not e.ssd and e.gpu is None:
                    want.append(e.gkey)
        if first_unknown is not None:
            n = self.extend(ns_id, keys, first_unknown)
            want += [ns_id + k for k in keys[first_unknown:first_unknown + n]]
        return want

    def extend(self, ns_id: bytes, keys: list[bytes], start: int) -> int:
        """How many blocks after `start` the remote tier holds (no lock held); they are
        indexed as remote.

        Asked in growing ranges (EXISTS_FIRST keys, then 4x more each trip) that stop at the
        first key Redis lacks. Why not all at once: a prefix of keys nobody stored (a new
        prompt, or a tenant's 65,536 made-up keys) would cost a pipeline of every key, about
        half a second of daemon CPU building it, and a late answer that marks Redis down for
        every tenant; a long stored prefix costs a few more round trips instead."""
        st = self.state
        n, step = 0, EXISTS_FIRST
        while start + n < len(keys):
            ask = [ns_id + k for k in keys[start + n:start + n + step]]
            found = self.not_deleted(ask, st.remote.exists_many(ask))
            hits = next((i for i, hit in enumerate(found) if not hit), len(found))
            n += hits
            if hits < len(ask):
                break
            step *= 4
        if n:
            with st.lock:
                info = st.namespaces.get(ns_id)
                if info is None:
                    return 0
                for i in range(start, start + n):
                    e = st.index.get(ns_id + keys[i])
                    if e is None:
                        parent = keys[i - 1] if i > 0 else None
                        e = Entry(ns_id, keys[i], parent, info.block_bytes, 0)
                        st.index.add(e)
                    st.index.set_remote(e)
        return n

    def deadline_for(self, ns_id: bytes, blocks: int) -> float:
        """The absolute deadline (time.monotonic()) of fetching `blocks` of the namespace's
        blocks: the tier's bulk deadline for their bytes, from now."""
        info = self.state.namespaces.get(ns_id)
        size = int(getattr(info, "block_bytes", 0) or 0)
        r = self.state.remote
        return time.monotonic() + r.deadline_s + r.bulk_s_per_mib * blocks * size / (1 << 20)

    def fetch(self, want: list[bytes], until: float | None = None) -> dict[bytes, object]:
        """One batched trip per node, no lock held: verified frames (not re-hashed) by key,
        GONE for the blocks Redis answered it no longer holds; a block whose read failed or
        was late is absent (its copy may still be there). `until`: an absolute deadline
        shared with other fetches of the same call."""
        if not want:
            return {}
        deadline_s = None if until is None else max(0.0, until - time.monotonic())
        gone: set[bytes] = set()
        values = self.state.remote.get_many(want, deadline_s=deadline_s, unframed=True,
                                            max_value_bytes=self._bounds(want), gone=gone)
        out: dict[bytes, object] = {g: v for g, v in zip(want, values, strict=True)
                                    if v is not None}
        out.update((g, GONE) for g in gone)
        return out

    def _bounds(self, want: list[bytes]) -> list[int]:
        """The longest value each wanted block's can be: its namespace's block, the codecs'
        worst case over it (lossless stores a block as is when it does not shrink; lossy
        codes and scales stay under an eighth more), the frame and the slack for the seal."""
        sizes: dict[bytes, int] = {}
        out = []
        for g in want:
            ns = g[:NS_ID_BYTES]
            if ns not in sizes:
                info = self.state.namespaces.get(ns)
                bb = int(getattr(info, "block_bytes", 0) or 0)
                sizes[ns] = (bb + bb // 8 + CODEC_SLACK_BYTES + VALUE_SLACK_BYTES if bb
                             else DEFAULT_MAX_VALUE_BYTES)
            out.append(sizes[ns])
        return out

    def close(self) -> None:
        """(at a stop, locked) Keep the deletes still waiting for the next start; nothing
        else is held between calls (each pipelined acquire owns its fetch thread)."""
        self.pending.save()
