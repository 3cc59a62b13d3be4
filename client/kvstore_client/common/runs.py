"""Merging copy runs that continue each other on both sides into fewer, larger copies.

Shared because the SDK's paged copies (paged_copy.py) and the daemon's device tiers
(tiers/device.py) both move lists of (source, destination, length) runs.
"""

from __future__ import annotations

import numpy as np


def coalesce_runs(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge runs that continue each other on both sides (fewer, larger copies)."""
    if src.size == 0:
        return src, dst, nbytes
    order = np.argsort(src, kind="stable")
    s, d, n = src[order], dst[order], nbytes[order]
    joins = (s[1:] == s[:-1] + n[:-1]) & (d[1:] == d[:-1] + n[:-1])
    head = np.concatenate(([True], ~joins))
    group = np.cumsum(head) - 1
    sizes = np.bincount(group, weights=n).astype(np.int64)
    return s[head], d[head], sizes
