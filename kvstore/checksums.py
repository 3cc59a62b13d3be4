"""xxh3-64 of many slots at once, on every core the daemon has.

Why: Commit verifies every block a client wrote against the checksum it sent, and that read
pass sits on the client's store path (the client waits for the answer). xxhash releases the
GIL, so splitting a batch's blocks over a few threads makes the check run at memory speed
instead of one core's hashing speed.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import xxhash

# Below this many bytes a batch is hashed on the calling thread: a hand-off costs more.
PARALLEL_MIN_BYTES = 8 << 20
MAX_THREADS = 8
RANGES_PER_THREAD = 8

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _threads() -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, n))


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=_threads(), thread_name_prefix="checksum")
        return _pool


def _run(views: Sequence[Any]) -> list[int]:
    return [xxhash.xxh3_64_intdigest(v) for v in views]


def xxh3_many(views: Sequence[Any]) -> list[int]:
    """[xxh3_64(v) for v in views], split over threads when the batch is large.

    Ranges of views are handed out as threads ask for them (several per thread), so one thread
    that loses its core on a busy machine does not hold up the whole batch.
    """
    total = sum(len(v) if not hasattr(v, "nbytes") else v.nbytes for v in views)
    if total < PARALLEL_MIN_BYTES:      # the common case: no system call to count cores
        return _run(views)
    w = min(_threads(), len(views))
    if w <= 1:
        return _run(views)
    per = max(1, -(-len(views) // (w * RANGES_PER_THREAD)))
    starts = iter(range(0, len(views), per))
    lock = threading.Lock()
    out: list[int] = [0] * len(views)

    def work() -> None:
        while True:
            with lock:
                i = next(starts, None)
            if i is None:
                return
            out[i:i + per] = _run(views[i:i + per])

    ex = _executor()
    futs = [ex.submit(work) for _ in range(w - 1)]
    work()
    for f in futs:
        f.result()
    return out
