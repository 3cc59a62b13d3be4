"""How the store scales with the blocks it indexes, and what spilling costs a writer.

Figures, each a ratio or a size measured in this run:
- bytes_per_indexed_block: resident memory the daemon gains per block when it rebuilds the
  index of N SSD-resident blocks (packed index row + SSD policy row, the warm-restart path of
  kvstore/store.py without a policy snapshot), at N = 1M. Target <= 300.
  Also reported: ghost_bytes_per_block, what the SSD policy's history of evicted keys adds per
  resident block once it is full (GHOST_FACTOR remembered keys per block,
  kvstore/policies/evicted_keys.py), and bytes_per_block_steady, the sum.
- lookup_p50_1m_vs_10k: median Store.lookup latency of a 16-block prompt with 1M blocks
  indexed against 10k. Target <= 1.2.
- alloc_after_churn_vs_fresh: ExtentAllocator.alloc time after 200k frees of the same size
  against allocations from a fresh slab. Target <= 1.5.
- store_gbps_spilling_vs_not: Store.put throughput of 2 MiB blocks into a full host pool
  (every write demotes to SSD) against an empty one. Target >= 0.5.
Usage: python bench/scale.py [--quick] [--dir DIR]; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
from kvstore_client import KVLayout, NamespaceSpec  # noqa: E402

from kvstore.config import StoreConfig  # noqa: E402
from kvstore.index import NS_ID_BYTES  # noqa: E402
from kvstore.store import Store  # noqa: E402
from tiers.slab import ExtentAllocator  # noqa: E402

SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=8, dtype="float16")
BIG = KVLayout(num_layers=16, num_kv_heads=8, head_dim=128, block_tokens=32, dtype="bfloat16")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def store(folder: str, host: int, ssd: int = 1 << 30, bg: bool = True) -> Store:
    cfg = StoreConfig(data_dir=tempfile.mkdtemp(prefix="kvstore-scale-", dir=folder))
    cfg.host.capacity = host
    cfg.ssd.capacity = ssd
    cfg.host.background_demotion = bg
    return Store(cfg)


def index_blocks(s: Store, ns: bytes, n: int, start: int = 0) -> None:
    """What a warm restart does per SSD block (Store._rebuild), without the disk."""
    policy = s.policies["ssd"]
    add = s.index.add_cold
    size = SMALL.block_bytes
    for i in range(start, start + n):
        key = i.to_bytes(16, "big")
        parent = (i - 1).to_bytes(16, "big") if i % 64 else None
        add(ns, key, parent, size, i, ssd=True)
        policy.insert(ns + key, ns + parent if parent else None, size)
    policy.compact()


def index_figures(folder: str, big_n: int) -> dict:
    s = store(folder, 1 << 20)
    try:
        ns = s.register_namespace(NamespaceSpec(model="scale", layout=SMALL)).ns_id
        assert len(ns) == NS_ID_BYTES
        index_blocks(s, ns, 10_000)
        small = lookup_p50(s, ns, 10_000)
        gc.collect()
        before = rss_bytes()
        index_blocks(s, ns, big_n - 10_000, start=10_000)
        gc.collect()
        per_block = (rss_bytes() - before) / (big_n - 10_000)
        big = lookup_p50(s, ns, big_n)
    finally:
        s.close(flush=False)
    return {"bytes_per_indexed_block": round(per_block, 1),
            "lookup_p50_big_vs_10k": round(big / small, 3),
            "lookup_p50_10k_us": round(small * 1e6, 2), "lookup_p50_big_us": round(big * 1e6, 2)}


def ghost_bytes_per_block(blocks: int) -> float:
    """Memory of the SSD policy's ghost per resident block once full (GHOST_FACTOR keys per
    block of a `blocks`-block tier). Counted from its arrays (it holds no Python object per
    key): the RSS delta is blind here, since the pages the index figure freed are reused."""
    from kvstore.policies import SegmentedPolicy
    from kvstore.policies.evicted_keys import GhostKeys

    g = GhostKeys()
    for i in range(SegmentedPolicy.GHOST_FACTOR * blocks):
        g[i.to_bytes(32, "little")] = None
    return sum(sys.getsizeof(a) for a in (g._fp, g._pos, g._ring)) / blocks


def lookup_p50(s: Store, ns: bytes, n: int, samples: int = 3000) -> float:
    rng = np.random.default_rng(0)
    starts = rng.integers(0, n - 16, samples)
    times = []
    for a in starts:
        keys = [int(i).to_bytes(16, "big") for i in range(a, a + 16)]
        t = time.perf_counter()
        s.lookup(ns, keys)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def alloc_churn(n: int = 200_000) -> float:
    size = 2 << 20

    def timed(a: ExtentAllocator) -> float:
        t = time.perf_counter()
        for _ in range(n):
            a.alloc(size)
        return time.perf_counter() - t

    fresh = timed(ExtentAllocator(n * size * 2))
    churned = ExtentAllocator(n * size * 2)
    offs = [churned.alloc(size) for _ in range(n)]
    for o in offs:
        churned.free(o)
    return timed(churned) / fresh


def store_spilling(folder: str, quick: bool) -> dict:
    n = 48 if quick else 160
    rng = np.random.default_rng(1)
    x = rng.standard_normal(BIG.block_elements, dtype=np.float32)
    base = (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    blocks = [np.roll(base, i).tobytes() for i in range(n)]
    host = n * BIG.block_bytes * 2                       # room for every block twice

    def rate(s: Store, tag: int) -> float:
        ns = s.register_namespace(NamespaceSpec(model="spill", layout=BIG)).ns_id
        keys = [bytes([tag]) + i.to_bytes(15, "big") for i in range(n)]
        t = time.perf_counter()
        for i in range(0, n, 8):
            s.put(ns, keys[i:i + 8], blocks[i:i + 8])
        return n * BIG.block_bytes / (time.perf_counter() - t) / 1e9

    s = store(folder, host, ssd=8 * host)
    try:
        empty = rate(s, 1)                                 # half the pool: no eviction
        s.evict("host")
        rate(s, 2)
        rate(s, 3)                                         # full: every write now spills
        spilling = rate(s, 4)
        waits = s.stats()["counters"].get("reserve_waits", 0)
    finally:
        s.close(flush=False)
    return {"store_gbps_spilling_vs_not": round(spilling / empty, 3),
            "store_gbps_empty": round(empty, 3), "store_gbps_spilling": round(spilling, 3),
            "spilling_puts_that_evicted_inline": waits}


def run(quick: bool, folder: str) -> dict:
    tmp = tempfile.mkdtemp(prefix="kvstore-scale-", dir=folder)
    try:
        big_n = 1_000_000
        idx = index_figures(tmp, big_n)
        res = {"bytes_per_indexed_block": idx["bytes_per_indexed_block"],
               "lookup_p50_1m_vs_10k": idx["lookup_p50_big_vs_10k"],
               "alloc_after_churn_vs_fresh": round(alloc_churn(50_000 if quick else 200_000),
                                                   3)}
        ghost = ghost_bytes_per_block(big_n)
        res.update({"ghost_bytes_per_block": round(ghost, 1),
                    "bytes_per_block_steady": round(idx["bytes_per_indexed_block"] + ghost, 1)})
        res.update(store_spilling(tmp, quick))
        res.update({"indexed_blocks": big_n, "lookup_p50_10k_us": idx["lookup_p50_10k_us"],
                    "lookup_p50_big_us": idx["lookup_p50_big_us"]})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dir", default=os.getcwd(), help="folder on the disk to use")
    args = ap.parse_args()
    res = run(args.quick, args.dir)
    for k, v in res.items():
        print(f"{k:<34}{v}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
