"""Per-key lookups that never block vLLM's scheduler.

vLLM asks a secondary tier about one chunk at a time, in its scheduler loop, and keeps scanning a
request's chunks past a "retry" answer. So the first time a key is asked about it is queued and
answered "retry"; a background thread sends every queued key of the step to the daemon in one
Locate call (which also starts promoting keys found on SSD or the remote tier into host memory),
and the next scan of the request finds the answer:

- in host memory: "hit" (vLLM then loads it);
- below host: "retry" while the daemon promotes it, asked again shortly;
- not stored, or no answer within the deadline (daemon down, slow, restarting): "miss".

Answers are cached briefly (a hit for `hit_ttl_s`, a miss for `miss_ttl_s`) so a request's
re-scans cost a dict lookup each, and a block another engine stores becomes visible soon.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

HIT, MISS, RETRY = "hit", "miss", "retry"


@dataclass
class LookupStats:
    queries: int = 0          # Locate calls sent
    keys_asked: int = 0       # keys those calls carried
    hits: int = 0
    misses: int = 0
    deadline_misses: int = 0  # keys answered "miss" because the daemon did not answer in time
    pending: int = 0          # keys found below host (promotion started)
    errors: list[str] = field(default_factory=list)


class Lookups:
    """Key -> answer cache fed by a background thread.

    `locate(keys)` runs on that thread and returns, per key, "host", a lower tier name, or None;
    it raises when the daemon cannot be asked (then every key in the batch is a miss).
    """

    def __init__(self, locate: Callable[[Sequence[bytes]], list[str | None]], *,
                 deadline_s: float = 1.0, hit_ttl_s: float = 10.0, miss_ttl_s: float = 0.5,
                 pending_recheck_s: float = 0.02, promote_deadline_s: float = 30.0,
                 max_batch: int = 4096) -> None:
        self._locate = locate
        self.deadline_s = deadline_s
        self.hit_ttl_s = hit_ttl_s
        self.miss_ttl_s = miss_ttl_s
        self.pending_recheck_s = pending_recheck_s
        self.promote_deadline_s = promote_deadline_s
        self.max_batch = max_batch
        self.stats = LookupStats()
        # key -> (answer, since): HIT / MISS with the time answered, RETRY with the time asked
        self._state: dict[bytes, tuple[str, float]] = {}
        self._waiting: set[bytes] = set()           # keys answered RETRY, answer not yet known
        self._promoting: dict[bytes, float] = {}    # keys below host -> when first seen there
        self._held: dict[bytes, float] = {}         # keys that failed to load -> MISS until
        self._queue: list[bytes] = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvstore-vllm-lookup",
                                        daemon=True)
        self._thread.start()

    def lookup(self, key: bytes) -> str:
        """HIT, MISS or RETRY for one key, at once."""
        now = time.monotonic()
        held = self._held.get(key)
        if held is not None:
            if now < held:
                return MISS
            self._held.pop(key, None)
        st = self._state.get(key)
        if st is not None:
            answer, since = st
            if answer == HIT and now - since < self.hit_ttl_s:
                return HIT
            if answer == MISS and now - since < self.miss_ttl_s:
                return MISS
            if answer == RETRY:
                if now - since < self.deadline_s:
                    return RETRY
                self._state[key] = (MISS, now)      # no answer in time: the engine goes on
                self._waiting.discard(key)
                self.stats.deadline_misses += 1
                return MISS
        with self._cv:
            if self._closed:
                return MISS
            self._state[key] = (RETRY, now)
            self._waiting.add(key)
            self._queue.append(key)
            self._cv.notify()
        return RETRY

    def pending(self) -> bool:
        """Whether answers are still to come (vLLM keeps stepping while a tier says so)."""
        return bool(self._waiting)

    def waiting_keys(self) -> list[bytes]:
        """Keys asked about whose answer is not in yet."""
        return list(self._waiting.copy())      # one C-level copy: safe against the thread

    def forget(self, keys: Sequence[bytes]) -> None:
        """Drop cached answers (after this engine stored or failed to load these keys)."""
        for k in keys:
            self._state.pop(k, None)
            self._waiting.discard(k)

    def mark_hits(self, keys: Sequence[bytes]) -> None:
        now = time.monotonic()
        for k in keys:
            self._state[k] = (HIT, now)
            self._held.pop(k, None)

    def hold_misses(self, keys: Sequence[bytes], hold_s: float) -> None:
        """Answer MISS for these keys for `hold_s` (after a load of them failed).

        vLLM defers a request while any of its chunks answers HIT_PENDING or RETRY, and after a
        failed promotion it asks again at once: were a block that cannot load (corrupt, gone)
        answered HIT again, the request would be promoted, fail and be deferred forever. A miss
        lets the engine recompute it instead.
        """
        now = time.monotonic()
        until = now + hold_s
        if len(self._held) > 4096:      # keys never asked about again: drop expired holds
            for k in [k for k, t in list(self._held.items()) if t <= now]:
                self._held.pop(k, None)
        for k in keys:
            self._state.pop(k, None)
            self._waiting.discard(k)
            self._held[k] = until

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait(0.5)
                if self._closed:
                    return
                batch, self._queue = self._queue[:self.max_batch], self._queue[self.max_batch:]
            self._ask(list(dict.fromkeys(batch)))

    def _ask(self, keys: list[bytes]) -> None:
        self.stats.queries += 1
        self.stats.keys_asked += len(keys)
        try:
            where = self._locate(keys)
        except Exception as e:
            now = time.monotonic()
            for k in keys:
                self._state[k] = (MISS, now)
                self._waiting.discard(k)
                self._promoting.pop(k, None)
            self.stats.misses += len(keys)
            self._note_error(e)
            return
        now = time.monotonic()
        recheck = []
        for k, t in zip(keys, where, strict=True):
            first = self._promoting.pop(k, now)
            if t == "host":
                self._state[k] = (HIT, now)
                self.stats.hits += 1
            elif t is None or now - first > self.promote_deadline_s:
                self._state[k] = (MISS, now)
                self.stats.misses += 1
            else:                                   # being promoted: ask again shortly
                self._state[k] = (RETRY, now)       # the deadline counts from this answer
                self._promoting[k] = first
                self.stats.pending += 1
                recheck.append(k)
                continue
            self._waiting.discard(k)
        if recheck:
            threading.Timer(self.pending_recheck_s, self._requeue, (recheck,)).start()

    def _requeue(self, keys: list[bytes]) -> None:
        with self._cv:
            if self._closed:
                return
            self._queue.extend(k for k in keys if self._state.get(k, (None,))[0] == RETRY)
            self._cv.notify()

    def _note_error(self, e: Exception) -> None:
        errs = self.stats.errors
        errs.append(f"{type(e).__name__}: {e}")
        del errs[:-5]

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(2.0)
