"""Prometheus metrics: RPC latencies and errors measured here, store figures read at scrape time.

Why a custom collector for the store: the store already counts everything it does (hits,
evictions, bytes moved...) in `store.stats()`. Reading that dict when Prometheus scrapes keeps
one source of truth and costs nothing on the hot path; counting the same events again here
would double the bookkeeping and drift. Only what the store cannot see — RPC latency, status
codes, calls in flight — is measured in this module.

Naming (README.md (Metrics) lists every metric):
- known tier fields become `kvstore_tier_<field>{tier}` (levels are gauges, events `_total`
  counters); fields this module does not know go to `kvstore_tier_other{tier,stat}`.
- `bytes_<src>_to_<dst>` counters become `kvstore_bytes_moved_total{path="<src>-><dst>"}`
  (`bytes_to_<dst>` is path "host-><dst>"); `codec_in_bytes_<codec>` / `codec_out_bytes_<codec>`
  become `kvstore_codec_bytes_in_total{codec}` / `kvstore_codec_bytes_out_total{codec}`.
- known counters become `kvstore_<name>_total`; unknown ones `kvstore_store_events_total{name}`,
  so a counter the store adds later is exported at once and the names stay documented.

The HTTP endpoint that serves them is metrics_endpoint.py.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import make_wsgi_app
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from .metrics_endpoint import MetricsServer

log = logging.getLogger("kvstore.metrics")

# 50 µs .. 10 s, roughly ×2.5 per step: a local Lookup is ~0.1–0.5 ms, a 256 MiB Put seconds.
RPC_BUCKETS = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1,
               0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# Tier fields: levels (gauges) and event counts (counters); others -> kvstore_tier_other.
TIER_GAUGES = {"capacity_bytes": "Bytes the tier may hold",
               "used_bytes": "Bytes the tier holds now",
               "blocks": "Blocks resident in the tier"}
TIER_COUNTERS = {"hits": "Looked-up blocks found in the tier (longest-prefix count)",
                 "misses": "Looked-up blocks not found in the tier",
                 "evictions": "Blocks evicted from the tier",
                 "stored": "Blocks written into the tier by clients",
                 "demotions": "Blocks copied from this tier down to the next",
                 "demotions_in": "Blocks received from the tier above",
                 "promotions": "Blocks copied up into this tier from a lower one",
                 "read_hits": "Acquired/Get blocks already resident in the tier"}
STORE_COUNTERS = {"lookups": "Lookup and LookupAcquire calls of loads (not of stores)",
                  "lookup_blocks": "Keys asked about by loads' Lookup, LookupAcquire, Locate",
                  "lookup_hit_blocks": "Keys those found cached (a prefix; Locate: each key)",
                  "store_lookups": "Lookups a store made of the prefix it need not write "
                                   "(LookupReserve, Lookup for_store): not hits or misses",
                  "acquired_blocks": "Blocks pinned by Acquire and Get",
                  "duplicate_blocks": "Written blocks dropped because the key was stored",
                  "duplicate_blocks_differing": "Written blocks dropped because the key was "
                                                "stored with other bytes (the block kept its "
                                                "own)",
                  "deleted_blocks": "Blocks removed by Delete",
                  "namespaces_reclaimed": "Empty namespaces forgotten to make room for a new "
                                          "one at limits.namespaces_per_tenant",
                  "retention_hint_blocks": "Stored blocks reached by Retain hints",
                  "corrupt_blocks": "Blocks that failed their checksum and were dropped",
                  "corrupt_host_blocks": "Host copies changed after commit, dropped unserved",
                  "ssd_disk_full_errors": "SSD writes that did not land: filesystem full",
                  "ssd_disk_full_dropped_blocks": "Evicted host blocks dropped, not demoted, "
                                                  "because the SSD filesystem was full",
                  "tenant_quota_dropped_blocks": "Evicted blocks not demoted because their "
                                                 "tenant's SSD or remote quota was full",
                  "promotion_duplicates": "Promoted copies dropped because a write stored the "
                                          "block meanwhile",
                  "commit_checksum_mismatch": "Commits refused: slot bytes != sent checksum",
                  "acquire_cut_host_full": "Acquires that served a shorter prefix because "
                                           "host could not hold more beside what they pinned",
                  "get_checksum_mismatch": "Get streams cut before a host block whose bytes "
                                           "no longer matched its checksum",
                  "leases_expired": "Leases reaped after their deadline",
                  "lossy_refused_nonfinite": "Blocks a lossy codec refused (inf/NaN), stored "
                                             "lossless instead",
                  "reserve_waits": "Reserves that evicted inline because background demotion "
                                   "had not kept host use under the high watermark",
                  "reserve_wait_seconds": "Seconds those Reserves spent making room",
                  "promotion_room_waits": "Promotions (loads from a lower tier) that found no "
                                          "free host slot at once and made or waited for room",
                  "promotion_room_wait_seconds": "Seconds those promotions spent on room",
                  "reserve_ahead": "Write leases a Commit reserved for the client's next store",
                  "releases_carried": "Leases released by a later call that carried them "
                                      "(no Release round trip of their own)",
                  "reserve_ahead_refused": "Reserve-aheads a Commit skipped: no room in the "
                                           "host pool (the client reserves when it stores)",
                  "lane_calls": "Calls served over the fast lane (<socket>.lane) instead of "
                                "gRPC",
                  "stop_flush_dropped_blocks": "Host-only blocks a stop dropped when its flush "
                                               "ran past server.stop_flush_s",
                  "gc_full_collections": "Full (generation 2) cyclic-GC collections since the "
                                         "daemon started",
                  "background_demotion_bytes": "Host bytes the background demoter freed",
                  "background_demotion_errors": "Background demotion rounds that failed "
                                                "(retried next round; inline eviction remains)",
                  "demotions_kept_pinned": "Demoted blocks that kept their host copy because "
                                           "a read lease pinned it meanwhile",
                  "host_room_wait_timeouts": "Calls refused after waiting for host room: "
                                             "demotions to SSD did not land in time",
                  "promotion_reclaimed_bytes": "Host bytes of unread promoted copies freed to "
                                               "make room",
                  "gpu_demotions_refused": "GPU evictions stopped because host could not take "
                                           "the victims",
                  "locate_blocks": "Keys asked about by Locate",
                  "prefetched_blocks": "Blocks Locate's prefetch promoted into host",
                  "prefetch_failed_blocks": "Blocks Locate's prefetch could not promote",
                  "prefetch_refused_blocks": "Blocks Locate's prefetch skipped: its queue (or "
                                             "the caller's share) was full",
                  "remote_demotion_failures": "Demotion batches Redis did not take (down or "
                                              "full): their blocks stayed local",
                  "remote_capacity_refused_blocks": "Blocks not demoted to Redis because "
                                                    "remote.capacity was reached",
                  "remote_dropped_blocks": "Evicted host blocks dropped because Redis could "
                                           "not take them",
                  "remote_read_failed_blocks": "Promotions from Redis that failed or were late "
                                               "(a miss; the copy is still known)",
                  "remote_deletes_given_up": "Remote deletes dropped from the retry list at "
                                             "its cap (their Redis copies linger until evicted)",
                  "ssd_damaged_records": "Damaged SSD index or namespace records dropped at "
                                         "open, never served",
                  "ssd_unpersisted_namespace_blocks": "Blocks kept off SSD because their "
                                                      "namespace's record had not landed yet",
                  "ssd_capacity_full_evictions": "Demotions that found the SSD payload file "
                                                 "at ssd.capacity with its room in pieces too "
                                                 "small, and evicted to make a hole"}
# Store figures that are levels, not counts (kvstore/gc_pauses.py).
STORE_GAUGES = {"gc_frozen_objects": "Objects frozen out of every collection after the warm-ups",
                "gc_walked_objects": "Objects a full collection walked once the daemon was warm",
                "remote_deletes_waiting": "Remote deletes Redis has not answered, to be sent "
                                          "again",
                "expired_write_slots_held": "Slots of expired write leases kept from the "
                                            "allocator for leases.expired_write_hold_s"}
# The event counts a gpu device reports (kvstore/moves/gpu_host.py, gpu_slots.py), each exported
# from the first scrape at 0 like the tier counters.
DEVICE_COUNTERS = ("stored", "bytes_in", "evictions", "demotions", "promotions", "read_hits")
# Remote tier figures that are not event counts (kvstore_remote_events leaves them out).
REMOTE_NOT_EVENTS = frozenset({"up", "serving", "nodes_up", "nodes_total", "capacity",
                               "round_trips_per_call"})
# Series that exist from the first scrape at 0, so `increase()` and `rate()` see the first
# event (a series that appears with value 1 has no earlier sample to increase from).
MOVE_PATHS = ("client->host", "host->client", "host->ssd", "ssd->host", "remote->host",
              "host->remote")
CODECS = ("lossless", "fp8_e4m3", "int8")
LOSSY_CODECS = ("fp8_e4m3", "int8")
# Every status the servicer answers with (kvstore_client.errors codes, CANCELLED for a client
# that left mid-stream).
RPC_CODES = ("OK", "CANCELLED", "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION",
             "RESOURCE_EXHAUSTED", "UNAVAILABLE", "DATA_LOSS", "DEADLINE_EXCEEDED", "INTERNAL",
             "UNAUTHENTICATED", "PERMISSION_DENIED", "OUT_OF_RANGE")


def rpc_methods() -> list[str]:
    """The KVStore service's methods, from the compiled proto (one source of truth)."""
    from kvstore_client._proto import kvstore_pb2

    service = kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"]
    return [m.name for m in service.methods]


