"""kvstore SDK: talk to a kvstore daemon from an inference engine.

Why the names load on first use (PEP 562): the daemon imports small parts of this package
(its shared layer `common`, the generated stubs) before it can report SERVING, and importing
a submodule runs this file first. Eager imports here pulled numpy, grpc and every client module
into the daemon's start (about a third of it). `from kvstore_client import connect` works as
before; it just imports `kvstore_client.client` at that moment.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from .common.grpc_stack import prefer_classic_poller

prefer_classic_poller()         # before anything here creates a channel (common/grpc_stack.py)

# public name -> submodule that defines it
_WHERE = {
    "Client": "client", "connect": "client",
    "DataLoss": "common.errors", "DeadlineExceeded": "common.errors",
    "InvalidArgument": "common.errors", "KVStoreError": "common.errors",
    "LeaseExpired": "common.errors", "NotFound": "common.errors",
    "PermissionDenied": "common.errors", "ResourceExhausted": "common.errors",
    "Unauthenticated": "common.errors", "Unavailable": "common.errors",
    "Unimplemented": "common.errors",
    "block_keys": "common.hashing", "chain_key": "common.hashing",
    "CODECS": "common.layout", "KVLayout": "common.layout", "NamespaceSpec": "common.layout",
    "LookupResult": "reads", "Namespace": "namespace", "Pinned": "reads",
    "PagedKV": "paged",
}

__all__ = [
    "CODECS", "Client", "DataLoss", "DeadlineExceeded", "InvalidArgument", "KVLayout",
    "KVStoreError", "LeaseExpired", "LookupResult", "Namespace", "NamespaceSpec", "NotFound",
    "PagedKV", "PermissionDenied", "Pinned", "ResourceExhausted", "Unauthenticated",
    "Unavailable", "Unimplemented", "block_keys", "chain_key", "connect",
]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'kvstore_client' has no attribute {name!r}")
    value = getattr(import_module(f".{where}", __name__), name)
    globals()[name] = value         # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


if TYPE_CHECKING:   # for type checkers and IDEs: the same names, imported eagerly
    from .client import Client, connect
    from .common.errors import (
        DataLoss,
        DeadlineExceeded,
        InvalidArgument,
        KVStoreError,
        LeaseExpired,
        NotFound,
        PermissionDenied,
        ResourceExhausted,
        Unauthenticated,
        Unavailable,
        Unimplemented,
    )
    from .common.hashing import block_keys, chain_key
    from .common.layout import CODECS, KVLayout, NamespaceSpec
    from .namespace import Namespace
    from .paged import PagedKV
    from .reads import LookupResult, Pinned
