"""Reference limits measured in the same run as each benchmark (memcpy, raw disk).

The machines are shared and noisy, so every figure a benchmark reports is a ratio against one of
these, measured minutes apart on the same machine.
"""

from __future__ import annotations

import mmap
import os
import time

import numpy as np

MIB = 1 << 20


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned, pre-faulted uint8 buffer (docs/performance.md: alignment, page faults)."""
    buf = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
    buf[:] = 1
    return buf


def best_of(fn, repeats: int = 3) -> float:
    """Fastest wall time of `repeats` runs: the least disturbed by neighbours."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def memcpy_seconds(nbytes: int, repeats: int = 3) -> float:
    src, dst = aligned_buffer(nbytes), aligned_buffer(nbytes)
    return best_of(lambda: np.copyto(dst, src), repeats)


def drop_page_cache(paths: list[str]) -> None:
    """Evict files from the page cache so the next read comes from the disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def odirect_write_read(folder: str, nbytes: int, chunk: int = 8 * MIB) -> tuple[float, float]:
    """Seconds for a sequential O_DIRECT write (with fsync) and read of `nbytes` in `folder`."""
    path = os.path.join(folder, ".kvstore-bench-disk-ref")
    buf = aligned_buffer(chunk)
    buf[:] = np.random.default_rng(0).integers(0, 255, chunk, dtype=np.uint8)
    n = max(1, nbytes // chunk)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        t = time.perf_counter()
        for _ in range(n):
            os.write(fd, buf)
        os.fsync(fd)
        w = time.perf_counter() - t
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        t = time.perf_counter()
        for _ in range(n):
            os.readv(fd, [buf])
        r = time.perf_counter() - t
    finally:
        os.close(fd)
        os.unlink(path)
    return w, r


class DiskRef:
    """Sequential O_DIRECT write (with fsync) and read of `nbytes` in `folder`, repeatable.

    Why a file kept across calls: a benchmark that repeats its own disk path in rounds writes
    fresh extents in the first round and rewrites freed ones after (as a daemon in steady
    state does); this reference does the same (its first call writes a new file, later calls
    overwrite it), so each round compares like with like. Pair each call with one round of
    the measured path and take the median of the per-round ratios: this virtual disk's speed
    moves 2x within seconds, more than any single-sample ratio can absorb."""

    def __init__(self, folder: str, nbytes: int, chunk: int = 8 * MIB) -> None:
        self.path = os.path.join(folder, ".kvstore-bench-disk-ref")
        self.buf = aligned_buffer(chunk)
        self.buf[:] = np.random.default_rng(0).integers(0, 255, chunk, dtype=np.uint8)
        self.n = max(1, nbytes // chunk)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.close(fd)

    def measure(self) -> tuple[float, float]:
        """Seconds to write then read the whole file."""
        fd = os.open(self.path, os.O_WRONLY | os.O_DIRECT)
        try:
            t = time.perf_counter()
            for _ in range(self.n):
                os.write(fd, self.buf)
            os.fsync(fd)
            w = time.perf_counter() - t
        finally:
            os.close(fd)
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
        try:
            t = time.perf_counter()
            for _ in range(self.n):
                os.readv(fd, [self.buf])
            r = time.perf_counter() - t
        finally:
            os.close(fd)
        return w, r

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
