"""Exceptions shared by the SDK and the daemon.

One exception class per gRPC status the protocol documents, so the daemon can raise a Python
exception deep in the store and the server turns it into the right status, and the SDK turns a
status back into the same exception on the client side.
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Base class; `code` is the gRPC status name the error travels as."""

    code = "INTERNAL"


class InvalidArgument(KVStoreError, ValueError):
    code = "INVALID_ARGUMENT"


class NotFound(KVStoreError, KeyError):
    code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class LeaseExpired(KVStoreError):
    code = "FAILED_PRECONDITION"


class ResourceExhausted(KVStoreError):
    code = "RESOURCE_EXHAUSTED"


class Unavailable(KVStoreError):
    code = "UNAVAILABLE"


class DataLoss(KVStoreError):
    code = "DATA_LOSS"


class DeadlineExceeded(KVStoreError, TimeoutError):
    code = "DEADLINE_EXCEEDED"


class Unimplemented(KVStoreError):
    """The daemon predates the call (the SDK then falls back to the older calls)."""

    code = "UNIMPLEMENTED"


class Unauthenticated(KVStoreError):
    """The call carried no credentials the daemon accepts (no token, an unknown token, or a
    Unix-socket peer uid no tenant claims)."""
    code = "UNAUTHENTICATED"


class PermissionDenied(KVStoreError, PermissionError):
    """The caller is known but may not do this (another tenant's namespace or lease, a model
    it is not allowed, an admin-only request)."""
    code = "PERMISSION_DENIED"


BY_CODE: dict[str, type[KVStoreError]] = {
    cls.code: cls
    for cls in (InvalidArgument, NotFound, LeaseExpired, ResourceExhausted, Unavailable, DataLoss,
                DeadlineExceeded, Unimplemented, Unauthenticated, PermissionDenied)
}


def from_code(code: str, message: str) -> KVStoreError:
    """Rebuild the exception a status code stands for (unknown codes give the base class)."""
    return BY_CODE.get(code, KVStoreError)(message)


def from_rpc_error(e: Exception, what: str, target: str) -> KVStoreError:
    """The exception a gRPC error stands for, with the daemon's own message and, for the two
    codes that mean "the daemon is not there (yet)", the address we tried."""
    code = e.code() if hasattr(e, "code") else None
    name = code.name if code is not None else "UNKNOWN"
    details = (e.details() if hasattr(e, "details") else None) or str(e)
    if name == "UNAVAILABLE":
        details = f"daemon at {target} is not reachable: {details}"
    elif name == "DEADLINE_EXCEEDED":
        details = f"{what} to {target} did not finish within its deadline: {details}"
    return from_code(name, f"{what}: {details}")
