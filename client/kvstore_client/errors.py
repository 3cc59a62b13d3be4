"""The SDK's exceptions, at the path the docs name (`kvstore_client.errors`, docs/sdk.md).

They are defined in `kvstore_client/common/errors.py`, the layer the daemon shares with the SDK;
this module re-exports them for engines, which catch them by this name.
"""

from __future__ import annotations

from .common.errors import (
    BY_CODE,
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
    from_code,
    from_rpc_error,
)

__all__ = ["BY_CODE", "DataLoss", "DeadlineExceeded", "InvalidArgument", "KVStoreError",
           "LeaseExpired", "NotFound", "PermissionDenied", "ResourceExhausted",
           "Unauthenticated", "Unavailable", "Unimplemented", "from_code", "from_rpc_error"]
