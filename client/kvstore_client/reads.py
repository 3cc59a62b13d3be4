"""How a load reaches the daemon: a read lease on the mapped pool, or a Get stream.

Same host, a load is one Acquire (the daemon pins the cached prefix and names its slots),
a verified copy out of the pool through a `Drain`, and a Release sent later off the load's
path. Elsewhere it is one Get whose reply messages are drained as they come. `pin` is the
first half of the same-host load, kept open: the engine learns what is cached and can copy it
with no further call. Namespace (namespace.py) is the face of these functions; they take it
for its connection, its id (which a re-registration changes) and its block size.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from ._proto import kvstore_pb2 as pb
from .buffers import check_seq, copy_block, raw_view, slot_view
from .common.errors import DataLoss, InvalidArgument, LeaseExpired, Unimplemented, from_rpc_error
from .common.read_ahead import ReadAhead
from .pool_copy import Drain, Stale, check_slots, current_pool, drain_verified, pool_bytes
from .wire import decode_get

if TYPE_CHECKING:
    from .host_pool import MappedPool
    from .namespace import Namespace

log = logging.getLogger(__name__)

# A Get expected to span more than one reply message (the daemon sends ~4 MiB a message) is
# received on a thread of its own while the caller drains what came (common/read_ahead.py).
_READ_AHEAD_BYTES = 4 << 20
_READ_AHEAD_DEPTH = 2


@dataclass
class LookupResult:
    """Longest cached prefix in blocks, overall and per tier."""

    prefix_blocks: int
    per_tier: dict[str, int]


def seq_drain(ns: Namespace, out: Any) -> Drain:
    """The drain that copies blocks into a sequence-layout `out` (block i at tokens
    [i*T, (i+1)*T)): the compiled kernel's where it applies, else block by block."""
    T = ns.layout.block_tokens
    dst = raw_view(out, ns.layout, "out")
    plan = ns.copy_plan(dst)
    if plan is not None:
        return ns.fused_move(plan, False)

    def drain(base: np.ndarray, offsets: Sequence[int], first: int) -> None:
        for j, off in enumerate(offsets):
            i = first + j
            copy_block(dst[:, :, i * T:(i + 1) * T], slot_view(base, off, ns.layout, dst))
    return drain


def load_once(ns: Namespace, keys: list[bytes], drain: Drain) -> int:
    if ns.client.pool is not None:
        return _load_shm(ns, keys, drain)
    return _load_grpc(ns, keys, drain)


def _load_shm(ns: Namespace, keys: list[bytes], drain: Drain) -> int:
    client = ns.client
    pool = current_pool(client)
    lease = client.call_carrying("Acquire", pb.AcquireRequest(
        namespace_id=ns.ns_id, keys=keys, tier="host", ttl_s=client.lease_ttl_s)).lease
    if not lease.slots:
        if lease.lease_id:
            client.release_later(lease.lease_id)
        return 0
    client.leases.add(lease.lease_id, lease.deadline)
    try:
        return drain_lease(ns, lease, keys, pool, drain)
    finally:
        # Off the load's path: the bytes are copied and verified by now (leases.py).
        client.release_later(lease.lease_id)


def drain_lease(ns: Namespace, lease: Any, keys: Sequence[bytes], pool: MappedPool,
                drain: Drain) -> int:
    """Copy a read lease's blocks out through drain, verified; blocks of the good prefix."""
    client, bb, lid = ns.client, ns.block_bytes, lease.lease_id
    offsets = check_slots(lease.slots, pool, bb)
    n = len(offsets)
    if list(lease.keys[:n]) != list(keys[:n]):
        raise DataLoss("the daemon's read lease names other keys than were asked for")
    if pool.replaced:
        # The call that gave the lease met a restarted daemon and took a new session: its
        # slots are in the new run's pool, which this (tenant, memfd) mapping is not.
        raise Stale("host pool replaced by a restarted daemon")
    want = list(lease.checksums) if client.verify else []
    good = drain_verified(drain, pool_bytes(pool), offsets, bb,
                          want if len(want) == n else None)
    if not client.leases.ok(lid):
        client.counters["leases_lost"] += 1
        raise Stale(f"read lease {lid} expired during the copy")
    if good < n:
        client.counters["checksum_failures"] += 1
        if not pool.current() or client.pool_moved(pool):
            raise Stale("host pool segment replaced during the copy")
        client.counters["corrupt_blocks"] += 1
        log.warning("kvstore: block %d of a load failed its checksum; serving the %d "
                    "blocks before it", good, good)
    return good


