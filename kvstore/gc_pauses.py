"""The cyclic garbage collector's pauses: kept short, and counted.

A collection holds the GIL for as long as it walks the objects of the generations it
collects; a full (generation 2) collection walks every tracked object of the process, and
whichever call trips it waits that long. Under a load of 16 clients the daemon's full
collections walked about 100k objects and took 70-90 ms of CPU each: 20x the median load's
latency, in one call. Nearly all of those objects are made once and live as long as the
daemon: modules, and above all what the warm-ups load (numpy, numba and the compiled codec
kernels, tens of thousands of objects). `gc.freeze()` moves the objects alive at that moment
to a generation no collection walks; so it runs once the warm-ups are done, not only after
startup (a freeze before them left everything they load to every full collection).

Counted in the store's counters once the warm-ups are done and frozen (`gc_frozen_objects`):
`gc_full_collections`, `gc_full_seconds` (total) and `gc_pause_max_seconds` (the longest
pause of any generation; wall time, so a thread preempted mid-collection counts that too).
`gc_walked_objects` is what a full collection walked once the warm-ups were done: read once
there, not at each Stats call, because counting walks every tracked object itself (about
60 ns an object, 120 ms for a 2M-object heap) and Stats runs under the store lock.
"""

from __future__ import annotations

import gc
import threading
import time
from collections import Counter
from typing import Any


def freeze_long_lived() -> int:
    """Collect, then freeze what is left: the objects alive now are the daemon's for its life
    (modules, kernels, startup state), and no later collection walks them. Returns how many
    objects are frozen in all."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def walked_objects() -> int:
    """The objects a full collection would walk now (builds and drops a list of every tracked
    object: call it once, never on a request path)."""
    return len(gc.get_objects())


class PauseCounter:
    """Times every collection into `counters` (a gc callback: runs on whichever thread the
    collection interrupted, holding the GIL, so it only adds to a few dict entries)."""

    def __init__(self, counters: Counter) -> None:
        self.counters = counters
        self._started = threading.local()

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def remove(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started.t = time.perf_counter()
            return
        started = getattr(self._started, "t", None)
        if started is None:
            return
        took = time.perf_counter() - started
        c = self.counters
        if info.get("generation") == 2:
            c["gc_full_collections"] += 1
            c["gc_full_seconds"] += took
        if took > c.get("gc_pause_max_seconds", 0.0):
            c["gc_pause_max_seconds"] = took
