"""vLLM figures: kvstore as vLLM's secondary tier, its transfers and an engine's TTFT.

Measured in one run against one daemon (a temporary one unless `--address` is given); the vLLM
parts run in the vLLM environment (`.venv-vllm`, or `--vllm-python`), each engine in a process
of its own (tests/vllm_engine.py):

- `tier_store_vs_memcpy`, `tier_load_vs_memcpy`: 64 chunks of 2 MiB moved between vLLM's
  primary tier and the daemon by KVStoreTier's submit_store / submit_load (4 jobs of 16 chunks,
  as per-request jobs arrive; copy, checksum, Reserve/Commit or Acquire/Release), until
  get_finished_jobs reports them, against a numpy memcpy of the same bytes in the same process,
  measured between the rounds. Best of the rounds; loaded bytes are checked equal to the stored.
- `vllm_ttft_speedup`: a random-weight Llama-style model, fp32 on CPU. Engine A serves a prompt
  (2,048 shared tokens + its own turn) and stores its blocks in kvstore; engine B, a new process
  with an empty prefix cache, serves the shared prefix + another turn: its time to first token
  without kvstore over its time with kvstore (lookups, promotion into vLLM's primary tier, load,
  prefill of the rest). Each engine first serves unrelated warm-up prompts. `vllm_cached_tokens`
  is B's `num_cached_tokens` with kvstore; `vllm_outputs_equal` whether B's greedy token with
  kvstore equals B's without. `vllm_ttft_vs_floor`: the TTFT of B without kvstore on another
  turn once the prefix is in its own prefix cache (what no external cache can beat) over B's
  TTFT with kvstore. `vllm_ttft_speedup_same_engine`: B with kvstore, full prefills of new
  prompts of the same length interleaved with the hits, over its hits (less exposed to the
  neighbours' load, which moves between processes). Medians over 3 shared prefixes with
  --quick (7 otherwise), each served by every engine in turn.

Usage: python bench/vllm.py [--quick] [--address A] [--vllm-python PY]. The last line is one
JSON object. `--quick` finishes in a few minutes on a 2-core machine.
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
from typing import Any

# This script is named like the `vllm` package: take its folder off the path, import by package.
_HERE = Path(__file__).resolve().parent
ROOT = _HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "client"))

import numpy as np  # noqa: E402

CHUNK_BYTES = 2 << 20
CHUNKS = 64
JOBS = 4
# The TTFT model: 8 layers, hidden 1024 (about 71 M parameters besides the embeddings, 340 MB
# on disk): a 2k-token prefill takes 3-9 s on 2 loaded cores, against about 0.7 s of fixed
# cost per engine step; the engine starts in well under a minute.
MODEL = {"layers": 8, "hidden": 1024, "heads": 16, "kv_heads": 4}
SHARED_TOKENS = 2048
TURN_TOKENS = 64
WARMUP_TOKENS = 256
RUN_DEADLINE_S = 600


def _unlink_region(mgr: Any) -> None:
    region = mgr.primary_tier._mmap_region
    if region._creator:
        os.unlink(region.mmap_path)
        region._creator = False


# -- in the vLLM environment: the tier's transfers --------------------------------------------

def _tier(address: str) -> tuple[Any, Any, np.ndarray]:
    """vLLM's tiering manager with KVStoreTier, built as vLLM builds it; (manager, tier, view)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    kcu.init_none_hash(get_hash_fn_by_name("sha256"))
    extra = {"cpu_bytes_to_use": 2 * CHUNKS * CHUNK_BYTES,
             "secondary_tiers": [{"type": "KVStoreTier",
                                  "module_path": "kvstore_client.vllm.tier",
                                  "address": address, "timeout_s": 30.0}]}
    cfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=32, layer_names=("layers.0.attn",),
                                      group_id=0),),
        worker_kv_bytes_per_block=CHUNK_BYTES, enable_kv_cache_events=False,
        extra_config=extra, engine_id=f"kvsbench{os.getpid()}",
        model=OffloadingModelConfig(name="kvstore-bench/vllm-tier", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False),
        kv_cache_layout="NHD")
    mgr = TieringOffloadingSpec(cfg).get_manager()
    # Only this process maps the primary tier: drop its name at once, so no exit path
    # (os._exit, a crash) leaves it in /dev/shm.
    _unlink_region(mgr)
    view = np.asarray(mgr.primary_tier.get_kv_memoryview()).view(np.uint8)
    return mgr, mgr.secondary_tiers[0], view


