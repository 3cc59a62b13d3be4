"""Checksums of committed blocks, checked before bytes leave the host pool.

Why the daemon checks at all: clients map the host pool read-write (that is what makes
zero-copy writes possible), so a committed block's slot can be overwritten by a buggy or
hostile client after Commit. The shared-memory read path catches that on the client, but every
path the daemon serves itself (Get, demotion to SSD and Redis, write-through) would otherwise
hand the overwritten bytes on, and a lower tier would then keep them as if they were good.

Why the copy is what gets hashed: a slot may change between a check and the copy that is sent
or encoded. Hashing the private copy (the Get message, the buffer handed to the encoder) is the
only order in which a passing check says something about the bytes that actually leave.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash


def first_mismatch(copies: Sequence, checksums: Sequence[int]) -> int:
    """Index of the first copy whose xxh3-64 differs from its checksum (len(copies) if none).

    Every checksum is compared, 0 included: a host or gpu copy's checksum is the hash of the
    bytes its committer wrote (clients may not send 0, kvstore/store.py commit), so there is no
    "unknown" to skip; were 0 skipped, a client could commit 0 and have any bytes served.
    """
    h = xxhash.xxh3_64_intdigest
    for i, (data, want) in enumerate(zip(copies, checksums, strict=False)):
        if h(data) != want:
            return i
    return len(copies)


def matches(data: object, checksum: int | None) -> bool:
    """True when `data` hashes to `checksum`; None: not checked (host.verify_reads off)."""
    return checksum is None or xxhash.xxh3_64_intdigest(data) == checksum
