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

A value may carry a note: bytes the tier does not read, sealed with the rest (the daemon puts
the block's KV-event text there: its token ids, which a node that loads the block from Redis
needs to announce it, and which nothing else in Redis keeps). Such a value is b"KVR2" | u64
checksum | 16s tag | u32 note length | the note (at most MAX_NOTE_BYTES) | the frame, its tag
covering the note too. A value without a note is written as KVR1, as before notes existed.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import blake3
from kvstore_client.common.errors import DataLoss, InvalidArgument

from tiers.frame import HEADER_BYTES

MAGIC = b"KVR1"
MAGIC_NOTE = b"KVR2"
_SEAL = struct.Struct("<4sQ16s")
_NOTE_LEN = struct.Struct("<I")
SEAL_BYTES = _SEAL.size          # 28 (a value with a note: + 4 + the note)
TAG_BYTES = 16
MAX_NOTE_BYTES = 16 << 10        # a longer note is not written (the value goes without one)
KEY_CONTEXT = "kvstore 2026-11 remote value seal v1"


class Sealer(NamedTuple):
    """How this daemon seals and opens remote values: `key` None = unkeyed."""
    key: bytes | None

    def _tag(self, gkey: bytes, checksum: int, frame: memoryview,
             note: memoryview | bytes | None = None) -> bytes:
        covered = frame if self.key is not None else frame[:HEADER_BYTES]
        h = blake3.blake3(key=self.key) if self.key is not None else blake3.blake3()
        h.update(MAGIC if note is None else MAGIC_NOTE)
        h.update(struct.pack("<QH", checksum, len(gkey)))
        h.update(gkey)
        if note is not None:
            h.update(_NOTE_LEN.pack(len(note)))
            h.update(note)
        h.update(covered)
        return h.digest(TAG_BYTES)

    def seal(self, gkey: bytes, checksum: int, frame: bytes | memoryview,
             note: bytes = b"") -> bytes:
        """The value to store under `gkey`: seal (+ note) + frame (one copy of the frame). A
        note past MAX_NOTE_BYTES is left out."""
        mv = memoryview(frame).cast("B")
        if not note or len(note) > MAX_NOTE_BYTES:
            return b"".join((_SEAL.pack(MAGIC, checksum, self._tag(gkey, checksum, mv)), mv))
        tag = self._tag(gkey, checksum, mv, note)
        return b"".join((_SEAL.pack(MAGIC_NOTE, checksum, tag), _NOTE_LEN.pack(len(note)),
                         note, mv))

    def open(self, gkey: bytes, value: bytes | memoryview) -> tuple[int, memoryview]:
        """(commit checksum, frame) of a value read under `gkey`: open_noted without its
        note."""
        checksum, frame, _ = self.open_noted(gkey, value)
        return checksum, frame

    def open_noted(self, gkey: bytes, value: bytes | memoryview
                   ) -> tuple[int, memoryview, bytes]:
        """(commit checksum, frame, note or b"") of a value read under `gkey`; DataLoss if it
        is not a value sealed for that key (by a daemon holding this key, where one is set).
        The frame itself is checked by tiers.frame.unframe."""
        mv = memoryview(value).cast("B")
        if len(mv) < SEAL_BYTES + HEADER_BYTES:
            raise DataLoss(f"remote value of {len(mv)} bytes is shorter than a sealed frame")
        magic, checksum, tag = _SEAL.unpack_from(mv)
        note: memoryview | None = None
        start = SEAL_BYTES
        if magic == MAGIC_NOTE:
            (n,) = _NOTE_LEN.unpack_from(mv, SEAL_BYTES)
            start = SEAL_BYTES + _NOTE_LEN.size + n
            if n > MAX_NOTE_BYTES or len(mv) < start + HEADER_BYTES:
                raise DataLoss(f"remote value's note of {n} bytes does not fit the value")
            note = mv[SEAL_BYTES + _NOTE_LEN.size:start]
        elif magic != MAGIC:
            raise DataLoss("remote value is not sealed (written by another kvstore version, "
                           "or not by kvstore)")
        frame = mv[start:]
        if self._tag(gkey, checksum, frame, note) != tag:
            raise DataLoss("remote value's seal does not match its key (written for another "
                           "block, damaged, or sealed with another remote.auth_key_file)")
        return checksum, frame, b"" if note is None else bytes(note)


def sealed_bytes(frame_bytes: int, note: bytes = b"") -> int:
    """The length of the value `seal` makes of a frame of `frame_bytes` and `note`."""
    if not note or len(note) > MAX_NOTE_BYTES:
        return SEAL_BYTES + frame_bytes
    return SEAL_BYTES + _NOTE_LEN.size + len(note) + frame_bytes


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
