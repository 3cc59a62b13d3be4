"""Encoding a block for a lower tier and decoding it back (demotion and promotion).

Kept apart from the store so the codec fallback rule lives in one place: a lossy codec that
refuses a block (inf/NaN) stores it lossless instead, and the refusal is counted.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import xxhash
from kvstore_client.errors import DataLoss
from kvstore_client.layout import KVLayout

from tiers import codecs, frame


def encode_block(raw: np.ndarray, layout: KVLayout, codec: str, counters: Counter) -> bytes:
    """Framed value for a keyed tier (ssd, remote)."""
    try:
        payload = codecs.encode(codec, raw, layout)
    except codecs.NonFiniteBlock:
        counters["lossy_refused_nonfinite"] += 1
        codec = "lossless"
        payload = codecs.encode(codec, raw, layout)
    value = frame.frame(codec, len(raw), payload)
    counters[f"codec_in_bytes_{codec}"] += len(raw)
    counters[f"codec_out_bytes_{codec}"] += len(value)
    return value


def decode_block(value: bytes | memoryview, layout: KVLayout, out: np.ndarray,
                 checksum: int | None) -> None:
    """Decode a framed value into `out`; DataLoss when it does not decode or verify.

    A lossless block must reproduce the checksum taken when it was first stored; lossy blocks
    cannot, so the frame's own checksum (over the encoded payload) is what guards them.
    """
    codec, raw_len, payload = frame.unframe(value)
    if raw_len != len(out):
        raise DataLoss(f"stored block is {raw_len} bytes, the namespace expects {len(out)}")
    codecs.decode(codec, payload, layout, out)
    if checksum and codec in ("raw", "lossless") and xxhash.xxh3_64_intdigest(out) != checksum:
        raise DataLoss("block decoded but its checksum does not match the one stored")
