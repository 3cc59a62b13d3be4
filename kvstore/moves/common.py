"""What every move shares: blocks in flight, victim picking, the worker pool, and the verdicts
on copies (a host copy that no longer matches its checksum, a lower copy that does not decode).

A move runs in three phases (kvstore/moves/__init__.py): pick under the lock, transfer without
it, settle under it. `Flight` is the bookkeeping of the middle phase: its blocks are marked
`moving` (so no delete, eviction, other move or promotion touches them), the call counts as busy
(close() waits for it), and landing clears the marks, wakes whoever waits on the flight and
notifies the lock's `idle` condition.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from ..index import Entry
from ..state import StoreState, aligned

log = logging.getLogger("kvstore.store")
T = TypeVar("T")
R = TypeVar("R")

WORKERS = max(2, os.cpu_count() or 2)     # encode/decode threads (zstd, torch, numpy)
# A remote fetch's answer for a block Redis said it no longer holds (or held only a corrupt
# value of): unlike no answer (down, late), the remote copy is gone (host_remote.py, fetch).
GONE = object()


class Flight:
    """Blocks moving outside the lock (made and landed under it)."""

    def __init__(self, state: StoreState, entries: Iterable[Entry] = ()) -> None:
        self.state = state
        self.event = threading.Event()
        self.entries = list(entries)
        for e in self.entries:
            e.moving = self.event
        state.enter_busy()

    def add(self, e: Entry) -> None:
        e.moving = self.event
        self.entries.append(e)

    def clear(self, e: Entry) -> None:
        """One block's move is over (locked)."""
        if e.moving is self.event:
            e.moving = None

    def land(self) -> None:
        """Every block's move is over, or was undone (locked): clear the marks still ours, wake
        the waiters and close()."""
        for e in self.entries:
            self.clear(e)
        self.state.busy -= 1
        self.event.set()
        self.state.idle.notify_all()


def pick_victims(policy, can: Callable[[bytes], bool], get: Callable[[bytes], Entry | None],
                 present: Callable[[Entry], bool], max_blocks: int, max_bytes: float
                 ) -> list[Entry]:
    """Phase 1 of an eviction (locked): up to `max_blocks` victims and about `max_bytes` of
    slots, taken out of `policy`; `can` says which keys may go, `present` whether a picked
    block still has the copy being evicted."""
    batch: list[Entry] = []
    planned = 0
    while len(batch) < max_blocks and planned < max_bytes:
        g = policy.pick(can)
        if g is None:
            break
        policy.remove(g)
        e = get(g)
        if e is None or not present(e):
            continue
        batch.append(e)
        planned += aligned(e.size)
    return batch


class Workers:
    """The encode/decode thread pool every move shares, made on first use."""

    def __init__(self, state: StoreState) -> None:
        self.state = state
        self._pool: ThreadPoolExecutor | None = None

    def pool(self) -> ThreadPoolExecutor:
        """Safe with or without the store lock held (promotions call it outside the lock, and
        two must not each create a pool)."""
        with self.state.lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="kvstore-decode")
            return self._pool

    def parallel(self, fn: Callable[[T], R], items: list[T]) -> list[R]:
        """[fn(x) for x in items] spread over the pool in contiguous chunks, one task per
        worker and the last chunk on the calling thread.

        Why not Executor.map: it makes one future (a lock, a condition, a queue round trip)
        per block, which profiled at 16% of a spilling daemon's time.
        """
        if len(items) < 2:
            return [fn(x) for x in items]
        pool = self.pool()
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

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def corrupt_host_copy(state: StoreState, gkey: bytes, path: str) -> None:
    """A host copy whose bytes no longer match its commit checksum: count it and free it
    (locked). Never served or demoted; a copy a reader still leases, or one in flight, is
    freed by a later eviction (it stays in the host policy, and the eviction, checking it
    before it writes, frees it instead of demoting it)."""
    state.counters["corrupt_blocks"] += 1
    state.counters["corrupt_host_blocks"] += 1
    e = state.index.get(gkey)
    log.warning("dropping block %s: its host copy no longer matches the checksum taken at "
                "commit (found by %s; a client wrote into its slot during or after commit)",
                gkey[-16:].hex(), path)
    if e is None or e.host is None or e.pins or e.moving is not None:
        return
    state.policies["host"].remove(gkey)
    state.host.free(e.host)
    state.index.clear_host(e)
    state.index.drop_if_gone(e)


def copy_verified(e: Entry, got: int) -> bool:
    """Verify on settle: a copy between slot tiers (host, gpu) is good only when the bytes that
    landed hash to the block's checksum. Every host and gpu copy has a known checksum (0
    included: clients may not commit 0), so it is compared, never taken."""
    return got == e.checksum
