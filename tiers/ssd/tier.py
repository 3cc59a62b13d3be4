"""`SSDTier`: the keyed tier the store demotes to, over a payload file and an LMDB index.

Why a class of its own over the two halves (tiers/ssd/payload.py, tiers/ssd/index.py): every
operation here is one of the tier's ordering rules applied to both. A put writes the payloads
(and, with `sync`, fdatasyncs them) before the one transaction that names them commits; a
delete or overwrite frees an extent only after every reader that may have looked it up is done;
a read verifies the value's checksum against its record, so a torn or stale payload is DataLoss
(a miss), never served. The crash order and the layout of the folder: tiers/ssd/__init__.py.

Why used_bytes counts extents (`extent_size` of each value: 4 KiB-aligned, 32 sizes per
octave), not value lengths: it is what the store evicts by, against `ssd.capacity`, and the
capacity is what an operator sets to fit the disk. Counting lengths, a tier of 4 KiB blocks
(8 KiB extents with their frame header) took twice its capacity on disk. The payload file
itself never grows past the capacity (tiers/ssd/payload.py). Per-tenant SSD quotas are the
store's, in raw block bytes (kvstore/pools.py), and do not use this figure.

Why an open takes used_bytes from the allocator it builds (`_settle_open`), never from the
figure LMDB kept: a folder an earlier build wrote kept the sum of value lengths there, and
the index image's stamp matches that figure all the same, so only the allocator (rebuilt from
the records, or loaded from the image, which has always counted whole extents) is sure to
mean extents. Where the two differ, the open commits the allocator's figure, and every put
and delete moves it in the same transaction as its records from then on (exact after a
crash, as before).

Why a record's extent is checked before it is used (`_bad_extent`, `value_limit`): the record's
8-byte length decides how big a buffer a read allocates and what a delete subtracts from
used_bytes. A damaged one (2**30, 2**44) made a Get allocate a GiB or fail with ENOMEM, and made
the record impossible to delete (used_bytes went negative), so every eviction batch holding it
failed. A record whose extent cannot be (unaligned, longer than any value, past the payload
file's end, longer than its block can take) is DataLoss on a read, before anything is read or
allocated, and a delete takes nothing off used_bytes for it. At open, a scan of the index drops
such records from LMDB, and of two that claim the same bytes keeps the one whose payload
verifies (`_scan_extents`); used_bytes is then the sum of the extents kept.
"""

from __future__ import annotations

import logging
import mmap
import os
import sys
from array import array
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import lmdb
import msgpack
import xxhash
from kvstore_client.common.errors import DataLoss, InvalidArgument
from kvstore_client.common.layout import MAX_BLOCK_BYTES

from ..slab import ExtentAllocator
from .image import read_image, remove_image, write_image
from .index import MAX_KEY, REC, LmdbIndex
from .migrate import is_legacy, migrate_legacy
from .payload import ADDRESS_LIMIT, ALIGN, PayloadFile, extent_size

T = TypeVar("T")
log = logging.getLogger("kvstore.ssd")

_ALLOC_SECTION = "ssd.alloc"        # the payload file's free-space map, in the index image
PROGRESS_MIN_ENTRIES = 50_000       # scan_meta shows a progress bar above this many entries
# The longest value the tier stores: the largest block, a codec's worst case over it (an eighth
# more) and room for headers. A record naming more is damaged (module docstring).
MAX_VALUE_BYTES = MAX_BLOCK_BYTES + MAX_BLOCK_BYTES // 8 + (1 << 20)
# value_limit(gkey, meta): the most bytes that key's value can be (None: no bound known).
ValueLimit = Callable[[bytes, memoryview], "int | None"]


