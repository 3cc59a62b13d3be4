"""The SSD tier's payload file: where block bytes live, how room is found, written and read back.

Why a file of extents and not LMDB values: LMDB's put copies every value through the page cache
into its map, which ran at 0.04-0.45 of the disk's speed; large aligned pwrites into a
preallocated file reach 0.7-0.9. The file grows in preallocated steps of GROW_STEP
(posix_fallocate) and is written with O_DIRECT where the filesystem allows (tmpfs and some
others do not: then plain pwrite).

The file never grows past the tier's capacity (rounded down to ALIGN: `limit`). Why: the
capacity is what an operator sets to fit the disk; the file used to grow whenever no free
extent fitted, by whole steps, and the tier counted value lengths rather than extents, so a
tier of 4 KiB blocks filled twice its capacity plus a step. Now the tier counts extents (what
the store evicts by, tiers/ssd/tier.py), the last step stops at the limit, and a write for
which no free extent fits below it waits a moment for extents that readers hold back (below),
then fails with CapacityFull rather than growing the file. A file already larger (an earlier
build's, or a capacity lowered since) is cut back at open to the end of its last stored
extent, or to the limit where that is larger (`trim`), and is not grown again.

Free space: extents come from an ExtentAllocator (tiers/slab.py) that the tier rebuilds from
its index on open. Sizes are rounded to 32 classes per power of two (at most ~3% slack) so a
freed extent is usually reused exactly. An extent freed while a reader that may have looked it
up is still reading goes back to the allocator only after that reader finishes (readers count
themselves in by epoch), so reuse never races a read.

Writes: a batch's extents are grouped into runs of adjacent extents (up to RUN_BYTES). Each
run is filled on the calling thread into a reused page-aligned buffer, checksummed there while
the bytes are in cache, and handed to one writer thread to write while the caller fills the
next run: copies overlap the disk, and writes reach the disk one at a time (on this kind of
disk, concurrent O_DIRECT writes were slower than one after another); while reads are
coming, each of at most WRITE_PIECE bytes, so that a read never queues behind megabytes of
them. A filled run is
queued before the caller waits for the one before it, so the writer goes from one pwrite
straight to the next: waiting first left the disk idle for two thread wake-ups per run,
several ms each on a loaded machine.

Reads: adjacent extents are read with one pread per run (up to READ_RUN_BYTES) into a reused
per-thread buffer: on this kind of disk, 8 MiB reads on two threads ran at 1.6x the rate of
2 MiB reads on three, and a fresh multi-MiB buffer per block page-faults on every use.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager

from kvstore_client.common.errors import InvalidArgument, ResourceExhausted

from ..slab import ExtentAllocator
from .disk_full import FULL_ERRNOS, CapacityFull, DiskFull, free_bytes

log = logging.getLogger("kvstore.ssd")

NAME = "payload.dat"
ALIGN = 4096
GROW_STEP = 256 << 20               # the payload file grows (preallocated) this much at a time,
MIN_GROW_STEP = 4 << 20             # or an eighth of the tier's capacity where that is less
# (and never past the capacity). At the capacity, a write waits at most this long for extents
# that readers hold back (deferred frees) before it fails with CapacityFull.
FREED_WAIT_S = 1.0
# Adjacent extents are joined into one write up to this size: 8 MiB of payload (as fast as
# the disk's large sequential writes) plus the ~3% an extent may round up, so that four
# 2 MiB blocks (2 MiB + 64 KiB extents) make one write instead of three and then one.
RUN_BYTES = (8 << 20) + (512 << 10)
PREFAULT_BUFFERS = 3                # write buffers populated at open (one per writing thread)
PREFAULT_MIN_CAPACITY = 256 << 20   # ... for a tier at least this big (not the tests' tiny ones)
MAX_FREE_BUFFERS = 8
READ_RUN_BYTES = 16 << 20           # adjacent extents read with one pread up to this size
# While reads are coming (one in the last READS_RECENT_S), a run goes to the disk in O_DIRECT
# writes of at most WRITE_PIECE, one after another. Why: the kernel splits one large write into
# requests that all reach the disk's queue at once, and a read (a load promoting blocks an
# engine waits for) queues behind every one of them: under bench/tail.py, two demoters
# writing whole 4-8 MiB runs made promotion reads wait 20-34 ms, in 1 MiB pieces 13-20 ms at
# most. Why only then: one piece at a time leaves the disk's queue shallower, and a spill
# with no reads behind it wrote about 20% slower that way (bench/tiers.py, bench/scale.py).
WRITE_PIECE = 1 << 20
READS_RECENT_S = 1.0
ADDRESS_LIMIT = 1 << 60

# Fills run `run` (item indexes, adjacent extents) into the buffer; False: nothing in it kept.
FillRun = Callable[[list[int], mmap.mmap], bool]


def extent_size(nbytes: int) -> int:
    """The extent a value of `nbytes` occupies: aligned, rounded to 32 classes per octave."""
    n = max(nbytes, ALIGN)
    grain = max(ALIGN, 1 << max(0, n.bit_length() - 6))
    return -(-n // grain) * grain


class PayloadFile:
    """The preallocated payload file of one SSD tier, its free-space map and its writer.

    Thread-safe: `lock` guards the allocator, the deferred frees and the file's size; writes
    and reads of payload bytes run without it. `alloc` is set by the tier once it knows the
    stored extents (from the index image or a scan of the index). `limit`: the size the file
    never grows past (module docstring).
    """

    def __init__(self, folder: str, capacity: int, sync: bool) -> None:
        self.folder = folder
        self.path = os.path.join(folder, NAME)
        self.capacity = capacity
        self.limit = capacity // ALIGN * ALIGN
        self._sync = sync
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.dfd = self._dfd_opened = _open_direct(self.path)
        self.size = os.fstat(self.fd).st_size
        self.alloc: ExtentAllocator = ExtentAllocator(0, ALIGN)
        self.lock = threading.Lock()
        self._freed = threading.Condition(self.lock)     # deferred frees given back
        self.closed = False
        self.last_read = float("-inf")     # time.monotonic() of the latest read
        # Deferred frees and the readers that hold them back (module docstring).
        self._epoch = 0
        self._active: dict[int, int] = {}
        self._pending: deque[tuple[int, int]] = deque()
        self._tls = threading.local()
        self._stages = _Buffers()
        self._write_pool: ThreadPoolExecutor | None = None

    # -- start --------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """The writer thread, warm write buffers and, for a fresh file, its first
        preallocated step, ready for the first write (often a stop's flush): under load,
        starting a thread and faulting in a buffer cost ~10 ms of its first batch, and the
        fallocate of the first step ~0.1-0.2 s. Then the allocator an index image left
        partly unbuilt, off the start's path."""
        if self.capacity >= PREFAULT_MIN_CAPACITY and not self.closed:
            writer = self._writer()
            writer.submit(self._stages.prefault, PREFAULT_BUFFERS)
            writer.submit(self._grow_ahead)
        if not self.closed:
            self._writer().submit(self._materialize_alloc)

    def _materialize_alloc(self) -> None:
        with self.lock:
            try:
                self.alloc.materialize()
            except InvalidArgument as exc:      # every write and free will say so as well
                log.error("the SSD tier's free-space map from the index image of %s is "
                          "inconsistent: %s", self.folder, exc)

    def _grow_ahead(self) -> None:
        with self.lock:
            if self.closed or self.size:
                return
            try:
                self._grow(ALIGN)
            except (OSError, ResourceExhausted) as exc:     # the first write grows it instead
                log.debug("could not preallocate %s: %s", self.path, exc)

    # -- space --------------------------------------------------------------------------------
    def allocate(self, sizes: list[int]) -> list[int]:
        """Extents for a batch, all or none; the file grows (preallocated) when no free extent
        fits, up to `limit`. There, a write waits up to FREED_WAIT_S for extents readers hold
        back, then fails with CapacityFull (module docstring)."""
        with self.lock:
            offsets: list[int] = []
            deadline = None
            try:
                for size in sizes:
                    while True:
                        try:
                            offsets.append(self.alloc.alloc(size))
                            break
                        except ResourceExhausted:
                            if self._grow(size):
                                continue
                        now = time.monotonic()
                        deadline = now + FREED_WAIT_S if deadline is None else deadline
                        if not self._pending or self.closed or now >= deadline:
                            raise CapacityFull(self.folder, self._no_room(size)) from None
                        self._freed.wait(deadline - now)
            except BaseException:
                for off in offsets:
                    self.alloc.free(off)
                raise
            return offsets

    def _no_room(self, size: int) -> str:
        held = sum(self.alloc.size_of(off) for _, off in self._pending
                   if self.alloc.is_allocated(off))
        return (f"no free extent of {size} bytes in its {self.size}-byte payload file, which "
                f"is at ssd.capacity ({self.capacity} bytes): {self.alloc.used_bytes} bytes are "
                f"allocated ({held} of them held back by reads in progress), the rest is in "
                "smaller pieces")

    def _grow(self, need: int) -> bool:
        """Preallocate GROW_STEP more (or `need`, if larger) at the end of the file, never past
        `limit`; on a filesystem with less room than a step, just `need` (DiskFull when not
        even that fits). False: the file is at `limit` already, nothing grown. Called with
        `lock` held."""
        if self.size >= self.limit:
            return False
        exact = min(self.size + -(-need // ALIGN) * ALIGN, self.limit)
        # A small tier (tests, a sidecar with little disk) must not pin a whole big step.
        step = min(GROW_STEP, max(MIN_GROW_STEP, self.capacity // 8 // ALIGN * ALIGN))
        new = min(max(self.size + step, exact), self.limit)
        if new > ADDRESS_LIMIT:
            raise ResourceExhausted(f"SSD payload file at {self.path} cannot grow further")
        while True:
            try:
                os.posix_fallocate(self.fd, self.size, new - self.size)
                break
            except OSError as exc:
                if exc.errno in FULL_ERRNOS and new > exact:
                    new = exact             # a nearly full disk: only what this write needs
                    continue
                if exc.errno in FULL_ERRNOS:
                    raise DiskFull(self.folder, free_bytes(self.folder),
                                   f"cannot grow the payload file to {new} bytes: {exc}"
                                   ) from None
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(self.fd, new)     # no preallocation on this filesystem: sparse
                break
        self.size = new
        self.alloc.grow(new)
        return True

    def trim(self, end: int) -> None:
        """Cut a file larger than `limit` back to `end` (the end of its last stored extent) or
        `limit`, whichever is larger: at open, before the allocator is built for the new size
        (module docstring)."""
        new = max(end, self.limit)
        if self.size > new:
            os.ftruncate(self.fd, new)
            log.info("SSD payload file %s cut back from %d to %d bytes (ssd.capacity is %d)",
                     self.path, self.size, new, self.capacity)
            self.size = new

    def free_now(self, offsets: list[int]) -> None:
        """Give back extents nothing ever pointed at (a batch that failed before commit)."""
        with self.lock:
            for off in offsets:
                self.alloc.free(off)

    def free_after_readers(self, offsets: list[int]) -> None:
        """Give back extents the index no longer names, once no reader may still read them."""
        if not offsets:
            return
        with self.lock:
            for off in offsets:
                self._pending.append((self._epoch, off))
            self._epoch += 1
            self._drain()

    @contextmanager
    def pinned(self) -> Iterator[None]:
        """Mark a reader: extents freed from now on stay allocated until it is done."""
        with self.lock:
            epoch = self._epoch
            self._active[epoch] = self._active.get(epoch, 0) + 1
        try:
            yield
        finally:
            with self.lock:
                n = self._active[epoch] - 1
                if n:
                    self._active[epoch] = n
                else:
                    del self._active[epoch]
                self._drain()

    def _drain(self) -> None:
        oldest = min(self._active) if self._active else self._epoch
        if self._pending and self._pending[0][0] < oldest:
            self._freed.notify_all()            # a write waiting for room (allocate)
        while self._pending and self._pending[0][0] < oldest:
            off = self._pending.popleft()[1]
            if not self.alloc.is_allocated(off):
                # A damaged record's offset (SSDTier._charge): nothing of ours to give back,
                # and no reason to fail the delete that dropped it.
                log.warning("SSD payload file %s: a deleted record named offset %d, which "
                            "holds no extent", self.path, off)
                continue
            self.alloc.free(off)

    def settled_state(self) -> dict | None:
        """The allocator's state for an index image, or None while a reader still holds
        extents back (then no image: its map would not match the index). InvalidArgument:
        the map is inconsistent."""
        with self.lock:
            self._drain()
            if self._active or self._pending:
                return None
            return self.alloc.state()

    # -- writes -------------------------------------------------------------------------------
    def write(self, offsets: list[int], sizes: list[int], lengths: list[int],
              fill_run: FillRun) -> None:
        """Fill and write the runs of a batch whose extents (`sizes`, holding values of
        `lengths` bytes) are allocated at `offsets` (module docstring);
        with `sync`, fdatasync'd before returning, so the index may name them. On failure
        every extent of the batch is freed and the error raised (DiskFull for a full disk);
        the writes already queued end first."""
        try:
            runs = _runs(offsets, sizes)
            pending: deque[Future] = deque()

            def write_run(run: list[int], stage: mmap.mmap) -> None:
                try:
                    start = offsets[run[0]]
                    self._pwrite_run(stage, offsets[run[-1]] + sizes[run[-1]] - start, start,
                                     [(offsets[i] - start, lengths[i]) for i in run])
                finally:
                    self._stages.give(stage)
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
                os.fdatasync(self.fd)          # payloads durable before the index names them
        except OSError as exc:
            self.free_now(offsets)
            if exc.errno in FULL_ERRNOS:
                raise DiskFull(self.folder, free_bytes(self.folder), exc) from None
            raise
        except BaseException:
            self.free_now(offsets)
            raise

    def _writer(self) -> ThreadPoolExecutor:
        """The one thread that writes filled runs (made on first use)."""
        with self.lock:
            if self._write_pool is None:
                self._write_pool = ThreadPoolExecutor(1, thread_name_prefix="kvstore-ssd-write")
            return self._write_pool

    def _pwrite_run(self, stage: mmap.mmap, total: int, start: int,
                    values: list[tuple[int, int]]) -> None:
        """Write a filled run: O_DIRECT pwrites of the whole aligned run (WRITE_PIECE at a
        time while reads are coming), or, where the filesystem refuses O_DIRECT, each value's
        bytes with buffered pwrites."""
        dfd = self.dfd
        if dfd is not None:
            try:
                with memoryview(stage) as view:
                    at = 0
                    while at < total:
                        n = total - at
                        if time.monotonic() - self.last_read < READS_RECENT_S:
                            n = min(n, WRITE_PIECE)
                        _pwrite_all(dfd, view[at:at + n], start + at)
                        at += n
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                log.warning("O_DIRECT writes fail on %s (%s); using buffered writes",
                            self.folder, exc)
                # Not closed here: another thread may be writing through it right now.
                self.dfd = None
        with memoryview(stage) as view:
            for pos, n in values:
                _pwrite_all(self.fd, view[pos:pos + n], start + pos)

    # -- reads --------------------------------------------------------------------------------
    def read(self, off: int, length: int) -> memoryview:
        """`length` bytes at `off`, read into this thread's reusable read buffer (valid until
        this thread's next read)."""
        self.last_read = time.monotonic()  # writes go in pieces meanwhile (WRITE_PIECE)
        size = extent_size(length)
        buf = getattr(self._tls, "rbuf", None)
        if buf is None or len(buf) < size:
            buf = self._tls.rbuf = _populated(max(size, 4 << 20))
        view = memoryview(buf)
        fd = self.dfd if self.dfd is not None else self.fd
        got = 0
        while got < length:
            try:
                n = os.preadv(fd, [view[got:size]], off + got)
            except OSError as exc:
                if fd != self.dfd or exc.errno != errno.EINVAL:
                    raise
                fd = self.fd                  # O_DIRECT refused for reads: buffered
                continue
            if n <= 0:
                break
            got += n
        return view[:min(got, length)]

    def drop_read_buffer(self) -> None:
        """Let go of this thread's read buffer (the open's checks of damaged records read
        values of any length on the main thread, which reads nothing after)."""
        self._tls.__dict__.pop("rbuf", None)

    def read_runs(self, extents: Sequence[tuple[int, int, int, int]]
                  ) -> Iterator[tuple[memoryview, list[tuple[int, int, int, int]]]]:
        """For (offset, length, checksum, i) records sorted by offset: each run of adjacent
        extents (up to READ_RUN_BYTES) read with one pread, as (bytes from the run's first
        offset, its records)."""
        runs: list[list[tuple[int, int, int, int]]] = []
        end = start = -1
        for rec in extents:
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
            yield self.read(first, last - first), run

    # -- end ----------------------------------------------------------------------------------
    def sync(self) -> None:
        os.fdatasync(self.fd)

    def close(self) -> None:
        """Wait for the writer, then close the file (the tier has stopped every write)."""
        self.closed = True
        if self._write_pool is not None:
            self._write_pool.shutdown(wait=True)
        for fd in (self.fd, self._dfd_opened):
            if fd is not None:
                os.close(fd)
        self.fd = self.dfd = self._dfd_opened = None  # type: ignore[assignment]


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
    RUN_BYTES (or one item): one pwrite each."""
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
