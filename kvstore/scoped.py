"""Stats as one tenant sees them: its own namespaces' blocks, not the whole daemon's.

Why computed on demand from the index: a non-admin Stats must not reveal other tenants'
activity (their block counts, hit rates, traffic). Every figure comes from the index's running
counts per namespace (BlockIndex.tier_usage, host_blocks), not from a walk: a walk of the
caller's blocks, under the store lock, made a tenant holding a million blocks stall every
other caller for as long as its Stats took.
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
            n = index.host_blocks(ns)
            info = store.state.namespaces.get(ns)
            counts["host"][0] += n
            counts["host"][1] += n * aligned(info.block_bytes) if info is not None else 0
        caps = {"host": store.host.capacity,
                "ssd": store.ssd.capacity if store.ssd is not None else None,
                "remote": store.config.remote.capacity if store.remote is not None else None}
        leases = sum(store.leases.on_namespace(ns) for ns in ns_ids)
    tiers = {t: {"capacity_bytes": caps[t], "used_bytes": b, "blocks": n, "hits": 0,
                 "misses": 0, "evictions": 0}
             for t, (n, b) in counts.items() if caps[t] is not None}
    return {"tiers": tiers, "counters": {}, "namespaces": len(ns_ids), "active_leases": leases,
            "daemon_id": store.daemon_id}
