"""A registered namespace: hash prompts, look up, store and load prefix blocks.

This is the engine's face of the SDK; how the blocks travel is in two modules beside it:
`writes.py` (a store: a write lease on the mapped host pool, or Put) and `reads.py` (a load
or a pin: a read lease on the pool, or Get). Both paths go through one pair of primitives,
`fill` and `drain` (pool_copy.py), so the dense sequence layout here and the paged engine
layout in `paged.py` share every other line. The connection, leases and restart handling
live in `client.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from . import blockcopy
from ._proto import kvstore_pb2 as pb
from .buffers import _is_tensor, check_seq, copy_block, raw_view, slot_view
from .common.errors import DataLoss, InvalidArgument, LeaseExpired, NotFound
from .common.hashing import DEFAULT_KEY_BYTES, ExtraKey, block_keys
from .common.layout import NamespaceSpec, check_retention
from .pool_copy import Drain, Fill, Stale, fused
from .reads import LookupResult, Pinned, load_once, pin_once, seq_drain
from .writes import Writer

if TYPE_CHECKING:
    from .client import Client

log = logging.getLogger(__name__)


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
        self._writer = Writer(self)             # the write path's state (writes.py)
        # Whether the daemon publishes KV events for this namespace and so wants each stored
        # block's token ids with its Commit (set by every registration).
        self.wants_token_ids = False
        self._register()

    def _register(self) -> None:
        self._writer.drop_spare()
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
        except (Stale, NotFound, LeaseExpired) as e:
            log.info("kvstore: %s; re-registering and retrying", e)
            daemon = self.client.daemon_id
            if isinstance(e, NotFound) and self.ns_id.hex() in str(e):
                # This namespace alone is unknown: the daemon reclaimed it while it was empty
                # (a tenant at its namespace cap), or restarted. Registering every namespace
                # of this client would reclaim others of its empty ones in turn.
                self._register()
                if self.client.daemon_id != daemon:
                    self.client.resync()        # a restart after all: the pool, the rest
            else:
                self.client.resync()
        try:
            return fn()
        except Stale as e:
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
        plan = self.copy_plan(src)
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
        tokens = self.token_bytes(token_ids, len(keys))
        return self._retrying(lambda: self._writer.store_once(
            keys, fill, parent, parts if rows is not None else None, tokens))

    def token_bytes(self, token_ids: Any, n: int) -> bytes | None:
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

    def copy_plan(self, x: Any) -> blockcopy.Plan | None:
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
        tokens = self.token_bytes(token_ids, len(keys))
        return self._retrying(lambda: self._writer.store_once(keys, fill, parent, None, tokens))

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
        return self.load_blocks(keys, seq_drain(self, out))

    def load_blocks(self, keys: Sequence[bytes], drain: Drain) -> int:
        """Load the cached prefix of `keys` through `drain`; returns blocks loaded."""
        keys = list(keys)
        if not keys:
            return 0
        return self._retrying(lambda: load_once(self, keys, drain))

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
        return self._retrying(lambda: pin_once(self, keys))

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
