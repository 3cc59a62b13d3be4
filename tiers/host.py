"""Host tier: one preallocated shared-memory slab that engines map once and copy into directly.

Why one slab: clients map it a single time (by name, `kvstore_client.common.shm.attach`) and
then move blocks with plain memcpy at offsets the daemon hands out — no per-block syscalls or
sockets. The slab is pre-faulted at start so the first copies into it do not pay page faults
(a fresh mapping faults each page on first touch, docs/performance.md), and its base is
page-aligned (mmap), so with 4 KiB-aligned extents every block copy is page-aligned.

Why the daemon holds an flock on its segment: a segment's name outlives a daemon killed with
its children (nothing is left to unlink it), so a start that finds the name taken must tell a
live daemon's slab, which it must leave alone, from such a leftover, which it reclaims. The
kernel drops the lock with the last descriptor of its holder, however the holder died, so
"nobody holds its lock" is exactly "its daemon is gone" (`_create_locked`).
"""

from __future__ import annotations

import _posixshmem
import errno
import fcntl
import mmap
import os
import secrets
from typing import TYPE_CHECKING, Any

from kvstore_client.common import prefault
from kvstore_client.common.errors import InvalidArgument, Unavailable
from kvstore_client.common.lazy import lazy_module

from .slab import ExtentAllocator, SlabAllocation

if TYPE_CHECKING:
    import numpy as np
else:   # the slab's numpy view is made by the first call that copies a block, after start
    np = lazy_module("numpy", globals(), "np")

PAGE = 4096
_PREFAULT_CHUNK = prefault.CHUNK


class HostTier(SlabAllocation):
    """A `capacity`-byte POSIX shared-memory segment cut into aligned extents."""

    name = "host"

    def __init__(self, capacity: int, shm_name: str | None = None, prefault: bool = True
                 ) -> None:
        """`prefault=False`: populate the slab's pages only when `start_prefault()` is called
        (the daemon does once it is ready)."""
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < PAGE:
            raise InvalidArgument(f"host.capacity must be at least {PAGE} bytes, got {capacity!r}")
        capacity -= capacity % PAGE
        if shm_name is None or shm_name == "":
            shm_name = f"kvstore-{secrets.token_hex(6)}"
        shm_name = shm_name.lstrip("/")
        if "/" in shm_name or "\0" in shm_name or len(shm_name) > 200:
            raise InvalidArgument(f"host.shm_name must be a plain name like 'kvstore-main', "
                                  f"got {shm_name!r}")
        self.capacity = capacity
        self.shm_name = shm_name
        try:
            self._shm = _create_fresh(shm_name, capacity, track=prefault)
        except SegmentInUse as e:
            raise SegmentInUse(f"host.shm_name {shm_name!r}: {e}; give each daemon its own "
                               "host.shm_name ('' derives one from the data folder) or stop "
                               "the other daemon") from None
        self._array: np.ndarray | None = None       # made on first use (_require_open)
        self._prefaulter: prefault.Prefaulter | None = None
        self._prefaulted = False
        self._alloc = ExtentAllocator(capacity, PAGE)
        if prefault:
            self.start_prefault()

    def start_prefault(self) -> None:
        """Make the slab's pages resident, in the background where the kernel can (once),
        and have the resource tracker unlink it should the daemon be killed."""
        if self._prefaulted or self._shm is None:
            return
        self._prefaulted = True
        self._shm.track()
        self._prefaulter = _prefault(self._shm.buf, self.capacity)

    # -- access -------------------------------------------------------------------------------
    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """1-D uint8 numpy view of slab bytes [offset, offset+nbytes), zero copy."""
        arr = self._require_open()
        if offset < 0 or nbytes < 0 or offset + nbytes > self.capacity:
            raise InvalidArgument(f"host slab range [{offset}, {offset + nbytes}) is outside "
                                  f"the {self.capacity}-byte slab")
        return arr[offset:offset + nbytes]

    @property
    def array(self) -> np.ndarray:
        """The whole slab as 1-D uint8 (for batched gathers/scatters)."""
        return self._require_open()

    @property
    def buffer(self) -> memoryview:
        """The whole slab as a buffer (no numpy needed: pinning it at start)."""
        if self._shm is None:
            raise InvalidArgument("host tier is closed")
        return self._shm.buf

    def describe(self) -> dict:
        """What a client needs to map the slab: `kvstore_client.common.shm.attach(name, size)`."""
        return {"kind": "shm", "name": self.shm_name, "size": self.capacity}

    # -- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        """Unmap and unlink the segment (clients still mapping it keep their pages)."""
        if self._shm is None:
            return
        if self._prefaulter is not None:
            self._prefaulter.stop()
        self._array = None
        shm, self._shm = self._shm, None
        try:
            shm.unlink()
        except FileNotFoundError:
            pass
        try:
            shm.close()
        except BufferError:
            # numpy views handed out still live; the mapping is freed with them. Keep the
            # object so its __del__ doesn't retry the close and warn mid-run.
            _OPEN_VIEWS.append(shm)

    @property
    def closed(self) -> bool:
        return self._shm is None

    def _require_open(self) -> np.ndarray:
        arr = self._array
        if arr is None:
            shm = self._shm
            if shm is None:
                raise InvalidArgument("host tier is closed")
            arr = np.frombuffer(shm.buf, dtype=np.uint8, count=self.capacity)
            if self._shm is None:           # closed meanwhile: hand out no view of it
                raise InvalidArgument("host tier is closed")
            self._array = arr
        return arr

    def __enter__(self) -> HostTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_OPEN_VIEWS: list[Any] = []


