"""What bench/rpc.py and bench/rpc_events.py both set up: glibc's malloc tunables for the
bench and its daemons, and page-aligned KV tensors. A module of its own so that neither
bench imports the other's script (rpc.py runs rpc_events' figures)."""

from __future__ import annotations

import os
import sys

# First, before anything starts gRPC: the SDK picks gRPC's socket layer on import
# (kvstore_client/common/grpc_stack.py), as in an engine that imports it before its channels.
import kvstore_client  # noqa: F401

MALLOC_ENV = {
    "MALLOC_ARENA_MAX": "4",
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(256 << 20),
    "MALLOC_TOP_PAD_": str(64 << 20),
}


def reexec_with_malloc_env() -> None:
    missing = {k: v for k, v in MALLOC_ENV.items() if k not in os.environ}
    if missing and "_KVS_BENCH_REEXEC" not in os.environ:
        env = {**os.environ, **missing, "_KVS_BENCH_REEXEC": "1"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def aligned_kv(lay, tokens: int, seed: int):
    """A page-aligned bf16 tensor [L, 2, tokens, H, D] (docs/performance.md: copy alignment)."""
    import numpy as np
    import torch
    from kvstore_client.buffers import aligned_buffer

    L, _, _, H, D = lay.block_shape
    n = L * 2 * tokens * H * D
    buf = aligned_buffer(n * 2).view(np.int16)
    buf[:] = np.random.default_rng(seed).integers(-2**15, 2**15, n, dtype=np.int16)
    return torch.from_numpy(buf).view(torch.bfloat16).view(L, 2, tokens, H, D)
