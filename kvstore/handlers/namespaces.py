"""Handlers that name things: register a namespace, look a prefix up, locate blocks per tier.

Why together: none of them moves block bytes or holds a lease; they answer from the index, and
RegisterNamespace decides what the caller may see of the shared pools (a tenant that is not
admin gets no name of them: it streams over Put/Get, or is handed its own pool by
kvstore/handoff.py).
"""

from __future__ import annotations

import threading

from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client.common.errors import InvalidArgument

from ..prefetch import Prefetcher
from .state import CallState
from .validate import TIERS, check_keys, check_ns, parse_request, spec_from_proto

# RegisterNamespaceResponse.protocol: 2 = Commit.reserve_next/first_slot and release_leases;
# 3 = a Put block split across messages (kvstore.proto, PutRequest); 4 = PutRequest.token_ids.
PROTOCOL = 4


def _no(_ns_id: bytes) -> bool:
    return False


class NamespaceCalls:
    def __init__(self, state: CallState) -> None:
        self.s = state
        self._prefetcher: Prefetcher | None = None
        self._prefetcher_lock = threading.Lock()

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()

    def _prefetch(self) -> Prefetcher:
        with self._prefetcher_lock:
            if self._prefetcher is None:
                self._prefetcher = Prefetcher(self.s.store)
            return self._prefetcher

    def RegisterNamespace(self, raw: bytes) -> pb.RegisterNamespaceResponse:
        s = self.s
        req = parse_request(pb.RegisterNamespaceRequest, raw)
        if not req.HasField("spec"):
            raise InvalidArgument("spec is missing: RegisterNamespace needs the namespace spec")
        spec = s.auth.tag(spec_from_proto(req.spec, req.spec.HasField("layout")))
        info = s.store.register_namespace(spec)
        block_bytes = int(getattr(info, "block_bytes", spec.layout.block_bytes))
        s.remember_block_bytes(bytes(info.ns_id), block_bytes)
        caller = s.auth.caller
        shared = caller is None or caller.admin
        own = s.store.tenant_pool(caller) if caller is not None else None
        host = ({"kind": "memfd", "name": "", "size": own[1]} if own is not None
                else s.store.host_info() if shared else {})
        resp = pb.RegisterNamespaceResponse(
            namespace_id=info.ns_id, block_bytes=block_bytes, daemon_id=s.store.daemon_id,
            protocol=PROTOCOL,
            wants_token_ids=bool(getattr(s.store, "wants_token_ids", _no)(info.ns_id)),
            host_pool=pb.HostPool(kind=str(host.get("kind", "")), name=str(host.get("name", "")),
                                  size=int(host.get("size", 0))))
        own_gpu = s.store.gpu_segments_of(caller.name) if caller is not None else []
        for g in (s.store.gpu_info(own_gpu) if own_gpu else
                  s.store.gpu_info() if shared else ()):
            resp.gpu_pools.add(device=int(g.get("device", 0)),
                               ipc_handle=bytes(g.get("ipc_handle", b"")),
                               size=int(g.get("size", 0)), owner_pid=int(g.get("owner_pid", 0)),
                               kind=str(g.get("kind", "")), name=str(g.get("name", "")))
        return resp

    def Lookup(self, raw: bytes) -> pb.LookupResponse:
        req = parse_request(pb.LookupRequest, raw, distinct_keys=True)
        ns = check_ns(req.namespace_id)
        self.s.auth.check_ns(ns)
        keys = check_keys(req.keys, allow_empty=True, distinct=True)
        res = self.s.lookup(ns, keys, counted=not req.for_store)
        return pb.LookupResponse(prefix_blocks=res.prefix_blocks,
                                 per_tier={str(k): int(v) for k, v in res.per_tier.items()})

    def Locate(self, raw: bytes) -> pb.LocateResponse:
        req = parse_request(pb.LocateRequest, raw, distinct_keys=True)
        ns = check_ns(req.namespace_id)
        self.s.auth.check_ns(ns)
        keys = check_keys(req.keys, allow_empty=True, distinct=True)
        where = self.s.store.where(ns, keys)
        if self.s.tenant_counters is not None:      # a load's lookup, as Lookup (lookup.py)
            caller = self.s.auth.caller
            self.s.tenant_counters.lookup(caller.name if caller else None, len(keys),
                                          len(keys) - where.count(None))
        names = [t for t in TIERS if t in set(where)]
        code = {t: i + 1 for i, t in enumerate(names)}
        resp = pb.LocateResponse(tier_names=names, where=bytes(code.get(t, 0) for t in where))
        if req.prefetch and any(t is not None and t != "host" for t in where):
            caller = self.s.auth.caller
            resp.prefetching = self._prefetch().submit(
                ns, keys, where, tenant=None if caller is None else caller.name)
        return resp
