"""Per-tenant Prometheus series: blocks and bytes per tier, lookups and hits.

Why the label set stays bounded: the only `tenant` values are the configured tenant names plus
"none" (namespaces registered before tenants were configured), so a client can never mint a
new series. Blocks and bytes are counted from the index at scrape time; lookups and hits are
counted by the servicer as they happen, because the store does not know who asked.

Why opt-in (`server.metrics_tenants`): the metrics endpoint has no authentication, and on
loopback every local user reaches it; per-tenant figures there tell anyone what each tenant
stores and how often its prompts hit. Why the walk goes a slice of rows at a time, each slice
under the store lock and the lock released between them: one walk of every block under the
lock stalled every call for its whole length (146 ms at 60k blocks). Each block is counted
once, as it was when its slice was read; with nothing moving the figures equal one walk's.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .state import aligned
from .tenants import TENANT_KEY

NONE = "none"


class TenantCounters:
    """Lookup traffic per tenant, counted by the servicer (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.lookup_blocks: Counter = Counter()
        self.lookup_hit_blocks: Counter = Counter()

    def lookup(self, tenant: str | None, asked: int, hit: int) -> None:
        name = tenant or NONE
        with self._lock:
            self.lookup_blocks[name] += asked
            self.lookup_hit_blocks[name] += hit


SLICE_ROWS = 2048     # index rows read per hold of the store lock (about a millisecond)


def tenant_usage(store: Any, slice_rows: int = SLICE_ROWS) -> dict[tuple[str, str], list[int]]:
    """{(tenant, tier): [blocks, bytes]} for host, ssd and remote (raw block bytes; host counts
    its aligned slots), walked a slice of index rows at a time (module docstring)."""
    out: dict[tuple[str, str], list[int]] = {}
    with store.state.lock:
        owners = {ns: info.spec.extra.get(TENANT_KEY) or NONE
                  for ns, info in store.namespaces.items()}
        rows = store.index.rows
    start = 0
    while start < rows:
        with store.state.lock:
            part = list(store.index.residency(start, start + slice_rows))
            rows = store.index.rows           # rows added meanwhile are walked too
        start += slice_rows
        for ns_id, on_host, on_ssd, on_remote, size in part:
            t = owners.get(ns_id, NONE)
            for tier, on, nbytes in (("host", on_host, aligned(size)),
                                     ("ssd", on_ssd, size), ("remote", on_remote, size)):
                if on:
                    row = out.setdefault((t, tier), [0, 0])
                    row[0] += 1
                    row[1] += nbytes
    return out


class TenantCollector(Collector):
    def __init__(self, store: Any, tenants: list[str], counters: TenantCounters) -> None:
        self.store = store
        self.names = [*tenants, NONE]
        self.counters = counters

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        usage = tenant_usage(self.store)
        blocks = GaugeMetricFamily("kvstore_tenant_blocks", "Blocks a tenant holds, by tier",
                                   labels=["tenant", "tier"])
        nbytes = GaugeMetricFamily("kvstore_tenant_bytes", "Block bytes a tenant holds, by tier",
                                   labels=["tenant", "tier"])
        for t in self.names:
            for tier in ("host", "ssd", "remote"):
                n, b = usage.get((t, tier), (0, 0))
                blocks.add_metric([t, tier], n)
                nbytes.add_metric([t, tier], b)
        yield blocks
        yield nbytes
        asked = CounterMetricFamily("kvstore_tenant_lookup_blocks",
                                    "Keys a tenant asked about with Lookup", labels=["tenant"])
        hits = CounterMetricFamily("kvstore_tenant_lookup_hit_blocks",
                                   "Keys a tenant's Lookups found cached", labels=["tenant"])
        for t in self.names:
            asked.add_metric([t], self.counters.lookup_blocks.get(t, 0))
            hits.add_metric([t], self.counters.lookup_hit_blocks.get(t, 0))
        yield asked
        yield hits
