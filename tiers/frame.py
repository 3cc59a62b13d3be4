"""Framing of every value a keyed tier (ssd, remote) stores: fixed header + codec payload.

Why a frame: a value read back from disk or another machine may be truncated, bit-flipped, from
a newer format or from a different codec; the header lets the reader reject all of these as a
DATA_LOSS miss before decoding a single byte. The checksum is seeded with the header fields, so a
flipped bit in the lengths or codec id fails it too.

Header, 32 bytes, little-endian (struct "<4sBBHQQQ"):
    0   4s   magic b"KVB\\x01"
    4   u8   format version (1)
    5   u8   codec id (CODEC_IDS below)
    6   u16  flags (0; readers reject unknown bits)
    8   u64  raw length: bytes of the decoded block
    16  u64  payload length: bytes after the header
    24  u64  xxh3-64 of the payload, seed = xxh3-64 of header bytes 0..23
    32  ...  payload

Why the codec ids live here: they are part of this header, and the daemon frames and checks
values (promotion, the remote tier) without importing the codecs themselves (tiers/codecs/).
"""

from __future__ import annotations

import struct

import xxhash
from kvstore_client.common.errors import DataLoss, InvalidArgument

# Codec ids as stored in the header; never renumber.
CODEC_IDS: dict[str, int] = {"raw": 0, "lossless": 1, "fp8_e4m3": 2, "int8": 3}
CODEC_NAMES: dict[int, str] = {v: k for k, v in CODEC_IDS.items()}

MAGIC = b"KVB\x01"
VERSION = 1
HEADER = struct.Struct("<4sBBHQQQ")
HEADER_BYTES = HEADER.size  # 32
_PREFIX = struct.Struct("<4sBBHQQ")


def _checksum(prefix: bytes, payload) -> int:
    return xxhash.xxh3_64_intdigest(payload, seed=xxhash.xxh3_64_intdigest(prefix))


def header(codec: str, raw_len: int, payload) -> bytes:
    """The 32-byte header for `payload` (so a writer can send header and payload separately)."""
    cid = CODEC_IDS.get(codec)
    if cid is None:
        raise InvalidArgument(f"unknown codec {codec!r}; expected one of {list(CODEC_IDS)}")
    if not 0 <= raw_len < 2**63:
        raise InvalidArgument(f"raw length {raw_len} out of range")
    mv = memoryview(payload).cast("B")
    prefix = _PREFIX.pack(MAGIC, VERSION, cid, 0, raw_len, len(mv))
    return prefix + struct.pack("<Q", _checksum(prefix, mv))


def frame(codec: str, raw_len: int, payload) -> bytes:
    """Header + payload as one bytes object (one copy of the payload)."""
    return b"".join((header(codec, raw_len, payload), payload))


def frame_into(buf: bytearray | memoryview, codec: str, raw_len: int, payload) -> int:
    """Write header + payload into a caller-owned buffer; returns bytes written."""
    mv = memoryview(payload).cast("B")
    n = HEADER_BYTES + len(mv)
    out = memoryview(buf).cast("B")
    if len(out) < n:
        raise InvalidArgument(f"buffer of {len(out)} bytes is too small for a {n}-byte frame")
    out[:HEADER_BYTES] = header(codec, raw_len, mv)
    out[HEADER_BYTES:n] = mv
    return n


def unframe(value, checked: bool = False) -> tuple[str, int, memoryview]:
    """value -> (codec name, raw length, payload view). DataLoss on anything inconsistent.

    `checked`: the caller has just verified a checksum over the whole value, header included
    (the SSD tier's record checksum), so hashing the payload again would find nothing new;
    the header's fields are still checked.
    """
    try:
        mv = memoryview(value).cast("B")
    except TypeError:
        raise DataLoss(f"stored value of type {type(value).__name__} is not a buffer") from None
    if len(mv) < HEADER_BYTES:
        raise DataLoss(f"stored value is {len(mv)} bytes, shorter than the {HEADER_BYTES}-byte "
                       "frame header")
    magic, version, cid, flags, raw_len, plen, csum = HEADER.unpack_from(mv)
    if magic != MAGIC:
        raise DataLoss(f"stored value has bad magic {bytes(magic)!r} (expected {MAGIC!r})")
    if version != VERSION:
        raise DataLoss(f"stored value has frame version {version}; this build reads {VERSION}")
    if flags:
        raise DataLoss(f"stored value has unknown frame flags {flags:#x}")
    if plen != len(mv) - HEADER_BYTES:
        raise DataLoss(f"stored value declares a {plen}-byte payload but holds "
                       f"{len(mv) - HEADER_BYTES}")
    payload = mv[HEADER_BYTES:]
    if not checked and _checksum(bytes(mv[:_PREFIX.size]), payload) != csum:
        raise DataLoss("stored value fails its xxh3 checksum")
    codec = CODEC_NAMES.get(cid)
    if codec is None:
        raise DataLoss(f"stored value uses unknown codec id {cid}")
    return codec, raw_len, payload
