"""SSD tier: block payloads in a preallocated payload file, metadata in LMDB; survives restarts.

Why not payloads in LMDB (the old format): LMDB's put copies every value through the page cache
into its map, which ran at 0.04-0.45 of the disk's speed; large aligned pwrites into a
preallocated file reach 0.7-0.9. LMDB keeps what it is good at: small records, atomic commits.

Layout of the tier's folder:
- `payload.dat`  block payloads at 4 KiB-aligned extents. The file grows in preallocated steps
                 of GROW_STEP (posix_fallocate) and is written with O_DIRECT where the
                 filesystem allows (tmpfs and some others do not: then plain pwrite).
- `index/`       LMDB environment, named sub-databases in one environment so one write
                 transaction is atomic across them:
                 `index`      gkey -> offset, value length, xxh3-64 of the value (24 bytes,
                              little-endian) + the caller's msgpack record
                 `namespaces` ns_id -> namespace spec JSON
                 `state`      name -> blob (policy snapshots and the like, owned by the store)
                 `_tier`      `used_bytes` (updated in the same transaction as every put and
                              delete, so it is exact after a crash) and `format`

Crash order: a batch's payloads are written (and, with `sync`, fdatasync'd) before the
transaction that points the index at them commits, so a committed record never names an extent
that was not written; a crash between the two leaves only unreferenced space, which the next
open counts as free. Without `sync` neither the payloads nor LMDB's commits are forced to the
device per batch (sync() does both, payloads first: the store's Flush and a stop); a power loss
may then leave a record whose payload did not reach the disk, which its checksum turns into a
miss. Every read verifies the value's checksum against its record: a torn or stale payload is
DataLoss (a miss), never served.

Free space: extents come from an ExtentAllocator (tiers/slab.py) rebuilt from the index on
open. Sizes are rounded to 32 classes per power of two (at most ~3% slack) so a freed extent
is usually reused exactly. An extent freed while a reader that may have looked it up is still
reading goes back to the allocator only after that reader finishes, so reuse never races a read.

A folder of the old format (payloads inside LMDB, `data.mdb` at the top) is migrated on open,
or refused with one line when that fails; a newer format is refused, never misread.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import struct
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import TypeVar

import lmdb
import msgpack
import xxhash
from kvstore_client.common.errors import DataLoss, InvalidArgument, ResourceExhausted, Unavailable

from .slab import ExtentAllocator
from .ssd_image import Stamp, read_image, remove_image, write_image

T = TypeVar("T")
log = logging.getLogger("kvstore.ssd")

FORMAT = b"2"
_REC = struct.Struct("<QQQ")        # offset, value length, xxh3-64 of the value
_SIZE = struct.Struct("<Q")
_USED_KEY = b"used_bytes"
_FORMAT_KEY = b"format"
_IMAGE_KEY = b"image"              # token of the index image written at the last clean stop
_ALLOC_SECTION = "ssd.alloc"
MAX_KEY = 511                       # LMDB's compiled-in key size limit
MAP_SLACK = 64 << 20
PROGRESS_MIN_ENTRIES = 50_000       # scan_meta shows a progress bar above this many entries
_SCAN_BATCH = 8192
ALIGN = 4096
GROW_STEP = 256 << 20               # the payload file grows (preallocated) this much at a time,
MIN_GROW_STEP = 4 << 20             # or an eighth of the tier's capacity where that is less
# Adjacent extents are joined into one write up to this size: 8 MiB of payload (as fast as
# the disk's large sequential writes) plus the ~3% an extent may round up, so that four
# 2 MiB blocks (2 MiB + 64 KiB extents) make one write instead of three and then one.
RUN_BYTES = (8 << 20) + (512 << 10)
PREFAULT_BUFFERS = 3                # write buffers populated at open (one per writing thread)
PREFAULT_MIN_CAPACITY = 256 << 20   # ... for a tier at least this big (not the tests' tiny ones)
MAX_FREE_BUFFERS = 8
READ_RUN_BYTES = 16 << 20           # adjacent extents read with one pread up to this size
_ADDRESS_LIMIT = 1 << 60
_MIGRATE_BATCH = 64


def initial_map_size(capacity: int) -> int:
    """LMDB map size for a byte cap: records only (~150 bytes a block), grown when full."""
    return capacity // 64 + MAP_SLACK


def extent_size(nbytes: int) -> int:
    """The extent a value of `nbytes` occupies: aligned, rounded to 32 classes per octave."""
    n = max(nbytes, ALIGN)
    grain = max(ALIGN, 1 << max(0, n.bit_length() - 6))
    return -(-n // grain) * grain


DISK_FULL_BYTES = 64 << 20         # an EIO with less than this free is the disk filling up


class DiskFull(ResourceExhausted):
    """A write to the SSD tier did not land: the filesystem under it is full.

    Why its own type: the store treats it differently from its own byte cap (it keeps host
    working by dropping eviction victims instead of demoting them) and the message names the
    path and the free space, which is what an operator needs to act.
    """

    def __init__(self, path: str, free: int, exc: BaseException | str) -> None:
        super().__init__(f"SSD tier write did not land: the filesystem under {path} is full "
                         f"({free} bytes free; {exc}); free space there or lower ssd.capacity")
        self.path, self.free = path, free


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer can still use on the filesystem holding `path`."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


class SSDTier:
    """Keyed tier: payload file + LMDB index. Thread-safe: commits serialize on a lock,
    payload writes and reads run concurrently.

    `used_bytes` (the sum of stored value lengths) changes only inside a write transaction,
    under the write lock, and is published after the commit. The store writes demotion batches
    without its own lock while other threads read, delete and evict here, so nothing in this
    class may call back into the store.
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
        os.makedirs(self.path, exist_ok=True)
        legacy = os.path.exists(os.path.join(self.path, "data.mdb"))
        index_dir = os.path.join(self.path, "index")
        os.makedirs(index_dir, exist_ok=True)
        try:
            self._env = lmdb.open(
                index_dir, map_size=initial_map_size(capacity), subdir=True, readahead=False,
                writemap=False, sync=sync, metasync=sync, max_dbs=8, lock=True,
                max_readers=512, meminit=False)
        except lmdb.Error as exc:
            raise Unavailable(f"cannot open the SSD tier at {self.path}: {exc}") from exc
        txnid = self._env.info()["last_txnid"]     # before anything here writes (image stamp)
        self._index = self._env.open_db(b"index")
        self._ns = self._env.open_db(b"namespaces")
        self._state = self._env.open_db(b"state")
        self._tier = self._env.open_db(b"_tier")
        self._write_lock = threading.Lock()
        # read gate: set_mapsize needs no live transaction in this process
        self._gate = threading.Condition()
        self._readers = 0
        self._resizing = False
        self._closed = False
        # Allocator, deferred frees and the readers that hold them back (see module docstring).
        self._alloc_lock = threading.Lock()
        self._epoch = 0
        self._active: dict[int, int] = {}
        self._pending: deque[tuple[int, int]] = deque()
        self._tls = threading.local()
        self._stages = _Buffers()
        self._write_pool: ThreadPoolExecutor | None = None
        self._check_format()
        self._payload_path = os.path.join(self.path, "payload.dat")
        self._fd = os.open(self._payload_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._dfd = self._dfd_opened = _open_direct(self._payload_path)
        try:
            self._file_size = os.fstat(self._fd).st_size
            # The index image of the last clean stop, if LMDB is exactly as it left it
            # (tiers/ssd_image.py): its sections replace the scans of the index.
            self._image = None if legacy else self._read_image(txnid)
            alloc = self._alloc_from_image()
            if alloc is not None:
                self._alloc = alloc
                alloc_used = 0          # LMDB's used_bytes is there whenever blocks are
            else:
                self._image = None
                extents, used = self._scan_extents()
                self._alloc = ExtentAllocator.from_extents(
                    max(self._file_size, max((o + s for o, s in extents), default=0)), ALIGN,
                    extents)
                alloc_used = used
            with self._env.begin(db=self._tier) as txn:
                raw = txn.get(_USED_KEY)
            self.used_bytes = _SIZE.unpack(raw)[0] if raw else alloc_used
            if legacy:
                self._migrate_legacy()
        except BaseException:
            self._close_files()
            raise
        if warm:
            self.warm_up()

    def warm_up(self) -> None:
        """The writer thread, warm write buffers and, for a fresh tier, the payload file's
        first preallocated step ready for the first demotion (often a stop's flush): under
        load, starting a thread and faulting in a buffer cost ~10 ms of its first batch, and
        the fallocate of the first step ~0.1-0.2 s."""
        if self.capacity >= PREFAULT_MIN_CAPACITY and not self._closed:
            writer = self._writer()
            writer.submit(self._stages.prefault, PREFAULT_BUFFERS)
            writer.submit(self._grow_ahead)
        if not self._closed:
            self._writer().submit(self._materialize_alloc)

    def _materialize_alloc(self) -> None:
        """The allocator an index image left partly unbuilt, built off the start's path."""
        with self._alloc_lock:
            try:
                self._alloc.materialize()
            except InvalidArgument as exc:      # every write and free will say so as well
                log.error("the SSD tier's free-space map from the index image of %s is "
                          "inconsistent: %s", self.path, exc)

    def _grow_ahead(self) -> None:
        with self._alloc_lock:
            if self._closed or self._file_size:
                return
            try:
                self._grow_file(ALIGN)
            except (OSError, ResourceExhausted) as exc:     # the first write grows it instead
                log.debug("could not preallocate %s: %s", self._payload_path, exc)

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
        buffer. Here each run of adjacent extents (up to RUN_BYTES) is filled on the calling
        thread into a reused page-aligned buffer, checksummed there while the bytes are in
        cache, and handed to the tier's writer thread for one pwrite, while the caller fills
        the next run: copies overlap the disk, and writes reach the disk one at a time (on
        this kind of disk, concurrent O_DIRECT writes were slower than one after another).
        A filled run is queued before the caller waits for the one before it, so the writer
        goes from one pwrite straight to the next: waiting first left the disk idle for two
        thread wake-ups per run, several ms each on a loaded machine.
        Crash order as put_many: every payload is written and synced before the one commit
        that names them.
        """
        checked = [(_key(k), _length(n), bytes(_blob(m, "meta"))) for k, n, m in items]
        if not checked:
            return []
        self._check_open()
        sizes = [extent_size(n) for _, n, _ in checked]
        offsets = self._allocate(sizes)
        sums: list[int | None] = [None] * len(checked)

        def fill_run(run: list[int], stage: mmap.mmap) -> bool:
            start = offsets[run[0]]
            with memoryview(stage) as view:
                for i in run:
                    pos = offsets[i] - start
                    with view[pos:pos + checked[i][1]] as dst:
                        if fill(i, dst):
                            sums[i] = xxhash.xxh3_64_intdigest(dst)
            return any(sums[i] is not None for i in run)

        def write_run(run: list[int], stage: mmap.mmap) -> None:
            try:
                start = offsets[run[0]]
                self._pwrite_run(stage, offsets[run[-1]] + sizes[run[-1]] - start, start,
                                 [(offsets[i] - start, checked[i][1]) for i in run])
            finally:
                self._stages.give(stage)

        try:
            runs = _runs(offsets, sizes)
            pending: deque[Future] = deque()
            try:
                for run in runs:
                    stage = self._stages.take(offsets[run[-1]] + sizes[run[-1]]
                                              - offsets[run[0]])
                    try:
                        filled = fill_run(run, stage)
                    except BaseException:
                        self._stages.give(stage)
                        raise
                    if not filled:
                        self._stages.give(stage)
                    elif len(runs) == 1:
                        write_run(run, stage)       # nothing to overlap with
                    else:
                        pending.append(self._writer().submit(write_run, run, stage))
                    while len(pending) > 1:         # one writing, one queued behind it
                        pending.popleft().result()
            finally:
                if pending:                         # on an error too: the writes end first
                    wait(pending)
            for done in pending:
                done.result()
            if self._sync:
                os.fdatasync(self._fd)          # payloads durable before the index names them
        except OSError as exc:
            self._free_now(offsets)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull(self.path, free_bytes(self.path), exc) from None
            raise
        except BaseException:
            self._free_now(offsets)
            raise
        kept = [s is not None for s in sums]
        self._free_now([off for off, ok in zip(offsets, kept, strict=True) if not ok])
        offsets = [off for off, ok in zip(offsets, kept, strict=True) if ok]
        stored = [(c, s) for c, s in zip(checked, sums, strict=True) if s is not None]
        replaced: list[int] = []

        def write(txn: lmdb.Transaction) -> int:
            replaced.clear()
            delta = 0
            for off, ((k, n, m), csum) in zip(offsets, stored, strict=True):
                old = txn.get(k, db=self._index)
                if old is not None:
                    old_off, old_len, _ = _REC.unpack_from(old)
                    replaced.append(old_off)
                    delta -= old_len
                txn.put(k, _REC.pack(off, n, csum) + m, db=self._index)
                delta += n
            return delta

        if stored:
            try:
                self._write(write)
            except BaseException:
                self._free_now(offsets)
                raise
        self._free_after_readers(replaced)
        return kept

    def get(self, gkey: bytes) -> bytes | None:
        """The value (a private copy), or None; DataLoss when it fails its checksum."""
        k = _key(gkey)
        with self._pinned(), self._read() as txn:     # close() waits for the read
            raw = txn.get(k, db=self._index)
            if raw is None:
                return None
            off, length, checksum = _REC.unpack_from(raw)
            value = bytes(self._read_extent(off, length))
        if len(value) != length or xxhash.xxh3_64_intdigest(value) != checksum:
            raise DataLoss(f"SSD block {k.hex()} fails its checksum (torn or overwritten "
                           "payload)")
        return value

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
        with self._pinned(), self._read() as txn:     # close() waits for the read
            raw = txn.get(k, db=self._index)
            if raw is None:
                return None
            off, length, checksum = _REC.unpack_from(raw)
            view = self._read_extent(off, length)
        if len(view) != length or xxhash.xxh3_64_intdigest(view) != checksum:
            raise DataLoss(f"SSD block {k.hex()} fails its checksum (torn or overwritten "
                           "payload)")
        return fn(view)

    def visit_many(self, gkeys: list[bytes], fn: Callable[[int, memoryview], object]
                   ) -> list[bool | DataLoss]:
        """fn(i, view) on each verified value (the view is valid only during the call); per
        key, True when visited, False when missing, or the DataLoss of a value that fails its
        checksum (fn is not called for it).

        Why: promotion of a prefix reads blocks that demotion wrote next to each other. Here
        adjacent extents are read with one O_DIRECT pread per run (up to READ_RUN_BYTES):
        on this kind of disk, 8 MiB reads on two threads ran at 1.6x the rate of 2 MiB reads
        on three.
        """
        keys = [_key(k) for k in gkeys]
        out: list[bool | DataLoss] = [False] * len(keys)
        with self._pinned(), self._read() as txn:     # close() waits for the read
            recs = []
            for i, k in enumerate(keys):
                raw = txn.get(k, db=self._index)
                if raw is not None:
                    recs.append((*_REC.unpack_from(raw), i))
            recs.sort()
            runs: list[list[tuple[int, int, int, int]]] = []
            end = start = -1
            for rec in recs:
                off, length = rec[0], rec[1]
                if runs and off == end and off + extent_size(length) - start <= READ_RUN_BYTES:
                    runs[-1].append(rec)
                else:
                    runs.append([rec])
                    start = off
                end = off + extent_size(length)
            for run in runs:
                first = run[0][0]
                last = run[-1][0] + extent_size(run[-1][1])
                got = self._read_extent(first, last - first)
                for off, length, checksum, i in run:
                    view = got[off - first:off - first + length]
                    if len(view) != length or xxhash.xxh3_64_intdigest(view) != checksum:
                        out[i] = DataLoss(f"SSD block {keys[i].hex()} fails its checksum "
                                          "(torn or overwritten payload)")
                        continue
                    fn(i, view)
                    out[i] = True
        return out

    def _read_extent(self, off: int, length: int) -> memoryview:
        """`length` bytes at `off`, read into this thread's reusable read buffer."""
        size = extent_size(length)
        buf = getattr(self._tls, "rbuf", None)
        if buf is None or len(buf) < size:
            buf = self._tls.rbuf = _populated(max(size, 4 << 20))
        view = memoryview(buf)
        fd = self._dfd if self._dfd is not None else self._fd
        got = 0
        while got < length:
            try:
                n = os.preadv(fd, [view[got:size]], off + got)
            except OSError as exc:
                if fd != self._dfd or exc.errno != errno.EINVAL:
                    raise
                fd = self._fd                  # O_DIRECT refused for reads: buffered
                continue
            if n <= 0:
                break
            got += n
        return view[:min(got, length)]

    def get_meta(self, gkey: bytes) -> bytes | None:
        rec = self._record(_key(gkey))
        return None if rec is None else rec[3]

    def set_meta(self, gkey: bytes, meta: bytes) -> None:
        """Replace the meta record of a stored key (InvalidArgument if it is not stored)."""
        k, m = _key(gkey), bytes(_blob(meta, "meta"))

        def write(txn: lmdb.Transaction) -> int:
            old = txn.get(k, db=self._index)
            if old is None:
                raise InvalidArgument(f"cannot set meta of key {k.hex()}: not in the SSD tier")
            txn.put(k, bytes(old[:_REC.size]) + m, db=self._index)
            return 0

        self._write(write)

    def size_of(self, gkey: bytes) -> int | None:
        """Stored value size, from the index record (no payload read)."""
        rec = self._record(_key(gkey))
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

        def write(txn: lmdb.Transaction) -> int:
            nonlocal found, freed
            found, delta = 0, 0
            gone.clear()
            for k in keys:
                old = txn.get(k, db=self._index)
                if old is None:
                    continue
                off, length, _ = _REC.unpack_from(old)
                txn.delete(k, db=self._index)
                gone.append(off)
                delta -= length
                found += 1
            freed = -delta
            return delta

        if keys:
            self._write(write)
            self._free_after_readers(gone)
        return found, freed

    def contains(self, gkey: bytes) -> bool:
        return self.size_of(gkey) is not None

    def __len__(self) -> int:
        with self._read() as txn:
            return txn.stat(self._index)["entries"]

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
            for batch in self._scan_index():
                for k, raw in batch:
                    yield k, raw[_REC.size:], _REC.unpack_from(raw)[1]
                if bar is not None:
                    bar.update(len(batch))
        finally:
            if bar is not None:
                bar.close()

    def _scan_index(self) -> Iterator[list[tuple[bytes, bytes]]]:
        """The index in key order, in batches read by short transactions: a long-lived reader
        would pin LMDB's free pages and block a map resize if the caller writes meanwhile."""
        start = b""
        while True:
            with self._read() as txn:
                cur = txn.cursor(db=self._index)
                ok = cur.set_range(start) if start else cur.first()
                batch = []
                while ok and len(batch) < _SCAN_BATCH:
                    batch.append(cur.item())
                    ok = cur.next()
            if batch:
                yield batch
            if len(batch) < _SCAN_BATCH:
                return
            start = batch[-1][0] + b"\x00"     # the smallest key after the last one

    # -- namespaces and state -----------------------------------------------------------------
    def put_namespace(self, ns_id: bytes, spec_json: bytes) -> None:
        k, v = _key(ns_id), _blob(spec_json, "namespace spec")
        self._write(lambda txn: (txn.put(k, bytes(v), db=self._ns), 0)[1])

    def namespaces(self) -> dict[bytes, bytes]:
        with self._read() as txn:
            return dict(txn.cursor(db=self._ns))

    def put_state(self, name: str, blob: bytes) -> None:
        k, v = _state_key(name), _blob(blob, "state blob")
        self._write(lambda txn: (txn.put(k, bytes(v), db=self._state), 0)[1])

    def get_state(self, name: str) -> bytes | None:
        k = _state_key(name)
        with self._read() as txn:
            return txn.get(k, db=self._state)

    # -- files and lifetime -------------------------------------------------------------------
    def data_files(self) -> list[str]:
        """The payload file, e.g. for dropping its page cache in benchmarks."""
        return [self._payload_path]

    @property
    def direct_io(self) -> bool:
        """Whether payloads are written with O_DIRECT (False: the filesystem refused it)."""
        return self._dfd is not None

    @property
    def map_size(self) -> int:
        return self._env.info()["map_size"]

    @property
    def file_bytes(self) -> int:
        """Bytes the payload file holds on disk (preallocated), for capacity planning."""
        return self._file_size

    def sync(self) -> None:
        """Flush payloads, then the index (a no-op cost when opened with sync=True)."""
        self._check_open()
        os.fdatasync(self._fd)
        self._env.sync(True)

    def image_section(self, name: str) -> bytes | memoryview | None:
        """A section the store saved with `close(image=...)` at the last clean stop, if the
        image is current (else None: rebuild from `scan_meta`). Each is handed out once."""
        return None if self._image is None else self._image.pop(name, None)

    def close(self, image: dict[str, bytes] | None = None) -> None:
        """Sync and close. `image`: the store's sections of an index image to write for the
        next open (tiers/ssd_image.py); the tier adds its allocator's."""
        if self._closed:
            return
        with self._write_lock, self._gate:
            while self._readers:
                self._gate.wait()
            self._closed = True
            try:
                os.fdatasync(self._fd)
                if image is not None:
                    self._write_image(image)
                if not self._sync:
                    self._env.sync(True)
            finally:
                self._close_files()

    def _read_image(self, txnid: int) -> dict[str, memoryview] | None:
        with self._env.begin() as txn:
            token = txn.get(_IMAGE_KEY, db=self._tier)
            if token is None:
                return None
            raw = txn.get(_USED_KEY, db=self._tier)
            entries = txn.stat(self._index)["entries"]
        used = _SIZE.unpack(raw)[0] if raw else 0
        return read_image(self.path, Stamp(bytes(token), txnid, entries, used))

    def _alloc_from_image(self) -> ExtentAllocator | None:
        blob = None if self._image is None else self._image.pop(_ALLOC_SECTION, None)
        if blob is None:
            return None
        try:
            alloc = ExtentAllocator.from_state(msgpack.unpackb(blob))
        except (InvalidArgument, ValueError, TypeError) as exc:
            log.warning("ignoring the SSD index image of %s: %s", self.path, exc)
            return None
        if alloc.capacity < self._file_size:
            alloc.grow(self._file_size)
        return alloc

    def _write_image(self, sections: dict[str, bytes]) -> None:
        """Commit a fresh token into LMDB, make LMDB durable, then write the image stamped
        with that token and LMDB's transaction id. Failure only costs the next open a scan."""
        with self._alloc_lock:
            self._drain()
            if self._active or self._pending:    # a reader still holds extents: no image
                return
            try:
                alloc = msgpack.packb(self._alloc.state())
            except InvalidArgument:             # an inconsistent map: the next open scans
                remove_image(self.path)
                return
        token = os.urandom(16)
        try:
            with self._env.begin(write=True) as txn:
                txn.put(_IMAGE_KEY, token, db=self._tier)
                raw = txn.get(_USED_KEY, db=self._tier)
                entries = txn.stat(self._index)["entries"]
            self._env.sync(True)
            stamp = Stamp(token, self._env.info()["last_txnid"], entries,
                          _SIZE.unpack(raw)[0] if raw else 0)
            write_image(self.path, stamp, {**sections, _ALLOC_SECTION: alloc})
        except (lmdb.Error, OSError) as exc:
            log.warning("no index image written for %s (the next start scans the index): %s",
                        self.path, exc)
            remove_image(self.path)

    def _close_files(self) -> None:
        if self._write_pool is not None:
            self._write_pool.shutdown(wait=True)
        for fd in (self._fd, self._dfd_opened):
            if fd is not None:
                os.close(fd)
        self._fd = self._dfd = self._dfd_opened = None  # type: ignore[assignment]
        self._env.close()

    def __enter__(self) -> SSDTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals: payload file --------------------------------------------------------------
    def _allocate(self, sizes: list[int]) -> list[int]:
        """Extents for a batch; the file grows (preallocated) when no free extent fits."""
        with self._alloc_lock:
            offsets: list[int] = []
            try:
                for size in sizes:
                    while True:
                        try:
                            offsets.append(self._alloc.alloc(size))
                            break
                        except ResourceExhausted:
                            self._grow_file(size)
            except BaseException:
                for off in offsets:
                    self._alloc.free(off)
                raise
            return offsets

    def _grow_file(self, need: int) -> None:
        """Preallocate GROW_STEP more (or `need`, if larger) at the end of the payload file;
        on a filesystem with less room than a step, just `need` (DiskFull when not even that
        fits)."""
        exact = self._file_size + -(-need // ALIGN) * ALIGN
        # A small tier (tests, a sidecar with little disk) must not pin a whole big step.
        step = min(GROW_STEP, max(MIN_GROW_STEP, self.capacity // 8 // ALIGN * ALIGN))
        new = max(self._file_size + step, exact)
        if new > _ADDRESS_LIMIT:
            raise ResourceExhausted(f"SSD payload file at {self._payload_path} cannot grow "
                                    "further")
        while True:
            try:
                os.posix_fallocate(self._fd, self._file_size, new - self._file_size)
                break
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT) and new > exact:
                    new = exact             # a nearly full disk: only what this write needs
                    continue
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise DiskFull(self.path, free_bytes(self.path),
                                   f"cannot grow the payload file to {new} bytes: {exc}"
                                   ) from None
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(self._fd, new)     # no preallocation on this filesystem: sparse
                break
        self._file_size = new
        self._alloc.grow(new)

    def _writer(self) -> ThreadPoolExecutor:
        """The one thread that writes filled runs (made on first use)."""
        with self._alloc_lock:
            if self._write_pool is None:
                self._write_pool = ThreadPoolExecutor(1, thread_name_prefix="kvstore-ssd-write")
            return self._write_pool

    def _pwrite_run(self, stage: mmap.mmap, total: int, start: int,
                    values: list[tuple[int, int]]) -> None:
        """Write a filled run: one O_DIRECT pwrite of the whole aligned run, or, where the
        filesystem refuses O_DIRECT, each value's bytes with buffered pwrites."""
        dfd = self._dfd
        if dfd is not None:
            try:
                _pwrite_all(dfd, memoryview(stage)[:total], start)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                log.warning("O_DIRECT writes fail on %s (%s); using buffered writes",
                            self.path, exc)
                # Not closed here: another thread may be writing through it right now.
                self._dfd = None
        with memoryview(stage) as view:
            for pos, n in values:
                _pwrite_all(self._fd, view[pos:pos + n], start + pos)

    # -- internals: deferred frees ------------------------------------------------------------
    @contextmanager
    def _pinned(self) -> Iterator[None]:
        """Mark a reader: extents freed from now on stay allocated until it is done."""
        with self._alloc_lock:
            epoch = self._epoch
            self._active[epoch] = self._active.get(epoch, 0) + 1
        try:
            yield
        finally:
            with self._alloc_lock:
                n = self._active[epoch] - 1
                if n:
                    self._active[epoch] = n
                else:
                    del self._active[epoch]
                self._drain()

    def _free_after_readers(self, offsets: list[int]) -> None:
        if not offsets:
            return
        with self._alloc_lock:
            for off in offsets:
                self._pending.append((self._epoch, off))
            self._epoch += 1
            self._drain()

    def _drain(self) -> None:
        oldest = min(self._active) if self._active else self._epoch
        while self._pending and self._pending[0][0] < oldest:
            self._alloc.free(self._pending.popleft()[1])

    def _free_now(self, offsets: list[int]) -> None:
        """Give back extents nothing ever pointed at (a batch that failed before commit)."""
        with self._alloc_lock:
            for off in offsets:
                self._alloc.free(off)

    # -- internals: index ---------------------------------------------------------------------
    def _record(self, k: bytes) -> tuple[int, int, int, bytes] | None:
        with self._read() as txn:
            raw = txn.get(k, db=self._index)
        if raw is None:
            return None
        off, length, checksum = _REC.unpack_from(raw)
        return off, length, checksum, raw[_REC.size:]

    def _scan_extents(self) -> tuple[list[tuple[int, int]], int]:
        """Every stored extent and the bytes they hold, for rebuilding the allocator."""
        extents: list[tuple[int, int]] = []
        used = 0
        unpack = _REC.unpack_from
        for batch in self._scan_index():
            for _, raw in batch:
                off, length, _ = unpack(raw)
                extents.append((off, extent_size(length)))
                used += length
        return extents, used

    def _check_format(self) -> None:
        with self._env.begin(write=True) as txn:
            fmt = txn.get(_FORMAT_KEY, db=self._tier)
            if fmt is None:
                txn.put(_FORMAT_KEY, FORMAT, db=self._tier)
        if fmt is not None and fmt != FORMAT:
            self._env.close()
            raise Unavailable(f"the SSD tier at {self.path} has format {fmt.decode()!r}; "
                              f"this build reads format {FORMAT.decode()!r} only (move the "
                              "folder away or run the build that wrote it)")

    def _migrate_legacy(self) -> None:
        """Copy a folder of the old format (payloads in LMDB at the top) into this one, then
        remove the old files. A crash midway leaves them, and the next open starts again."""
        try:
            old = lmdb.open(self.path, subdir=True, readonly=True, lock=False, max_dbs=8)
        except lmdb.Error as exc:
            raise Unavailable(f"the SSD tier at {self.path} is in the old format and cannot be "
                              f"read for migration ({exc}); move the folder away") from exc
        moved = 0
        try:
            dbs = {n: old.open_db(n, create=False) for n in (b"blocks", b"meta", b"namespaces",
                                                            b"state")}
            with old.begin() as txn:
                for k, v in txn.cursor(db=dbs[b"namespaces"]):
                    self.put_namespace(k, v)
                for k, v in txn.cursor(db=dbs[b"state"]):
                    self._write(lambda t, k=k, v=v: (t.put(k, v, db=self._state), 0)[1])
                batch: list[tuple[bytes, bytes, bytes]] = []
                for k, raw in txn.cursor(db=dbs[b"meta"]):
                    value = txn.get(k, db=dbs[b"blocks"])
                    if value is None:
                        continue
                    batch.append((k, value, raw[_SIZE.size:]))
                    if len(batch) == _MIGRATE_BATCH:
                        self.put_many(batch)
                        moved += len(batch)
                        batch = []
                self.put_many(batch)
                moved += len(batch)
        except (lmdb.Error, KeyError) as exc:
            raise Unavailable(f"the SSD tier at {self.path} is in the old format and its "
                              f"migration failed ({exc}); move the folder away") from exc
        finally:
            old.close()
        self.sync()
        for name in ("data.mdb", "lock.mdb"):
            try:
                os.unlink(os.path.join(self.path, name))
            except FileNotFoundError:
                pass
        log.warning("migrated %d blocks of the SSD tier at %s to the payload-file format",
                    moved, self.path)

    def _check_open(self) -> None:
        if self._closed:
            raise Unavailable("the SSD tier is closed")

    @contextmanager
    def _read(self) -> Iterator[lmdb.Transaction]:
        with self._gate:
            while self._resizing:
                self._gate.wait()
            self._check_open()
            self._readers += 1
        try:
            with self._env.begin() as txn:
                yield txn
        finally:
            with self._gate:
                self._readers -= 1
                if not self._readers:
                    self._gate.notify_all()

    def _write(self, fn: Callable[[lmdb.Transaction], int]) -> None:
        """Run fn in a write transaction (fn returns the used_bytes delta).

        On MapFullError the transaction is aborted, the map grows and fn runs once more.
        """
        with self._write_lock:
            self._check_open()
            for attempt in range(2):
                try:
                    with self._env.begin(write=True) as txn:
                        delta = fn(txn)
                        used = self.used_bytes + delta
                        if delta:
                            txn.put(_USED_KEY, _SIZE.pack(used), db=self._tier)
                    self.used_bytes = used
                    return
                except lmdb.MapFullError:
                    if attempt:
                        raise ResourceExhausted(
                            f"SSD index map full at {self.map_size} bytes even after growing "
                            f"({self.used_bytes} of {self.capacity} bytes used); evict first"
                        ) from None
                    self._grow()
                except lmdb.Error as exc:
                    free = free_bytes(self.path)
                    if _is_enospc(exc) or (_is_eio(exc) and free < DISK_FULL_BYTES):
                        raise DiskFull(self.path, free, exc) from None
                    raise

    def _grow(self) -> None:
        """Enlarge the map by half (needs every read transaction of this process closed)."""
        with self._gate:
            self._resizing = True
            try:
                while self._readers:
                    self._gate.wait()
                cur = self._env.info()["map_size"]
                self._env.set_mapsize(max(cur + cur // 2, initial_map_size(self.capacity)))
            finally:
                self._resizing = False
                self._gate.notify_all()


class _Buffers:
    """Page-aligned write buffers (O_DIRECT needs aligned memory), shared by the threads that
    write runs and reused: a fresh multi-MiB buffer page-faults on every use
    (docs/performance.md)."""

    def __init__(self) -> None:
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> mmap.mmap:
        with self._lock:
            for i, buf in enumerate(self._free):
                if len(buf) >= nbytes:
                    return self._free.pop(i)
        return _populated(max(nbytes, RUN_BYTES))

    def give(self, buf: mmap.mmap) -> None:
        with self._lock:
            if len(self._free) < MAX_FREE_BUFFERS:
                self._free.append(buf)

    def prefault(self, n: int) -> None:
        for _ in range(n):
            self.give(_populated(RUN_BYTES))


def _populated(nbytes: int) -> mmap.mmap:
    """An anonymous mapping with its pages already faulted in (where MAP_POPULATE exists)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, nbytes, flags=flags)


def _open_direct(path: str) -> int | None:
    """An O_DIRECT descriptor for the payload file, or None where the filesystem refuses it."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_RDWR | os.O_CLOEXEC | flag)
    except OSError as exc:
        log.info("no O_DIRECT for %s (%s); payloads use buffered writes", path, exc)
        return None


def _runs(offsets: list[int], sizes: list[int]) -> list[list[int]]:
    """Item indexes grouped into runs of adjacent extents, in file order, each at most
    RUN_BYTES (or one item): one pwrite each, and several runs to spread over threads."""
    order = sorted(range(len(offsets)), key=offsets.__getitem__)
    runs: list[list[int]] = []
    end = start = -1
    for i in order:
        if runs and offsets[i] == end and end + sizes[i] - start <= RUN_BYTES:
            runs[-1].append(i)
        else:
            runs.append([i])
            start = offsets[i]
        end = offsets[i] + sizes[i]
    return runs


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        if n <= 0:
            raise OSError(errno.EIO, f"short write at offset {offset}")
        data, offset = data[n:], offset + n


def _key(k: object) -> bytes:
    if not isinstance(k, bytes | bytearray | memoryview):
        raise InvalidArgument(f"SSD tier keys must be bytes, got {type(k).__name__}")
    k = bytes(k)
    if not 0 < len(k) <= MAX_KEY:
        raise InvalidArgument(f"SSD tier key must be 1..{MAX_KEY} bytes, got {len(k)}")
    return k


def _length(n: object) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n < _ADDRESS_LIMIT:
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


def _is_enospc(exc: lmdb.Error) -> bool:
    return (getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
            or "No space" in str(exc) or "quota" in str(exc).lower())


def _is_eio(exc: lmdb.Error) -> bool:
    """LMDB reports a short write (the disk filled mid-commit) as EIO."""
    return getattr(exc, "errno", None) == errno.EIO or "Input/output error" in str(exc)
