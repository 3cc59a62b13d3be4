"""Which codec encodes a block and which decodes a payload: dispatch by codec name and payload
version.

Writers: `raw` as is; `lossless` payload v2 (lossless.py); `fp8_e4m3` / `int8` payload v4
(lossy.py, compiled) for a block on the host. `encode_tensor` on an accelerator quantizes on the
device in torch (lossy_torch.py, payload v2), so only the codes cross to the host; so does
`encode` with an explicit `scheme` (benchmarks). Readers: every version ever written (v4, v3 in
legacy/, v1/v2 in lossy_torch.py; lossless v2 and v1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from kvstore_client.common.errors import DataLoss, InvalidArgument
from kvstore_client.common.layout import KVLayout

from ..frame import CODEC_IDS
from . import lossless, lossy, reorder
from .common import check_block
from .legacy import lossy_v3

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

    from .lossy_torch import QuantScheme

LOSSY: tuple[str, ...] = ("fp8_e4m3", "int8")


def _quant() -> Any:
    """lossy_torch.py, imported (with torch) on first use."""
    from . import lossy_torch

    return lossy_torch


def encode(codec: str, block: np.ndarray, layout: KVLayout,
           scheme: QuantScheme | None = None) -> bytes | memoryview:
    """Encode one raw block (1-D uint8, canonical layout) -> payload.

    `scheme` overrides a lossy codec's scaling (benchmarks only; the decoder reads it from the
    payload header, so any scheme decodes).
    """
    if codec == "raw":
        return memoryview(check_block(block, layout))
    if codec == "lossless":
        return lossless.encode(block, layout)
    if codec in LOSSY:
        if layout.engine_native:
            block, layout = reorder.to_canonical(check_block(block, layout), layout)
        if scheme is None:
            return lossy.encode(block, layout, codec)
        return _quant().encode(block, layout, scheme)     # v1/v2 (benchmarks, old readers)
    raise InvalidArgument(f"unknown codec {codec!r}; expected one of {list(CODEC_IDS)}")


def encode_tensor(codec: str, t: torch.Tensor, layout: KVLayout,
                  scheme: QuantScheme | None = None) -> bytes | memoryview:
    """Encode a block held in a torch tensor on any device (e.g. a GPU pool slot).

    On an accelerator, lossy codecs quantize on the tensor's device (v2 payload, torch), so only
    the ~half-size codes and scales cross to the host; on the CPU, and for raw and lossless,
    the block is encoded on the host by the compiled codecs (v4 / lossless v2).
    """
    q = _quant()
    if codec in LOSSY and not layout.engine_native and (
            scheme is not None or t.device.type != "cpu"):
        return q.encode_tensor(t, layout, scheme or q.SCHEMES[codec])
    if codec not in CODEC_IDS:
        raise InvalidArgument(f"unknown codec {codec!r}; expected one of {list(CODEC_IDS)}")
    if t.numel() != layout.block_elements or t.dtype != q.TORCH_DTYPES[layout.dtype]:
        raise InvalidArgument(f"tensor must hold {layout.block_elements} {layout.dtype} values")
    import torch

    host = t.detach().reshape(-1).cpu().contiguous().view(torch.uint8).numpy()
    out = encode(codec, host, layout)
    return bytes(out) if codec == "raw" else out


def decode(codec: str, payload, layout: KVLayout, out: np.ndarray) -> None:
    """Decode a payload into `out` (1-D uint8, layout.block_bytes); DataLoss if it cannot."""
    try:
        mv = memoryview(payload)
    except TypeError:
        raise DataLoss(f"payload of type {type(payload).__name__} is not a buffer") from None
    if codec == "raw":
        check_block(out, layout, "out")
        mv = mv.cast("B")
        if len(mv) != out.nbytes:
            raise DataLoss(f"raw payload is {len(mv)} bytes; the layout needs {out.nbytes}")
        out[:] = np.frombuffer(mv, np.uint8)
        return
    if codec == "lossless":
        lossless.decode(mv, layout, out)
        return
    if codec in LOSSY:
        if layout.engine_native:
            check_block(out, layout, "out")
            canon = np.empty(layout.block_bytes, np.uint8)
            _decode_lossy(mv, codec, layout.canonical_layout(), canon)
            reorder.from_canonical(canon, layout, out)
            return
        _decode_lossy(mv, codec, layout, out)
        return
    raise DataLoss(f"payload uses unknown codec {codec!r}")


def _decode_lossy(mv: memoryview, codec: str, layout: KVLayout, out: np.ndarray) -> None:
    """v4 and v3 payloads decode in the compiled codecs; v1/v2 (written before them) through
    torch."""
    mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    if len(mv) and mv[0] == lossy.VERSION:
        lossy.decode(mv, codec, layout, out)
    elif len(mv) and mv[0] == lossy_v3.VERSION:
        lossy_v3.decode(mv, codec, layout, out)
    else:
        _quant().decode(mv, codec, layout, out)


def warm_up(names: tuple[str, ...] = ("lossless", "int8")) -> None:
    """Compile (or load from numba's on-disk cache) the kernels of the compiled codecs.

    Why: the first use in a fresh checkout compiles them: ~1 s for lossless, ~12 s for int8 on
    this 2-core machine under load. A daemon that calls this on a background thread at start
    moves that off its first demotion. Runs every dtype path and both payload kinds (bytes
    and writable buffers are distinct compiled variants)."""
    for dtype in ("bfloat16", "float32"):
        layout = KVLayout(1, 1, 8, 2, dtype)
        block = np.zeros(layout.block_bytes, np.uint8)
        out = np.empty_like(block)
        for name in names:
            payload = bytes(encode(name, block, layout))
            decode(name, payload, layout, out)
            decode(name, bytearray(payload), layout, out)
