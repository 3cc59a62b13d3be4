"""kvstore SDK: talk to a kvstore daemon from an inference engine."""

from .client import Client, connect
from .errors import (
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
from .hashing import block_keys, chain_key
from .layout import CODECS, KVLayout, NamespaceSpec
from .namespace import LookupResult, Namespace, Pinned
from .paged import PagedKV

__all__ = [
    "CODECS", "Client", "DataLoss", "DeadlineExceeded", "InvalidArgument", "KVLayout",
    "KVStoreError", "LeaseExpired", "LookupResult", "Namespace", "NamespaceSpec", "NotFound",
    "PagedKV", "PermissionDenied", "Pinned", "ResourceExhausted", "Unauthenticated",
    "Unavailable", "Unimplemented", "block_keys", "chain_key", "connect",
]
