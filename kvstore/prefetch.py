"""Promote-ahead: bring blocks up from SSD or the remote tier before an engine asks for them.

Engines whose scheduler must never block (vLLM's tiered offloading) ask where blocks are with
`Locate(prefetch=true)`, answer "retry" for blocks below host, and load them once they are in
host memory. The promotion itself is an ordinary Acquire whose lease is released at once: the
block stays in host, unpinned, as recently used as a real read makes it.

One background thread works through a bounded queue, so a burst of lookups never holds more
than `max_queued` blocks of promotion work; what does not fit is refused (counted) and the
engine simply keeps seeing the block as not ready, then as ready once a later Locate promotes it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

log = logging.getLogger("kvstore.prefetch")


class Prefetcher:
    def __init__(self, store: Any, max_queued: int = 4096) -> None:
        self.store = store
        self.max_queued = max_queued
        # The store's own counters, so Stats and the metrics endpoint show prefetching too.
        self.counters: Counter = getattr(store, "counters", None) or Counter()
        self._queue: queue.Queue = queue.Queue()
        self._queued = 0                       # blocks waiting or being promoted
        self._pending: set[bytes] = set()      # ns_id + key of those blocks
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-prefetch", daemon=True)
        self._thread.start()

    def submit(self, ns_id: bytes, keys: Sequence[bytes], where: Sequence[str | None]) -> int:
        """Queue the promotion of the keys held only below host; returns how many were queued.

        Keys are grouped into runs of consecutive stored keys, because an Acquire promotes the
        longest stored prefix of what it is given and stops at the first key nobody holds.
        """
        runs: list[list[bytes]] = []
        run: list[bytes] = []
        with self._lock:
            for k, t in zip(keys, where, strict=True):
                g = ns_id + k
                if t is None or t == "host" or g in self._pending:
                    if run:
                        runs.append(run)
                        run = []
                    continue
                if self._queued >= self.max_queued:
                    self.counters["prefetch_refused_blocks"] += 1
                    continue
                self._pending.add(g)
                self._queued += 1
                run.append(k)
            if run:
                runs.append(run)
        for r in runs:
            self._queue.put((ns_id, r))
        return sum(len(r) for r in runs)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            if item is None:
                return
            ns_id, keys = item
            try:
                self._promote(ns_id, keys)
            finally:
                with self._lock:
                    for k in keys:
                        self._pending.discard(ns_id + k)
                    self._queued -= len(keys)

    def _promote(self, ns_id: bytes, keys: list[bytes]) -> None:
        try:
            lease = self.store.acquire(ns_id, keys, for_client=False)
        except Exception as e:  # a closing store, a failed read: the engine sees a miss later
            self.counters["prefetch_failed_blocks"] += len(keys)
            log.debug("prefetch of %d blocks failed: %s", len(keys), e)
            return
        try:
            n = len(lease.keys)
            self.counters["prefetched_blocks"] += n
            self.counters["prefetch_failed_blocks"] += len(keys) - n
        finally:
            self.store.release(lease.id, missing_ok=True)

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._queue.put(None)
        self._thread.join(timeout_s)