def _move(tier: Any, keys: list[bytes], chunks: np.ndarray, promotion: bool,
          first_id: int) -> float:
    """Submit the chunks as JOBS jobs, wait until the tier reports all finished; seconds."""
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    per = len(keys) // JOBS
    jobs = [TransferJob(job_id=first_id + j, keys=keys[j * per:(j + 1) * per],
                        chunk_ids=chunks[j * per:(j + 1) * per], is_promotion=promotion,
                        req_context=ReqContext(req_id=f"bench-{first_id + j}"))
            for j in range(JOBS)]
    t = time.perf_counter()
    for job in jobs:
        (tier.submit_load if promotion else tier.submit_store)(job)
    done: list[Any] = []
    end = time.monotonic() + 120
    while len(done) < JOBS:
        done += list(tier.get_finished_jobs())
        if time.monotonic() > end:
            raise RuntimeError(f"the tier finished {len(done)} of {JOBS} jobs in 120 s")
        time.sleep(0.0002)
    dt = time.perf_counter() - t
    bad = [r for r in done if not r.success]
    if bad:
        raise RuntimeError(f"{len(bad)} {'load' if promotion else 'store'} jobs failed; "
                           f"tier stats: {tier.stats()}")
    return dt


def tier_figures(address: str, rounds: int) -> dict[str, Any]:
    from vllm.v1.kv_offload.base import make_offload_key

    from bench.refs import memcpy_seconds

    mgr, tier, view = _tier(address)
    try:
        rng = np.random.default_rng(0)
        src = np.arange(CHUNKS, dtype=np.int32)
        dst = np.arange(CHUNKS, 2 * CHUNKS, dtype=np.int32)
        view[:CHUNKS, :CHUNK_BYTES] = rng.integers(0, 256, (CHUNKS, CHUNK_BYTES), np.uint8)
        total = CHUNKS * CHUNK_BYTES
        store_s, load_s, memcpy_s, job = [], [], [], 0
        ns = None
        for r in range(rounds + 1):                     # round 0 warms the pool and paths
            keys = [make_offload_key(rng.bytes(32), 0) for _ in range(CHUNKS)]
            s = _move(tier, keys, src, False, job)
            view[CHUNKS:] = 0
            ld = _move(tier, keys, dst, True, job + JOBS)
            job += 2 * JOBS
            if not np.array_equal(view[CHUNKS:, :CHUNK_BYTES], view[:CHUNKS, :CHUNK_BYTES]):
                raise RuntimeError("chunks loaded from kvstore differ from the stored ones")
            ns = tier._namespace()
            ns.delete([tier_key(k) for k in keys])      # keep the pool from filling up
            if r:
                store_s.append(s)
                load_s.append(ld)
                memcpy_s.append(memcpy_seconds(total, repeats=2))   # interleaved with the tier
        gb = total / 1e9
        memcpy_s = min(memcpy_s)
        return {"tier_store_vs_memcpy": round(memcpy_s / min(store_s), 3),
                "tier_load_vs_memcpy": round(memcpy_s / min(load_s), 3),
                "tier_store_gbps": round(gb / min(store_s), 2),
                "tier_load_gbps": round(gb / min(load_s), 2),
                "memcpy_gbps": round(gb / memcpy_s, 2),
                "tier_chunks": CHUNKS, "tier_chunk_bytes": CHUNK_BYTES,
                "tier_transport": ns.client.transport if ns is not None else None}
    finally:
        view = None
        mgr.shutdown()


def tier_key(offload_key: bytes) -> bytes:
    from kvstore_client.vllm.keyspace import fold_key
    return fold_key(offload_key)


# -- in the bench's environment: the daemon and the engines ------------------------------------

def vllm_python(arg: str) -> str:
    py = arg or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(py).exists():
        raise SystemExit(f"the vLLM environment's python {py} does not exist: `make vllm-env` "
                         "builds .venv-vllm; or pass --vllm-python")
    return py


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "client"), str(ROOT)])
    return env


def _run(cmd: list[str], what: str) -> None:
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=RUN_DEADLINE_S,
                       stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        raise RuntimeError(f"{what} failed (rc {p.returncode}):\n{p.stderr[-4000:]}")


def _engine(py: str, model: str, prompts: list[list[int]], folder: Path, name: str,
            address: str = "") -> dict[str, Any]:
    pfile, out = folder / f"{name}-prompts.json", folder / f"{name}-out.json"
    pfile.write_text(json.dumps(prompts))
    # A primary tier that holds a few prompts' chunks: with the default 64 MiB (128 chunks of
    # this model) promoted chunks were evicted again before the engine read them.
    cmd = [py, str(ROOT / "tests" / "vllm_engine.py"), "run", "--model", model, "--prompts",
           str(pfile), "--out", str(out), "--ttft", "--primary-mib", "256"]
    if address:
        cmd += ["--kvstore", address]
    _run(cmd, f"engine {name}")
    return json.loads(out.read_text())


