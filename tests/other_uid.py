"""Whether a test may run a child process under another uid here, and making it possible in CI.

Such a child starts as root, imports what it can, drops to the other uid and then may import
more (the SDK loads modules lazily) from this checkout and from the interpreter's environment,
so every folder from the filesystem root down to those must be searchable (o+x) by other users.
A checkout cloned under a private folder (`mktemp -d` makes 0700 ones) is not: the child then
dies on an ImportError, which says nothing about isolation.

CI runs as root on such a clone, and these tests are the proof docs/security.md cites, so under
CI (`CI` set) the folders that lack it get o+x (search, not read: nothing becomes listable) for
the test session and their modes are put back at its end. Elsewhere the tests skip, saying which
folder stops them.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _roots() -> list[Path]:
    """The folders a child imports from: the checkout, the interpreter's environment and
    every folder on its import path (resolved: a symlinked .venv counts where it points)."""
    out = [ROOT, Path(sys.prefix).resolve()]
    out += [Path(p).resolve() for p in sys.path if p and os.path.isdir(p)]
    return out


def blocked() -> list[Path]:
    """The folders, root first, that other users cannot search on the way to those."""
    seen: dict[Path, None] = {}
    for r in _roots():
        for d in (*reversed(r.parents), r):
            if d not in seen and not d.stat().st_mode & stat.S_IXOTH:
                seen[d] = None
    return list(seen)


def skip_reason() -> str | None:
    """Why a child under another uid cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "running a client under another uid needs root"
    for d in blocked():
        return (f"{d} is not searchable by other users (mode {d.stat().st_mode & 0o777:o}), "
                "so a child under another uid cannot import the SDK from this checkout; under "
                "CI (CI set) the suite makes it searchable for its run")
    return None


@contextmanager
def searchable() -> Iterator[str | None]:
    """Yields None when children under other uids can run (under CI, after granting o+x on
    the folders that lacked it, restored on exit), else why not."""
    why = skip_reason()
    if why is None or os.geteuid() != 0 or not os.environ.get("CI"):
        yield why
        return
    granted: list[tuple[Path, int]] = []
    try:
        for d in blocked():
            mode = stat.S_IMODE(d.stat().st_mode)
            d.chmod(mode | stat.S_IXOTH)
            granted.append((d, mode))
        yield skip_reason()
    finally:
        for d, mode in reversed(granted):
            d.chmod(mode)
