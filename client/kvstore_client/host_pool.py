"""The daemon's host pool as this process maps it, and how to tell it is still the daemon's.

Same host, a client copies blocks straight into and out of the daemon's shared-memory pool: a
named /dev/shm segment, or a tenant's own memfd passed over the handshake socket. A restarted
daemon has a new pool under the same name (or a new memfd), and a copy into the old mapping
would be lost: `current()` tells, from the segment's inode (or, for a memfd, the session's
socket identity and whether a newer session named another memfd), so the namespace can resync
before it copies. The connection (client.py) makes, follows and closes the mapping.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .common.handoff import Session


def fd_ino(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


class MappedPool:
    """The mapped host pool, with the segment identity to notice a restarted daemon."""

    def __init__(self, name: str, size: int, fd: int | None = None,
                 session: Session | None = None, auth_path: str | None = None) -> None:
        from .common import prefault, shm  # only clients that map the pool need them
        self.name, self.size = name, size
        self.fd_backed = fd is not None
        # A tenant's own pool comes as a memfd from the handshake; it has no name to stat. Its
        # identity is the memfd's inode: while this mapping holds that memfd, no later run's
        # pool can have the same one (a socket file's inode, by contrast, may be reused).
        self.ino = fd_ino(fd) if fd is not None else None
        self.slab = shm.attach_fd(fd, size) if fd is not None else shm.attach(name, size)
        if not self.fd_backed:
            self.ino = self._ino()
        # Set once a newer session or handshake named another memfd: a restarted daemon whose
        # pool this mapping is not, although nothing about the mapping itself changed.
        self.replaced = False
        self._session, self._auth_path = session, auth_path
        # Take this process's page faults on the pool now, in the background, not in the
        # engine's first copies into each slot (kvstore_client/common/prefault.py).
        self._prefaulter = prefault.start(self.slab._mmap, size) if size else None

    def _ino(self) -> tuple[int, int] | None:
        try:
            st = os.stat(os.path.join("/dev/shm", self.name))
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def current(self) -> bool:
        """False when the daemon replaced the segment (restart) or removed it."""
        if self.fd_backed:
            # The handshake socket file's identity is a cheap first sign (a token client gets
            # no other until a checksum fails); `replaced`, set by a newer session, is sure.
            return not self.replaced and (self._session is None or self._auth_path is None
                                          or self._session.current(self._auth_path))
        return not os.path.isdir("/dev/shm") or self._ino() == self.ino

    def follow(self, session: Session | None) -> bool:
        """Keep the mapping for a newer session only when its pool fd names this same memfd
        (a session renewed within one daemon run); else mark it replaced. True if kept."""
        fd = session.pool_fd if session is not None else None
        if fd is not None and fd_ino(fd) == self.ino:
            self._session = session
            return True
        self.replaced = True
        return False

    def close(self) -> None:
        if self._prefaulter is not None:
            self._prefaulter.stop()         # before the mapping goes
        self.slab.close()
