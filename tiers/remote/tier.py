"""`RemoteTier`: the keyed tier over Redis / Valkey, one pipelined batch per node per call.

Why calls look the way they do: each call routes its keys to their nodes (tiers/remote/nodes.py)
and sends every node its batch at once on a small thread pool, so a 64-block lookup costs one
round trip per node, never one per block. The caller waits at most `deadline` for the batches;
a batch that is late (hung server, lost network) is a miss and counted, and its node goes into
its back-off "down" state. Nothing here raises into the caller unless asked (`raise_errors`):
a failure is a miss. Values are `tiers.frame` frames, verified on read; one that fails its
check is a counted `corrupt` miss, never returned, and is deleted in the background so a writer
can store a good copy.

Reads are bounded: anyone who reaches the Redis can write anything under a block key, so a read
asks for at most `max_value_bytes` + 1 bytes of each value (GETRANGE, with TYPE in the same
pipeline to tell a missing key from an empty or non-string one). A longer value, or a key of
another type (a hash, a list), is a counted `corrupt` miss deleted in the background like any
other bad value: the daemon's memory per read is bounded by what the caller expects, never by
what a stranger stored.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, NamedTuple

import redis
from kvstore_client.common.errors import DataLoss, InvalidArgument, Unavailable
from kvstore_client.common.layout import MAX_BLOCK_BYTES
from redis.exceptions import AskError, ClusterDownError, ResponseError, TryAgainError

from .connection import (
    cfg_value,
    check_urls,
    connection_kwargs,
    describe_error,
    mask_url,
    url_secrets,
)
from .envelope import MAX_NOTE_BYTES, Sealer, sealer_from_file
from .nodes import TIMEOUT_TEXT, Batch, Nodes, make_key
from .stats import RemoteStats

try:  # framing is owned by tiers/frame.py; verification switches on once it exists
    from tiers.frame import unframe as _unframe
except ImportError:  # pragma: no cover - only while frame.py is being written
    _unframe = None


# What a caller adds to a value's worst-case frame size when it passes `max_value_bytes`: room
# for the seal and its note (envelope.py), and for a small envelope a newer daemon may wrap
# around a frame (its values must not read as oversize and be deleted by an older one's bound).
VALUE_SLACK_BYTES = 256 + 4 + MAX_NOTE_BYTES
# The bound on a value's size when the caller gives none (and the config has no
# `max_value_bytes`): the largest block a namespace may declare, plus 1 MiB for frame and codec
# headers and the envelope. No value a daemon writes is larger; callers that know the
# namespace pass its own, much tighter, bound.
DEFAULT_MAX_VALUE_BYTES = MAX_BLOCK_BYTES + (1 << 20)
# The per-key size a read's deadline assumes when the caller gives neither `expected_bytes` nor
# `max_value_bytes` (a 2 MiB block).
ASSUMED_VALUE_BYTES = 2 << 20


class _Marker:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


WRONG_TYPE = _Marker("WRONG_TYPE")   # a key holding a non-string value (a hash, a list...)
REFUSED = _Marker("REFUSED")         # a value over its bound or of the wrong type: counted, gone
ABSENT = _Marker("ABSENT")           # the node answered: no such key


class Unframed(NamedTuple):
    """A verified value, opened (get_many(unframed=True)): the frame's fields, the checksum
    the block was committed with (0: unknown) and the note sealed with it (b"": none), from
    its seal (tiers/remote/envelope.py)."""
    codec: str
    raw_len: int
    payload: memoryview
    checksum: int
    note: bytes = b""


def _read_reply(kind: Any, value: Any) -> Any:
    """(TYPE reply, GETRANGE reply) of one key -> value, ABSENT, WRONG_TYPE or the error.

    GETRANGE answers "" both for a missing key and for an empty value; TYPE tells them apart.
    """
    if isinstance(value, ResponseError) and str(value).startswith("WRONGTYPE"):
        return WRONG_TYPE
    if isinstance(value, BaseException):
        return value
    if value:                           # a value (even if TYPE raced with a writer)
        return value
    if isinstance(kind, BaseException):
        return kind
    kind = kind.decode() if isinstance(kind, bytes) else str(kind)
    if kind == "none":
        return ABSENT
    return value if kind == "string" else WRONG_TYPE


def _pipeline_delete(b: Batch) -> list:
    """DEL each key in one pipeline (no multi-key DEL: keys of a node span several slots)."""
    p = b.client.pipeline(transaction=False)
    for k in b.keys:
        p.delete(k)
    return p.execute(raise_on_error=False)


def _pipeline_delete_sized(b: Batch) -> list:
    """STRLEN then DEL each key, in one pipeline: per key (keys deleted, bytes it held), or
    DEL's error. For delete_many callers that do not know the sizes (the daemon never does),
    so `bytes_deleted` counts what Redis gave back; a key that is not a string (STRLEN's
    WRONGTYPE) counts 0 bytes."""
    p = b.client.pipeline(transaction=False)
    for k in b.keys:
        p.strlen(k)
        p.delete(k)
    res = p.execute(raise_on_error=False)
    out: list = []
    for size, deleted in zip(res[0::2], res[1::2], strict=True):
        if isinstance(deleted, BaseException):
            out.append(deleted)
        else:
            out.append((deleted, size if isinstance(size, int) else 0))
    return out


class RemoteTier:
    """Keyed tier over Redis/Valkey; see tiers/remote/__init__.py for the rules it keeps."""

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
        urls = list(cfg_value(cfg, "urls", []))
        if not urls:
            raise InvalidArgument("remote.urls must list at least one redis:// or rediss:// URL")
        self.cluster = bool(cfg_value(cfg, "cluster", False))
        if len(urls) > 1 and not self.cluster:
            raise InvalidArgument("remote.urls lists several servers but remote.cluster is off; "
                                  "set cluster = true (the URLs are then seed nodes) or list one")
        check_urls(urls, self.cluster)
        prefix = str(cfg_value(cfg, "key_prefix", "kvs:"))
        if self.cluster and ("{" in prefix or "}" in prefix):
            raise InvalidArgument(f"remote.key_prefix {prefix!r} contains a brace: in a cluster "
                                  "that is a hash tag and would put every block on one node")
        self.prefix = prefix.encode()
        self.deadline_s = float(cfg_value(cfg, "deadline_ms", 200)) / 1000.0
        if self.deadline_s <= 0:
            raise InvalidArgument("remote.deadline_ms must be positive")
        # Bulk calls (get/put of whole blocks) get the lookup deadline plus a per-MiB allowance,
        # so a 64 x 2 MiB load is not declared dead by a deadline meant for a key lookup.
        self.bulk_s_per_mib = float(cfg_value(cfg, "bulk_ms_per_mib", 5.0)) / 1000.0
        # Every value is sealed to its key and commit checksum (tiers/remote/envelope.py),
        # keyed with remote.auth_key_file where one is set.
        self.sealer: Sealer = sealer_from_file(str(cfg_value(cfg, "auth_key_file", "") or ""))
        self.max_value_bytes = int(cfg_value(cfg, "max_value_bytes", DEFAULT_MAX_VALUE_BYTES))
        if self.max_value_bytes <= 0:
            raise InvalidArgument("remote.max_value_bytes must be positive")
        self.capacity = int(cfg_value(cfg, "capacity", 0))
        self.ttl_s = int(cfg_value(cfg, "ttl_s", 0))
        self.raise_errors = raise_errors
        self.on_latency = on_latency
        if verify is None:
            verify = _unframe is not None
        if verify and _unframe is None:
            raise InvalidArgument("verify=True needs tiers.frame, which is not installed")
        self.verify = verify

        tls = bool(cfg_value(cfg, "tls", False)) or any(u.startswith("rediss://") for u in urls)
        conn = connection_kwargs(cfg, tls)
        self._tls, self._client_cert = tls, "ssl_certfile" in conn
        self._secrets = url_secrets(urls, str(cfg_value(cfg, "password", "")))
        self._closed = False
        workers = int(cfg_value(cfg, "max_workers", 8))
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvs-remote")
        self._stats = RemoteStats()
        self._nodes = Nodes(urls, self.cluster, self.prefix, conn, self._pool, self._stats,
                            self._describe,
                            float(cfg_value(cfg, "backoff_min_ms", 50)) / 1000.0,
                            float(cfg_value(cfg, "backoff_max_ms", 2000)) / 1000.0,
                            label=mask_url(urls[0]),
                            # as many as the batches that may go to one node at once
                            warm=workers)

    def key(self, gkey: bytes) -> bytes:
        return make_key(self.prefix, gkey)

    def _describe(self, err: BaseException | str) -> str:
        return describe_error(err, tls=self._tls, client_cert=self._client_cert,
                              secrets=self._secrets)

    def wait_ready(self, timeout: float = 5.0) -> bool:
        """Block until the cluster topology is known (standalone: at once) and the warm-up
        connections are open (Nodes.warm_node). For tools and tests."""
        return self._nodes.wait_ready(timeout)

    # ----------------------------------------------------------------------------- engine

    def _run(self, op: str, gkeys: Sequence[bytes], per_node: Callable[[Batch], list],
             deadline_s: float) -> list[Any]:
        """Send one pipeline per node in parallel; results in caller order, None = miss/failed.

        Items of a node that failed, timed out, was down or is unknown come back as None.
        A late batch does not mark its node down by itself, the node is PINGed first
        (Nodes.check_slow): a block read's or write's deadline was sized from this caller's
        bytes, and an existence check late behind a busy machine's scheduling is not a dead
        node; neither may make the node a miss for every other caller.
        """
        t0 = time.perf_counter()
        out: list[Any] = [None] * len(gkeys)
        if self._closed:
            raise Unavailable("remote tier is closed")
        add, nodes = self._stats.add, self._nodes
        add("calls", 1)
        batches = nodes.route(gkeys)
        if batches is None:                   # cluster not discovered (yet / any more)
            add("skipped_down", 1)
            if time.monotonic() >= nodes.topology.down_until:
                nodes.discover_async()
            self._finish(op, t0, failed="cluster topology unknown")
            return out
        live: list[tuple[Batch, Future]] = []
        failure = ""
        for b in batches.values():
            if not nodes.usable(b.node):
                # a miss without waiting; with raise_errors the caller hears why
                failure = f"{op} on {b.node}: down ({nodes.node(b.node).last_error})"
                continue
            live.append((b, self._pool.submit(per_node, b)))
        if failure:
            add("skipped_down", 1)
        if live:
            done, _ = wait_futures([f for _, f in live], timeout=deadline_s)
            for b, f in live:
                if f not in done:
                    add("timeouts", 1)
                    add("errors", 1)
                    failure = f"{op} on {b.node}: {TIMEOUT_TEXT} {deadline_s * 1000:.0f} ms"
                    nodes.check_slow(b.node, failure, self.deadline_s)
                    continue
                exc = f.exception()
                if exc is not None:
                    add("errors", 1)
                    failure = f"{op} on {b.node}: {self._describe(exc)}"
                    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError, OSError,
                                        ClusterDownError)):
                        nodes.mark_down(b.node, exc)
                    continue
                add("round_trips", 1)
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
            self._stats.add("moved", 1)
            self._nodes.request_refresh()
        else:
            self._stats.add("errors", 1)

    def _finish(self, op: str, t0: float, failed: str = "") -> None:
        dt = time.perf_counter() - t0
        self._stats.timed(op, dt)
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

        def per_node(b: Batch) -> list:
            p = b.client.pipeline(transaction=False)
            for k in b.keys:
                p.exists(k)
            return p.execute(raise_on_error=False)

        res = self._run("exists", gkeys, per_node, self.deadline_s if deadline_s is None
                        else deadline_s)
        found = [bool(r) for r in res]
        n = sum(found)
        self._stats.add("lookup_hits", n, "lookup_misses", len(found) - n)
        return found

    def get_many(self, gkeys: Sequence[bytes], deadline_s: float | None = None,
                 unframed: bool = False, max_value_bytes: int | Sequence[int] | None = None,
                 expected_bytes: int | None = None, gone: set[bytes] | None = None
                 ) -> list[Any]:
        """Frames or None: missing, failed, late or corrupt. Each value is opened (its seal
        checked against its key, tiers/remote/envelope.py) and its frame verified.

        With `unframed=True` each hit is an `Unframed` (codec, raw_len, payload, checksum) so
        the caller does not checksum the block a second time. Corrupt values are counted,
        never returned. `gone`, where given, receives the keys Redis answered it does not
        hold or held only a corrupt value of (deleted): unlike a failed or late read, these
        say the copy is no more.

        `max_value_bytes`: the longest value that can be right, for every key or per key (the
        namespace's worst-case frame plus VALUE_SLACK_BYTES); default: the config's
        `max_value_bytes`, else DEFAULT_MAX_VALUE_BYTES. At most that many bytes + 1 are read
        per key; a longer value, or a non-string one, is a counted `corrupt` (and `oversize` /
        `wrong_type`) miss and is deleted in the background.

        Deadline (unless `deadline_s`): `deadline_ms` plus `bulk_ms_per_mib` per MiB of
        `expected_bytes` (the bytes the caller expects in all), else of the keys' explicit
        `max_value_bytes` summed, else of ASSUMED_VALUE_BYTES per key.
        """
        if not gkeys:
            return []
        n = len(gkeys)
        if max_value_bytes is None:
            limits = [self.max_value_bytes] * n
        elif isinstance(max_value_bytes, int):
            limits = [max_value_bytes] * n
        else:
            limits = [int(x) for x in max_value_bytes]
            if len(limits) != n:
                raise InvalidArgument(f"max_value_bytes lists {len(limits)} sizes for {n} keys")
        if min(limits) < 0:
            raise InvalidArgument("max_value_bytes must not be negative")

        def per_node(b: Batch) -> list:
            return self._read_batch(b, limits)

        if deadline_s is None:
            if expected_bytes is not None:
                nbytes = int(expected_bytes)
            elif max_value_bytes is not None:
                nbytes = sum(limits)
            else:
                nbytes = n * ASSUMED_VALUE_BYTES
            deadline_s = self._bulk_deadline(nbytes)
        res = self._run("get", gkeys, per_node, deadline_s)
        out: list[Any] = []
        hits = nbytes = corrupt = 0
        bad: list[bytes] = []
        for g, v in zip(gkeys, res, strict=True):
            if v is None or v is REFUSED or v is ABSENT:
                if gone is not None and v is not None:
                    gone.add(g)
                out.append(None)
                continue
            nbytes += len(v)
            try:
                checksum, fr, note = self.sealer.open_noted(g, v)
                if self.verify or unframed:
                    codec, raw_len, payload = _unframe(fr)  # type: ignore[misc]
            except (DataLoss, ValueError, TypeError):
                corrupt += 1
                bad.append(g)
                if gone is not None:
                    gone.add(g)
                out.append(None)
                continue
            out.append(Unframed(codec, raw_len, payload, checksum, note) if unframed
                       else bytes(fr))
            hits += 1
        self._stats.add("hits", hits, "misses", len(res) - hits, "bytes_read", nbytes,
                        "corrupt", corrupt)
        if bad:
            self._delete_async(bad)
        return out

    def _read_batch(self, b: Batch, limits: list[int]) -> list:
        """One node's share of a get (on a pool thread): TYPE + GETRANGE per key, pipelined.

        Values over their bound and non-string keys are counted and their deletion is sent
        here, not by the caller: a caller that stopped waiting (the deadline) must not leave
        them in place to be read again. They come back as REFUSED.
        """
        p = b.client.pipeline(transaction=False)
        for i, k in zip(b.idx, b.keys, strict=True):
            p.type(k)
            p.getrange(k, 0, limits[i])     # inclusive end: at most limit + 1 bytes
        res = p.execute(raise_on_error=False)
        out: list[Any] = []
        drop = Batch(b.node, b.client)
        oversize = wrong_type = 0
        for j, (i, k) in enumerate(zip(b.idx, b.keys, strict=True)):
            v = _read_reply(res[2 * j], res[2 * j + 1])
            if v is WRONG_TYPE:
                wrong_type += 1
            elif isinstance(v, bytes) and len(v) > limits[i]:
                oversize += 1
            else:
                out.append(v)
                continue
            out.append(REFUSED)
            drop.idx.append(i)
            drop.keys.append(k)
        if drop.keys:
            self._stats.add("corrupt", oversize + wrong_type, "oversize", oversize,
                            "wrong_type", wrong_type)
            try:
                self._pool.submit(_pipeline_delete, drop)
            except RuntimeError:            # the tier closed meanwhile: nothing to tidy
                pass
        return out

    def _delete_async(self, gkeys: list[bytes]) -> None:
        """Best effort, not waited for: drop corrupt values so a writer can store a good copy."""
        batches = self._nodes.route(gkeys) or {}
        for b in batches.values():
            if self._nodes.node(b.node).up and not self._closed:
                self._pool.submit(_pipeline_delete, b)

    def put_many(self, items: Sequence[tuple], deadline_s: float | None = None) -> int:
        """Store (gkey, frame), (gkey, frame, commit checksum) or (gkey, frame, checksum,
        note) items, each sealed to its key, checksum (0: unknown) and note
        (tiers/remote/envelope.py), one pipelined SET batch per node. Returns the bytes Redis
        acknowledged (seals included); failures are counted (and raised only with
        raise_errors)."""
        if not items:
            return 0
        gkeys = [it[0] for it in items]
        seal = self.sealer.seal
        values = [seal(it[0], it[2] if len(it) > 2 else 0, it[1], it[3] if len(it) > 3 else b"")
                  for it in items]
        sizes = [len(v) for v in values]
        ttl = self.ttl_s or None

        def per_node(b: Batch) -> list:
            p = b.client.pipeline(transaction=False)
            for i, k in zip(b.idx, b.keys, strict=True):
                p.set(k, values[i], ex=ttl)
            return p.execute(raise_on_error=False)

        if deadline_s is None:
            deadline_s = self._bulk_deadline(sum(sizes))
        res = self._run("put", gkeys, per_node, deadline_s)
        written = sum(s for s, r in zip(sizes, res, strict=True) if r)
        self._stats.add("bytes_written", written, "keys_written", sum(1 for r in res if r))
        return written

    def delete_many(self, gkeys: Sequence[bytes], sizes: Sequence[int] | None = None,
                    deadline_s: float | None = None, failed: list[bytes] | None = None) -> int:
        """Delete keys (one pipelined DEL batch per node); returns how many existed.

        `sizes` (the sizes put_many counted: frames plus their seals) lets the tier keep
        `used_bytes` right; without them each key's length is asked in the same pipeline
        (STRLEN before its DEL, no extra round trip), so `bytes_deleted` is never left at 0
        while keys go (the daemon's deletes carry no sizes).
        `failed`, where given, receives the keys whose node did not answer (down, late): they
        may still be there.
        """
        if not gkeys:
            return 0

        res = self._run("delete", gkeys,
                        _pipeline_delete if sizes is not None else _pipeline_delete_sized,
                        self.deadline_s if deadline_s is None else deadline_s)
        if failed is not None:
            failed.extend(g for g, r in zip(gkeys, res, strict=True)
                          if r is None or isinstance(r, BaseException))
        if sizes is None:
            gone = [r for r in res if isinstance(r, tuple) and r[0]]   # (not down, late)
            self._stats.add("keys_deleted", len(gone),
                            "bytes_deleted", sum(size for _, size in gone))
            return len(gone)
        n = sum(1 for r in res if r and not isinstance(r, BaseException))
        self._stats.add("keys_deleted", n)
        self._stats.add("bytes_deleted", sum(s for s, r in zip(sizes, res, strict=True) if r))
        return n

    @property
    def used_bytes(self) -> int:
        """Bytes this process wrote and has not deleted: an upper bound of what it holds in
        Redis, whose own eviction it does not see. The daemon's capacity bound and Stats use
        the index's running total of the blocks it holds as remote instead (docs/remote.md)."""
        return self._stats.used_bytes

    @property
    def up(self) -> bool:
        return self._nodes.up

    @property
    def stats(self) -> dict[str, Any]:
        s: dict[str, Any] = dict(self._stats.counters)
        s["up"] = self.up                   # every node answers
        # Any node answers: the tier still serves (a cluster, its live nodes' slots).
        s["nodes_up"], s["nodes_total"] = self._nodes.health()
        s["serving"] = s["nodes_up"] > 0
        s["capacity"] = self.capacity
        now = time.monotonic()
        nodes = self._nodes
        s["last_error"] = nodes.last_error
        s["nodes"] = {n: st.summary(now) for n, st in list(nodes.states.items())}
        if self.cluster:                     # discovery failures (auth, TLS) show up here
            s["topology"] = nodes.topology.summary(now)
        s["latency"] = self._stats.latency_summary()
        s["round_trips_per_call"] = (s["round_trips"] / s["calls"]) if s["calls"] else 0.0
        return s

    def latency_samples(self, op: str) -> list[float]:
        """Recent per-call latencies of `op` in seconds (for histograms and percentiles)."""
        return self._stats.samples(op)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._nodes.closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._nodes.close()

    def __enter__(self) -> RemoteTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
