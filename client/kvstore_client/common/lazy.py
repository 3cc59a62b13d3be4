"""A module imported on first use, for names that a process may never need before it is ready.

Why: the daemon must report SERVING quickly (the target: within twice a bare gRPC server's
start, bench/startup.py), and numpy alone costs about as much CPU as that whole bare start. The
daemon's start path (open the store, bind gRPC) touches no array; the first data call does. A
module-level `np = lazy_module("numpy", globals(), "np")` keeps every `np.xxx` in the module's
functions as it was: the first attribute read imports numpy and rebinds the module's global
`np` to the real module, so later calls pay nothing. Importing is thread-safe (the import
system's locks), and a race only rebinds the same module twice.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any


class _LazyModule:
    __slots__ = ("_name", "_owner", "_alias")

    def __init__(self, name: str, owner: dict[str, Any], alias: str) -> None:
        self._name, self._owner, self._alias = name, owner, alias

    def __getattr__(self, attr: str) -> Any:
        module = import_module(self._name)
        if self._owner.get(self._alias) is self:
            self._owner[self._alias] = module
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<module {self._name!r}, imported on first use>"


def lazy_module(name: str, owner: dict[str, Any], alias: str) -> Any:
    """A stand-in for `import name as alias` in the module whose globals() is `owner`."""
    return _LazyModule(name, owner, alias)
