"""The daemon's hold on its data folder, and the one-line error any start step ends with.

Why a lock file: two daemons on one data folder would share one LMDB environment and one
shared-memory slab name and silently corrupt each other's index. `fcntl.flock` is released by
the kernel when the holder dies (even on SIGKILL), so a crashed daemon never leaves a stale lock
behind, and the file carries the holder's pid for the error message.

Why owner-only modes: LMDB's index holds model and tenant names, block keys and, with KV
events on, prompts' token ids; the data folder is made 0700 (0711 where other users' engines
must reach a tenants' socket inside it) and what the daemon keeps in it 0600/0700, including
in a folder an older daemon left readable (`tighten_modes`).

Why StartupError lives here: a start fails on the data folder more often than anywhere else
(in use, full, read-only), and each step after it (kvstore/binding.py, kvstore/daemon.py) ends
the same way: one line naming the cause and the fix, and an exit code for the CLI.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
from pathlib import Path

log = logging.getLogger("kvstore.daemon")

LOCK_NAME = "LOCK"
# What the daemon keeps in its data folder (besides its sockets, whose modes are deliberate).
OWNED_ENTRIES = (LOCK_NAME, "ssd", "events")


class StartupError(Exception):
    """The daemon cannot start; the message says why in one line. `exit_code` for the CLI."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class DataDirLock:
    """An exclusive flock on <data_dir>/LOCK holding the owner's pid."""

    def __init__(self, data_dir: str | os.PathLike) -> None:
        self.path = Path(data_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:   # preflight checked; this is the race or an odd filesystem
            raise fs_error(self.path.parent, e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise StartupError(
                    f"data folder {self.path.parent} is in use by another kvstore daemon "
                    f"(pid {holder}, lock {self.path}); stop it or pass another --data-dir"
                ) from None
            raise
        # The pid is written first and the file cut to it after: on a full filesystem the
        # write fails and the previous holder's pid stays readable, never an empty LOCK.
        pid = f"{os.getpid()}\n".encode()
        try:
            if os.pwrite(fd, pid, 0) != len(pid):
                raise OSError(errno.ENOSPC, "short write")
            os.ftruncate(fd, len(pid))
        except OSError as e:
            os.close(fd)
            raise fs_error(self.path.parent, e) from None
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        finally:
            os.close(self._fd)    # closing drops the flock
            self._fd = None


def tighten_modes(data_dir: str | os.PathLike, searchable: bool = False) -> list[str]:
    """Take group and other users' rights off the data folder and what the daemon keeps in it
    (LOCK, ssd/, events/: folders 0700, files 0600 at most), where this user owns them; returns
    what it changed, as "path 0755->0700". `searchable`: the folder stays 0711, so other uids
    can reach a socket inside it (tenants, with the default socket path), but not list it.

    Sockets and symlinks are left alone, and nothing that is not this user's is touched."""
    folder = Path(data_dir)
    me = os.geteuid()
    changed: list[str] = []

    def strip(path: Path, st: os.stat_result, keep: int = 0) -> None:
        old = stat.S_IMODE(st.st_mode)
        new = (old & ~0o077) | keep
        if st.st_uid != me or new == old:
            return
        try:
            os.chmod(path, new)
        except OSError as e:
            log.warning("cannot make %s owner-only (%s)", path, e.strerror or e)
            return
        changed.append(f"{path} {old:04o}->{new:04o}")

    try:
        st = os.stat(folder)
    except OSError:
        return changed
    strip(folder, st, 0o011 if searchable else 0)
    for name in OWNED_ENTRIES:
        top = folder / name
        try:
            st = os.lstat(top)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            strip(top, st)
        elif stat.S_ISDIR(st.st_mode):
            strip(top, st)
            for root, dirs, files in os.walk(top):
                for n in (*dirs, *files):
                    p = Path(root) / n
                    try:
                        st = os.lstat(p)
                    except OSError:
                        continue
                    if stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode):
                        strip(p, st)
    return changed


FS_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO)


def fs_error(folder: Path, e: OSError) -> StartupError:
    """A data folder the daemon cannot write: exit 2, one line naming folder and cause."""
    if e.errno == errno.EROFS:
        why = "is on a read-only filesystem"
    elif e.errno in (errno.ENOSPC, errno.EDQUOT):
        why = f"is on a full filesystem ({_free(folder)} bytes free)"
    else:
        why = f"cannot be written ({e.strerror or e})"
    return StartupError(f"data folder {folder} {why}; free space, remount it read-write or "
                        "pass another --data-dir", exit_code=2)


def _free(folder: Path) -> int:
    try:
        st = os.statvfs(folder)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def check_data_dir_writable(folder: Path) -> None:
    """The preflight check of the data folder (full, read-only, not writable), for a Daemon
    started without the CLI: exit 2 and one line, before LOCK is touched."""
    from .preflight import PreflightError, check_data_dir

    try:
        check_data_dir(str(folder))
    except PreflightError as e:
        raise StartupError(str(e), exit_code=2) from None
