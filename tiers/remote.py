"""Remote tier: framed blocks in Redis / Valkey, standalone or Redis Cluster, shared by many nodes.

Why it looks the way it does:

* **One batch per node.** Keys are routed to their node (cluster: by hash slot, from redis-py's
  slot table) and each node gets one pipeline, all nodes in parallel on a small thread pool. A
  64-block lookup costs one round trip per node, never one per block. Keys carry no hash tag, so
  a namespace spreads over every slot and node.
* **A hard deadline.** The caller waits at most `deadline` for the node batches; a batch that is
  late (hung server, lost network) is a miss and counted, and its node goes into a back-off
  "down" state: calls skip it for a short, growing interval, then one background PING probes
  it. A dead Redis therefore costs a dict lookup per call, never a timeout per call, and the
  tier reconnects by itself. Nothing here raises into the caller unless asked (`raise_errors`).
  A misconfigured client (wrong password, TLS certificates) is such a down node too, and
  `stats["last_error"]` says which of those it is: redis-py's own messages often do not.
* **Verified values.** Values are `tiers.frame` frames (header + xxh3 checksum, the same bytes the
  SSD tier stores); a value that fails its check is a counted `corrupt` miss, never returned.
* **Capacity belongs to Redis.** Redis' maxmemory policy may drop any key at any time (see
  docs/remote.md); a vanished key is an ordinary miss. The tier counts the bytes it wrote so the
  store can stop demoting past `capacity`.

This module imports redis-py lazily-free (it is a hard dependency) but never imports `kvstore`:
the config is duck-typed (any object with RemoteConfig's attribute names).
"""

from __future__ import annotations

import collections
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

import redis
from kvstore_client.common.errors import DataLoss, InvalidArgument, Unavailable
from redis.backoff import NoBackoff
from redis.connection import parse_url
from redis.crc import key_slot
from redis.exceptions import AskError, AuthenticationError, ClusterDownError, TryAgainError
from redis.retry import Retry

try:  # framing is owned by tiers/frame.py; verification switches on once it exists
    from tiers.frame import unframe as _unframe
except ImportError:  # pragma: no cover - only while frame.py is being written
    _unframe = None

NS_ID_BYTES = 16
LATENCY_SAMPLES = 2048          # recent samples kept per operation, for histograms/percentiles
ERROR_CHARS = 300               # last_error strings are cut to this length
OPS = ("exists", "get", "put", "delete")
# How long after the deadline a node's sockets time out (see _connection_kwargs).
SOCKET_GRACE_S = 1.0


def make_key(prefix: bytes, gkey: bytes) -> bytes:
    """`{prefix}{ns_id.hex()}:{block_key.hex()}`: readable in redis-cli, no hash tag (spreads)."""
    return b"%s%s:%s" % (prefix, gkey[:NS_ID_BYTES].hex().encode(),
                         gkey[NS_ID_BYTES:].hex().encode())


@dataclass
class _NodeState:
    """Health of one Redis node as this process sees it (the back-off "down" state)."""

    name: str
    up: bool = True
    down_until: float = 0.0       # monotonic; calls skip the node until then
    backoff_s: float = 0.0
    probing: bool = False
    failures: int = 0
    last_error: str = ""


@dataclass
class _OpStats:
    count: int = 0
    sum_s: float = 0.0
    max_s: float = 0.0
    samples: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=LATENCY_SAMPLES))

    def add(self, seconds: float) -> None:
        self.count += 1
        self.sum_s += seconds
        self.max_s = max(self.max_s, seconds)
        self.samples.append(seconds)


class _Batch:
    """The keys of one call that go to one node, with their positions in the caller's list."""

    __slots__ = ("node", "client", "idx", "keys")

    def __init__(self, node: str, client: redis.Redis) -> None:
        self.node = node
        self.client = client
        self.idx: list[int] = []
        self.keys: list[bytes] = []


def _pipeline_delete(b: _Batch) -> list:
    """DEL each key in one pipeline (no multi-key DEL: keys of a node span several slots)."""
    p = b.client.pipeline(transaction=False)
    for k in b.keys:
        p.delete(k)
    return p.execute(raise_on_error=False)


