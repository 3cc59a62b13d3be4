"""gpu -> SSD: a flush writes the blocks only a device holds straight to SSD.

Why through host memory and the host codecs: a block must be stored in the same payload
version whatever tier it left from, or a codec name would mean two formats (quantizing on the
device wrote lossy payload v2 with CUDA and v4 on the CPU device). So each block is copied
device -> a private host buffer (not a host slot: the host pool may be full, and a flush must
not evict to make room for what it is writing down), verified against the block's checksum as
it lands (verify on settle: a copy that differs is dropped, never written), encoded by the
same encoder as every other demotion, and written by host_to_ssd.put, the one SSD write.
Lossy codecs thus send the whole block over PCIe rather than codes and scales; a flush is not
on an engine's path.

Three phases per batch: picked and marked `moving` under the lock, copied, encoded and written
without it, indexed as SSD copies under it again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvstore_client.common.lazy import lazy_module

from ..index import Entry
from ..state import StoreState, aligned
from .common import Flight, copy_verified
from .encoding import Encoder
from .gpu_host import DEVICE_WAIT_S, GpuHost
from .host_to_ssd import HostToSSD

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy", globals(), "np")

FLUSH_BATCH = 16            # blocks copied down per flight


class GpuToSSD:
    def __init__(self, state: StoreState, gpu_host: GpuHost, to_ssd: HostToSSD,
                 encoder: Encoder) -> None:
        self.state = state
        self.gpu_host = gpu_host
        self.to_ssd = to_ssd
        self.encoder = encoder

    def flush(self, only: set[bytes] | None = None, deadline: float | None = None,
              cancelled: Callable[[], bool] | None = None, written: int = 0) -> int:
        """Write every gpu-only block (of the namespaces `only` names) to SSD (locked; released
        for each batch's transfer); returns the blocks written. `deadline` (time.monotonic())
        and `cancelled()`: as Moves.flush, checked before each batch (`written`: the blocks
        the flush wrote before this, for the message)."""
        from kvstore_client.common.errors import DeadlineExceeded

        from ..state import CallCancelled

        st = self.state
        todo = [e for e in st.index.hot_entries()
                if e.gpu is not None and e.host is None and not e.ssd and e.moving is None
                and (only is None or e.ns_id in only)]
        done = 0
        for dev in st.gpu:
            mine = [e for e in todo if e.gpu_dev == dev]
            for i in range(0, len(mine), FLUSH_BATCH):
                gone = cancelled is not None and cancelled()
                if gone or (deadline is not None and time.monotonic() >= deadline):
                    why = "the client went away" if gone else "it passed its deadline"
                    raise (CallCancelled if gone else DeadlineExceeded)(
                        f"Flush ended writing device-only blocks: {why}; {written + done} "
                        "blocks were written to SSD (not yet synced); call Flush again for "
                        "the rest")
                # (still the index's own: one deleted while an earlier batch was written is
                # not this block any more, whatever its fields say)
                batch = [e for e in mine[i:i + FLUSH_BATCH]
                         if e.gpu is not None and e.moving is None and not e.ssd
                         and st.index.get(e.gkey) is e]
                if batch:
                    done += self.demote(dev, batch)
        return done

    def demote(self, dev: int, batch: list[Entry]) -> int:
        """Copy, verify, encode and write one batch of a device's blocks to SSD (locked on
        entry and return); returns the blocks written."""
        st = self.state
        offsets, pos = [], 0
        for e in batch:
            offsets.append(pos)
            pos += aligned(e.size)
        items = [(e.gpu, off, e.size) for e, off in zip(batch, offsets, strict=True)]
        flight = Flight(st, batch)
        st.demotions.add(flight.event)
        bad: list[Entry] = []
        written: list[tuple[Entry, int]] = []
        try:
            with st.unlocked():
                scratch = np.empty(pos, np.uint8)
                sums = st.gpu[dev].copy_to_host_checked(items, scratch, DEVICE_WAIT_S)
            good = []
            for e, off, s in zip(batch, offsets, sums, strict=True):
                if copy_verified(e, s):
                    good.append((e, off))
                else:
                    bad.append(e)
            jobs = [self.encoder.job(e, scratch[off:off + e.size], None) for e, off in good]
            with st.unlocked():
                values, local = self.encoder.encode(jobs)
            st.counters.update(local)
            entries = [e for e, _ in good]
            lengths = [len(v) for v in values]

            def fill(i: int, dst: memoryview) -> bool:
                dst[:] = values[i]
                return True
            stored = self.to_ssd.put(entries, list(range(len(entries))), lengths, fill,
                                     strict=True)
            written = [(entries[i], lengths[i]) for i, ok in stored if ok]
        finally:
            st.demotions.discard(flight.event)
            flight.land()
        self.to_ssd.settle(written, source="gpu")
        for e in bad:       # the gpu copy does not match the block's checksum: never served
            st.counters["corrupt_blocks"] += 1
            self.gpu_host.drop_copy(e)
            st.index.drop_if_gone(e)
        return len(written)