def pin_once(ns: Namespace, keys: list[bytes]) -> Pinned:
    client = ns.client
    pool = current_pool(client)
    req = dict(namespace_id=ns.ns_id, keys=keys, tier="host", ttl_s=client.lease_ttl_s)
    lease, res = None, None
    if client.fused_rpcs:
        try:
            r = client.call_carrying("LookupAcquire", pb.LookupAcquireRequest(**req))
            res = LookupResult(int(r.prefix_blocks), {k: int(v) for k, v in
                                                      r.per_tier.items()})
            lease = r.lease if r.HasField("lease") else None
        except Unimplemented:
            log.info("kvstore: daemon has no LookupAcquire; using Lookup + Acquire")
            client.fused_rpcs = False
    if res is None:
        res = ns.lookup_result(keys)
        if res.prefix_blocks:
            lease = client.call("Acquire", pb.AcquireRequest(**req)).lease
    if lease is not None and not lease.slots:
        if lease.lease_id:
            client.release(lease.lease_id)
        lease = None
    if lease is not None:
        client.leases.add(lease.lease_id, lease.deadline)
    return Pinned(ns, keys, res, lease, pool)


def _load_grpc(ns: Namespace, keys: list[bytes], drain: Drain) -> int:
    client = ns.client
    drain = getattr(drain, "_kvstore_unhashed", drain)     # nothing to verify against
    n = 0
    msgs: ReadAhead | None = None
    try:
        call = client._get(pb.GetRequest(namespace_id=ns.ns_id, keys=keys),
                           timeout=client.timeout, wait_for_ready=True,
                           metadata=client.metadata)
        # A reply of several messages: the next is received while this one is drained.
        if len(keys) * ns.block_bytes > _READ_AHEAD_BYTES:
            msgs = ReadAhead(call, _READ_AHEAD_DEPTH, cancel=call.cancel,
                             name="kvstore-get-read", inline=1)
        for raw in msgs if msgs is not None else call:
            base = np.frombuffer(raw, dtype=np.uint8)
            blocks = decode_get(raw)
            for k, (key, _off, length) in enumerate(blocks):
                if n + k >= len(keys) or key != keys[n + k] or length != ns.block_bytes:
                    raise DataLoss("the daemon's Get stream returned an unexpected block "
                                   f"(#{n + k}, {length} bytes)")
            if blocks:
                drain(base, [off for _, off, _ in blocks], n)
                n += len(blocks)
    except grpc.RpcError as e:
        raise from_rpc_error(e, "Get", client.target) from None
    finally:
        if msgs is not None:
            msgs.close()
    return n


class Pinned:
    """A cached prefix pinned in the host pool by `Namespace.pin`: `lookup` is what the daemon
    found (per tier), `blocks` how many leading blocks are pinned and loadable now."""

    def __init__(self, ns: Namespace, keys: list[bytes], lookup: LookupResult, lease: Any,
                 pool: MappedPool) -> None:
        self.ns, self.keys, self.lookup, self._lease, self._pool = ns, keys, lookup, lease, pool
        self.blocks = len(lease.slots) if lease is not None else 0

    def load_blocks(self, drain: Drain) -> int:
        """Copy the pinned blocks out through drain (verified); returns blocks loaded."""
        if self._lease is None:
            return 0
        try:
            return drain_lease(self.ns, self._lease, self.keys, self._pool, drain)
        except Stale as e:
            raise LeaseExpired(f"pinned prefix lost ({e}); pin again") from None

    def load_keys(self, out: Any) -> int:
        """Fill out[:, :, :n*T] with the pinned blocks (as Namespace.load_keys); returns n."""
        ns = self.ns
        T = ns.layout.block_tokens
        check_seq(out, ns.layout, 0, "out")
        if out.shape[2] < self.blocks * T:
            raise InvalidArgument(f"out holds {out.shape[2]} tokens; the pinned prefix is "
                                  f"{self.blocks * T}")
        return self.load_blocks(seq_drain(ns, out))

    def release(self) -> None:
        """Unpin (idempotent)."""
        lease, self._lease = self._lease, None
        if lease is not None:
            self.ns.client.release_later(lease.lease_id)

    def __enter__(self) -> Pinned:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