class SegmentInUse(Unavailable):
    """A segment of the name exists and a live process holds its lock (another daemon)."""


class Segment:
    """A new POSIX shared-memory segment, made as multiprocessing.shared_memory makes one
    (same name, mode and mapping), except that Python's resource tracker, which unlinks it
    should this process be killed, hears of it only at `track()`, and that its descriptor
    stays open holding an exclusive flock until `close()` (module docstring).

    Why: registering spawns the tracker, a second Python process, on every daemon start (with
    the multiprocessing import, ~25 ms of CPU beside a start of ~100 ms); the daemon tracks
    its slab once it is ready. A segment left by a kill before that, or by a kill of the
    daemon together with the tracker, is replaced by the next start (`_create_fresh`).
    """

    def __init__(self, name: str, size: int) -> None:
        self.name, self.size = name, size
        self._path = "/" + name
        fd = _create_locked(self._path)
        try:
            os.ftruncate(fd, size)
            self._mmap = mmap.mmap(fd, size)
        except BaseException:
            _posixshmem.shm_unlink(self._path)
            os.close(fd)
            raise
        self._fd: int | None = fd
        self.buf = memoryview(self._mmap)
        self._tracked = False

    def track(self) -> None:
        if not self._tracked:
            from multiprocessing import resource_tracker

            resource_tracker.register(self._path, "shared_memory")
            self._tracked = True

    def close(self) -> None:
        """Unmap and drop the lock; BufferError while views of `buf` live (as
        SharedMemory.close; the descriptor, and with it the lock, is closed all the same)."""
        try:
            self.buf.release()
            self._mmap.close()
        finally:
            fd, self._fd = self._fd, None
            if fd is not None:
                os.close(fd)

    def unlink(self) -> None:
        _posixshmem.shm_unlink(self._path)
        if self._tracked:
            from multiprocessing import resource_tracker

            resource_tracker.unregister(self._path, "shared_memory")
            self._tracked = False


def _create_fresh(name: str, size: int, track: bool = True) -> Segment:
    """Create segment `name`; a leftover of the same name (a daemon that is gone) is replaced,
    one a live daemon holds is not (SegmentInUse)."""
    seg = Segment(name, size)
    if track:
        seg.track()
    return seg


_CREATE_TRIES = 8


def _create_locked(path: str) -> int:
    """A new segment at `path`, its descriptor holding an exclusive flock, the name checked to
    still be it once locked. A segment already there is reclaimed when nobody holds its lock.

    Two starts racing for one name: each locks what it made and then checks the name still
    names it; a start removes a segment only while holding its lock and only if the name still
    names it, so neither can remove the other's once locked, and one of them is refused."""
    for _ in range(_CREATE_TRIES):
        try:
            fd = _posixshmem.shm_open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        except FileExistsError:
            _reclaim(path)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                os.close(fd)            # another start took it for a leftover and removes it
                continue
            # (no flock on this filesystem: unlocked, as before the lock; nothing to tell)
        if _names(path, fd):
            return fd
        os.close(fd)                    # removed before we locked it: make another
    raise SegmentInUse(f"shared-memory segment /dev/shm{path} is in use by another process")


def _reclaim(path: str) -> None:
    """Remove the segment at `path` if nobody holds its lock (its daemon is gone), else raise
    SegmentInUse."""
    try:
        fd = _posixshmem.shm_open(path, os.O_RDWR, mode=0o600)
    except FileNotFoundError:
        return
    except PermissionError:
        raise SegmentInUse(f"shared-memory segment /dev/shm{path} exists and belongs to "
                           "another user") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise SegmentInUse(f"shared-memory segment /dev/shm{path} is in use by a "
                                   "running kvstore daemon") from None
            # (no flock here: a leftover, as every segment of the name was before the lock)
        if _names(path, fd):
            try:
                _posixshmem.shm_unlink(path)
            except FileNotFoundError:
                pass
    finally:
        os.close(fd)


def _names(path: str, fd: int) -> bool:
    """Whether the name `path` names the segment open at `fd` (not one made after its unlink)."""
    try:
        other = _posixshmem.shm_open(path, os.O_RDONLY, mode=0o600)
    except FileNotFoundError:
        return False
    try:
        a, b = os.fstat(fd), os.fstat(other)
    finally:
        os.close(other)
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def check_free(name: str) -> None:
    """Raise SegmentInUse (naming host.shm_name) if a live daemon holds segment `name`; a
    leftover is left for the create to reclaim. Cheap: for a refusal before any slow work."""
    name = name.lstrip("/")
    if not name or "/" in name or "\0" in name:
        return                          # HostTier reports a bad name
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    except FileNotFoundError:
        return
    except OSError:
        return                          # (another user's: the create says so)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise SegmentInUse(f"host.shm_name {name!r}: shared-memory segment /dev/shm/{name} "
                               "is in use by a running kvstore daemon; give each daemon its "
                               "own host.shm_name ('' derives one from the data folder) or "
                               "stop the other daemon") from None
    finally:
        os.close(fd)


def _prefault(buf: memoryview, size: int) -> prefault.Prefaulter | None:
    """Make every page resident (tmpfs allocates on first write) so block copies never fault:
    in the background where the kernel can populate pages (Linux 5.14+), else by writing
    zeros now."""
    t = prefault.start(buf, size)
    if t is not None:
        return t
    zeros = bytes(min(_PREFAULT_CHUNK, size))
    for start in range(0, size, _PREFAULT_CHUNK):
        n = min(_PREFAULT_CHUNK, size - start)
        buf[start:start + n] = zeros[:n]
    return None
