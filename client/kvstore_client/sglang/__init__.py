"""kvstore for SGLang: a HiCache storage backend ("L3") over the daemon's shared-memory pool.

Enabled by configuration alone (docs/sglang.md):

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
        "module_path": "kvstore_client.sglang", "class_name": "KVStoreHiCache",
        "interface_v1": 1, "address": "/run/kvstore/kvstore.sock"}'

One module per concern: `pages` (where a page lies in SGLang's host pool and how it is copied),
`identity` (keys and the namespace a pool's pages live in), `backend` (the HiCacheStorage
subclass). Nothing here imports SGLang until SGLang's storage factory loads the backend.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVStoreHiCache"]


def __getattr__(name: str) -> Any:
    # SGLang's factory does getattr(import_module("kvstore_client.sglang"), "KVStoreHiCache"):
    # the backend (and SGLang with it) is imported only then.
    if name == "KVStoreHiCache":
        from .backend import KVStoreHiCache
        return KVStoreHiCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
