"""The cyclic garbage collector's pauses: kept short.

A collection holds the GIL for as long as it walks the objects of the generations it
collects; a full (generation 2) collection walks every tracked object of the process, and
whichever call trips it waits that long. Under a load of 16 clients the daemon's full
collections walked about 100k objects and took 70-90 ms of CPU each: 20x the median load's
latency, in one call. Nearly all of those objects are made once and live as long as the
daemon: modules, and above all what the warm-ups load (numpy, numba and the compiled codec
kernels, tens of thousands of objects). `gc.freeze()` moves the objects alive at that moment
to a generation no collection walks; so it runs once the warm-ups are done, not only after
startup (a freeze before them left everything they load to every full collection).

Reported: `gc_frozen_objects` and `gc_walked_objects`, set once the warm-ups are done, and
`gc_full_collections` (the interpreter's own count, read at each Stats call). The pauses are
not timed: a `gc.callbacks` hook runs Python code at every collection, generation 0 included,
and timing each one halved the gRPC Put stream's throughput (0.34 to 0.20 GB/s).
`gc_walked_objects` is what a full collection walked once the warm-ups were done: read once
there, not at each Stats call, because counting walks every tracked object itself (about
60 ns an object, 120 ms for a 2M-object heap) and Stats runs under the store lock.
"""

from __future__ import annotations

import gc


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


def full_collections() -> int:
    """Full collections since the process started (the interpreter's count: nothing is run
    per collection to keep it)."""
    return gc.get_stats()[2]["collections"]
