"""SSD -> host: the fill phase of a promotion whose source is the SSD tier.

The reservation and the settle are every promotion's (kvstore/moves/promotion.py); this is the
transfer. Blocks of one acquire were usually demoted together, so their extents lie side by
side in the payload file: a chunk of about 8 MiB of a prefix is read with one O_DIRECT pread
per run of adjacent extents (tiers/ssd/tier.py, visit_many) and each block is decoded straight from
the tier's read buffer into its reserved host slot, no copy in between. The read buffer has
been checked against each record's checksum of the whole value, so the frame's own payload
hash would find nothing new and is skipped.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore_client.common.errors import DataLoss
from kvstore_client.common.layout import KVLayout

from tiers import frame

from ..state import StoreState
from .promotion import Promotion, decode_into


class SSDToHost:
    def __init__(self, state: StoreState) -> None:
        self.state = state

    def fill(self, chunk: list[Promotion], layout: KVLayout,
             fallback: Callable[[Promotion, KVLayout], None]) -> None:
        """Read and decode a chunk of promotions from SSD (no lock held). A block LMDB no
        longer has is marked `ssd_missed` and handed to `fallback` (the remote prefetch)."""
        host = self.state.host

        def got(i: int, mv: memoryview) -> None:
            decode_into(host, chunk[i], frame.unframe(mv, checked=True), layout)
            chunk[i].nbytes = len(mv)
        found = self.state.ssd.visit_many([p.entry.gkey for p in chunk], got)
        for p, f in zip(chunk, found, strict=True):
            if isinstance(f, DataLoss):     # the payload fails its checksum: never served
                p.source, p.error = "ssd", f
            elif f:
                p.source = "ssd"
            else:
                p.ssd_missed = True
                fallback(p, layout)
