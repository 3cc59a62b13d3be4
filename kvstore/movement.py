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

LOSSY = ("fp8_e4m3", "int8")
ERROR_SAMPLE_EVERY = 32     # one lossy block in this many is decoded again to measure its error


def encode_block(raw: np.ndarray, layout: KVLayout, codec: str, counters: Counter,
                 sample_error: bool = False) -> bytes:
    """Framed value for a keyed tier (ssd, remote); with `sample_error`, a lossy codec's error on
    this block is measured into the counters (callers sample one block in ERROR_SAMPLE_EVERY)."""
    try:
        payload = codecs.encode(codec, raw, layout)
    except codecs.NonFiniteBlock:
        counters["lossy_refused_nonfinite"] += 1
        codec = "lossless"
        payload = codecs.encode(codec, raw, layout)
    value = frame.frame(codec, len(raw), payload)
    counters[f"codec_in_bytes_{codec}"] += len(raw)
    counters[f"codec_out_bytes_{codec}"] += len(value)
    if codec in LOSSY and sample_error:
        _sample_error(raw, payload, layout, codec, counters)
    counters[f"codec_blocks_{codec}"] += 1
    return value


def _as_float(block: np.ndarray, layout: KVLayout):
    import torch  # numpy has no bfloat16

    dt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    return torch.from_numpy(np.ascontiguousarray(block)).view(dt[layout.dtype]).float()


def _sample_error(raw: np.ndarray, payload, layout: KVLayout, codec: str,
                  counters: Counter) -> None:
    """Element-wise relative error ‖x̂−x‖/‖x‖ of one block, summed for the metrics' mean."""
    out = np.empty_like(raw)
    codecs.decode(codec, payload, layout, out)
    err = codecs.relative_error(_as_float(raw, layout), _as_float(out, layout))
    counters[f"codec_error_sum_{codec}"] += err
    counters[f"codec_error_samples_{codec}"] += 1


def decode_block(value: bytes | memoryview | tuple, layout: KVLayout, out: np.ndarray,
                 checksum: int | None) -> str:
    """Decode a framed value into `out` and return the codec it was stored with; DataLoss when
    it does not decode or verify.

    A lossless block must reproduce the checksum taken when it was first stored; lossy blocks
    cannot, so the frame's own checksum (over the encoded payload) is what guards them.
    """
    # A keyed tier may hand over an already verified (codec, raw_len, payload) triple.
    codec, raw_len, payload = value if isinstance(value, tuple) else frame.unframe(value)
    if raw_len != len(out):
        raise DataLoss(f"stored block is {raw_len} bytes, the namespace expects {len(out)}")
    codecs.decode(codec, payload, layout, out)
    if checksum and codec not in LOSSY and xxhash.xxh3_64_intdigest(out) != checksum:
        raise DataLoss("block decoded but its checksum does not match the one stored")
    return codec
