"""Handlers of the slot path: reserve, commit, acquire, release and renew leases over pool
slots, and the fused calls that look a prefix up and take its lease in one round trip.

Why together: each hands out or ends a lease whose slots the client maps and copies through,
so each checks the same things (tier, ttl, the caller owns the namespace or lease) and answers
leases the same way (CallState.lease_out). Finished read leases may ride on a later call
(`release_leases`): an engine loading batch after batch saves a Release round trip each, and
one Release may end many leases (`lease_ids`), each with its own result.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client.common.errors import InvalidArgument, KVStoreError
from kvstore_client.common.limits import MAX_CARRIED_RELEASES

from .state import CallState
from .validate import (
    check_carried,
    check_count,
    check_keys,
    check_lease_id,
    check_ns,
    check_parent,
    check_slot_tier,
    check_ttl,
    parse_request,
)

log = logging.getLogger("kvstore.server")

MAX_RESERVE_AHEAD = 1 << 12   # slots one Commit may reserve for the next store
# Lease ids one Release may end: the bound on its hold of the store lock that the leases a
# call carries have (release_leases), for the same reason.
MAX_RELEASES = MAX_CARRIED_RELEASES


class LeaseCalls:
    def __init__(self, state: CallState) -> None:
        self.s = state

    def Reserve(self, raw: bytes) -> pb.ReserveResponse:
        s = self.s
        req = parse_request(pb.ReserveRequest, raw)
        ns = check_ns(req.namespace_id)
        s.auth.check_ns(ns)
        n = check_count(req.count)
        tier = check_slot_tier(req.tier, s.gpu_enabled)
        s.auth.check_tier(tier)
        ttl = check_ttl(req.ttl_s, s.max_ttl_s)
        dev = {"device": req.device} if req.HasField("device") else {}
        lease = s.store.reserve(ns, n, tier=tier, ttl_s=ttl, **dev)
        return pb.ReserveResponse(lease=s.lease_out(lease))

    def Commit(self, raw: bytes) -> pb.CommitResponse:
        s = self.s
        req = parse_request(pb.CommitRequest, raw, distinct_keys=True)
        self._release_carried(req.release_leases)
        lease_id = check_lease_id(req.lease_id)
        s.auth.check_lease(lease_id)
        keys = check_keys(req.keys, allow_empty=True, distinct=True)
        parent = check_parent(req.parent)
        if req.checksums and len(req.checksums) != len(keys):
            raise InvalidArgument(f"{len(req.checksums)} checksums for {len(keys)} keys; send "
                                  "one per key")
        if keys and not req.checksums:
            self._need_checksums(lease_id)
        lease = s.store.leases.find(lease_id) if req.reserve_next else None
        tokens = {"token_ids": req.token_ids} if req.token_ids else {}
        res = s.store.commit(lease_id, keys, parent=parent,
                             checksums=list(req.checksums) or None,
                             first_slot=req.first_slot, **tokens)
        resp = pb.CommitResponse(stored=res.stored, duplicates=res.duplicates)
        if lease is not None and lease.tier == "host":
            self._reserve_ahead(resp, lease.ns_id, req)
        return resp

    def _need_checksums(self, lease_id: str) -> None:
        """Refuse a Commit of host-memory slots without checksums.

        Why: every client that maps a pool can write into any of its slots, and a client
        whose write lease expired while it was stalled goes on copying into slots the daemon
        has since handed to another lease. Hashing the slots at Commit would publish that
        late write as the new owner's blocks, with a checksum every later read agrees with.
        The owner's own checksums tell its bytes apart. CUDA device slots are hashed by the
        daemon (a client has no cheap hash of device memory there)."""
        lease = self.s.store.leases.find(lease_id)
        if lease is None:
            return                          # unknown or ended: Commit itself says which
        if lease.tier == "gpu":
            gpu = getattr(self.s.store, "gpu", None) or {}
            if not lease.slots or getattr(gpu.get(lease.slots[0].device), "kind", "") != "cpu":
                return
        raise InvalidArgument(
            "Commit carries no checksums: send each block's xxh3-64 of the bytes you wrote "
            "(checksums, one per key); without them the daemon cannot tell your bytes from a "
            "late write into the same slots by a client whose lease on them expired")

    def _reserve_ahead(self, resp: pb.CommitResponse, ns_id: bytes, req: Any) -> None:
        """The write lease for the client's next store, in this Commit's answer. Why: an
        engine stores batch after batch, and reserving the next batch's slots here saves that
        store a round trip. It takes only free room (nothing is evicted for a store that may
        not come); a pool without it answers without one: the client reserves as before, and
        the commit that just succeeded is not failed by a reservation it only asked for
        ahead."""
        s = self.s
        n = min(int(req.reserve_next), MAX_RESERVE_AHEAD)
        ttl = check_ttl(req.next_ttl_s, s.max_ttl_s)
        try:
            nxt = s.store.reserve(ns_id, n, tier="host", ttl_s=ttl, ahead=True)
        except KVStoreError as e:
            s.store.counters["reserve_ahead_refused"] += 1
            log.debug("reserve-ahead of %d slots refused: %s", n, e)
            return
        s.store.counters["reserve_ahead"] += 1
        resp.next_lease.CopyFrom(s.lease_out(nxt))

    def Acquire(self, raw: bytes) -> pb.AcquireResponse:
        s = self.s
        req = parse_request(pb.AcquireRequest, raw, distinct_keys=True)
        self._release_carried(req.release_leases)
        ns = check_ns(req.namespace_id)
        s.auth.check_ns(ns)
        keys = check_keys(req.keys, distinct=True)
        tier = check_slot_tier(req.tier, s.gpu_enabled)
        s.auth.check_tier(tier)
        ttl = check_ttl(req.ttl_s, s.max_ttl_s)
        dev = {"device": req.device} if req.HasField("device") else {}
        lease = s.store.acquire(ns, keys, tier=tier, ttl_s=ttl, **dev)
        return pb.AcquireResponse(lease=s.lease_out(lease))

    def _release_carried(self, lease_ids: Sequence[str]) -> None:
        """Give back the leases a call carries (the client's finished loads), each checked as
        the caller's first; the store ends them in its next hold of the lock
        (Store.release_carried)."""
        s = self.s
        ids = check_carried(lease_ids)
        for lease_id in ids:
            s.auth.check_lease(lease_id)
        if ids:
            s.store.release_carried(ids)

    def Release(self, raw: bytes) -> pb.ReleaseResponse:
        req = parse_request(pb.ReleaseRequest, raw)
        if req.lease_ids:
            return self._release_batch(req)
        lease_id = check_lease_id(req.lease_id)
        self.s.auth.check_lease(lease_id)
        self.s.store.release(lease_id)
        return pb.ReleaseResponse()

    def _release_batch(self, req: Any) -> pb.ReleaseResponse:
        """End every lease a Release names (lease_id, then lease_ids), each with its own
        result: a client giving back many leases waits on one round trip, and one it may not
        release (unknown, expired, another tenant's) costs only that one. The ownership
        checks run first, outside the store lock; the releases then take it once, as the
        carried ones do (kvstore/carried.py), not once per lease behind every other caller."""
        s = self.s
        n = len(req.lease_ids) + bool(req.lease_id)
        if n > MAX_RELEASES:
            raise InvalidArgument(f"{n} lease ids in one Release; the limit is {MAX_RELEASES} "
                                  "(send the rest in another)")
        ids = ([req.lease_id] if req.lease_id else []) + list(req.lease_ids)
        errors: list[KVStoreError | None] = [None] * len(ids)
        owned: list[int] = []
        for i, lease_id in enumerate(ids):
            try:
                s.auth.check_lease(check_lease_id(lease_id))
                owned.append(i)
            except KVStoreError as e:
                errors[i] = e
        if owned:
            with s.store.state.lock:
                for i in owned:
                    try:
                        s.store.release(ids[i])
                    except KVStoreError as e:
                        errors[i] = e
        resp = pb.ReleaseResponse()
        for e in errors:
            if e is None:
                resp.results.add(code="OK")
            else:
                resp.results.add(code=e.code, message=str(e))
        return resp

    def RenewLease(self, raw: bytes) -> pb.RenewLeaseResponse:
        s = self.s
        req = parse_request(pb.RenewLeaseRequest, raw)
        lease_id = check_lease_id(req.lease_id)
        s.auth.check_lease(lease_id)
        ttl = check_ttl(req.ttl_s, s.max_ttl_s)
        return pb.RenewLeaseResponse(deadline=s.store.renew(lease_id, ttl))

    # -- fused calls: one round trip where the protocol allows ---------------------------------
    def _fused_lookup(self, req: Any, counted: bool) -> tuple[bytes, list[bytes], str, float,
                                                               Any]:
        """The checks and the lookup both fused calls start with; `counted`: a hit/miss of
        the cache (LookupAcquire, a load's) or not (LookupReserve, a store's: lookup.py)."""
        s = self.s
        ns = check_ns(req.namespace_id)
        s.auth.check_ns(ns)
        keys = check_keys(req.keys, distinct=True)
        tier = check_slot_tier(req.tier, s.gpu_enabled)
        s.auth.check_tier(tier)
        ttl = check_ttl(req.ttl_s, s.max_ttl_s)
        return ns, keys, tier, ttl, s.lookup(ns, keys, counted)

    def LookupReserve(self, raw: bytes) -> pb.LookupReserveResponse:
        """Lookup, then Reserve slots for the missing keys (at most max_slots)."""
        s = self.s
        req = parse_request(pb.LookupReserveRequest, raw, distinct_keys=True)
        ns, keys, tier, ttl, res = self._fused_lookup(req, counted=False)
        resp = pb.LookupReserveResponse(
            prefix_blocks=res.prefix_blocks,
            per_tier={str(k): int(v) for k, v in res.per_tier.items()})
        missing = len(keys) - res.prefix_blocks
        if missing > 0:
            n = min(missing, req.max_slots) if req.max_slots else missing
            dev = {"device": req.device} if req.HasField("device") else {}
            lease = s.store.reserve(ns, check_count(n), tier=tier, ttl_s=ttl, **dev)
            resp.lease.CopyFrom(s.lease_out(lease))
        return resp

    def LookupAcquire(self, raw: bytes) -> pb.LookupAcquireResponse:
        """Lookup, then Acquire the cached prefix under a read lease."""
        s = self.s
        req = parse_request(pb.LookupAcquireRequest, raw, distinct_keys=True)
        self._release_carried(req.release_leases)
        ns, keys, tier, ttl, res = self._fused_lookup(req, counted=True)
        resp = pb.LookupAcquireResponse(
            prefix_blocks=res.prefix_blocks,
            per_tier={str(k): int(v) for k, v in res.per_tier.items()})
        if res.prefix_blocks:
            dev = {"device": req.device} if req.HasField("device") else {}
            lease = s.store.acquire(ns, keys[:res.prefix_blocks], tier=tier, ttl_s=ttl, **dev)
            if lease.slots:
                resp.lease.CopyFrom(s.lease_out(lease))
            else:                       # nothing could be pinned: hold nothing
                s.store.release(lease.id, missing_ok=True)
        return resp
