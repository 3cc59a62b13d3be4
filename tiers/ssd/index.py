"""The SSD tier's LMDB index: a record per block naming its extent in the payload file.

Why LMDB here (and not for the payloads, tiers/ssd/payload.py): small records and atomic
commits are what it is good at. Named sub-databases live in one environment, so one write
transaction is atomic across them:
  `index`      gkey -> offset, value length, xxh3-64 of the value (24 bytes, little-endian)
               + the caller's msgpack record
  `namespaces` ns_id -> namespace spec JSON
  `state`      name -> blob (policy snapshots and the like, owned by the store)
  `_tier`      `used_bytes`: the extents the values take in the payload file (updated in the
               same transaction as every put and delete, so it is exact after a crash; an
               earlier build kept the sum of value lengths here, which the tier's open
               replaces, tiers/ssd/tier.py), `format`, and the token of the last index image

Why a read gate: growing the map (`set_mapsize`, on MapFullError) needs no live transaction
in this process, so readers count themselves in and a resize waits for them to leave. The map
starts at about 64 bytes of records per byte of capacity and grows by half when full.

Why the file's length is checked before LMDB maps it (`check_length`): LMDB reads its pages
through a memory map, and a page past the end of a truncated file is a SIGBUS that kills the
process with no word; its meta pages say how many pages the file holds, so a short file is
refused with one line instead.

Why owner-only modes (0700 folder, 0600 files): the records name models and tenants and hold
block keys (and, with KV events, prompts' token ids); other users must not read them.

Why short transactions for a scan: a long-lived reader pins LMDB's free pages and would block
a map resize while the caller writes meanwhile.

Why the block count is kept in memory (`entries`, set after every write transaction, as
`used_bytes` is): beginning a read transaction writes LMDB's reader table in lock.mdb, and
py-lmdb holds the GIL while it does; on a frozen or stalled filesystem that write waits, and so
does every thread of the process. Stats and metrics scrapes read the two counts, never LMDB.

Why a damaged file is refused in one line (`unreadable`): LMDB reports a page it cannot make
sense of (CorruptedError, PageNotFoundError, ...) as an exception from whichever read meets it;
at open that names the file and what the operator can do, not a traceback.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import lmdb
from kvstore_client.common.errors import ResourceExhausted, Unavailable

from .disk_full import DISK_FULL_BYTES, DiskFull, free_bytes, is_eio, is_enospc
from .image import Stamp

FORMAT = b"2"
REC = struct.Struct("<QQQ")         # offset, value length, xxh3-64 of the value
_SIZE = struct.Struct("<Q")
_USED_KEY = b"used_bytes"
_FORMAT_KEY = b"format"
_IMAGE_KEY = b"image"              # token of the index image written at the last clean stop
MAX_KEY = 511                       # LMDB's compiled-in key size limit
MAP_SLACK = 64 << 20
_SCAN_BATCH = 8192
DATA_FILE = "data.mdb"
# LMDB 0.9's meta page (lmdb/mdb.c, MDB_meta after a 16-byte page header): magic, version, ...;
# the first MDB_db's md_pad holds the page size; then the last page used and the txn id.
_PAGE_HEADER = 16
_META_MAGIC = 0xBEEFC0DE
_META_HEAD = struct.Struct("=II")           # mm_magic, mm_version
_META_PSIZE = struct.Struct("=I")           # mm_dbs[0].md_pad, at 24
_META_TAIL = struct.Struct("=QQ")           # mm_last_pg, mm_txnid, at 120
_META_BYTES = 136
# What LMDB raises for a file whose pages it cannot make sense of.
_DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError,
           lmdb.IncompatibleError, lmdb.PanicError, lmdb.VersionMismatchError,
           lmdb.BadValsizeError)


def unreadable(folder: str, exc: BaseException) -> Unavailable:
    """The one-line error for an SSD tier's index that LMDB cannot read (module docstring)."""
    path = os.path.join(folder, "index", DATA_FILE)
    if isinstance(exc, _DAMAGE):
        return Unavailable(f"{path} is damaged ({exc}); restore the SSD tier's folder from a "
                           f"backup, or move {folder} away to start with an empty SSD tier")
    return Unavailable(f"cannot read {path}: {exc}")


def check_length(index_dir: str) -> None:
    """Refuse a data.mdb shorter than the pages its newest meta page says it uses (a truncated
    copy or a disk that lost the file's tail): LMDB would SIGBUS on the first missing page.
    Anything this cannot parse is left to LMDB, which reports what it finds."""
    path = os.path.join(index_dir, DATA_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError:
        return                          # LMDB's own open says why
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, _PAGE_HEADER + _META_BYTES, 0)
        metas = []
        psize = 0
        for i in range(2):
            if i:
                if psize < 512 or psize & (psize - 1):
                    return
                head = os.pread(fd, _PAGE_HEADER + _META_BYTES, psize)
            if len(head) < _PAGE_HEADER + _META_BYTES:
                return                  # too short to hold two meta pages: LMDB's error
            magic, _version = _META_HEAD.unpack_from(head, _PAGE_HEADER)
            if magic != _META_MAGIC:
                return
            if not i:
                psize = _META_PSIZE.unpack_from(head, _PAGE_HEADER + 24)[0]
            metas.append(_META_TAIL.unpack_from(head, _PAGE_HEADER + 120))
    finally:
        os.close(fd)
    last_pg, _txnid = max(metas, key=lambda m: m[1])       # LMDB opens the newest
    need = (last_pg + 1) * psize
    if size < need:
        raise Unavailable(
            f"{path} is {size} bytes but its header says it holds {need} (truncated, or copied "
            f"while written); restore it from a backup, or move {os.path.dirname(index_dir)} "
            "away to start with an empty SSD tier")


