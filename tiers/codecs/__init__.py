"""Demotion codecs: how a block is encoded when it moves to a keyed tier (ssd, remote).

`raw` stores the block as is; `lossless` codes each element's top byte in 4 bits (bit-exact,
keeps inf/NaN); `fp8_e4m3` and `int8` quantize a Hadamard-rotated block with per-channel key and
per-token value scales, keeping a few attention-critical tokens exact (payload v4, compiled;
opt-in per namespace, ~0.54x bf16 bytes). Each payload starts with its own small version
header; tiers/frame.py wraps it with the codec id, lengths and a checksum. Formats and measured
figures: docs/codecs.md.

Error policy: a caller passing a wrong-sized block or an unknown codec to `encode` gets
InvalidArgument (a bug); a stored payload that does not decode gets DataLoss (a miss), never a
crash. Lossy codecs raise NonFiniteBlock on inf/NaN so the store can fall back to `lossless`.

Why torch loads lazily: importing it costs seconds to tens of seconds on a busy machine, and
only lossy payloads written before v3 (v1/v2), quantizing on an accelerator and the error
metrics need it; the compiled codecs (numba, itself imported on first use) do not. A daemon
never imports either at start (start and warm restart stay at gRPC-server speed).

| module | job |
| --- | --- |
| `dispatch` | `encode` / `decode` / `encode_tensor` by codec name and payload version; `warm_up` |
| `lossless`, `lossless_kernels` | `lossless` payload v2 (and v1 decode): 4-bit top-byte code |
| `lossy`, `lossy_kernels` | `int8` / `fp8_e4m3` payload v4, compiled: how host blocks are written |
| `lossy_torch` | payloads v1/v2 in torch: decodes them, and still writes v2 where a block is |
| | quantized on an accelerator (`encode_tensor`) or with an explicit scheme (benchmarks) |
| `legacy/` | payload versions no longer written (lossy v3): decode only |
| `reorder` | engine-native blocks to the canonical layout and back, for the lossy codecs |
| `accuracy` | element and attention-output error of a codec on a block |
| `common` | per-thread zstd contexts and scratch buffers, the block check, kernel loaders |

The frame around every stored payload, with the codec ids, is tiers/frame.py.
"""

from __future__ import annotations

from typing import Any

from ..frame import CODEC_IDS, CODEC_NAMES
from .accuracy import as_float32, attention_error, measure_error, relative_error
from .common import NonFiniteBlock
from .dispatch import LOSSY, _quant, decode, encode, encode_tensor, warm_up

_QUANT_NAMES = ("QuantScheme", "SCHEMES", "TORCH_DTYPES")


def __getattr__(name: str) -> Any:
    """QuantScheme, SCHEMES and TORCH_DTYPES, loaded with torch only when someone asks."""
    if name in _QUANT_NAMES:
        return getattr(_quant(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CODEC_IDS", "CODEC_NAMES", "LOSSY", "NonFiniteBlock", "QuantScheme", "SCHEMES",
           "TORCH_DTYPES", "attention_error", "decode", "encode", "encode_tensor",
           "measure_error", "relative_error", "warm_up", "as_float32"]
