"""A registered namespace: hash prompts, look up, store and load prefix blocks.

Same host, the blocks are copied straight into and out of the daemon's mapped host pool
(Reserve -> copy -> Commit; Acquire -> copy -> Release); otherwise they stream over Put/Get.
Both paths go through one pair of primitives, `fill` and `drain`, so the dense sequence layout
here and the paged engine layout in `paged.py` share every other line. The connection,
leases and restart handling live in `client.py`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
import xxhash

from . import blockcopy
from ._proto import kvstore_pb2 as pb
from .buffers import (
    PAGE,
    StagingBuffers,
    _is_tensor,
    check_seq,
    copy_block,
    raw_view,
    slot_view,
)
from .common.errors import (
    DataLoss,
    DeadlineExceeded,
    InvalidArgument,
    LeaseExpired,
    NotFound,
    Unimplemented,
    from_rpc_error,
)
from .common.hashing import DEFAULT_KEY_BYTES, ExtraKey, block_keys
from .common.layout import NamespaceSpec, check_retention
from .common.read_ahead import ReadAhead
from .wire import decode_get, encode_put, split_put

if TYPE_CHECKING:
    from .client import Client, _Pool

log = logging.getLogger(__name__)

# Blocks are copied and checksummed in groups of about this many bytes, so the checksum pass
# reads bytes the copy just left in cache.
_CHUNK_BYTES = 4 << 20
# Put streams carry about this many block bytes per message (and per RPC at most _PUT_RPC_BYTES),
# bounding the client's temporary memory; a daemon receives messages of at most 4 MiB by default
# (server.max_receive_bytes), so a bigger block goes alone, split across messages, where the
# daemon takes that (protocol 3).
_PUT_MESSAGE_BYTES = 2 << 20
_PUT_RPC_BYTES = 64 << 20
# A Get expected to span more than one reply message (the daemon sends ~4 MiB a message) is
# received on a thread of its own while the caller drains what came (common/read_ahead.py).
_READ_AHEAD_BYTES = 4 << 20
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

Fill = Callable[[np.ndarray, Sequence[int], int], "np.ndarray | None"]
"""fill(base, offsets, first): write blocks first, first+1, ... into base[offsets[j]:+bb].

It may return the xxh3-64 of each block it wrote (uint64 array), computed in the copy's pass;
when it returns None the namespace checksums the slots itself (a second pass)."""
Drain = Callable[[np.ndarray, Sequence[int], int], "np.ndarray | None"]
"""drain(base, offsets, first): copy base[offsets[j]:+bb] out as blocks first, first+1, ...

Like Fill, it may return the xxh3-64 of each block it read, for the load's verification."""


def fused(fn: Callable) -> Callable:
    """Mark a fill/drain that takes a whole batch at once and returns its checksums.

    Unmarked callbacks are called in ~4 MiB chunks so a separate checksum pass reads bytes the
    copy just left in cache; a fused one already did both in one pass, so one call per batch
    (and one Python call per batch, not per block) is what it wants.
    """
    fn._kvstore_fused = True  # type: ignore[attr-defined]
    return fn


def _is_fused(fn: Callable) -> bool:
    return bool(getattr(fn, "_kvstore_fused", False))


@dataclass
class LookupResult:
    """Longest cached prefix in blocks, overall and per tier."""

    prefix_blocks: int
    per_tier: dict[str, int]


class _Stale(Exception):
    """The pool mapping or a lease went stale mid-call: resync and try again."""


