"""Promote-ahead: bring blocks up from SSD or the remote tier before an engine asks for them.

Engines whose scheduler must never block (vLLM's tiered offloading) ask where blocks are with
`Locate(prefetch=true)`, answer "retry" for blocks below host, and load them once they are in
host memory. The promotion itself is an ordinary Acquire whose lease is released at once: the
block stays in host, unpinned, as recently used as a real read makes it.

One background thread works through bounded queues, so a burst of lookups never holds more
than `max_queued` blocks of promotion work; what does not fit is refused (counted) and the
engine simply keeps seeing the block as not ready, then as ready once a later Locate promotes it.

Why one queue per tenant, served in turn: the queue is shared work, and with a single FIFO one
tenant's burst of Locates would both fill it (every other tenant's prefetch refused) and put
thousands of SSD reads ahead of everyone else's. Each tenant may hold at most `per_tenant`
queued blocks, and the worker takes one run from each tenant in turn.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any

log = logging.getLogger("kvstore.prefetch")

# A run longer than this is promoted in pieces, so a tenant's turn is one short Acquire.
TURN_BLOCKS = 64


class Prefetcher:
    def __init__(self, store: Any, max_queued: int = 4096, per_tenant: int = 1024) -> None:
        self.store = store
        self.max_queued = max_queued
        self.per_tenant = min(per_tenant, max_queued)
        # The store's own counters, so Stats and the metrics endpoint show prefetching too.
        self.counters: Counter = getattr(store, "counters", None) or Counter()
        self._runs: dict[str, deque[tuple[bytes, list[bytes]]]] = {}   # tenant -> its runs
        self._turns: deque[str] = deque()      # tenants with runs waiting, in serving order
        self._queued = 0                       # blocks waiting or being promoted
        self._queued_by: Counter = Counter()   # the same, per tenant
        self._pending: set[bytes] = set()      # ns_id + key of those blocks
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvstore-prefetch", daemon=True)
        self._thread.start()

    def submit(self, ns_id: bytes, keys: Sequence[bytes], where: Sequence[str | None],
               tenant: str | None = None) -> int:
        """Queue the promotion of the keys held only below host; returns how many were queued.

        Keys are grouped into runs of consecutive stored keys, because an Acquire promotes the
        longest stored prefix of what it is given and stops at the first key nobody holds.
        `tenant` None (no tenants configured) is bound only by `max_queued`.
        """
        who = "" if tenant is None else tenant
        cap = self.max_queued if tenant is None else self.per_tenant
        runs: list[list[bytes]] = []
        run: list[bytes] = []
        with self._cv:
            if self._stop:
                return 0
            for k, t in zip(keys, where, strict=True):
                g = ns_id + k
                skip = t is None or t == "host" or g in self._pending
                if run and (skip or len(run) == TURN_BLOCKS):
                    runs.append(run)
                    run = []
                if skip:
                    continue
                if self._queued >= self.max_queued or self._queued_by[who] >= cap:
                    self.counters["prefetch_refused_blocks"] += 1
                    continue
                self._pending.add(g)
                self._queued += 1
                self._queued_by[who] += 1
                run.append(k)
            if run:
                runs.append(run)
            if runs:
                mine = self._runs.setdefault(who, deque())
                if not mine:
                    self._turns.append(who)
                mine.extend((ns_id, r) for r in runs)
                self._cv.notify()
        return sum(len(r) for r in runs)

    def _next(self) -> tuple[str, bytes, list[bytes]] | None:
        with self._cv:
            while not self._turns and not self._stop:
                self._cv.wait()
            if self._stop:
                return None
            who = self._turns.popleft()
            mine = self._runs[who]
            ns_id, keys = mine.popleft()
            if mine:
                self._turns.append(who)        # back of the line: the others go first
            else:
                del self._runs[who]
            return who, ns_id, keys

    def _run(self) -> None:
        while (item := self._next()) is not None:
            who, ns_id, keys = item
            try:
                self._promote(ns_id, keys)
            finally:
                with self._cv:
                    for k in keys:
                        self._pending.discard(ns_id + k)
                    self._queued -= len(keys)
                    self._queued_by[who] -= len(keys)
                    if self._queued_by[who] <= 0:
                        del self._queued_by[who]

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
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout_s)
