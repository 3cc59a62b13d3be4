"""The remote tier's value: a block's frame (tiers/frame.py) sealed to its key and its commit
checksum.

Why more than the frame the SSD tier stores: Redis is shared. Any daemon of the fleet, and
anyone else who can write to it, puts values there, and a daemon reads blocks it never wrote
(another node's, or its own after a restart) with no commit checksum of its own to compare.
A frame only proves its payload was not damaged: a whole, well-framed value of block B copied
under block A's key (a script, a restore of the wrong snapshot, a bug in a tool) read as A.
The seal names the block (namespace id + key) and carries the checksum the block was
committed with, so a reader
- refuses a value under a key it was not written for, and
- knows the committed checksum of a block it learned of only from Redis, and checks the bytes
  it decodes (lossless) against it, as for a block it committed itself.

Two strengths:
- without a key (the default), the tag is an unkeyed BLAKE3 of the seal and the frame header,
  whose own checksum covers the payload: it catches misplaced and damaged values, for about a
  microsecond a value; it does not stop someone who writes to Redis on purpose, since anyone
  can compute it;
- with `remote.auth_key_file` (a secret every daemon of the fleet shares), the tag is a keyed
  BLAKE3 of the seal and the whole frame: a value written by anyone without the secret is
  refused. Hashing the payload costs about 0.12 ms per MiB on one core.

Layout, little-endian: 0 4s magic b"KVR1" | 4 u64 commit checksum (xxh3-64 of the raw block;
0: unknown) | 12 16s tag | 28 the frame.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import blake3
from kvstore_client.common.errors import DataLoss, InvalidArgument

from tiers.frame import HEADER_BYTES

MAGIC = b"KVR1"
_SEAL = struct.Struct("<4sQ16s")
SEAL_BYTES = _SEAL.size          # 28
TAG_BYTES = 16
KEY_CONTEXT = "kvstore 2026-11 remote value seal v1"


class Sealer(NamedTuple):
    """How this daemon seals and opens remote values: `key` None = unkeyed."""
    key: bytes | None

    def _tag(self, gkey: bytes, checksum: int, frame: memoryview) -> bytes:
        covered = frame if self.key is not None else frame[:HEADER_BYTES]
        h = blake3.blake3(key=self.key) if self.key is not None else blake3.blake3()
        h.update(MAGIC)
        h.update(struct.pack("<QH", checksum, len(gkey)))
        h.update(gkey)
        h.update(covered)
        return h.digest(TAG_BYTES)

    def seal(self, gkey: bytes, checksum: int, frame: bytes | memoryview) -> bytes:
        """The value to store under `gkey`: seal + frame (one copy of the frame)."""
        mv = memoryview(frame).cast("B")
        return b"".join((_SEAL.pack(MAGIC, checksum, self._tag(gkey, checksum, mv)), mv))

    def open(self, gkey: bytes, value: bytes | memoryview) -> tuple[int, memoryview]:
        """(commit checksum, frame) of a value read under `gkey`; DataLoss if it is not a
        value sealed for that key (by a daemon holding this key, where one is set). The
        frame itself is checked by tiers.frame.unframe."""
        mv = memoryview(value).cast("B")
        if len(mv) < SEAL_BYTES + HEADER_BYTES:
            raise DataLoss(f"remote value of {len(mv)} bytes is shorter than a sealed frame")
        magic, checksum, tag = _SEAL.unpack_from(mv)
        if magic != MAGIC:
            raise DataLoss("remote value is not sealed (written by another kvstore version, "
                           "or not by kvstore)")
        frame = mv[SEAL_BYTES:]
        if self._tag(gkey, checksum, frame) != tag:
            raise DataLoss("remote value's seal does not match its key (written for another "
                           "block, damaged, or sealed with another remote.auth_key_file)")
        return checksum, frame


def sealer_from_file(path: str) -> Sealer:
    """The Sealer for `remote.auth_key_file` ("" = unkeyed): the file's bytes, at least 32,
    turned into a BLAKE3 key (so any secret format works, and the key is never the raw
    secret)."""
    if not path:
        return Sealer(None)
    try:
        with open(path, "rb") as f:
            secret = f.read(1 << 16)
    except OSError as e:
        raise InvalidArgument(f"remote.auth_key_file {path!r} cannot be read: "
                              f"{e.strerror or e}") from None
    if len(secret.strip()) < 32:
        raise InvalidArgument(f"remote.auth_key_file {path!r} holds {len(secret.strip())} "
                              "bytes; it needs a secret of at least 32 (e.g. `head -c 48 "
                              "/dev/urandom | base64`), the same on every daemon that "
                              "shares the Redis")
    return Sealer(blake3.blake3(secret.strip(), derive_key_context=KEY_CONTEXT).digest())
