"""Drives vLLM's real tiering manager with kvstore's tier, for tests/test_vllm_manager.py.

Runs under the vLLM environment (`.venv-vllm`), never under pytest, as tests/vllm_engine.py does.
It builds what vLLM's scheduler builds from `kv_transfer_config` — an `OffloadingConfig`, vLLM's
`TieringOffloadingSpec`, its `TieringOffloadingManager` with a small CPU primary tier and
`KVStoreTier` as the secondary tier, loaded by `module_path` through vLLM's tier factory — and
calls the manager as vLLM's offloading connector does (on_new_request, prepare_store /
complete_store, lookup, prepare_load / complete_load, on_schedule_end once per step), the way
vLLM's own tests/v1/kv_offload/tiering tests drive it. Nothing of vLLM or kvstore is replaced;
the runner only plays the engine worker (writing chunk bytes into the primary tier) and records
the job results the manager consumes.

    python tests/vllm_manager.py --address unix:/path/kvs.sock --out FILE [--daemon-pid PID]

Prints one JSON object as its last line (and writes it to --out): per scenario, what the engine
saw. A scenario that raises is recorded with its traceback, never hides the others.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import numpy as np  # noqa: E402

CHUNK_BYTES = 40_000        # KV bytes per chunk; not page-aligned, so rows carry padding
BLOCK_TOKENS = 32
PRIMARY_CHUNKS = 8          # a small primary tier, so a few stores evict it
STEP_S = 0.01


def _unlink_region(mgr: Any) -> None:
    region = mgr.primary_tier._mmap_region
    if region._creator:
        os.unlink(region.mmap_path)
        region._creator = False


class Capture(logging.Handler):
    """Keeps the tier's log records, to count what an operator would see."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def lines(self, level: int) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == level]


