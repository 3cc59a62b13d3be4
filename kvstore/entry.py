"""A block's record in the index (`Entry`), the names of the tiers it can live in, and the
listener told of every change of where it lives.

Why apart from the index (kvstore/index.py): every other part of the daemon reads and changes
blocks through these records (the store, the moves between tiers, the policies, KV events),
while only the index knows how they are packed; the listener's contract (what it is told, and
under which lock) is what kvstore/events/ builds on.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

NS_ID_BYTES = 16
# The tiers a block can be resident in, as the residency listener names them.
GPU, HOST, SSD, REMOTE = "gpu", "host", "ssd", "remote"


@dataclass(slots=True)
class Entry:
    ns_id: bytes
    key: bytes
    parent: bytes | None        # parent block key (same namespace), None for a prompt's first block
    size: int                   # raw block bytes
    checksum: int               # xxh3-64 of the raw bytes
    host: int | None = None     # offset in the host slab
    ssd: bool = False
    remote: bool = False
    pins: int = 0               # read leases holding the host copy
    gpu: int | None = None      # offset in the device slab of device `gpu_dev` (gpu tier)
    gpu_dev: int = 0
    gpu_pins: int = 0           # read leases holding the gpu copy
    children: int = 0           # indexed blocks whose parent this is
    # Set while the block moves between tiers outside the store lock (kvstore/moves/):
    # an acquire promoting it (host copy None; other acquires wait on the event), or an
    # eviction demoting it to SSD (host copy still there, readable and acquirable). Meanwhile
    # no delete, eviction or other demotion or promotion touches it.
    moving: threading.Event | None = None
    row: int = -1               # the block's row in the index (set by BlockIndex.add)

    @property
    def gkey(self) -> bytes:
        return self.ns_id + self.key

    @property
    def parent_gkey(self) -> bytes | None:
        return self.ns_id + self.parent if self.parent else None

    @property
    def resident(self) -> bool:
        return self.host is not None or self.ssd or self.remote or self.gpu is not None


class ResidencyListener(Protocol):
    """Told of every change of a block's residency (kvstore/events/ publishes them).

    Called under the store lock, after the change: `changed` when block `e` entered (True) or
    left (False) `tier` (its fields show the new state); `discarded` when it left the index
    with the tiers its fields still show (each of those is left). A listener may also have
    `changed_many(entries, tier, entered)`, the same as `changed` for each in order: the index
    calls it for a batch published at once (BlockIndex.add_host_many)."""

    def changed(self, e: Entry, tier: str, entered: bool) -> None: ...

    def discarded(self, e: Entry) -> None: ...
