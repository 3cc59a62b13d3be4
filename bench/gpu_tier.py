"""The gpu tier as a tier, measured on the CPU device (imported by bench/gpu.py).

- gpu_tier_gather_vs_memcpy: a separate client process opens the daemon-side device slab by
  handle (`open_pool`) and gathers N leased blocks (shuffled slots) into a vLLM-layout paged
  cache (random block table) with `PagedCopier.load`, end to end, against a memcpy of the
  same bytes between two pre-faulted buffers in that process.
- gpu_demote_vs_memcpy: `Store.evict("gpu")` of N resident gpu blocks: host slots reserved
  (host room made), device -> host copy, each block verified against its checksum, host copies
  published, gpu slots freed; against a memcpy of the same bytes in the same run.
- gpu_promote_vs_memcpy: `Store.acquire(tier="gpu")` of the same N blocks back from host
  (device slots reserved, host -> device copy, verified, pinned), likewise.
Every figure is the reference's time over ours (>= 0.5 is the target on the CPU device).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

MIB = 1 << 20


def _interleaved(fn: Any, nbytes: int, reps: int, after: Any = None) -> tuple[float, float]:
    """Median seconds of `fn` and of a memcpy of `nbytes`, alternated rep by rep so both see
    the same neighbours on a shared machine; `after` runs untimed after each `fn`."""
    from bench.refs import aligned_buffer

    src, dst = aligned_buffer(nbytes), aligned_buffer(nbytes)
    ours, ref = [], []
    for _ in range(reps + 1):
        t = time.perf_counter()
        fn()
        ours.append(time.perf_counter() - t)
        if after is not None:
            after()
        t = time.perf_counter()
        np.copyto(dst, src)
        ref.append(time.perf_counter() - t)
    return statistics.median(ours[1:]), statistics.median(ref[1:])


def _gather_client(desc: dict, slots: list[int], layout: Any, reps: int, q: Any) -> None:
    """Runs in its own process: the pool is a real mapping of the daemon's slab here."""
    try:
        import torch
        from kvstore_client import gpu as cg

        pool = cg.open_pool(desc)
        L = layout
        n_cache = 2 * len(slots)
        caches = [torch.zeros((2, n_cache, L.block_tokens, L.num_kv_heads, L.head_dim),
                              dtype=torch.bfloat16) for _ in range(L.num_layers)]
        cache = cg.PagedKVCache.from_vllm(caches)
        targets = np.random.default_rng(1).permutation(n_cache)[:len(slots)]
        cp = cg.PagedCopier(pool, cache, L)
        t, ref = _interleaved(lambda: cp.load(targets, slots).wait(60),
                              len(slots) * L.block_bytes, reps)
        # correctness of what was timed: one block, byte for byte
        b0 = torch.stack([torch.stack([caches[i][0, targets[0]], caches[i][1, targets[0]]])
                          for i in range(L.num_layers)]).contiguous()
        same = bytes(b0.view(torch.uint8).reshape(-1).numpy()) == \
            bytes(pool.view(slots[0], L.block_bytes))
        q.put(("ok", {"gather_s": t, "memcpy_s": ref, "same": same}))
    except BaseException as e:  # report instead of hanging the parent
        q.put(("error", repr(e)))


def run(layout: Any, blocks: int, reps: int) -> dict:
    """The CPU-device figures; `layout` blocks, `blocks` of them."""
    from kvstore_client import NamespaceSpec

    from kvstore.config import StoreConfig
    from kvstore.state import aligned as _aligned
    from kvstore.store import Store

    bb = layout.block_bytes
    nbytes = blocks * bb
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-gpu-") as tmp:
        cfg = StoreConfig(data_dir=str(Path(tmp) / "data"))
        cfg.ssd.enabled = False
        cfg.host.capacity = 2 * blocks * _aligned(bb) + 8 * MIB
        cfg.gpu.enabled, cfg.gpu.backend = True, "cpu"
        cfg.gpu.capacity = 2 * blocks * _aligned(bb) + 8 * MIB
        cfg.leases.default_ttl_s = 300
        store = Store(cfg)
        try:
            ns = store.register_namespace(NamespaceSpec(model="bench/gpu", layout=layout)).ns_id
            rng = np.random.default_rng(0)
            keys = [rng.bytes(16) for _ in range(blocks)]
            lease = store.reserve(ns, blocks, tier="gpu")
            (dev,) = store.gpu
            tier = store.gpu[dev]
            for s in lease.slots:
                tier.view(s.offset, s.length)[:] = rng.integers(0, 255, bb, dtype=np.uint8)
            store.commit(lease.id, keys)

            # -- gather by another process through the opened pool, from leased gpu slots
            read = store.acquire(ns, keys, tier="gpu")
            slots = [s.offset for s in read.slots]
            rng.shuffle(slots)
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            proc = ctx.Process(target=_gather_client, args=(tier.describe(), slots, layout,
                                                             reps, q), daemon=True)
            proc.start()
            status, res = q.get(timeout=600)
            proc.join(60)
            if status != "ok":
                raise RuntimeError(f"gather client failed: {res}")
            store.release(read.id)

            # -- demotion (evict all) and promotion (acquire back), alternating
            def promote() -> None:
                lease = store.acquire(ns, keys, tier="gpu")
                assert len(lease.slots) == blocks
                store.release(lease.id)

            def demote() -> None:
                assert store.evict("gpu")[1] == blocks

            # Promotion leaves the host copies; without them each eviction must copy every
            # block down again (no SSD here: the gpu copies keep the blocks).
            d_s, ref = _interleaved(demote, nbytes, reps,
                                    after=lambda: (promote(), store.evict("host")))
            demote()                         # host-only now: each promotion copies up
            p_s, ref_p = _interleaved(promote, nbytes, reps,
                                      after=lambda: (store.evict("host"), demote()))
            counters = dict(store.counters)
        finally:
            store.close(flush=False)

    def gbps(s: float) -> float:
        return round(nbytes / s / 1e9, 2)
    return {
        "device_kind": "cpu", "tier_blocks": blocks, "tier_block_bytes": bb,
        "gpu_tier_gather_vs_memcpy": round(res["memcpy_s"] / res["gather_s"], 3),
        "gpu_tier_gather_GBps": gbps(res["gather_s"]),
        "gpu_tier_gather_bytes_equal": res["same"],
        "gather_memcpy_GBps": gbps(res["memcpy_s"]),
        "gpu_demote_vs_memcpy": round(ref / d_s, 3), "gpu_demote_GBps": gbps(d_s),
        "gpu_promote_vs_memcpy": round(ref_p / p_s, 3), "gpu_promote_GBps": gbps(p_s),
        "memcpy_GBps": gbps(ref),
        "corrupt_blocks": counters.get("corrupt_blocks", 0),
    }
