"""What every group of RPC handlers shares: the store, the caller's checks, the limits a request
is held to, and the two answers every group needs (a namespace's block size, a lease as the
caller maps it).

Why one object handed to each group: the groups (namespaces.py, leases.py, streams.py,
admin.py) are separate so each can be read alone, and they must agree on these: a block-size
cache filled by RegisterNamespace is what Put's parser sizes blocks by, and a tenant's lease
offsets must be shifted the same way wherever a lease is answered.
"""

from __future__ import annotations

from typing import Any

from kvstore_client._proto import kvstore_pb2 as pb

from ..auth import Auth
from .replies import lease_to_proto


class CallState:
    """The servicer's shared state; `tenant_counters` (kvstore/tenant_metrics.py) is set by the
    daemon where tenants are configured."""

    def __init__(self, store: Any, auth: Auth, max_ttl_s: float, gpu_enabled: bool) -> None:
        self.store = store
        self.auth = auth                  # identity and ownership checks (kvstore/auth.py)
        self.max_ttl_s = max_ttl_s
        self.gpu_enabled = gpu_enabled
        self.tenant_counters: Any = None  # per-tenant lookups
        self._block_bytes: dict[bytes, int] = {}

    def block_bytes(self, ns_id: bytes) -> int | None:
        """The namespace's block size (NotFound for an unknown namespace; None from a store
        that does not say)."""
        bb = self._block_bytes.get(ns_id)
        if bb is None:
            lookup = getattr(self.store, "namespace", None)
            if lookup is None:
                return None
            bb = int(lookup(ns_id).block_bytes)   # NotFound for an unknown namespace
            self._block_bytes[ns_id] = bb
        return bb

    def remember_block_bytes(self, ns_id: bytes, block_bytes: int) -> None:
        self._block_bytes[ns_id] = block_bytes

    def lookup(self, ns: bytes, keys: list[bytes], counted: bool = True) -> Any:
        """store.lookup, counted per tenant where tenants are configured; `counted`: False for
        a store's lookup of what not to write (kvstore/lookup.py: not a hit or a miss)."""
        res = self.store.lookup(ns, keys, counted)
        if counted and self.tenant_counters is not None:
            caller = self.auth.caller
            self.tenant_counters.lookup(caller.name if caller else None, len(keys),
                                        res.prefix_blocks)
        return res

    def lease_out(self, lease: Any) -> pb.Lease:
        """A lease as the client maps it: slots in a tenant's own pool count from its start."""
        msg = lease_to_proto(lease)
        if self.auth.enabled and lease.tier == "host":
            base = self.store.tenant_base(self.store.owner(lease.ns_id))
            if base:
                for slot in msg.slots:
                    slot.offset -= base
        elif self.auth.enabled and lease.tier == "gpu":
            bases = {d: b for d, b, _ in self.store.gpu_segments_of(
                self.store.owner(lease.ns_id))}
            for slot in msg.slots:
                slot.offset -= bases.get(slot.device, 0)
        return msg