class Engine:
    """One engine's scheduler-side offloading stack, built by vLLM's own spec and factory."""

    count = 0

    def __init__(self, address: str, *, primary_chunks: int = PRIMARY_CHUNKS,
                 parallel: dict[str, Any] | None = None, config: dict[str, Any] | None = None,
                 dtype: str = "float32", **tier: Any) -> None:
        """parallel / config: OffloadingParallelConfig / OffloadingConfig fields to override
        (a chunk is CHUNK_BYTES whatever the topology: each worker's share of it, or one copy
        when the layout is replicated); tier: the tier's settings."""
        from vllm.v1.kv_offload.config import (
            OffloadingCacheConfig,
            OffloadingConfig,
            OffloadingGroupConfig,
            OffloadingModelConfig,
            OffloadingParallelConfig,
        )
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        Engine.count += 1
        self.name = f"kvs{os.getpid()}x{Engine.count}"
        stride = -(-CHUNK_BYTES // 4096) * 4096
        tier_cfg = {"type": "KVStoreTier", "module_path": "kvstore_client.vllm.tier",
                    "address": address, "lookup_deadline_s": 2.0, "timeout_s": 5.0, **tier}
        self.extra = {"cpu_bytes_to_use": primary_chunks * stride, "secondary_tiers": [tier_cfg]}
        par = dict(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                   data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                   is_parallelism_agnostic=False)
        par.update(parallel or {})
        fields: dict[str, Any] = dict(
            groups=(OffloadingGroupConfig(tokens_per_block=BLOCK_TOKENS,
                                          layer_names=("model.layers.0.self_attn.attn",),
                                          group_id=0),),
            worker_kv_bytes_per_block=CHUNK_BYTES, enable_kv_cache_events=False,
            extra_config=self.extra, engine_id=self.name,
            model=OffloadingModelConfig(name="kvstore-test/manager-model", dtype=dtype),
            cache=OffloadingCacheConfig(tokens_per_hash=BLOCK_TOKENS, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(**par), kv_cache_layout="NHD")
        fields.update(config or {})
        copies = 1 if fields.get("replicated_layout") else par["world_size"]
        fields["worker_kv_bytes_per_block"] = CHUNK_BYTES // copies
        cfg = OffloadingConfig(**fields)
        self.spec_cls = TieringOffloadingSpec
        self.spec = TieringOffloadingSpec(cfg)
        self.mgr = self.spec.get_manager()
        # Only this process maps the primary tier: drop its name at once, so no exit path
        # (os._exit, a crash) leaves it in /dev/shm.
        _unlink_region(self.mgr)
        self.tier = self.mgr.secondary_tiers[0]
        self.view = np.asarray(self.mgr.primary_tier.get_kv_memoryview()).view(np.uint8)
        self.jobs: list[dict[str, Any]] = []
        self.exceptions: list[str] = []
        self._req = 0
        finished = self.tier.get_finished_jobs

        def record() -> list[Any]:      # observe what the manager consumes, unchanged
            done = list(finished())
            for r in done:
                self.jobs.append({"job_id": r.job_id, "success": bool(r.success),
                                  "successful_keys": None if r.successful_keys is None
                                  else [bytes(k).hex() for k in r.successful_keys],
                                  "bytes": r.transfer_bytes})
            return done
        self.tier.get_finished_jobs = record

    # -- the calls vLLM's connector makes -------------------------------------------------------
    def ctx(self) -> Any:
        from vllm.v1.kv_offload.base import ReqContext
        self._req += 1
        c = ReqContext(req_id=f"{self.name}-r{self._req}")
        self.mgr.on_new_request(c)
        return c

    def step(self) -> None:
        from vllm.v1.kv_offload.base import ScheduleEndContext
        self.mgr.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def store(self, keys: list[bytes], data: dict[bytes, bytes]) -> int:
        """What the worker does for a request's computed blocks: GPU -> primary, then the
        manager cascades them into the secondary tier."""
        c = self.ctx()
        out = self.mgr.prepare_store(keys, c)
        if out is None:
            raise RuntimeError("the primary tier refused the store")
        for k, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
            self.view[int(chunk), :CHUNK_BYTES] = np.frombuffer(data[k], np.uint8)
        if out.keys_to_store:       # vLLM's worker completes only stores it was given
            self.mgr.complete_store(out.keys_to_store, c)
        self.mgr.on_request_finished(c)
        self.step()
        return len(out.keys_to_store)

    def settle(self, deadline_s: float = 30.0) -> bool:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            self.step()
            if not self.mgr.has_pending_work():
                return True
            time.sleep(STEP_S)
        return False

    def in_primary(self, keys: list[bytes]) -> list[str]:
        c = self.ctx()
        out = [self.mgr.primary_tier.lookup(k, c).name for k in keys]
        self.mgr.on_request_finished(c)
        return out

    def lookup_until(self, keys: list[bytes], deadline_s: float, *,
                     stop: str = "HIT", min_s: float = 0.0) -> dict[str, Any]:
        """Scan the keys each step, as the scheduler scans a waiting request, until every key
        answers `stop` (or the deadline). Returns each key's distinct answers in order, the
        seconds until its first `stop` answer, and `retry_s`: the latest a key still answered
        RETRY before that, in seconds after its first answer (at most what the tier measured
        against its lookup deadline, whatever the load: from the end of the first call to the
        start of the later one)."""
        c = self.ctx()
        seqs: dict[bytes, list[str]] = {k: [] for k in keys}
        first: dict[bytes, float] = {}
        asked: dict[bytes, float] = {}
        retry: dict[bytes, float] = {}
        t0 = time.monotonic()
        end = t0 + deadline_s
        while True:
            now = time.monotonic()
            for k in keys:
                if k in first and stop == "HIT":
                    continue
                t_call = time.monotonic()
                try:
                    r = self.mgr.lookup(k, c).name
                except Exception:
                    self.exceptions.append(traceback.format_exc())
                    r = "EXCEPTION"
                asked.setdefault(k, time.monotonic())
                if r == "RETRY" and k not in first:
                    retry[k] = max(0.0, t_call - asked[k])
                if not seqs[k] or seqs[k][-1] != r:
                    seqs[k].append(r)
                if r == stop and k not in first:
                    first[k] = now - t0
            self.step()
            done = len(first) == len(keys) and now - t0 >= min_s
            if done or now > end:
                break
            time.sleep(STEP_S)
        self.mgr.on_request_finished(c)
        self.settle(10.0)
        return {"answers": [seqs[k] for k in keys],
                "first_s": [first.get(k) for k in keys],
                "retry_s": [retry.get(k, 0.0) for k in keys]}

    def read(self, keys: list[bytes]) -> list[bytes]:
        """What the worker loads into the engine: the primary tier's bytes of HIT chunks."""
        c = self.ctx()
        spec = self.mgr.prepare_load(keys, c)
        out = [self.view[int(ch), :CHUNK_BYTES].tobytes() for ch in spec.chunk_ids]
        self.mgr.complete_load(keys, c)
        self.mgr.on_request_finished(c)
        return out

    def stats(self) -> dict[str, Any]:
        return self.tier.stats()

    def close(self) -> None:
        try:
            self.settle(10.0)
        finally:
            self.view = None        # vLLM closes the primary tier's mmap: no views may remain
            self.mgr.shutdown()


# -- keys and bytes ------------------------------------------------------------------------------

def keys_for(tokens: list[int], algo: str = "sha256") -> list[bytes]:
    """vLLM's own offload keys for a prompt: its chained block hashes + KV group 0."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.kv_offload.base import make_offload_key

    fn = get_hash_fn_by_name(algo)
    parent = kcu.NONE_HASH
    out = []
    for i in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        parent = kcu.hash_block_tokens(fn, parent, tuple(tokens[i:i + BLOCK_TOKENS]), None)
        out.append(make_offload_key(bytes(parent), 0))
    return out


def prompt(seed: int, blocks: int) -> tuple[list[bytes], dict[bytes, bytes]]:
    rng = np.random.default_rng(seed)
    keys = keys_for([int(t) for t in rng.integers(3, 8000, blocks * BLOCK_TOKENS)])
    return keys, {k: rng.integers(0, 256, CHUNK_BYTES, dtype=np.uint8).tobytes() for k in keys}


def evict_primary(e: Engine, seed: int) -> None:
    """Fill the primary tier with other chunks, as later requests would."""
    keys, data = prompt(seed, PRIMARY_CHUNKS)
    e.store(keys, data)
    e.settle()


def daemon_client(address: str) -> Any:
    import kvstore_client
    return kvstore_client.connect(address, timeout=10.0)


def _locate(e: Engine, keys: list[bytes]) -> list[str | None]:
    from kvstore_client.vllm.keyspace import fold_key
    return e.tier._namespace().locate([fold_key(k) for k in keys])


def _hex(keys: list[bytes]) -> list[str]:
    return [bytes(k).hex() for k in keys]


# -- scenarios -----------------------------------------------------------------------------------

def sc_cascade_promote(args: argparse.Namespace) -> dict[str, Any]:
    """Store -> cascade -> primary eviction -> lookup -> promotion -> HIT, in the storing
    engine and in a second engine that never saw the blocks."""
    keys, data = prompt(1, 6)
    a = Engine(args.address)
    b = None
    try:
        stored = a.store(keys, data)
        settled = a.settle()
        store_jobs = list(a.jobs)
        evict_primary(a, 101)
        evicted = a.in_primary(keys)
        where = _locate(a, keys)
        again = a.lookup_until(keys, 20.0)
        a_equal = a.read(keys) == [data[k] for k in keys] if all(
            s is not None for s in again["first_s"]) else False
        b = Engine(args.address)
        fresh = b.lookup_until(keys, 20.0)
        b_bytes = b.read(keys) if all(s is not None for s in fresh["first_s"]) else []
        stats = b.mgr.get_stats()
        values = {}
        if stats is not None:
            for name, by_label in stats.data.get("data", {}).items():
                values[name] = sum(v for v in by_label.values() if isinstance(v, int | float))
        defs = sorted(a.spec_cls.build_metric_definitions(a.extra))
        return {"stored": stored, "settled": settled, "store_jobs": store_jobs,
                "evicted_from_primary": evicted, "daemon_where": where,
                "a_answers": again, "a_bytes_equal": a_equal,
                "b_answers": fresh, "b_bytes_equal": b_bytes == [data[k] for k in keys],
                "b_jobs": b.jobs, "a_tier": a.stats(), "b_tier": b.stats(),
                "stats_type": type(stats).__name__, "stats_values": values,
                "metric_definitions": defs,
                "exceptions": a.exceptions + b.exceptions}
    finally:
        a.close()
        if b is not None:
            b.close()


def sc_ssd(args: argparse.Namespace) -> dict[str, Any]:
    """Blocks the daemon demoted to SSD answer RETRY while it promotes them, then HIT."""
    keys, data = prompt(2, 6)
    a = Engine(args.address)
    c = None
    client = daemon_client(args.address)
    try:
        a.store(keys, data)
        a.settle()
        before = client.stats()["counters"]
        freed, blocks = client.evict("host")
        where = _locate(a, keys)
        c = Engine(args.address)
        seen = c.lookup_until(keys, 30.0)
        ok = all(s is not None for s in seen["first_s"])
        got = c.read(keys) if ok else []
        after = client.stats()["counters"]
        return {"evicted_blocks": blocks, "where_after_evict": where, "answers": seen,
                "bytes_equal": got == [data[k] for k in keys], "tier": c.stats(),
                "jobs": c.jobs, "prefetched": after.get("prefetched_blocks", 0)
                - before.get("prefetched_blocks", 0),
                "where_after_load": _locate(a, keys),
                "exceptions": a.exceptions + c.exceptions}
    finally:
        client.close()
        a.close()
        if c is not None:
            c.close()


def sc_corrupt(args: argparse.Namespace) -> dict[str, Any]:
    """A block whose bytes changed in the daemon's host pool comes back as a failed job whose
    successful keys exclude it; its bytes never become a HIT."""
    from kvstore_client._proto import kvstore_pb2 as pb
    from kvstore_client.vllm.keyspace import fold_key

    keys, data = prompt(3, 6)
    bad = 3
    a = Engine(args.address)
    d = None
    client = daemon_client(args.address)
    try:
        a.store(keys, data)
        a.settle()
        ns_id = a.tier._namespace().ns_id
        # Any same-uid client maps the pool; the read lease says where the block lives.
        lease = client.call("Acquire", pb.AcquireRequest(
            namespace_id=ns_id, keys=[fold_key(keys[bad])], tier="host", ttl_s=30)).lease
        off = int(lease.slots[0].offset)
        pool = _map_pool(client, a)
        pool[off:off + 64] ^= 0xFF
        client.release(lease.lease_id)
        d = Engine(args.address)
        seen = d.lookup_until(keys, 3.0)
        hits = [k for k, s in zip(keys, seen["first_s"], strict=True) if s is not None]
        got = d.read(hits) if hits else []
        where = _locate(a, keys)
        # The engine recomputes what it could not load and stores it again; a third engine
        # then finds the whole prompt, with the right bytes.
        in_primary = d.in_primary(keys)
        d.store(keys[len(hits):], data)
        d.settle()
        e = Engine(args.address)
        again = e.lookup_until(keys, 10.0)
        ok = all(s is not None for s in again["first_s"])
        fixed = ok and e.read(keys) == [data[k] for k in keys]
        e.close()
        return {"bad_index": bad, "keys": _hex(keys), "answers": seen,
                "hit_keys": _hex(hits), "hit_bytes_equal": got == [data[k] for k in hits],
                "jobs": d.jobs, "tier": d.stats(), "daemon_where_after": where,
                "in_primary_before_recompute": in_primary,
                "checksum_failures": d.tier._client.counters["checksum_failures"],
                "after_recompute": again, "after_recompute_bytes_equal": fixed,
                "exceptions": a.exceptions + d.exceptions + e.exceptions}
    finally:
        client.close()
        a.close()
        if d is not None:
            d.close()


def _map_pool(client: Any, e: Engine) -> np.ndarray:
    """The daemon's host pool, mapped by this separate client (as the SDK maps it)."""
    client.register(e.tier._namespace().spec)
    if client.pool is None:
        raise RuntimeError("the daemon's host pool is not mappable from this process")
    return client.pool.slab.array


def sc_down(args: argparse.Namespace) -> dict[str, Any]:
    """A daemon that is not there: lookups MISS within the deadline, stores fail as jobs."""
    keys, data = prompt(4, 4)
    folder = tempfile.mkdtemp(prefix="kvs-gone-")
    e = Engine(f"unix:{os.path.join(folder, 'none.sock')}", lookup_deadline_s=0.5, timeout_s=1.0)
    try:
        e.store(keys, data)
        settled = e.settle(20.0)
        evict_primary(e, 104)
        t0 = time.monotonic()
        seen = e.lookup_until(keys, 5.0, stop="MISS")
        return {"settled": settled, "jobs": e.jobs, "answers": seen,
                "elapsed_s": time.monotonic() - t0, "deadline_s": 0.5, "tier": e.stats(),
                "exceptions": e.exceptions}
    finally:
        e.close()
        shutil.rmtree(folder, ignore_errors=True)


def sc_hung(args: argparse.Namespace) -> dict[str, Any]:
    """A daemon that stops answering mid-run (SIGSTOP): the promotion already under way fails
    as a job, lookups of another engine MISS within their deadline, nothing raises."""
    if not args.daemon_pid:
        return {"skipped": "no --daemon-pid"}
    keys, data = prompt(5, 4)
    e = Engine(args.address, lookup_deadline_s=0.5, timeout_s=1.0)
    f = Engine(args.address, lookup_deadline_s=0.5, timeout_s=1.0)
    f.tier._namespace()             # connected and registered before the daemon stops
    stopped = False
    try:
        e.store(keys, data)
        e.settle()
        evict_primary(e, 105)
        c = e.ctx()
        first = [e.mgr.lookup(k, c).name for k in keys]   # the tier knows them: promotion
        os.kill(args.daemon_pid, signal.SIGSTOP)
        stopped = True
        t0 = time.monotonic()
        e.step()                                            # submits the promotion job
        e.mgr.on_request_finished(c)
        settled = e.settle(20.0)
        promote_s = time.monotonic() - t0
        other, _ = prompt(6, 3)
        t1 = time.monotonic()
        seen = f.lookup_until(other, 5.0, stop="MISS")
        miss_s = time.monotonic() - t1
        in_primary = e.in_primary(keys)
        # The lookups' Locate may have been answered just before the stop, its blocks pinned
        # for this engine; then the promotion needs no more of the daemon and may succeed.
        # What it loaded must then be the stored bytes.
        loaded = (e.read(keys) == [data[k] for k in keys]
                  if e.jobs and e.jobs[-1]["success"] and in_primary == ["HIT"] * len(keys)
                  else None)
        return {"first": first, "settled": settled, "promote_fail_s": promote_s,
                "jobs": e.jobs, "other_answers": seen, "other_elapsed_s": miss_s,
                "deadline_s": 0.5, "timeout_s": 1.0, "in_primary": in_primary,
                "loaded_bytes_equal": loaded, "exceptions": e.exceptions + f.exceptions}
    finally:
        if stopped:
            os.kill(args.daemon_pid, signal.SIGCONT)
        e.close()
        f.close()


def sc_process_random(args: argparse.Namespace) -> dict[str, Any]:
    """An engine whose block hashes are seeded per process (xxhash, PYTHONHASHSEED unset) is
    refused with one clear line; allow_process_local runs it privately, said loudly."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    if os.environ.get("PYTHONHASHSEED") is not None:
        return {"skipped": "PYTHONHASHSEED is set"}
    kcu.init_none_hash(get_hash_fn_by_name("xxhash"))
    cap = Capture()
    log = logging.getLogger("kvstore.vllm")
    log.addHandler(cap)
    rng = np.random.default_rng(7)
    keys = keys_for([int(t) for t in rng.integers(3, 8000, 4 * BLOCK_TOKENS)], "xxhash")
    data = {k: rng.integers(0, 256, CHUNK_BYTES, dtype=np.uint8).tobytes() for k in keys}
    out: dict[str, Any] = {}
    e = Engine(args.address)
    try:
        e.store(keys, data)
        e.settle()
        evict_primary(e, 107)
        seen = e.lookup_until(keys, 5.0, stop="MISS")
        out["refused"] = {"jobs": e.jobs, "answers": seen, "tier": e.stats(),
                          "errors": cap.lines(logging.ERROR),
                          "exceptions": e.exceptions}
    finally:
        e.close()
    cap.records.clear()
    p = Engine(args.address, allow_process_local=True)
    q = None
    try:
        p.store(keys, data)
        p.settle()
        evict_primary(p, 108)
        seen = p.lookup_until(keys, 20.0)
        ok = all(s is not None for s in seen["first_s"])
        q = Engine(args.address, allow_process_local=True)
        other = q.lookup_until(keys, 5.0, stop="MISS")
        out["process_local"] = {"jobs": p.jobs, "answers": seen,
                                "bytes_equal": ok and p.read(keys) == [data[k] for k in keys],
                                "warnings": cap.lines(logging.WARNING),
                                "errors": cap.lines(logging.ERROR),
                                "other_engine_answers": other,
                                "namespaces": [p.stats()["namespace"], q.stats()["namespace"]],
                                "exceptions": p.exceptions + q.exceptions}
    finally:
        p.close()
        if q is not None:
            q.close()
        log.removeHandler(cap)
    return out


# The hash-seed scenario re-seeds vLLM's hash chain for the whole process: it runs last.
def sc_batched(args: argparse.Namespace) -> dict[str, Any]:
    """Jobs submitted together (as vLLM submits a step's requests) share one store or load;
    each still gets its own result. A load whose verified prefix ends inside one job fails
    that job with the keys before the gap, and the jobs after it are loaded all the same."""
    from kvstore_client.vllm.keyspace import fold_key
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    prompts = [prompt(60 + j, 3) for j in range(3)]
    e = Engine(args.address, primary_chunks=20)
    t = e.tier
    try:
        def run_jobs(first_chunk: int, promotion: bool, base_id: int) -> list[dict[str, Any]]:
            jobs = [TransferJob(job_id=base_id + j, keys=keys,
                                chunk_ids=np.arange(first_chunk + 3 * j, first_chunk + 3 * j + 3),
                                is_promotion=promotion, req_context=ReqContext(req_id=f"b{j}"))
                    for j, (keys, _) in enumerate(prompts)]
            for job in jobs:
                (t.submit_load if promotion else t.submit_store)(job)
            end = time.monotonic() + 30
            while len([j for j in e.jobs if j["job_id"] >= base_id]) < len(jobs) \
                    and time.monotonic() < end:
                t.get_finished_jobs()
                time.sleep(STEP_S)
            return sorted((j for j in e.jobs if j["job_id"] >= base_id),
                          key=lambda j: j["job_id"])

        for j, (keys, data) in enumerate(prompts):
            for i, k in enumerate(keys):
                e.view[3 * j + i, :CHUNK_BYTES] = np.frombuffer(data[k], np.uint8)
        stored = run_jobs(0, False, 1000)
        gap = prompts[1][0][1]                              # the middle job's second chunk
        t._namespace().delete([fold_key(gap)])
        e.view[10:19] = 0
        loaded = run_jobs(10, True, 2000)
        equal = [[e.view[10 + 3 * j + i, :CHUNK_BYTES].tobytes() == data[k]
                  for i, k in enumerate(keys)] for j, (keys, data) in enumerate(prompts)]
        return {"stored": stored, "loaded": loaded, "equal": equal, "tier": t.stats(),
                "keys": [_hex(keys) for keys, _ in prompts], "exceptions": e.exceptions}
    finally:
        e.close()


SCENARIOS = {"cascade_promote": sc_cascade_promote, "ssd": sc_ssd, "corrupt": sc_corrupt,
             "down": sc_down, "hung": sc_hung, "batched": sc_batched,
             "process_random": sc_process_random}    # last: it reseeds vLLM's hashes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--out", default="")
    ap.add_argument("--daemon-pid", type=int, default=0)
    ap.add_argument("--only", default="", help="comma-separated scenario names")
    args = ap.parse_args()

    from kvstore_client.vllm.compat import check_vllm
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    logging.getLogger("kvstore").setLevel(logging.INFO)
    result: dict[str, Any] = {"vllm": check_vllm(), "scenarios": {}, "errors": {}}
    kcu.init_none_hash(get_hash_fn_by_name("sha256"))     # what the engine core does
    only = [s for s in args.only.split(",") if s]
    for name, fn in SCENARIOS.items():
        if only and name not in only:
            continue
        t0 = time.monotonic()
        try:
            result["scenarios"][name] = fn(args)
        except Exception:
            result["errors"][name] = traceback.format_exc()
        print(f"scenario {name}: {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    text = json.dumps(result, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)   # skip vLLM's slow interpreter teardown; the output is written


if __name__ == "__main__":
    main()
