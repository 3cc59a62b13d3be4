"""Peer benchmark: kvstore zero-copy store/load against LMCache's in-process CPU backend.

Same workload for both, in the same run, each system alone: bf16 blocks of 16 tokens gathered
from and scattered into an engine-layout tensor [L, 2, tokens, H, D] (page-aligned, allocated
once), all blocks new on store and all cached on load, bytes verified after the first round.
  2 MiB blocks:   L=32, H=8, D=128   (512 blocks; --quick: 64)
  128 KiB blocks: L=8,  H=4, D=64    (4096 blocks; --quick: 1024)
kvstore: the SDK on the daemon's shared-memory pool, checksums on (the client checksums in its
copy pass, the daemon verifies each Commit, the client verifies each load).
LMCache: LMCacheEngine with its LocalCPUBackend, chunk_size 16, in this machine's CPU memory.
Its stock standalone connector copies nothing, so this bench's connector copies every chunk out
of and back into the engine tensor with torch `copy_`, as a GPU connector does.

Figures, plain GB/s ratios (kvstore / LMCache, higher is better; target >= 1.0 each):
  vs_lmcache_store_2m, vs_lmcache_load_2m, vs_lmcache_store_128k, vs_lmcache_load_128k

LMCache pins numpy and protobuf versions the daemon cannot use, so it lives in a venv of its own
and runs in a child process (README, "Benchmarks"): --lmcache-python, $KVSTORE_LMCACHE_PYTHON,
or .venv-lmcache/bin/python in the repository. Without it the bench says so in one line and
reports kvstore alone (the ratios are null).

Usage: .venv/bin/python bench/peers.py [--quick]. Last line of output: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {"2m": (32, 8, 128), "128k": (8, 4, 64)}
T = 16
MALLOC_ENV = {
    "MALLOC_ARENA_MAX": "4",
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(256 << 20),
    "MALLOC_TOP_PAD_": str(64 << 20),
}


def _blocks(quick: bool) -> dict[str, int]:
    return {"2m": 64, "128k": 1024} if quick else {"2m": 512, "128k": 4096}


def _engine_tensor(shape: tuple[int, int, int], tokens: int, seed: int):
    """A page-aligned bf16 [L, 2, tokens, H, D] tensor (docs/performance.md: alignment)."""
    import mmap

    import numpy as np
    import torch

    L, H, D = shape
    n = L * 2 * tokens * H * D
    mm = mmap.mmap(-1, n * 2)
    buf = np.frombuffer(mm, dtype=np.int16, count=n)
    buf[:] = np.random.default_rng(seed).integers(-2**15, 2**15, n, dtype=np.int16)
    return torch.from_numpy(buf).view(torch.bfloat16).view(L, 2, tokens, H, D)


def _summary(stores: list[float], loads: list[float], nbytes: int) -> dict:
    st, ld = statistics.median(stores), statistics.median(loads)
    return {"store_s": st, "load_s": ld, "store_gbps": nbytes / st / 1e9,
            "load_gbps": nbytes / ld / 1e9, "bytes": nbytes}


# ------------------------------------------------------------------------------ kvstore side

def bench_kvstore(address: str, name: str, nblocks: int, rounds: int) -> dict:
    import kvstore_client
    import numpy as np
    import torch
    from kvstore_client import KVLayout

    lay = KVLayout(*WORKLOADS[name], T, "bfloat16")
    kv = _engine_tensor(WORKLOADS[name], nblocks * T, 1)
    out = _engine_tensor(WORKLOADS[name], nblocks * T, 2)
    stores, loads = [], []
    with kvstore_client.connect(address, transport="shm", verify=True) as c:
        ns = c.namespace(lay, model=f"bench/peers/{name}")
        # A client that has run a while: its mapping of the pool populated (the SDK does it in
        # the background at connect, kvstore_client/common/prefault.py), as LMCache's buffers are
        # touched by its round 0.
        if c.pool is not None and c.pool._prefaulter is not None:
            c.pool._prefaulter.join(60)
        for r in range(rounds + 1):              # round 0 warms pages, buffers, the kernel
            ids = np.random.default_rng(200 + r).integers(0, 50_000, nblocks * T)
            t0 = time.perf_counter()
            stored = ns.store(ids, kv)
            t1 = time.perf_counter()
            got = ns.load(ids, out=out)
            t2 = time.perf_counter()
            if stored != nblocks or got != nblocks * T:
                raise RuntimeError(f"kvstore {name}: stored {stored}, loaded {got} tokens")
            if r == 0 and not torch.equal(out.view(torch.int16), kv.view(torch.int16)):
                raise RuntimeError(f"kvstore {name}: loaded bytes differ")
            ns.delete(ns.keys(ids))
            if r:
                stores.append(t1 - t0)
                loads.append(t2 - t1)
        if c.counters["checksum_failures"]:
            raise RuntimeError(f"kvstore {name}: checksum failures {c.counters}")
    return _summary(stores, loads, nblocks * lay.block_bytes)


# ------------------------------------------------------------------------------ LMCache side

def lmcache_worker(name: str, nblocks: int, rounds: int) -> None:
    """Runs inside LMCache's venv: prints one JSON line with the same figures."""
    import logging

    import torch
    logging.disable(logging.WARNING)
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
    from lmcache.v1.metadata import LMCacheMetadata

    L, H, D = WORKLOADS[name]
    kv = _engine_tensor(WORKLOADS[name], nblocks * T, 1)
    out = _engine_tensor(WORKLOADS[name], nblocks * T, 2)
    nbytes = kv.numel() * 2

    class CopyingConnector(GPUConnectorInterface):
        """Copies chunks between the engine tensor and LMCache's memory objects, as a GPU
        connector does (LMCache's MockGPUConnector copies nothing)."""

        def __init__(self) -> None:
            self.src = kv

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([L, 2, num_tokens, H, D])

        # LMCache keeps a chunk as KV_2LTD: [2, L, tokens, H*D]; one copy_ per chunk and
        # direction, as a GPU connector's one kernel launch per chunk.
        def from_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
            memory_obj.tensor.view(2, L, end - start, H, D).transpose(0, 1).copy_(
                self.src[:, :, start:end])

        def to_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
            self.src[:, :, start:end].copy_(
                memory_obj.tensor.view(2, L, end - start, H, D).transpose(0, 1))

        def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
            for m, s, e in zip(memory_objs, starts, ends, strict=True):
                self.from_gpu(m, s, e)

        def batched_to_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
            for m, s, e in zip(memory_objs, starts, ends, strict=True):
                self.to_gpu(m, s, e)

        def initialize_kvcaches_ptr(self, **kwargs) -> None:
            pass

    gib = 2.5 * nbytes / 2**30 + 0.5
    config = LMCacheEngineConfig.from_defaults(chunk_size=T, local_cpu=True,
                                               max_local_cpu_size=gib, save_unfull_chunk=False)
    meta = LMCacheMetadata(model_name=f"bench/{name}", world_size=1, local_world_size=1,
                           worker_id=0, local_worker_id=0, kv_dtype=torch.bfloat16,
                           kv_shape=(L, 2, T, H, D), role="worker")
    conn = CopyingConnector()
    engine = LMCacheEngineBuilder.get_or_create(
        f"bench-{name}", config, meta, conn, lambda *a, **k: None, lambda *a, **k: None)
    if hasattr(engine, "post_init"):
        engine.post_init()
    import numpy as np

    def one_round(seed: int) -> tuple[float, float, int]:
        ids = torch.from_numpy(np.random.default_rng(seed).integers(0, 50_000, nblocks * T))
        conn.src = kv
        t0 = time.perf_counter()
        engine.store(ids)
        t1 = time.perf_counter()
        conn.src = out
        got = int(engine.retrieve(ids).sum())
        t2 = time.perf_counter()
        engine.clear()
        return t1 - t0, t2 - t1, got

    # Give LMCache its best thread setting: torch's intra-op threads help an idle machine and
    # spin-wait badly on a busy one (one 128 KiB copy_ measured 6 us on 1 thread, 12 ms on 2).
    tried = {}
    for threads in sorted({torch.get_num_threads(), 1}):
        torch.set_num_threads(threads)
        st, ld, _ = one_round(100 + threads)
        tried[threads] = st + ld
    best = min(tried, key=tried.__getitem__)
    torch.set_num_threads(best)
    stores, loads = [], []
    for r in range(rounds + 1):
        ids = torch.from_numpy(np.random.default_rng(200 + r).integers(0, 50_000, nblocks * T))
        conn.src = kv
        t0 = time.perf_counter()
        engine.store(ids)
        t1 = time.perf_counter()
        conn.src = out
        mask = engine.retrieve(ids)
        t2 = time.perf_counter()
        got = int(mask.sum())
        if got != nblocks * T:
            raise RuntimeError(f"LMCache {name}: retrieved {got}/{nblocks * T} tokens")
        if r == 0 and not torch.equal(out.view(torch.int16), kv.view(torch.int16)):
            raise RuntimeError(f"LMCache {name}: retrieved bytes differ")
        engine.clear()
        if r:
            stores.append(t1 - t0)
            loads.append(t2 - t1)
    LMCacheEngineBuilder.destroy(f"bench-{name}")
    res = _summary(stores, loads, nbytes)
    res["torch_threads"] = best
    print("LMCACHE_RESULT " + json.dumps(res), flush=True)