class Namespace:
    """One registered namespace: hash prompts, look up, store and load prefix blocks.

    Token-based calls (`lookup`, `load`) count tokens; key-based calls (`lookup_keys`,
    `load_keys`) count blocks. `store*` return blocks written (0 when all were cached).
    """

    def __init__(self, client: Client, spec: NamespaceSpec, *, extra_keys: tuple = (),
                 key_bytes: int = DEFAULT_KEY_BYTES) -> None:
        self.client = client
        self.spec = spec
        self.layout = spec.layout
        self.extra_keys = extra_keys
        self.key_bytes = key_bytes
        self.ns_id = b""
        self.block_bytes = spec.layout.block_bytes
        self._staging = StagingBuffers()      # Put's staged blocks, one buffer per call
        self._spare: Any | None = None          # write lease a Commit reserved ahead
        self._spare_lock = threading.Lock()
        # Whether this namespace's last store found blocks cached. A store into a spare lease
        # looks up its cached prefix only then: where stores are new blocks (an engine's own
        # offloads), that lookup would cost a round trip of CPU for nothing; when the guess is
        # wrong, the store copies blocks the daemon already has, and Commit counts them as
        # duplicates (slower, never wrong), which turns the lookup back on.
        self._prefix_seen = True
        # Whether the daemon publishes KV events for this namespace and so wants each stored
        # block's token ids with its Commit (set by every registration).
        self.wants_token_ids = False
        self._register()

    def _register(self) -> None:
        self._spare = None          # reserved by a daemon run this (re-)registration replaces
        resp = self.client.register(self.spec)
        if resp.block_bytes and resp.block_bytes != self.layout.block_bytes:
            raise InvalidArgument(f"the daemon sizes this namespace's blocks at "
                                  f"{resp.block_bytes} bytes, the layout at "
                                  f"{self.layout.block_bytes}: client and daemon disagree")
        self.ns_id = bytes(resp.namespace_id)
        self.wants_token_ids = bool(resp.wants_token_ids)

    def __repr__(self) -> str:
        return (f"Namespace(model={self.spec.model!r}, ns_id={self.ns_id.hex()}, "
                f"transport={self.client.transport})")

    # -- keys -------------------------------------------------------------------------------
    def keys(self, token_ids: Sequence[int] | np.ndarray, *, parent: bytes | None = None,
             block_extra_keys: Sequence[Sequence[ExtraKey]] | None = None) -> list[bytes]:
        """Reference keys (kvstore_client.common.hashing.block_keys) of every full block."""
        if self.spec.hash_scheme != "kvstore-blake3-v1":
            raise InvalidArgument(f"namespace uses hash scheme {self.spec.hash_scheme!r}: pass "
                                  "your own keys to lookup_keys/store_keys/load_keys")
        if _is_tensor(token_ids):
            token_ids = token_ids.detach().cpu().numpy()
        return block_keys(token_ids, self.layout.block_tokens, parent=parent,
                          extra_keys=self.extra_keys, block_extra_keys=block_extra_keys,
                          key_bytes=self.key_bytes)

    # -- retry wrapper ----------------------------------------------------------------------
    def _retrying(self, fn: Callable[[], Any]) -> Any:
        """Run fn; after a sign of a daemon restart, resync and run it once more.

        The store and load paths check the pool segment themselves before touching it, so
        lookups pay no extra system call here.
        """
        try:
            return fn()
        except (_Stale, NotFound, LeaseExpired) as e:
            log.info("kvstore: %s; re-registering and retrying", e)
            self.client.resync()
        try:
            return fn()
        except _Stale as e:
            raise DataLoss(f"the daemon's pool changed twice during one call: {e}") from None

    # -- lookup -----------------------------------------------------------------------------
    def lookup_result(self, keys: Sequence[bytes]) -> LookupResult:
        """Longest cached prefix of `keys` in blocks, overall and per tier."""
        if not keys:
            return LookupResult(0, {})

        def run() -> LookupResult:
            r = self.client.call("Lookup", pb.LookupRequest(namespace_id=self.ns_id,
                                                            keys=list(keys)))
            return LookupResult(int(r.prefix_blocks), {k: int(v) for k, v in r.per_tier.items()})
        return self._retrying(run)

    def lookup_keys(self, keys: Sequence[bytes]) -> int:
        """Blocks of the longest cached prefix of `keys`."""
        return self.lookup_result(keys).prefix_blocks

    def lookup(self, token_ids: Sequence[int] | np.ndarray) -> int:
        """Tokens of `token_ids` whose KV is cached (a multiple of block_tokens)."""
        return self.lookup_keys(self.keys(token_ids)) * self.layout.block_tokens

    # -- store ------------------------------------------------------------------------------
    def store(self, token_ids: Sequence[int] | np.ndarray, kv: Any) -> int:
        """Store the full blocks of `token_ids` not cached yet; returns blocks written.

        kv: [num_layers, 2, n_tokens, num_kv_heads, head_dim] (numpy or torch, namespace dtype,
        any strides) with n_tokens >= the full blocks of token_ids.
        """
        return self.store_keys(self.keys(token_ids), kv, token_ids=token_ids)

    def store_keys(self, keys: Sequence[bytes], kv: Any, *, parent: bytes | None = None,
                   token_ids: Sequence[int] | np.ndarray | None = None) -> int:
        """store() with precomputed keys; kv[:, :, i*T:(i+1)*T] is block i's KV.

        `token_ids` (at least len(keys) * block_tokens, block i's tokens at [i*T, (i+1)*T))
        go to the daemon where it publishes KV events for routers (`wants_token_ids`)."""
        keys = list(keys)
        if not keys:
            return 0
        T = self.layout.block_tokens
        check_seq(kv, self.layout, len(keys) * T, "kv")
        src = raw_view(kv, self.layout, "kv")
        plan = self._plan(src)
        if plan is not None:
            fill = self.fused_move(plan, True)
        else:
            def fill(base: np.ndarray, offsets: Sequence[int], first: int) -> None:
                for j, off in enumerate(offsets):
                    i = first + j
                    dst = slot_view(base, off, self.layout, src)
                    copy_block(dst, src[:, :, i * T:(i + 1) * T])

        rows = None
        if isinstance(src, np.ndarray):
            # Put can join each block's contiguous (layer, K/V) rows straight into the message.
            L, _, N, H, D = src.shape
            rows = src.view()
            try:
                rows.shape = (L * 2, N * H * D)
            except AttributeError:
                rows = None
        E = T * self.layout.num_kv_heads * self.layout.head_dim

        def parts(i: int) -> list[Any]:
            return list(rows[:, i * E:(i + 1) * E])  # type: ignore[index]
        tokens = self._tokens(token_ids, len(keys))
        return self._retrying(lambda: self._store_once(keys, fill, parent,
                                                       parts if rows is not None else None,
                                                       tokens))

    def _tokens(self, token_ids: Any, n: int) -> bytes | None:
        """The token ids of n full blocks as Commit carries them (little-endian uint32), or
        None when the daemon does not want them (then nothing is converted or sent)."""
        if token_ids is None or not self.wants_token_ids:
            return None
        if _is_tensor(token_ids):
            token_ids = token_ids.detach().cpu().numpy()
        need = n * self.layout.block_tokens
        if len(token_ids) < need:
            raise InvalidArgument(f"{len(token_ids)} token ids for {n} blocks of "
                                  f"{self.layout.block_tokens} tokens")
        a = np.asarray(token_ids[:need])
        if a.size and (a.dtype.kind not in "iu" or a.min() < 0 or a.max() > 0xFFFFFFFF):
            raise InvalidArgument("token ids must be unsigned 32-bit integers")
        return a.astype("<u4").tobytes()

    def _plan(self, x: Any) -> blockcopy.Plan | None:
        """The compiled copy plan for a host-memory sequence tensor, or None (fallback)."""
        if not isinstance(x, np.ndarray) or not blockcopy.kernel_available():
            return None
        return blockcopy.seq_plan(x, self.layout.block_tokens)

    def fused_move(self, plan: blockcopy.Plan, to_slots: bool,
                   blocks: Sequence[int] | None = None) -> Callable:
        """A fill (to_slots) or drain over `plan`: one pass, checksummed (a drain only when
        verifying).

        Key i of the call moves plan block `blocks[i]` (an engine adapter's chunk or page id),
        or plan block i without `blocks` (a sequence's token blocks)."""
        client = self.client

        def run(base: np.ndarray, offsets: Sequence[int], first: int, hashed: bool
                ) -> np.ndarray | None:
            sums = np.empty(len(offsets), dtype=np.uint64) if hashed else None
            ids = (range(first, first + len(offsets)) if blocks is None
                   else blocks[first:first + len(offsets)])
            blockcopy.run(plan, base, ids, offsets, to_slots, sums, client.copy_threads)
            return sums

        @fused
        def move(base: np.ndarray, offsets: Sequence[int], first: int) -> np.ndarray | None:
            return run(base, offsets, first, to_slots or client.verify)
        if not to_slots:
            # A Get reply's blocks come with no checksum to compare against (the daemon checked
            # each copy against its commit checksum before it left): hashing them here would be
            # work whose result nobody reads.
            move._kvstore_unhashed = fused(  # type: ignore[attr-defined]
                lambda base, offsets, first: run(base, offsets, first, False))
        return move

    def store_blocks(self, keys: Sequence[bytes], fill: Fill, *,
                     parent: bytes | None = None,
                     token_ids: Sequence[int] | np.ndarray | None = None) -> int:
        """Store blocks produced by `fill` for the keys not cached yet (for custom layouts);
        `token_ids` as store_keys."""
        keys = list(keys)
        if not keys:
            return 0
        tokens = self._tokens(token_ids, len(keys))
        return self._retrying(lambda: self._store_once(keys, fill, parent, None, tokens))

    def _store_once(self, keys: list[bytes], fill: Fill, parent: bytes | None,
                    parts: Callable[[int], list[Any]] | None = None,
                    tokens: bytes | None = None) -> int:
        if self.client.pool is not None:
            return self._store_shm(keys, parent, fill, tokens)
        have = self.lookup_keys(keys)
        if have >= len(keys):
            return 0
        first_parent = keys[have - 1] if have else (parent or b"")
        # Asked again here: a retry follows a re-registration, which may have changed them; a
        # daemon before protocol 4 refuses a Put field it does not know.
        send = self.client.put_tokens and self.wants_token_ids
        return self._store_grpc(keys, have, first_parent, fill, parts,
                                tokens if send else None)

    def _reserve_batch(self) -> int:
        pool = self.client.pool
        per = (self.block_bytes + PAGE - 1) // PAGE * PAGE
        cap = int(pool.size * _RESERVE_POOL_SHARE) // per if pool is not None else 1
        return max(1, min(_RESERVE_MAX_SLOTS, cap))

    def _current_pool(self) -> _Pool:
        """The mapped host pool, or _Stale when the daemon replaced its segment (a restart)."""
        pool = self.client.pool
        if pool is None or not pool.current():
            raise _Stale("host pool segment replaced")
        return pool

    @staticmethod
    def _pool_bytes(pool: _Pool) -> np.ndarray:
        """The mapped pool's bytes, or _Stale once another call re-mapped a restarted daemon's
        pool and closed this one. Why: a call holds its `_Pool` for a whole round trip (a
        `Pinned` for as long as it lives) and `_adopt` closes it under them; the caller's
        reference to the array keeps the mapping alive for its copy (shm.SharedSlab.close)."""
        arr = pool.slab.array
        if arr is None:
            raise _Stale("host pool closed: the daemon restarted and its new pool is mapped")
        return arr

    def _lookup_reserve(self, keys: list[bytes]) -> tuple[int, Any]:
        """(cached prefix, write lease for the next missing blocks or None) in one round trip;
        Lookup then (later) Reserve against a daemon that predates LookupReserve."""
        client = self.client
        if client.fused_rpcs:
            try:
                r = client.call("LookupReserve", pb.LookupReserveRequest(
                    namespace_id=self.ns_id, keys=keys, tier="host", ttl_s=client.lease_ttl_s,
                    max_slots=self._reserve_batch()))
                return int(r.prefix_blocks), (r.lease if r.HasField("lease") else None)
            except Unimplemented:
                log.info("kvstore: daemon has no LookupReserve; using Lookup + Reserve")
                client.fused_rpcs = False
        return self.lookup_keys(keys), None

    def _store_shm(self, keys: list[bytes], parent: bytes | None, fill: Fill,
                   tokens: bytes | None = None) -> int:
        """Steady state, one round trip on the store's path: the previous store's Commit
        reserved this one's slots (`_store_ahead`). Otherwise LookupReserve, then Commit."""
        lease = self._take_spare(len(keys))
        if lease is not None:
            return self._store_ahead(keys, parent, fill, lease, tokens)
        T = 4 * self.layout.block_tokens           # bytes of token ids a block
        client, bb = self.client, self.block_bytes
        pool = self._current_pool()
        have, lease = self._lookup_reserve(keys)
        self._prefix_seen = have > 0
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
                pool = self._current_pool()
                lease = client.call("Reserve", pb.ReserveRequest(
                    namespace_id=self.ns_id, count=n, tier="host",
                    ttl_s=client.lease_ttl_s)).lease
            client.leases.add(lease.lease_id, lease.deadline)
            try:
                offsets = self._check_slots(lease.slots, pool)[:n]
                n = len(offsets)
                sums = _fill_checksummed(fill, self._pool_bytes(pool), offsets, i, bb)
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
        is expected: `_prefix_seen`) in flight meanwhile: blocks are filled from the end of
        the batch, and filling stops at the prefix once its answer is in. So the store waits
        on one round trip (its Commit), and a cached prefix is still not copied (except what
        was filled before the answer came)."""
        client, bb, n = self.client, self.block_bytes, len(keys)
        deadline: float | None = None
        try:
            pool = self._current_pool()
            offsets = self._check_slots(lease.slots, pool)[:n]
            have: int | None = None
            look = None
            if self._prefix_seen:
                # The store's one deadline: the Commit gets what waiting on the lookup left.
                deadline = time.monotonic() + client.timeout
                look = client.call_future("Lookup", pb.LookupRequest(namespace_id=self.ns_id,
                                                                     keys=keys))
            else:
                have = 0
            sums = [0] * n
            per = max(1, _AHEAD_CHUNK_BYTES // bb)
            hi = n
            while hi > (have or 0):
                if have is None and look.done():
                    have = _prefix_of(look)
                    continue
                lo = max(hi - per, 0) if have is None else have    # answered: the rest at once
                base = self._pool_bytes(pool)       # each piece: a re-map may close it
                sums[lo:hi] = _fill_checksummed(fill, base, offsets[lo:hi], lo, bb)
                hi = lo
            if have is None:
                have = _prefix_of(look)
        except BaseException:
            client.release_later(lease.lease_id)
            raise
        self._prefix_seen = have > 0
        if have >= n:                       # all cached: the slots wait for the next store
            if client.leases.remove(lease.lease_id):
                self._keep_spare(lease)
            else:
                client.release_later(lease.lease_id)
            return 0
        T = 4 * self.layout.block_tokens           # bytes of token ids a block
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
        client, lid = self.client, lease.lease_id
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
            raise _Stale(str(e)) from None
        except BaseException:
            client.release_later(lid)
            raise
        if r.duplicates:
            self._prefix_seen = True
        if r.HasField("next_lease") and r.next_lease.slots:
            self._keep_spare(r.next_lease)
        return int(r.stored)

    def _keep_spare(self, lease: Any) -> None:
        self.client.leases.keep_spare(lease.lease_id, lease.deadline)
        with self._spare_lock:
            old, self._spare = self._spare, lease
        if old is not None and self.client.leases.take_spare(old.lease_id, 0.0):
            self.client.release_later(old.lease_id)

    def _take_spare(self, n: int) -> Any | None:
        """The write lease a Commit reserved ahead, if it is still held and holds n slots."""
        with self._spare_lock:
            lease, self._spare = self._spare, None
        if lease is None:
            return None
        client = self.client
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
        `tokens` (every key's, as _tokens gives them) go with their blocks' messages."""
        stride = (self.block_bytes + PAGE - 1) // PAGE * PAGE
        per_rpc = max(1, _PUT_RPC_BYTES // stride)
        # This call's own staging (StagingBuffers: gRPC reads it lazily while the Put runs).
        staging = (self._staging.take(min(len(keys) - start, per_rpc) * stride)
                   if parts is None else None)
        done = False
        try:
            stored = self._put_all(keys, start, parent, fill, parts, tokens, staging)
            done = True
        finally:
            # Given back only after a Put that the daemon answered, having read every message;
            # a failed one may leave gRPC's sender thread still encoding from it.
            if staging is not None and done:
                self._staging.give(staging)
        return stored

    def _put_all(self, keys: list[bytes], start: int, parent: bytes, fill: Fill,
                 parts: Callable[[int], list[Any]] | None, tokens: bytes | None,
                 staging: np.ndarray | None) -> int:
        """The Put RPCs of one store, up to _PUT_RPC_BYTES each, each filled into `staging`
        (this call's alone) just before it is sent."""
        client, bb = self.client, self.block_bytes
        tb = 4 * self.layout.block_tokens           # token id bytes a block
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
                    ns_id, par = (self.ns_id, parent) if m0 == 0 else (b"", b"")
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

    # -- load -------------------------------------------------------------------------------
    def load(self, token_ids: Sequence[int] | np.ndarray, out: Any) -> int:
        """Fill out[:, :, :n] with the cached prefix of `token_ids`; returns n (tokens).

        out: [num_layers, 2, >= tokens, num_kv_heads, head_dim] (numpy or torch, namespace
        dtype). Positions past n are left as they were.
        """
        return self.load_keys(self.keys(token_ids), out) * self.layout.block_tokens

    def load_keys(self, keys: Sequence[bytes], out: Any) -> int:
        """load() with precomputed keys; returns blocks loaded into out[:, :, :blocks*T]."""
        keys = list(keys)
        if not keys:
            return 0
        T = self.layout.block_tokens
        check_seq(out, self.layout, 0, "out")
        keys = keys[:out.shape[2] // T]
        if not keys:
            raise InvalidArgument(f"out holds {out.shape[2]} tokens, less than one block "
                                  f"({T} tokens)")
        dst = raw_view(out, self.layout, "out")
        plan = self._plan(dst)
        if plan is not None:
            return self.load_blocks(keys, self.fused_move(plan, False))

        def drain(base: np.ndarray, offsets: Sequence[int], first: int) -> None:
            for j, off in enumerate(offsets):
                i = first + j
                copy_block(dst[:, :, i * T:(i + 1) * T], slot_view(base, off, self.layout, dst))
        return self.load_blocks(keys, drain)

    def load_blocks(self, keys: Sequence[bytes], drain: Drain) -> int:
        """Load the cached prefix of `keys` through `drain`; returns blocks loaded."""
        keys = list(keys)
        if not keys:
            return 0
        return self._retrying(lambda: self._load_once(keys, drain))

    def _load_once(self, keys: list[bytes], drain: Drain) -> int:
        if self.client.pool is not None:
            return self._load_shm(keys, drain)
        return self._load_grpc(keys, drain)

    def _check_slots(self, slots: Sequence[pb.Slot], pool: _Pool) -> list[int]:
        offsets = []
        for s in slots:
            if s.length != self.block_bytes or s.offset + s.length > pool.size:
                raise DataLoss(f"daemon handed out slot ({s.offset}, {s.length}) that does not "
                               f"fit a {self.block_bytes}-byte block in a {pool.size}-byte pool")
            offsets.append(int(s.offset))
        return offsets

    def _load_shm(self, keys: list[bytes], drain: Drain) -> int:
        client = self.client
        pool = self._current_pool()
        lease = client.call_carrying("Acquire", pb.AcquireRequest(
            namespace_id=self.ns_id, keys=keys, tier="host", ttl_s=client.lease_ttl_s)).lease
        if not lease.slots:
            if lease.lease_id:
                client.release_later(lease.lease_id)
            return 0
        client.leases.add(lease.lease_id, lease.deadline)
        try:
            return self._drain_lease(lease, keys, pool, drain)
        finally:
            # Off the load's path: the bytes are copied and verified by now (leases.py).
            client.release_later(lease.lease_id)

    def _drain_lease(self, lease: Any, keys: Sequence[bytes], pool: _Pool, drain: Drain) -> int:
        """Copy a read lease's blocks out through drain, verified; blocks of the good prefix."""
        client, bb, lid = self.client, self.block_bytes, lease.lease_id
        offsets = self._check_slots(lease.slots, pool)
        n = len(offsets)
        if list(lease.keys[:n]) != list(keys[:n]):
            raise DataLoss("the daemon's read lease names other keys than were asked for")
        if pool.replaced:
            # The call that gave the lease met a restarted daemon and took a new session: its
            # slots are in the new run's pool, which this (tenant, memfd) mapping is not.
            raise _Stale("host pool replaced by a restarted daemon")
        want = list(lease.checksums) if client.verify else []
        good = _drain_verified(drain, self._pool_bytes(pool), offsets, bb,
                               want if len(want) == n else None)
        if not client.leases.ok(lid):
            client.counters["leases_lost"] += 1
            raise _Stale(f"read lease {lid} expired during the copy")
        if good < n:
            client.counters["checksum_failures"] += 1
            if not pool.current() or client.pool_moved(pool):
                raise _Stale("host pool segment replaced during the copy")
            client.counters["corrupt_blocks"] += 1
            log.warning("kvstore: block %d of a load failed its checksum; serving the %d "
                        "blocks before it", good, good)
        return good

    # -- lookup + pin ------------------------------------------------------------------------
    def pin(self, keys: Sequence[bytes]) -> Pinned:
        """Look up `keys` and pin the cached prefix in the host pool, in one round trip.

        For engines that ask "how much is cached?" and then load it: the answer carries the
        slots and a read lease (renewed in the background), so `Pinned.load_keys` /
        `load_blocks` copy with no further call before the release. Release it (or use it as a
        context manager) when done; an unreleased pin ends at its lease deadline.
        Same host only (the mapped pool): over gRPC streams use lookup + load.
        """
        keys = list(keys)
        if not keys:
            raise InvalidArgument("pin needs at least one key")
        return self._retrying(lambda: self._pin_once(keys))

    def _pin_once(self, keys: list[bytes]) -> Pinned:
        client = self.client
        pool = self._current_pool()
        req = dict(namespace_id=self.ns_id, keys=keys, tier="host", ttl_s=client.lease_ttl_s)
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
            res = self.lookup_result(keys)
            if res.prefix_blocks:
                lease = client.call("Acquire", pb.AcquireRequest(**req)).lease
        if lease is not None and not lease.slots:
            if lease.lease_id:
                client.release(lease.lease_id)
            lease = None
        if lease is not None:
            client.leases.add(lease.lease_id, lease.deadline)
        return Pinned(self, keys, res, lease, pool)

    def _load_grpc(self, keys: list[bytes], drain: Drain) -> int:
        client = self.client
        drain = getattr(drain, "_kvstore_unhashed", drain)     # nothing to verify against
        n = 0
        msgs: ReadAhead | None = None
        try:
            call = client._get(pb.GetRequest(namespace_id=self.ns_id, keys=keys),
                               timeout=client.timeout, wait_for_ready=True,
                               metadata=client.metadata)
            # A reply of several messages: the next is received while this one is drained.
            if len(keys) * self.block_bytes > _READ_AHEAD_BYTES:
                msgs = ReadAhead(call, _READ_AHEAD_DEPTH, cancel=call.cancel,
                                 name="kvstore-get-read", inline=1)
            for raw in msgs if msgs is not None else call:
                base = np.frombuffer(raw, dtype=np.uint8)
                blocks = decode_get(raw)
                for k, (key, _off, length) in enumerate(blocks):
                    if n + k >= len(keys) or key != keys[n + k] or length != self.block_bytes:
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

    def locate(self, keys: Sequence[bytes], *, prefetch: bool = False,
               timeout: float | None = None) -> list[str | None]:
        """The fastest tier holding each key ("host", "ssd", "remote", "gpu") or None.

        Unlike lookup, every key is answered on its own (engines such as vLLM look blocks up
        one by one). With `prefetch`, the daemon starts promoting the keys held only below host
        into host in the background: a later load of them is a host hit.
        """
        keys = list(keys)
        if not keys:
            return []
        req = pb.LocateRequest(namespace_id=self.ns_id, keys=keys, prefetch=prefetch)

        def run() -> list[str | None]:
            resp = self.client.call("Locate", req, timeout=timeout)
            names = [None, *resp.tier_names]
            if len(resp.where) != len(keys) or any(b >= len(names) for b in resp.where):
                raise DataLoss("malformed Locate response from the daemon")
            return [names[b] for b in resp.where]
        return self._retrying(run)

    def retain(self, keys: Sequence[bytes], level: str) -> int:
        """Tell the daemon how likely `keys` (from `keys()`) are to be needed again: "low" (the
        session is over, a one-shot request: evict these first), "normal", or "high" (a
        follow-up is expected). Returns the stored blocks the hint reached; keys not stored are
        skipped. Hints only order eviction: nothing is dropped or pinned by them."""
        req = pb.RetainRequest(namespace_id=self.ns_id, keys=list(keys),
                               level=check_retention(level))
        return int(self.client.call("Retain", req).blocks)

    # -- admin ------------------------------------------------------------------------------
    def delete(self, keys: Sequence[bytes] | None = None) -> int:
        """Delete `keys` (None: the whole namespace) from every tier; returns blocks deleted."""
        req = pb.DeleteRequest(namespace_id=self.ns_id, keys=list(keys or ()), all=keys is None)
        return int(self.client.call("Delete", req).deleted)


class Pinned:
    """A cached prefix pinned in the host pool by `Namespace.pin`: `lookup` is what the daemon
    found (per tier), `blocks` how many leading blocks are pinned and loadable now."""

    def __init__(self, ns: Namespace, keys: list[bytes], lookup: LookupResult, lease: Any,
                 pool: _Pool) -> None:
        self.ns, self.keys, self.lookup, self._lease, self._pool = ns, keys, lookup, lease, pool
        self.blocks = len(lease.slots) if lease is not None else 0

    def load_blocks(self, drain: Drain) -> int:
        """Copy the pinned blocks out through drain (verified); returns blocks loaded."""
        if self._lease is None:
            return 0
        try:
            return self.ns._drain_lease(self._lease, self.keys, self._pool, drain)
        except _Stale as e:
            raise LeaseExpired(f"pinned prefix lost ({e}); pin again") from None

    def load_keys(self, out: Any) -> int:
        """Fill out[:, :, :n*T] with the pinned blocks (as Namespace.load_keys); returns n."""
        ns = self.ns
        T = ns.layout.block_tokens
        check_seq(out, ns.layout, 0, "out")
        if out.shape[2] < self.blocks * T:
            raise InvalidArgument(f"out holds {out.shape[2]} tokens; the pinned prefix is "
                                  f"{self.blocks * T}")
        dst = raw_view(out, ns.layout, "out")
        plan = ns._plan(dst)
        if plan is not None:
            return self.load_blocks(ns.fused_move(plan, False))

        def drain(base: np.ndarray, offsets: Sequence[int], first: int) -> None:
            for j, off in enumerate(offsets):
                i = first + j
                copy_block(dst[:, :, i * T:(i + 1) * T], slot_view(base, off, ns.layout, dst))
        return self.load_blocks(drain)

    def release(self) -> None:
        """Unpin (idempotent)."""
        lease, self._lease = self._lease, None
        if lease is not None:
            self.ns.client.release_later(lease.lease_id)

    def __enter__(self) -> Pinned:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _fill_checksummed(fill: Fill, base: np.ndarray, offsets: list[int], first: int, bb: int
                      ) -> list[int]:
    """Run fill over the batch; the checksums to send with Commit.

    Why always, `verify` or not: the daemon cannot tell the bytes this client wrote from a
    late write into the same slots by a client whose lease on them expired (a stalled
    process resuming its copy), and refuses a host Commit without them."""
    if _is_fused(fill):
        got = fill(base, offsets, first)
        if got is not None and len(got) == len(offsets):
            return got.tolist()
        return [xxhash.xxh3_64_intdigest(base[o:o + bb]) for o in offsets]
    sums: list[int] = []
    for c0, c1 in _chunks(len(offsets), bb):
        got = fill(base, offsets[c0:c1], first + c0)
        if got is not None and len(got) == c1 - c0:
            sums += got.tolist()
        else:
            sums += [xxhash.xxh3_64_intdigest(base[o:o + bb]) for o in offsets[c0:c1]]
    return sums


def _drain_verified(drain: Drain, base: np.ndarray, offsets: list[int], bb: int,
                    want: list[int] | None) -> int:
    """Run drain over the batch; blocks of the verified prefix (all of them when want is None).

    A fused drain checksums in its copy pass, so a block that fails has already been copied:
    the caller serves only the prefix before it (positions past it hold unverified bytes).
    """
    n = len(offsets)
    if _is_fused(drain):
        chunks: Iterator[tuple[int, int]] = iter([(0, n)])
    else:
        chunks = _chunks(n, bb)
    for c0, c1 in chunks:
        got = drain(base, offsets[c0:c1], c0)
        if want is None:
            continue
        if got is None or len(got) != c1 - c0:
            got = np.array([xxhash.xxh3_64_intdigest(base[o:o + bb]) for o in offsets[c0:c1]],
                           dtype=np.uint64)
        bad = np.flatnonzero(got != np.array(want[c0:c1], dtype=np.uint64))
        if bad.size:
            return c0 + int(bad[0])
    return n


def _prefix_of(look: Any) -> int:
    """The cached prefix from a Lookup future; 0 when it failed (the store then copies every
    block, and Commit counts the cached ones as duplicates: slower, never wrong)."""
    try:
        return int(look.result().prefix_blocks)
    except grpc.RpcError as e:
        log.debug("kvstore: lookup before a store failed (%s); storing every block", e)
        return 0


def _chunks(n: int, block_bytes: int) -> Iterator[tuple[int, int]]:
    per = max(1, _CHUNK_BYTES // max(1, block_bytes))
    for c0 in range(0, n, per):
        yield c0, min(n, c0 + per)
