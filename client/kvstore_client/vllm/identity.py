"""The namespace an engine's offloaded chunks live in.

A vLLM primary-tier chunk is opaque bytes in vLLM's layout: every worker's pages for the chunk's
blocks, worker after worker. Chunks are interchangeable only between engines with the same
model, cache dtype, layout, chunking and parallel topology, and the same key space
(keyspace.py), so all of those name the namespace.

Lossy codecs need to know which bytes are K and V of which head. That is declared only where it
can be checked: one worker, one block per chunk, a backend whose block interior is known, and a
KV geometry (from the model's config.json or the tier's settings) whose size is exactly the
chunk's. Anything else stays lossless, said once in the log.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from ..common.layout import DTYPE_BYTES, KVLayout

log = logging.getLogger("kvstore.vllm")

# Per-layer block interior of the attention backends whose layout is known, in the canonical
# axis letters (L layers, 2 K/V, T tokens, H heads, D head_dim). vLLM's CPU backend keeps, per
# block and head, K for T tokens then V for T tokens ([H, 2T, D]; cpu_attn.py).
BACKEND_INTERIOR = {"LBHNC": "H2TD"}
_DTYPES = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32",
           "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2", "fp8": "fp8_e4m3"}


@dataclass(frozen=True)
class ChunkGeometry:
    """What the tier knows of one primary-tier chunk."""

    stride: int          # bytes between chunks in the primary view (with alignment padding)
    nbytes: int          # bytes of KV in a chunk (what is stored)


def chunk_geometry(spec: Any, stride: int) -> ChunkGeometry:
    cfg = spec.config
    copies = 1 if getattr(spec, "replicated_layout", False) else cfg.parallel.world_size
    page = int(getattr(spec, "cpu_page_size_per_worker", 0) or 0)
    nbytes = page * copies if page else stride
    if not 0 < nbytes <= stride:
        nbytes = stride
    return ChunkGeometry(stride, nbytes)


def _model_kv(model: str) -> tuple[int, int] | None:
    """(kv heads, head_dim) from a local model folder's config.json; None when not local."""
    path = os.path.join(model, "config.json")
    try:
        with open(path) as f:
            c = json.load(f)
    except (OSError, ValueError):
        return None
    c = c.get("text_config", c)
    heads = c.get("num_attention_heads")
    kv = c.get("num_key_value_heads") or heads
    hd = c.get("head_dim") or (c.get("hidden_size", 0) // heads if heads else 0)
    return (int(kv), int(hd)) if kv and hd else None


def declared_axes(spec: Any, nbytes: int, dtype: str, kv_heads: int | None,
                  head_dim: int | None) -> tuple[str, int, int, int, int] | None:
    """(kv_axes, layers, tokens, heads, head_dim) when the chunk's KV layout is certain."""
    cfg = spec.config
    interior = BACKEND_INTERIOR.get(str(cfg.kv_cache_layout or ""))
    why = None
    if interior is None:
        why = f"the backend layout {cfg.kv_cache_layout!r} is not one kvstore knows"
    elif cfg.parallel.world_size != 1 or cfg.cache.blocks_per_chunk != 1:
        why = "chunks span several workers or blocks"
    elif dtype not in DTYPE_BYTES:
        why = f"the cache dtype {dtype!r} is not a float type kvstore quantizes"
    if why is None:
        geo = (kv_heads, head_dim) if kv_heads and head_dim else _model_kv(cfg.model.name)
        layers = sum(len(g.layer_names) for g in cfg.groups)
        tokens = cfg.cache.tokens_per_hash * cfg.cache.blocks_per_chunk
        if geo is None:
            why = "the KV heads and head_dim are unknown (set kv_heads and head_dim)"
        elif layers * 2 * tokens * geo[0] * geo[1] * DTYPE_BYTES[dtype] != nbytes:
            why = (f"{layers} layers x {tokens} tokens x {geo[0]} heads x {geo[1]} dims do not "
                   f"make the {nbytes}-byte chunk")
        else:
            return "L" + interior, layers, tokens, geo[0], geo[1]
    log.warning("kvstore: cannot declare vLLM's chunk layout (%s); storing lossless", why)
    return None


def namespace_args(spec: Any, geometry: ChunkGeometry, scheme: str, codec: str,
                   tenant_salt: str, kv_heads: int | None = None,
                   head_dim: int | None = None) -> dict[str, Any]:
    """Keyword arguments for `Client.namespace` naming this engine's chunks."""
    cfg = spec.config
    dtype = _DTYPES.get(cfg.model.dtype, "uint8")
    par = cfg.parallel
    flags = "".join(f":{name}" for name, on in (
        ("replicated", getattr(spec, "replicated_layout", False)),
        ("canonical", getattr(cfg, "canonical_layout", False))) if on)
    engine_layout = (f"vllm-offload:{cfg.kv_cache_layout or 'default'}"
                     f":bpc{cfg.cache.blocks_per_chunk}:tph{cfg.cache.tokens_per_hash}"
                     f":ws{par.world_size}{flags}")
    geo = None
    if codec != "lossless":
        geo = declared_axes(spec, geometry.nbytes, dtype, kv_heads, head_dim)
        if geo is None:
            codec = "lossless"
    if geo is None:
        layout = KVLayout(0, 0, 0, 0, dtype, engine_layout=engine_layout,
                          block_bytes_opaque=geometry.nbytes)
    else:
        axes, layers, tokens, heads, dim = geo
        layout = KVLayout(layers, heads, dim, tokens, dtype, engine_layout=engine_layout,
                          block_bytes_opaque=geometry.nbytes, kv_axes=axes)
    extra = {"tp": str(par.tp_size), "pp": str(par.pp_size), "pcp": str(par.pcp_size),
             "dcp": str(par.dcp_size), "world": str(par.world_size)}
    return dict(layout=layout, model=cfg.model.name, codec=codec, hash_scheme=scheme,
                tenant_salt=tenant_salt, shard_rank=0, shard_size=1, extra=extra)
