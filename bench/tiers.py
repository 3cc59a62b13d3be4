"""Host and SSD tier throughput through the Store API, as ratios against memcpy and raw disk.

Figures:
- host_vs_memcpy: put + get of 64 x 2 MiB blocks through the Store (copy into the slab, then
  acquire, copy out into a reused buffer, release) against numpy copies of the same bytes.
- ssd_write_vs_disk: demotion of those blocks (encode + payload-file write + index commit +
  fsync) against a sequential O_DIRECT write of the same bytes.
- ssd_read_vs_disk: cold promotion (page cache of the payload file dropped; read + decode + verify)
  against a sequential O_DIRECT read.
  Both are the median of per-round ratios (7 rounds with --quick, 11 without): each round
  demotes and promotes fresh keys and measures the disk reference right beside it
  (bench/refs.py DiskRef; the order alternates), because this virtual disk's speed moves 2x
  within seconds. The first round of each writes fresh extents, later rounds rewrite freed
  ones, on both sides.
- ssd_tier_write_vs_disk / ssd_tier_read_vs_disk: the same bytes through SSDTier alone (payload
  file + index commit + sync; cold reads through `visit`, as promotion reads), no codec: the
  data path without encoding.
Usage: python bench/tiers.py [--quick] [--dir DIR]. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# This script is named like the `tiers` package: take its folder off the path, import by package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
from kvstore_client import KVLayout, NamespaceSpec, block_keys  # noqa: E402

from bench.refs import DiskRef, aligned_buffer, drop_page_cache, memcpy_seconds  # noqa: E402
from kvstore.config import StoreConfig  # noqa: E402
from kvstore.store import Store  # noqa: E402
from tiers.codecs import warm_up  # noqa: E402

# 16 layers x 2 x 32 tokens x 8 heads x 128 dims x bf16 = 2 MiB, a typical block.
LAYOUT = KVLayout(num_layers=16, num_kv_heads=8, head_dim=128, block_tokens=32, dtype="bfloat16")


def kv_like(n_blocks: int) -> list[np.ndarray]:
    """bf16 blocks with KV-like statistics (per-channel scale, a few outlier channels)."""
    rng = np.random.default_rng(0)
    shape = LAYOUT.block_shape
    scale = rng.gamma(2.0, 0.5, size=(shape[0], 2, 1, shape[3], shape[4])).astype(np.float32)
    scale[:, 0, :, :, :4] *= 20                     # outlier key channels
    out = []
    for _ in range(n_blocks):
        x = (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)
        out.append((x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(-1))
    return out


def run(quick: bool, folder: str) -> dict:
    n = 64
    blocks = kv_like(n)
    total = n * LAYOUT.block_bytes
    tmp = tempfile.mkdtemp(prefix="kvstore-bench-", dir=folder)
    try:
        cfg = StoreConfig(data_dir=tmp)
        cfg.host.capacity = 4 * total
        cfg.ssd.capacity = 4 * total
        store = Store(cfg)
        ns = store.register_namespace(NamespaceSpec(model="bench", layout=LAYOUT)).ns_id
        keys = block_keys(np.arange(n * LAYOUT.block_tokens), LAYOUT.block_tokens)
        out = aligned_buffer(total)
        rounds = 3 if quick else 10

        def host_round(r: int) -> float:
            ks = [bytes([r]) + k[1:] for k in keys]        # fresh keys each round: no dedup
            t = time.perf_counter()
            store.put(ns, ks, blocks)
            lease = store.acquire(ns, ks)
            for i, s in enumerate(lease.slots):
                np.copyto(out[i * s.length:(i + 1) * s.length], store.host.view(s.offset, s.length))
            store.release(lease.id)
            dt = time.perf_counter() - t
            store.delete(ns, ks)
            return dt

        host_round(255)                                   # warm the slab and the code paths
        warm_up()       # the codec kernels, as the daemon loads them once it is ready
        host_s = min(host_round(r) for r in range(rounds))
        memcpy_s = 2 * memcpy_seconds(total)              # put and get are one copy each

        stored = []

        def ssd_round(r: int) -> tuple[float, float]:
            ks = [bytes([128 + r]) + k[1:] for k in keys]
            store.put(ns, ks, blocks)
            # Demotion: host -> ssd (encode, payload write, index commit, fsync).
            t = time.perf_counter()
            store.evict("host")
            store.ssd.sync()
            write_s = time.perf_counter() - t
            stored.append(store.ssd.used_bytes)
            # Cold promotion: drop the payload file's pages, then acquire everything back.
            drop_page_cache(store.ssd.data_files())
            t = time.perf_counter()
            lease = store.acquire(ns, ks)
            read_s = time.perf_counter() - t
            assert len(lease.keys) == n, "promotion lost blocks"
            for i, s in enumerate(lease.slots):
                assert np.array_equal(store.host.view(s.offset, s.length), blocks[i])
            store.release(lease.id)
            store.delete(ns, ks)
            return write_s, read_s

        disk = DiskRef(tmp, total)
        ours, ref = [], []
        for r in range(7 if quick else 11):
            if r % 2:                                   # alternate who goes first
                ref.append(disk.measure())
                ours.append(ssd_round(r))
            else:
                ours.append(ssd_round(r))
                ref.append(disk.measure())
        disk.close()
        counters = store.stats()["counters"]
        store.close(flush=False)
        tier_w, tier_r = tier_only(tmp, blocks)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = statistics.median
    write_s, read_s = med(w for w, _ in ours), med(r for _, r in ours)
    disk_w, disk_r = med(w for w, _ in ref), med(r for _, r in ref)
    gb = total / 1e9
    res = {
        "host_vs_memcpy": round(memcpy_s / host_s, 3),
        "ssd_write_vs_disk": round(med(d[0] / o[0] for o, d in zip(ours, ref, strict=True)), 3),
        "ssd_read_vs_disk": round(med(d[1] / o[1] for o, d in zip(ours, ref, strict=True)), 3),
        "ssd_write_vs_disk_rounds": [round(d[0] / o[0], 2) for o, d in zip(ours, ref,
                                                                          strict=True)],
        "ssd_read_vs_disk_rounds": [round(d[1] / o[1], 2) for o, d in zip(ours, ref,
                                                                         strict=True)],
        "host_put_get_gbps": round(2 * gb / host_s, 2),
        "memcpy_gbps": round(2 * gb / memcpy_s, 2),
        "demote_gbps": round(gb / write_s, 2),
        "disk_write_gbps": round(gb / disk_w, 2),
        "promote_cold_gbps": round(gb / read_s, 2),
        "disk_read_gbps": round(gb / disk_r, 2),
        "ssd_tier_write_vs_disk": round(disk_w / tier_w, 3),
        "ssd_tier_read_vs_disk": round(disk_r / tier_r, 3),
        "ssd_stored_ratio": round(max(stored) / total, 3),
        "lossy_refused": counters.get("lossy_refused_nonfinite", 0),
        "blocks": n, "block_bytes": LAYOUT.block_bytes,
    }
    return res


def tier_only(folder: str, blocks: list[np.ndarray]) -> tuple[float, float]:
    """Seconds to write (put_many in demotion-sized batches + sync) and cold-read (two threads,
    as promotion reads) the same blocks, framed raw, through SSDTier alone: the data path
    without the codec, which on a busy 2-core machine is what bounds the Store figures."""
    from concurrent.futures import ThreadPoolExecutor

    from tiers import frame
    from tiers.ssd import SSDTier

    values = [frame.frame("raw", len(b), b) for b in blocks]
    keys = [i.to_bytes(16, "big") for i in range(len(values))]
    path = tempfile.mkdtemp(prefix="kvstore-bench-tier-", dir=folder)
    try:
        with SSDTier(path, capacity=4 * sum(map(len, values))) as t:
            t.put_many([(k, v, b"") for k, v in zip(keys, values, strict=True)])  # grow once
            t.delete_many(keys)
            start = time.perf_counter()
            for i in range(0, len(keys), 16):
                t.put_many([(k, v, b"") for k, v in zip(keys[i:i + 16], values[i:i + 16],
                                                       strict=True)])
            t.sync()
            write_s = time.perf_counter() - start
            drop_page_cache(t.data_files())
            start = time.perf_counter()
            with ThreadPoolExecutor(2) as pool:      # promotion decodes from visit's view
                sizes = list(pool.map(lambda k: t.visit(k, len), keys))
            read_s = time.perf_counter() - start
            assert sizes == [len(v) for v in values], "the SSD tier lost blocks"
            assert [t.get(k) for k in keys] == values, "the SSD tier returned other bytes"
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return write_s, read_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dir", default=os.getcwd(), help="folder on the disk to measure")
    args = ap.parse_args()
    res = run(args.quick, args.dir)
    print(f"{'figure':<22}{'value':>10}")
    for k, v in res.items():
        print(f"{k:<26}{v!s:>10}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
