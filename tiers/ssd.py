"""SSD tier: framed block values in an LMDB environment on local disk; survives restarts.

Layout (named sub-databases of one environment, so one write transaction is atomic across them):
- `blocks`     gkey -> framed value (tiers/frame.py), large values live in overflow pages
- `meta`       gkey -> 8-byte little-endian value size + the caller's msgpack record; the size
               prefix lets `scan_meta` rebuild the index (sizes included) without touching a
               single payload page
- `namespaces` ns_id -> namespace spec JSON
- `state`      name -> blob (policy snapshots and the like, owned by the store)
- `_tier`      this module's own bookkeeping (`used_bytes`), updated in the same transaction
               as every put/delete so it is exact after a crash or restart

Why these LMDB flags (PERF-NOTES): `readahead=True` (off makes cold reads of large values 10x
slower), `writemap=False` (on halves put speed on ext4). The caller (store) keeps
`used_bytes` under `capacity`; the map is sized with head room above that for page rounding
and LMDB's free-page reuse, and grows on the rare MapFullError instead of failing.
"""

from __future__ import annotations

import errno
import os
import struct
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import lmdb
from kvstore_client.errors import InvalidArgument, ResourceExhausted, Unavailable

T = TypeVar("T")

_SIZE = struct.Struct("<Q")
_USED_KEY = b"used_bytes"
MAX_KEY = 511                       # LMDB's compiled-in key size limit
MAP_SLACK = 64 << 20
PROGRESS_MIN_ENTRIES = 50_000       # scan_meta shows a progress bar above this many entries
_SCAN_BATCH = 8192


def initial_map_size(capacity: int) -> int:
    """Map size for a byte cap: 1.5x for overflow-page rounding and free-page reuse, + 64 MiB."""
    return int(capacity * 1.5) + MAP_SLACK


