"""Stats: the store's figures by tier, from state that already counts them.

Per-tier block counts come from state that already counts them (a tier's policy holds exactly
its resident blocks; the SSD tier keeps its record count and used bytes in memory), not from a
walk of the whole index under the lock at every scrape. Remote residency has no such count, so
only a daemon with the remote tier walks the index.

Why no LMDB read here: beginning a read transaction writes LMDB's reader table, and py-lmdb
holds the GIL meanwhile; on a frozen SSD filesystem one Stats call or metrics scrape stalled
every thread of the daemon, host hits included, for as long as the freeze (tiers/ssd/index.py).
"""

from __future__ import annotations

import time
from typing import Any

from .gc_pauses import full_collections
from .leases import LeaseTable
from .state import StoreState
from .tenants import TENANT_KEY

LISTED_MAX = 4096       # namespaces one Stats lists, most blocks first


def stats(state: StoreState, leases: LeaseTable, gpu_slots: Any, daemon_id: str) -> dict:
    """The Stats answer (locked); `gpu_slots`: the gpu tier's calls (kvstore/gpu_slots.py),
    None without one."""
    st = state
    tiers = {}
    host_blocks = len(st.policies["host"])
    ssd_blocks = len(st.ssd) if st.ssd is not None else 0    # (in memory: no LMDB read)
    remote_blocks = st.index.remote_count() if st.remote is not None else 0
    gpu_devices: dict = {}
    if gpu_slots is not None:
        tiers["gpu"], gpu_devices = gpu_slots.stats()
    tiers["host"] = {"capacity_bytes": st.host.capacity, "used_bytes": st.host.used_bytes,
                     "blocks": host_blocks, **st.tier_counters["host"]}
    if st.ssd is not None:
        tiers["ssd"] = {"capacity_bytes": st.ssd.capacity, "used_bytes": st.ssd.used_bytes,
                        "blocks": ssd_blocks, **st.tier_counters["ssd"]}
    if st.remote is not None:
        tiers["remote"] = {"capacity_bytes": st.config.remote.capacity,
                           "used_bytes": st.index.tier_total("remote")[1],
                           "blocks": remote_blocks, **st.tier_counters["remote"],
                           **{f"remote_{k}": v for k, v in st.remote.stats.items()
                              if isinstance(v, (int, float))}}
    for t in tiers.values():
        for k in ("hits", "misses", "evictions"):
            t.setdefault(k, 0)
    out_remote = {} if st.remote is None else st.remote.stats
    counters = {**st.counters, "gc_full_collections": full_collections()}
    return {"tiers": tiers, "counters": counters, "remote": out_remote,
            "gpu_devices": gpu_devices, "namespaces": len(st.namespaces),
            "active_leases": len(leases), "blocks": len(st.index), "daemon_id": daemon_id}


def namespace_list(state: StoreState, leases: LeaseTable, only: set[bytes] | None) -> list[dict]:
    """One record per namespace (of `only`, a tenant's own), most blocks first, at most
    LISTED_MAX (locked). Why: the first thing an operator asks of a full cache is which models
    hold it, and which namespaces sit empty and idle (those a registration at the cap
    reclaims). Every figure is a running count (no walk of blocks), and a tenant's list looks
    only at its own namespaces."""
    idx, used, now = state.index, state.ns_used, time.monotonic()
    names = state.namespaces if only is None else only
    out = []
    for ns_id in names:
        info = state.namespaces.get(ns_id)
        if info is None:
            continue
        spec, last = info.spec, used.get(ns_id)
        out.append({"namespace_id": ns_id, "model": spec.model, "revision": spec.revision,
                    "codec": spec.codec, "shard_rank": spec.shard_rank,
                    "shard_size": spec.shard_size, "tenant": spec.extra.get(TENANT_KEY, ""),
                    "block_bytes": info.block_bytes, "blocks": idx.holds(ns_id),
                    "host_blocks": idx.host_blocks(ns_id),
                    "ssd_blocks": idx.tier_usage(ns_id, "ssd")[0],
                    "remote_blocks": idx.tier_usage(ns_id, "remote")[0],
                    "leases": leases.on_namespace(ns_id),
                    "idle_s": round(now - last, 3) if last is not None else -1.0})
    out.sort(key=lambda r: (-r["blocks"], r["model"]))
    return out[:LISTED_MAX]
