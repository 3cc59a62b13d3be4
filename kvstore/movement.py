"""How blocks move between tiers: eviction with demotion, and promotion with decoding.

The store (kvstore/store.py) owns the API, the index and the leases; this module owns the
mechanics: making room in host and SSD, encoding victims for the tier below (in parallel),
fetching and decoding lower copies (in parallel, pipelined for Redis), and dropping copies that
fail verification. Promotion and host eviction each run in three phases so their slow part does
not hold the store lock: promotion's SSD read, decode, verify and copy into the slab, eviction's
encode and LMDB write (see "Locking" in docs/internals.md). SSD eviction, flush and
write-through still run under the lock. The codec fallback rule lives here too: a lossy codec
that refuses a block (inf/NaN) stores it lossless instead, and the refusal is counted.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import msgpack
import xxhash
from kvstore_client.common.errors import DataLoss, ResourceExhausted
from kvstore_client.common.layout import KVLayout
from kvstore_client.common.lazy import lazy_module

from tiers import frame
from tiers.ssd import DiskFull

from .encode_choice import EncodeChoice
from .index import Entry
from .nsinfo import NamespaceInfo
from .verify import matches

if TYPE_CHECKING:
    import numpy as np

    from tiers import codecs
else:   # imported by the first block that moves, not before the daemon is ready
    np = lazy_module("numpy", globals(), "np")
    codecs = lazy_module("tiers.codecs", globals(), "codecs")

log = logging.getLogger("kvstore.store")
T = TypeVar("T")
R = TypeVar("R")

LOSSY = ("fp8_e4m3", "int8")
WORKERS = max(2, os.cpu_count() or 2)     # encode/decode threads (zstd, torch, numpy)
ERROR_SAMPLE_EVERY = 32     # one lossy block in this many is decoded again to measure its error


def encode_block(raw: np.ndarray, layout: KVLayout, codec: str, counters: Counter,
                 sample_error: bool = False) -> bytes:
    """Framed value for a keyed tier (ssd, remote); with `sample_error`, a lossy codec's error on
    this block is measured into the counters (callers sample one block in ERROR_SAMPLE_EVERY)."""
    try:
        payload = codecs.encode(codec, raw, layout)
    except codecs.NonFiniteBlock:
        counters["lossy_refused_nonfinite"] += 1
        codec = "lossless"
        payload = codecs.encode(codec, raw, layout)
    value = frame.frame(codec, len(raw), payload)
    counters[f"codec_in_bytes_{codec}"] += len(raw)
    counters[f"codec_out_bytes_{codec}"] += len(value)
    if codec in LOSSY and sample_error:
        _sample_error(raw, payload, layout, codec, counters)
    counters[f"codec_blocks_{codec}"] += 1
    return value


def _as_float(block: np.ndarray, layout: KVLayout):
    import torch  # numpy has no bfloat16

    dt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    return torch.from_numpy(np.ascontiguousarray(block)).view(dt[layout.dtype]).float()


def _sample_error(raw: np.ndarray, payload, layout: KVLayout, codec: str,
                  counters: Counter) -> None:
    """Element-wise relative error ‖x̂−x‖/‖x‖ of one block, summed for the metrics' mean."""
    out = np.empty_like(raw)
    codecs.decode(codec, payload, layout, out)
    err = codecs.relative_error(_as_float(raw, layout), _as_float(out, layout))
    counters[f"codec_error_sum_{codec}"] += err
    counters[f"codec_error_samples_{codec}"] += 1


def decode_block(value: bytes | memoryview | tuple, layout: KVLayout, out: np.ndarray,
                 checksum: int | None) -> str:
    """Decode a framed value into `out` and return the codec it was stored with; DataLoss when
    it does not decode or verify.

    A lossless block must reproduce the checksum taken when it was first stored; lossy blocks
    cannot, so the frame's own checksum (over the encoded payload) is what guards them.
    """
    # A keyed tier may hand over an already verified (codec, raw_len, payload) triple.
    codec, raw_len, payload = value if isinstance(value, tuple) else frame.unframe(value)
    if raw_len != len(out):
        raise DataLoss(f"stored block is {raw_len} bytes, the namespace expects {len(out)}")
    codecs.decode(codec, payload, layout, out)
    if checksum and codec not in LOSSY and xxhash.xxh3_64_intdigest(out) != checksum:
        raise DataLoss("block decoded but its checksum does not match the one stored")
    return codec


SLAB_ALIGN = 4096
# An eviction batch: up to this many victims and about this many bytes. Each batch ends with
# its SSD write and one index commit, so the disk idles briefly between batches: large
# blocks want few, large batches; small blocks many per batch.
BATCH_BLOCKS = 64
BATCH_BYTES = 32 << 20
SSD_READ_CHUNK = 8 << 20     # promotion reads about this many adjacent SSD bytes per task
REMOTE_CHUNK = 8        # remote blocks fetched per trip when an acquire pipelines its fetches