class SSDTier:
    """Keyed tier on LMDB. Thread-safe: writes serialize on a lock, reads run concurrently.

    `used_bytes` changes only inside a write transaction, under the write lock, and is published
    after the commit; a reader on another thread sees the value before or after a write, never
    a mix. The store writes demotion batches without its own lock while other threads read,
    delete and evict here, so nothing in this class may call back into the store.
    """

    name = "ssd"

    def __init__(self, path: str, capacity: int, sync: bool = False) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0:
            raise InvalidArgument(f"ssd.capacity must be a positive number of bytes, "
                                  f"got {capacity!r}")
        self.path = os.fspath(path)
        self.capacity = capacity
        self._sync = sync
        os.makedirs(self.path, exist_ok=True)
        try:
            self._env = lmdb.open(
                self.path, map_size=initial_map_size(capacity), subdir=True, readahead=True,
                writemap=False, sync=sync, metasync=sync, max_dbs=8, lock=True,
                max_readers=512, meminit=False)
        except lmdb.Error as exc:
            raise Unavailable(f"cannot open the SSD tier at {self.path}: {exc}") from exc
        self._blocks = self._env.open_db(b"blocks")
        self._meta = self._env.open_db(b"meta")
        self._ns = self._env.open_db(b"namespaces")
        self._state = self._env.open_db(b"state")
        self._tier = self._env.open_db(b"_tier")
        self._write_lock = threading.Lock()
        # read gate: set_mapsize needs no live transaction in this process
        self._gate = threading.Condition()
        self._readers = 0
        self._resizing = False
        self._closed = False
        with self._env.begin(db=self._tier) as txn:
            raw = txn.get(_USED_KEY)
        self.used_bytes = _SIZE.unpack(raw)[0] if raw else self._recount()

    # -- blocks -------------------------------------------------------------------------------
    def put(self, gkey: bytes, value: bytes, meta: bytes) -> None:
        """Store (or overwrite) one framed value and its meta record."""
        self.put_many([(gkey, value, meta)])

    def put_many(self, items: list[tuple[bytes, bytes, bytes]]) -> None:
        """Store a batch in one transaction (demotion batches: one commit, one fsync)."""
        checked = [(_key(k), _blob(v, "value"), _blob(m, "meta")) for k, v, m in items]
        if not checked:
            return

        def write(txn: lmdb.Transaction) -> int:
            delta = 0
            for k, v, m in checked:
                old = txn.get(k, db=self._meta)
                if old is not None:
                    delta -= _SIZE.unpack_from(old)[0]
                txn.put(k, v, db=self._blocks)
                txn.put(k, _SIZE.pack(memoryview(v).nbytes) + bytes(m), db=self._meta)
                delta += memoryview(v).nbytes
            return delta

        self._write(write)

    def get(self, gkey: bytes) -> bytes | None:
        """The framed value (a private copy), or None."""
        k = _key(gkey)
        with self._read() as txn:
            return txn.get(k, db=self._blocks)

    def get_many(self, gkeys: Iterable[bytes]) -> list[bytes | None]:
        """Values for many keys in one read transaction (None for missing)."""
        keys = [_key(k) for k in gkeys]
        with self._read() as txn:
            return [txn.get(k, db=self._blocks) for k in keys]

    def visit(self, gkey: bytes, fn: Callable[[memoryview], T]) -> T | None:
        """Call fn on a zero-copy view of the value inside the read transaction.

        Why: decoding straight out of LMDB's map saves one copy of every promoted block. The
        view is only valid during the call; fn must not keep it. None if the key is missing.
        """
        k = _key(gkey)
        with self._read(buffers=True) as txn:
            view = txn.get(k, db=self._blocks)
            if view is None:
                return None
            return fn(view)

    def get_meta(self, gkey: bytes) -> bytes | None:
        k = _key(gkey)
        with self._read() as txn:
            raw = txn.get(k, db=self._meta)
        return None if raw is None else raw[_SIZE.size:]

    def set_meta(self, gkey: bytes, meta: bytes) -> None:
        """Replace the meta record of a stored key (InvalidArgument if it is not stored)."""
        k, m = _key(gkey), _blob(meta, "meta")

        def write(txn: lmdb.Transaction) -> int:
            old = txn.get(k, db=self._meta)
            if old is None:
                raise InvalidArgument(f"cannot set meta of key {k.hex()}: not in the SSD tier")
            txn.put(k, old[:_SIZE.size] + bytes(m), db=self._meta)
            return 0

        self._write(write)

    def size_of(self, gkey: bytes) -> int | None:
        """Stored value size, from the meta record (no payload read)."""
        k = _key(gkey)
        with self._read() as txn:
            raw = txn.get(k, db=self._meta)
        return None if raw is None else _SIZE.unpack_from(raw)[0]

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

        def write(txn: lmdb.Transaction) -> int:
            nonlocal found, freed
            found, delta = 0, 0
            for k in keys:
                old = txn.get(k, db=self._meta)
                if old is not None:
                    delta -= _SIZE.unpack_from(old)[0]
                    txn.delete(k, db=self._meta)
                if txn.delete(k, db=self._blocks) or old is not None:
                    found += 1
            freed = -delta
            return delta

        if keys:
            self._write(write)
        return found, freed

    def contains(self, gkey: bytes) -> bool:
        return self.size_of(gkey) is not None

    def __len__(self) -> int:
        with self._read() as txn:
            return txn.stat(self._meta)["entries"]

    def scan_meta(self) -> Iterator[tuple[bytes, bytes, int]]:
        """(gkey, meta, value size) of every stored block, reading only the meta database.

        Rebuilds the store's index on open; shows a tqdm bar on stderr for large tiers.
        """
        with self._read() as txn:
            total = txn.stat(self._meta)["entries"]
        bar = None
        if total > PROGRESS_MIN_ENTRIES:
            from tqdm import tqdm
            bar = tqdm(total=total, desc="ssd index", unit="blk", file=sys.stderr,
                       mininterval=0.5, leave=False)
        try:
            start = b""
            while True:
                # short read transactions: a long-lived reader would pin LMDB's free pages
                # (map growth) and block a map resize if the caller writes while scanning
                with self._read() as txn:
                    cur = txn.cursor(db=self._meta)
                    ok = cur.set_range(start) if start else cur.first()
                    batch = []
                    while ok and len(batch) < _SCAN_BATCH:
                        batch.append(cur.item())
                        ok = cur.next()
                for k, raw in batch:
                    yield k, raw[_SIZE.size:], _SIZE.unpack_from(raw)[0]
                if bar is not None:
                    bar.update(len(batch))
                if len(batch) < _SCAN_BATCH:
                    return
                start = batch[-1][0] + b"\x00"     # the smallest key after the last one
        finally:
            if bar is not None:
                bar.close()

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
        """The LMDB data file(s), e.g. for dropping their page cache in benchmarks."""
        return [os.path.join(self.path, "data.mdb")]

    @property
    def map_size(self) -> int:
        return self._env.info()["map_size"]

    def sync(self) -> None:
        """Flush to disk (a no-op cost when opened with sync=True)."""
        self._check_open()
        self._env.sync(True)

    def close(self) -> None:
        if self._closed:
            return
        with self._write_lock, self._gate:
            while self._readers:
                self._gate.wait()
            self._closed = True
            if not self._sync:
                self._env.sync(True)
            self._env.close()

    def __enter__(self) -> SSDTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise Unavailable("the SSD tier is closed")

    @contextmanager
    def _read(self, buffers: bool = False) -> Iterator[lmdb.Transaction]:
        with self._gate:
            while self._resizing:
                self._gate.wait()
            self._check_open()
            self._readers += 1
        try:
            with self._env.begin(buffers=buffers) as txn:
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
                            f"SSD tier map full at {self.map_size} bytes even after growing "
                            f"({self.used_bytes} of {self.capacity} bytes used); evict first"
                        ) from None
                    self._grow()
                except lmdb.Error as exc:
                    if _is_enospc(exc):
                        raise ResourceExhausted(
                            f"SSD tier disk full at {self.path}: {exc}") from exc
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

    def _recount(self) -> int:
        """used_bytes from the meta records (environments written before the counter)."""
        return sum(size for _, _, size in self.scan_meta())


def _key(k: object) -> bytes:
    if not isinstance(k, bytes | bytearray | memoryview):
        raise InvalidArgument(f"SSD tier keys must be bytes, got {type(k).__name__}")
    k = bytes(k)
    if not 0 < len(k) <= MAX_KEY:
        raise InvalidArgument(f"SSD tier key must be 1..{MAX_KEY} bytes, got {len(k)}")
    return k


def _blob(v: object, what: str) -> bytes | bytearray | memoryview:
    if not isinstance(v, bytes | bytearray | memoryview):
        raise InvalidArgument(f"SSD tier {what} must be bytes-like, got {type(v).__name__}")
    return v


def _state_key(name: object) -> bytes:
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"state name must be a non-empty string, got {name!r}")
    return _key(name.encode())


def _is_enospc(exc: lmdb.Error) -> bool:
    return getattr(exc, "errno", None) == errno.ENOSPC or "No space" in str(exc)
