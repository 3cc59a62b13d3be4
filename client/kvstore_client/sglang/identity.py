"""Whose pages these are: daemon keys for SGLang's page hashes, and the namespace they live in.

SGLang names a page by a sha256 hex string chained over the previous page's hash and the
page's tokens (`get_hash_str`). The hash is only meaningful between engines that chain and
serialize tokens the same way, so the namespace's hash scheme carries a fingerprint of SGLang's
hash of a fixed probe page: engines whose hashing differs land in different namespaces and
never see each other's pages.

The namespace also folds in the model, the page geometry (pages.py) and the parallel shard:
each TP rank holds its own heads, each PP stage its own layers, so those are separate
namespaces — except for MLA models, whose latent KV is the same on every TP rank: one copy
serves them all.
"""

from __future__ import annotations

import logging
from typing import Any

import blake3

from ..common.layout import KVLayout
from .pages import PageGeometry

log = logging.getLogger("kvstore.sglang")

_PROBE_TOKENS = list(range(1, 17))


def fold_key(key: str) -> bytes:
    """A 32-byte daemon key for one SGLang page key.

    SGLang's keys are 64 hex digits (sha256): their bytes are the key. Any other string (a
    suffixed sidecar key, another hash) is folded with blake3, which cannot collide with a
    sha256 digest in practice.
    """
    if len(key) == 64:
        try:
            return bytes.fromhex(key)
        except ValueError:
            pass
    return blake3.blake3(b"kvstore-sglang-key\0" + key.encode()).digest(32)


def key_scheme() -> str:
    """The namespace hash scheme: "external:sglang-<fingerprint of SGLang's page hash>"."""
    try:
        from sglang.srt.mem_cache.utils import get_hash_str
        probe = str(get_hash_str(_PROBE_TOKENS, None))
    except Exception as e:          # an SGLang without the helper: hash scheme unknown
        log.warning("kvstore: cannot fingerprint SGLang's page hash (%s)", e)
        return "external:sglang-unknown"
    fp = blake3.blake3(b"kvstore-sglang-keyspace\0" + probe.encode()).hexdigest()[:16]
    return f"external:sglang-{fp}"


def namespace_args(config: Any, geo: PageGeometry, *, codec: str, tenant_salt: str,
                   scheme: str | None = None) -> dict[str, Any]:
    """Keyword arguments for `Client.namespace` naming this rank's pages.

    config: SGLang's HiCacheStorageConfig.
    """
    mla = bool(getattr(config, "is_mla_model", False))
    declared = geo.declared_axes() if codec != "lossless" and not mla else None
    if codec != "lossless" and declared is None:
        log.warning("kvstore: SGLang's %s %s page layout is not one kvstore can declare; "
                    "storing lossless", geo.pool, geo.layout)
        codec = "lossless"
    if declared is None:
        layout = KVLayout(0, 0, 0, 0, geo.dtype, engine_layout=geo.engine_layout,
                          block_bytes_opaque=geo.nbytes)
    else:
        axes, s = declared
        layout = KVLayout(s["L"], s["H"], s["D"], s["T"], geo.dtype,
                          engine_layout=geo.engine_layout, block_bytes_opaque=geo.nbytes,
                          kv_axes=axes)
    pp_size = int(getattr(config, "pp_size", 1) or 1)
    extra = {"pp": f"{int(getattr(config, 'pp_rank', 0) or 0)}/{pp_size}"}
    for name in ("attn_cp", "dcp"):
        size = int(getattr(config, f"{name}_size", 1) or 1)
        if size > 1:
            extra[name] = f"{int(getattr(config, f'{name}_rank', 0) or 0)}/{size}"
    if getattr(config, "should_split_heads", False):
        extra["split_heads"] = str(getattr(config, "tp_lcm_size", "") or "")
    if mla:
        rank, size = 0, 1              # the latent KV is the same on every TP rank
        extra["mla"] = "1"
    else:
        rank, size = int(config.tp_rank), int(config.tp_size)
    model = str(getattr(config, "model_name", "") or "")
    if not model:
        log.warning("kvstore: SGLang passed no model name; pages go to the namespace of "
                    "model 'unnamed' (set model_name in the extra config to keep models apart)")
        model = "unnamed"
    return dict(layout=layout, model=model, codec=codec, hash_scheme=scheme or key_scheme(),
                tenant_salt=tenant_salt, shard_rank=rank, shard_size=size, extra=extra)
