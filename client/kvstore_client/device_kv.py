"""Store and load blocks through the daemon's gpu tier: the engine copies, the daemon never does.

Why: a prefix another engine computed should reach this engine's paged cache with one
device-to-device gather, not through host memory or the daemon's process. The client opens
the daemon's device pool once by handle (`kvstore_client.gpu.open_pool`: a CUDA IPC slab, or
the CPU device's shared-memory slab on machines without CUDA), and moves blocks between that
pool and its own paged cache with `PagedCopier`, at the slot offsets the daemon leases:

    store: Lookup -> Reserve(tier="gpu") -> copier.store (wait) -> Commit
    load:  Acquire(tier="gpu") -> verify (CPU pools) -> copier.load (wait) -> Release

The daemon promotes blocks found only in host or lower tiers into the pool before it answers
Acquire, and verifies every block's bytes after each move; the client checks the slots it is
handed and, where the pool is host memory, the checksums the lease carries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from ._proto import kvstore_pb2 as pb
from .common.errors import DataLoss, InvalidArgument, LeaseExpired, NotFound
from .common.pools import open_pool
from .paged_copy import PagedCopier, PagedKVCache
from .writes import cached_prefix

if TYPE_CHECKING:
    from .namespace import Namespace

COPY_WAIT_S = 60.0


class DeviceKV:
    """One engine cache bound to a namespace and one device pool of the daemon.

    cache: the engine's `PagedKVCache` (CUDA tensors for a CUDA pool, CPU tensors for the CPU
    device). device: which of the daemon's devices (its pool and its slots) to use.
    """

    def __init__(self, ns: Namespace, cache: PagedKVCache, *, device: int = 0,
                 method: str = "auto") -> None:
        self.ns = ns
        self.device = device
        self.cache = cache
        self.method = method
        self._open()

    def _open(self) -> None:
        pools = [p for p in self.ns.client.gpu_pools if p["device"] == self.device]
        if not pools:
            raise NotFound(f"the daemon offers no gpu pool for device {self.device} (is "
                           "gpu.enabled set?); offered: "
                           f"{[p['device'] for p in self.ns.client.gpu_pools]}")
        self.pool = open_pool(pools[0])
        self.copier = PagedCopier(self.pool, self.cache, self.ns.layout, method=self.method)

    def _fresh(self) -> None:
        """Re-open the pool when the daemon restarted (a new slab under the same name)."""
        if not self._current():
            self.ns.client.resync()
            self._open()

    def _current(self) -> bool:
        current = getattr(self.pool, "current", None)
        return (not self.pool.closed and (current is None or current())
                and self.ns.client.session_current())

    def _stale(self, lease_id: str) -> bool:
        """True (the lease released) when the call that gave the lease had to start a new
        session, i.e. met a restarted daemon: its slots are in the new run's slab, which a
        tenant's own pool (a memfd per run) must be re-opened to reach; the caller retries."""
        if self._current():
            return False
        self.ns.client.release(lease_id)
        self._fresh()
        return True

    def _offsets(self, slots: Sequence[pb.Slot]) -> list[int]:
        bb = self.ns.block_bytes
        out = []
        for s in slots:
            if s.device != self.device or s.length != bb or s.offset + s.length > self.pool.size:
                raise DataLoss(f"daemon handed out gpu slot (device {s.device}, {s.offset}, "
                               f"{s.length}) that does not fit a {bb}-byte block in device "
                               f"{self.device}'s {self.pool.size}-byte pool")
            out.append(int(s.offset))
        return out

    # -- store ------------------------------------------------------------------------------
    def store(self, token_ids: Any, block_ids: Any) -> int:
        """store_keys for the reference keys of the full blocks of token_ids (and their token
        ids, for KV events)."""
        return self.store_keys(self.ns.keys(token_ids), block_ids, token_ids=token_ids)

    def store_keys(self, keys: Sequence[bytes], block_ids: Any, *,
                   parent: bytes | None = None, token_ids: Any = None) -> int:
        """Store cache blocks block_ids[i] as keys[i] (the ones not cached yet, in any tier)
        into the gpu tier; returns blocks written. `token_ids`: as Namespace.store_keys (block
        i's at [i*T, (i+1)*T)), sent where the daemon publishes KV events, which announce only
        blocks whose token ids it knows. A namespace the daemon reclaimed or forgot is
        registered again and the store tried once more, as the host path does."""
        keys = list(keys)
        return self.ns._retrying(lambda: self._store_keys(keys, block_ids, parent=parent,
                                                          token_ids=token_ids))

    def _store_keys(self, keys: list[bytes], block_ids: Any, *, parent: bytes | None,
                    token_ids: Any, _retry: bool = True) -> int:
        ids = _ids(block_ids, len(keys))
        tokens = self.ns.token_bytes(token_ids, len(keys))
        self._fresh()
        client = self.ns.client
        have = cached_prefix(self.ns, keys)
        if have >= len(keys):
            return 0
        n = len(keys) - have
        prev = keys[have - 1] if have else (parent or b"")
        lease = client.call("Reserve", pb.ReserveRequest(
            namespace_id=self.ns.ns_id, count=n, tier="gpu", ttl_s=client.lease_ttl_s,
            device=self.device)).lease
        lid = lease.lease_id
        if _retry and self._stale(lid):
            return self._store_keys(keys, block_ids, parent=parent, token_ids=token_ids,
                                    _retry=False)
        client.leases.add(lid, lease.deadline)
        committed = False
        try:
            offsets = self._offsets(lease.slots)[:n]
            self.copier.store(ids[have:have + n], offsets).wait(COPY_WAIT_S)
            # (host memory: checksums as for a host Commit; CUDA memory: the daemon hashes)
            sums = ([xxhash.xxh3_64_intdigest(self.pool.view(o, self.ns.block_bytes))
                     for o in offsets] if self.pool.device is None else [])
            if not client.leases.remove(lid):
                raise LeaseExpired(f"write lease {lid} expired during the copy")
            tb = 4 * self.ns.layout.block_tokens        # token id bytes a block
            mine = tokens[have * tb:(have + n) * tb] if tokens else b""
            r = client.call("Commit", pb.CommitRequest(lease_id=lid, keys=keys[have:have + n],
                                                       parent=prev, checksums=sums,
                                                       token_ids=mine))
            committed = True
            return int(r.stored)
        finally:
            if not committed:
                # From the lease thread: a Release now would wait on the same unanswering
                # daemon past the store's deadline (the daemon reaps the lease anyway).
                client.release_later(lid)

    # -- load -------------------------------------------------------------------------------
    def load_keys(self, keys: Sequence[bytes], block_ids: Any) -> int:
        """Gather the cached prefix of keys into cache blocks block_ids[i]; returns blocks
        loaded. Blocks the daemon holds only in host or lower tiers are promoted first."""
        keys = list(keys)
        return self.ns._retrying(lambda: self._load_keys(keys, block_ids))

    def _load_keys(self, keys: list[bytes], block_ids: Any, _retry: bool = True) -> int:
        ids = _ids(block_ids, 0)
        keys = keys[:len(ids)]
        if not keys:
            return 0
        self._fresh()
        client = self.ns.client
        lease = client.call("Acquire", pb.AcquireRequest(
            namespace_id=self.ns.ns_id, keys=keys, tier="gpu", ttl_s=client.lease_ttl_s,
            device=self.device)).lease
        lid = lease.lease_id
        if not lease.slots:
            if lid:
                client.release(lid)
            return 0
        if _retry and self._stale(lid):
            return self._load_keys(keys, block_ids, _retry=False)
        client.leases.add(lid, lease.deadline)
        try:
            offsets = self._offsets(lease.slots)
            n = len(offsets)
            if list(lease.keys[:n]) != keys[:n]:
                raise DataLoss("the daemon's read lease names other keys than were asked for")
            if client.verify and self.pool.device is None and len(lease.checksums) == n:
                # Host-memory pool: checking costs one read of each slot, so it is done.
                bb = self.ns.block_bytes
                for j, (o, c) in enumerate(zip(offsets, lease.checksums, strict=True)):
                    if xxhash.xxh3_64_intdigest(self.pool.view(o, bb)) != c:
                        client.counters["checksum_failures"] += 1
                        n = j
                        break
            if n:
                self.copier.load(ids[:n], offsets[:n]).wait(COPY_WAIT_S)
            if not client.leases.ok(lid):
                client.counters["leases_lost"] += 1
                raise LeaseExpired(f"read lease {lid} expired during the copy")
        except BaseException:
            client.release_later(lid)       # as a failed store's (store_keys)
            raise
        client.release(lid)                 # at once: the lease pins device slots
        return n


def _ids(block_ids: Any, need: int) -> np.ndarray:
    arr = np.asarray(block_ids.cpu() if hasattr(block_ids, "cpu") else block_ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidArgument("block_ids must be a 1-D list of integer cache block ids")
    if len(arr) < need:
        raise InvalidArgument(f"{len(arr)} block ids for {need} keys")
    return arr.astype(np.int64)