_MOVE = re.compile(r"^bytes_(?:(?P<src>[a-z]+)_)?to_(?P<dst>[a-z]+)$")
_CODEC = re.compile(r"^codec_(?P<dir>in|out)_bytes_(?P<codec>[a-z0-9_]+)$")
# Sampled quantization error (kvstore/moves/encoding.py): sum and sample count per lossy codec.
_CODEC_STAT = re.compile(r"^codec_(?P<stat>blocks|error_sum|error_samples)_(?P<codec>[a-z0-9_]+)$")
_CODEC_STAT_HELP = {
    "blocks": "Blocks encoded by each tier codec",
    "error_sum": "Sum of sampled relative errors |x_hat - x| / |x| of lossy-encoded blocks",
    "error_samples": "Lossy-encoded blocks whose error was sampled (mean = error_sum / this)",
}
_SAFE = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(raw: str) -> str:
    """A stats key as a Prometheus name fragment (letters, digits, underscores)."""
    name = _SAFE.sub("_", str(raw)).strip("_").lower()
    return name or "unnamed"


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


class StoreCollector(Collector):
    """Turns `store.stats()` into metric families at each scrape."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.failures = 0

    def describe(self) -> list[Metric]:
        return []   # families depend on the store's keys; describe lazily (no registry check)

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.store.stats()
        except Exception:
            self.failures += 1
            log.exception("store.stats() failed during a metrics scrape")
            stats = None
        up = GaugeMetricFamily("kvstore_stats_up", "1 when store.stats() answered this scrape")
        up.add_metric([], 0.0 if stats is None else 1.0)
        yield up
        if stats is None:
            return
        yield from self._tiers(stats.get("tiers", {}))
        yield from self._devices(stats.get("gpu_devices") or {})
        yield from self._remote(stats.get("remote") or {})
        yield from self._counters(stats.get("counters", {}))
        for key, help_ in (("namespaces", "Registered namespaces"),
                           ("active_leases", "Leases currently held by clients"),
                           ("blocks", "Distinct blocks known to the index, any tier")):
            v = _number(stats.get(key))
            if v is not None:
                g = GaugeMetricFamily(f"kvstore_{key}", help_)
                g.add_metric([], v)
                yield g
        info = GaugeMetricFamily("kvstore_daemon_info", "Always 1; the labels identify this run",
                                 labels=["daemon_id"])
        info.add_metric([str(stats.get("daemon_id") or getattr(self.store, "daemon_id", ""))],
                        1.0)
        yield info

    @staticmethod
    def _tiers(tiers: dict[str, dict]) -> Iterator[Metric]:
        fams: dict[str, Metric] = {}
        other = GaugeMetricFamily("kvstore_tier_other", "Tier figures without their own metric",
                                  labels=["tier", "stat"])
        for tier, fields in tiers.items():
            fields = {**dict.fromkeys(TIER_COUNTERS, 0), **fields}
            for field, value in fields.items():
                v = _number(value)
                if v is None:
                    continue
                if field in TIER_GAUGES:
                    fam = fams.get(field) or GaugeMetricFamily(
                        f"kvstore_tier_{field}", TIER_GAUGES[field], labels=["tier"])
                elif field in TIER_COUNTERS:
                    fam = fams.get(field) or CounterMetricFamily(
                        f"kvstore_tier_{field}", TIER_COUNTERS[field], labels=["tier"])
                else:
                    other.add_metric([tier, metric_name(field)], v)
                    continue
                fams[field] = fam
                fam.add_metric([tier], v)
        yield from fams.values()
        yield other

    @staticmethod
    def _devices(devices: dict[str, dict]) -> Iterator[Metric]:
        """Per-device gpu tier figures: kvstore_gpu_device_<field>{device, kind}; the levels
        (TIER_GAUGES) as gauges, every other field as a `_total` counter.

        Why counters: besides its levels a device reports only event counts (stored,
        evictions, demotions, promotions, read_hits, bytes_in: kvstore/moves/gpu_host.py,
        gpu_slots.py), which only grow; typed as gauges they read as levels, `rate()` and
        `increase()` did not treat a daemon restart as a counter reset, and the names broke
        the `_total` rule every other counter here keeps. Why DEVICE_COUNTERS at 0: a device
        counts an event only once it happens, and a series that appears at 1 has no earlier
        sample for `increase()` (MOVE_PATHS)."""
        fams: dict[str, Metric] = {}
        for dev, fields in devices.items():
            kind = str(fields.get("kind", ""))
            fields = {**dict.fromkeys(DEVICE_COUNTERS, 0), **fields}
            for field, value in fields.items():
                v = _number(value)
                if v is None:
                    continue
                name = metric_name(field)
                fam = fams.get(name)
                if fam is None:
                    kind_of = GaugeMetricFamily if field in TIER_GAUGES else CounterMetricFamily
                    fam = kind_of(f"kvstore_gpu_device_{name}",
                                  f"gpu tier, per device: {TIER_GAUGES.get(field) or field}",
                                  labels=["device", "kind"])
                fams[name] = fam
                fam.add_metric([str(dev), kind], v)
        yield from fams.values()

    @staticmethod
    def _remote(remote: dict[str, Any]) -> Iterator[Metric]:
        """The Redis/Valkey client's own figures (tiers/remote/), when the tier is enabled."""
        if not remote:
            return
        up = GaugeMetricFamily("kvstore_remote_up", "1 while the remote tier serves: at least "
                               "one of its nodes answers")
        up.add_metric([], 1.0 if remote.get("serving", remote.get("up")) else 0.0)
        yield up
        for key, name, help_ in (
                ("nodes_up", "kvstore_remote_nodes_up", "Remote nodes answering (a cluster's "
                 "primaries; a down one's keys are misses until it answers again)"),
                ("nodes_total", "kvstore_remote_nodes", "Remote nodes known (a cluster's "
                 "primaries, 0 until its slot table is read; standalone: 1)")):
            v = _number(remote.get(key))
            if v is not None:
                g = GaugeMetricFamily(name, help_)
                g.add_metric([], v)
                yield g
        events = CounterMetricFamily("kvstore_remote_events", "Remote client events by name",
                                     labels=["event"])
        for key, value in sorted(remote.items()):
            v = _number(value)
            if v is not None and key not in REMOTE_NOT_EVENTS:
                events.add_metric([metric_name(key)], v)
        yield events
        lat = remote.get("latency") or {}
        fams = {part: CounterMetricFamily(f"kvstore_remote_latency_seconds_{part}",
                                          f"Remote call latency {part}, by operation",
                                          labels=["op"]) for part in ("sum", "count")}
        worst = GaugeMetricFamily("kvstore_remote_latency_max_seconds",
                                  "Slowest remote call since start, by operation", labels=["op"])
        for op, o in sorted(lat.items()):
            fams["sum"].add_metric([op], float(o.get("sum_s", 0.0)))
            fams["count"].add_metric([op], float(o.get("count", 0)))
            worst.add_metric([op], float(o.get("max_s", 0.0)))
        yield from fams.values()
        yield worst

    @staticmethod
    def _counters(counters: dict[str, Any]) -> Iterator[Metric]:
        moved = CounterMetricFamily("kvstore_bytes_moved", "Block bytes moved, by path",
                                    labels=["path"])
        codec = {d: CounterMetricFamily(f"kvstore_codec_bytes_{d}",
                                        f"Bytes {'into' if d == 'in' else 'out of'} the "
                                        "tier codecs (raw vs encoded)", labels=["codec"])
                 for d in ("in", "out")}
        codec_stats = {st: CounterMetricFamily(f"kvstore_codec_{st}", h, labels=["codec"])
                       for st, h in _CODEC_STAT_HELP.items()}
        events = CounterMetricFamily("kvstore_store_events", "Store counters without their "
                                     "own metric", labels=["name"])
        known = {name: CounterMetricFamily(f"kvstore_{name}", help_)
                 for name, help_ in STORE_COUNTERS.items()}
        for name in known:
            known[name].add_metric([], float(_number(counters.get(name)) or 0.0))
        # Every level from the first scrape, at 0 until the store first sets it (no deletes
        # waiting, no expired write slots held, no frozen objects before the warm-up): a
        # documented series that appeared only with its first event left dashboards on "no
        # data" and an alert such as `kvstore_expired_write_slots_held > 0` with nothing to read.
        levels = {name: GaugeMetricFamily(f"kvstore_{name}", help_)
                  for name, help_ in STORE_GAUGES.items()}
        for name, fam in levels.items():
            fam.add_metric([], float(_number(counters.get(name)) or 0.0))
        zeros = {f"codec_{d}_bytes_{c}": 0 for d in ("in", "out") for c in CODECS}
        zeros |= {f"codec_blocks_{c}": 0 for c in CODECS}
        zeros |= {f"codec_{st}_{c}": 0 for st in ("error_sum", "error_samples")
                  for c in LOSSY_CODECS}
        zeros |= {f"bytes_{p.replace('->', '_to_')}": 0 for p in MOVE_PATHS}
        counters = {**zeros, **counters}
        # Two spellings of one path (bytes_to_remote, bytes_host_to_remote) add up.
        moved_by_path: dict[str, float] = {}
        for key, value in sorted(counters.items()):
            v = _number(value)
            key = str(key)
            if v is None or key in known or key in STORE_GAUGES:
                continue
            if m := _MOVE.match(key):
                path = f"{m.group('src') or 'host'}->{m.group('dst')}"
                moved_by_path[path] = moved_by_path.get(path, 0.0) + v
            elif m := _CODEC.match(key):
                codec[m.group("dir")].add_metric([m.group("codec")], v)
            elif m := _CODEC_STAT.match(key):
                codec_stats[m.group("stat")].add_metric([m.group("codec")], v)
            else:
                events.add_metric([metric_name(key)], v)
        for path, v in sorted(moved_by_path.items()):
            moved.add_metric([path], v)
        yield from known.values()
        yield from levels.values()
        yield moved
        yield from codec.values()
        yield from codec_stats.values()
        yield events


