"""Whether a test may run a child process under another uid here.

Such a child imports the SDK and its dependencies from this checkout (and its .venv) after
dropping privileges, so every folder from the filesystem root down to the checkout must be
searchable by other users. A checkout cloned under a private folder (`mktemp -d` makes 0700
ones) is not: the child then dies on an ImportError, which says nothing about isolation.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def skip_reason() -> str | None:
    """Why a child under another uid cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "running a client under another uid needs root"
    for d in (ROOT, *ROOT.parents):
        if not d.stat().st_mode & 0o001:
            return (f"{d} is not searchable by other users (mode "
                    f"{d.stat().st_mode & 0o777:o}), so a child under another uid cannot "
                    "import the SDK from this checkout")
    return None
