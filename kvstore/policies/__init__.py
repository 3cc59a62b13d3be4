"""Eviction policies: which resident block a tier gives up next (see docs/eviction.md).

One policy instance per tier. It sees only global keys and owns its ordering state, so the store
can swap policies per tier and the bench can replay traces against exactly the code the daemon
runs. Three policies:

* ``"lru"`` — prefix leaves first, least recently used first among leaves. A block whose
  children are resident is never a victim: a child is unreachable without its parent, so evicting
  the parent first would waste the child's slot.
* ``"default"`` — segmented LRU over the same prefix leaves (probation for blocks seen once,
  protected for blocks seen again), whose protected share is chosen online by miniature
  shadow caches (plain LRU is one of the candidates), plus a learned rule that sends a put's
  last block (usually a partial block in a prefix cache) to the eviction end when such tails
  are observed to be reused far less than other new blocks. Optional hook: ``note_put``.
* ``"lru"`` and ``"default"`` also take the engine's reuse hints (``Store.retain``) through
  the optional hook ``note_retention(gkeys, level)``: "low" to the eviction end, "high" kept
  like a block already reused.
* ``"arc"`` — the previous default: adaptive replacement (ARC, Megiddo & Modha) over prefix
  leaves with a sampled LRU guard. Kept for comparison (``--policies arc`` in the bench).

Every operation is O(1) or O(log n) amortized: leaves sit in lazily invalidated heaps that are
rebuilt when more than half their entries are stale.

| module | job |
| --- | --- |
| `base` | the interface the store codes against (`EvictionPolicy`), snapshot packing |
| `leaves` | the prefix forest of resident blocks and its leaf heaps (`PrefixLeaves`) |
| `packed_leaves` | the same forest in packed arrays keyed by index row (`RowLeaves`): SSD |
| `evicted_keys` | the ghost history, evicted keys as fingerprints (`GhostKeys`): SSD |
| `lru`, `arc`, `segmented` | one policy each; `segmented` is `"default"` |
| `segments` | the default's heaps (block class x engine hint) and which each order empties first |
| `simulate` | one access to a miniature copy of the default: what its tuner runs |
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvstore_client.common.errors import InvalidArgument

from .arc import AdaptivePolicy
from .base import EvictionPolicy
from .lru import LRUPolicy
from .packed_leaves import Rows
from .segmented import SegmentedPolicy

__all__ = ["AdaptivePolicy", "EvictionPolicy", "LRUPolicy", "SegmentedPolicy", "make_policy"]


_POLICIES: dict[str, Callable[[int | None], Any]] = {
    "lru": LRUPolicy,
    "default": SegmentedPolicy,
    "arc": AdaptivePolicy,
}


def make_policy(name: str, capacity_blocks_hint: int | None = None,
                rows: Rows | None = None) -> EvictionPolicy:
    """A fresh policy by name: "lru", "default" (the tuned segmented policy) or "arc".

    `rows` (the block index): "default" keeps its per-block state in packed arrays keyed by
    index row, for a tier holding millions of blocks; the order is the same either way."""
    factory = _POLICIES.get(name)
    if factory is None:
        raise InvalidArgument(f"unknown eviction policy {name!r}; choose one of "
                              f"{sorted(_POLICIES)}")
    if rows is not None and factory is SegmentedPolicy:
        return SegmentedPolicy(capacity_blocks_hint, rows=rows)
    return factory(capacity_blocks_hint)