def _cfg(cfg: Any, name: str, default: Any) -> Any:
    value = getattr(cfg, name, default)
    return default if value is None else value


def _chain(err: BaseException) -> list[BaseException]:
    """`err` and the exceptions it was raised from (redis-py wraps ssl/socket errors)."""
    out: list[BaseException] = []
    e: BaseException | None = err
    while e is not None and len(out) < 8:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def describe_error(err: BaseException | str, *, tls: bool = False,
                   client_cert: bool = False) -> str:
    """A last-error string that names the cause an operator can act on.

    redis-py's own messages hide it in two common cases: a wrong or missing password reads
    "invalid username-password pair" or "HELLO must be called ...", and a server that requires a
    client certificate just closes the TLS connection ("EOF occurred in violation of protocol").
    An untrusted server certificate already says "certificate verify failed"; it gets a prefix.
    """
    if isinstance(err, str):
        return err[:ERROR_CHARS]
    text = f"{type(err).__name__}: {err}"
    chain = _chain(err)
    if any(isinstance(e, AuthenticationError) for e in chain):
        text = f"authentication failed (check remote.username/password): {text}"
    elif any(isinstance(e, ssl.SSLCertVerificationError) for e in chain):
        text = f"TLS: server certificate not trusted (check remote.tls_ca_file): {text}"
    elif tls and any(isinstance(e, ssl.SSLEOFError) or "alert certificate" in str(e)
                     for e in chain):
        why = ("the server may have rejected the client certificate" if client_cert else
               "the server may require a client certificate (remote.tls_cert_file/key_file)")
        text = f"TLS: connection closed by the server during setup; {why}: {text}"
    elif any(isinstance(e, ssl.SSLError) for e in chain):
        text = f"TLS: {text}"
    return text[:ERROR_CHARS]


def _url_kwargs(url: str) -> dict[str, Any]:
    """`redis.Redis` options for a redis://, rediss:// or unix:// URL.

    `parse_url` returns ConnectionPool options (`connection_class`, `path`), which
    `redis.Redis(**kw)` rejects with a TypeError; the client takes `ssl=True` and
    `unix_socket_path=` instead.
    """
    kw = dict(parse_url(url))
    cls = kw.pop("connection_class", None)
    if cls is redis.SSLConnection:
        kw["ssl"] = True
    elif cls is redis.UnixDomainSocketConnection:
        kw["unix_socket_path"] = kw.pop("path")
    return kw


class RemoteTier:
    """Keyed tier over Redis/Valkey; see the module docstring for the rules it keeps."""

    name = "remote"

    def __init__(self, cfg: Any, *, verify: bool | None = None, raise_errors: bool = False,
                 on_latency: Callable[[str, float], None] | None = None) -> None:
        """`cfg`: RemoteConfig-like (urls, cluster, username, password, tls, tls_ca_file,
        tls_cert_file, tls_key_file, key_prefix, deadline_ms, capacity; optional: ttl_s,
        backoff_min_ms, backoff_max_ms, bulk_ms_per_mib, socket_read_size, max_workers).

        verify: check frames on read (default: whenever tiers.frame exists).
        raise_errors: raise Unavailable instead of returning misses (for tools and tests).
        on_latency: called with (op, seconds) after each call, e.g. a Prometheus histogram.
        """
        urls = list(_cfg(cfg, "urls", []))
        if not urls:
            raise InvalidArgument("remote.urls must list at least one redis:// or rediss:// URL")
        self.cluster = bool(_cfg(cfg, "cluster", False))
        if len(urls) > 1 and not self.cluster:
            raise InvalidArgument("remote.urls lists several servers but remote.cluster is off; "
                                  "set cluster = true (the URLs are then seed nodes) or list one")
        prefix = str(_cfg(cfg, "key_prefix", "kvs:"))
        if self.cluster and ("{" in prefix or "}" in prefix):
            raise InvalidArgument(f"remote.key_prefix {prefix!r} contains a brace: in a cluster "
                                  "that is a hash tag and would put every block on one node")
        self.prefix = prefix.encode()
        self.deadline_s = float(_cfg(cfg, "deadline_ms", 200)) / 1000.0
        if self.deadline_s <= 0:
            raise InvalidArgument("remote.deadline_ms must be positive")
        # Bulk calls (get/put of whole blocks) get the lookup deadline plus a per-MiB allowance,
        # so a 64 x 2 MiB load is not declared dead by a deadline meant for a key lookup.
        self.bulk_s_per_mib = float(_cfg(cfg, "bulk_ms_per_mib", 5.0)) / 1000.0
        self.capacity = int(_cfg(cfg, "capacity", 0))
        self.ttl_s = int(_cfg(cfg, "ttl_s", 0))
        self.backoff_min_s = float(_cfg(cfg, "backoff_min_ms", 50)) / 1000.0
        self.backoff_max_s = float(_cfg(cfg, "backoff_max_ms", 2000)) / 1000.0
        self.raise_errors = raise_errors
        self.on_latency = on_latency
        if verify is None:
            verify = _unframe is not None
        if verify and _unframe is None:
            raise InvalidArgument("verify=True needs tiers.frame, which is not installed")
        self.verify = verify

        tls = bool(_cfg(cfg, "tls", False)) or any(u.startswith("rediss://") for u in urls)
        self._conn_kwargs = self._connection_kwargs(cfg, tls)
        self._tls, self._client_cert = tls, "ssl_certfile" in self._conn_kwargs
        self._last_error = ""
        self._next_refresh = 0.0             # monotonic; slot-table refreshes are rate-limited
        self._urls = urls
        self._lock = threading.Lock()
        self._stat_lock = threading.Lock()
        self._nodes: dict[str, _NodeState] = {}
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=int(_cfg(cfg, "max_workers", 8)),
                                        thread_name_prefix="kvs-remote")
        self._counters: dict[str, int] = dict.fromkeys(
            ("calls", "round_trips", "hits", "misses", "lookup_hits", "lookup_misses",
             "bytes_read", "bytes_written", "bytes_deleted", "bytes_vanished", "keys_written",
             "keys_deleted", "errors", "timeouts", "corrupt", "skipped_down", "moved",
             "probes", "reconnects"), 0)
        self._lat: dict[str, _OpStats] = {op: _OpStats() for op in OPS}

        self._standalone: redis.Redis | None = None
        self._rc: Any = None                 # redis.cluster.RedisCluster once discovered
        self._topology = _NodeState("topology", up=False)
        if self.cluster:
            self._discover_async()           # never blocks the constructor on a dead cluster
        else:
            kw = _url_kwargs(urls[0])
            kw.update(self._conn_kwargs)
            kw["retry"] = Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
            self._standalone = redis.Redis(**kw)
            self._nodes["standalone"] = _NodeState("standalone")

    # ----------------------------------------------------------------------------- config

    @staticmethod
    def _connection_kwargs(cfg: Any, tls: bool) -> dict[str, Any]:
        """Options passed through to redis-py for every node connection.

        `tls`: `tls = true` or a rediss:// URL; either way the CA and client certificate apply
        (a rediss:// URL alone must not silently drop them and fail verification).
        """
        deadline = float(_cfg(cfg, "deadline_ms", 200)) / 1000.0
        kw: dict[str, Any] = {
            # The caller stops waiting at the deadline (and counts a timeout); the sockets give
            # up SOCKET_GRACE_S later, only to free a worker thread stuck on a server that
            # never answers. A socket timeout equal to the deadline would race the caller's
            # wait and, on a busy machine, end some batches first as plain errors.
            "socket_timeout": deadline + SOCKET_GRACE_S,
            "socket_connect_timeout": deadline + SOCKET_GRACE_S,
            "socket_keepalive": True,
            # Large replies: read big chunks (fewer hiredis feeds; see docs/remote.md figures).
            "socket_read_size": int(_cfg(cfg, "socket_read_size", 1 << 20)),
            "health_check_interval": int(_cfg(cfg, "health_check_interval_s", 30)),
        }
        if _cfg(cfg, "username", ""):
            kw["username"] = cfg.username
        if _cfg(cfg, "password", ""):
            kw["password"] = cfg.password
        if tls:
            kw["ssl"] = True
            if _cfg(cfg, "tls_ca_file", ""):
                kw["ssl_ca_certs"] = cfg.tls_ca_file
            if _cfg(cfg, "tls_cert_file", ""):
                kw["ssl_certfile"] = cfg.tls_cert_file
            if _cfg(cfg, "tls_key_file", ""):
                kw["ssl_keyfile"] = cfg.tls_key_file
        return kw

    # ----------------------------------------------------------------------------- routing

    def key(self, gkey: bytes) -> bytes:
        return make_key(self.prefix, gkey)

    def _route(self, gkeys: Sequence[bytes]) -> dict[str, _Batch] | None:
        """Group keys by node. None when the cluster topology is not known (all misses)."""
        batches: dict[str, _Batch] = {}
        if self._standalone is not None:
            b = _Batch("standalone", self._standalone)
            b.idx = list(range(len(gkeys)))
            b.keys = [make_key(self.prefix, g) for g in gkeys]
            batches["standalone"] = b
            return batches
        rc = self._rc
        if rc is None:
            return None
        nm = rc.nodes_manager
        slot_node: dict[int, Any] = {}
        for i, g in enumerate(gkeys):
            k = make_key(self.prefix, g)
            slot = key_slot(k)
            node = slot_node.get(slot)
            if node is None:
                try:
                    node = nm.get_node_from_slot(slot)
                except Exception:            # slot not covered: a miss, topology may change
                    continue
                slot_node[slot] = node
            b = batches.get(node.name)
            if b is None:
                b = batches[node.name] = _Batch(node.name, rc.get_redis_connection(node))
            b.idx.append(i)
            b.keys.append(k)
        return batches

    # ----------------------------------------------------------------------------- health

    def _add(self, *pairs: Any) -> None:
        """Counters are bumped from callers and pool threads: name, delta, name, delta..."""
        with self._stat_lock:
            c = self._counters
            for i in range(0, len(pairs), 2):
                c[pairs[i]] += pairs[i + 1]

    def _node(self, name: str) -> _NodeState:
        st = self._nodes.get(name)
        if st is None:
            st = self._nodes[name] = _NodeState(name)
        return st

    def _usable(self, name: str) -> bool:
        """True when calls may go to the node; a down node past its back-off gets a probe."""
        st = self._node(name)
        if st.up:
            return True
        if time.monotonic() >= st.down_until and not st.probing and not self._closed:
            st.probing = True
            self._pool.submit(self._probe, name)
        return False

    def _describe(self, err: BaseException | str) -> str:
        return describe_error(err, tls=self._tls, client_cert=self._client_cert)

    def _mark_down(self, name: str, err: BaseException | str) -> None:
        with self._lock:
            st = self._node(name)
            st.failures += 1
            st.last_error = self._last_error = self._describe(err)
            st.backoff_s = (min(st.backoff_s * 2, self.backoff_max_s) if not st.up
                            else self.backoff_min_s)
            st.up = False
            st.down_until = time.monotonic() + st.backoff_s
        client = self._client_for(name)
        if client is not None:
            try:  # drop pooled sockets: after a restart they are all dead, reconnect fresh
                client.connection_pool.disconnect()
            except Exception:
                pass

    def _mark_up(self, name: str) -> None:
        with self._lock:
            st = self._node(name)
            if not st.up:
                self._add("reconnects", 1)
            st.up, st.backoff_s, st.down_until, st.probing = True, 0.0, 0.0, False

    def _client_for(self, name: str) -> redis.Redis | None:
        if self._standalone is not None:
            return self._standalone
        rc = self._rc
        if rc is None:
            return None
        node = rc.get_node(node_name=name)
        return None if node is None else rc.get_redis_connection(node)

    def _probe(self, name: str) -> None:
        """Background: PING a down node; up again on PONG, else a longer back-off."""
        self._add("probes", 1)
        try:
            if self.cluster:
                self._refresh_topology()
            client = self._client_for(name)
            if client is None:
                raise Unavailable(f"node {name} is no longer in the cluster")
            client.ping()
        except Exception as e:  # noqa: BLE001 - any failure means "still down"
            self._mark_down(name, e)
        else:
            self._mark_up(name)
        finally:
            with self._lock:
                self._node(name).probing = False

    def _discover_async(self) -> None:
        st = self._topology
        if st.probing or self._closed:
            return
        st.probing = True
        self._pool.submit(self._discover)

    def _discover(self) -> None:
        """Background: build the RedisCluster client (CLUSTER SLOTS from any seed node)."""
        from redis.cluster import ClusterNode, RedisCluster

        st = self._topology
        try:
            nodes = []
            for url in self._urls:
                u = parse_url(url)
                nodes.append(ClusterNode(u.get("host", "127.0.0.1"), u.get("port", 6379)))
            kw = dict(self._conn_kwargs)
            first = _url_kwargs(self._urls[0])
            for k in ("username", "password"):
                if k in first and k not in kw:
                    kw[k] = first[k]
            self._rc = RedisCluster(startup_nodes=nodes, require_full_coverage=False,
                                    dynamic_startup_nodes=True, **kw)
        except Exception as e:  # noqa: BLE001
            with self._lock:
                st.failures += 1
                st.last_error = self._last_error = self._describe(e)
                st.backoff_s = min(max(st.backoff_s * 2, self.backoff_min_s), self.backoff_max_s)
                st.down_until = time.monotonic() + st.backoff_s
                st.up = False
        else:
            with self._lock:
                st.up, st.backoff_s = True, 0.0
        finally:
            st.probing = False

    def _refresh_topology(self) -> None:
        rc = self._rc
        if rc is not None:
            try:
                rc.nodes_manager.initialize()
            except Exception:  # noqa: BLE001 - keep the old table; next probe tries again
                pass

    def wait_ready(self, timeout: float = 5.0) -> bool:
        """Block until the cluster topology is known (standalone: at once). For tools/tests."""
        end = time.monotonic() + timeout
        while self.cluster and self._rc is None and time.monotonic() < end:
            if not self._topology.probing and time.monotonic() >= self._topology.down_until:
                self._discover_async()
            time.sleep(0.01)
        return not self.cluster or self._rc is not None

    # ----------------------------------------------------------------------------- engine

    def _run(self, op: str, gkeys: Sequence[bytes], per_node: Callable[[_Batch], list],
             deadline_s: float) -> list[Any]:
        """Send one pipeline per node in parallel; results in caller order, None = miss/failed.

        Items of a node that failed, timed out, was down or is unknown come back as None.
        """
        t0 = time.perf_counter()
        out: list[Any] = [None] * len(gkeys)
        if self._closed:
            raise Unavailable("remote tier is closed")
        self._add("calls", 1)
        batches = self._route(gkeys)
        if batches is None:                   # cluster not discovered (yet / any more)
            self._add("skipped_down", 1)
            if time.monotonic() >= self._topology.down_until:
                self._discover_async()
            self._finish(op, t0, failed="cluster topology unknown")
            return out
        live: list[tuple[_Batch, Future]] = []
        failure = ""
        for b in batches.values():
            if not self._usable(b.node):
                # a miss without waiting; with raise_errors the caller hears why
                failure = f"{op} on {b.node}: down ({self._node(b.node).last_error})"
                continue
            live.append((b, self._pool.submit(per_node, b)))
        if failure:
            self._add("skipped_down", 1)
        if live:
            done, _ = wait_futures([f for _, f in live], timeout=deadline_s)
            for b, f in live:
                if f not in done:
                    self._add("timeouts", 1)
                    self._add("errors", 1)
                    failure = f"{op} on {b.node}: no answer within {deadline_s * 1000:.0f} ms"
                    self._mark_down(b.node, failure)
                    continue
                exc = f.exception()
                if exc is not None:
                    self._add("errors", 1)
                    failure = f"{op} on {b.node}: {self._describe(exc)}"
                    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError, OSError,
                                        ClusterDownError)):
                        self._mark_down(b.node, exc)
                    continue
                self._add("round_trips", 1)
                res = f.result()
                for i, r in zip(b.idx, res, strict=True):
                    if isinstance(r, BaseException):
                        self._item_error(r)
                        continue
                    out[i] = r
        self._finish(op, t0, failed=failure)
        return out

    def _item_error(self, r: BaseException) -> None:
        """One key's reply was an error: a miss. MOVED/ASK: the slot map is stale, refresh it.

        ASK (the slot is half-migrated and the key already lives on the importing node) is not
        followed: it stays a counted miss until the migration ends and MOVED takes over.
        """
        if isinstance(r, (AskError, TryAgainError, ClusterDownError)):   # MovedError is an Ask
            self._add("moved", 1)
            self._request_refresh()
        else:
            self._add("errors", 1)

    def _request_refresh(self) -> None:
        """Re-read the slot table in the background: one at a time, at most once per
        `backoff_min_ms`. During a long migration every call sees ASK; without the limit each
        would re-run CLUSTER SLOTS (and redis-py drops the queried node's idle sockets then)."""
        now = time.monotonic()
        with self._lock:
            st = self._topology
            if self._rc is None or st.probing or self._closed or now < self._next_refresh:
                return
            st.probing = True
            self._next_refresh = now + self.backoff_min_s
        self._pool.submit(self._refresh_then_clear)

    def _refresh_then_clear(self) -> None:
        try:
            self._refresh_topology()
        finally:
            self._topology.probing = False

    def _finish(self, op: str, t0: float, failed: str = "") -> None:
        dt = time.perf_counter() - t0
        with self._stat_lock:
            self._lat[op].add(dt)
        if self.on_latency is not None:
            try:
                self.on_latency(op, dt)
            except Exception:  # noqa: BLE001 - metrics never break the data path
                pass
        if failed and self.raise_errors:
            raise Unavailable(f"remote tier: {failed}")

    def _bulk_deadline(self, nbytes: int) -> float:
        return self.deadline_s + self.bulk_s_per_mib * nbytes / (1 << 20)

    # ----------------------------------------------------------------------------- API

    def exists_many(self, gkeys: Sequence[bytes], deadline_s: float | None = None) -> list[bool]:
        """Which keys the remote store holds: one pipelined EXISTS batch per node, deadline-bound.

        Used by lookups for the part of a prefix the local tiers miss; failures read as False.
        """
        if not gkeys:
            return []

        def per_node(b: _Batch) -> list:
            p = b.client.pipeline(transaction=False)
            for k in b.keys:
                p.exists(k)
            return p.execute(raise_on_error=False)

        res = self._run("exists", gkeys, per_node, self.deadline_s if deadline_s is None
                        else deadline_s)
        found = [bool(r) for r in res]
        n = sum(found)
        self._add("lookup_hits", n)
        self._add("lookup_misses", len(found) - n)
        return found

    def get_many(self, gkeys: Sequence[bytes], deadline_s: float | None = None,
                 unframed: bool = False) -> list[Any]:
        """Values (framed bytes) or None: missing, failed, late or corrupt.

        With `unframed=True` each hit is `unframe(value)` = (codec, raw_len, payload) so the
        caller does not checksum the block a second time. Corrupt values are counted, never
        returned. Deadline: `deadline_ms` plus `bulk_ms_per_mib` for an assumed 2 MiB per key.
        """
        if not gkeys:
            return []

        def per_node(b: _Batch) -> list:
            p = b.client.pipeline(transaction=False)
            for k in b.keys:
                p.get(k)
            return p.execute(raise_on_error=False)

        if deadline_s is None:
            deadline_s = self._bulk_deadline(len(gkeys) << 21)
        res = self._run("get", gkeys, per_node, deadline_s)
        out: list[Any] = []
        hits = nbytes = corrupt = 0
        bad: list[bytes] = []
        for g, v in zip(gkeys, res, strict=True):
            if v is None:
                out.append(None)
                continue
            nbytes += len(v)
            if self.verify or unframed:
                try:
                    framed = _unframe(v)  # type: ignore[misc]
                except (DataLoss, ValueError, TypeError):
                    corrupt += 1
                    bad.append(g)
                    out.append(None)
                    continue
                out.append(framed if unframed else v)
            else:
                out.append(v)
            hits += 1
        self._add("hits", hits, "misses", len(res) - hits, "bytes_read", nbytes,
                  "corrupt", corrupt)
        if bad:
            self._delete_async(bad)
        return out

    def _delete_async(self, gkeys: list[bytes]) -> None:
        """Best effort, not waited for: drop corrupt values so a writer can store a good copy."""
        batches = self._route(gkeys) or {}
        for b in batches.values():
            if self._node(b.node).up and not self._closed:
                self._pool.submit(_pipeline_delete, b)


    def put_many(self, items: Sequence[tuple[bytes, bytes | memoryview]],
                 deadline_s: float | None = None) -> int:
        """Store (gkey, framed value) pairs, one pipelined SET batch per node. Returns the bytes
        Redis acknowledged; failures are counted (and raised only with raise_errors)."""
        if not items:
            return 0
        gkeys = [g for g, _ in items]
        sizes = [len(v) for _, v in items]
        values = [v for _, v in items]
        ttl = self.ttl_s or None

        def per_node(b: _Batch) -> list:
            p = b.client.pipeline(transaction=False)
            for i, k in zip(b.idx, b.keys, strict=True):
                p.set(k, values[i], ex=ttl)
            return p.execute(raise_on_error=False)

        if deadline_s is None:
            deadline_s = self._bulk_deadline(sum(sizes))
        res = self._run("put", gkeys, per_node, deadline_s)
        written = sum(s for s, r in zip(sizes, res, strict=True) if r)
        self._add("bytes_written", written)
        self._add("keys_written", sum(1 for r in res if r))
        return written

    def delete_many(self, gkeys: Sequence[bytes], sizes: Sequence[int] | None = None,
                    deadline_s: float | None = None) -> int:
        """Delete keys (one pipelined DEL batch per node); returns how many existed.

        `sizes` (the framed sizes the caller wrote) lets the tier keep `used_bytes` right.
        """
        if not gkeys:
            return 0

        res = self._run("delete", gkeys, _pipeline_delete,
                        self.deadline_s if deadline_s is None else deadline_s)
        n = sum(1 for r in res if r)
        self._add("keys_deleted", n)
        if sizes is not None:
            self._add("bytes_deleted", sum(s for s, r in zip(sizes, res, strict=True) if r))
        return n

    def forget(self, nbytes: int) -> None:
        """The caller found keys it wrote gone (Redis evicted them): stop counting their bytes."""
        self._add("bytes_vanished", int(nbytes))

    @property
    def used_bytes(self) -> int:
        """Bytes this process wrote and has not seen deleted or vanish (an upper bound: Redis'
        own eviction is only seen when a key is found missing, see `forget`)."""
        c = self._counters
        return max(0, c["bytes_written"] - c["bytes_deleted"] - c["bytes_vanished"])

    def has_room(self, nbytes: int) -> bool:
        return self.capacity <= 0 or self.used_bytes + nbytes <= self.capacity

    @property
    def up(self) -> bool:
        if self.cluster and self._rc is None:
            return False
        return all(st.up for st in self._nodes.values())

    @property
    def stats(self) -> dict[str, Any]:
        s: dict[str, Any] = dict(self._counters)
        s["up"] = self.up
        s["used_bytes"] = self.used_bytes
        s["capacity"] = self.capacity
        now = time.monotonic()
        s["last_error"] = self._last_error
        s["nodes"] = {n: self._node_stats(st, now) for n, st in list(self._nodes.items())}
        if self.cluster:                     # discovery failures (auth, TLS) show up here
            s["topology"] = self._node_stats(self._topology, now)
        s["latency"] = {op: {"count": o.count, "sum_s": o.sum_s, "max_s": o.max_s}
                        for op, o in self._lat.items()}
        s["round_trips_per_call"] = (s["round_trips"] / s["calls"]) if s["calls"] else 0.0
        return s

    @staticmethod
    def _node_stats(st: _NodeState, now: float) -> dict[str, Any]:
        return {"up": st.up, "failures": st.failures, "last_error": st.last_error,
                "retry_in_s": max(0.0, st.down_until - now) if not st.up else 0.0}

    def latency_samples(self, op: str) -> list[float]:
        """Recent per-call latencies of `op` in seconds (for histograms and percentiles)."""
        return list(self._lat[op].samples)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        for c in [self._standalone, self._rc]:
            if c is not None:
                try:
                    c.close()
                except Exception:  # noqa: BLE001
                    pass

    def __enter__(self) -> RemoteTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
