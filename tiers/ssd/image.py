"""The SSD tier's index image: a file written at a clean stop so a restart need not scan LMDB.

Why: a warm restart rebuilt the store's index, the SSD policy and the tier's free-space map by
reading every LMDB record (twice: the tier and the store each scanned) and running a Python
step per block, 12-30x a bare gRPC server's start for 100k blocks. At a clean stop
everything those steps produce is already in memory; written as packed arrays it loads back in
a few bulk operations.

Why it can never be trusted stale: the file carries a random token and LMDB's transaction id.
The tier commits the same token into LMDB (`_tier/image`) just before writing the file, and an
image is used only when LMDB's token, its last transaction id, its record count and its
used_bytes all equal the file's. Every change to the index is an LMDB write transaction, which
moves the transaction id, so a daemon that wrote anything after the image (or was killed after
writing anything) makes it stale; an interrupted write leaves a file whose checksum or token
does not match. Anything that does not match is ignored and the open falls back to the scan.

File layout: MAGIC, a little-endian u32 header length, the header (JSON: token, txnid,
entries, used_bytes, xxh3-64 of the sections, their names and lengths), then the sections'
bytes back to back. Sections are opaque here; their owners (the tier's allocator, the store's
index and policy) pack and check their own.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import xxhash

MAGIC = b"KVSIMG1\n"
_LEN = struct.Struct("<I")
NAME = "index.img"


@dataclass
class Stamp:
    """What LMDB must say for an image to be current."""

    token: bytes
    txnid: int
    entries: int
    used_bytes: int


def write_image(folder: str, stamp: Stamp, sections: dict[str, bytes]) -> None:
    """Write the image atomically (temporary file, fsync, rename); raises OSError on failure."""
    names = list(sections)
    digest = xxhash.xxh3_64()
    for n in names:
        digest.update(sections[n])
    header = json.dumps({"token": stamp.token.hex(), "txnid": stamp.txnid,
                         "entries": stamp.entries, "used_bytes": stamp.used_bytes,
                         "xxh3": digest.intdigest(),
                         "sections": [[n, len(sections[n])] for n in names]}).encode()
    path = os.path.join(folder, NAME)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb", closefd=True) as f:
            f.write(MAGIC + _LEN.pack(len(header)) + header)
            for n in names:
                f.write(sections[n])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_image(folder: str, stamp: Stamp) -> dict[str, memoryview] | None:
    """The sections of the image in `folder` if it exists, is whole and matches `stamp`
    (views into the file's bytes: no copy of a multi-MB image)."""
    try:
        with open(os.path.join(folder, NAME), "rb") as f:
            data = f.read()
    except OSError:
        return None
    head = len(MAGIC) + _LEN.size
    if len(data) < head or data[:len(MAGIC)] != MAGIC:
        return None
    (hlen,) = _LEN.unpack_from(data, len(MAGIC))
    try:
        meta = json.loads(data[head:head + hlen])
        if (bytes.fromhex(meta["token"]) != stamp.token or meta["txnid"] != stamp.txnid
                or meta["entries"] != stamp.entries or meta["used_bytes"] != stamp.used_bytes):
            return None
        body = memoryview(data)[head + hlen:]
        if len(body) != sum(n for _, n in meta["sections"]) \
                or xxhash.xxh3_64_intdigest(body) != meta["xxh3"]:
            return None
        out, pos = {}, 0
        for name, n in meta["sections"]:
            out[str(name)] = body[pos:pos + n]
            pos += n
        return out
    except (ValueError, KeyError, TypeError):
        return None


def remove_image(folder: str) -> None:
    for name in (NAME, NAME + ".tmp"):
        try:
            os.unlink(os.path.join(folder, name))
        except FileNotFoundError:
            pass
