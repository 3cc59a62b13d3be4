"""Whose block hashes these are: a name for vLLM's key space, and the guard against random ones.

vLLM names offloaded blocks by its own prefix-chained block hashes. Those depend on the hash
algorithm, the seed of the chain's root (`NONE_HASH`, from PYTHONHASHSEED or a fixed default)
and how a block's tokens are serialized, which changes across vLLM versions. Two engines may
share blocks only when all of that agrees, so the namespace's hash scheme carries the algorithm
and a fingerprint of vLLM's hash of a fixed probe block: engines whose key spaces differ land in
different namespaces and never see each other's blocks.

Where the root is seeded with random bytes per process (non-cryptographic hashes without
PYTHONHASHSEED), no other process can ever hit a stored block; the tier refuses to store them
persistently unless told to run process-local (docs/vllm.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import blake3

from ..common.engine_keys import fold_vllm_key

_PROBE_TOKENS = tuple(range(1, 17))
_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
_NON_CRYPTO = ("xxhash", "xxhash_cbor")


@dataclass(frozen=True)
class KeySpace:
    algo: str            # vLLM's prefix-caching hash algorithm
    fingerprint: str     # hex digest of vLLM's hash of a probe block
    process_random: bool  # the root is seeded per process: no other process shares these keys

    @property
    def scheme(self) -> str:
        return f"external:vllm-{self.algo}-{self.fingerprint}"


def detect() -> KeySpace | None:
    """The key space of this process's vLLM; None before vLLM has seeded its hash chain.

    vLLM's engine core seeds the chain (`init_none_hash`) after it builds the scheduler, so the
    tier calls this lazily, on its first lookup or store, never in its constructor.
    """
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    root = getattr(kcu, "NONE_HASH", None)
    seed = getattr(kcu, "_NONE_HASH_SEED", None)
    if root is None:
        return None
    algo = None
    for name in _ALGOS:
        try:
            fn = get_hash_fn_by_name(name)
        except ValueError:
            continue
        if seed is not None and fn(seed) == root:
            algo = name
            break
    if algo is None:        # an algorithm this adapter does not know: fingerprint the root only
        algo, fn = "unknown", None
    probe = root
    if fn is not None:
        probe = kcu.hash_block_tokens(fn, root, _PROBE_TOKENS, None)
    fingerprint = blake3.blake3(b"kvstore-vllm-keyspace\0" + bytes(probe)).hexdigest()[:16]
    random_seed = algo in _NON_CRYPTO and os.environ.get("PYTHONHASHSEED") is None
    return KeySpace(algo, fingerprint, random_seed)


fold_key = fold_vllm_key
