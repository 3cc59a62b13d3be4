"""How a store reaches the daemon: slots of the mapped pool under a write lease, or Put.

Same host, a store is a write lease on host-pool slots (Reserve, or LookupReserve with the
lookup of the cached prefix in the same round trip), a checksummed copy into them through a
`Fill`, and a Commit. In steady state it is one round trip: each Commit reserves the next
store's slots (the spare lease), and the next store fills them while its lookup is in flight
(`_store_ahead`). Elsewhere the blocks stream over Put, staged or straight from the caller's
arrays. Namespace (namespace.py) is the face of this; a Writer holds one namespace's state
of the write path (the spare lease, whether its stores find blocks cached, Put staging).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from ._proto import kvstore_pb2 as pb
from .buffers import PAGE, StagingBuffers
from .common.errors import DataLoss, DeadlineExceeded, LeaseExpired, Unimplemented, from_rpc_error
from .common.read_ahead import ReadAhead
from .pool_copy import Fill, Stale, check_slots, current_pool, fill_checksummed, pool_bytes
from .wire import encode_put, split_put

if TYPE_CHECKING:
    from .namespace import Namespace

log = logging.getLogger(__name__)

# Put streams carry about this many block bytes per message (and per RPC at most _PUT_RPC_BYTES),
# bounding the client's temporary memory; a daemon receives messages of at most 4 MiB by default
# (server.max_receive_bytes), so a bigger block goes alone, split across messages, where the
# daemon takes that (protocol 3).
_PUT_MESSAGE_BYTES = 2 << 20
_PUT_RPC_BYTES = 64 << 20
# Put messages are encoded on a thread of their own this many ahead of the wire.
_READ_AHEAD_DEPTH = 2
# A Reserve asks for at most this share of the host pool (the daemon refuses batches that do not
# fit below its high watermark) and at most this many slots.
_RESERVE_POOL_SHARE = 0.25
_RESERVE_MAX_SLOTS = 1024
# A store into a lease reserved ahead fills this many bytes at a time from the end of its batch,
# checking between pieces whether the lookup of the cached prefix has answered.
_AHEAD_CHUNK_BYTES = 16 << 20
# A spare lease with less life than this left is given back rather than used.
_SPARE_MARGIN_S = 0.5


class Writer:
    """The write path of one namespace (`ns`, read at each call: a re-registration changes its
    id)."""

    def __init__(self, ns: Namespace) -> None:
        self.ns = ns
        self.staging = StagingBuffers()      # Put's staged blocks, one buffer per call
        self.spare: Any | None = None          # write lease a Commit reserved ahead
        self._spare_lock = threading.Lock()
        # Whether this namespace's last store found blocks cached. A store into a spare lease
        # looks up its cached prefix only then: where stores are new blocks (an engine's own
        # offloads), that lookup would cost a round trip of CPU for nothing; when the guess is
        # wrong, the store copies blocks the daemon already has, and Commit counts them as
        # duplicates (slower, never wrong), which turns the lookup back on.
        self.prefix_seen = True

    def drop_spare(self) -> None:
        """Forget the spare lease: reserved by a daemon run a (re-)registration replaces."""
        self.spare = None

    def store_once(self, keys: list[bytes], fill: Fill, parent: bytes | None,
                   parts: Callable[[int], list[Any]] | None = None,
                   tokens: bytes | None = None) -> int:
        """Store the blocks of `keys` not cached yet; `parts(i)` (contiguous pieces of block i)
        lets Put skip its staging copy; `tokens` go with the blocks where the daemon wants
        them. One attempt: Namespace retries it once after a daemon restart."""
        ns = self.ns
        if ns.client.pool is not None:
            return self._store_shm(keys, parent, fill, tokens)
        have = cached_prefix(self.ns, keys)
        if have >= len(keys):
            return 0
        first_parent = keys[have - 1] if have else (parent or b"")
        # Asked again here: a retry follows a re-registration, which may have changed them; a
        # daemon before protocol 4 refuses a Put field it does not know.
        send = ns.client.put_tokens and ns.wants_token_ids
        return self._store_grpc(keys, have, first_parent, fill, parts,
                                tokens if send else None)

    def _reserve_batch(self) -> int:
        pool = self.ns.client.pool
        per = (self.ns.block_bytes + PAGE - 1) // PAGE * PAGE
        cap = int(pool.size * _RESERVE_POOL_SHARE) // per if pool is not None else 1
        return max(1, min(_RESERVE_MAX_SLOTS, cap))

    def _lookup_reserve(self, keys: list[bytes]) -> tuple[int, Any]:
        """(cached prefix, write lease for the next missing blocks or None) in one round trip;
        Lookup then (later) Reserve against a daemon that predates LookupReserve."""
        client = self.ns.client
        if client.fused_rpcs:
            try:
                r = client.call("LookupReserve", pb.LookupReserveRequest(
                    namespace_id=self.ns.ns_id, keys=keys, tier="host",
                    ttl_s=client.lease_ttl_s, max_slots=self._reserve_batch()))
                return int(r.prefix_blocks), (r.lease if r.HasField("lease") else None)
            except Unimplemented:
                log.info("kvstore: daemon has no LookupReserve; using Lookup + Reserve")
                client.fused_rpcs = False
        return cached_prefix(self.ns, keys), None

    def _store_shm(self, keys: list[bytes], parent: bytes | None, fill: Fill,
                   tokens: bytes | None = None) -> int:
        """Steady state, one round trip on the store's path: the previous store's Commit
        reserved this one's slots (`_store_ahead`). Otherwise LookupReserve, then Commit."""
        lease = self._take_spare(len(keys))
        if lease is not None:
            return self._store_ahead(keys, parent, fill, lease, tokens)
        ns = self.ns
        T = 4 * ns.layout.block_tokens           # bytes of token ids a block
        client, bb = ns.client, ns.block_bytes
        pool = current_pool(client)
        have, lease = self._lookup_reserve(keys)
        self.prefix_seen = have > 0
        if have >= len(keys):
            if lease is not None:
                client.release_later(lease.lease_id)
            return 0
        parent = keys[have - 1] if have else (parent or b"")
        stored = 0
        i = have
        while i < len(keys):
            n = min(len(keys) - i, self._reserve_batch())
            if lease is None:
                pool = current_pool(client)
                lease = client.call("Reserve", pb.ReserveRequest(
                    namespace_id=ns.ns_id, count=n, tier="host",
                    ttl_s=client.lease_ttl_s)).lease
            client.leases.add(lease.lease_id, lease.deadline)
            try:
                offsets = check_slots(lease.slots, pool, bb)[:n]
                n = len(offsets)
                sums = fill_checksummed(fill, pool_bytes(pool), offsets, i, bb)
            except BaseException:
                client.release_later(lease.lease_id)    # off the failing call's deadline
                raise
            last = i + n >= len(keys)
            stored += self._commit(lease, keys[i:i + n], parent, sums,
                                   ahead=len(keys) if last else 0,
                                   tokens=tokens[i * T:(i + n) * T] if tokens else None)
            lease = None
            parent = keys[i + n - 1]
            i += n
        return stored

    def _store_ahead(self, keys: list[bytes], parent: bytes | None, fill: Fill,
                     lease: Any, tokens: bytes | None = None) -> int:
        """Store into a lease reserved ahead, with the lookup of the cached prefix (when one
        is expected: `prefix_seen`) in flight meanwhile: blocks are filled from the end of
        the batch, and filling stops at the prefix once its answer is in. So the store waits
        on one round trip (its Commit), and a cached prefix is still not copied (except what
        was filled before the answer came)."""
        ns = self.ns
        client, bb, n = ns.client, ns.block_bytes, len(keys)
        deadline: float | None = None
        try:
            pool = current_pool(client)
            offsets = check_slots(lease.slots, pool, bb)[:n]
            have: int | None = None
            look = None
            if self.prefix_seen:
                # The store's one deadline: the Commit gets what waiting on the lookup left.
                deadline = time.monotonic() + client.timeout
                look = client.call_future("Lookup", pb.LookupRequest(
                    namespace_id=ns.ns_id, keys=keys, for_store=True))
            else:
                have = 0
            sums = [0] * n
            per = max(1, _AHEAD_CHUNK_BYTES // bb)
            hi = n
            while hi > (have or 0):
                if have is None and look.done():
                    have = prefix_of(look)
                    continue
                lo = max(hi - per, 0) if have is None else have    # answered: the rest at once
                base = pool_bytes(pool)       # each piece: a re-map may close it
                sums[lo:hi] = fill_checksummed(fill, base, offsets[lo:hi], lo, bb)
                hi = lo
            if have is None:
                have = prefix_of(look)
        except BaseException:
            client.release_later(lease.lease_id)
            raise
        self.prefix_seen = have > 0
        if have >= n:                       # all cached: the slots wait for the next store
            if client.leases.remove(lease.lease_id):
                self._keep_spare(lease)
            else:
                client.release_later(lease.lease_id)
            return 0
        T = 4 * ns.layout.block_tokens           # bytes of token ids a block
        return self._commit(lease, keys[have:], keys[have - 1] if have else (parent or b""),
                            sums[have:], ahead=n, first_slot=have,
                            tokens=tokens[have * T:] if tokens else None, deadline=deadline)

    def _commit(self, lease: Any, keys: list[bytes], parent: bytes, sums: list[int], *,
                ahead: int = 0, first_slot: int = 0, tokens: bytes | None = None,
                deadline: float | None = None) -> int:
        """Commit a filled write lease; with `ahead`, reserve that many slots for the next
        store in the same call (kept as the spare). Returns blocks stored. `deadline`: the
        store's, when part of it went before (its lookup); else the Commit's own timeout.

        A failed Commit's lease is released from the lease thread: a synchronous Release
        would wait on the same unresponsive daemon again, past the store's deadline, and its
        error would hide the Commit's (the daemon reaps the lease at its deadline anyway)."""
        client, lid = self.ns.client, lease.lease_id
        if not client.leases.remove(lid):
            client.counters["leases_lost"] += 1
            client.release_later(lid)
            raise LeaseExpired(f"write lease {lid} expired during the copy")
        ahead = min(ahead, self._reserve_batch())
        try:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise DeadlineExceeded(f"Commit: the store's deadline ({client.timeout:g} s) "
                                       "passed waiting for its lookup")
            r = client.call_carrying("Commit", pb.CommitRequest(
                lease_id=lid, keys=keys, parent=parent, checksums=sums, first_slot=first_slot,
                reserve_next=ahead, next_ttl_s=client.lease_ttl_s, token_ids=tokens or b""),
                timeout=left)
        except DataLoss as e:
            # Our bytes did not arrive where the daemon looks: a replaced segment (the daemon
            # freed the lease already).
            raise Stale(str(e)) from None
        except BaseException:
            client.release_later(lid)
            raise
        if r.duplicates:
            self.prefix_seen = True
        if r.HasField("next_lease") and r.next_lease.slots:
            self._keep_spare(r.next_lease)
        return int(r.stored)

    def _keep_spare(self, lease: Any) -> None:
        leases = self.ns.client.leases
        leases.keep_spare(lease.lease_id, lease.deadline)
        with self._spare_lock:
            old, self.spare = self.spare, lease
        if old is not None and leases.take_spare(old.lease_id, 0.0):
            self.ns.client.release_later(old.lease_id)

    def _take_spare(self, n: int) -> Any | None:
        """The write lease a Commit reserved ahead, if it is still held and holds n slots."""
        with self._spare_lock:
            lease, self.spare = self.spare, None
        if lease is None:
            return None
        client = self.ns.client
        if not client.leases.take_spare(lease.lease_id, _SPARE_MARGIN_S):
            return None
        if len(lease.slots) < n:
            client.release_later(lease.lease_id)
            return None
        client.leases.add(lease.lease_id, lease.deadline)
        return lease

    def _store_grpc(self, keys: list[bytes], start: int, parent: bytes, fill: Fill,
                    parts: Callable[[int], list[Any]] | None = None,
                    tokens: bytes | None = None) -> int:
        """Put streams; `parts(i)` (contiguous pieces of block i) skips the staging copy;
        `tokens` (every key's, as Namespace.token_bytes gives them) go with their blocks'
        messages."""
        stride = (self.ns.block_bytes + PAGE - 1) // PAGE * PAGE
        per_rpc = max(1, _PUT_RPC_BYTES // stride)
        # This call's own staging (StagingBuffers: gRPC reads it lazily while the Put runs).
        staging = (self.staging.take(min(len(keys) - start, per_rpc) * stride)
                   if parts is None else None)
        done = False
        try:
            stored = self._put_all(keys, start, parent, fill, parts, tokens, staging)
            done = True
        finally:
            # Given back only after a Put that the daemon answered, having read every message;
            # a failed one may leave gRPC's sender thread still encoding from it.
            if staging is not None and done:
                self.staging.give(staging)
        return stored

    def _put_all(self, keys: list[bytes], start: int, parent: bytes, fill: Fill,
                 parts: Callable[[int], list[Any]] | None, tokens: bytes | None,
                 staging: np.ndarray | None) -> int:
        """The Put RPCs of one store, up to _PUT_RPC_BYTES each, each filled into `staging`
        (this call's alone) just before it is sent."""
        ns = self.ns
        client, bb = ns.client, ns.block_bytes
        tb = 4 * ns.layout.block_tokens           # token id bytes a block
        stride = (bb + PAGE - 1) // PAGE * PAGE
        per_rpc = max(1, _PUT_RPC_BYTES // stride)
        per_msg = max(1, _PUT_MESSAGE_BYTES // bb)
        split = bb > _PUT_MESSAGE_BYTES and client.put_pieces
        stored = 0
        i = start
        while i < len(keys):
            n = min(len(keys) - i, per_rpc)
            base, offsets = None, []
            if staging is not None:
                base = staging
                offsets = [j * stride for j in range(n)]
                fill(base, offsets, i)
            def msgs(i: int = i, n: int = n, parent: bytes = parent, base=base,
                     offsets: list[int] = offsets):
                # A generator: gRPC's sender thread encodes the next message while the
                # previous one is on the wire.
                for m0 in range(0, n, per_msg):
                    m1 = min(n, m0 + per_msg)
                    blocks = [(keys[i + j], parts(i + j) if parts is not None
                               else base[offsets[j]:offsets[j] + bb])
                              for j in range(m0, m1)]
                    ns_id, par = (ns.ns_id, parent) if m0 == 0 else (b"", b"")
                    ids = tokens[(i + m0) * tb:(i + m1) * tb] if tokens else b""
                    if split:
                        yield from split_put(ns_id, par, blocks[0], _PUT_MESSAGE_BYTES, ids)
                    else:
                        yield encode_put(ns_id, par, blocks, ids)
            # Each message is encoded on a thread of its own while the previous one is
            # written: gRPC asks for the next message only once the last is on the wire.
            src = (ReadAhead(msgs(), _READ_AHEAD_DEPTH, name="kvstore-put-encode")
                   if n > per_msg else None)
            try:
                r = client._put(iter(src) if src is not None else msgs(), timeout=client.timeout,
                                wait_for_ready=True, metadata=client.metadata)
            except grpc.RpcError as e:
                raise from_rpc_error(e, "Put", client.target) from None
            finally:
                if src is not None:
                    src.close()
            stored += int(r.stored)
            parent = keys[i + n - 1]
            i += n
        return stored


def cached_prefix(ns: Namespace, keys: list[bytes]) -> int:
    """Blocks of `keys`' prefix the daemon has: what a store need not write. Marked
    `for_store`, so the daemon does not count it as a hit or miss of the cache."""
    r = ns.client.call("Lookup", pb.LookupRequest(namespace_id=ns.ns_id, keys=keys,
                                                  for_store=True))
    return int(r.prefix_blocks)


def prefix_of(look: Any) -> int:
    """The cached prefix from a Lookup future; 0 when it failed (the store then copies every
    block, and Commit counts the cached ones as duplicates: slower, never wrong)."""
    try:
        return int(look.result().prefix_blocks)
    except grpc.RpcError as e:
        log.debug("kvstore: lookup before a store failed (%s); storing every block", e)
        return 0
