"""The daemon's cyclic-GC pauses: what a full collection walks once the daemon is warm.

A full collection holds the GIL while it walks every tracked object, inside whichever call
tripped it (kvstore/gc_pauses.py). The daemon freezes what its startup and warm-ups made (code,
numpy, numba and the codec kernels) so that collections walk only the live state; this checks
that on a real daemon once its warm-ups are done, and that pauses are counted while blocks
move through SSD.
"""

from __future__ import annotations

import time

import kvstore_client
import numpy as np
from kvstore_client import KVLayout

from tests.daemon import cleanup, start_daemon

WARMUP_DEADLINE_S = 120.0   # the warm-ups load numba and the kernels; a loaded machine is slow
# A full collection walks about 1 us per object: 20k objects is a pause of ~20 ms at worst.
# The warm-ups alone leave tens of thousands unfrozen when the freeze runs before them.
MOST_OBJECTS = 20_000


def _counters(c) -> dict:
    return c.stats().get("counters", {})


def test_full_collection_walks_only_live_state_after_warmup(tmp_path):
    d = start_daemon(tmp_path, {"host.capacity": "4MiB", "ssd.capacity": "64MiB"})
    try:
        with kvstore_client.connect(d.address) as c:
            deadline = time.monotonic() + WARMUP_DEADLINE_S
            counters = _counters(c)
            while "gc_frozen_objects" not in counters:
                assert time.monotonic() < deadline, "the daemon's warm-ups never finished"
                time.sleep(0.2)     # polling a remote counter: no event to wait on
                counters = _counters(c)
            assert 0 <= counters["gc_walked_objects"] <= MOST_OBJECTS, counters
            # Blocks through host and SSD (4 MiB host pool: these spill): the codecs run, and
            # the pauses are counted.
            lay = KVLayout(4, 2, 32, 16, "float16")
            ns = c.namespace(lay, model="gc-test")
            rng = np.random.default_rng(0)
            kv = rng.standard_normal((4, 2, 64 * 16, 2, 32)).astype(np.float16)
            for p in range(8):
                ids = np.arange(p * 64 * 16, (p + 1) * 64 * 16)
                ns.store(ids, kv)
            out = np.empty_like(kv)
            ns.load(np.arange(0, 64 * 16), out)
            assert np.array_equal(out, kv)
            counters = _counters(c)
            assert counters.get("gc_full_collections", -1) >= 0
            assert counters.get("background_demotion_bytes", 0) > 0
    finally:
        cleanup(d)