class Metrics:
    """The daemon's registry: RPC metrics (observed by the server) + the store collector."""

    def __init__(self, store: Any | None = None) -> None:
        disable_created_metrics()   # `_created` series double the output and nobody graphs them
        self.registry = CollectorRegistry(auto_describe=True)
        self.rpc_seconds = Histogram(
            "kvstore_rpc_duration_seconds", "Server-side RPC latency, by method",
            ["method"], buckets=RPC_BUCKETS, registry=self.registry)
        self.rpc_total = Counter(
            "kvstore_rpcs", "Finished RPCs, by method and status code",
            ["method", "code"], registry=self.registry)
        self.rpc_errors = Counter(
            "kvstore_rpc_errors", "RPCs that ended with a status other than OK",
            ["method", "code"], registry=self.registry)
        self.in_flight = Gauge("kvstore_rpcs_in_flight", "RPCs being served now",
                               registry=self.registry)
        self.started = Gauge("kvstore_start_time_seconds", "Unix time the daemon started",
                             registry=self.registry)
        self.started.set(time.time())
        # Each call's children, found once here: `labels()` checks and joins its values under
        # a lock every time, two such lookups a call, a tenth of a lookup's daemon CPU. Only
        # the service's own methods and codes (a fixed set: no name a peer sends grows this);
        # any other pair still goes through labels().
        self._children: dict[tuple[str, str], tuple[Any, Any, Any]] = {}
        for method in rpc_methods():
            seconds = self.rpc_seconds.labels(method)
            for code in RPC_CODES:
                self._children[method, code] = (
                    seconds, self.rpc_total.labels(method, code),
                    self.rpc_errors.labels(method, code) if code != "OK" else None)
        ProcessCollector(registry=self.registry)
        self.store_collector: StoreCollector | None = None
        if store is not None:
            self.store_collector = StoreCollector(store)
            self.registry.register(self.store_collector)
        self._http: MetricsServer | None = None

    def observe(self, method: str, code: str, seconds: float) -> None:
        known = self._children.get((method, code))
        if known is None:
            self.rpc_seconds.labels(method).observe(seconds)
            self.rpc_total.labels(method, code).inc()
            if code != "OK":
                self.rpc_errors.labels(method, code).inc()
            return
        hist, total, errors = known
        hist.observe(seconds)
        total.inc()
        if errors is not None:
            errors.inc()

    def serve(self, address: str) -> str:
        """Start the HTTP endpoint on "host:port" (port 0: any free port); returns its URL."""
        host, _, port = address.rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        self._http = MetricsServer(host, int(port), make_wsgi_app(self.registry))
        bound = self._http.server_port
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{bound}/metrics"

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None
