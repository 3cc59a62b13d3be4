"""kvstore/checksums.py: the daemon's parallel xxh3 gives each view's own checksum, in order."""

from __future__ import annotations

import numpy as np
import xxhash

from kvstore.checksums import PARALLEL_MIN_BYTES, xxh3_many


def test_parallel_and_serial_batches_give_each_views_checksum() -> None:
    data = np.random.default_rng(1).integers(0, 256, 3 * PARALLEL_MIN_BYTES, dtype=np.uint8)
    size = 300_001                                  # odd sizes: no alignment assumed
    views = [memoryview(data[i:i + size]) for i in range(0, data.nbytes - size, size)]
    assert sum(v.nbytes for v in views) >= PARALLEL_MIN_BYTES     # the threaded path
    want = [xxhash.xxh3_64_intdigest(v) for v in views]
    assert xxh3_many(views) == want
    assert xxh3_many(views[:3]) == want[:3]         # small: the calling thread alone
    assert xxh3_many([]) == []