def ttft_figures(py: str, address: str, model_dir: Path, folder: Path,
                 prefixes: int) -> dict[str, Any]:
    if not (model_dir / "config.json").exists():
        _run([py, str(ROOT / "tests" / "vllm_engine.py"), "model", str(model_dir),
              "--layers", str(MODEL["layers"]), "--hidden", str(MODEL["hidden"]),
              "--heads", str(MODEL["heads"]), "--kv-heads", str(MODEL["kv_heads"])], "model")
    rng = np.random.default_rng(17)

    def tokens(n: int) -> list[int]:
        return [int(t) for t in rng.integers(3, 8000, n)]

    def warmup() -> list[list[int]]:
        # A full prefill, then one on top of a cached prefix (vLLM's own prefix cache): the
        # first forward pass of each kind pays one-off costs that are no part of TTFT.
        w = tokens(WARMUP_TOKENS)
        return [w, w[:WARMUP_TOKENS - 32] + tokens(TURN_TOKENS)]
    shared = [tokens(SHARED_TOKENS) for _ in range(prefixes)]
    t = time.monotonic()
    a = _engine(py, str(model_dir), [*warmup(), *(p + tokens(TURN_TOKENS) for p in shared)],
                folder, "a", address)
    turns = [p + tokens(TURN_TOKENS) for p in shared]
    # B with kvstore: a new process, so each prefix can come from kvstore only. Each turn is
    # followed by a new prompt of the same length (a full prefill, kvstore finding nothing), so
    # the same process also gives TTFT without a hit, interleaved with the hits.
    fresh = [tokens(SHARED_TOKENS + TURN_TOKENS) for _ in shared]
    b_kv = _engine(py, str(model_dir), [*warmup(), *(x for pair in zip(turns, fresh, strict=True)
                                                    for x in pair)], folder, "b-kvstore", address)
    # B without kvstore; then each prefix once more with another turn, now in this engine's own
    # prefix cache: the floor, the TTFT no external cache can beat.
    b_none = _engine(py, str(model_dir),
                     [*warmup(), *turns, *(p + tokens(TURN_TOKENS) for p in shared)],
                     folder, "b-none")
    n = len(shared)
    kv, none = b_kv["results"][-2 * n::2], b_none["results"][-2 * n:-n]
    missed = b_kv["results"][-2 * n + 1::2]
    floor = b_none["results"][-n:]
    kv_m, none_m, floor_m = (statistics.median(r["ttft_s"] for r in x)
                             for x in (kv, none, floor))
    tier = b_kv.get("tier") or {}
    return {"vllm_ttft_speedup": round(none_m / kv_m, 2),
            "vllm_outputs_equal": [r["tokens"] for r in kv] == [r["tokens"] for r in none],
            "vllm_ttft_kvstore_s": round(kv_m, 3),
            "vllm_ttft_none_s": round(none_m, 3),
            "vllm_ttft_floor_s": round(floor_m, 3),
            "vllm_ttft_vs_floor": round(floor_m / kv_m, 2),
            "vllm_ttft_speedup_same_engine": round(
                statistics.median(r["ttft_s"] for r in missed) / kv_m, 2),
            "vllm_ttft_a_s": round(statistics.median(r["ttft_s"] for r in a["results"][-n:]), 3),
            "vllm_cached_tokens": min(r["cached"] for r in kv),
            "vllm_cached_tokens_none": max(r["cached"] for r in none),
            "vllm_shared_tokens": SHARED_TOKENS, "vllm_prompt_tokens": SHARED_TOKENS + TURN_TOKENS,
            "vllm_tier_loaded_chunks": tier.get("vllm:kvstore_loaded_chunks"),
            "vllm_prefixes": n,
            "vllm_engine_start_s": round(a["start_s"], 1),
            "vllm_model": f"{MODEL['layers']}x{MODEL['hidden']}",
            "vllm_engines_s": round(time.monotonic() - t, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    t = sub.add_parser("tier", help="(internal) the tier figures, in the vLLM environment")
    t.add_argument("--address", required=True)
    t.add_argument("--rounds", type=int, default=3)
    t.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--address", default="", help="a running daemon (default: start one)")
    ap.add_argument("--vllm-python", default="")
    ap.add_argument("--model-dir", default="", help="where the random model is kept "
                    "(default: bench/out/vllm-model-<size>, made once)")
    args = ap.parse_args()
    if args.cmd == "tier":
        res = tier_figures(args.address, args.rounds)
        Path(args.out).write_text(json.dumps(res))
        sys.stdout.flush()
        os._exit(0)     # skip vLLM's slow interpreter teardown; the output is written

    from kvstore_demo.chat import daemon_address

    py = vllm_python(args.vllm_python)
    model_dir = Path(args.model_dir or ROOT / "bench" / "out" /
                     f"vllm-model-{MODEL['layers']}x{MODEL['hidden']}")
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvs-bench-vllm-") as tmp, \
            daemon_address(args.address, {"host.capacity": "1GiB"}) as address:
        folder = Path(tmp)
        out = folder / "tier.json"
        _run([py, str(Path(__file__).resolve()), "tier", "--address", address,
              "--rounds", str(3 if args.quick else 10), "--out", str(out)], "tier figures")
        res.update(json.loads(out.read_text()))
        res.update(ttft_figures(py, address, model_dir, folder, 3 if args.quick else 7))
    print(f"{'figure':<28}{'value':>14}")
    for k, v in res.items():
        print(f"{k:<28}{v!s:>14}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
