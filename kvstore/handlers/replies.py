"""Store results as protobuf replies: leases and statistics.

Why its own module: both are built on hot paths or from loosely typed input, and each has a
reason it is written the way it is (slots as dicts, counters filtered to numbers) that belongs
next to the code rather than inside a handler.
"""

from __future__ import annotations

from typing import Any

from kvstore_client._proto import kvstore_pb2 as pb


def lease_to_proto(lease: Any) -> pb.Lease:
    # Slots as dicts: building a pb.Slot per slot cost ~4x as much, a visible share of a
    # 1,024-block lease's round trip (small blocks must pay per batch, not per block).
    return pb.Lease(lease_id=lease.id, deadline=lease.deadline, tier=lease.tier,
                    slots=[{"offset": s.offset, "length": s.length, "device": s.device}
                           for s in lease.slots],
                    keys=lease.keys, checksums=lease.checksums)


def stats_to_proto(stats: dict, daemon_id: str) -> pb.StatsResponse:
    """store.stats() -> StatsResponse; counters keep only numeric values (proto map of double)."""
    def u64(v: Any) -> int:
        return max(0, int(v)) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0

    resp = pb.StatsResponse(namespaces=u64(stats.get("namespaces", 0)),
                            active_leases=u64(stats.get("active_leases", 0)),
                            daemon_id=str(stats.get("daemon_id") or daemon_id))
    for name, t in stats.get("tiers", {}).items():
        resp.tiers.add(name=name, capacity_bytes=u64(t.get("capacity_bytes")),
                       used_bytes=u64(t.get("used_bytes")), blocks=u64(t.get("blocks")),
                       hits=u64(t.get("hits")), misses=u64(t.get("misses")),
                       evictions=u64(t.get("evictions")))
    for name, v in stats.get("counters", {}).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            resp.counters[str(name)] = float(v)
    return resp


def add_namespaces(resp: pb.StatsResponse, records: list[dict]) -> None:
    """store.namespace_list() records into a StatsResponse's namespace_list."""
    for r in records:
        resp.namespace_list.add(**r)
