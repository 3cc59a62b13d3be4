"""Engine-native blocks through lossy codecs: reorder a declared block to the canonical layout.

The quantizers group scales by (layer, head) and channel, so they must know which bytes are K and
V of which head. An engine layout that declares its interior order (`kv_axes`, e.g. vLLM CPU's
"LH2TD") is reordered to [L, 2, T, H, D] before encoding and back after decoding; the reorder is
a pure permutation of elements, so a lossless round trip through it is exact.
"""

from __future__ import annotations

import numpy as np
from kvstore_client.common.layout import CANONICAL_AXES, KVLayout

_WORD = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def to_canonical(block: np.ndarray, layout: KVLayout) -> tuple[np.ndarray, KVLayout]:
    """(1-D uint8 block in canonical order, canonical layout) for a declared engine block."""
    canon = layout.canonical_layout()
    if layout.kv_axes == CANONICAL_AXES:
        return block, canon
    elems = block.view(_WORD[layout.itemsize]).reshape(layout.interior_shape)
    perm = [layout.kv_axes.index(a) for a in CANONICAL_AXES]
    out = np.ascontiguousarray(elems.transpose(perm))
    return out.reshape(-1).view(np.uint8), canon


def from_canonical(canon_block: np.ndarray, layout: KVLayout, out: np.ndarray) -> None:
    """Write a canonical-order block into `out` (1-D uint8) in the engine's declared order."""
    if layout.kv_axes == CANONICAL_AXES:
        out[:] = canon_block
        return
    word = _WORD[layout.itemsize]
    elems = canon_block.view(word).reshape(layout.canonical_layout().block_shape)
    perm = [CANONICAL_AXES.index(a) for a in layout.kv_axes]
    out.view(word).reshape(layout.interior_shape)[...] = elems.transpose(perm)