def _aligned(n: int) -> int:
    return -(-n // SLAB_ALIGN) * SLAB_ALIGN


def _meta(e: Entry, texts: dict | None = None) -> bytes:
    """A block's SSD meta record; with `texts` (KV events on: kvstore/events/), its text
    where one is known, so a restart can announce it again."""
    m = {"p": e.parent, "s": e.size, "c": e.checksum, "t": time.time()}
    if texts is not None and (text := texts.get(e.gkey)) is not None:
        m["e"] = text.pack()
    return msgpack.packb(m)


@dataclass(slots=True, eq=False)
class Promotion:
    """One block an acquire promotes: reserved under the lock (_reserve_promotion), filled
    without it (_fill), settled under it again (_settle)."""
    entry: Entry
    offset: int                     # the reserved host slot; nothing else writes or frees it
    checksum: int                   # the entry's checksum when reserved: what the copy must match
    ssd: bool                       # read the SSD copy (else the remote one)
    remote_value: object = None     # the remote prefetch: the source, or SSD's fallback
    # Verdicts, written by _fill outside the lock and applied by _settle:
    source: str | None = None       # where the bytes came from; None: no copy was found
    error: DataLoss | None = None   # the copy did not decode or verify
    lossy: bool = False
    new_checksum: int = 0           # the slot's checksum, where the entry needs a new one
    nbytes: int = 0                 # encoded bytes read
    ssd_missed: bool = False        # the index said SSD but LMDB had no value
    gpu: bool = False               # copy the gpu copy down (kvstore/device_movement.py)


def _shared(name: str) -> property:
    """An attribute of the store this movement serves (read and written through)."""
    return property(lambda self: getattr(self._store, name),
                    lambda self, value: setattr(self._store, name, value))


class TierMovement:
    """The store's movement half, as an object the store owns (`store.movement`).

    It keeps its own state (demotions in flight, the bytes they free and write, the worker
    pools) and works on the store's tiers, index, policies, counters and lock, named below.
    Every method expects the store lock held (once) unless its docstring says not; those
    whose docstring says so may release it mid-way.
    """

    config = _shared("config")
    host = _shared("host")
    ssd = _shared("ssd")
    remote = _shared("remote")
    index = _shared("index")
    namespaces = _shared("namespaces")
    policies = _shared("policies")
    counters = _shared("counters")
    tier_counters = _shared("tier_counters")
    _lock = _shared("_lock")
    _idle = _shared("_idle")
    _busy = _shared("_busy")          # close() waits while it is non-zero
    # Per-tenant host pools (kvstore/pools.py, a mixin of the store)
    _seg = _shared("_seg")
    _seg_room = _shared("_seg_room")
    _seg_namespaces = _shared("_seg_namespaces")
    _seg_full = _shared("_seg_full")
    _fit_quota = _shared("_fit_quota")

    def __init__(self, store: Any) -> None:
        """`store`: the kvstore.store.Store this serves (not imported: movement.py must not
        import store.py, which imports it)."""
        self._store = store
        self._demotions: set[threading.Event] = set()   # eviction batches in flight
        self._host_evicting = 0         # host bytes those batches will free when they settle
        self._ssd_pending = 0           # SSD bytes they are writing (room made, not yet landed)
        self._decoders: ThreadPoolExecutor | None = None
        self._remote_fetcher: ThreadPoolExecutor | None = None
        self._encoded = 0               # blocks encoded, to sample one in ERROR_SAMPLE_EVERY
        self._encode_choice: EncodeChoice | None = None
        # Background demotion: woken when host use passes the low watermark (see _demote_loop).
        self._wake = threading.Condition(store._lock)
        self._demoter: threading.Thread | None = None

    def start_background(self) -> None:
        """Start demoting in the background, if there is a tier to demote to and it is on."""
        if (self._demoter is not None or not self.config.host.background_demotion
                or (self.ssd is None and self.remote is None)):
            return
        self._demoter = threading.Thread(target=self._demote_loop, name="kvstore-demoter",
                                         daemon=True)
        self._demoter.start()

    def _demote_loop(self) -> None:
        """Keep host use at or under the low watermark, so writers rarely evict inline.

        Why: demotion (encode + SSD write) ran on the Reserve that needed room, so a spilling
        engine stored 10-30 blocks/s and every other engine's lookups waited behind it. Here
        it runs in batches on its own thread, releasing the store lock for each batch's encode
        and write exactly as an inline eviction does (_evict_batch); a writer evicts inline only
        when use would pass the high watermark anyway (counted as `reserve_waits`).
        """
        with self._lock:
            while not self._store._closed:
                freed = 0
                # Each tenant's own pool is kept under its own watermark with its own blocks:
                # one tenant's writes never demote another's (kvstore/pools.py).
                for seg in range(getattr(self.host, "segment_count", 1)):
                    cap, used = self._seg_room(seg)
                    over = (used - (self._host_evicting if seg == 0 else 0)
                            - self.config.host.low_watermark * cap)
                    if over <= 0:
                        continue
                    try:
                        f, _ = self._evict_host(int(over), self._seg_namespaces(seg))
                        freed += f
                        self.counters["background_demotion_bytes"] += f
                    except Exception as exc:  # the next round retries; inline eviction remains
                        self.counters["background_demotion_errors"] += 1
                        log.warning("background demotion failed: %s", exc)
                if not freed:
                    self._wake.wait(0.25)

    def close(self) -> None:
        """Stop the worker pools (after the store has let every call settle)."""
        self._wake.notify_all()          # the caller holds the store lock; the demoter exits
        for pool in (self._decoders, self._remote_fetcher):
            if pool is not None:
                pool.shutdown(wait=True)

    def _host_room(self, need: int, ns_id: bytes | None = None) -> None:
        """Evict from host so `need` more bytes fit: past the high watermark, down to the low.

        Victims already being demoted by other threads count as freed (their slots are freed
        when they settle), so concurrent callers do not each evict for the same shortfall. May
        release the store lock while victims are demoted (see _evict_batch); _alloc_host then
        gets the slot even if other threads took the room meanwhile.
        """
        seg = self._seg(ns_id)                  # a tenant's own pool (kvstore/pools.py)
        cap, used = self._seg_room(seg)
        high, low = self.config.host.high_watermark * cap, self.config.host.low_watermark * cap
        used -= self._host_evicting if seg == 0 else 0
        if used + need > low and self._demoter is not None:
            self._wake.notify()          # the background demoter makes room from here on
        if used + need <= high:
            return
        target = max(0.0, min(low, high - need))
        self._evict_host(int(used + need - target), self._seg_namespaces(seg))

    def has_room(self, need: int, ns_id: bytes | None = None) -> bool:
        """Whether `need` more host bytes fit under the high watermark without evicting."""
        seg = self._seg(ns_id)
        cap, used = self._seg_room(seg)
        used -= self._host_evicting if seg == 0 else 0
        return used + need <= self.config.host.high_watermark * cap

    def must_evict_inline(self, need: int) -> bool:
        """Whether making room for `need` more host bytes means evicting on the caller's
        thread now (background demotion has not kept up); a Reserve then waits."""
        used = self.host.used_bytes - self._host_evicting
        return used + need > self.config.host.high_watermark * self.host.capacity

    def _alloc_host(self, nbytes: int, ns_id: bytes | None = None) -> int:
        """A host slot of `nbytes`, evicting (and demoting, without the lock) until one fits.

        Other threads may take the room an eviction made while the lock was released, so this
        loops: evict what is missing, or wait for other threads' demotions in flight to settle,
        and try again; ResourceExhausted only when nothing is evictable and nothing is in flight.
        """
        seg = self._seg(ns_id)
        while True:
            try:
                return self.host.alloc(nbytes, seg) if seg else self.host.alloc(nbytes)
            except ResourceExhausted:
                pass
            if not seg and self._host_evicting >= _aligned(nbytes) and self._wait_demotions():
                continue     # batches in flight free enough: no second writer on the disk
            _, _, picked = self._evict_host_batches(_aligned(nbytes), self._seg_namespaces(seg))
            if picked or self._wait_demotions():
                continue
            try:
                return self.host.alloc(nbytes, seg) if seg else self.host.alloc(nbytes)
            except ResourceExhausted:
                if seg:
                    raise self._seg_full(seg) from None
                # Watermarks are a target, not a guarantee; this is the real limit.
                raise ResourceExhausted(
                    f"host tier full: {self.host.used_bytes} of {self.host.capacity} bytes are "
                    "leased or pinned and nothing is evictable; release leases or raise "
                    "host.capacity") from None

    def _evict_host(self, nbytes: int | None, only: set[bytes] | None = None
                    ) -> tuple[int, int]:
        """Evict host blocks until `nbytes` are freed (None: all evictable), demoting in batches;
        with `only`, blocks of those namespaces alone (a tenant's own Evict, its quota).

        Returns (bytes freed, blocks freed). May release the store lock while a batch is encoded
        and written to SSD (see _evict_batch).
        """
        freed, blocks, _ = self._evict_host_batches(nbytes, only)
        return freed, blocks

    def _evict_host_batches(self, nbytes: int | None, only: set[bytes] | None = None
                            ) -> tuple[int, int, int]:
        """_evict_host, also returning how many victims were picked (a victim a reader pinned
        while it was demoted keeps its host copy: picked, but not freed)."""
        freed = blocks = picked = 0
        planned = 0
        while nbytes is None or planned < nbytes:
            batch = self._pick_host_victims(nbytes, planned, only)
            if not batch:
                break
            picked += len(batch)
            planned += sum(_aligned(e.size) for e in batch)
            f, b = self._evict_batch(batch)
            freed, blocks = freed + f, blocks + b
        return freed, blocks, picked

    def _pick_host_victims(self, nbytes: int | None, planned: int,
                           only: set[bytes] | None = None) -> list[Entry]:
        """Phase 1 of an eviction (locked): up to BATCH_BLOCKS victims and about BATCH_BYTES,
        taken out of the host policy."""
        policy = self.policies["host"]
        lower = self.ssd is not None or self.remote is not None

        def can(g: bytes) -> bool:
            # A block whose children are indexed may only go if a lower tier keeps a copy,
            # or its children would become unreachable. A block in flight (being demoted by
            # another eviction, or promoted) is not a victim.
            e = self.index.get(g)
            return (e is not None and e.pins == 0 and e.host is not None and e.moving is None
                    and (lower or e.ssd or e.remote or e.gpu is not None or e.children == 0)
                    and (only is None or e.ns_id in only))
        batch: list[Entry] = []
        first = planned
        while (len(batch) < BATCH_BLOCKS and planned - first < BATCH_BYTES
               and (nbytes is None or planned < nbytes)):
            g = policy.pick(can)
            if g is None:
                break
            policy.remove(g)
            e = self.index.get(g)
            if e is None or e.host is None:
                continue
            batch.append(e)
            planned += _aligned(e.size)
        return batch

    def _evict_batch(self, batch: list[Entry]) -> tuple[int, int]:
        """Demote a batch of victims and free their host slots; (bytes, blocks) freed.

        Victims with no SSD copy yet are encoded and written to SSD without the store lock
        (docs/internals.md, "Locking"): they are marked `moving` first, so no delete, eviction
        or promotion touches them, and their host copies (immutable once published, the slots
        not freed until settle) stay readable and acquirable meanwhile. On any error every
        victim goes back as it was (host copy, host policy) and the error propagates.
        """
        if self.ssd is None or all(e.ssd for e in batch):
            # Nothing to write to SSD: dropped, or demoted to Redis under the lock.
            self._demote_from_host(batch)
            return self._free_victims(batch)
        flight = threading.Event()
        size = sum(_aligned(e.size) for e in batch)
        for e in batch:
            e.moving = flight
        self._host_evicting += size
        self._demotions.add(flight)
        self._busy += 1                      # close() waits for this batch to settle
        try:
            written = self._demote_unlocked([e for e in batch if not e.ssd])
        except DiskFull as exc:
            written = self._demotion_disk_full(batch, exc)
        except BaseException:
            for e in batch:                  # as it was: the host copy stays, evictable again
                e.moving = None
                self.policies["host"].insert(e.gkey, e.parent_gkey, e.size)
            self._demotion_done(flight, size)
            raise
        for e in batch:
            e.moving = None
        self._record_ssd_copies(written)
        try:
            return self._free_victims(batch)
        finally:
            self._demotion_done(flight, size)

    def _demotion_disk_full(self, batch: list[Entry], exc: DiskFull) -> list:
        """The SSD write of an eviction batch did not land (filesystem full): the victims
        without a lower copy are dropped rather than kept, so host keeps serving (a full disk
        must not stop every write and every promotion that needs room). Counted; logged at most
        once a minute, not once per batch."""
        lost = sum(1 for e in batch if not e.ssd and not e.remote and not e.pins)
        self.counters["ssd_disk_full_errors"] += 1
        self.counters["ssd_disk_full_dropped_blocks"] += lost
        now = time.monotonic()
        if now - getattr(self, "_disk_full_logged", -1e9) > 60:
            self._disk_full_logged = now
            log.warning("%s; dropping %d evicted host blocks instead of demoting them (logged "
                        "once a minute; counter ssd_disk_full_dropped_blocks)", exc, lost)
        return []

    def _free_victims(self, batch: list[Entry]) -> tuple[int, int]:
        """Phase 3 of an eviction (locked): free the victims' host slots. A victim a reader
        acquired while it was demoted keeps its host copy (it now has an SSD copy too)."""
        freed = blocks = 0
        for e in batch:
            if e.host is None:
                continue                     # a corrupt copy, dropped when it was encoded
            if e.pins:
                self.policies["host"].insert(e.gkey, e.parent_gkey, e.size)
                self.counters["demotions_kept_pinned"] += 1
                continue
            self.host.free(e.host)
            self.index.clear_host(e)
            self.index.drop_if_gone(e)
            freed += _aligned(e.size)
            blocks += 1
        self.tier_counters["host"]["evictions"] += blocks
        return freed, blocks

    def _demote_unlocked(self, todo: list[Entry]) -> list[tuple[Entry, int]]:
        """Phase 2 of an eviction: encode `todo` and write it to SSD without the store lock.

        Called and returns with the lock held; releases it for the encode and again for the
        write. SSD room is made in between, under the lock, and the bytes being written
        count in `_ssd_pending` until they land, so concurrent demotions never overfill SSD.
        Returns (entry, encoded bytes) for each block written.
        """
        return self._write_ssd(todo, unlocked=True, strict=False)

    def _write_ssd(self, todo: list[Entry], unlocked: bool, strict: bool
                   ) -> list[tuple[Entry, int]]:
        """Write host copies to SSD (locked on entry and return; with `unlocked`, the lock is
        released for the encode and for the write, and the caller has marked `todo` moving).

        Each block is encoded with its namespace's codec where that applies now
        (kvstore/encode_choice.py: a lossless block is compressed only while compressing does
        not slow demotion), else stored `raw`: copied from its slot straight into the SSD
        tier's write buffer, verified and framed there (one copy, hashes while the bytes are
        in cache), the batch's runs written in parallel on the worker threads. A block whose
        host copy fails its checksum is dropped and counted, never written. `strict`: a
        tenant's SSD quota that cannot fit the batch raises (flush), else those blocks are
        left out (eviction). Returns (entry, stored bytes) for each block written.
        """
        jobs = self._encode_jobs(todo)
        choice = self.encode_choice
        plain = [not choice.compress(j[2]) for j in jobs]
        # No probe in a stop's flush: nothing is left to use what it measures, and its encode
        # (on a worker, the codec kernels' first load if not yet warm) competed with the flush.
        if any(plain) and not self._store._closed and choice.probe():
            job = jobs[plain.index(True)]
            self._probe_encode(np.array(job[0]), job[1])
        enc = [i for i, p in enumerate(plain) if not p]
        values: list = [None] * len(todo)
        if enc:
            with self._maybe_unlocked(unlocked):
                t = time.perf_counter()
                vals, local = self._encode([jobs[i] for i in enc])
                dt = time.perf_counter() - t
            self.counters.update(local)
            for i, v in zip(enc, vals, strict=True):
                values[i] = v
            if all(jobs[i][2] == "lossless" for i in enc):
                choice.note_encode(sum(todo[i].size for i in enc if values[i] is not None),
                                   sum(len(v) for v in vals if v is not None), dt,
                                   one_thread=len(enc) == 1)
            for i in enc:
                if values[i] is None:
                    self._corrupt_host_copy(todo[i].gkey, "demotion")
        idx = [i for i in range(len(todo)) if plain[i] or values[i] is not None]
        lengths = [frame.HEADER_BYTES + e.size if p else (len(v) if v is not None else 0)
                   for e, p, v in zip(todo, plain, values, strict=True)]
        _, idx = self._fit_quota("ssd", [todo[i] for i in idx], idx, strict=strict)
        if not idx:
            return []
        need = sum(lengths[i] for i in idx)
        self._ssd_room(need)
        texts = self._store.events.book if self._store.events is not None else None
        items = [(todo[i].gkey, lengths[i], _meta(todo[i], texts)) for i in idx]

        def fill(k: int, dst: memoryview) -> bool:
            i = idx[k]
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

        self._ssd_pending += need
        try:
            with self._maybe_unlocked(unlocked):
                t = time.perf_counter()
                stored = self.ssd.put_filled(items, fill)
                choice.note_write(need, time.perf_counter() - t)
        finally:
            self._ssd_pending -= need
        written = []
        for i, ok in zip(idx, stored, strict=True):
            e = todo[i]
            if not ok:
                self._corrupt_host_copy(e.gkey, "demotion")
                continue
            written.append((e, lengths[i]))
            if plain[i]:
                self.counters["codec_in_bytes_raw"] += e.size
                self.counters["codec_out_bytes_raw"] += lengths[i]
                self.counters["codec_blocks_raw"] += 1
        return written

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
        self._pool().submit(run)

    @property
    def encode_choice(self) -> EncodeChoice:
        """Whether lossless blocks are compressed on their way to SSD (made on first use)."""
        if self._encode_choice is None:
            self._encode_choice = EncodeChoice(self.config.ssd.compress,
                                               min(WORKERS + 1, os.cpu_count() or 1))
        return self._encode_choice

    def _maybe_unlocked(self, unlocked: bool) -> AbstractContextManager[None]:
        return self._unlocked() if unlocked else nullcontext()

    @contextmanager
    def _unlocked(self) -> Iterator[None]:
        """Release the store lock for the block's duration and take it back.

        Releases one level only: a caller that holds the lock more than once keeps it, and the
        slow part then runs locked, as before (safe, just not concurrent). Every caller counts
        itself in `_busy` first, so close() cannot release the tiers meanwhile.
        """
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()

    def _demotion_done(self, flight: threading.Event, size: int) -> None:
        """A batch settled or was undone (locked): wake close() and waiting allocations."""
        self._host_evicting -= size
        self._demotions.discard(flight)
        self._busy -= 1
        flight.set()
        self._idle.notify_all()

    def _wait_demotions(self) -> bool:
        """Wait (releasing the lock) until the demotions now in flight have settled; False when
        none was. They never wait on anything but the lock, so this cannot deadlock; the caller
        counts in `_busy` meanwhile, so close() waits for it to finish its call."""
        pending = list(self._demotions)
        if not pending:
            return False
        self._busy += 1
        try:
            while not all(ev.is_set() for ev in pending):
                self._idle.wait()
        finally:
            self._busy -= 1
            self._idle.notify_all()
        return True

    def _demote_from_host(self, entries: list[Entry]) -> None:
        """Write host copies to the tier below under the lock (flush, write-through, and
        eviction without an SSD tier). Skips blocks another thread is demoting: their SSD copy
        is on its way, and their host copy may already be gone."""
        todo = [e for e in entries if not e.ssd and e.host is not None and e.moving is None]
        if not todo:
            return
        if self.ssd is None:
            todo = [e for e in todo if not e.remote]    # already in Redis: nothing to write
            if self.remote is not None and todo:
                self._demote_to_remote(todo, from_host=True)
            return
        self._record_ssd_copies(self._write_ssd(todo, unlocked=False, strict=True))

    def _record_ssd_copies(self, written: list[tuple[Entry, int]]) -> None:
        """Blocks just written to SSD from host (entry, encoded bytes): index, policy, counters."""
        for e, nbytes in written:
            self.index.set_ssd(e)
            self.policies["ssd"].insert(e.gkey, e.parent_gkey, e.size)
            self.tier_counters["ssd"]["demotions_in"] += 1
            self.counters["bytes_host_to_ssd"] += nbytes
        self.tier_counters["host"]["demotions"] += len(written)

    def _encode_many(self, entries: list[Entry]) -> list[bytes | None]:
        """Encode host copies for a lower tier (locked), in parallel; see _encode."""
        values, local = self._encode(self._encode_jobs(entries))
        self.counters.update(local)
        return values

    def _encode_jobs(self, entries: list[Entry]) -> list[tuple]:
        """What _encode needs per block, taken under the lock: the slot's view, layout, codec,
        whether to sample the codec's error (one block in ERROR_SAMPLE_EVERY) and the checksum
        the copy must match (None: not checked, host.verify_reads off)."""
        jobs = []
        for e in entries:
            self._encoded += 1
            spec = self.namespaces[e.ns_id].spec
            jobs.append((self.host.view(e.host, e.size), spec.layout, spec.codec,
                         self._encoded % ERROR_SAMPLE_EVERY == 1,
                         e.checksum if self.config.host.verify_reads else None))
        return jobs

    def _verified(self, entries: list[Entry], values: list[bytes | None]
                  ) -> tuple[list[Entry], list[bytes]]:
        """(entries, values) without the blocks whose host copy failed its checksum when it
        was encoded; those are counted and dropped (locked)."""
        good = [(e, v) for e, v in zip(entries, values, strict=True) if v is not None]
        for e, v in zip(entries, values, strict=True):
            if v is None:
                self._corrupt_host_copy(e.gkey, "demotion")
        return [e for e, _ in good], [v for _, v in good]

    def _corrupt_host_copy(self, gkey: bytes, path: str) -> None:
        """A host copy whose bytes no longer match its commit checksum: count it and free it
        (locked). Never served or demoted; a copy a reader still leases, or one in flight,
        is freed by a later eviction."""
        self.counters["corrupt_blocks"] += 1
        self.counters["corrupt_host_blocks"] += 1
        e = self.index.get(gkey)
        log.warning("dropping block %s: its host copy no longer matches the checksum taken at "
                    "commit (found by %s; a client wrote into its slot during or after commit)",
                    gkey[-16:].hex(), path)
        if e is None or e.host is None or e.pins or e.moving is not None:
            # Leased, or an eviction victim in flight: the slot cannot be freed under its user.
            # It stays in the host policy, so a later eviction finds it again (and, checking it
            # before it writes, frees it instead of demoting it).
            return
        self.policies["host"].remove(gkey)
        self.host.free(e.host)
        self.index.clear_host(e)
        self.index.drop_if_gone(e)

    def _encode(self, jobs: list[tuple]) -> tuple[list[bytes | None], Counter]:
        """Encode jobs from _encode_jobs, in parallel (zstd and torch release the GIL); needs
        no lock. Returns the values (None for a block whose host copy fails its checksum: the
        caller drops it, see _verified) and the codec counters, for the caller to add under the
        lock.

        Encoding, not the disk, is the slow part of demotion (about 0.4 GB/s a core for
        lossless), so a batch of victims is spread over the worker pool.
        """
        def one(job: tuple) -> tuple[bytes | None, Counter]:
            view, layout, codec, sample, checksum = job
            local: Counter = Counter()
            if checksum is not None:
                # A private copy first: the slot is client-writable (kvstore/verify.py).
                view = np.array(view)
                if not matches(view, checksum):
                    return None, local
            return encode_block(view, layout, codec, local, sample), local

        done = self._parallel(one, jobs)
        total: Counter = Counter()
        for _, local in done:
            total.update(local)
        return [v for v, _ in done], total

    def _ssd_room(self, need: int) -> None:
        """Evict from SSD so `need` more bytes fit (locked). Bytes other threads are writing
        without the lock (`_ssd_pending`) count as used: a batch that has just committed may
        count twice until it settles, which only errs towards evicting early."""
        cap = self.ssd.capacity
        high = self.config.ssd.high_watermark * cap
        used = self.ssd.used_bytes + self._ssd_pending
        if used + need <= high:
            return
        target = max(0.0, min(self.config.ssd.low_watermark * cap, high - need))
        self._evict_ssd(int(used + need - target))
        used = self.ssd.used_bytes + self._ssd_pending
        if used + need > cap:
            raise ResourceExhausted(f"ssd tier full ({used} of {cap} bytes) and nothing is "
                                    "evictable")

    def _evict_ssd(self, nbytes: int | None, only: set[bytes] | None = None
                   ) -> tuple[int, int]:
        policy = self.policies["ssd"]
        freed = blocks = 0

        def can(g: bytes) -> bool:
            e = self.index.get(g)
            # A block being promoted keeps its lower copies until its promotion settles.
            return (e is not None and e.ssd and e.moving is None
                    and (self.remote is not None or e.remote or e.host is not None
                         or e.gpu is not None or e.children == 0)
                    and (only is None or e.ns_id in only))
        while nbytes is None or freed < nbytes:
            g = policy.pick(can)
            if g is None:
                break
            policy.remove(g)
            e = self.index.get(g)
            if e is None or not e.ssd:
                continue
            if self.remote is not None and not e.remote:
                self._demote_to_remote([e], from_host=False)
            freed += max(self.ssd.delete_sized([g]), 1)
            blocks += 1
            self.index.set_ssd(e, False)
            self.tier_counters["ssd"]["evictions"] += 1
            self.index.drop_if_gone(e)
        return freed, blocks

    def _demote_to_remote(self, entries: list[Entry], from_host: bool) -> None:
        # Host copies are encoded (in parallel); SSD-only blocks already hold an encoded value.
        in_host = [e for e in entries if from_host or e.host is not None]
        items = (list(zip(*self._verified(in_host, self._encode_many(in_host)), strict=True))
                 if in_host else [])
        for e in entries:
            if not (from_host or e.host is not None):
                try:
                    value = self.ssd.get(e.gkey)
                except DataLoss:
                    self.counters["corrupt_blocks"] += 1
                    continue                # a corrupt copy is not passed down
                if value is not None:
                    items.append((e, value))
        items = [(e, v) for e, v in items if self.remote.has_room(len(v))]
        items = list(zip(*self._fit_quota("remote", [e for e, _ in items],
                                          [v for _, v in items], strict=False), strict=True))
        if not items:
            return
        written = self.remote.put_many([(e.gkey, v) for e, v in items])
        if written < sum(len(v) for _, v in items):
            self.counters["remote_demotion_failures"] += 1
            return  # Redis down or full: the blocks stay local; a later demotion retries
        for e, v in items:
            self.index.set_remote(e)
            self.counters["bytes_to_remote"] += len(v)
        self.tier_counters["remote"]["demotions_in"] += len(items)

    def _remote_wanted(self, ns_id: bytes, keys: list[bytes]) -> list[bytes]:
        """Global keys of the prefix blocks only the remote tier holds, in order.

        Keys the index has never seen may still be remote (another node wrote them): the first
        unknown key starts a remote existence check, as Lookup does.
        """
        if self.remote is None:
            return []
        with self._lock:
            want, first_unknown = [], None
            for i, k in enumerate(keys):
                e = self.index.get(ns_id + k)
                if e is None:
                    first_unknown = i
                    break
                if e.host is None and not e.ssd and e.gpu is None:
                    want.append(e.gkey)
        if first_unknown is not None:
            n = self._store._remote_extend(ns_id, keys, first_unknown)
            want += [ns_id + k for k in keys[first_unknown:first_unknown + n]]
        return want

    def _fetch_remote(self, want: list[bytes]) -> dict[bytes, tuple]:
        """One batched trip per node, outside the store lock; verified frames, not re-hashed."""
        if not want:
            return {}
        values = self.remote.get_many(want, unframed=True)
        return {g: v for g, v in zip(want, values, strict=True) if v is not None}

    def _fetcher(self) -> ThreadPoolExecutor:
        if self._remote_fetcher is None:
            self._remote_fetcher = ThreadPoolExecutor(1, thread_name_prefix="kvstore-fetch")
        return self._remote_fetcher

    def _reserve_promotion(self, e: Entry, remote_values: dict,
                           flight: threading.Event) -> Promotion | None:
        """Phase 1 (locked): mark a block a lower tier holds in flight and reserve its host slot.

        None when no lower copy is known (the block is a miss). The mark goes on before room is
        made: eviction run by _host_room may reach the SSD tier, and must not take this copy.
        """
        remote_value = remote_values.get(e.gkey) if e.remote else None
        from_gpu = e.gpu is not None    # exact bytes, and faster than any lower tier
        if not e.ssd and remote_value is None and not from_gpu:
            # vanished (Redis evicted it) or unreachable: a miss
            self.index.set_remote(e, False)
            self.index.drop_if_gone(e)
            return None
        e.moving = flight
        try:
            self._host_room(_aligned(e.size), e.ns_id)
            off = self._alloc_host(e.size, e.ns_id)
        except BaseException:
            e.moving = None
            raise
        return Promotion(e, off, e.checksum, e.ssd and not from_gpu, remote_value, gpu=from_gpu)

    def _fill(self, info: NamespaceInfo, jobs: list[Promotion]) -> None:
        """Phase 2 (no lock held): read each block's lower copy and decode and verify it into its
        reserved slot, in parallel (LMDB reads, zstd, torch and numpy copies release the GIL).

        Touches only the jobs, their slots (reserved for them alone) and the thread-safe tiers;
        every verdict is left on the job for _settle to apply under the lock.
        """
        layout = info.spec.layout

        def decode(p: Promotion, value: object) -> None:
            p.nbytes = len(value[2]) if isinstance(value, tuple) else len(value)
            out = self.host.view(p.offset, p.entry.size)
            try:
                if isinstance(value, tuple):
                    codec = value[0]
                else:
                    value = frame.unframe(value)        # (checks the payload's hash)
                    codec = value[0]
                if p.checksum and codec not in LOSSY:
                    decode_block(value, layout, out, p.checksum)
                    return                      # verified against the committed checksum
                # The block's checksum is to be taken now: after a lossy decode the slot holds
                # dequantized bytes, and a block known only from Redis has none yet. It is taken
                # of a private copy of what was decoded (verified by the frame's hash), never of
                # the slot, which clients map writable: a hash of the slot would vouch for
                # whatever was written there meanwhile.
                own = np.empty(p.entry.size, np.uint8)
                p.lossy = decode_block(value, layout, own, p.checksum) in LOSSY
            except DataLoss as exc:
                p.error = exc
                return
            p.new_checksum = xxhash.xxh3_64_intdigest(own)
            out[:] = own

        def from_remote(p: Promotion) -> None:
            if p.remote_value is not None:
                p.source = "remote"
                decode(p, p.remote_value)

        def from_ssd(chunk: list[Promotion]) -> None:
            # Decoded straight from the tier's read buffer (adjacent blocks in one O_DIRECT
            # read, no copy), which has been verified against each record's checksum of the
            # whole value: the frame's own payload hash would find nothing new.
            def got(i: int, mv: memoryview) -> None:
                decode(chunk[i], frame.unframe(mv, checked=True))
                chunk[i].nbytes = len(mv)
            found = self.ssd.visit_many([p.entry.gkey for p in chunk], got)
            for p, f in zip(chunk, found, strict=True):
                if isinstance(f, DataLoss):     # the payload fails its checksum: never served
                    p.source, p.error = "ssd", f
                elif f:
                    p.source = "ssd"
                else:
                    p.ssd_missed = True
                    from_remote(p)

        def one(task: tuple[str, Any]) -> None:
            kind, x = task
            if kind == "ssd":
                from_ssd(x)
            elif kind == "gpu":
                self._store._fill_from_gpu(x)
            else:
                from_remote(x)

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
        self._parallel(one, tasks)

    def _settle(self, p: Promotion) -> bool:
        """Phase 3 (locked): publish a filled slot as the block's host copy, or give it back.

        True when the block may be served from host; a copy that failed to decode or verify is
        dropped from its tier and is a counted miss, never served.
        """
        e = p.entry
        e.moving = None
        if p.ssd_missed and not self.ssd.contains(e.gkey):
            self.index.set_ssd(e, False)
        if p.source is None:
            self.host.free(p.offset)
            self.index.drop_if_gone(e)
            return e.host is not None
        if p.error is not None:
            self._drop_corrupt(e, p.offset, p.source, p.error)
            return False
        if e.host is not None:
            # A put or commit stored this key while we decoded: keep that copy (same key, same
            # bytes) and free ours, so no block ever owns two slots.
            self.host.free(p.offset)
            self.counters["promotion_duplicates"] += 1
            return True
        if p.new_checksum:
            e.checksum = p.new_checksum
        self.index.set_host(e, p.offset)
        self.policies["host"].insert(e.gkey, e.parent_gkey, e.size)
        self.tier_counters["host"]["promotions"] += 1
        self.counters[f"bytes_{p.source}_to_host"] += p.nbytes
        return True

    def _abandon(self, p: Promotion) -> None:
        """Undo a reservation whose fill did not finish (locked); the lower copy stays."""
        p.entry.moving = None
        self.host.free(p.offset)

    def _parallel(self, fn: Callable[[T], R], items: list[T]) -> list[R]:
        """[fn(x) for x in items] spread over the worker pool in contiguous chunks, one task
        per worker and the last chunk on the calling thread.

        Why not Executor.map: it makes one future (a lock, a condition, a queue round trip)
        per block, which profiled at 16% of a spilling daemon's time.
        """
        if len(items) < 2:
            return [fn(x) for x in items]
        pool = self._pool()
        parts = min(len(items), WORKERS + 1)
        step = -(-len(items) // parts)
        chunks = [items[i:i + step] for i in range(0, len(items), step)]

        def run(chunk: list[T]) -> list[R]:
            return [fn(x) for x in chunk]
        futures = [pool.submit(run, c) for c in chunks[:-1]]
        out: list[R] = []
        try:
            last = run(chunks[-1])
        finally:
            for f in futures:
                out += f.result()     # waits for every chunk, even when ours raised
        return out + last

    def _pool(self) -> ThreadPoolExecutor:
        """The encode/decode workers; safe with or without the store lock held (promotions
        call it outside the lock, and two must not each create a pool)."""
        with self._lock:
            if self._decoders is None:
                self._decoders = ThreadPoolExecutor(WORKERS,
                                                    thread_name_prefix="kvstore-decode")
            return self._decoders

    def _drop_corrupt(self, e: Entry, off: int, source: str, exc: DataLoss) -> None:
        """A copy that does not decode or verify is deleted from its tier: never served."""
        self.host.free(off)
        self.counters["corrupt_blocks"] += 1
        log.warning("dropping corrupt %s copy of block %s: %s", source, e.key.hex(), exc)
        if source == "ssd":
            self.ssd.delete(e.gkey)
            self.policies["ssd"].remove(e.gkey)
            self.index.set_ssd(e, False)
        elif source == "gpu":
            self._store._drop_gpu_copy(e)
        else:
            self.remote.delete_many([e.gkey])
            self.index.set_remote(e, False)
        self.index.drop_if_gone(e)
