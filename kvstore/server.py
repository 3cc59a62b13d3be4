"""gRPC front of the Store: parse, validate, call the store, map errors to status codes.

Why requests arrive as raw bytes: grpcio answers a request it cannot deserialize with INTERNAL,
which would make garbage from a client look like a daemon bug. Every handler therefore
receives the undecoded bytes and parses them itself, so a malformed message is an
INVALID_ARGUMENT with a message naming the expected type.

Why the server validates even though the Store does too: the server is the trust boundary. It
checks every field a client controls (lengths, counts, ranges, tier names) before anything
reaches the store, so a malformed request can never become a crash or an INTERNAL, and the
messages can name the protocol field ("keys[3]", "ttl_s") rather than a Python argument.

Error mapping: a `kvstore_client.errors` exception travels as the status its `.code` names;
anything else is a bug: INTERNAL, with the traceback logged, and the daemon keeps serving.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from google.protobuf.message import Message
from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client.errors import (
    InvalidArgument,
    KVStoreError,
    LeaseExpired,
    NotFound,
    Unavailable,
)
from kvstore_client.layout import KVLayout, NamespaceSpec

from . import getcopy
from .auth import OPEN, Auth
from .prefetch import Prefetcher
from .scoped import scoped_stats

log = logging.getLogger("kvstore.server")

SERVICE = "kvstore.v1.KVStore"
NS_ID_BYTES = 16
MIN_KEY_BYTES, MAX_KEY_BYTES = 16, 32
MAX_KEYS = 1 << 16            # per request: a 1M-token prompt in 16-token blocks
MAX_LEASE_ID = 128
MAX_TEXT = 1024               # model, revision, tenant salt, extra entries
MAX_EXTRA = 64
GET_BATCH_BYTES = 4 << 20     # block bytes per Get stream message
MAX_RESERVE_AHEAD = 1 << 12   # slots one Commit may reserve for the next store
# RegisterNamespaceResponse.protocol: 2 = Commit.reserve_next/first_slot and release_leases.
PROTOCOL = 2
# The largest valid request other than Put: MAX_KEYS keys and checksums, plus small fields.
MAX_REQUEST_BYTES = MAX_KEYS * (2 + MAX_KEY_BYTES + 11) + (256 << 10)
TIERS = ("gpu", "host", "ssd", "remote")
SLOT_TIERS = ("host", "gpu")  # tiers that hand out slots under leases

Observer = Callable[[str, str, float], None]


# -------------------------------------------------------------------------- validation helpers

def check_ns(ns_id: bytes, field: str = "namespace_id") -> bytes:
    if len(ns_id) != NS_ID_BYTES:
        what = "missing" if not ns_id else f"{len(ns_id)} bytes"
        raise InvalidArgument(f"{field} is {what}; it must be the {NS_ID_BYTES}-byte id "
                              "RegisterNamespace returned")
    return bytes(ns_id)


def check_key(key: bytes, field: str) -> bytes:
    if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
        raise InvalidArgument(f"{field} is {len(key)} bytes; block keys are {MIN_KEY_BYTES}.."
                              f"{MAX_KEY_BYTES} bytes (see docs/hashing.md)")
    return bytes(key)


def check_keys(keys: Iterable[bytes], field: str = "keys", allow_empty: bool = False,
               distinct: bool = False) -> list[bytes]:
    keys = list(keys)
    if not keys and not allow_empty:
        raise InvalidArgument(f"{field} is empty; pass at least one block key")
    if len(keys) > MAX_KEYS:
        raise InvalidArgument(f"{len(keys)} {field} in one request; the limit is {MAX_KEYS}, "
                              "split the request")
    lens = list(map(len, keys))
    if lens and MIN_KEY_BYTES <= min(lens) and max(lens) <= MAX_KEY_BYTES:
        # The common case, checked at C speed (protobuf hands over bytes already).
        out = keys if set(map(type, keys)) == {bytes} else list(map(bytes, keys))
    else:
        out = [check_key(k, f"{field}[{i}]") for i, k in enumerate(keys)]
    if distinct and len(set(out)) != len(out):
        seen: dict[bytes, int] = {}
        for i, k in enumerate(out):
            if k in seen:
                raise InvalidArgument(f"{field}[{i}] repeats {field}[{seen[k]}]; a prefix chain "
                                      "cannot hold the same block twice")
            seen[k] = i
    return out


def check_parent(parent: bytes, field: str = "parent") -> bytes | None:
    return check_key(parent, field) if parent else None


def check_lease_id(lease_id: str) -> str:
    if not lease_id:
        raise InvalidArgument("lease_id is empty; pass the id Reserve or Acquire returned")
    if len(lease_id) > MAX_LEASE_ID or not lease_id.isprintable():
        raise NotFound(f"unknown lease {lease_id[:40]!r}...: not an id this daemon hands out")
    return lease_id


def check_ttl(ttl_s: float, max_ttl_s: float) -> float | None:
    if math.isnan(ttl_s) or math.isinf(ttl_s) or ttl_s < 0:
        raise InvalidArgument(f"ttl_s must be 0 (daemon default) or a positive number of "
                              f"seconds, got {ttl_s}")
    if ttl_s > max_ttl_s:
        raise InvalidArgument(f"ttl_s={ttl_s:g} is above the daemon's maximum lease of "
                              f"{max_ttl_s:g} s (leases.max_ttl_s); renew the lease instead")
    return ttl_s or None


def check_slot_tier(tier: str, gpu_enabled: bool) -> str:
    tier = tier or "host"
    if tier not in SLOT_TIERS:
        raise InvalidArgument(f"tier {tier[:40]!r} cannot hand out slots; use 'host' (or 'gpu' "
                              "where the gpu tier is enabled)")
    if tier == "gpu" and not gpu_enabled:
        raise InvalidArgument("the gpu tier is not enabled on this daemon (gpu.enabled=false); "
                              "use tier 'host'")
    return tier


def check_count(count: int) -> int:
    if count <= 0:
        raise InvalidArgument("count must be at least 1 block")
    if count > MAX_KEYS:
        raise InvalidArgument(f"count {count} is above the per-request limit {MAX_KEYS}; "
                              "reserve in smaller batches")
    return count


def _text(value: str, field: str) -> str:
    if len(value) > MAX_TEXT:
        raise InvalidArgument(f"{field} is {len(value)} characters; the limit is {MAX_TEXT}")
    return value


def spec_from_proto(msg: pb.NamespaceSpec, has_layout: bool) -> NamespaceSpec:
    """Proto NamespaceSpec -> layout.NamespaceSpec, applying the proto's documented defaults."""
    if not has_layout:
        raise InvalidArgument("spec.layout is missing: give num_layers, num_kv_heads, head_dim, "
                              "block_tokens and dtype")
    if len(msg.extra) > MAX_EXTRA:
        raise InvalidArgument(f"spec.extra has {len(msg.extra)} entries; the limit is {MAX_EXTRA}")
    extra = {_text(k, "spec.extra key"): _text(v, f"spec.extra[{k[:40]!r}]")
             for k, v in msg.extra.items()}
    lay = msg.layout
    layout = KVLayout(num_layers=lay.num_layers, num_kv_heads=lay.num_kv_heads,
                      head_dim=lay.head_dim, block_tokens=lay.block_tokens,
                      dtype=lay.dtype or "bfloat16",
                      engine_layout=_text(lay.engine_layout, "spec.layout.engine_layout"),
                      block_bytes_opaque=lay.block_bytes,
                      kv_axes=_text(lay.kv_axes, "spec.layout.kv_axes"))
    return NamespaceSpec(model=_text(msg.model, "spec.model"), layout=layout,
                         revision=_text(msg.revision, "spec.revision"),
                         shard_rank=msg.shard_rank, shard_size=msg.shard_size or 1,
                         hash_scheme=_text(msg.hash_scheme, "spec.hash_scheme")
                         or "kvstore-blake3-v1",
                         tenant_salt=_text(msg.tenant_salt, "spec.tenant_salt"),
                         codec=msg.codec or "lossless", extra=extra)


