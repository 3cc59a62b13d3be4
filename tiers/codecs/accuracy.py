"""How far a lossy codec moves a block: element error and the error of the attention output.

For the daemon's sampled codec metrics (`measure_error`, one lossy block in 32) and for the
codec tests and benchmarks. torch is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from kvstore_client.common.layout import KVLayout

from . import reorder
from .common import check_block
from .dispatch import _quant, decode, encode

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch


def as_float32(block: np.ndarray, dtype: str) -> np.ndarray:
    """A raw block's bytes (1-D uint8) as float32 values, in numpy alone.

    The daemon samples the error of its lossy demotions on the request path; importing torch
    there (seconds on a loaded machine) for a dtype numpy lacks would stall that request.
    bfloat16 is the top half of a float32, so it widens by a shift.
    """
    raw = np.ascontiguousarray(block).reshape(-1)
    if dtype == "bfloat16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if dtype == "float16":
        return raw.view(np.float16).astype(np.float32)
    if dtype == "float32":
        return raw.view(np.float32)
    raise ValueError(f"no float view of dtype {dtype!r}")


def relative_error(x: np.ndarray | torch.Tensor, x_hat: np.ndarray | torch.Tensor) -> float:
    """‖x̂ − x‖ / ‖x‖ over all elements (0 when both are zero)."""
    if isinstance(x, np.ndarray) and isinstance(x_hat, np.ndarray):
        a = x.astype(np.float64, copy=False).reshape(-1)
        b = x_hat.astype(np.float64, copy=False).reshape(-1)
        den = float(np.linalg.norm(a))
        num = float(np.linalg.norm(b - a))
        return num / den if den > 0 else (0.0 if num == 0 else float("inf"))
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
        block, canon = reorder.to_canonical(block, layout)
        out = reorder.to_canonical(out, layout)[0]
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