def initial_map_size(capacity: int) -> int:
    """LMDB map size for a byte cap: records only (~150 bytes a block), grown when full."""
    return capacity // 64 + MAP_SLACK


class LmdbIndex:
    """The LMDB environment of one SSD tier. Thread-safe: commits serialize on a lock, reads
    run concurrently behind the read gate.

    `used_bytes` (the extents of the stored values) changes only inside a write transaction,
    under the write lock, and is published after the commit.
    """

    def __init__(self, folder: str, capacity: int, sync: bool) -> None:
        self.folder = folder
        self.capacity = capacity
        index_dir = os.path.join(folder, "index")
        os.makedirs(index_dir, mode=0o700, exist_ok=True)
        check_length(index_dir)
        try:
            # mode: LMDB makes data.mdb and lock.mdb with it, less the execute bits (0600).
            self._env = lmdb.open(
                index_dir, map_size=initial_map_size(capacity), subdir=True, readahead=False,
                writemap=False, sync=sync, metasync=sync, max_dbs=8, lock=True,
                max_readers=512, meminit=False, mode=0o700)
        except lmdb.Error as exc:
            if isinstance(exc, _DAMAGE):
                raise unreadable(folder, exc) from None
            raise Unavailable(f"cannot open the SSD tier at {folder}: {exc}") from exc
        self._write_lock = threading.Lock()
        self._gate = threading.Condition()
        self._readers = 0
        self._resizing = False
        self.closed = False
        try:
            self.opened_txnid = self._env.info()["last_txnid"]   # before anything here writes
            self.blocks = self._env.open_db(b"index")
            self._ns = self._env.open_db(b"namespaces")
            self._state = self._env.open_db(b"state")
            self._tier = self._env.open_db(b"_tier")
            self._check_format()
            with self._env.begin(db=self._tier) as txn:
                raw = txn.get(_USED_KEY)
                # The record count in memory (module docstring), kept by write().
                self.entries: int = txn.stat(self.blocks)["entries"]
        except lmdb.Error as exc:
            self._env.close()
            raise unreadable(folder, exc) from None
        # A damaged count is recounted by the tier's scan of the records (None).
        self.saved_used: int | None = (_SIZE.unpack(raw)[0] if raw is not None
                                       and len(raw) == _SIZE.size else None)
        self.used_bytes = self.saved_used or 0

    def _check_format(self) -> None:
        with self._env.begin(write=True) as txn:
            fmt = txn.get(_FORMAT_KEY, db=self._tier)
            if fmt is None:
                txn.put(_FORMAT_KEY, FORMAT, db=self._tier)
        if fmt is not None and fmt != FORMAT:
            self._env.close()
            raise Unavailable(f"the SSD tier at {self.folder} has format "
                              f"{fmt.decode(errors='replace')!r}; "
                              f"this build reads format {FORMAT.decode()!r} only (move the "
                              "folder away or run the build that wrote it)")

    def check_open(self) -> None:
        if self.closed:
            raise Unavailable("the SSD tier is closed")

    # -- transactions -------------------------------------------------------------------------
    @contextmanager
    def read(self) -> Iterator[lmdb.Transaction]:
        """A read transaction (behind the gate: a map resize waits for it to end)."""
        with self._gate:
            while self._resizing:
                self._gate.wait()
            self.check_open()
            self._readers += 1
        try:
            with self._env.begin() as txn:
                yield txn
        finally:
            with self._gate:
                self._readers -= 1
                if not self._readers:
                    self._gate.notify_all()

    def write(self, fn: Callable[[lmdb.Transaction], int]) -> None:
        """Run fn in a write transaction (fn returns the used_bytes delta); `used_bytes` and
        `entries` are published after the commit. used_bytes never goes below 0: a damaged
        record's length is not subtracted (SSDTier), but a count is never a reason for a
        delete to fail.

        On MapFullError the transaction is aborted, the map grows and fn runs once more.
        """
        with self._write_lock:
            self.check_open()
            for attempt in range(2):
                try:
                    with self._env.begin(write=True) as txn:
                        delta = fn(txn)
                        used = max(0, self.used_bytes + delta)
                        if used != self.used_bytes:
                            txn.put(_USED_KEY, _SIZE.pack(used), db=self._tier)
                        entries = txn.stat(self.blocks)["entries"]
                    self.used_bytes = used
                    self.entries = entries
                    return
                except lmdb.MapFullError:
                    if attempt:
                        raise ResourceExhausted(
                            f"SSD index map full at {self.map_size} bytes even after growing "
                            f"({self.used_bytes} of {self.capacity} bytes used); evict first"
                        ) from None
                    self._grow()
                except lmdb.Error as exc:
                    free = free_bytes(self.folder)
                    if is_enospc(exc) or (is_eio(exc) and free < DISK_FULL_BYTES):
                        raise DiskFull(self.folder, free, exc) from None
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

    # -- records ------------------------------------------------------------------------------
    def record(self, k: bytes) -> tuple[int, int, int, bytes] | None:
        """(offset, length, checksum, meta) of a stored key (None: not stored, or a record too
        short to name an extent, which no read serves)."""
        with self.read() as txn:
            raw = txn.get(k, db=self.blocks)
        if raw is None or len(raw) < REC.size:
            return None
        off, length, checksum = REC.unpack_from(raw)
        return off, length, checksum, raw[REC.size:]

    def count(self) -> int:
        """LMDB's own count of the block records (a read transaction; `entries` is the same
        without one)."""
        with self.read() as txn:
            return txn.stat(self.blocks)["entries"]

    def scan(self) -> Iterator[list[tuple[bytes, bytes]]]:
        """The records in key order, in batches read by short transactions (module
        docstring). Unavailable (`unreadable`) when LMDB finds the file damaged."""
        start = b""
        while True:
            try:
                with self.read() as txn:
                    cur = txn.cursor(db=self.blocks)
                    ok = cur.set_range(start) if start else cur.first()
                    batch = []
                    while ok and len(batch) < _SCAN_BATCH:
                        batch.append(cur.item())
                        ok = cur.next()
            except lmdb.Error as exc:
                raise unreadable(self.folder, exc) from None
            if batch:
                yield batch
            if len(batch) < _SCAN_BATCH:
                return
            start = batch[-1][0] + b"\x00"     # the smallest key after the last one

    # -- namespaces and state -----------------------------------------------------------------
    def put_namespace(self, k: bytes, v: bytes) -> None:
        self.write(lambda txn: (txn.put(k, v, db=self._ns), 0)[1])

    def delete_namespace(self, k: bytes) -> None:
        self.write(lambda txn: (txn.delete(k, db=self._ns), 0)[1])

    def namespaces(self) -> dict[bytes, bytes]:
        try:
            with self.read() as txn:
                return dict(txn.cursor(db=self._ns))
        except lmdb.Error as exc:
            raise unreadable(self.folder, exc) from None

    def put_state(self, k: bytes, v: bytes) -> None:
        self.write(lambda txn: (txn.put(k, v, db=self._state), 0)[1])

    def get_state(self, k: bytes) -> bytes | None:
        try:
            with self.read() as txn:
                return txn.get(k, db=self._state)
        except lmdb.Error as exc:
            raise unreadable(self.folder, exc) from None

    # -- the index image's stamp --------------------------------------------------------------
    def image_stamp(self) -> Stamp | None:
        """What an index image must carry to be current: the token of the last clean stop and
        LMDB as this open found it (None: no image was written since the last change)."""
        try:
            with self._env.begin() as txn:
                token = txn.get(_IMAGE_KEY, db=self._tier)
                if token is None:
                    return None
                raw = txn.get(_USED_KEY, db=self._tier)
                entries = txn.stat(self.blocks)["entries"]
        except lmdb.Error as exc:
            raise unreadable(self.folder, exc) from None
        used = _SIZE.unpack(raw)[0] if raw and len(raw) == _SIZE.size else 0
        return Stamp(bytes(token), self.opened_txnid, entries, used)

    def commit_image_token(self, token: bytes) -> Stamp:
        """Commit a fresh image token and make LMDB durable; the stamp an image written now
        carries. Only while `quiesced` (no other write can follow it)."""
        with self._env.begin(write=True) as txn:
            txn.put(_IMAGE_KEY, token, db=self._tier)
            raw = txn.get(_USED_KEY, db=self._tier)
            entries = txn.stat(self.blocks)["entries"]
        self._env.sync(True)
        return Stamp(token, self._env.info()["last_txnid"], entries,
                     _SIZE.unpack(raw)[0] if raw and len(raw) == _SIZE.size else 0)

    # -- lifetime -----------------------------------------------------------------------------
    @property
    def map_size(self) -> int:
        return self._env.info()["map_size"]

    def sync(self) -> None:
        self._env.sync(True)

    @contextmanager
    def quiesced(self) -> Iterator[None]:
        """No write and no reader until the end of the block, which closes the index: for the
        tier's close (its last commits, the image, the syncs)."""
        with self._write_lock, self._gate:
            while self._readers:
                self._gate.wait()
            self.closed = True
            yield

    def close(self) -> None:
        self.closed = True
        self._env.close()
