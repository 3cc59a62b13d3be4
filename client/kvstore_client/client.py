"""The SDK's connection to a daemon: channel, deadlines, the mapped host pool, leases, restarts.

Restarts: a daemon restart gives a new `daemon_id` and a fresh pool segment. The client notices
(the channel dropped, the pool segment changed under the same name, the namespace or a lease is
unknown, or a checksum fails) and re-registers its namespaces and re-maps the pool before
retrying the call once, so callers see at most a slower call.

Every RPC carries a deadline and waits for the channel to become ready within it, so a daemon
that is restarting is waited for, and one that is gone fails within `timeout` seconds; until a
daemon has answered once, a wrong address fails at once instead (`first_call.py`). What a
namespace does with the connection (hashing, lookup, store, load) is in `namespace.py`
(and `writes.py`, `reads.py`); the mapping of the host pool is `host_pool.py`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import grpc

from . import first_call
from ._proto import kvstore_pb2 as pb
from ._proto import kvstore_pb2_grpc as pbg
from .blockcopy import default_threads
from .common.address import grpc_target
from .common.errors import (
    DeadlineExceeded,
    InvalidArgument,
    KVStoreError,
    LeaseExpired,
    NotFound,
    Unauthenticated,
    Unavailable,
    from_rpc_error,
)
from .common.handoff import Session, handshake, handshake_path
from .common.hashing import DEFAULT_KEY_BYTES, ExtraKey
from .common.lane_wire import METHOD_ID, lane_path
from .common.layout import KVLayout, NamespaceSpec
from .common.limits import MAX_CARRIED_RELEASES
from .host_pool import MappedPool, fd_ino
from .lane import LaneClient, NotSent, available
from .leases import LeaseKeeper
from .namespace import Namespace
from .wire import spec_to_proto

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 << 20
DEFAULT_TIMEOUT_S = 10.0
# Calls whose answer depends on the releases a client has queued (leases.py): sent after them;
# those that also count or free reserved slots give the spare write leases back first.
_AFTER_RELEASES = {"Delete": False, "Flush": False, "Evict": True, "Stats": True}
# Releases sent together off a call's path (the lease thread's, close()) share one deadline of
# at most this long: the daemon ends a lease not released by then at its own deadline.
RELEASE_S = 2.0
# Leases one Release call gives back: the daemon's cap, the same as release_leases'.
MAX_RELEASES = MAX_CARRIED_RELEASES
# A Flush's default deadline: demoting a whole host tier writes all of it to SSD, which a
# client's per-call timeout (seconds) is not sized for. A timeout passed to flush() wins.
FLUSH_TIMEOUT_S = 60.0
DEFAULT_ADDRESS = "data/kvstore.sock"   # `kvstore serve`'s default socket, relative to its cwd

TRANSPORTS = ("auto", "shm", "grpc")


class Client:
    """A connection to one daemon. Thread-safe; use as a context manager or call `close()`."""

    def __init__(self, address: str, *, transport: str = "auto",
                 timeout: float = DEFAULT_TIMEOUT_S, verify: bool = True,
                 lease_ttl_s: float = 0.0, copy_threads: int = 0, token: str | None = None,
                 tls_ca_file: str | None = None, tls_cert_file: str | None = None,
                 tls_key_file: str | None = None, tls_server_name: str | None = None,
                 lane: bool = True) -> None:
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
        if isinstance(copy_threads, bool) or not isinstance(copy_threads, int) \
                or copy_threads < 0:
            raise InvalidArgument(f"copy_threads must be a non-negative integer (0: every core "
                                  f"this process may use), got {copy_threads!r}")
        self.copy_threads = copy_threads or default_threads()
        # LookupReserve / LookupAcquire until a daemon answers UNIMPLEMENTED (an older one).
        self.fused_rpcs = True
        # Many leases in one Release until a daemon answers one without results (an older
        # one: _release_many).
        self.batch_release = True
        self.put_pieces = False         # set from RegisterNamespace's protocol (_adopt)
        self.put_tokens = False
        self._lock = threading.RLock()
        self._closed = False
        self._reached = False           # a daemon answered once (see call())
        options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            # A restarted daemon should be found again in well under a second.
            ("grpc.initial_reconnect_backoff_ms", 50),
            ("grpc.min_reconnect_backoff_ms", 50),
            ("grpc.max_reconnect_backoff_ms", 500),
            ("grpc.enable_retries", 0),
        ]
        if tls_ca_file or tls_cert_file:
            if tls_server_name:
                options.append(("grpc.ssl_target_name_override", tls_server_name))
            self._channel = grpc.secure_channel(self.target, tls_credentials(
                tls_ca_file, tls_cert_file, tls_key_file), options=options)
        else:
            self._channel = grpc.insecure_channel(self.target, options=options)
        # Credentials (docs/security.md): a bearer token, or on the Unix socket of a daemon
        # with tenants a session from the uid handshake (made on first use).
        self._token = token or ""
        self.metadata: tuple[tuple[str, str], ...] | None = (
            (("authorization", f"Bearer {token}"),) if token else None)
        self._auth_path = (handshake_path(self.target[len("unix:"):])
                           if self.target.startswith("unix:") else None)
        self._session: Session | None = None
        self._session_checked = False
        # The fast lane (lane.py), opened at the first RegisterNamespace answer when the
        # daemon has one; lane=False keeps every call on gRPC.
        self._lane_path = (lane_path(self.target[len("unix:"):])
                           if lane and transport != "grpc" and self.target.startswith("unix:")
                           else None)
        self._lane: LaneClient | None = None
        self._stub = pbg.KVStoreStub(self._channel)
        self._put = self._channel.stream_unary(
            "/kvstore.v1.KVStore/Put", request_serializer=lambda b: b,
            response_deserializer=pb.PutResponse.FromString)
        self._get = self._channel.unary_stream(
            "/kvstore.v1.KVStore/Get", request_serializer=pb.GetRequest.SerializeToString,
            response_deserializer=lambda b: b)
        self.daemon_id = ""
        self._pool: MappedPool | None = None
        self.gpu_pools: list[dict] = []
        self._shm_error: str | None = None
        self._namespaces: weakref.WeakSet[Namespace] = weakref.WeakSet()
        self.leases = LeaseKeeper(self._renew, self._release_quiet, self._release_many)
        # corrupt_blocks: checksum failures of the daemon's own copy (the mapping was checked
        # to be the live pool), the only ones that justify dropping a block for everyone.
        self.counters: dict[str, int] = {"resyncs": 0, "checksum_failures": 0,
                                         "leases_lost": 0, "corrupt_blocks": 0}

    # -- plumbing -------------------------------------------------------------------------
    def call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        """One unary RPC with a deadline, statuses turned into errors.* exceptions.

        Until a daemon has answered once, a missing socket or a refused connection fails at
        once ("no kvstore daemon at ..."): that is a wrong address, not a restart. Afterwards
        calls wait up to their deadline for the channel, so a restarting daemon is waited for.

        One deadline for the whole call, set here: a lane hello that timed out (a stopped
        daemon still accepts connections) leaves gRPC only what it did not use, so a call
        never takes its deadline twice.
        """
        if self._closed:
            raise KVStoreError("client is closed")
        timeout = timeout or self.timeout
        t_end = time.monotonic() + timeout
        if method in _AFTER_RELEASES:
            # Out of this call's deadline: the releases are part of what it waits for.
            self.leases.flush(spares=_AFTER_RELEASES[method], deadline=t_end)
        first = not self._reached
        if first:
            first_call.check_address(self.target)
        if not self._session_checked:
            self.ensure_session()
        lane = self._lane
        why = ""
        if lane is not None and method in METHOD_ID:
            try:
                body = lane.call(method, request.SerializeToString(),
                                 _left(method, timeout, t_end))
                return _RESPONSE[method].FromString(body)
            except NotSent as e:
                why = f" ({e})"             # not sent: over gRPC below
        try:
            left = _left(method, timeout, t_end, why)
            resp = first_call.invoke(self._invoke, self.target, self.address, method,
                                     request, left, t_end) if first else \
                self._invoke(method, request, left, True)
        except grpc.RpcError as e:
            if first and e.code() == grpc.StatusCode.UNAVAILABLE:
                raise first_call.unavailable(self.address, e) from None
            err = from_rpc_error(e, method, self.target)
            if not (isinstance(err, Unauthenticated) and self._session is not None):
                raise err from None
            # A session ends with the daemon run that issued it: one fresh handshake, one retry.
            self.ensure_session(refresh=True)
            try:
                resp = self._invoke(method, request, _left(method, timeout, t_end), wait=True)
            except grpc.RpcError as e2:
                raise from_rpc_error(e2, method, self.target) from None
        self._reached = True
        return resp

    def call_future(self, method: str, request: Any, timeout: float | None = None) -> Any:
        """Start a unary RPC whose round trip overlaps the caller's work; `future.result()`
        raises grpc.RpcError (the caller decides what a failure means for it). Only after a
        daemon has answered once: a first call needs `call()`'s address checks."""
        if self._closed:
            raise KVStoreError("client is closed")
        return getattr(self._stub, method).future(
            request, timeout=timeout or self.timeout, wait_for_ready=True,
            metadata=self.metadata)

    def _invoke(self, method: str, request: Any, timeout: float | None, wait: bool) -> Any:
        return getattr(self._stub, method)(request, timeout=timeout or self.timeout,
                                           wait_for_ready=wait, metadata=self.metadata)

    def ensure_session(self, refresh: bool = False) -> None:
        """Handshake with the daemon's Unix socket when it has one (a daemon with tenants):
        a session token unless a token was given, and the tenant's own pool fd, if any."""
        with self._lock:
            if self._session_checked and not refresh:
                return
            old, pool = self._session, self._pool
            self._session_checked = True
            if self._auth_path is None or not os.path.exists(self._auth_path):
                self._session = None
                if pool is not None and pool.fd_backed:
                    pool.follow(None)
                return
            self._session = handshake(self._auth_path, self._token, self.timeout)
            if pool is not None and pool.fd_backed:
                # A new run's session says nothing else about the mapped memfd: without this,
                # loads would go on reading the dead run's pool (retried only on a NotFound).
                pool.follow(self._session)
            if old is not None:
                old.close_fds()
                # Their fds are closed: the next RegisterNamespace names the new ones.
                self.gpu_pools = [p for p in self.gpu_pools if "fd" not in p]
            if not self._token:
                self.metadata = (("authorization", f"Bearer {self._session.token}"),)
                if self._lane is not None:      # its hello carries the session too
                    self._lane.renew(self._session.token)

    def pool_moved(self, pool: MappedPool) -> bool:
        """After a checksum failure: whether the daemon now hands out another pool than the
        memfd `pool` maps. One handshake, because a token client keeps its session across a
        restart and only the socket file's identity (common/handoff.py, socket_id) says so,
        which a filesystem with coarse timestamps could blur: the memfd tells a dead run's
        mapping from a corrupt block for sure. False for named segments (`current()` checks
        those)."""
        if not pool.fd_backed or pool.replaced:
            return pool.replaced
        if self._auth_path is None:
            return False
        try:
            probe = handshake(self._auth_path, self._token, self.timeout)
        except KVStoreError:
            return False                # no answer: nothing says the mapping is stale
        try:
            same = probe.pool_fd is not None and fd_ino(probe.pool_fd) == pool.ino
        finally:
            probe.close_fds()
        if not same:
            pool.replaced = True
        return not same

    def session_current(self) -> bool:
        """False when the daemon restarted since the handshake (its fds are of a dead run)."""
        s, path = self._session, self._auth_path
        return s is None or path is None or s.current(path)

    @property
    def tenant(self) -> str | None:
        """The tenant the daemon's handshake named (None: no handshake on this connection)."""
        return self._session.tenant if self._session is not None else None

    def _renew(self, lease_id: str) -> float:
        return self.call("RenewLease", pb.RenewLeaseRequest(lease_id=lease_id,
                                                            ttl_s=self.lease_ttl_s)).deadline

    def _release_deadline(self) -> float:
        return time.monotonic() + min(RELEASE_S, self.timeout)

    def _release_quiet(self, lease_id: str, deadline: float | None = None) -> None:
        self._release_many([lease_id], deadline)

    def _release_many(self, lease_ids: list[str], deadline: float | None = None) -> None:
        """Release leases within one deadline (monotonic; None: RELEASE_S from now), in one
        Release call per MAX_RELEASES of them; those it leaves unsent end at their own
        deadlines.

        Why one call and one deadline: the leases a client gives back together (a batch of
        finished loads, the pins it held at close, those pending before a Stats) cost one
        round trip, not one each, and against a daemon that stopped answering N releases do
        not take N times the caller's timeout. A daemon that predates `lease_ids` ends only
        the first lease of a call and answers with no results: the rest then go one call
        each, and so do later releases until a resync (the daemon may have been upgraded)."""
        if self._closed:
            return  # close() released every lease the keeper held
        if deadline is None:
            deadline = self._release_deadline()
        ids = list(dict.fromkeys(lease_ids))
        i = 0
        while i < len(ids):
            left = deadline - time.monotonic()
            if left <= 0:
                log.debug("kvstore: %d releases left to their lease deadlines (no time left)",
                          len(ids) - i)
                return
            batch = ids[i:i + MAX_RELEASES] if self.batch_release else ids[i:i + 1]
            try:
                r = self.call("Release", pb.ReleaseRequest(lease_id=batch[0],
                                                           lease_ids=batch[1:]), timeout=left)
            except (NotFound, LeaseExpired):
                # The first lease was gone already. A daemon that reads lease_ids answers a
                # batch with results, never this: an older one, which ended nothing else.
                i += 1
                if len(batch) > 1:
                    self.batch_release = False
                continue
            except Unavailable:
                i += len(batch)     # the daemon restarted or is gone: so are these leases
                continue
            except InvalidArgument as e:
                if len(batch) == 1:
                    log.debug("kvstore: release of %s refused: %s", batch[0], e)
                    i += 1
                else:           # a daemon whose cap is lower than ours: one call each
                    self.batch_release = False
                continue
            except KVStoreError as e:
                # Timed out, or refused: the leases end at their deadlines anyway, and the
                # caller's own error (if any) matters; the next ones may still go.
                log.debug("kvstore: release of %d leases failed: %s", len(batch), e)
                i += len(batch)
                continue
            if len(batch) > 1 and len(r.results) != len(batch):
                self.batch_release = False      # an older daemon: it ended batch[0] only
                i += 1
                continue
            for lease_id, res in zip(batch, r.results, strict=False):
                if res.code != "OK":
                    log.debug("kvstore: release of %s: %s %s", lease_id, res.code, res.message)
            i += len(batch)

    def release(self, lease_id: str) -> None:
        """Release a lease (best effort: a lease the daemon no longer knows is already free)."""
        self.leases.remove(lease_id)
        self._release_quiet(lease_id)

    def call_carrying(self, method: str, request: Any, timeout: float | None = None) -> Any:
        """`call` with the releases of finished leases added to the request (its
        release_leases field), so they need no round trip of their own (leases.py)."""
        ids = self.leases.take_pending()
        if not ids:
            return self.call(method, request, timeout)
        request.release_leases.extend(ids)
        try:
            return self.call(method, request, timeout)
        except BaseException:
            self.leases.requeue(ids)
            raise

    def release_later(self, lease_id: str) -> bool:
        """Release from the lease thread, off the caller's path; True if the lease stayed valid
        while it was held (kvstore_client/leases.py)."""
        return self.leases.release_later(lease_id)

    @property
    def pool(self) -> MappedPool | None:
        return self._pool

    @property
    def transport(self) -> str:
        """"shm" once the pool is mapped, else "grpc"."""
        return "shm" if self._pool is not None else "grpc"

    def _adopt(self, resp: pb.RegisterNamespaceResponse) -> None:
        """Take the daemon identity and pool from a RegisterNamespace answer (caller locks)."""
        changed = resp.daemon_id != self.daemon_id
        self.daemon_id = resp.daemon_id
        self.leases.carry = resp.protocol >= 2     # Acquire and Commit carry releases
        self.put_pieces = resp.protocol >= 3       # a Put block may span messages
        self.put_tokens = resp.protocol >= 4       # Put may carry token ids
        if self._lane_path is not None and (changed or self._lane is None):
            if self._lane is not None:
                self._lane.close()
            self._lane = None
            if available(self._lane_path):
                token = self._token or (self._session.token if self._session else "")
                self._lane = LaneClient(self._lane_path, token, self.timeout)
        # Device pools, as `kvstore_client.gpu.open_pool` takes them (kvstore_client/device_kv.py)
        # A tenant's own CPU-device slabs come as fds from the handshake, not by name.
        fds = self._session.gpu_fds if self._session is not None else {}
        self.gpu_pools = [{"kind": g.kind or "cuda_ipc", "device": int(g.device),
                           "handle": bytes(g.ipc_handle), "size": int(g.size),
                           "pid": int(g.owner_pid), "name": g.name,
                           **({"fd": fds[g.device][0]} if g.device in fds else {})}
                          for g in resp.gpu_pools]
        if self.transport_option == "grpc":
            return
        hp = resp.host_pool
        pool = self._pool
        if pool is not None and not changed and pool.name == hp.name and pool.current():
            return
        fd = None
        if hp.kind == "memfd":
            # This tenant's own pool: the fd from the handshake (a fresh one after a restart,
            # or when the mapped pool was found replaced and its session's fd is consumed).
            if pool is not None and (changed or self._session is None
                                     or self._session.pool_fd is None):
                self.ensure_session(refresh=True)
            session = self._session
            fd = session.pool_fd if session is not None else None
            if session is not None:
                session.pool_fd = None          # consumed by the mapping
        if pool is not None:
            self._pool = None
            pool.close()
        if self.transport_option == "auto" and not self._local:
            self._shm_error = "the daemon is on another host"
            return
        try:
            if hp.kind == "memfd" and fd is not None and hp.size:
                self._pool = MappedPool("", int(hp.size), fd=fd, session=session,
                                   auth_path=self._auth_path)
            elif hp.kind != "shm" or not hp.name or not hp.size:
                raise NotFound(f"the daemon offers no shared-memory host pool ({hp.kind!r})")
            else:
                self._pool = MappedPool(hp.name, int(hp.size))
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
            self.fused_rpcs = True      # the daemon may have been upgraded
            self.batch_release = True
            if self._session is not None:
                self.ensure_session(refresh=True)
            for ns in list(self._namespaces):
                ns._register()

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

    def stats(self, *, namespaces: bool = False) -> dict[str, Any]:
        """The daemon's Stats as plain data: {"tiers": {name: {...}}, "counters": ..., ...}.

        namespaces: also list each namespace (a tenant's own only) under "namespace_list":
        model, revision, codec, shard, tenant, blocks in all and per tier, leases held, and
        seconds since a call last named it (-1: none since the daemon started); most blocks
        first, at most 4096."""
        r = self.call("Stats", pb.StatsRequest(list_namespaces=namespaces))
        tiers = {t.name: {"capacity_bytes": t.capacity_bytes, "used_bytes": t.used_bytes,
                          "blocks": t.blocks, "hits": t.hits, "misses": t.misses,
                          "evictions": t.evictions} for t in r.tiers}
        out = {"tiers": tiers, "counters": dict(r.counters), "namespaces": r.namespaces,
               "active_leases": r.active_leases, "daemon_id": r.daemon_id}
        if namespaces:
            out["namespace_list"] = [
                {f.name: (bytes(v) if f.name == "namespace_id" else v)
                 for f, v in ((f, getattr(n, f.name)) for f in n.DESCRIPTOR.fields)}
                for n in r.namespace_list]
        return out

    def evict(self, tier: str, nbytes: int = 0, *, timeout: float | None = None
              ) -> tuple[int, int]:
        """Ask the daemon to evict from `tier` (0 bytes: everything evictable). `timeout`:
        seconds for the whole call (None: the client's), the releases it sends first included."""
        r = self.call("Evict", pb.EvictRequest(tier=tier, bytes=nbytes),
                      timeout=_check_timeout(timeout))
        return int(r.freed_bytes), int(r.blocks)

    def flush(self, *, timeout: float | None = None) -> int:
        """Demote every host block to SSD; returns how many were written. Past the daemon's
        limits.request_deadline_s it raises DeadlineExceeded, saying how many it wrote (call
        again for the rest); a second Flush of the same tenant at once is ResourceExhausted.

        `timeout`: seconds for the whole call. None: the client's timeout, but at least
        FLUSH_TIMEOUT_S (60 s), because writing a whole host tier to SSD outlasts a per-call
        timeout sized for stores and loads; one passed here is kept as given."""
        t = _check_timeout(timeout) or max(self.timeout, FLUSH_TIMEOUT_S)
        return int(self.call("Flush", pb.FlushRequest(), timeout=t).demoted)

    def close(self) -> None:
        """Release every lease still held, unmap the pool, close the channel. Idempotent.
        The releases share one deadline (at most 2 s, or `timeout` if shorter), however many
        leases are held: the daemon ends any left at their own deadlines."""
        if self._closed:
            return
        self.leases.close(self._release_deadline())
        self._closed = True
        with self._lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None
            if self._session is not None:
                self._session.close_fds()
            if self._lane is not None:
                self._lane.close()
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# The response message of each call the lane carries.
_RESPONSE = {m: getattr(pb, f"{m}Response") for m in METHOD_ID}


