"""kvstore as a secondary tier of vLLM's tiered KV offloading (`SecondaryTierManager`).

vLLM keeps its own primary tier of CPU chunks; this tier copies chunks between that primary
memory and the daemon's shared-memory host pool, so every engine on the node (and, through the
daemon's SSD and remote tiers, across restarts and nodes) reuses them.

Every method runs in vLLM's scheduler and returns at once: copies run on a small thread pool,
lookups are answered from a cache a background thread fills (lookups.py). Nothing here raises
into vLLM: a daemon that is down or slow turns lookups into misses within a deadline and jobs
into failed jobs; a load that fails part way, or a block that fails its checksum, comes back as
a failed job naming the keys that did load, and vLLM recomputes the rest.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
import weakref
from collections import Counter, OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from .compat import check_vllm

check_vllm()

# ruff: noqa: E402  (the version check must run before vLLM's modules are imported)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingMetricMetadata,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from .. import blockcopy, connect
from ..common.errors import KVStoreError, Unavailable
from . import identity, keyspace
from .lookups import HIT, MISS, Lookups

log = logging.getLogger("kvstore.vllm")

_RESULT = {HIT: LookupResult.HIT, MISS: LookupResult.MISS}
_DEFAULT_ADDRESS = "data/kvstore.sock"
# vLLM metric names this tier reports through get_stats().
M_LOOKUP_HITS = "vllm:kvstore_lookup_hit_chunks"
M_LOOKUP_MISSES = "vllm:kvstore_lookup_miss_chunks"
M_DEADLINE_MISSES = "vllm:kvstore_lookup_deadline_miss_chunks"
M_STORED = "vllm:kvstore_stored_chunks"
M_LOADED = "vllm:kvstore_loaded_chunks"
M_LOAD_FAILED = "vllm:kvstore_load_failed_chunks"
M_STORE_FAILED = "vllm:kvstore_store_failed_chunks"
_METRICS = {
    M_LOOKUP_HITS: "Chunks kvstore found in its host memory for a lookup.",
    M_LOOKUP_MISSES: "Chunks kvstore did not hold (or could not answer for) at a lookup.",
    M_DEADLINE_MISSES: "Lookups answered as misses because the daemon did not answer in time.",
    M_STORED: "Chunks copied from vLLM's primary tier into kvstore.",
    M_LOADED: "Chunks copied from kvstore into vLLM's primary tier, checksums verified.",
    M_LOAD_FAILED: "Chunks a load could not deliver (missing, corrupt, daemon unreachable).",
    M_STORE_FAILED: "Chunks a store could not deliver (daemon unreachable, full).",
}


# Keys announced in stored events whose removal the tier would report, at most this many (the
# oldest are forgotten first; a few MiB of the scheduler's memory).
MAX_ANNOUNCED = 1 << 16

_INSTANCES: weakref.WeakSet = weakref.WeakSet()
# A queued transfer: (job, folded keys, primary-tier chunk ids, submit time).
_Queued = tuple[TransferJob, list[bytes], list[int], float]


def instances() -> list[KVStoreTier]:
    """The tiers alive in this process, oldest first (for tests, benches and debugging)."""
    return sorted(_INSTANCES, key=lambda t: t._created)


class KVStoreTier(SecondaryTierManager):
    """Configured as {"type": "KVStoreTier", "module_path": "kvstore_client.vllm.tier", ...}.

    Settings (all optional): address (daemon socket or host:port; default $KVSTORE_ADDRESS or
    data/kvstore.sock), codec ("lossless", "int8", "fp8_e4m3"), tenant_salt, timeout_s (per
    transfer RPC), lookup_deadline_s (a lookup unanswered this long is a miss),
    allow_process_local (run even when vLLM's block hashes are seeded per process), kv_heads and
    head_dim (the KV geometry, where the model folder has no config.json), io_threads,
    failed_hold_s (chunks whose load failed answer MISS this long, so vLLM recomputes them),
    enable_kv_events (emit vLLM's OffloadingEvent for stored chunks, and for announced chunks
    the tier later finds gone, when vLLM's KV events are on), locality ("LOCAL" or "REMOTE",
    the events' locality), hit_ttl_s (how long a HIT answer is reused before the daemon is asked
    again).

    Hits are served from the daemon's host memory, hence the CPU medium.
    """

    medium = Medium.CPU

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, *, address: str | None = None,
                 codec: str = "lossless", tenant_salt: str = "", timeout_s: float = 5.0,
                 lookup_deadline_s: float = 1.0, allow_process_local: bool = False,
                 kv_heads: int | None = None, head_dim: int | None = None,
                 io_threads: int = 2, failed_hold_s: float = 10.0,
                 enable_kv_events: bool = False, locality: str | None = None,
                 hit_ttl_s: float = 10.0, **unknown: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        if unknown:
            log.warning("kvstore: ignoring unknown vLLM tier settings %s", sorted(unknown))
        self.address = address or os.environ.get("KVSTORE_ADDRESS") or _DEFAULT_ADDRESS
        self.codec = codec
        self.tenant_salt = tenant_salt
        self.timeout_s = float(timeout_s)
        self.allow_process_local = bool(allow_process_local)
        self.failed_hold_s = float(failed_hold_s)
        self._kv_geo = (kv_heads, head_dim)
        arr = np.asarray(primary_kv_view)
        self._chunks = arr.view(np.uint8).reshape(arr.shape[0], -1)
        self.geometry = identity.chunk_geometry(offloading_spec, self._chunks.shape[1])
        self.num_chunks = int(self._chunks.shape[0])
        # vLLM's KV events: stored chunks as jobs succeed, and announced chunks the tier later
        # finds gone; None unless asked for here and enabled in vLLM (as its own tiers do).
        self.events: list[OffloadingEvent] | None = None
        if enable_kv_events:
            events_config = getattr(offloading_spec, "kv_events_config", None)
            if getattr(events_config, "enable_kv_cache_events", False) is True:
                self.events = []
            else:
                log.warning("kvstore: enable_kv_events is set on the tier but vLLM's KV cache "
                            "events are off; the tier emits none")
        self._event_keys: dict[int, list[Any]] = {}        # store job -> its offload keys
        self._announced: OrderedDict[bytes, Any] = OrderedDict()   # folded -> offload key
        self._events_lock = threading.Lock()
        # One pass per byte (copy and checksum fused, on the client's copy threads) where the
        # compiled kernel is available; numpy copies plus a separate checksum pass otherwise.
        self._plan = (blockcopy.rows_plan(self._chunks, self.geometry.nbytes)
                      if blockcopy.kernel_available() else None)
        self._io = ThreadPoolExecutor(max(1, int(io_threads)), thread_name_prefix="kvstore-vllm")
        self._jobs: dict[int, Future] = {}      # set when the job's result is out
        self._queued: dict[Any, list[_Queued]] = {self._store: [], self._load: []}
        self._finished: list[JobResult] = []
        self._lock = threading.Lock()
        self._ns_lock = threading.Lock()
        self._hints: list[tuple[Any, list[bytes], str]] = []    # (namespace, keys, level)
        self._hint_lock = threading.Lock()
        self._client: Any = None
        self._ns: Any = None
        self._disabled: str | None = None
        self._down_until = 0.0
        self._backoff = 0.5
        self.counters: Counter = Counter()
        self._reported: Counter = Counter()
        self._req_keys: dict[str, list[bytes]] = {}
        self._lookups = Lookups(self._locate, deadline_s=float(lookup_deadline_s),
                                hit_ttl_s=float(hit_ttl_s))
        self._created = time.monotonic()
        _INSTANCES.add(self)
        log.info("kvstore: vLLM tier on %s, %d-byte chunks, codec %s", self.address,
                 self.geometry.nbytes, codec)

    # -- the namespace, set up lazily (vLLM seeds its hashes after building the scheduler) ---
    def _namespace(self) -> Any:
        if self._ns is not None:
            return self._ns
        with self._ns_lock:
            if self._ns is not None:
                return self._ns
            if self._disabled:
                raise Unavailable(self._disabled)
            space = keyspace.detect()
            if space is None:
                raise Unavailable("vLLM has not seeded its block hashes yet")
            salt = self.tenant_salt
            if space.process_random:
                if not self.allow_process_local:
                    self._disabled = (
                        f"vLLM's {space.algo} block hashes are seeded randomly in each process "
                        "(PYTHONHASHSEED is unset), so no other process could ever reuse a "
                        "stored block: kvstore stores nothing. Set PYTHONHASHSEED to one value "
                        "for all engines, use prefix_caching_hash_algo=sha256, or set "
                        "allow_process_local=true to cache for this process only.")
                    log.error("kvstore: %s", self._disabled)
                    raise Unavailable(self._disabled)
                salt = f"{salt}/process-local/{uuid.uuid4().hex}"
                log.warning("kvstore: PROCESS-LOCAL MODE: vLLM's %s block hashes are seeded "
                            "per process, so blocks stored now are private to this process and "
                            "are lost when it exits", space.algo)
            if self._client is None:
                self._client = connect(self.address, timeout=self.timeout_s)
            args = identity.namespace_args(self._offloading_spec, self.geometry, space.scheme,
                                           self.codec, salt, *self._kv_geo)
            self._ns = self._client.namespace(**args)
            log.info("kvstore: namespace %s for %s (%s)", self._ns.ns_id.hex(),
                     args["model"], space.scheme)
            return self._ns

    def _guard(self) -> Any:
        """The namespace, or Unavailable at once while the daemon is known to be down."""
        if time.monotonic() < self._down_until:
            raise Unavailable(f"kvstore daemon at {self.address} is unreachable; retrying "
                              "shortly")
        return self._namespace()

    def _failed(self, e: BaseException) -> None:
        if isinstance(e, KVStoreError) and e.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
            if self._disabled:
                return
            self._down_until = time.monotonic() + self._backoff
            if self._backoff < 8:
                log.warning("kvstore: daemon at %s unreachable (%s); serving misses",
                            self.address, e)
            self._backoff = min(self._backoff * 2, 10.0)
        else:
            log.warning("kvstore: %s: %s", type(e).__name__, e)
        self.counters["errors"] += 1

    def _ok(self) -> None:
        self._backoff = 0.5

    # -- lookups --------------------------------------------------------------------------
    def _locate(self, keys: list[bytes]) -> list[str | None]:
        try:
            ns = self._guard()
            where = ns.locate(keys, prefetch=True, timeout=self._lookups.deadline_s)
        except Exception as e:
            self._failed(e)
            raise
        self._ok()
        self._gone([k for k, w in zip(keys, where, strict=True) if w is None])
        return where

    def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult:
        answer = self._lookups.lookup(keyspace.fold_key(key))
        return _RESULT.get(answer, LookupResult.RETRY)

    # -- transfers ------------------------------------------------------------------------
    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self._store)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self._load)

    def _submit(self, job: TransferJob, fn: Any) -> None:
        t0 = time.monotonic()
        keys = [keyspace.fold_key(k) for k in job.keys]
        chunks = [int(c) for c in np.asarray(job.chunk_ids).reshape(-1)]
        rid = job.req_context.req_id if job.req_context is not None else None
        if rid is not None:
            self._req_keys.setdefault(rid, []).extend(keys)
        if self.events is not None and not job.is_promotion:
            with self._events_lock:
                self._event_keys[job.job_id] = list(job.keys)
        bad = len(chunks) != len(keys) or any(not 0 <= c < self.num_chunks for c in chunks)
        if bad or not keys:
            # Nothing to move (an empty job), or chunk ids outside the primary tier: the job
            # ends here, alone, so it neither touches memory it must not nor fails other jobs.
            if bad:
                log.warning("kvstore: job %s names %d chunks for %d keys, or chunks outside the "
                            "primary tier's %d; failing it", job.job_id, len(chunks), len(keys),
                            self.num_chunks)
                self.counters["load_failed" if job.is_promotion else "store_failed"] += len(keys)
            self._finish(job, JobResult(job.job_id, not bad), t0)
            return
        done: Future = Future()
        with self._lock:
            self._jobs[job.job_id] = done
            self._queued[fn].append((job, keys, chunks, t0))
        self._io.submit(self._drain_queue, fn)

    def _drain_queue(self, fn: Any) -> None:
        """Run every job of this kind queued so far as one batch: vLLM submits a job per
        request, and each alone would pay its own round trips (Reserve and Commit, Acquire and
        Release); jobs that queued up while the copy threads were busy share them instead."""
        with self._lock:
            batch, self._queued[fn] = self._queued[fn], []
        while batch:
            self.counters["load_batches" if batch[0][0].is_promotion else "store_batches"] += 1
            batch = fn(batch)

    def _finish(self, job: TransferJob, result: JobResult, t0: float) -> None:
        result.transfer_time = time.monotonic() - t0
        if self.events is not None and not job.is_promotion:
            self._announce(job.job_id, result.success)
        with self._lock:
            self._finished.append(result)
            done = self._jobs.pop(job.job_id, None)
        if done is not None:
            done.set_result(None)

    def _fail_all(self, batch: list[_Queued], e: Exception) -> None:
        """The whole batch failed (daemon down, full, ...): never into vLLM, a failed job each."""
        self._failed(e)
        for job, keys, _, t0 in batch:
            self.counters["load_failed" if job.is_promotion else "store_failed"] += len(keys)
            if job.is_promotion:
                self._lookups.hold_misses(keys, self.failed_hold_s)
            self._finish(job, JobResult(job.job_id, False), t0)

    def _mover(self, ns: Any, chunks: list[int], to_slots: bool) -> Any:
        """The fill (to_slots) or drain between the primary tier's chunks and pool slots: the
        SDK's one-pass kernel where it is available, numpy copies otherwise."""
        if self._plan is not None:
            return ns.fused_move(self._plan, to_slots, chunks)
        nb, rows = self.geometry.nbytes, self._chunks

        def move(base: np.ndarray, offsets: Any, first: int) -> None:
            for j, off in enumerate(offsets):
                if to_slots:
                    base[off:off + nb] = rows[chunks[first + j], :nb]
                else:
                    rows[chunks[first + j], :nb] = base[off:off + nb]
        return move

    def _store(self, batch: list[_Queued]) -> list[_Queued]:
        """One store of every chunk in the batch; all its jobs succeed or fail together.

        The batch is stored as one chain, so a job's first chunk may be recorded as the child
        of another request's last: parents only steer eviction order (leaves first), and the
        tier never knew a job's true parent anyway (vLLM stores a request in several jobs)."""
        keys = [k for _, ks, _, _ in batch for k in ks]
        chunks = [c for _, _, cs, _ in batch for c in cs]
        try:
            ns, nb = self._guard(), self.geometry.nbytes
            ns.store_blocks(keys, self._mover(ns, chunks, True))
            self._ok()
        except Exception as e:
            self._fail_all(batch, e)
            return []
        self._lookups.mark_hits(keys)
        self.counters["stored"] += len(keys)
        for job, ks, _, t0 in batch:
            self._finish(job, JobResult(job.job_id, True, transfer_bytes=len(ks) * nb), t0)
        return []

    def _load(self, batch: list[_Queued]) -> list[_Queued]:
        """One load of every chunk in the batch. It returns the verified prefix: the jobs
        inside it succeed, the job it ends in fails with the keys that did load, and the jobs
        after that (other requests, most likely still cached) come back to be tried again."""
        keys = [k for _, ks, _, _ in batch for k in ks]
        chunks = [c for _, _, cs, _ in batch for c in cs]
        try:
            ns, nb = self._guard(), self.geometry.nbytes
            # load_blocks verifies each block's checksum and returns the verified prefix only.
            # Only corrupt_blocks counts failures of the daemon's own copy: a checksum failure
            # of this client's mapping (a restarted daemon's old pool) is resynced instead, and
            # deleting on it would drop a block that is intact for every other engine.
            bad_sums = ns.client.counters["corrupt_blocks"]
            n = ns.load_blocks(keys, self._mover(ns, chunks, False))
            self._ok()
        except Exception as e:
            self._fail_all(batch, e)
            return []
        self.counters["loaded"] += n
        at = 0
        for i, (job, ks, _, t0) in enumerate(batch):
            if at + len(ks) <= n:
                self._finish(job, JobResult(job.job_id, True, transfer_bytes=len(ks) * nb), t0)
                at += len(ks)
                continue
            got = n - at
            self.counters["load_failed"] += len(ks) - got
            if ns.client.counters["corrupt_blocks"] != bad_sums:
                self._drop_corrupt(ns, ks[got])
            self._gone(ks[got:got + 1])     # the daemon answered: missing, or dropped as corrupt
            self._lookups.hold_misses(ks[got:], self.failed_hold_s)
            # tiering/base.py: successful_keys names the keys that did load on a partial
            # failure; None when none did (every key shares the job's fate).
            ok_keys = list(job.keys)[:got] or None
            self._finish(job, JobResult(job.job_id, False, successful_keys=ok_keys,
                                        transfer_bytes=got * nb), t0)
            return batch[i + 1:]
        return []

    def _drop_corrupt(self, ns: Any, key: bytes) -> None:
        """Delete a block whose bytes failed their checksum, so that no engine is offered it
        again (vLLM would promote it, fail and ask again); the next store writes it afresh."""
        self.counters["corrupt_dropped"] += 1
        try:
            ns.delete([key])
            log.warning("kvstore: dropped block %s: its bytes in the daemon failed their "
                        "checksum", key.hex()[:16])
        except Exception as e:
            log.warning("kvstore: could not drop block %s that failed its checksum: %s",
                        key.hex()[:16], e)

    # -- KV events --------------------------------------------------------------------------
    def _announce(self, job_id: int, success: bool) -> None:
        """A finished store job: its keys become one stored event when it succeeded."""
        with self._events_lock:
            keys = self._event_keys.pop(job_id, None)
            if not success or not keys or self.events is None:
                return
            self.events.append(OffloadingEvent(keys=keys, medium=self.medium, removed=False,
                                               locality=self.locality))
            for k in keys:
                folded = keyspace.fold_key(k)
                self._announced[folded] = k
                self._announced.move_to_end(folded)
            while len(self._announced) > MAX_ANNOUNCED:
                self._announced.popitem(last=False)

    def _gone(self, folded: list[bytes]) -> None:
        """Announced keys the tier found gone (a lookup or load missed them): removed events.

        The tier learns of a removal only when it asks about the key again; the daemon's own
        event stream reports every eviction as it happens (docs/vllm.md, "KV events").
        """
        if self.events is None or not folded:
            return
        with self._events_lock:
            keys = [self._announced.pop(f) for f in folded if f in self._announced]
            if keys:
                self.events.append(OffloadingEvent(keys=keys, medium=self.medium, removed=True,
                                                   locality=self.locality))

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events is None:
            return []
        with self._events_lock:
            out, self.events = self.events, []
        return out

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._lock:
            done, self._finished = self._finished, []
        return done

    def has_pending_work(self) -> bool:
        with self._lock:
            busy = bool(self._jobs) or bool(self._finished)
        return busy or self._lookups.pending()

    def drain_jobs(self) -> None:
        with self._lock:
            futures = list(self._jobs.values())
        # Each job's RPCs have deadlines, so this ends; the bound is a second line of defence.
        wait(futures, timeout=4 * self.timeout_s + 10)

    # -- requests and engine signals ---------------------------------------------------------
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        # A request may say what follows it: kv_transfer_params={"kvstore_session": "closed"}
        # (the conversation is over) or "continues" (a follow-up turn is expected).
        params = req_context.kv_transfer_params or {}
        session = params.get("kvstore_session") if isinstance(params, dict) else None
        signal = {"closed": "session_closed", "continues": "session_continues"}.get(
            session, "request_finished")
        self._signal(self._req_keys.pop(req_context.req_id, None), signal)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        for rid in context.preempted_req_ids:
            self._signal(self._req_keys.get(rid), "preempted")

    def _signal(self, keys: list[bytes] | None, signal: str) -> None:
        """Tell the daemon what the engine knows of these blocks' future (a retention hint)."""
        if not keys or self._ns is None:
            return
        try:
            from ..retention import level_for
        except ImportError:                 # an SDK without the signal table
            return
        level = level_for(signal)
        if level == "normal":
            return
        with self._lock:
            self._hints.append((self._ns, list(dict.fromkeys(keys)), level))
        self._io.submit(self._send_hints)

    def _send_hints(self) -> None:
        """Send the hints queued so far, in the order the engine gave its signals. Why in order:
        a hint reorders eviction as a use would, so of two blocks hinted "high" the one hinted
        last is kept longest; sent from the io threads as they came free, a preemption's hint
        could overtake the finished request's before it (seen in tests/test_vllm_tier.py)."""
        with self._hint_lock:               # one sender at a time: the daemon sees them in order
            with self._lock:
                todo, self._hints = self._hints, []
            for ns, keys, level in todo:
                try:
                    ns.retain(keys, level)
                except Exception as e:
                    log.debug("kvstore: retention hint failed: %s", e)

    # -- stats ------------------------------------------------------------------------------
    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]
                                 ) -> dict[str, OffloadingMetricMetadata]:
        return {name: OffloadingCounterMetadata(documentation=doc)
                for name, doc in _METRICS.items()}

    def _totals(self) -> dict[str, int]:
        s = self._lookups.stats
        return {M_LOOKUP_HITS: s.hits, M_LOOKUP_MISSES: s.misses,
                M_DEADLINE_MISSES: s.deadline_misses, M_STORED: self.counters["stored"],
                M_LOADED: self.counters["loaded"], M_LOAD_FAILED: self.counters["load_failed"],
                M_STORE_FAILED: self.counters["store_failed"]}

    def get_stats(self) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )
        stats = OffloadingConnectorStats()
        for name, total in self._totals().items():
            delta = total - self._reported[name]
            if delta:
                stats.increase_counter(name, delta)
                self._reported[name] = total
        return None if stats.is_empty() else stats

    def stats(self) -> dict[str, Any]:
        """Totals since start, for logs and tests (vLLM's metrics get deltas via get_stats)."""
        s = self._lookups.stats
        return {**self._totals(), "queries": s.queries, "keys_asked": s.keys_asked,
                "pending": s.pending, "errors": dict(self.counters).get("errors", 0),
                "corrupt_dropped": dict(self.counters).get("corrupt_dropped", 0),
                "store_batches": self.counters["store_batches"],
                "load_batches": self.counters["load_batches"],
                "last_errors": list(s.errors), "disabled": self._disabled,
                "namespace": self._ns.ns_id.hex() if self._ns is not None else None}

    def shutdown(self) -> None:
        self._lookups.close()
        self.drain_jobs()
        self._io.shutdown(wait=False)
        # Drop the view of the primary tier: vLLM closes that mmap next and cannot while a
        # buffer export is alive ("cannot close exported pointers exist"). The copy plan holds
        # the same view (Plan.keep), so it goes too.
        self._chunks = None
        self._plan = None
        if self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass
