"""The SDK client: connect to a daemon, register a namespace, store and load prefix blocks.

Data flow (DESIGN.md §3). Same host: the client maps the daemon's shared-memory host pool once
and copies blocks straight into and out of it (Reserve → copy → Commit; Acquire → copy →
Release), so a block crosses memory once per direction and gRPC carries only small control
messages. A client that cannot map the pool (another host, or `transport="grpc"`) streams the
same bytes with Put/Get instead. Both paths go through one pair of primitives — `fill` (write
blocks into a byte buffer at given offsets) and `drain` (read them back out) — so the dense
sequence layout here and the paged engine layout in `paged.py` share every other line.

Restarts: a daemon restart gives a new `daemon_id` and a fresh pool segment. The client notices
(the channel dropped, the pool segment changed under the same name, the namespace or a lease is
unknown, or a checksum fails) and re-registers its namespaces and re-maps the pool before
retrying the call once, so callers see at most a slower call.

Every RPC carries a deadline and waits for the channel to become ready within it, so a daemon
that is restarting is waited for, and one that is gone fails within `timeout` seconds.
"""

from __future__ import annotations

import logging
import mmap
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import xxhash

from . import errors
from ._proto import kvstore_pb2 as pb
from ._proto import kvstore_pb2_grpc as pbg
from .errors import DataLoss, InvalidArgument, KVStoreError, LeaseExpired, NotFound, Unavailable
from .hashing import DEFAULT_KEY_BYTES, ExtraKey, block_keys
from .layout import KVLayout, NamespaceSpec
from .leases import LeaseKeeper

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 << 20
DEFAULT_TIMEOUT_S = 10.0
PAGE = 4096
# Blocks are copied and checksummed in groups of about this many bytes, so the checksum pass
# reads bytes the copy just left in cache.
_CHUNK_BYTES = 4 << 20
# Put streams carry about this many block bytes per message (and per RPC at most _PUT_RPC_BYTES),
# bounding the client's temporary memory.
_PUT_MESSAGE_BYTES = 2 << 20
_PUT_RPC_BYTES = 64 << 20
# A Reserve asks for at most this share of the host pool (the daemon refuses batches that do not
# fit below its high watermark) and at most this many slots.
_RESERVE_POOL_SHARE = 0.25
_RESERVE_MAX_SLOTS = 1024

Fill = Callable[[np.ndarray, Sequence[int], int], None]
"""fill(base, offsets, first): write blocks first, first+1, ... into base[offsets[j]:+bb]."""
Drain = Callable[[np.ndarray, Sequence[int], int], None]
"""drain(base, offsets, first): copy base[offsets[j]:+bb] out as blocks first, first+1, ..."""

TRANSPORTS = ("auto", "shm", "grpc")


# ----------------------------------------------------------------------------------- addresses

def grpc_target(address: str) -> tuple[str, bool]:
    """(gRPC target, same host?) for a socket path, "unix:..." or "host:port" address."""
    if not isinstance(address, str) or not address.strip():
        raise InvalidArgument("address must be a Unix socket path, 'unix:///path' or "
                              f"'host:port', got {address!r}")
    a = address.strip()
    if a.startswith("unix:"):
        path = a[len("unix:"):]
        if path.startswith("//"):
            path = path[2:]
        return "unix:" + os.path.abspath(path), True
    if a.startswith(("/", ".", "~")) or ":" not in a:
        return "unix:" + os.path.abspath(os.path.expanduser(a)), True
    host, sep, port = a.rpartition(":")
    if not sep or not port.isdigit():
        raise InvalidArgument(f"cannot read {address!r} as an address: use a Unix socket path, "
                              "'unix:///path' or 'host:port'")
    local = host.strip("[]") in ("localhost", "127.0.0.1", "::1", "")
    return a, local


# ------------------------------------------------------------------------------------ errors

def _error(e: grpc.RpcError, what: str, target: str) -> KVStoreError:
    """The errors.* exception a status stands for, with the daemon's own message."""
    code = e.code() if hasattr(e, "code") else None
    name = code.name if code is not None else "UNKNOWN"
    details = (e.details() if hasattr(e, "details") else None) or str(e)
    if name == "UNAVAILABLE":
        details = f"daemon at {target} is not reachable: {details}"
    elif name == "DEADLINE_EXCEEDED":
        details = f"{what} to {target} did not finish within its deadline: {details}"
    return errors.from_code(name, f"{what}: {details}")


# -------------------------------------------------------------------------- arrays / tensors

_NP_DTYPES = {"float16": np.float16, "float32": np.float32, "bfloat16": np.uint16}
_RAW = {2: np.int16, 4: np.int32, 8: np.int64}


def _torch() -> Any:
    return sys.modules.get("torch")


def _is_tensor(x: Any) -> bool:
    t = _torch()
    return t is not None and isinstance(x, t.Tensor)


def raw_view(x: Any, layout: KVLayout, what: str) -> Any:
    """`x` reinterpreted as same-size integers (a view, never a copy), after checking its dtype.

    Returns a numpy array for numpy inputs and CPU tensors (so copies use numpy's memcpy loops),
    and an integer-typed tensor for device tensors (copied with torch). The integer view makes
    the copy a pure byte move: no float conversion, no NaN canonicalisation, and bfloat16 needs
    no numpy support.
    """
    isz = layout.itemsize
    if _is_tensor(x):
        t = _torch()
        name = str(x.dtype).removeprefix("torch.")
        if name != layout.dtype:
            raise InvalidArgument(f"{what} has dtype {name}; this namespace holds {layout.dtype} "
                                  "(convert with .to(...) first: the store never converts)")
        x = x.detach().view({2: t.int16, 4: t.int32}[isz])
        return x.numpy() if x.device.type == "cpu" else x
    if not isinstance(x, np.ndarray):
        raise InvalidArgument(f"{what} must be a numpy array or a torch tensor, got "
                              f"{type(x).__name__}")
    ok = x.dtype.name == layout.dtype or (x.dtype.kind in "ui" and x.dtype.itemsize == isz) \
        or (layout.dtype != "bfloat16" and x.dtype == _NP_DTYPES[layout.dtype])
    if not ok:
        hint = " (numpy has no bfloat16: pass a torch tensor or a uint16 view of the bits)" \
            if layout.dtype == "bfloat16" else ""
        raise InvalidArgument(f"{what} has dtype {x.dtype}; this namespace holds "
                              f"{layout.dtype}{hint}")
    return x.view(_RAW[isz])


def check_seq(x: Any, layout: KVLayout, tokens: int, what: str) -> None:
    """`x` must be [num_layers, 2, >= tokens, num_kv_heads, head_dim]."""
    shape = tuple(x.shape)
    L, _, T, H, D = layout.block_shape
    if len(shape) != 5 or shape[0] != L or shape[1] != 2 or shape[3] != H or shape[4] != D:
        raise InvalidArgument(f"{what} has shape {shape}; expected [num_layers={L}, 2, tokens, "
                              f"num_kv_heads={H}, head_dim={D}] (the canonical sequence layout)")
    if shape[2] < tokens:
        raise InvalidArgument(f"{what} holds {shape[2]} tokens, fewer than the {tokens} the "
                              "full blocks of token_ids need")


def slot_view(base: np.ndarray, offset: int, layout: KVLayout, like: Any) -> Any:
    """The block at `base[offset:]` as [L, 2, T, H, D] integers matching `like`'s kind."""
    nbytes = layout.block_bytes
    v = base[offset:offset + nbytes].view(_RAW[layout.itemsize]).reshape(layout.block_shape)
    if isinstance(like, np.ndarray):
        return v
    return _torch().from_numpy(v)


def copy_block(dst: Any, src: Any) -> None:
    """dst[...] = src for two same-shape integer views (numpy, or torch where one is a tensor)."""
    if isinstance(dst, np.ndarray) and isinstance(src, np.ndarray):
        np.copyto(dst, src, casting="no")
        return
    t = _torch()
    d = t.from_numpy(dst) if isinstance(dst, np.ndarray) else dst
    s = t.from_numpy(src) if isinstance(src, np.ndarray) else src
    d.copy_(s)


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned, pre-faulted uint8 buffer (PERF-NOTES: alignment and page-fault traps)."""
    mm = mmap.mmap(-1, max(PAGE, nbytes))
    arr = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
    arr[::PAGE] = 0
    return arr


# ------------------------------------------------------------------------ Put/Get wire format
# Put and Get move the block bytes; encoding them by hand avoids protobuf's extra copies of
# multi-MiB `bytes` fields (one join here, and zero-copy views on the way back).

def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(buf: memoryview, i: int) -> tuple[int, int]:
    shift = n = 0
    while True:
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return n, i
        shift += 7
        if shift > 63:
            raise DataLoss("malformed Get response from the daemon (varint too long)")


def encode_put(ns_id: bytes, parent: bytes, blocks: Sequence[tuple[bytes, Any]]) -> bytes:
    """A serialized PutRequest holding `blocks` [(key, bytes-like or list of bytes-likes)]."""
    parts: list[Any] = []
    if ns_id:
        parts += [b"\x0a", _varint(len(ns_id)), ns_id]
    if parent:
        parts += [b"\x12", _varint(len(parent)), parent]
    for key, data in blocks:
        pieces = data if isinstance(data, list) else [data]
        n = sum(p.nbytes if isinstance(p, np.ndarray) else len(p) for p in pieces)
        inner = 1 + len(_varint(len(key))) + len(key) + 1 + len(_varint(n)) + n
        parts += [b"\x1a", _varint(inner), b"\x0a", _varint(len(key)), key, b"\x12",
                  _varint(n), *pieces]
    return b"".join(parts)


def _skip(buf: memoryview, i: int, wire: int) -> int:
    if wire == 0:
        return _read_varint(buf, i)[1]
    if wire == 1:
        return i + 8
    if wire == 2:
        n, i = _read_varint(buf, i)
        return i + n
    if wire == 5:
        return i + 4
    raise DataLoss(f"malformed Get response from the daemon (wire type {wire})")


def decode_get(raw: bytes) -> list[tuple[bytes, int, int]]:
    """[(key, data offset, data length)] of a serialized GetResponse, offsets into `raw`."""
    buf = memoryview(raw)
    out: list[tuple[bytes, int, int]] = []
    i, end = 0, len(buf)
    while i < end:
        tag, i = _read_varint(buf, i)
        if tag != 0x0A:
            i = _skip(buf, i, tag & 7)
            continue
        n, i = _read_varint(buf, i)
        j, bend = i, i + n
        key, doff, dlen = b"", -1, 0
        while j < bend:
            t, j = _read_varint(buf, j)
            if t == 0x0A:
                m, j = _read_varint(buf, j)
                key = bytes(buf[j:j + m])
                j += m
            elif t == 0x12:
                m, j = _read_varint(buf, j)
                doff, dlen = j, m
                j += m
            else:
                j = _skip(buf, j, t & 7)
        if doff < 0 or bend > end:
            raise DataLoss("malformed Get response from the daemon (block without data)")
        out.append((key, doff, dlen))
        i = bend
    return out


# ------------------------------------------------------------------------------ the client

@dataclass
class LookupResult:
    """Longest cached prefix in blocks, overall and per tier."""

    prefix_blocks: int
    per_tier: dict[str, int]


class _Pool:
    """The mapped host pool, with the segment identity to notice a restarted daemon."""

    def __init__(self, name: str, size: int) -> None:
        from . import shm  # only clients that map the pool need it
        self.name, self.size = name, size
        self.slab = shm.attach(name, size)
        self.ino = self._ino()

    def _ino(self) -> tuple[int, int] | None:
        try:
            st = os.stat(os.path.join("/dev/shm", self.name))
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def current(self) -> bool:
        """False when the daemon replaced the segment (restart) or removed it."""
        return not os.path.isdir("/dev/shm") or self._ino() == self.ino

    def close(self) -> None:
        self.slab.close()


class Client:
    """A connection to one daemon. Thread-safe; use as a context manager or call `close()`."""

    def __init__(self, address: str, *, transport: str = "auto",
                 timeout: float = DEFAULT_TIMEOUT_S, verify: bool = True,
                 lease_ttl_s: float = 0.0) -> None:
        if transport not in TRANSPORTS:
            raise InvalidArgument(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if not timeout or timeout <= 0:
            raise InvalidArgument(f"timeout must be positive seconds, got {timeout!r}")
        self.address = address
        self.target, self._local = grpc_target(address)
        self.transport_option = transport
        self.timeout = float(timeout)
        self.verify = verify
        self.lease_ttl_s = float(lease_ttl_s)
        self._lock = threading.RLock()
        self._closed = False
        self._channel = grpc.insecure_channel(self.target, options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            # A restarted daemon should be found again in well under a second.
            ("grpc.initial_reconnect_backoff_ms", 50),
            ("grpc.min_reconnect_backoff_ms", 50),
            ("grpc.max_reconnect_backoff_ms", 500),
            ("grpc.enable_retries", 0),
        ])
        self._stub = pbg.KVStoreStub(self._channel)
        self._put = self._channel.stream_unary(
            "/kvstore.v1.KVStore/Put", request_serializer=lambda b: b,
            response_deserializer=pb.PutResponse.FromString)
        self._get = self._channel.unary_stream(
            "/kvstore.v1.KVStore/Get", request_serializer=pb.GetRequest.SerializeToString,
            response_deserializer=lambda b: b)
        self.daemon_id = ""
        self._pool: _Pool | None = None
        self._shm_error: str | None = None
        self._namespaces: weakref.WeakSet[Namespace] = weakref.WeakSet()
        self.leases = LeaseKeeper(self._renew, self._release_quiet)
        self.counters: dict[str, int] = {"resyncs": 0, "checksum_failures": 0,
                                         "leases_lost": 0}

    # -- plumbing -------------------------------------------------------------------------
    def call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        """One unary RPC with a deadline, statuses turned into errors.* exceptions."""
        if self._closed:
            raise KVStoreError("client is closed")
        try:
            return getattr(self._stub, method)(request, timeout=timeout or self.timeout,
                                               wait_for_ready=True)
        except grpc.RpcError as e:
            raise _error(e, method, self.target) from None

    def _renew(self, lease_id: str) -> float:
        return self.call("RenewLease", pb.RenewLeaseRequest(lease_id=lease_id,
                                                            ttl_s=self.lease_ttl_s)).deadline

    def _release_quiet(self, lease_id: str) -> None:
        if self._closed:
            return  # close() released every lease the keeper held
        try:
            self.call("Release", pb.ReleaseRequest(lease_id=lease_id), timeout=2.0)
        except (NotFound, LeaseExpired, Unavailable):
            pass  # already gone: the daemon restarted or reaped it

    def release(self, lease_id: str) -> None:
        """Release a lease (best effort: a lease the daemon no longer knows is already free)."""
        self.leases.remove(lease_id)
        self._release_quiet(lease_id)

    @property
    def pool(self) -> _Pool | None:
        return self._pool

    @property
    def transport(self) -> str:
        """"shm" once the pool is mapped, else "grpc"."""
        return "shm" if self._pool is not None else "grpc"

    def _adopt(self, resp: pb.RegisterNamespaceResponse) -> None:
        """Take the daemon identity and pool from a RegisterNamespace answer (caller locks)."""
        changed = resp.daemon_id != self.daemon_id
        self.daemon_id = resp.daemon_id
        if self.transport_option == "grpc":
            return
        hp = resp.host_pool
        pool = self._pool
        if pool is not None and not changed and pool.name == hp.name and pool.current():
            return
        if pool is not None:
            self._pool = None
            pool.close()
        if self.transport_option == "auto" and not self._local:
            self._shm_error = "the daemon is on another host"
            return
        try:
            if hp.kind != "shm" or not hp.name or not hp.size:
                raise NotFound(f"the daemon offers no shared-memory host pool ({hp.kind!r})")
            self._pool = _Pool(hp.name, int(hp.size))
            self._shm_error = None
        except (KVStoreError, OSError) as e:
            self._shm_error = str(e)
            if self.transport_option == "shm":
                raise Unavailable(f"transport='shm' but the host pool cannot be mapped: {e}"
                                  ) from None
            log.info("kvstore: using Put/Get streams (host pool not mappable: %s)", e)

    def register(self, spec: NamespaceSpec) -> pb.RegisterNamespaceResponse:
        resp = self.call("RegisterNamespace", pb.RegisterNamespaceRequest(spec=spec_to_proto(spec)))
        with self._lock:
            self._adopt(resp)
        return resp

    def resync(self) -> None:
        """Re-register every namespace and re-map the pool (after a daemon restart)."""
        with self._lock:
            self.counters["resyncs"] += 1
            for ns in list(self._namespaces):
                ns._register()

    def _check_fresh(self) -> None:
        """Resync if the pool segment changed since we mapped it (the daemon restarted)."""
        pool = self._pool
        if pool is not None and not pool.current():
            self.resync()

    # -- public -----------------------------------------------------------------------------
    def namespace(self, layout: KVLayout, *, model: str, revision: str = "",
                  codec: str = "lossless", shard_rank: int = 0, shard_size: int = 1,
                  tenant_salt: str = "", hash_scheme: str = "kvstore-blake3-v1",
                  extra: dict[str, str] | None = None, extra_keys: Sequence[ExtraKey] = (),
                  key_bytes: int = DEFAULT_KEY_BYTES) -> Namespace:
        """Register (or join) the namespace for this model/layout/shard and return a handle.

        `extra_keys` (e.g. a LoRA adapter name) are mixed into every block key `keys()` makes.
        """
        spec = NamespaceSpec(model=model, layout=layout, revision=revision,
                             shard_rank=shard_rank, shard_size=shard_size,
                             hash_scheme=hash_scheme, tenant_salt=tenant_salt, codec=codec,
                             extra=dict(extra or {}))
        ns = Namespace(self, spec, extra_keys=tuple(extra_keys), key_bytes=key_bytes)
        self._namespaces.add(ns)
        return ns

    def stats(self) -> dict[str, Any]:
        """The daemon's Stats as plain data: {"tiers": {name: {...}}, "counters": ..., ...}."""
        r = self.call("Stats", pb.StatsRequest())
        tiers = {t.name: {"capacity_bytes": t.capacity_bytes, "used_bytes": t.used_bytes,
                          "blocks": t.blocks, "hits": t.hits, "misses": t.misses,
                          "evictions": t.evictions} for t in r.tiers}
        return {"tiers": tiers, "counters": dict(r.counters), "namespaces": r.namespaces,
                "active_leases": r.active_leases, "daemon_id": r.daemon_id}

    def evict(self, tier: str, nbytes: int = 0) -> tuple[int, int]:
        """Ask the daemon to evict from `tier` (0 bytes: everything evictable)."""
        r = self.call("Evict", pb.EvictRequest(tier=tier, bytes=nbytes))
        return int(r.freed_bytes), int(r.blocks)

    def flush(self) -> int:
        """Demote every host block to SSD; returns how many were written."""
        return int(self.call("Flush", pb.FlushRequest(), timeout=max(self.timeout, 60)).demoted)

    def close(self) -> None:
        """Release every lease still held, unmap the pool, close the channel. Idempotent."""
        if self._closed:
            return
        self.leases.close()
        self._closed = True
        with self._lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(address: str, *, transport: str = "auto", timeout: float = DEFAULT_TIMEOUT_S,
            verify: bool = True, lease_ttl_s: float = 0.0) -> Client:
    """Connect to a kvstore daemon.

    address: a Unix socket path, "unix:///path", or "host:port".
    transport: "shm" maps the daemon's host pool (same host only), "grpc" streams bytes with
        Put/Get, "auto" maps the pool when it can and falls back to streams otherwise.
    timeout: deadline in seconds of every RPC (a restarting daemon is waited for this long).
    verify: check each loaded block against the xxh3-64 checksum its read lease carries, and
        send checksums with every Commit.
    lease_ttl_s: lease lifetime to ask for (0: the daemon's default); leases in use are renewed.
    The connection is lazy: the first namespace() call talks to the daemon.
    """
    return Client(address, transport=transport, timeout=timeout, verify=verify,
                  lease_ttl_s=lease_ttl_s)


