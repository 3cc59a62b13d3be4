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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from kvstore_client.errors import DataLoss, InvalidArgument
from kvstore_client.layout import KVLayout

from . import codec_engine, codec_lossless, codec_q3, codec_q4
from .codec_common import CODEC_IDS, CODEC_NAMES, NonFiniteBlock, check_block

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

    from .codec_quant import QuantScheme

LOSSY: tuple[str, ...] = ("fp8_e4m3", "int8")
_QUANT_NAMES = ("QuantScheme", "SCHEMES", "TORCH_DTYPES")


def _quant() -> Any:
    """tiers.codec_quant, imported (with torch) on first use."""
    from . import codec_quant

    return codec_quant


def __getattr__(name: str) -> Any:
    """QuantScheme, SCHEMES and TORCH_DTYPES, loaded with torch only when someone asks."""
    if name in _QUANT_NAMES:
        return getattr(_quant(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["CODEC_IDS", "CODEC_NAMES", "LOSSY", "NonFiniteBlock", "QuantScheme", "encode",
           "decode", "encode_tensor", "attention_error", "measure_error", "relative_error"]


def encode(codec: str, block: np.ndarray, layout: KVLayout,
           scheme: QuantScheme | None = None) -> bytes | memoryview:
    """Encode one raw block (1-D uint8, canonical layout) -> payload.

    `scheme` overrides a lossy codec's scaling (benchmarks only; the decoder reads it from the
    payload header, so any scheme decodes).
    """
    if codec == "raw":
        return memoryview(check_block(block, layout))
    if codec == "lossless":
        return codec_lossless.encode(block, layout)
    if codec in LOSSY:
        if layout.engine_native:
            block, layout = codec_engine.to_canonical(check_block(block, layout), layout)
        if scheme is None:
            return codec_q4.encode(block, layout, codec)
        if scheme is None:
            scheme = _quant().SCHEMES[codec]
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
        codec_lossless.decode(mv, layout, out)
        return
    if codec in LOSSY:
        if layout.engine_native:
            check_block(out, layout, "out")
            canon = np.empty(layout.block_bytes, np.uint8)
            _decode_lossy(mv, codec, layout.canonical_layout(), canon)
            codec_engine.from_canonical(canon, layout, out)
            return
        _decode_lossy(mv, codec, layout, out)
        return
    raise DataLoss(f"payload uses unknown codec {codec!r}")


def _decode_lossy(mv: memoryview, codec: str, layout: KVLayout, out: np.ndarray) -> None:
    """v4 and v3 payloads decode in the compiled codecs; v1/v2 (written before them) through
    torch."""
    mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    if len(mv) and mv[0] == codec_q4.VERSION:
        codec_q4.decode(mv, codec, layout, out)
    elif len(mv) and mv[0] == codec_q3.VERSION:
        codec_q3.decode(mv, codec, layout, out)
    else:
        _quant().decode(mv, codec, layout, out)


# ------------------------------------------------------------------ error metrics


def relative_error(x: np.ndarray | torch.Tensor, x_hat: np.ndarray | torch.Tensor) -> float:
    """‖x̂ − x‖ / ‖x‖ over all elements (0 when both are zero)."""
    import torch

    x = torch.as_tensor(x, dtype=torch.float32)
    x_hat = torch.as_tensor(x_hat, dtype=torch.float32)
    den = float(torch.linalg.vector_norm(x))
    num = float(torch.linalg.vector_norm(x_hat - x))
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


def attention_error(q, k, v, k_hat, v_hat) -> torch.Tensor:
    """Per-head relative error of the attention output when K,V are replaced by K̂,V̂.

    q: [..., Nq, D]; k, v, k_hat, v_hat: [..., N, D] (leading dims are batch/layer/head). Returns
    ‖A(q,K,V) − A(q,K̂,V̂)‖ / ‖A(q,K,V)‖ per leading index, with A = softmax(qKᵀ/√D)·V and the
    norm over all queries and channels. Aggregate with .mean() / .max().
    """
    import torch

    q, k, v, k_hat, v_hat = (torch.as_tensor(a, dtype=torch.float32)
                             for a in (q, k, v, k_hat, v_hat))
    scale = q.shape[-1] ** -0.5

    def attn(kk, vv):
        return torch.softmax(q @ kk.transpose(-1, -2) * scale, dim=-1) @ vv

    a, a_hat = attn(k, v), attn(k_hat, v_hat)
    num = torch.linalg.vector_norm(a_hat - a, dim=(-2, -1))
    den = torch.linalg.vector_norm(a, dim=(-2, -1)).clamp_min(1e-30)
    return num / den


def _block_f32(block: np.ndarray, layout: KVLayout) -> torch.Tensor:
    import torch

    t = torch.from_numpy(np.ascontiguousarray(block)).view(_quant().TORCH_DTYPES[layout.dtype])
    return t.float().reshape(layout.block_shape)


def measure_error(codec: str, block: np.ndarray, layout: KVLayout) -> dict[str, float]:
    """Sampled quantization error of one block, for the daemon's metrics.

    Returns {"element": ‖x̂−x‖/‖x‖, "attention_mean": ..., "attention_max": ...}; the attention
    error uses the block's own keys, centred per channel, as queries (the store has no real
    queries), per (layer, head). NonFiniteBlock propagates for lossy codecs.
    """
    check_block(block, layout)
    out = np.empty_like(block)
    decode(codec, encode(codec, block, layout), layout, out)
    if layout.engine_native:   # measure in canonical order, where heads and K/V are known
        block, canon = codec_engine.to_canonical(block, layout)
        out = codec_engine.to_canonical(out, layout)[0]
        layout = canon
    x, x_hat = _block_f32(block, layout), _block_f32(out, layout)
    import torch

    finite = bool(torch.isfinite(x).all())
    if not finite:   # only lossless/raw get here; they are exact
        same = bool(np.array_equal(block, out))
        return {"element": 0.0 if same else float("inf"), "attention_mean": 0.0,
                "attention_max": 0.0}
    # [L, 2, T, H, D] -> [L, H, T, D]
    k, v = x[:, 0].transpose(1, 2), x[:, 1].transpose(1, 2)
    kh, vh = x_hat[:, 0].transpose(1, 2), x_hat[:, 1].transpose(1, 2)
    # Proxy queries: the block's own keys, centred per channel, so that a large constant key
    # offset (common in real KV) does not turn every query into an argmax over one key.
    q = k - k.mean(dim=-2, keepdim=True)
    err = attention_error(q, k, v, kh, vh)
    return {"element": relative_error(x, x_hat), "attention_mean": float(err.mean()),
            "attention_max": float(err.max())}


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


def check_codec_name(codec: str) -> str:
    """InvalidArgument unless `codec` is a known codec (for config/namespace validation)."""
    if codec not in CODEC_IDS:
        raise InvalidArgument(f"unknown codec {codec!r}; expected one of {list(CODEC_IDS)}")
    return codec
