"""SSD tier: block payloads in a preallocated payload file, metadata in LMDB; survives restarts.

Layout of the tier's folder:
- `payload.dat`  block payloads at 4 KiB-aligned extents (payload.py); never larger than the
                 tier's capacity, which bounds the extents (`used_bytes`), not value lengths
- `index/`       the LMDB environment: a record per block naming its extent, length and
                 checksum, the namespaces, the store's state, the tier's used bytes (index.py)
- `index.img`    the index image of the last clean stop, so a restart need not scan LMDB
                 (image.py)

Crash order: a batch's payloads are written (and, with `sync`, fdatasync'd) before the
transaction that points the index at them commits, so a committed record never names an extent
that was not written; a crash between the two leaves only unreferenced space, which the next
open counts as free. Without `sync` neither the payloads nor LMDB's commits are forced to the
device per batch (sync() does both, payloads first: the store's Flush and a stop); a power loss
may then leave a record whose payload did not reach the disk, which its checksum turns into a
miss. Every read verifies the value's checksum against its record: a torn or stale payload is
DataLoss (a miss), never served.

A folder of the old format (payloads inside LMDB, `data.mdb` at the top) is migrated on open,
or refused with one line when that fails; a newer format is refused, never misread.

| module | job |
| --- | --- |
| `tier` | `SSDTier`: the keyed tier's API, each operation the ordering rules above |
| `payload` | the payload file: extents, growth, deferred frees, the writer thread, reads |
| `index` | the LMDB environment: records, namespaces, state, used bytes, the map's growth |
| `image` | the index image's file format and its staleness stamp |
| `migrate` | the old format (payloads in LMDB) copied into this one |
| `disk_full` | no room for a write: the filesystem full (`DiskFull`), the cap (`CapacityFull`) |
"""

from __future__ import annotations

from .disk_full import CapacityFull, DiskFull
from .index import initial_map_size
from .payload import extent_size
from .tier import SSDTier

__all__ = ["CapacityFull", "DiskFull", "SSDTier", "extent_size", "initial_map_size"]
