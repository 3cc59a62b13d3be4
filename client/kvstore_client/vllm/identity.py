"""The namespace an engine's offloaded chunks live in.

A vLLM primary-tier chunk is opaque bytes in vLLM's layout. Chunks are interchangeable only
between engines with the same model, cache dtype, layout, chunking and key space (keyspace.py),
and, unless vLLM's layout makes them independent of it, the same parallel topology; all of
those name the namespace.

Which chunks are independent of the parallel topology follows vLLM's own storage identity
(`vllm.v1.kv_offload.file_mapper.FileMapper`), narrowed where the bytes say otherwise:
- a replicated layout (MLA latent KV, the same on every TP rank) stores one copy per chunk:
  shared across TP sizes;
- the canonical layout with `is_parallelism_agnostic` stores topology-free canonical pages (each
  worker writes its own heads into one shared page): shared across parallel layouts;
- the direct layout is each worker's cell in rank order, every cell holding all of that
  worker's layers, so a TP=2 chunk is not the bytes of a TP=4 chunk even where vLLM calls the
  configuration parallelism-agnostic: the TP, PP, PCP and DCP sizes stay in its namespace.

Lossy codecs need to know which bytes are K and V of which head. That is declared only where it
can be checked: one worker, one block per chunk, a backend whose block interior is known, and a
KV geometry (from the model's config.json or the tier's settings) whose size is exactly the
chunk's. Anything else stays lossless, said once in the log.
"""

from __future__ import annotations

import json
import logging
import numbers
import os
from dataclasses import dataclass
from typing import Any

import blake3

from ..common.layout import DTYPE_BYTES, KVLayout

log = logging.getLogger("kvstore.vllm")

# Per-layer block interior of the attention backends whose layout is known, in the canonical
# axis letters (L layers, 2 K/V, T tokens, H heads, D head_dim). vLLM's CPU backend keeps, per
# block and head, K for T tokens then V for T tokens ([H, 2T, D]; cpu_attn.py).
BACKEND_INTERIOR = {"LBHNC": "H2TD"}
_DTYPES = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32",
           "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2", "fp8": "fp8_e4m3"}


class BadGeometry(ValueError):
    """The chunk geometry derived from vLLM's spec and primary tier cannot be right."""


@dataclass(frozen=True)
class ChunkGeometry:
    """What the tier knows of one primary-tier chunk."""

    stride: int          # bytes between chunks in the primary view (with alignment padding)
    nbytes: int          # bytes of KV in a chunk (what is stored)


def _count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise BadGeometry(f"kvstore's vLLM tier: vLLM's {name} is {value!r}, not an integer "
                          f">= {minimum}; refusing to derive a chunk size from it")
    return int(value)


def replicated(spec: Any) -> bool:
    """Whether a chunk holds one copy for every worker (vLLM's replicated layout)."""
    own = getattr(spec, "replicated_layout", None)      # what the spec laid out, where it says
    if isinstance(own, bool):
        return own
    return bool(getattr(spec.config, "replicated_layout", False))


def chunk_geometry(spec: Any, stride: int) -> ChunkGeometry:
    """The chunk's size, from vLLM's config, checked against the primary tier's row stride.

    A chunk is `worker_kv_bytes_per_block` x copies (1 when replicated, else the world size) x
    blocks per chunk, as vLLM's CPU spec sizes it; where the config does not say
    (`worker_kv_bytes_per_block` 0) it is the whole row, as vLLM's own tiers store it. A size
    that is not an integer, or a chunk larger than its row, is refused with one line.
    """
    cfg = spec.config
    stride = _count("primary tier row stride", stride, 1)
    per_block = _count("worker_kv_bytes_per_block", cfg.worker_kv_bytes_per_block, 0)
    world = _count("parallel.world_size", cfg.parallel.world_size, 1)
    bpc = _count("cache.blocks_per_chunk", cfg.cache.blocks_per_chunk, 1)
    if per_block == 0:
        return ChunkGeometry(stride, stride)
    nbytes = per_block * (1 if replicated(spec) else world) * bpc
    if nbytes > stride:
        raise BadGeometry(
            f"kvstore's vLLM tier: a chunk of {nbytes} bytes ({per_block} per worker block) "
            f"does not fit the primary tier's {stride}-byte rows; refusing to store truncated "
            "chunks")
    return ChunkGeometry(stride, nbytes)


def shares_across_parallel_layouts(spec: Any) -> bool:
    """Whether this engine's chunks are the same bytes under any parallel topology."""
    cfg = spec.config
    if replicated(spec):
        return True
    return bool(getattr(cfg, "canonical_layout", False)) \
        and bool(getattr(cfg.parallel, "is_parallelism_agnostic", False))


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
    elif getattr(cfg, "canonical_layout", False):
        why = "the canonical layout's block interior is not one kvstore declares"
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


def _canonical_format(cfg: Any) -> str:
    """vLLM's id of the canonical byte format (its version and layout family)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (
            canonical_format_id,
        )
        return canonical_format_id(str(cfg.kv_cache_layout))
    except Exception:                   # a vLLM without it, or a layout it does not name
        return f"unknown-{cfg.kv_cache_layout}"


def engine_layout(spec: Any) -> str:
    """The chunk layout's name: backend layout, chunking, groups, copies, canonical format."""
    cfg = spec.config
    groups = [[g.tokens_per_block, list(g.layer_names)] for g in cfg.groups]
    digest = blake3.blake3(json.dumps(groups, separators=(",", ":")).encode()).hexdigest()[:12]
    name = (f"vllm-offload:{cfg.kv_cache_layout or 'default'}:bpc{cfg.cache.blocks_per_chunk}"
            f":tph{cfg.cache.tokens_per_hash}:g{digest}")
    if replicated(spec):
        name += ":replicated"
    if getattr(cfg, "canonical_layout", False):
        name += f":canonical-{_canonical_format(cfg)}"
    return name


def namespace_args(spec: Any, geometry: ChunkGeometry, scheme: str, codec: str,
                   tenant_salt: str, kv_heads: int | None = None,
                   head_dim: int | None = None) -> dict[str, Any]:
    """Keyword arguments for `Client.namespace` naming this engine's chunks."""
    cfg = spec.config
    dtype = _DTYPES.get(cfg.model.dtype, "uint8")
    par = cfg.parallel
    name = engine_layout(spec)
    geo = None
    if codec != "lossless":
        geo = declared_axes(spec, geometry.nbytes, dtype, kv_heads, head_dim)
        if geo is None:
            codec = "lossless"
    if geo is None:
        layout = KVLayout(0, 0, 0, 0, dtype, engine_layout=name,
                          block_bytes_opaque=geometry.nbytes)
    else:
        axes, layers, tokens, heads, dim = geo
        layout = KVLayout(layers, heads, dim, tokens, dtype, engine_layout=name,
                          block_bytes_opaque=geometry.nbytes, kv_axes=axes)
    if shares_across_parallel_layouts(spec):
        extra = {"parallel": "any"}
    else:
        extra = {"tp": str(par.tp_size), "pp": str(par.pp_size), "pcp": str(par.pcp_size),
                 "dcp": str(par.dcp_size), "world": str(par.world_size)}
    return dict(layout=layout, model=cfg.model.name, codec=codec, hash_scheme=scheme,
                tenant_salt=tenant_salt, shard_rank=0, shard_size=1, extra=extra)
