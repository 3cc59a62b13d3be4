"""kvstore SDK: talk to a kvstore daemon from an inference engine."""

from .errors import (DataLoss, DeadlineExceeded, InvalidArgument, KVStoreError, LeaseExpired,
                     NotFound, ResourceExhausted, Unavailable)
from .hashing import block_keys, chain_key
from .layout import CODECS, KVLayout, NamespaceSpec

__all__ = [
    "CODECS", "DataLoss", "DeadlineExceeded", "InvalidArgument", "KVLayout", "KVStoreError",
    "LeaseExpired", "NamespaceSpec", "NotFound", "ResourceExhausted", "Unavailable",
    "block_keys", "chain_key",
]
