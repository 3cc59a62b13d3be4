"""Stats as one tenant sees them: its own namespaces' blocks, not the whole daemon's.

Why computed on demand from the index: a non-admin Stats must not reveal other tenants'
activity (their block counts, hit rates, traffic), and a walk of the caller's own namespaces
costs only as much as the caller has stored. SSD and remote usage come from the index's running
totals per namespace (BlockIndex.tier_usage); only host copies are still counted by a walk.
"""

from __future__ import annotations

from typing import Any

from .state import aligned


def scoped_stats(store: Any, ns_ids: set[bytes]) -> dict:
    """store.stats()-shaped dict covering only `ns_ids` (capacity: the whole tier's)."""
    counts = {t: [0, 0] for t in ("host", "ssd", "remote")}
    index = store.index
    with store.state.lock:
        for ns in ns_ids:
            for tier in ("ssd", "remote"):      # the index's running totals: no walk
                n, b = index.tier_usage(ns, tier)
                counts[tier][0] += n
                counts[tier][1] += b
            for host, _, _, size in index.namespace_residency(ns):
                if host:
                    counts["host"][0] += 1
                    counts["host"][1] += aligned(size)
        caps = {"host": store.host.capacity,
                "ssd": store.ssd.capacity if store.ssd is not None else None,
                "remote": store.config.remote.capacity if store.remote is not None else None}
        leases = sum(1 for lease in store.leases.all() if lease.ns_id in ns_ids)
    tiers = {t: {"capacity_bytes": caps[t], "used_bytes": b, "blocks": n, "hits": 0,
                 "misses": 0, "evictions": 0}
             for t, (n, b) in counts.items() if caps[t] is not None}
    return {"tiers": tiers, "counters": {}, "namespaces": len(ns_ids), "active_leases": leases,
            "daemon_id": store.daemon_id}