def _check_timeout(timeout: float | None) -> float | None:
    """A caller's per-call timeout: None, or positive seconds (0 would mean the default to
    `call`, and a negative one fail at once: both are mistakes worth saying so)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InvalidArgument(f"timeout must be positive seconds, got {timeout!r}")
    return float(timeout)


def _left(method: str, timeout: float, t_end: float, why: str = "") -> float:
    """Seconds left of a call's deadline; DeadlineExceeded at once when none are (a next
    step given a fresh or a zero timeout would wait a whole default one)."""
    left = t_end - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded(f"{method}: did not finish within its deadline ({timeout:.3g} s)"
                               f"{why}")
    return left


def tls_credentials(ca_file: str | None, cert_file: str | None, key_file: str | None
                    ) -> grpc.ChannelCredentials:
    """grpcio channel credentials: the CA to trust, and for mTLS this client's cert and key."""
    def read(path: str | None, what: str) -> bytes | None:
        if not path:
            return None
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise InvalidArgument(f"cannot read the TLS {what} {path}: {e.strerror}") from None
    if bool(cert_file) != bool(key_file):
        raise InvalidArgument("tls_cert_file and tls_key_file go together (mTLS)")
    return grpc.ssl_channel_credentials(read(ca_file, "CA file"), read(key_file, "key file"),
                                        read(cert_file, "certificate file"))


