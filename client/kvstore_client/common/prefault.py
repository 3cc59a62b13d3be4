"""Populate a mapping's page tables in the background, so block copies never take page faults.

Why: each process that maps the pool takes a fault on its first touch of every 4 KiB page, even
when the daemon made the page resident long ago (about 40 ms per 128 MiB here, 5x the copy
itself), and tmpfs allocates a page on its first write anywhere (about 80 ms per 128 MiB).
madvise(MADV_POPULATE_WRITE) (Linux 5.14+) does that work without touching the bytes, so it is
safe while blocks are being copied in and out; a copy that runs ahead of it just takes the
faults. ctypes releases the GIL for the call, so the engine's Python threads keep running.
"""

from __future__ import annotations

import ctypes
import threading

CHUNK = 64 << 20
_MADV_POPULATE_WRITE = 23           # linux/mman.h, Linux 5.14+; older kernels: EINVAL
try:
    # The process's own symbols (libc among them): no ctypes.util, whose library search may
    # not even be importable in a client that dropped privileges after starting.
    _libc: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
    _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
except (OSError, AttributeError):  # pragma: no cover - no libc to call
    _libc = None


def populate(addr: int, size: int) -> bool:
    """Populate [addr, addr+size) writable now; False where the kernel cannot."""
    return _libc is not None and _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(size),
                                               _MADV_POPULATE_WRITE) == 0


def buffer_address(buf: object) -> int:
    probe = ctypes.c_char.from_buffer(buf)
    addr = ctypes.addressof(probe)
    del probe                                       # releases its export of the buffer
    return addr


class Prefaulter(threading.Thread):
    """Populates a mapping chunk by chunk; `stop()` before the mapping is unmapped."""

    def __init__(self, addr: int, size: int) -> None:
        super().__init__(name="kvstore-prefault", daemon=True)
        self._addr, self._size = addr, size
        self._stopped = threading.Event()

    def run(self) -> None:
        for start in range(0, self._size, CHUNK):
            if self._stopped.is_set():
                return
            populate(self._addr + start, min(CHUNK, self._size - start))

    def stop(self) -> None:
        """Stop before the mapping goes (a chunk takes tens of milliseconds)."""
        self._stopped.set()
        if self.is_alive():
            self.join()


def start(buf: object, size: int) -> Prefaulter | None:
    """Populate `buf` (a writable mapping) in the background; None where the kernel cannot
    (the caller decides whether to write zeros instead)."""
    addr = buffer_address(buf)
    if not populate(addr, min(4096, size)):         # one page: is the call supported?
        return None
    t = Prefaulter(addr, size)
    t.start()
    return t
