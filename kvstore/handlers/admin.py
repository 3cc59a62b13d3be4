"""Handlers that manage what is stored rather than move it: delete, retention hints, evict,
flush and statistics.

Why together: with tenants each acts only within the caller's scope (`Auth.scope()`: the
namespaces it owns, or everything for an admin), so a tenant can neither see nor evict nor
flush another's blocks; without tenants the scope is everything.

Why a Flush has a deadline and a tenant one Flush at a time: when writes outrun the disk a
Flush can take long, and it holds a gRPC worker all that while. It ends at
`limits.request_deadline_s` of its start or at the client's own deadline, whichever comes
first (DEADLINE_EXCEEDED, having written what it could), and as soon as the client goes away
(client_call.py). A tenant's second Flush while one runs is refused at once
(RESOURCE_EXHAUSTED): Flushes a client gave up on tied up every worker, and the daemon's other
calls then waited for one.
"""

from __future__ import annotations

import threading

from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client.common.errors import InvalidArgument, ResourceExhausted

from ..scoped import scoped_stats
from . import client_call
from .replies import add_namespaces, stats_to_proto
from .state import CallState
from .validate import TIERS, check_keys, check_ns, parse_request


class AdminCalls:
    def __init__(self, state: CallState) -> None:
        self.s = state
        limits = getattr(getattr(state.store, "config", None), "limits", None)
        self._flush_s = limits.request_deadline_s if limits is not None else 30.0
        self._flushing: set[str | None] = set()     # tenants with a Flush running
        self._flushing_lock = threading.Lock()

    def Delete(self, raw: bytes) -> pb.DeleteResponse:
        req = parse_request(pb.DeleteRequest, raw)
        ns = check_ns(req.namespace_id)
        self.s.auth.check_ns(ns)
        if req.all and req.keys:
            raise InvalidArgument("pass either keys or all=true, not both")
        if not req.all and not req.keys:
            raise InvalidArgument("nothing to delete: pass keys, or all=true for the whole "
                                  "namespace")
        keys = None if req.all else check_keys(req.keys)
        return pb.DeleteResponse(deleted=int(self.s.store.delete(ns, keys)))

    def Retain(self, raw: bytes) -> pb.RetainResponse:
        req = parse_request(pb.RetainRequest, raw)
        ns = check_ns(req.namespace_id)
        self.s.auth.check_ns(ns)
        keys = check_keys(req.keys)
        return pb.RetainResponse(blocks=int(self.s.store.retain(ns, keys, req.level)))

    def Evict(self, raw: bytes) -> pb.EvictResponse:
        req = parse_request(pb.EvictRequest, raw)
        if req.tier not in TIERS:
            raise InvalidArgument(f"tier {req.tier[:40]!r} is not one of {list(TIERS)}")
        scope = self.s.auth.scope()
        store = self.s.store
        deadline, cancelled = client_call.bounds(self._flush_s)   # (as Flush's)
        res = store.evict(req.tier, int(req.bytes), only=scope, deadline=deadline,
                          cancelled=cancelled)
        freed, blocks = res if isinstance(res, tuple) else (res, 0)
        return pb.EvictResponse(freed_bytes=int(freed), blocks=int(blocks))

    def Flush(self, raw: bytes) -> pb.FlushResponse:
        parse_request(pb.FlushRequest, raw)
        scope = self.s.auth.scope()
        caller = self.s.auth.caller
        who = caller.name if caller is not None else None
        with self._flushing_lock:
            if who in self._flushing:
                raise ResourceExhausted(
                    ("a Flush" if who is None else f"tenant {who}'s Flush") + " is already "
                    "running; one at a time: retry when it ends")
            self._flushing.add(who)
        try:
            deadline, cancelled = client_call.bounds(self._flush_s)
            done = self.s.store.flush(only=scope, deadline=deadline, cancelled=cancelled)
        finally:
            with self._flushing_lock:
                self._flushing.discard(who)
        return pb.FlushResponse(demoted=int(done or 0))

    def Stats(self, raw: bytes) -> pb.StatsResponse:
        req = parse_request(pb.StatsRequest, raw)
        scope = self.s.auth.scope()
        store = self.s.store
        if scope is None:
            resp = stats_to_proto(store.stats(), store.daemon_id)
        else:
            resp = stats_to_proto(scoped_stats(store, scope), store.daemon_id)
        if req.list_namespaces:
            add_namespaces(resp, store.namespace_list(scope))
        return resp