def lease_to_proto(lease: Any) -> pb.Lease:
    # Slots as dicts: building a pb.Slot per slot cost ~4x as much, a visible share of a
    # 1,024-block lease's round trip (issue 19: small blocks pay per batch, not per block).
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


def _parse(cls: type[Message], raw: bytes) -> Any:
    if len(raw) > MAX_REQUEST_BYTES:
        # Refused before protobuf parses millions of keys (early refusal, issue 13).
        raise InvalidArgument(f"request is {len(raw)} bytes; no valid {cls.DESCRIPTOR.full_name} "
                              f"is larger than {MAX_REQUEST_BYTES} bytes (at most {MAX_KEYS} "
                              "keys of at most 32 bytes): split the request")
    try:
        return cls.FromString(raw)
    except Exception as e:  # DecodeError, or invalid UTF-8 in a string field
        raise InvalidArgument(f"request is not a valid {cls.DESCRIPTOR.full_name} message: "
                              f"{e}") from None


def _wire_fields(buf: memoryview, what: str) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of a protobuf message; bytes fields as memoryviews.

    Only what PutRequest needs: upb copies a bytes field on every access, and a Put carries
    megabytes of block data that should be copied once, into the slab.
    """
    i, n = 0, len(buf)

    def varint() -> int:
        nonlocal i
        shift = result = 0
        while True:
            if i >= n or shift > 63:
                raise InvalidArgument(f"request is not a valid {what} message: bad varint")
            b = buf[i]
            i += 1
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7

    while i < n:
        tag = varint()
        field, wt = tag >> 3, tag & 7
        if field == 0:
            raise InvalidArgument(f"request is not a valid {what} message: field number 0")
        if wt == 0:
            yield field, wt, varint()
        elif wt == 2:
            size = varint()
            if i + size > n:
                raise InvalidArgument(f"request is not a valid {what} message: truncated")
            yield field, wt, buf[i:i + size]
            i += size
        elif wt in (1, 5):
            size = 8 if wt == 1 else 4
            if i + size > n:
                raise InvalidArgument(f"request is not a valid {what} message: truncated")
            i += size
        else:
            raise InvalidArgument(f"request is not a valid {what} message: wire type {wt}")


def _parse_put(raw: bytes, block_bytes: int | None = None,
               sizer: Callable[[bytes], int | None] | None = None, where: str = "message 0"
               ) -> tuple[bytes, bytes, list[tuple[bytes, memoryview]]]:
    """PutRequest -> (namespace_id, parent, [(key, data view)]), data not copied.

    Refuses as it reads, not after: the block past MAX_KEYS, or a block whose data is not
    `block_bytes` long (`sizer(namespace_id)` gives it once the namespace field is read), ends
    the parse there, so a message of a million blocks costs no more than the first bad one.
    """
    ns = parent = b""
    blocks: list[tuple[bytes, memoryview]] = []
    what = "kvstore.v1.PutRequest"
    for field, wt, v in _wire_fields(memoryview(raw), what):
        if field == 3 and len(blocks) >= MAX_KEYS:
            raise InvalidArgument(f"{where} carries more than {MAX_KEYS} blocks (refused at "
                                  f"block {MAX_KEYS}); send at most {MAX_KEYS} per message")
        if field in (1, 2, 3) and wt != 2:
            raise InvalidArgument(f"request is not a valid {what} message: field {field} has "
                                  f"wire type {wt}")
        if field == 1:
            ns = bytes(v)
        elif field == 2:
            parent = bytes(v)
        elif field == 3:
            key, data = b"", memoryview(b"")
            for f2, wt2, v2 in _wire_fields(v, "kvstore.v1.Block"):
                if f2 in (1, 2) and wt2 != 2:
                    raise InvalidArgument(f"request is not a valid kvstore.v1.Block message: "
                                          f"field {f2} has wire type {wt2}")
                if f2 == 1:
                    key = bytes(v2)
                elif f2 == 2:
                    data = v2
            if block_bytes is not None and len(data) != block_bytes:
                raise InvalidArgument(f"{where} blocks[{len(blocks)}].data is {len(data)} "
                                      f"bytes; this namespace's blocks are {block_bytes} bytes")
            blocks.append((key, data))
        elif field == 1 and sizer is not None and block_bytes is None:
            block_bytes = sizer(bytes(v))
    return ns, parent, blocks


def _no(_ns_id: bytes) -> bool:
    return False


def _status(code: str) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, code, grpc.StatusCode.INTERNAL)


# -------------------------------------------------------------------------- the servicer


class KVStoreServicer:
    """One method per RPC of kvstore.v1.KVStore; each takes the raw request bytes."""

    def __init__(self, store: Any, max_ttl_s: float = 600.0, gpu_enabled: bool = False,
                 observe: Observer | None = None, in_flight: Any = None,
                 auth: Auth | None = None) -> None:
        self.store = store
        self.auth = auth or OPEN      # identity and ownership checks (kvstore/auth.py)
        self.tenant_counters: Any = None  # per-tenant lookups (kvstore/tenant_metrics.py)
        self.max_ttl_s = max_ttl_s
        self.gpu_enabled = gpu_enabled
        self._observe = observe
        self._in_flight = in_flight   # optional prometheus Gauge
        self._closing = threading.Event()
        self._block_bytes: dict[bytes, int] = {}
        self._prefetcher: Prefetcher | None = None
        self._prefetcher_lock = threading.Lock()
        self._pool_lock = threading.Lock()
        self._lane_lock = threading.Lock()
        self._reader: ThreadPoolExecutor | None = None   # Get's read-ahead (getcopy.stream)

    def start_shutdown(self) -> None:
        """New calls get UNAVAILABLE from now on; calls already running finish."""
        self._closing.set()
        if self._prefetcher is not None:
            self._prefetcher.close()

    def _prefetch(self) -> Prefetcher:
        with self._prefetcher_lock:
            if self._prefetcher is None:
                self._prefetcher = Prefetcher(self.store)
            return self._prefetcher

    # -- plumbing -----------------------------------------------------------------------------
    def _enter(self) -> None:
        if self._closing.is_set():
            raise Unavailable("the daemon is shutting down; retry against its replacement")
        if self._in_flight is not None:
            self._in_flight.inc()

    def _done(self, method: str, code: str, t0: float, entered: bool) -> None:
        if entered and self._in_flight is not None:
            self._in_flight.dec()
        if self._observe is not None:
            self._observe(method, code, time.perf_counter() - t0)

    @staticmethod
    def _failure(method: str, exc: BaseException) -> tuple[str, str]:
        if isinstance(exc, KVStoreError) and exc.code != "INTERNAL":
            return exc.code, str(exc) or type(exc).__name__
        log.error("%s failed with an unexpected error", method, exc_info=exc)
        return "INTERNAL", f"internal error in {method}: {type(exc).__name__}: {exc}"

    def unary(self, method: str, fn: Callable[[Any], Message]) -> Callable:
        """Wrap `fn(request)`: timing, in-flight count, exception -> status."""
        def handler(raw: Any, context: grpc.ServicerContext) -> Message:
            t0, entered = time.perf_counter(), False
            try:
                self._enter()
                entered = True
                self.auth.identify(context)
                resp = fn(raw)
            except Exception as exc:
                code, msg = self._failure(method, exc)
                self._done(method, code, t0, entered)
                context.abort(_status(code), msg)
            self._done(method, "OK", t0, entered)
            return resp
        return handler

    def lane_call(self, method: str, raw: bytes, tenant: Any) -> tuple[str, bytes]:
        """One call from the fast lane (kvstore/lane.py): as `unary`, with the caller known
        from the connection's hello; returns (status code, response or error message)."""
        t0, entered = time.perf_counter(), False
        try:
            self._enter()
            entered = True
            self.auth.bind(tenant)
            body = getattr(self, method)(raw).SerializeToString()
            with self._lane_lock:         # lane threads run at once; store.counters has no lock
                self.store.counters["lane_calls"] += 1
        except Exception as exc:
            code, msg = self._failure(method, exc)
            self._done(method, code, t0, entered)
            return code, msg.encode()
        self._done(method, "OK", t0, entered)
        return "OK", body

    def server_stream(self, method: str, fn: Callable[[bytes], Iterator[Message]]) -> Callable:
        """Like `unary` for a generator; an error after some messages ends the stream with it."""
        def handler(raw: bytes, context: grpc.ServicerContext) -> Iterator[Message]:
            t0, entered = time.perf_counter(), False
            code, msg = "OK", ""
            try:
                self._enter()
                entered = True
                self.auth.identify(context)
                yield from fn(raw)
            except GeneratorExit:   # the client went away mid-stream
                code = "CANCELLED"
                raise
            except Exception as exc:
                code, msg = self._failure(method, exc)
            finally:
                self._done(method, code, t0, entered)
            if code != "OK":
                context.abort(_status(code), msg)
        return handler

    def _ns_block_bytes(self, ns_id: bytes) -> int | None:
        bb = self._block_bytes.get(ns_id)
        if bb is None:
            lookup = getattr(self.store, "namespace", None)
            if lookup is None:
                return None
            bb = int(lookup(ns_id).block_bytes)   # NotFound for an unknown namespace
            self._block_bytes[ns_id] = bb
        return bb

    def _lookup(self, ns: bytes, keys: list[bytes]) -> Any:
        """store.lookup, counted per tenant where tenants are configured."""
        res = self.store.lookup(ns, keys)
        if self.tenant_counters is not None:
            caller = self.auth.caller
            self.tenant_counters.lookup(caller.name if caller else None, len(keys),
                                        res.prefix_blocks)
        return res

    def _lease_out(self, lease: Any) -> pb.Lease:
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

    # -- RPCs ---------------------------------------------------------------------------------
    def RegisterNamespace(self, raw: bytes) -> pb.RegisterNamespaceResponse:
        req = _parse(pb.RegisterNamespaceRequest, raw)
        if not req.HasField("spec"):
            raise InvalidArgument("spec is missing: RegisterNamespace needs the namespace spec")
        spec = self.auth.tag(spec_from_proto(req.spec, req.spec.HasField("layout")))
        info = self.store.register_namespace(spec)
        block_bytes = int(getattr(info, "block_bytes", spec.layout.block_bytes))
        self._block_bytes[bytes(info.ns_id)] = block_bytes
        # A tenant that is not admin gets no name of the shared pools: it streams over Put/Get
        # (kvstore/handoff.py hands it its own pool where it has one).
        caller = self.auth.caller
        shared = caller is None or caller.admin
        own = self.store.tenant_pool(caller) if caller is not None else None
        host = ({"kind": "memfd", "name": "", "size": own[1]} if own is not None
                else self.store.host_info() if shared else {})
        resp = pb.RegisterNamespaceResponse(
            namespace_id=info.ns_id, block_bytes=block_bytes, daemon_id=self.store.daemon_id,
            protocol=PROTOCOL,
            wants_token_ids=bool(getattr(self.store, "wants_token_ids", _no)(info.ns_id)),
            host_pool=pb.HostPool(kind=str(host.get("kind", "")), name=str(host.get("name", "")),
                                  size=int(host.get("size", 0))))
        own_gpu = self.store.gpu_segments_of(caller.name) if caller is not None else []
        for g in (self.store.gpu_info(own_gpu) if own_gpu else
                  self.store.gpu_info() if shared else ()):
            resp.gpu_pools.add(device=int(g.get("device", 0)),
                               ipc_handle=bytes(g.get("ipc_handle", b"")),
                               size=int(g.get("size", 0)), owner_pid=int(g.get("owner_pid", 0)),
                               kind=str(g.get("kind", "")), name=str(g.get("name", "")))
        return resp

    def Lookup(self, raw: bytes) -> pb.LookupResponse:
        req = _parse(pb.LookupRequest, raw)
        ns = check_ns(req.namespace_id)
        self.auth.check_ns(ns)
        keys = check_keys(req.keys, allow_empty=True)
        res = self._lookup(ns, keys)
        return pb.LookupResponse(prefix_blocks=res.prefix_blocks,
                                 per_tier={str(k): int(v) for k, v in res.per_tier.items()})

    def Locate(self, raw: bytes) -> pb.LocateResponse:
        req = _parse(pb.LocateRequest, raw)
        ns = check_ns(req.namespace_id)
        self.auth.check_ns(ns)
        keys = check_keys(req.keys, allow_empty=True)
        where = self.store.where(ns, keys)
        names = [t for t in TIERS if t in set(where)]
        code = {t: i + 1 for i, t in enumerate(names)}
        resp = pb.LocateResponse(tier_names=names, where=bytes(code.get(t, 0) for t in where))
        if req.prefetch and any(t is not None and t != "host" for t in where):
            resp.prefetching = self._prefetch().submit(ns, keys, where)
        return resp

    def Reserve(self, raw: bytes) -> pb.ReserveResponse:
        req = _parse(pb.ReserveRequest, raw)
        ns = check_ns(req.namespace_id)
        self.auth.check_ns(ns)
        n = check_count(req.count)
        tier = check_slot_tier(req.tier, self.gpu_enabled)
        self.auth.check_tier(tier)
        ttl = check_ttl(req.ttl_s, self.max_ttl_s)
        dev = {"device": req.device} if req.HasField("device") else {}
        lease = self.store.reserve(ns, n, tier=tier, ttl_s=ttl, **dev)
        return pb.ReserveResponse(lease=self._lease_out(lease))

    def Commit(self, raw: bytes) -> pb.CommitResponse:
        req = _parse(pb.CommitRequest, raw)
        self._release_carried(req.release_leases)
        lease_id = check_lease_id(req.lease_id)
        self.auth.check_lease(lease_id)
        keys = check_keys(req.keys, allow_empty=True, distinct=True)
        parent = check_parent(req.parent)
        if req.checksums and len(req.checksums) != len(keys):
            raise InvalidArgument(f"{len(req.checksums)} checksums for {len(keys)} keys; send "
                                  "one per key or none")
        lease = self.store.leases.find(lease_id) if req.reserve_next else None
        tokens = {"token_ids": req.token_ids} if req.token_ids else {}
        res = self.store.commit(lease_id, keys, parent=parent,
                                checksums=list(req.checksums) or None,
                                first_slot=req.first_slot, **tokens)
        resp = pb.CommitResponse(stored=res.stored, duplicates=res.duplicates)
        if lease is not None and lease.tier == "host":
            self._reserve_ahead(resp, lease.ns_id, req)
        return resp

    def _reserve_ahead(self, resp: pb.CommitResponse, ns_id: bytes, req: Any) -> None:
        """The write lease for the client's next store, in this Commit's answer. Why: an
        engine stores batch after batch, and reserving the next batch's slots here saves that
        store a round trip. It takes only free room (nothing is evicted for a store that may
        not come); a pool without it answers without one: the client reserves as before, and
        the commit that just succeeded is not failed by a reservation it only asked for
        ahead."""
        n = min(int(req.reserve_next), MAX_RESERVE_AHEAD)
        ttl = check_ttl(req.next_ttl_s, self.max_ttl_s)
        try:
            nxt = self.store.reserve(ns_id, n, tier="host", ttl_s=ttl, ahead=True)
        except KVStoreError as e:
            self.store.counters["reserve_ahead_refused"] += 1
            log.debug("reserve-ahead of %d slots refused: %s", n, e)
            return
        self.store.counters["reserve_ahead"] += 1
        resp.next_lease.CopyFrom(self._lease_out(nxt))

    def Acquire(self, raw: bytes) -> pb.AcquireResponse:
        req = _parse(pb.AcquireRequest, raw)
        self._release_carried(req.release_leases)
        ns = check_ns(req.namespace_id)
        self.auth.check_ns(ns)
        keys = check_keys(req.keys)
        tier = check_slot_tier(req.tier, self.gpu_enabled)
        self.auth.check_tier(tier)
        ttl = check_ttl(req.ttl_s, self.max_ttl_s)
        dev = {"device": req.device} if req.HasField("device") else {}
        lease = self.store.acquire(ns, keys, tier=tier, ttl_s=ttl, **dev)
        return pb.AcquireResponse(lease=self._lease_out(lease))

    def _release_carried(self, lease_ids: Iterable[str]) -> None:
        """Release the leases a call carries (the client's finished loads), as Release would;
        one it no longer holds (expired, or the daemon restarted) is already free."""
        for raw_id in lease_ids:
            lease_id = check_lease_id(raw_id)
            self.auth.check_lease(lease_id)
            try:
                self.store.release(lease_id, missing_ok=True)
            except LeaseExpired:
                continue                # reaped at its deadline: its slots are free already
            self.store.counters["releases_carried"] += 1

    def Release(self, raw: bytes) -> pb.ReleaseResponse:
        req = _parse(pb.ReleaseRequest, raw)
        lease_id = check_lease_id(req.lease_id)
        self.auth.check_lease(lease_id)
        self.store.release(lease_id)
        return pb.ReleaseResponse()

    def RenewLease(self, raw: bytes) -> pb.RenewLeaseResponse:
        req = _parse(pb.RenewLeaseRequest, raw)
        lease_id = check_lease_id(req.lease_id)
        self.auth.check_lease(lease_id)
        ttl = check_ttl(req.ttl_s, self.max_ttl_s)
        return pb.RenewLeaseResponse(deadline=self.store.renew(lease_id, ttl))

    def Put(self, raws: Iterator[bytes]) -> pb.PutResponse:
        """Client stream: each message's blocks continue the chain of the previous message."""
        ns: bytes | None = None
        prev: bytes | None = None      # parent of the next block
        stored = dups = 0
        block_bytes: int | None = None

        def sizer(ns_id: bytes) -> int | None:
            self.auth.check_ns(check_ns(ns_id, "namespace_id (first Put message)"))
            return self._ns_block_bytes(ns_id)
        for m, raw in enumerate(raws):
            req_ns, req_parent, blocks = _parse_put(raw, block_bytes, sizer if m == 0 else None,
                                                    f"message {m}")
            if m == 0:
                ns = check_ns(req_ns, "namespace_id (first Put message)")
                self.auth.check_ns(ns)
                prev = check_parent(req_parent, "parent (first Put message)")
                block_bytes = self._ns_block_bytes(ns)
            else:
                if req_ns and req_ns != ns:
                    raise InvalidArgument(f"Put message {m} names another namespace; one Put "
                                          "stream writes one namespace")
                if req_parent and req_parent != prev:
                    raise InvalidArgument(f"Put message {m}: parent must be empty (the chain "
                                          "continues from the previous message's last key)")
            if not blocks:
                continue
            keys = check_keys((k for k, _ in blocks), f"message {m} blocks[].key",
                              distinct=True)
            for i, (_, data) in enumerate(blocks):
                if block_bytes is not None and len(data) != block_bytes:
                    raise InvalidArgument(f"message {m} blocks[{i}].data is {len(data)} bytes; "
                                          f"this namespace's blocks are {block_bytes} bytes")
            res = self.store.put(ns, keys, [d for _, d in blocks], parent=prev)
            stored += res.stored
            dups += res.duplicates
            prev = keys[-1]
        return pb.PutResponse(stored=stored, duplicates=dups)

    def Get(self, raw: bytes) -> Iterator[bytes | pb.GetResponse]:
        """The longest cached prefix, fetched and sent in ~8 MiB batches to bound memory."""
        req = _parse(pb.GetRequest, raw)
        ns = check_ns(req.namespace_id)
        self.auth.check_ns(ns)
        keys = check_keys(req.keys)
        bb = self._ns_block_bytes(ns)
        per = max(1, GET_BATCH_BYTES // bb) if bb else 1
        sent = False
        for msg in self._get_batches(ns, keys, per, self.store.config.host.verify_reads):
            sent = True
            yield msg
        if not sent:
            yield pb.GetResponse()

    def _get_batches(self, ns: bytes, keys: list[bytes], per: int, check: bool
                     ) -> Iterator[bytes]:
        """Encoded GetResponses of the longest cached prefix, each block's copy checked against
        its commit checksum (kvstore/getcopy.py); a block that fails ends the stream there."""
        def read(chunk: list[bytes]) -> getcopy.Reply:
            return self.store.read_prefix(
                ns, chunk, lambda views, sums: getcopy.encode(views, sums, check))

        def report(key: bytes) -> None:
            self.store.corrupt_host_copy(ns, key, "Get")
        return getcopy.stream(read, keys, per, report,
                              self._read_pool() if len(keys) > per else None)

    def _read_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._reader is None:
                self._reader = ThreadPoolExecutor(2, thread_name_prefix="get-read")
            return self._reader

    def Delete(self, raw: bytes) -> pb.DeleteResponse:
        req = _parse(pb.DeleteRequest, raw)
        ns = check_ns(req.namespace_id)
        self.auth.check_ns(ns)
        if req.all and req.keys:
            raise InvalidArgument("pass either keys or all=true, not both")
        if not req.all and not req.keys:
            raise InvalidArgument("nothing to delete: pass keys, or all=true for the whole "
                                  "namespace")
        keys = None if req.all else check_keys(req.keys)
        return pb.DeleteResponse(deleted=int(self.store.delete(ns, keys)))

    def Retain(self, raw: bytes) -> pb.RetainResponse:
        req = _parse(pb.RetainRequest, raw)
        ns = check_ns(req.namespace_id)
        self.auth.check_ns(ns)
        keys = check_keys(req.keys)
        return pb.RetainResponse(blocks=int(self.store.retain(ns, keys, req.level)))

    def Evict(self, raw: bytes) -> pb.EvictResponse:
        req = _parse(pb.EvictRequest, raw)
        if req.tier not in TIERS:
            raise InvalidArgument(f"tier {req.tier[:40]!r} is not one of {list(TIERS)}")
        scope = self.auth.scope()
        res = (self.store.evict(req.tier, int(req.bytes)) if scope is None
               else self.store.evict(req.tier, int(req.bytes), only=scope))
        freed, blocks = res if isinstance(res, tuple) else (res, 0)
        return pb.EvictResponse(freed_bytes=int(freed), blocks=int(blocks))

    def Flush(self, raw: bytes) -> pb.FlushResponse:
        _parse(pb.FlushRequest, raw)
        scope = self.auth.scope()
        done = self.store.flush() if scope is None else self.store.flush(only=scope)
        return pb.FlushResponse(demoted=int(done or 0))

    def Stats(self, raw: bytes) -> pb.StatsResponse:
        _parse(pb.StatsRequest, raw)
        scope = self.auth.scope()
        if scope is None:
            return stats_to_proto(self.store.stats(), self.store.daemon_id)
        return stats_to_proto(scoped_stats(self.store, scope), self.store.daemon_id)

    # -- fused calls: one round trip where the protocol allows (issue 19) ---------------------
    def _fused_lookup(self, req: Any) -> tuple[bytes, list[bytes], str, float, Any]:
        """The checks and the lookup both fused calls start with."""
        ns = check_ns(req.namespace_id)
        self.auth.check_ns(ns)
        keys = check_keys(req.keys)
        tier = check_slot_tier(req.tier, self.gpu_enabled)
        self.auth.check_tier(tier)
        ttl = check_ttl(req.ttl_s, self.max_ttl_s)
        return ns, keys, tier, ttl, self._lookup(ns, keys)

    def LookupReserve(self, raw: bytes) -> pb.LookupReserveResponse:
        """Lookup, then Reserve slots for the missing keys (at most max_slots)."""
        req = _parse(pb.LookupReserveRequest, raw)
        ns, keys, tier, ttl, res = self._fused_lookup(req)
        resp = pb.LookupReserveResponse(
            prefix_blocks=res.prefix_blocks,
            per_tier={str(k): int(v) for k, v in res.per_tier.items()})
        missing = len(keys) - res.prefix_blocks
        if missing > 0:
            n = min(missing, req.max_slots) if req.max_slots else missing
            dev = {"device": req.device} if req.HasField("device") else {}
            lease = self.store.reserve(ns, check_count(n), tier=tier, ttl_s=ttl, **dev)
            resp.lease.CopyFrom(self._lease_out(lease))
        return resp

    def LookupAcquire(self, raw: bytes) -> pb.LookupAcquireResponse:
        """Lookup, then Acquire the cached prefix under a read lease."""
        req = _parse(pb.LookupAcquireRequest, raw)
        self._release_carried(req.release_leases)
        ns, keys, tier, ttl, res = self._fused_lookup(req)
        resp = pb.LookupAcquireResponse(
            prefix_blocks=res.prefix_blocks,
            per_tier={str(k): int(v) for k, v in res.per_tier.items()})
        if res.prefix_blocks:
            dev = {"device": req.device} if req.HasField("device") else {}
            lease = self.store.acquire(ns, keys[:res.prefix_blocks], tier=tier, ttl_s=ttl,
                                       **dev)
            if lease.slots:
                resp.lease.CopyFrom(self._lease_out(lease))
            else:                       # nothing could be pinned: hold nothing
                self.store.release(lease.id, missing_ok=True)
        return resp

    # -- registration -------------------------------------------------------------------------
    def handler(self) -> grpc.GenericRpcHandler:
        """The generic handler with raw-bytes request deserializers (see module docstring)."""
        def ser(msg: Message | bytes) -> bytes:
            # Get replies arrive already encoded (one copy from the slab, no protobuf copies).
            return msg if isinstance(msg, bytes) else msg.SerializeToString()

        unary = ("RegisterNamespace", "Lookup", "Reserve", "Commit", "Acquire", "Release",
                 "RenewLease", "Retain", "Delete", "Evict", "Flush", "Stats", "Locate",
                 "LookupReserve", "LookupAcquire")
        handlers = {name: grpc.unary_unary_rpc_method_handler(
            self.unary(name, getattr(self, name)), response_serializer=ser) for name in unary}
        handlers["Put"] = grpc.stream_unary_rpc_method_handler(
            self.unary("Put", self.Put), response_serializer=ser)
        handlers["Get"] = grpc.unary_stream_rpc_method_handler(
            self.server_stream("Get", self.Get), response_serializer=ser)
        return grpc.method_handlers_generic_handler(SERVICE, handlers)


# -------------------------------------------------------------------------- the server

def grpc_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # Two daemons must never share a TCP port silently: bind fails instead.
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ]


def build_server(servicer: KVStoreServicer, workers: int, max_message_bytes: int
                 ) -> tuple[grpc.Server, Any]:
    """A thread-pool gRPC server with the KVStore service, health checking and reflection.

    Returns (server, health servicer); the caller binds ports, starts it and flips health
    to SERVING once it is really ready.
    """
    from concurrent.futures import ThreadPoolExecutor

    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    server = grpc.server(ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rpc"),
                         options=grpc_options(max_message_bytes),
                         maximum_concurrent_rpcs=None)
    server.add_generic_rpc_handlers((servicer.handler(),))
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection(
        (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return server, health_servicer