def _lmcache_python(arg: str | None) -> str | None:
    for cand in (arg, os.environ.get("KVSTORE_LMCACHE_PYTHON"),
                 str(ROOT / ".venv-lmcache" / "bin" / "python")):
        if cand and Path(cand).exists():
            return cand
    return None


def run_lmcache(py: str, name: str, nblocks: int, rounds: int) -> dict:
    env = {**os.environ, **MALLOC_ENV, "LMCACHE_TRACK_USAGE": "false",
           "LMCACHE_LOG_LEVEL": "ERROR"}
    env.pop("PYTHONPATH", None)
    p = subprocess.run([py, __file__, "--lmcache-worker", name, "--blocks", str(nblocks),
                        "--rounds", str(rounds)], capture_output=True, text=True, env=env,
                       timeout=900)
    for line in p.stdout.splitlines():
        if line.startswith("LMCACHE_RESULT "):
            return json.loads(line[len("LMCACHE_RESULT "):])
    tail = (p.stderr or p.stdout).strip().splitlines()[-5:]
    raise RuntimeError(f"LMCache worker failed (exit {p.returncode}): " + " | ".join(tail))


def _lmcache_importable(py: str) -> str | None:
    """None when `py` can import LMCache, else why not (one line)."""
    p = subprocess.run([py, "-c", "import lmcache.v1.cache_engine"], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONPATH": "",
                                                    "LMCACHE_TRACK_USAGE": "false"})
    if p.returncode == 0:
        return None
    lines = (p.stderr or p.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit {p.returncode}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller run, about a minute")
    ap.add_argument("--lmcache-python", help="python of a venv with lmcache installed")
    ap.add_argument("--lmcache-worker", help=argparse.SUPPRESS)
    ap.add_argument("--blocks", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per system (3)")
    args = ap.parse_args()
    if args.lmcache_worker:
        lmcache_worker(args.lmcache_worker, args.blocks, args.rounds)
        return
    missing = {k: v for k, v in MALLOC_ENV.items() if k not in os.environ}
    if missing and "_KVS_BENCH_REEXEC" not in os.environ:
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, **missing, "_KVS_BENCH_REEXEC": "1"})
    sys.path.insert(0, str(ROOT))
    from kvstore_client.blockcopy import kernel_status

    from tests.daemon import cleanup, start_daemon

    blocks = _blocks(args.quick)
    result: dict = {"bench": "peers", "quick": args.quick, "rounds": args.rounds,
                    "blocks": blocks, "copy_kernel": kernel_status()}
    py = _lmcache_python(args.lmcache_python)
    why = "no LMCache venv (README, Benchmarks)" if py is None else _lmcache_importable(py)
    if why:
        print(f"peers: LMCache not available, skipping its side: {why}")
    result["lmcache"] = None if why else {"python": "given" if args.lmcache_python else "found"}
    pool = max(1 << 30, int(2.2 * max(n * 2 * T * 2 * (WORKLOADS[k][0] * WORKLOADS[k][1]
                                                    * WORKLOADS[k][2])
                                      for k, n in blocks.items())))
    with tempfile.TemporaryDirectory(prefix="kvs-bench-peers-") as d:
        daemon = start_daemon(Path(d) / "daemon", {
            "host.capacity": str(pool), "ssd.capacity": "1GiB"}, env=dict(MALLOC_ENV))
        try:
            for name, n in blocks.items():
                result[f"kvstore_{name}"] = bench_kvstore(daemon.address, name, n, args.rounds)
        finally:
            cleanup(daemon)
    for name, n in blocks.items():
        if not why:
            lm = result[f"lmcache_{name}"] = run_lmcache(py, name, n, args.rounds)
            kv = result[f"kvstore_{name}"]
            result[f"vs_lmcache_store_{name}"] = round(kv["store_gbps"] / lm["store_gbps"], 3)
            result[f"vs_lmcache_load_{name}"] = round(kv["load_gbps"] / lm["load_gbps"], 3)
        else:
            result[f"vs_lmcache_store_{name}"] = result[f"vs_lmcache_load_{name}"] = None
    figures = [f"vs_lmcache_{op}_{name}" for name in blocks for op in ("store", "load")]
    result["targets_met"] = {f: (result[f] >= 1.0 if result[f] is not None else None)
                             for f in figures}
    print(f"{'workload':10} {'kvstore store/load GB/s':>26} {'LMCache store/load GB/s':>26}")
    for name in blocks:
        kv = result[f"kvstore_{name}"]
        lm = result.get(f"lmcache_{name}")
        lms = f"{lm['store_gbps']:.2f} / {lm['load_gbps']:.2f}" if lm else "skipped"
        print(f"{name:10} {kv['store_gbps']:>12.2f} / {kv['load_gbps']:<11.2f} {lms:>26}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
