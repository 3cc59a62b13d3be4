"""Optional test dependencies: a skip where one is not installed, a failure where it is but
does not import.

`pytest.importorskip` turns any ImportError into a skip, so a package that is installed but
broken (a version clash, a missing shared library) would pass the suite as skips. Here only
"not installed at all" skips, with what installs it; under CI no such skip is expected
(`make test` installs every test dependency), so it fails there too.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

import pytest


def module(name: str, hint: str = "`make dev` installs it") -> ModuleType:
    """Import `name`; skip (module level too) when it is not installed; its import errors
    propagate and fail the test."""
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:         # a parent package is missing
        spec = None
    if spec is None:
        pytest.skip(f"{name} is not installed ({hint})", allow_module_level=True)
    return importlib.import_module(name)
