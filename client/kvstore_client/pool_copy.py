"""Copying blocks into and out of the daemon's mapped host pool, and the checks around it.

A store fills slots through a `Fill`, a load empties them through a `Drain`. Unless marked
`fused` (one pass that copies and checksums), both run in ~4 MiB chunks so the checksum pass
reads bytes the copy just left in cache. Before a byte moves, every slot the daemon handed
out is checked to fit the pool, and the mapping to be the daemon's current one: a restarted
daemon's pool is another segment, and a copy into the old one would be lost (`Stale`: the
namespace resyncs and runs the call once more).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from ._proto import kvstore_pb2 as pb
from .common.errors import DataLoss

if TYPE_CHECKING:
    from .client import Client
    from .host_pool import MappedPool

# Blocks are copied and checksummed in groups of about this many bytes, so the checksum pass
# reads bytes the copy just left in cache.
_CHUNK_BYTES = 4 << 20

Fill = Callable[[np.ndarray, Sequence[int], int], "np.ndarray | None"]
"""fill(base, offsets, first): write blocks first, first+1, ... into base[offsets[j]:+bb].

It may return the xxh3-64 of each block it wrote (uint64 array), computed in the copy's pass;
when it returns None the namespace checksums the slots itself (a second pass)."""
Drain = Callable[[np.ndarray, Sequence[int], int], "np.ndarray | None"]
"""drain(base, offsets, first): copy base[offsets[j]:+bb] out as blocks first, first+1, ...

Like Fill, it may return the xxh3-64 of each block it read, for the load's verification."""


def fused(fn: Callable) -> Callable:
    """Mark a fill/drain that takes a whole batch at once and returns its checksums.

    Unmarked callbacks are called in ~4 MiB chunks so a separate checksum pass reads bytes the
    copy just left in cache; a fused one already did both in one pass, so one call per batch
    (and one Python call per batch, not per block) is what it wants.
    """
    fn._kvstore_fused = True  # type: ignore[attr-defined]
    return fn


def is_fused(fn: Callable) -> bool:
    return bool(getattr(fn, "_kvstore_fused", False))


class Stale(Exception):
    """The pool mapping or a lease went stale mid-call: resync and try again."""


def current_pool(client: Client) -> MappedPool:
    """The mapped host pool, or Stale when the daemon replaced its segment (a restart)."""
    pool = client.pool
    if pool is None or not pool.current():
        raise Stale("host pool segment replaced")
    return pool


def pool_bytes(pool: MappedPool) -> np.ndarray:
    """The mapped pool's bytes, or Stale once another call re-mapped a restarted daemon's
    pool and closed this one. Why: a call holds its `MappedPool` for a whole round trip (a
    `Pinned` for as long as it lives) and `_adopt` closes it under them; the caller's
    reference to the array keeps the mapping alive for its copy (shm.SharedSlab.close)."""
    arr = pool.slab.array
    if arr is None:
        raise Stale("host pool closed: the daemon restarted and its new pool is mapped")
    return arr


def check_slots(slots: Sequence[pb.Slot], pool: MappedPool, block_bytes: int) -> list[int]:
    """The slots' offsets, or DataLoss for a slot that is not one block inside the pool."""
    offsets = []
    for s in slots:
        if s.length != block_bytes or s.offset + s.length > pool.size:
            raise DataLoss(f"daemon handed out slot ({s.offset}, {s.length}) that does not "
                           f"fit a {block_bytes}-byte block in a {pool.size}-byte pool")
        offsets.append(int(s.offset))
    return offsets


def fill_checksummed(fill: Fill, base: np.ndarray, offsets: list[int], first: int, bb: int
                     ) -> list[int]:
    """Run fill over the batch; the checksums to send with Commit.

    Why always, `verify` or not: the daemon cannot tell the bytes this client wrote from a
    late write into the same slots by a client whose lease on them expired (a stalled
    process resuming its copy), and refuses a host Commit without them."""
    if is_fused(fill):
        got = fill(base, offsets, first)
        if got is not None and len(got) == len(offsets):
            return got.tolist()
        return [xxhash.xxh3_64_intdigest(base[o:o + bb]) for o in offsets]
    sums: list[int] = []
    for c0, c1 in block_chunks(len(offsets), bb):
        got = fill(base, offsets[c0:c1], first + c0)
        if got is not None and len(got) == c1 - c0:
            sums += got.tolist()
        else:
            sums += [xxhash.xxh3_64_intdigest(base[o:o + bb]) for o in offsets[c0:c1]]
    return sums


def drain_verified(drain: Drain, base: np.ndarray, offsets: list[int], bb: int,
                   want: list[int] | None) -> int:
    """Run drain over the batch; blocks of the verified prefix (all of them when want is None).

    A fused drain checksums in its copy pass, so a block that fails has already been copied:
    the caller serves only the prefix before it (positions past it hold unverified bytes).
    """
    n = len(offsets)
    if is_fused(drain):
        chunks: Iterator[tuple[int, int]] = iter([(0, n)])
    else:
        chunks = block_chunks(n, bb)
    for c0, c1 in chunks:
        got = drain(base, offsets[c0:c1], c0)
        if want is None:
            continue
        if got is None or len(got) != c1 - c0:
            got = np.array([xxhash.xxh3_64_intdigest(base[o:o + bb]) for o in offsets[c0:c1]],
                           dtype=np.uint64)
        bad = np.flatnonzero(got != np.array(want[c0:c1], dtype=np.uint64))
        if bad.size:
            return c0 + int(bad[0])
    return n


def block_chunks(n: int, block_bytes: int) -> Iterator[tuple[int, int]]:
    """[c0, c1) ranges of n blocks, about _CHUNK_BYTES each."""
    per = max(1, _CHUNK_BYTES // max(1, block_bytes))
    for c0 in range(0, n, per):
        yield c0, min(n, c0 + per)
