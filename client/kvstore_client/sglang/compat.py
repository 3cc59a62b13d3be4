"""Which SGLang the backend runs on, checked once with one clear line when it cannot."""

from __future__ import annotations

# The SGLang releases the backend is tested against (tests/test_sglang*.py run SGLang's own
# HiCacheStorage, host pools, storage factory, cache controller and backend tests). 0.5.23 is
# also the newest release on PyPI. SGLang's storage interface changes between releases, so a
# release outside the list is refused rather than guessed at.
SUPPORTED = ("0.5.23",)


class UnsupportedSGLang(ImportError):
    """The installed SGLang is not one the backend supports."""


def sglang_version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version
        try:
            return version("sglang")
        except PackageNotFoundError:
            pass
        from sglang.version import __version__
        return str(__version__)
    except ImportError:
        return "not installed"


def check_sglang() -> str:
    """The SGLang version string; UnsupportedSGLang (one line) outside the supported list."""
    v = sglang_version()
    if v.split("+")[0] not in SUPPORTED:
        raise UnsupportedSGLang(f"kvstore's SGLang backend supports SGLang "
                                f"{' and '.join(SUPPORTED)}; installed SGLang: {v}")
    return v
