"""`SSDTier`: the keyed tier the store demotes to, over a payload file and an LMDB index.

Why a class of its own over the two halves (tiers/ssd/payload.py, tiers/ssd/index.py): every
operation here is one of the tier's ordering rules applied to both. A put writes the payloads
(and, with `sync`, fdatasyncs them) before the one transaction that names them commits; a
delete or overwrite frees an extent only after every reader that may have looked it up is done;
a read verifies the value's checksum against its record, so a torn or stale payload is DataLoss
(a miss), never served. The crash order and the layout of the folder: tiers/ssd/__init__.py.
"""

from __future__ import annotations

import logging
import mmap
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import lmdb
import msgpack
import xxhash
from kvstore_client.common.errors import DataLoss, InvalidArgument

from ..slab import ExtentAllocator
from .image import read_image, remove_image, write_image
from .index import MAX_KEY, REC, LmdbIndex
from .migrate import is_legacy, migrate_legacy
from .payload import ADDRESS_LIMIT, ALIGN, PayloadFile, extent_size

T = TypeVar("T")
log = logging.getLogger("kvstore.ssd")

_ALLOC_SECTION = "ssd.alloc"        # the payload file's free-space map, in the index image
PROGRESS_MIN_ENTRIES = 50_000       # scan_meta shows a progress bar above this many entries


class SSDTier:
    """Keyed tier: payload file + LMDB index. Thread-safe: commits serialize on the index's
    lock, payload writes and reads run concurrently.

    The store writes demotion batches without its own lock while other threads read, delete
    and evict here, so nothing in this class may call back into the store.
    """

    name = "ssd"

    def __init__(self, path: str, capacity: int, sync: bool = False, warm: bool = True
                 ) -> None:
        """`warm=False` leaves starting the writer thread and its buffers to `warm_up()`."""
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0:
            raise InvalidArgument(f"ssd.capacity must be a positive number of bytes, "
                                  f"got {capacity!r}")
        self.path = os.fspath(path)
        self.capacity = capacity
        self._sync = sync
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
            alloc_used = 0              # LMDB's used_bytes is there whenever blocks are
            if alloc is None:
                self._image = None
                extents, alloc_used = self._scan_extents()
                alloc = ExtentAllocator.from_extents(
                    max(self._payload.size, max((o + s for o, s in extents), default=0)),
                    ALIGN, extents)
            self._payload.alloc = alloc
            saved = self._index.saved_used
            self._index.used_bytes = saved if saved is not None else alloc_used
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
        """The sum of stored value lengths, exact after a crash (kept in the index)."""
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
                    old_off, old_len, _ = REC.unpack_from(old)
                    replaced.append(old_off)
                    delta -= old_len
                txn.put(k, REC.pack(off, n, csum) + m, db=blocks)
                delta += n
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
            off, length, checksum = REC.unpack_from(raw)
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
                    recs.append((*REC.unpack_from(raw), i))
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
        """Delete keys in one transaction; returns the bytes their values held.

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
                off, length, _ = REC.unpack_from(old)
                txn.delete(k, db=blocks)
                gone.append(off)
                delta -= length
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
        return self._index.count()

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
                    yield k, raw[REC.size:], REC.unpack_from(raw)[1]
                if bar is not None:
                    bar.update(len(batch))
        finally:
            if bar is not None:
                bar.close()

    def _scan_extents(self) -> tuple[list[tuple[int, int]], int]:
        """Every stored extent and the bytes they hold, for rebuilding the allocator."""
        extents: list[tuple[int, int]] = []
        used = 0
        unpack = REC.unpack_from
        for batch in self._index.scan():
            for _, raw in batch:
                off, length, _ = unpack(raw)
                extents.append((off, extent_size(length)))
                used += length
        return extents, used

    # -- namespaces and state -----------------------------------------------------------------
    def put_namespace(self, ns_id: bytes, spec_json: bytes) -> None:
        self._index.put_namespace(_key(ns_id), bytes(_blob(spec_json, "namespace spec")))

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
                if image is not None:
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
            alloc = ExtentAllocator.from_state(msgpack.unpackb(blob))
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
    return n


def _blob(v: object, what: str) -> bytes | bytearray | memoryview:
    if not isinstance(v, bytes | bytearray | memoryview):
        raise InvalidArgument(f"SSD tier {what} must be bytes-like, got {type(v).__name__}")
    return v


def _state_key(name: object) -> bytes:
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"state name must be a non-empty string, got {name!r}")
    return _key(name.encode())