def spec_to_proto(spec: NamespaceSpec) -> pb.NamespaceSpec:
    lay = spec.layout
    return pb.NamespaceSpec(
        model=spec.model, revision=spec.revision,
        layout=pb.KVLayout(num_layers=lay.num_layers, num_kv_heads=lay.num_kv_heads,
                           head_dim=lay.head_dim, block_tokens=lay.block_tokens,
                           dtype=lay.dtype),
        shard_rank=spec.shard_rank, shard_size=spec.shard_size, hash_scheme=spec.hash_scheme,
        tenant_salt=spec.tenant_salt, codec=spec.codec, extra=dict(spec.extra))


class _Stale(Exception):
    """The pool mapping or a lease went stale mid-call: resync and try again."""


# ---------------------------------------------------------------------------- the namespace

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
        self._staging: np.ndarray | None = None
        self._register()

    def _register(self) -> None:
        resp = self.client.register(self.spec)
        if resp.block_bytes and resp.block_bytes != self.layout.block_bytes:
            raise InvalidArgument(f"the daemon sizes this namespace's blocks at "
                                  f"{resp.block_bytes} bytes, the layout at "
                                  f"{self.layout.block_bytes}: client and daemon disagree")
        self.ns_id = bytes(resp.namespace_id)

    def __repr__(self) -> str:
        return (f"Namespace(model={self.spec.model!r}, ns_id={self.ns_id.hex()}, "
                f"transport={self.client.transport})")

    # -- keys -------------------------------------------------------------------------------
    def keys(self, token_ids: Sequence[int] | np.ndarray, *, parent: bytes | None = None,
             block_extra_keys: Sequence[Sequence[ExtraKey]] | None = None) -> list[bytes]:
        """Reference keys (kvstore_client.hashing.block_keys) of every full block."""
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
        return self.store_keys(self.keys(token_ids), kv)

    def store_keys(self, keys: Sequence[bytes], kv: Any, *, parent: bytes | None = None) -> int:
        """store() with precomputed keys; kv[:, :, i*T:(i+1)*T] is block i's KV."""
        keys = list(keys)
        if not keys:
            return 0
        T = self.layout.block_tokens
        check_seq(kv, self.layout, len(keys) * T, "kv")
        src = raw_view(kv, self.layout, "kv")

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
        return self._retrying(lambda: self._store_once(keys, fill, parent,
                                                       parts if rows is not None else None))

    def store_blocks(self, keys: Sequence[bytes], fill: Fill, *,
                     parent: bytes | None = None) -> int:
        """Store blocks produced by `fill` for the keys not cached yet (for custom layouts)."""
        keys = list(keys)
        if not keys:
            return 0
        return self._retrying(lambda: self._store_once(keys, fill, parent))

    def _store_once(self, keys: list[bytes], fill: Fill, parent: bytes | None,
                    parts: Callable[[int], list[Any]] | None = None) -> int:
        have = self.lookup_keys(keys)
        if have >= len(keys):
            return 0
        first_parent = keys[have - 1] if have else (parent or b"")
        if self.client.pool is not None:
            return self._store_shm(keys, have, first_parent, fill)
        return self._store_grpc(keys, have, first_parent, fill, parts)

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

    def _store_shm(self, keys: list[bytes], start: int, parent: bytes, fill: Fill) -> int:
        client, bb = self.client, self.block_bytes
        stored = 0
        i = start
        while i < len(keys):
            n = min(len(keys) - i, self._reserve_batch())
            pool = self._current_pool()
            lease = client.call("Reserve", pb.ReserveRequest(
                namespace_id=self.ns_id, count=n, tier="host", ttl_s=client.lease_ttl_s)).lease
            lid = lease.lease_id
            client.leases.add(lid, lease.deadline)
            committed = False
            try:
                offsets = self._check_slots(lease.slots, pool)[:n]
                n = len(offsets)
                base = pool.slab.array
                sums: list[int] = []
                for c0, c1 in _chunks(n, bb):
                    fill(base, offsets[c0:c1], i + c0)
                    if client.verify:
                        sums += [xxhash.xxh3_64_intdigest(base[o:o + bb]) for o in offsets[c0:c1]]
                if not client.leases.remove(lid):
                    client.counters["leases_lost"] += 1
                    raise LeaseExpired(f"write lease {lid} expired during the copy")
                try:
                    r = client.call("Commit", pb.CommitRequest(
                        lease_id=lid, keys=keys[i:i + n], parent=parent, checksums=sums))
                except DataLoss as e:
                    # Our bytes did not arrive where the daemon looks: a replaced segment.
                    committed = True   # the daemon freed the lease already
                    raise _Stale(str(e)) from None
                committed = True
                stored += int(r.stored)
            finally:
                if not committed:
                    client.release(lid)
            parent = keys[i + n - 1]
            i += n
        return stored

    def _staging_buffer(self, nbytes: int) -> np.ndarray:
        if self._staging is None or self._staging.nbytes < nbytes:
            self._staging = aligned_buffer(nbytes)
        return self._staging

    def _store_grpc(self, keys: list[bytes], start: int, parent: bytes, fill: Fill,
                    parts: Callable[[int], list[Any]] | None = None) -> int:
        """Put streams; `parts(i)` (contiguous pieces of block i) skips the staging copy."""
        client, bb = self.client, self.block_bytes
        stride = (bb + PAGE - 1) // PAGE * PAGE
        per_rpc = max(1, _PUT_RPC_BYTES // stride)
        per_msg = max(1, _PUT_MESSAGE_BYTES // bb)
        stored = 0
        i = start
        while i < len(keys):
            n = min(len(keys) - i, per_rpc)
            base, offsets = None, []
            if parts is None:
                base = self._staging_buffer(n * stride)
                offsets = [j * stride for j in range(n)]
                fill(base, offsets, i)
            def msgs(i: int = i, n: int = n, parent: bytes = parent, base=base,
                     offsets: list[int] = offsets):
                # A generator: gRPC's sender thread encodes the next message while the
                # previous one is on the wire.
                for m0 in range(0, n, per_msg):
                    blocks = [(keys[i + j], parts(i + j) if parts is not None
                               else base[offsets[j]:offsets[j] + bb])
                              for j in range(m0, min(n, m0 + per_msg))]
                    yield encode_put(self.ns_id if m0 == 0 else b"",
                                     parent if m0 == 0 else b"", blocks)
            try:
                r = client._put(msgs(), timeout=client.timeout, wait_for_ready=True)
            except grpc.RpcError as e:
                raise _error(e, "Put", client.target) from None
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
        client, bb = self.client, self.block_bytes
        pool = self._current_pool()
        lease = client.call("Acquire", pb.AcquireRequest(
            namespace_id=self.ns_id, keys=keys, tier="host", ttl_s=client.lease_ttl_s)).lease
        lid = lease.lease_id
        if not lease.slots:
            if lid:
                client.release(lid)
            return 0
        client.leases.add(lid, lease.deadline)
        try:
            offsets = self._check_slots(lease.slots, pool)
            n = len(offsets)
            if list(lease.keys[:n]) != keys[:n]:
                raise DataLoss("the daemon's read lease names other keys than were asked for")
            sums = list(lease.checksums)
            base = pool.slab.array
            good = n
            for c0, c1 in _chunks(n, bb):
                drain(base, offsets[c0:c1], c0)
                if client.verify and len(sums) == n:
                    bad = next((j for j in range(c0, c1)
                                if xxhash.xxh3_64_intdigest(base[offsets[j]:offsets[j] + bb])
                                != sums[j]), None)
                    if bad is not None:
                        good = bad
                        break
            if not client.leases.ok(lid):
                client.counters["leases_lost"] += 1
                raise _Stale(f"read lease {lid} expired during the copy")
            if good < n:
                client.counters["checksum_failures"] += 1
                if not pool.current():
                    raise _Stale("host pool segment replaced during the copy")
                log.warning("kvstore: block %d of a load failed its checksum; serving the %d "
                            "blocks before it", good, good)
            return good
        finally:
            client.release(lid)

    def _load_grpc(self, keys: list[bytes], drain: Drain) -> int:
        client = self.client
        n = 0
        try:
            for raw in client._get(pb.GetRequest(namespace_id=self.ns_id, keys=keys),
                                   timeout=client.timeout, wait_for_ready=True):
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
            raise _error(e, "Get", client.target) from None
        return n

    # -- admin ------------------------------------------------------------------------------
    def delete(self, keys: Sequence[bytes] | None = None) -> int:
        """Delete `keys` (None: the whole namespace) from every tier; returns blocks deleted."""
        req = pb.DeleteRequest(namespace_id=self.ns_id, keys=list(keys or ()), all=keys is None)
        return int(self.client.call("Delete", req).deleted)


def _chunks(n: int, block_bytes: int) -> Iterator[tuple[int, int]]:
    per = max(1, _CHUNK_BYTES // max(1, block_bytes))
    for c0 in range(0, n, per):
        yield c0, min(n, c0 + per)
