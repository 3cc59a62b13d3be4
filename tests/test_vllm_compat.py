"""Loading the vLLM tier where vLLM lacks tiered offloading fails with one actionable line."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_tier_without_vllm_says_what_is_needed():
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("this environment has vLLM; the engine tests cover it")
    for mod in ("kvstore_client.vllm.tier", "kvstore_client.vllm.cpu_worker"):
        p = subprocess.run([sys.executable, "-c", f"import {mod}"], capture_output=True,
                           text=True, timeout=60)
        assert p.returncode != 0
        last = p.stderr.strip().splitlines()[-1]
        assert last == ("kvstore_client.vllm.compat.UnsupportedVLLM: kvstore's vLLM tier "
                        "supports vLLM 0.32 and 0.33 (tiered KV offloading); installed vLLM: "
                        "not installed"), last


def test_sdk_imports_without_vllm():
    """The SDK and the adapter's package never import vLLM by themselves."""
    p = subprocess.run([sys.executable, "-c", "import sys, kvstore_client, kvstore_client.vllm,"
                        " kvstore_client.vllm.keyspace; assert 'vllm' not in sys.modules"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