class SSDTier:
    """Keyed tier: payload file + LMDB index. Thread-safe: commits serialize on the index's
    lock, payload writes and reads run concurrently.

    The store writes demotion batches without its own lock while other threads read, delete
    and evict here, so nothing in this class may call back into the store.
    """

    name = "ssd"

    def __init__(self, path: str, capacity: int, sync: bool = False, warm: bool = True,
                 value_limit: ValueLimit | None = None) -> None:
        """`warm=False` leaves starting the writer thread and its buffers to `warm_up()`.
        `value_limit(gkey, meta)`: the most bytes a key's value can be (the store's bound by
        namespace), checked on every read; it must not raise or call into the store."""
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0:
            raise InvalidArgument(f"ssd.capacity must be a positive number of bytes, "
                                  f"got {capacity!r}")
        self.path = os.fspath(path)
        self.capacity = capacity
        self._sync = sync
        self.value_limit = value_limit
        self.dropped_at_open = 0        # damaged index records the open's scan dropped
        # Set by the owner when its view of the records is partial (the store skipped a damaged
        # namespace record): close() then writes no index image, so the next open scans.
        self.scan_next_open = False
        self._dropped: set[bytes] = set()   # ... those still in LMDB (their delete failed)
        os.makedirs(self.path, mode=0o700, exist_ok=True)     # (LMDB's records: owner only)
        legacy = is_legacy(self.path)
        self._index = LmdbIndex(self.path, capacity, sync)
        try:
            self._payload = PayloadFile(self.path, capacity, sync)
        except BaseException:
            self._index.close()
            raise
        try:
            # The index image of the last clean stop, if LMDB is exactly as it left it
            # (tiers/ssd/image.py): its sections replace the scans of the index.
            self._image = None if legacy else self._read_image()
            alloc = self._alloc_from_image()
            saved = self._index.saved_used
            self._index.used_bytes = saved if saved is not None else 0
            bad: dict[bytes, str] = {}
            if alloc is None:
                self._image = None
                extents, _, bad = self._scan_extents()
                top = max((o + s for o, s in extents), default=0)
                self._payload.trim(top)
                alloc = ExtentAllocator.from_extents(max(self._payload.size, top), ALIGN,
                                                     extents)
            self._settle_open(bad, alloc.used_bytes)
            self._payload.alloc = alloc
            if legacy:
                migrate_legacy(self.path, self._index, self.put_many, self.sync)
        except BaseException:
            self._payload.close()
            self._index.close()
            raise
        if warm:
            self.warm_up()

    def warm_up(self) -> None:
        """Start the payload file's writer, its buffers and first step (PayloadFile.warm_up)."""
        self._payload.warm_up()

    @property
    def used_bytes(self) -> int:
        """Bytes the stored values take in the payload file: the sum of their extents
        (`extent_size`, module docstring), exact after a crash (kept in the index)."""
        return self._index.used_bytes

    # -- blocks -------------------------------------------------------------------------------
    def put(self, gkey: bytes, value: bytes, meta: bytes) -> None:
        """Store (or overwrite) one value and its meta record."""
        self.put_many([(gkey, value, meta)])

    def put_many(self, items: list[tuple[bytes, bytes, bytes]]) -> None:
        """Store a batch: payloads written in large aligned runs, then one index commit."""
        values = [memoryview(_blob(v, "value")).cast("B") for _, v, _ in items]

        def fill(i: int, dst: memoryview) -> bool:
            dst[:] = values[i]
            return True

        self.put_filled([(k, len(v), m) for (k, _, m), v in zip(items, values, strict=True)],
                        fill)

    def put_filled(self, items: list[tuple[bytes, int, bytes]],
                   fill: Callable[[int, memoryview], bool]) -> list[bool]:
        """Store a batch whose values the caller writes straight into the tier's write buffers.

        items: (key, value length, meta). `fill(i, dst)` writes value i (exactly that many
        bytes) into `dst` and returns False to leave it out (its source failed a check); it may
        raise, which stores nothing. Returns, per item, whether it was stored.

        Why: demotion used to build each value as its own object (fresh multi-MiB buffers, a
        page-fault round each) which put_many then copied again into the O_DIRECT staging
        buffer. Here each run is filled in place, checksummed while the bytes are in cache and
        written by the payload file's writer while the next is filled (tiers/ssd/payload.py).
        Crash order as put_many: every payload is written and synced before the one commit
        that names them.
        """
        checked = [(_key(k), _length(n), bytes(_blob(m, "meta"))) for k, n, m in items]
        if not checked:
            return []
        self._index.check_open()
        sizes = [extent_size(n) for _, n, _ in checked]
        lengths = [n for _, n, _ in checked]
        offsets = self._payload.allocate(sizes)
        sums: list[int | None] = [None] * len(checked)

        def fill_run(run: list[int], stage: mmap.mmap) -> bool:
            start = offsets[run[0]]
            with memoryview(stage) as view:
                for i in run:
                    pos = offsets[i] - start
                    with view[pos:pos + lengths[i]] as dst:
                        if fill(i, dst):
                            sums[i] = xxhash.xxh3_64_intdigest(dst)
            return any(sums[i] is not None for i in run)

        self._payload.write(offsets, sizes, lengths, fill_run)
        kept = [s is not None for s in sums]
        self._payload.free_now([off for off, ok in zip(offsets, kept, strict=True) if not ok])
        offsets = [off for off, ok in zip(offsets, kept, strict=True) if ok]
        stored = [(c, s) for c, s in zip(checked, sums, strict=True) if s is not None]
        replaced: list[int] = []
        blocks = self._index.blocks

        def write(txn: lmdb.Transaction) -> int:
            replaced.clear()
            delta = 0
            for off, ((k, n, m), csum) in zip(offsets, stored, strict=True):
                old = txn.get(k, db=blocks)
                if old is not None:
                    old_off, old_size = self._charge(old)
                    if old_off is not None:
                        replaced.append(old_off)
                    delta -= old_size
                txn.put(k, REC.pack(off, n, csum) + m, db=blocks)
                delta += extent_size(n)
            return delta

        if stored:
            try:
                self._index.write(write)
            except BaseException:
                self._payload.free_now(offsets)
                raise
        self._payload.free_after_readers(replaced)
        return kept

    def get(self, gkey: bytes) -> bytes | None:
        """The value (a private copy), or None; DataLoss when it fails its checksum."""
        return self.visit(gkey, bytes)

    def get_many(self, gkeys: Iterable[bytes]) -> list[bytes | None]:
        """Values for many keys (None for missing)."""
        return [self.get(k) for k in gkeys]

    def visit(self, gkey: bytes, fn: Callable[[memoryview], T]) -> T | None:
        """Call fn on a view of the verified value (valid only during the call); None if the
        key is missing; DataLoss when it fails its checksum.

        Why: promotion decodes straight from this view, which is a reused, page-aligned
        per-thread buffer filled by one O_DIRECT read where the file allows it: no fresh
        multi-MiB object per block (page faults) and no readahead-sized split of the read.
        """
        k = _key(gkey)
        with self._payload.pinned(), self._index.read() as txn:   # close() waits for it
            raw = txn.get(k, db=self._index.blocks)
            if raw is None:
                return None
            off, length, checksum = self._readable(k, raw)
            view = self._payload.read(off, length)
        if len(view) != length or xxhash.xxh3_64_intdigest(view) != checksum:
            raise DataLoss(f"SSD block {k.hex()} fails its checksum (torn or overwritten "
                           "payload)")
        return fn(view)

    def visit_many(self, gkeys: list[bytes], fn: Callable[[int, memoryview], object]
                   ) -> list[bool | DataLoss]:
        """fn(i, view) on each verified value (the view is valid only during the call); per
        key, True when visited, False when missing, or the DataLoss of a value that fails its
        checksum (fn is not called for it).

        Why: promotion of a prefix reads blocks that demotion wrote next to each other, so
        adjacent extents are read with one pread per run (PayloadFile.read_runs).
        """
        keys = [_key(k) for k in gkeys]
        out: list[bool | DataLoss] = [False] * len(keys)
        with self._payload.pinned(), self._index.read() as txn:   # close() waits for it
            recs = []
            for i, k in enumerate(keys):
                raw = txn.get(k, db=self._index.blocks)
                if raw is not None:
                    try:
                        recs.append((*self._readable(k, raw), i))
                    except DataLoss as exc:
                        out[i] = exc
            recs.sort()
            for got, run in self._payload.read_runs(recs):
                first = run[0][0]
                for off, length, checksum, i in run:
                    view = got[off - first:off - first + length]
                    if len(view) != length or xxhash.xxh3_64_intdigest(view) != checksum:
                        out[i] = DataLoss(f"SSD block {keys[i].hex()} fails its checksum "
                                          "(torn or overwritten payload)")
                        continue
                    fn(i, view)
                    out[i] = True
        return out

    def get_meta(self, gkey: bytes) -> bytes | None:
        rec = self._index.record(_key(gkey))
        return None if rec is None else rec[3]

    def set_meta(self, gkey: bytes, meta: bytes) -> None:
        """Replace the meta record of a stored key (InvalidArgument if it is not stored)."""
        k, m = _key(gkey), bytes(_blob(meta, "meta"))
        blocks = self._index.blocks

        def write(txn: lmdb.Transaction) -> int:
            old = txn.get(k, db=blocks)
            if old is None:
                raise InvalidArgument(f"cannot set meta of key {k.hex()}: not in the SSD tier")
            txn.put(k, bytes(old[:REC.size]) + m, db=blocks)
            return 0

        self._index.write(write)

    def size_of(self, gkey: bytes) -> int | None:
        """Stored value size, from the index record (no payload read)."""
        rec = self._index.record(_key(gkey))
        return None if rec is None else rec[1]

    def delete(self, gkey: bytes) -> bool:
        return self.delete_many([gkey]) == 1

    def delete_many(self, gkeys: Iterable[bytes]) -> int:
        """Delete keys in one transaction; returns how many were stored."""
        return self._delete(gkeys)[0]

    def delete_sized(self, gkeys: Iterable[bytes]) -> int:
        """Delete keys in one transaction; returns the bytes it took off `used_bytes` (their
        extents).

        Why not `used_bytes` before and after: another thread's put may commit in between (the
        store writes demotion batches without its own lock), so only the transaction's own
        delta says what this delete freed.
        """
        return self._delete(gkeys)[1]

    def _delete(self, gkeys: Iterable[bytes]) -> tuple[int, int]:
        keys = [_key(k) for k in gkeys]
        found = freed = 0
        gone: list[int] = []
        blocks = self._index.blocks

        def write(txn: lmdb.Transaction) -> int:
            nonlocal found, freed
            found, delta = 0, 0
            gone.clear()
            for k in keys:
                old = txn.get(k, db=blocks)
                if old is None:
                    continue
                off, size = self._charge(old)
                txn.delete(k, db=blocks)
                if off is not None:
                    gone.append(off)
                delta -= size
                found += 1
            freed = -delta
            return delta

        if keys:
            self._index.write(write)
            self._payload.free_after_readers(gone)
        return found, freed

    def contains(self, gkey: bytes) -> bool:
        return self.size_of(gkey) is not None

    def __len__(self) -> int:
        """The block records stored, from memory: no LMDB transaction (tiers/ssd/index.py),
        so Stats and metrics scrapes never wait for the disk."""
        return self._index.entries

    # -- checks of a record -------------------------------------------------------------------
    def _bad_extent(self, off: int, length: int) -> str | None:
        """Why a record's offset and length cannot name a stored value (module docstring), or
        None. Cheap: no I/O, no lock."""
        if off % ALIGN:
            return f"offset {off} is not {ALIGN}-aligned"
        if length > MAX_VALUE_BYTES:
            return f"length {length} is more than any value ({MAX_VALUE_BYTES} bytes)"
        end = off + extent_size(length)
        if end > self._payload.size:
            return (f"its extent ({length} bytes at {off}) ends past the payload file "
                    f"({self._payload.size} bytes)")
        return None

    def _readable(self, k: bytes, raw: bytes) -> tuple[int, int, int]:
        """(offset, length, checksum) of a record a read may follow; DataLoss (a miss) when it
        cannot name a stored value, checked before a byte is read or a buffer sized for it."""
        if len(raw) < REC.size:
            why = f"a record of {len(raw)} bytes"
        else:
            off, length, checksum = REC.unpack_from(raw)
            why = self._bad_extent(off, length)
            if why is None and self.value_limit is not None:
                try:
                    limit = self.value_limit(k, memoryview(raw)[REC.size:])
                except Exception:  # noqa: BLE001 - the bound is a check, not a reason to fail
                    limit = None
                if limit is not None and length > limit:
                    why = f"length {length} is more than its block can take ({limit} bytes)"
            if why is None:
                return off, length, checksum
        raise DataLoss(f"SSD block {k.hex()} has a damaged index record: {why}")

    def _charge(self, raw: bytes) -> tuple[int | None, int]:
        """What deleting or overwriting a record gives back: the extent to free (None: it names
        none) and the bytes to take off used_bytes (its extent's size). A record whose extent
        cannot be takes nothing off (its true length is unknown; the damaged one made
        used_bytes negative; the next open recounts from the allocator);
        its offset, where it can name an extent, is still freed (a damaged length leaves it
        right; one the allocator does not hold is skipped, PayloadFile._drain)."""
        if len(raw) < REC.size:
            return None, 0
        off, length, _ = REC.unpack_from(raw)
        if self._bad_extent(off, length) is None:
            return off, extent_size(length)
        return (off if off % ALIGN == 0 and off < self._payload.size else None), 0

    def scan_meta(self) -> Iterator[tuple[bytes, bytes, int]]:
        """(gkey, meta, value size) of every stored block, reading only the index.

        Rebuilds the store's index on open; shows a tqdm bar on stderr for large tiers.
        """
        total = len(self)
        bar = None
        if total > PROGRESS_MIN_ENTRIES:
            from tqdm import tqdm
            bar = tqdm(total=total, desc="ssd index", unit="blk", file=sys.stderr,
                       mininterval=0.5, leave=False)
        try:
            for batch in self._index.scan():
                for k, raw in batch:
                    if len(raw) >= REC.size and k not in self._dropped:
                        yield k, raw[REC.size:], REC.unpack_from(raw)[1]
                if bar is not None:
                    bar.update(len(batch))
        finally:
            if bar is not None:
                bar.close()

    def _scan_extents(self) -> tuple[list[tuple[int, int]], int, dict[bytes, str]]:
        """Every stored extent and the bytes they take, for rebuilding the allocator, and the
        damaged records left out, with why (module docstring): a record too short, one whose
        extent cannot be, and of extents that overlap, each whose payload fails its checksum
        (then, of those that pass, all but the first)."""
        extents: list[tuple[int, int]] = []
        used = 0
        bad: dict[bytes, str] = {}
        unpack, check = REC.unpack_from, self._bad_extent
        for batch in self._index.scan():
            for k, raw in batch:
                if len(raw) < REC.size:
                    bad[k] = f"a record of {len(raw)} bytes"
                    continue
                off, length, _ = unpack(raw)
                why = check(off, length)
                if why is not None:
                    bad[k] = why
                    continue
                size = extent_size(length)
                extents.append((off, size))
                used += size
        extents.sort()
        top = 0
        for off, size in extents:
            if off < top:
                return self._untangle(bad)
            top = off + size
        return extents, used, bad

    def _untangle(self, bad: dict[bytes, str]
                  ) -> tuple[list[tuple[int, int]], int, dict[bytes, str]]:
        """_scan_extents when two records claim the same bytes (a damaged length or offset):
        a second scan with the keys, and each record of an overlapping group verified against
        its payload. Rare, so the first scan keeps no keys."""
        recs: list[tuple[int, int, int, int, bytes]] = []    # offset, extent, length, sum, key
        for batch in self._index.scan():
            for k, raw in batch:
                if k not in bad:
                    off, length, checksum = REC.unpack_from(raw)
                    recs.append((off, extent_size(length), length, checksum, k))
        recs.sort()
        kept: list[tuple[int, int, int, int, bytes]] = []
        group: list[tuple[int, int, int, int, bytes]] = []
        end = -1
        for rec in [*recs, None]:
            if rec is not None and rec[0] < end:
                group.append(rec)
                end = max(end, rec[0] + rec[1])
                continue
            if len(group) > 1:
                top = -1
                for off, size, length, checksum, k in group:
                    if not self._verifies(off, length, checksum):
                        bad[k] = ("its extent overlaps another record's and its payload fails "
                                  "its checksum")
                    elif off < top:
                        bad[k] = "its extent overlaps another record's"
                    else:
                        kept.append((off, size, length, checksum, k))
                        top = off + size
            else:
                kept.extend(group)
            if rec is not None:
                group, end = [rec], rec[0] + rec[1]
        self._payload.drop_read_buffer()
        return [(r[0], r[1]) for r in kept], sum(r[1] for r in kept), bad

    def _verifies(self, off: int, length: int, checksum: int) -> bool:
        try:
            view = self._payload.read(off, length)
        except OSError:
            return False
        return len(view) == length and xxhash.xxh3_64_intdigest(view) == checksum

    def _settle_open(self, bad: dict[bytes, str], used: int) -> None:
        """At open: used_bytes is the allocator's figure, the extents of the records kept
        (module docstring), committed where LMDB's differs, and the damaged records a scan
        found are deleted from LMDB (one WARNING with their count). Should that write fail,
        they stay left out of scan_meta, so nothing reads them."""
        index = self._index
        if index.saved_used is not None and index.saved_used != used and not bad:
            log.info("SSD tier at %s: used bytes recounted as the extents stored, %d (was %d)",
                     self.path, used, index.saved_used)
        if not bad and index.saved_used in (None, used):
            index.used_bytes = used
            return
        keys = list(bad)
        blocks = index.blocks

        def drop(txn: lmdb.Transaction) -> int:
            for k in keys:
                txn.delete(k, db=blocks)
            return used - index.used_bytes

        try:
            index.write(drop)
        except Exception as exc:  # noqa: BLE001 - the next open drops them again
            log.warning("SSD tier at %s: could not delete damaged index records: %s",
                        self.path, exc)
            self._dropped = set(keys)
        index.used_bytes = used
        if bad:
            self.dropped_at_open = len(bad)
            first = keys[0]
            log.warning("SSD tier at %s: dropped %d damaged index record(s) at open, never "
                        "served (e.g. block %s: %s)", self.path, len(bad), first.hex(),
                        bad[first])

    # -- namespaces and state -----------------------------------------------------------------
    def put_namespace(self, ns_id: bytes, spec_json: bytes) -> None:
        self._index.put_namespace(_key(ns_id), bytes(_blob(spec_json, "namespace spec")))

    def delete_namespace(self, ns_id: bytes) -> None:
        """Forget a namespace's record (the store reclaimed it: it holds no block)."""
        self._index.delete_namespace(_key(ns_id))

    def namespaces(self) -> dict[bytes, bytes]:
        return self._index.namespaces()

    def put_state(self, name: str, blob: bytes) -> None:
        self._index.put_state(_state_key(name), bytes(_blob(blob, "state blob")))

    def get_state(self, name: str) -> bytes | None:
        return self._index.get_state(_state_key(name))

    # -- files and lifetime -------------------------------------------------------------------
    def data_files(self) -> list[str]:
        """The payload file, e.g. for dropping its page cache in benchmarks."""
        return [self._payload.path]

    @property
    def direct_io(self) -> bool:
        """Whether payloads are written with O_DIRECT (False: the filesystem refused it)."""
        return self._payload.dfd is not None

    @property
    def map_size(self) -> int:
        return self._index.map_size

    @property
    def file_bytes(self) -> int:
        """Bytes the payload file holds on disk (preallocated), for capacity planning."""
        return self._payload.size

    def sync(self) -> None:
        """Flush payloads, then the index (a no-op cost when opened with sync=True)."""
        self._index.check_open()
        self._payload.sync()
        self._index.sync()

    def image_section(self, name: str) -> bytes | memoryview | None:
        """A section the store saved with `close(image=...)` at the last clean stop, if the
        image is current (else None: rebuild from `scan_meta`). Each is handed out once."""
        return None if self._image is None else self._image.pop(name, None)

    def close(self, image: dict[str, bytes] | None = None) -> None:
        """Sync and close. `image`: the store's sections of an index image to write for the
        next open (tiers/ssd/image.py); the tier adds its allocator's."""
        if self._index.closed:
            return
        with self._index.quiesced():
            self._payload.closed = True
            try:
                self._payload.sync()
                if self.scan_next_open:
                    remove_image(self.path)
                elif image is not None:
                    self._write_image(image)
                if not self._sync:
                    self._index.sync()
            finally:
                self._payload.close()
                self._index.close()

    def _read_image(self) -> dict[str, memoryview] | None:
        stamp = self._index.image_stamp()
        return None if stamp is None else read_image(self.path, stamp)

    def _alloc_from_image(self) -> ExtentAllocator | None:
        blob = None if self._image is None else self._image.pop(_ALLOC_SECTION, None)
        if blob is None:
            return None
        try:
            state = msgpack.unpackb(blob)
            alloc = ExtentAllocator.from_state(state)
            if alloc.capacity > self._payload.size:   # the file lost its tail since: scan
                log.warning("ignoring the SSD index image of %s: it maps %d bytes of a "
                            "%d-byte payload file", self.path, alloc.capacity,
                            self._payload.size)
                return None
            if self._payload.size > self._payload.limit:
                # Larger than the capacity (PayloadFile.trim): cut back past the last stored
                # extent, and the map rebuilt from the image's extents for the shorter file.
                # Rare, so its cost (a step per extent, as a scan) is no start's usual path.
                extents = _state_extents(state)
                top = max((o + n for o, n in extents), default=0)
                self._payload.trim(top)
                alloc = ExtentAllocator.from_extents(self._payload.size, ALIGN, extents)
        except (InvalidArgument, ValueError, TypeError) as exc:
            log.warning("ignoring the SSD index image of %s: %s", self.path, exc)
            return None
        if alloc.capacity < self._payload.size:
            alloc.grow(self._payload.size)
        return alloc

    def _write_image(self, sections: dict[str, bytes]) -> None:
        """Commit a fresh token into LMDB, make LMDB durable, then write the image stamped
        with that token and LMDB's transaction id. Failure only costs the next open a scan."""
        try:
            state = self._payload.settled_state()
        except InvalidArgument:             # an inconsistent map: the next open scans
            remove_image(self.path)
            return
        if state is None:                   # a reader still holds extents: no image
            return
        alloc = msgpack.packb(state)
        try:
            stamp = self._index.commit_image_token(os.urandom(16))
            write_image(self.path, stamp, {**sections, _ALLOC_SECTION: alloc})
        except (lmdb.Error, OSError) as exc:
            log.warning("no index image written for %s (the next start scans the index): %s",
                        self.path, exc)
            remove_image(self.path)

    def __enter__(self) -> SSDTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _state_extents(state: dict) -> list[tuple[int, int]]:
    """The allocated extents of an allocator's state (ExtentAllocator.state)."""
    off, size = array("Q"), array("Q")
    off.frombytes(state["used_off"])
    size.frombytes(state["used_size"])
    return list(zip(off, size, strict=True))


def _key(k: object) -> bytes:
    if not isinstance(k, bytes | bytearray | memoryview):
        raise InvalidArgument(f"SSD tier keys must be bytes, got {type(k).__name__}")
    k = bytes(k)
    if not 0 < len(k) <= MAX_KEY:
        raise InvalidArgument(f"SSD tier key must be 1..{MAX_KEY} bytes, got {len(k)}")
    return k


def _length(n: object) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n < ADDRESS_LIMIT:
        raise InvalidArgument(f"SSD tier value length must be a byte count, got {n!r}")
    if n > MAX_VALUE_BYTES:
        raise InvalidArgument(f"SSD tier values are at most {MAX_VALUE_BYTES} bytes, got {n}")
    return n


def _blob(v: object, what: str) -> bytes | bytearray | memoryview:
    if not isinstance(v, bytes | bytearray | memoryview):
        raise InvalidArgument(f"SSD tier {what} must be bytes-like, got {type(v).__name__}")
    return v


def _state_key(name: object) -> bytes:
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"state name must be a non-empty string, got {name!r}")
    return _key(name.encode())
