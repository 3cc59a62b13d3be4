"""Small builders shared by the store tests: a store in a temp dir and random KV blocks."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from kvstore_client import KVLayout, NamespaceSpec, block_keys

from kvstore.config import StoreConfig
from kvstore.store import Store

# 2 layers x 2 (K,V) x 8 tokens x 2 heads x 16 dims x fp16 = 2 KiB a block: fast tests.
SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=8, dtype="float16")


def make_store(tmp_path, host_capacity: int = 1 << 20, ssd_capacity: int = 64 << 20,
               ssd: bool = True, gpu_capacity: int = 0, ssd_compress: str = "auto",
               **host_kw) -> Store:
    """gpu_capacity > 0 enables the gpu tier on the CPU device (tiers/device_cpu.py);
    ssd_compress is config ssd.compress (kvstore/encode_choice.py)."""
    cfg = StoreConfig(data_dir=str(tmp_path / "data"))
    if gpu_capacity:
        cfg.gpu.enabled, cfg.gpu.capacity, cfg.gpu.backend = True, gpu_capacity, "cpu"
    cfg.host.capacity = host_capacity
    for k, v in host_kw.items():
        setattr(cfg.host, k, v)
    cfg.ssd.enabled = ssd
    cfg.ssd.capacity = ssd_capacity
    cfg.ssd.compress = ssd_compress
    cfg.leases.default_ttl_s = 30
    return Store(cfg)


@contextmanager
def quiet(store: Store, deadline_s: float = 30.0) -> Iterator[None]:
    """Hold the store lock at a moment nothing is in flight, for checks of exact state.

    After the callers stop, a background demoter's batch or an SSD write may still be moving
    blocks (their `moving` marks set, their destination slots taken) with the lock released.
    Every such move, and every call that released the lock mid-way, counts in state.busy and
    starts only under the lock: with the lock held and busy at 0, every pin, mark and byte
    count is final."""
    st = store.state
    end = time.monotonic() + deadline_s
    while True:
        st.lock.acquire()
        if st.busy == 0:
            break
        st.lock.release()
        assert time.monotonic() < end, "calls or moves still in flight after the deadline"
        time.sleep(0.01)
    try:
        yield
    finally:
        st.lock.release()


def namespace(store: Store, layout: KVLayout = SMALL, codec: str = "lossless",
              model: str = "test-model") -> bytes:
    return store.register_namespace(NamespaceSpec(model=model, layout=layout, codec=codec)).ns_id


def random_prompt(rng: np.random.Generator, n_blocks: int, layout: KVLayout = SMALL):
    tokens = rng.integers(0, 32000, size=n_blocks * layout.block_tokens)
    return tokens, block_keys(tokens, layout.block_tokens)


def kv_block(key: bytes, layout: KVLayout = SMALL) -> bytes:
    """Deterministic pseudo-KV for a key, so any test can recompute what a block must hold."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    vals = rng.standard_normal(layout.block_elements).astype(np.float32)
    return vals.astype(np.float16 if layout.dtype == "float16" else np.float32).tobytes() \
        if layout.dtype != "bfloat16" else (vals.view(np.uint32) >> 16).astype(np.uint16).tobytes()
