"""The small bf16 layout and the deterministic prompts and KV that the SDK-level daemon tests
store and load: 2 layers, 2 KV heads of 64, 16-token blocks (16 KiB a block)."""

from __future__ import annotations

import numpy as np
import torch
from kvstore_client import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=16, dtype="bfloat16")
T = LAYOUT.block_tokens


def make_kv(seed: int, blocks: int) -> torch.Tensor:
    """[layers, 2, blocks * T, heads, dim] of LAYOUT, the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    L, _, _, H, D = LAYOUT.block_shape
    return torch.randn((L, 2, blocks * T, H, D), generator=g).to(torch.bfloat16)


def prompt(seed: int, blocks: int) -> np.ndarray:
    """Token ids of `blocks` full blocks, the same for the same seed."""
    return np.random.default_rng(seed).integers(0, 50_000, size=blocks * T, dtype=np.int64)
