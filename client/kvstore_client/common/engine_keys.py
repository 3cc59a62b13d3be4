"""How an engine's own block names become daemon block keys.

Why shared: the vLLM adapter stores chunks under these keys, and the daemon's KV-event relay
computes the same keys from the block hashes in the engine's own event stream to join the two
(kvstore/events/relay.py). One definition keeps them from drifting.
"""

from __future__ import annotations

import blake3


def fold_vllm_key(offload_key: bytes) -> bytes:
    """A daemon block key (32 bytes) for one of vLLM's offload keys (block hash + group index).

    vLLM's keys are 36 bytes with sha256 and shorter with xxhash; blake3 folds every length into
    the daemon's key size without weakening a cryptographic hash.
    """
    return blake3.blake3(bytes(offload_key)).digest(32)
