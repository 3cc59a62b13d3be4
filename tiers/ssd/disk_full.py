"""A full filesystem under the SSD tier, told apart from the store's own byte cap; and the
payload file at that cap with no free extent that fits (`CapacityFull`).

Why its own module: both halves of the tier meet it (the payload file when it grows or a
pwrite fails, LMDB when a commit cannot extend its map file), and each must turn the errno it
sees into the same error. Why its own error type: the store treats it differently from its
own cap (it keeps host working by dropping eviction victims instead of demoting them), and the
message names the path and the free space, which is what an operator needs to act.
"""

from __future__ import annotations

import errno
import os

from kvstore_client.common.errors import ResourceExhausted

DISK_FULL_BYTES = 64 << 20         # an EIO with less than this free is the disk filling up
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class DiskFull(ResourceExhausted):
    """A write to the SSD tier did not land: the filesystem under it is full."""

    def __init__(self, path: str, free: int, exc: BaseException | str) -> None:
        super().__init__(f"SSD tier write did not land: the filesystem under {path} is full "
                         f"({free} bytes free; {exc}); free space there or lower ssd.capacity")
        self.path, self.free = path, free


class CapacityFull(DiskFull):
    """A write to the SSD tier did not land: no free extent fits within `ssd.capacity` (the
    payload file is at the cap and the room left in it is in smaller pieces, or still held by
    reads in progress, tiers/ssd/payload.py).

    Why a DiskFull: the cap is what the operator set to fit the disk, so this is the event a
    full filesystem was when the file could grow past the cap, and the same answer fits: host
    keeps serving by dropping eviction victims instead of failing every call that needs host
    room. Only the message differs: the filesystem may have room to spare."""

    def __init__(self, path: str, why: str) -> None:
        ResourceExhausted.__init__(
            self, f"SSD tier write did not land under {path}: {why}; the payload file stays "
                  "within ssd.capacity (raise it if this repeats)")
        self.path, self.free = path, free_bytes(path)


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer can still use on the filesystem holding `path`."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def is_enospc(exc: BaseException) -> bool:
    """An LMDB error that is the filesystem refusing more bytes (LMDB's own text, or errno)."""
    return (getattr(exc, "errno", None) in FULL_ERRNOS
            or "No space" in str(exc) or "quota" in str(exc).lower())


def is_eio(exc: BaseException) -> bool:
    """LMDB reports a short write (the disk filled mid-commit) as EIO."""
    return getattr(exc, "errno", None) == errno.EIO or "Input/output error" in str(exc)