def connect(address: str | None = None, *, transport: str = "auto",
            timeout: float = DEFAULT_TIMEOUT_S, verify: bool = True,
            lease_ttl_s: float = 0.0, copy_threads: int = 0, token: str | None = None,
            tls_ca_file: str | None = None, tls_cert_file: str | None = None,
            tls_key_file: str | None = None, tls_server_name: str | None = None,
            lane: bool = True) -> Client:
    """Connect to a kvstore daemon.

    address: a Unix socket path, "unix:///path", or "host:port"; None: $KVSTORE_ADDRESS,
        else "data/kvstore.sock" (where `kvstore serve` started in this folder listens).
    transport: "shm" maps the daemon's host pool (same host only), "grpc" streams bytes with
        Put/Get, "auto" maps the pool when it can and falls back to streams otherwise.
    timeout: deadline in seconds of every RPC (a restarting daemon is waited for this long).
    verify: check each loaded block against the xxh3-64 checksum its read lease carries, and
        send checksums with every Commit.
    lease_ttl_s: lease lifetime to ask for (0: the daemon's default); leases in use are renewed.
    copy_threads: threads that copy blocks between your tensors and the pool (0: every core this
        process may run on, at most 16; the copies release the GIL).
    token: bearer token of a tenant (daemons with tenants, docs/security.md). On the Unix socket
        the SDK can instead prove the process's uid, when a tenant lists it.
    tls_ca_file / tls_cert_file / tls_key_file: TLS over TCP (the CA that signed the daemon's
        certificate), and mTLS (this client's certificate and key); tls_server_name overrides
        the name checked in the daemon's certificate.
    lane: on a Unix socket, send the hot unary calls of stores and loads over the daemon's
        fast lane (`<socket>.lane`, a tenth of gRPC's per-call cost) when it has one.
    The connection is lazy: the first namespace() call talks to the daemon.
    """
    if address is None:
        address = os.environ.get("KVSTORE_ADDRESS") or DEFAULT_ADDRESS
    return Client(address, transport=transport, timeout=timeout, verify=verify,
                  lease_ttl_s=lease_ttl_s, copy_threads=copy_threads, token=token,
                  tls_ca_file=tls_ca_file, tls_cert_file=tls_cert_file,
                  tls_key_file=tls_key_file, tls_server_name=tls_server_name, lane=lane)


