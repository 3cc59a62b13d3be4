"""Store lock contention: how much one engine's tier movement slows another engine's hot calls.

In process, against a real Store (host + SSD in a temp folder). Thread B is the latency-sensitive
engine: every PACE_S it calls lookup, then acquire + release, on a few hot host-resident blocks,
and records each call's latency. Thread A is the busy engine, in one of two workloads:
- promote: acquire + release a batch of cold 2 MiB blocks that must come back from SSD (read,
  decode, verify, copy into the slab). Its working set is three batches and host holds about one,
  so every acquire promotes; the blocks it evicts keep their SSD copy (no demotion).
- demote: put a batch of fresh blocks into a full host, so every put evicts and demotes host-only
  blocks (encode, LMDB write).
Figures: B's lookup and acquire p50/p99 with A idle and A busy, as busy/idle ratios
(`lookup_p99_busy_vs_idle` is the promote workload's; the demote workload's carry a `_demote`
suffix, and its headline `lookup_p99_demote_busy_vs_idle` repeats `lookup_p99_busy_vs_idle_demote`),
and A's throughput with B running against A alone (`a_promote_with_b_vs_alone`), so a change
cannot win by starving A.
Usage: python bench/contention.py [--quick] [--dir DIR]. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

# This folder holds a script named like the `tiers` package: take it off the path (bench/tiers.py).
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
from kvstore_client import NamespaceSpec  # noqa: E402

from bench.tiers import LAYOUT, kv_like  # noqa: E402
from kvstore.config import StoreConfig  # noqa: E402
from kvstore.state import aligned as _aligned  # noqa: E402
from kvstore.store import Store  # noqa: E402

BATCH = 16          # blocks A moves per call (32 MiB)
HOT = 4             # blocks B reads per call
PACE_S = 0.001      # B's think time between calls: an engine's request rate, not a spin loop


def key(group: int, i: int) -> bytes:
    return struct.pack("<QQ", group, i)


def percentiles(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"p50_us": round(s[len(s) // 2] * 1e6, 1),
            "p99_us": round(s[min(len(s) - 1, int(len(s) * 0.99))] * 1e6, 1), "calls": len(s)}


class Engine:
    """Thread B: lookup, then acquire + release, of the hot blocks, with per-call latencies."""

    def __init__(self, store: Store, ns: bytes, keys: list[bytes]) -> None:
        self.store, self.ns, self.keys = store, ns, keys
        self.lookup_s: list[float] = []
        self.acquire_s: list[float] = []

    def run(self, stop: threading.Event) -> None:
        clock, store = time.perf_counter, self.store
        while not stop.is_set():
            t0 = clock()
            n = store.lookup(self.ns, self.keys).prefix_blocks
            t1 = clock()
            lease = store.acquire(self.ns, self.keys)
            store.release(lease.id)
            t2 = clock()
            assert n == len(lease.keys) == len(self.keys), "a hot block left host"
            self.lookup_s.append(t1 - t0)
            self.acquire_s.append(t2 - t1)
            time.sleep(PACE_S)


def timed(seconds: float, fns: list[Callable[[threading.Event], None]]) -> None:
    """Run each fn(stop) in its own thread for `seconds`; re-raise the first failure."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def guard(fn: Callable[[threading.Event], None]) -> None:
        try:
            fn(stop)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
            stop.set()
    threads = [threading.Thread(target=guard, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    stop.wait(seconds)
    stop.set()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


class Mover:
    """Thread A: promotes cold batches or demotes fresh ones; counts the bytes it moved."""

    def __init__(self, store: Store, ns: bytes, blocks: list) -> None:
        self.store, self.ns, self.blocks = store, ns, blocks
        self.cold = [[key(1 + b, i) for i in range(BATCH)] for b in range(3)]
        self.round = 0
        self.moved = 0
        self.seconds = 0.0

    def _promoted(self) -> int:
        return self.store.stats()["tiers"]["host"].get("promotions", 0)

    def promote(self, stop: threading.Event) -> None:
        before, t = self._promoted(), time.perf_counter()
        while not stop.is_set():
            keys = self.cold[self.round % len(self.cold)]
            self.round += 1
            lease = self.store.acquire(self.ns, keys)
            self.store.release(lease.id)
            assert len(lease.keys) == BATCH, "a cold block was lost"
        self.seconds += time.perf_counter() - t
        self.moved += (self._promoted() - before) * LAYOUT.block_bytes

    def demote(self, stop: threading.Event) -> None:
        t = time.perf_counter()
        while not stop.is_set():
            self.round += 1
            keys = [key(1000 + self.round, i) for i in range(BATCH)]
            self.store.put(self.ns, keys, self.blocks)
            self.moved += BATCH * LAYOUT.block_bytes
        self.seconds += time.perf_counter() - t

    def gbps(self) -> float:
        return round(self.moved / self.seconds / 1e9, 3) if self.seconds else 0.0


def open_store(folder: str) -> Store:
    cfg = StoreConfig(data_dir=folder)
    block = _aligned(LAYOUT.block_bytes)
    # Host: the hot blocks plus a little over one cold batch (at the low watermark), so each
    # acquire of the next batch evicts the last one.
    cfg.host.capacity = int((HOT + BATCH + 2) * block / cfg.host.low_watermark)
    cfg.ssd.capacity = 1 << 30
    return Store(cfg)


def scenario(store: Store, ns: bytes, hot: list[bytes], work: Callable | None, seconds: float
             ) -> dict:
    b = Engine(store, ns, hot)
    timed(seconds, [b.run] + ([work] if work else []))
    return {"lookup": percentiles(b.lookup_s), "acquire": percentiles(b.acquire_s)}


def measure(store: Store, secs: float, blocks: list) -> dict:
    """The three scenarios on one store: A's throughput alone, then B idle, A promoting, A
    demoting."""
    ns = store.register_namespace(NamespaceSpec(model="bench", layout=LAYOUT)).ns_id
    hot = [key(0, i) for i in range(HOT)]
    store.put(ns, hot, blocks[:HOT])
    pin = store.acquire(ns, hot, ttl_s=600)   # A's eviction must never take B's blocks
    a = Mover(store, ns, blocks)
    for keys in a.cold:                         # cold batches: on SSD, not in host
        store.put(ns, keys, blocks)
        store.evict("host")
    timed(secs / 3, [a.promote])                # warm-up, and A's throughput alone
    a.moved = 0
    a.seconds = 0.0
    timed(secs / 2, [a.promote])
    alone_promote = a.gbps()
    res: dict = {"idle": scenario(store, ns, hot, None, secs)}
    a.moved, a.seconds = 0, 0.0
    res["promote"] = scenario(store, ns, hot, a.promote, secs)
    res["promote"]["a_gbps"] = a.gbps()
    res["promote"]["a_alone_gbps"] = alone_promote
    a.moved, a.seconds = 0, 0.0
    timed(secs / 2, [a.demote])
    alone_demote = a.gbps()
    a.moved, a.seconds = 0, 0.0
    res["demote"] = scenario(store, ns, hot, a.demote, secs)
    res["demote"]["a_gbps"] = a.gbps()
    res["demote"]["a_alone_gbps"] = alone_demote
    store.release(pin.id)
    return res


def run(quick: bool, folder: str) -> dict:
    secs = 5.0 if quick else 15.0
    blocks = kv_like(BATCH)
    tmp = tempfile.mkdtemp(prefix="kvstore-bench-", dir=folder)
    try:
        store = open_store(tmp)
        try:
            res = measure(store, secs, blocks)
        finally:
            store.close(flush=False)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return summarize(res)


def summarize(res: dict) -> dict:
    idle = res["idle"]
    out: dict = {}
    for work in ("promote", "demote"):
        r = res[work]
        for call in ("lookup", "acquire"):
            for p in ("p50", "p99"):
                out[f"{call}_{p}_busy_vs_idle" + ("" if work == "promote" else "_demote")] = \
                    round(r[call][f"{p}_us"] / idle[call][f"{p}_us"], 2)
        out[f"a_{work}_with_b_vs_alone"] = round(r["a_gbps"] / r["a_alone_gbps"], 3)
    out["lookup_p99_demote_busy_vs_idle"] = out["lookup_p99_busy_vs_idle_demote"]
    out["scenarios"] = res
    out["block_bytes"] = LAYOUT.block_bytes
    out["batch"] = BATCH
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dir", default=os.getcwd(), help="folder on the disk to use")
    args = ap.parse_args()
    res = run(args.quick, args.dir)
    sc = res["scenarios"]
    print(f"{'A workload':<12}{'lookup p50/p99 us':>22}{'acquire p50/p99 us':>22}"
          f"{'A GB/s (alone)':>18}")
    for name in ("idle", "promote", "demote"):
        r = sc[name]
        lk, aq = r["lookup"], r["acquire"]
        a = f"{r['a_gbps']} ({r['a_alone_gbps']})" if "a_gbps" in r else "-"
        print(f"{name:<12}{lk['p50_us']:>11.0f} / {lk['p99_us']:<8.0f}"
              f"{aq['p50_us']:>11.0f} / {aq['p99_us']:<8.0f}{a:>18}")
    for k, v in res.items():
        if k != "scenarios":
            print(f"{k:<34}{v:>10}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
