"""Who holds the store lock, and for how long: an opt-in measuring wrapper around the RLock.

Why: under many clients a call's latency is mostly waits for the store lock, and a wait is as
long as the hold it waits behind. This records, per call site, how long each outermost hold
lasted (from the acquire that took the lock to the release that gave it up, sites named by
file, line and function, two frames deep past the locking helpers) and how long each acquire
waited for it, plus the individual holds of 5 ms or more.

Off unless `KVS_LOCK_TIMING` names a JSON file: then StoreState's lock is a `TimedRLock`
and the figures are written there when the store closes. Off, the lock is a plain
`threading.RLock` and nothing here runs. On, every outermost acquire walks a few frames (a few
microseconds): a measuring aid, not for production.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

ENV = "KVS_LOCK_TIMING"
LONG_S = 0.005                  # holds at least this long are kept one by one
KEEP_LONG = 5000                # of them, at most this many
_SKIP = ("/kvstore/lock_timing.py", "/contextlib.py", "/threading.py", "/kvstore/state.py")


def make_lock() -> Any:
    """The store lock: a TimedRLock where KVS_LOCK_TIMING is set, else a plain RLock."""
    return TimedRLock() if os.environ.get(ENV) else threading.RLock()


def _site(depth: int = 2) -> str:
    """The first `depth` frames of the caller outside the locking helpers."""
    f = sys._getframe(2)
    parts: list[str] = []
    while f is not None and len(parts) < depth:
        name = f.f_code.co_filename
        if not name.endswith(_SKIP):
            tail = "/".join(name.rsplit("/", 2)[-2:])
            parts.append(f"{tail}:{f.f_lineno}:{f.f_code.co_name}")
        elif name.endswith("/kvstore/state.py") and not parts:
            parts.append(f"state.py:{f.f_code.co_name}")
        f = f.f_back
    return " <- ".join(parts)


class _Stat:
    __slots__ = ("n", "total", "max", "long")

    def __init__(self) -> None:
        self.n = 0
        self.total = 0.0
        self.max = 0.0
        self.long = 0

    def add(self, dt: float) -> None:
        self.n += 1
        self.total += dt
        if dt > self.max:
            self.max = dt
        if dt >= LONG_S:
            self.long += 1

    def row(self) -> dict:
        return {"n": self.n, "total_ms": round(self.total * 1e3, 1),
                "mean_us": round(self.total / self.n * 1e6, 1) if self.n else 0.0,
                "max_ms": round(self.max * 1e3, 2), "ge5ms": self.long}


class TimedRLock:
    """An RLock that times its outermost holds and the waits to take it, by call site.

    Works as a Condition's lock (it keeps RLock's `_release_save`/`_acquire_restore`, so a
    wait ends the hold and its wake-up starts a new one)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._depth = 0             # written by the owner only
        self._since = 0.0
        self._site = ""
        self._stats_lock = threading.Lock()
        self.holds: dict[str, _Stat] = {}
        self.waits: dict[str, _Stat] = {}
        self.long: list[tuple[float, float, str, str]] = []
        self.t0 = time.monotonic()

    # -- the lock ------------------------------------------------------------------------------
    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        t = time.perf_counter()
        got = self._lock.acquire(blocking, timeout)
        if got:
            self._depth += 1
            if self._depth == 1:
                now = time.perf_counter()
                site = _site()
                self._begin(site, now, now - t)
        return got

    def release(self) -> None:
        if self._depth == 1:
            self._end(time.perf_counter())
        self._depth -= 1
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _is_owned(self) -> bool:
        return self._lock._is_owned()  # type: ignore[attr-defined]

    def _release_save(self) -> Any:
        self._end(time.perf_counter())
        depth, self._depth = self._depth, 0
        return depth, self._lock._release_save()  # type: ignore[attr-defined]

    def _acquire_restore(self, saved: Any) -> None:
        depth, inner = saved
        t = time.perf_counter()
        self._lock._acquire_restore(inner)  # type: ignore[attr-defined]
        self._depth = depth
        now = time.perf_counter()
        self._begin(_site(), now, now - t, woke=True)

    # -- the figures ---------------------------------------------------------------------------
    def _begin(self, site: str, now: float, waited: float, woke: bool = False) -> None:
        self._since = now
        self._site = site
        if not woke:
            with self._stats_lock:
                self.waits.setdefault(site, _Stat()).add(waited)

    def _end(self, now: float) -> None:
        held = now - self._since
        key = f"{self._site}  ==>  {_site(1)}"
        with self._stats_lock:
            self.holds.setdefault(key, _Stat()).add(held)
            if held >= LONG_S and len(self.long) < KEEP_LONG:
                self.long.append((round(time.monotonic() - self.t0, 3), round(held * 1e3, 2),
                                  self._site, key))

    def report(self) -> dict:
        with self._stats_lock:
            holds = sorted(self.holds.items(), key=lambda kv: -kv[1].total)
            waits = sorted(self.waits.items(), key=lambda kv: -kv[1].total)
            return {"holds": {k: v.row() for k, v in holds},
                    "waits": {k: v.row() for k, v in waits},
                    "long_holds": list(self.long)}

    def dump(self, path: str | None = None) -> None:
        path = path or os.environ.get(ENV)
        if path:
            with open(path, "w") as f:
                json.dump(self.report(), f, indent=1)
