"""Which Redis node holds a key, and whether that node is worth asking right now.

Routing: keys go to their node (cluster: by hash slot, from redis-py's slot table), so a call
makes one batch per node. Keys carry no hash tag, so a namespace spreads over every slot and
node.

Health: a node whose batch failed or came late is "down" for a short, growing back-off
(`backoff_min_ms` doubling up to `backoff_max_ms`); calls skip it meanwhile, and once the
back-off has passed the next call sends one background PING instead of its batch. A dead Redis
therefore costs a dict lookup per call, never a timeout per call, and the tier reconnects by
itself. A cluster's topology is discovered in the background the same way (the constructor
never blocks on a dead cluster), and re-read when a reply says the slot map is stale, at most
once per `backoff_min_ms`.

A bulk batch (block reads and writes) that comes late does not mark its node down by itself:
its deadline grows with the bytes it moves, and one caller's large values must not make the node
a miss for every caller while it answers everyone else. The node is PINGed in the background
instead (`check_slow`) and goes down only if that PING is late or fails too.

Warm connections: each node gets `warm` connections opened in the background when it becomes
known (the standalone server at once, a cluster's primaries once its slot table is read) and
again when it answers after being down. A connection's setup (TCP, TLS, AUTH) costs round
trips that a cold call would pay inside its deadline: at tens of milliseconds to the server,
the first calls after a start, or after an outage dropped the connections, would come late,
be misses, and mark the node down, though it answers.

Log: a node going down logs one WARNING naming the cause (the operator's only view of a wrong
password or a TLS mistake besides `stats`), and one INFO when it is back. Rate-limited per node:
the same cause again within LOG_REPEAT_S, or any cause within LOG_MIN_INTERVAL_S of the last
warning, is counted and told with the next warning instead, so a flapping node cannot flood the
log.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import redis
from kvstore_client.common.errors import Unavailable
from redis.backoff import NoBackoff
from redis.connection import parse_url
from redis.crc import key_slot
from redis.retry import Retry

from .connection import url_kwargs
from .stats import RemoteStats

log = logging.getLogger("kvstore.remote")

NS_ID_BYTES = 16
STANDALONE = "standalone"
TOPOLOGY = "topology"
LOG_REPEAT_S = 300.0        # the same cause of a node going down is warned about again after this
LOG_MIN_INTERVAL_S = 10.0   # at most one down warning per node within this, whatever the cause
TIMEOUT_TEXT = "no answer within"   # how the tier words a late batch (tier.py, _run)


def make_key(prefix: bytes, gkey: bytes) -> bytes:
    """`{prefix}{ns_id.hex()}:{block_key.hex()}`: readable in redis-cli, no hash tag (spreads)."""
    return b"%s%s:%s" % (prefix, gkey[:NS_ID_BYTES].hex().encode(),
                         gkey[NS_ID_BYTES:].hex().encode())


@dataclass
class NodeState:
    """Health of one Redis node as this process sees it (the back-off "down" state)."""

    name: str
    up: bool = True
    down_until: float = 0.0       # monotonic; calls skip the node until then
    backoff_s: float = 0.0
    probing: bool = False
    failures: int = 0
    last_error: str = ""
    checking: bool = False        # a background PING after a late bulk batch is running
    down_since: float = 0.0       # monotonic, when it last went down
    warned_key: str = ""          # the cause of the last down warning (digits folded)
    warned_at: float = float("-inf")
    warned_down: bool = False     # a warning was logged for this down spell: log the way back
    unlogged: int = 0             # times it went down since the last warning, not logged

    def summary(self, now: float) -> dict[str, Any]:
        return {"up": self.up, "failures": self.failures, "last_error": self.last_error,
                "retry_in_s": max(0.0, self.down_until - now) if not self.up else 0.0}


class Batch:
    """The keys of one call that go to one node, with their positions in the caller's list."""

    __slots__ = ("node", "client", "idx", "keys")

    def __init__(self, node: str, client: redis.Redis) -> None:
        self.node = node
        self.client = client
        self.idx: list[int] = []
        self.keys: list[bytes] = []


class Nodes:
    """The nodes of one remote tier: routing, health and (cluster) topology.

    `pool` runs probes and discovery (the tier's own batches run there too); `describe` turns
    a failure into the operator's last-error text.
    """

    def __init__(self, urls: list[str], cluster: bool, prefix: bytes,
                 conn_kwargs: dict[str, Any], pool: ThreadPoolExecutor, stats: RemoteStats,
                 describe: Callable[[BaseException | str], str], backoff_min_s: float,
                 backoff_max_s: float, label: str = "", warm: int = 0) -> None:
        self.cluster = cluster
        self.prefix = prefix
        self.backoff_min_s = backoff_min_s
        self.backoff_max_s = backoff_max_s
        self.last_error = ""
        self.closed = False
        self._urls = urls
        self._conn_kwargs = conn_kwargs
        self._pool = pool
        self._stats = stats
        self._describe = describe
        self._label = label or STANDALONE     # how logs name the standalone server
        self._lock = threading.Lock()
        self._next_refresh = 0.0             # monotonic; slot-table refreshes are rate-limited
        self._warm = warm                    # connections opened ahead per node (`warm_node`)
        self._warming = 0                    # warm-up PINGs under way (under _lock)
        self.states: dict[str, NodeState] = {}
        self.standalone: redis.Redis | None = None
        self.rc: Any = None                  # redis.cluster.RedisCluster once discovered
        self.topology = NodeState(TOPOLOGY, up=False)
        if cluster:
            self.discover_async()            # never blocks the constructor on a dead cluster
        else:
            kw = url_kwargs(urls[0])
            kw.update(conn_kwargs)
            kw["retry"] = Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
            self.standalone = redis.Redis(**kw)
            self.states[STANDALONE] = NodeState(STANDALONE)
            self.warm_node(STANDALONE)

    # -- routing ------------------------------------------------------------------------------
    def route(self, gkeys: Sequence[bytes]) -> dict[str, Batch] | None:
        """Group keys by node. None when the cluster topology is not known (all misses)."""
        batches: dict[str, Batch] = {}
        if self.standalone is not None:
            b = Batch(STANDALONE, self.standalone)
            b.idx = list(range(len(gkeys)))
            b.keys = [make_key(self.prefix, g) for g in gkeys]
            batches[STANDALONE] = b
            return batches
        rc = self.rc
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
                b = batches[node.name] = Batch(node.name, rc.get_redis_connection(node))
            b.idx.append(i)
            b.keys.append(k)
        return batches

    def client_for(self, name: str) -> redis.Redis | None:
        if self.standalone is not None:
            return self.standalone
        rc = self.rc
        if rc is None:
            return None
        node = rc.get_node(node_name=name)
        return None if node is None else rc.get_redis_connection(node)

    # -- health -------------------------------------------------------------------------------
    def node(self, name: str) -> NodeState:
        st = self.states.get(name)
        if st is None:
            st = self.states[name] = NodeState(name)
        return st

    @property
    def up(self) -> bool:
        """Every node answers (none is in back-off) and, in a cluster, the topology is known."""
        if self.cluster and self.rc is None:
            return False
        return all(st.up for st in self.states.values())

    def health(self) -> tuple[int, int]:
        """(nodes up, nodes known): standalone, its one server; a cluster, the primaries of
        its slot table (with any node a call reached since), (0, 0) until the table is known.

        Why apart from `up`: a cluster serves every slot of its live primaries while others
        are down (their keys are misses), so "one node down" is a degraded tier, not a dead
        one; the operator needs both figures (kvstore_remote_up, kvstore_remote_nodes_up)."""
        if self.standalone is not None:
            return (1 if self.node(STANDALONE).up else 0), 1
        rc = self.rc
        if rc is None:
            return 0, 0
        names = set(self.states)
        try:
            for owners in list(rc.nodes_manager.slots_cache.values()):
                if owners:
                    names.add(owners[0].name)
        except Exception:  # noqa: BLE001 - a table being rebuilt: the nodes seen so far
            pass
        states = self.states
        return sum(1 for n in names if n not in states or states[n].up), len(names)

    def usable(self, name: str) -> bool:
        """True when calls may go to the node; a down node past its back-off gets a probe."""
        st = self.node(name)
        if st.up:
            return True
        if time.monotonic() >= st.down_until and not st.probing and not self.closed:
            st.probing = True
            self._pool.submit(self._probe, name)
        return False

    def mark_down(self, name: str, err: BaseException | str) -> None:
        with self._lock:
            st = self.node(name)
            now = time.monotonic()
            if st.up:
                st.down_since = now
            st.failures += 1
            st.last_error = self.last_error = self._describe(err)
            st.backoff_s = (min(st.backoff_s * 2, self.backoff_max_s) if not st.up
                            else self.backoff_min_s)
            line = self._note_down(st, now, went_down=st.up)
            st.up = False
            st.down_until = now + st.backoff_s
        if line and not self.closed:        # (a tier closing fails its last calls: no news)
            log.warning("%s", line)
        client = self.client_for(name)
        if client is not None:
            try:  # drop pooled sockets: after a restart they are all dead, reconnect fresh
                client.connection_pool.disconnect()
            except Exception:
                pass

    def mark_up(self, name: str) -> None:
        with self._lock:
            st = self.node(name)
            line = ""
            if not st.up:
                self._stats.add("reconnects", 1)
                line = self._note_up(st, time.monotonic())
            st.up, st.backoff_s, st.down_until, st.probing = True, 0.0, 0.0, False
        if line:
            log.info("%s", line)

    # -- the log: one line per cause, rate-limited (module docstring) --------------------------
    def _display(self, name: str) -> str:
        if name == STANDALONE:
            return f"server {self._label}"
        if name == TOPOLOGY:
            return "cluster (slot-table discovery)"
        return f"cluster node {name}"

    def _note_down(self, st: NodeState, now: float, went_down: bool) -> str:
        """The warning to log for `st` going (or staying) down with st.last_error, or "".
        Called under the lock."""
        key = re.sub(r"\d+", "#", re.sub(r"^\w+ on \S+: ", "", st.last_error))
        repeat = key == st.warned_key and now - st.warned_at < LOG_REPEAT_S
        # A late answer says little (a TLS handshake with a plain server just hangs); the first
        # real error after it is told at once, however soon.
        vague = TIMEOUT_TEXT in st.warned_key and TIMEOUT_TEXT not in key
        if repeat or (now - st.warned_at < LOG_MIN_INTERVAL_S and not vague):
            if went_down:
                st.unlogged += 1
            return ""
        more = (f" ({st.unlogged} more time{'s' if st.unlogged > 1 else ''} down since the "
                "last warning)" if st.unlogged else "")
        st.warned_key, st.warned_at, st.warned_down, st.unlogged = key, now, True, 0
        then = ("every key is a miss until a background retry reads the slot table"
                if st.name == TOPOLOGY else
                "its keys are misses until a background PING finds it answering again")
        return f"remote tier: {self._display(st.name)} is down: {st.last_error}{more}; {then}"

    def _note_up(self, st: NodeState, now: float) -> str:
        """The line to log for `st` answering again: only after a warned-about spell."""
        if not st.warned_down:
            return ""
        st.warned_down = False
        return (f"remote tier: {self._display(st.name)} is answering again after "
                f"{now - st.down_since:.1f} s down")

    def check_slow(self, name: str, cause: str, timeout_s: float) -> None:
        """A bulk batch to `name` came late: PING it in the background and mark it down only if
        the PING is late (past `timeout_s`) or fails. One check per node at a time."""
        with self._lock:
            st = self.node(name)
            if not st.up or st.checking or self.closed:
                return
            st.checking = True
        threading.Thread(target=self._check_slow, args=(name, cause, timeout_s), daemon=True,
                         name="kvs-remote-check").start()

    def _check_slow(self, name: str, cause: str, timeout_s: float) -> None:
        result: list[BaseException | None] = []

        def ping() -> None:
            try:
                client = self.client_for(name)
                if client is None:
                    raise Unavailable(f"node {name} is no longer in the cluster")
                client.ping()
            except Exception as e:  # noqa: BLE001 - any failure means "down"
                result.append(e)
            else:
                result.append(None)

        try:
            self._stats.add("probes", 1)
            t = threading.Thread(target=ping, daemon=True, name="kvs-remote-ping")
            t.start()
            t.join(timeout_s)
            if not result:
                self.mark_down(name, f"{cause}, and a PING got no answer within "
                                     f"{timeout_s * 1000:.0f} ms")
            elif result[0] is not None:
                self.mark_down(name, result[0])
            else:
                self._stats.add("slow", 1)     # late for its size, but the node answers
        finally:
            with self._lock:
                self.node(name).checking = False

    def _probe(self, name: str) -> None:
        """Background: PING a down node; up again on PONG, else a longer back-off."""
        self._stats.add("probes", 1)
        try:
            if self.cluster:
                self.refresh_topology()
            client = self.client_for(name)
            if client is None:
                raise Unavailable(f"node {name} is no longer in the cluster")
            client.ping()
        except Exception as e:  # noqa: BLE001 - any failure means "still down"
            self.mark_down(name, e)
        else:
            # An outage broke its connections: open new ones before calls go there again, or
            # the first ones pay the setup inside their deadlines and mark it down anew. The
            # pool starts over first: a broken connection still in it, or one a late call
            # or PING gives back after the warm-up, would reconnect inside a call (redis-py
            # hands out the connection given back last).
            _start_over(client)
            end = time.monotonic() + 2 * float(self._conn_kwargs.get("socket_timeout", 1.0))
            for t in self.warm_node(name):
                t.join(max(0.0, end - time.monotonic()))
            self.mark_up(name)
        finally:
            with self._lock:
                self.node(name).probing = False

    # -- cluster topology ---------------------------------------------------------------------
    def discover_async(self) -> None:
        st = self.topology
        if st.probing or self.closed:
            return
        st.probing = True
        self._pool.submit(self._discover)

    def _discover(self) -> None:
        """Background: build the RedisCluster client (CLUSTER SLOTS from any seed node)."""
        from redis.cluster import ClusterNode, RedisCluster

        st = self.topology
        try:
            nodes = []
            for url in self._urls:
                u = parse_url(url)
                nodes.append(ClusterNode(u.get("host", "127.0.0.1"), u.get("port", 6379)))
            kw = dict(self._conn_kwargs)
            first = url_kwargs(self._urls[0])
            for k in ("username", "password"):
                if k in first and k not in kw:
                    kw[k] = first[k]
            self.rc = RedisCluster(startup_nodes=nodes, require_full_coverage=False,
                                   dynamic_startup_nodes=True, **kw)
            for node in self.rc.get_primaries():
                self.warm_node(node.name)
        except Exception as e:  # noqa: BLE001
            with self._lock:
                now = time.monotonic()
                if st.up or not st.failures:
                    st.down_since = now
                st.failures += 1
                st.last_error = self.last_error = self._describe(e)
                st.backoff_s = min(max(st.backoff_s * 2, self.backoff_min_s), self.backoff_max_s)
                st.down_until = now + st.backoff_s
                line = self._note_down(st, now, went_down=st.up)
                st.up = False
            if line:
                log.warning("%s", line)
        else:
            with self._lock:
                line = self._note_up(st, time.monotonic())
                st.up, st.backoff_s = True, 0.0
            if line:
                log.info("%s", line)
        finally:
            st.probing = False

    def refresh_topology(self) -> None:
        rc = self.rc
        if rc is not None:
            try:
                rc.nodes_manager.initialize()
            except Exception:  # noqa: BLE001 - keep the old table; next probe tries again
                pass

    def request_refresh(self) -> None:
        """Re-read the slot table in the background: one at a time, at most once per
        `backoff_min_ms`. During a long migration every call sees ASK; without the limit each
        would re-run CLUSTER SLOTS (and redis-py drops the queried node's idle sockets then)."""
        now = time.monotonic()
        with self._lock:
            st = self.topology
            if self.rc is None or st.probing or self.closed or now < self._next_refresh:
                return
            st.probing = True
            self._next_refresh = now + self.backoff_min_s
        self._pool.submit(self._refresh_then_clear)

    def _refresh_then_clear(self) -> None:
        try:
            self.refresh_topology()
        finally:
            self.topology.probing = False

    def wait_ready(self, timeout: float) -> bool:
        """Block until the cluster topology is known (standalone: at once) and the warm-up
        connections it started are open or have failed; False if `timeout` passed first."""
        end = time.monotonic() + timeout
        while self.cluster and self.rc is None and time.monotonic() < end:
            if not self.topology.probing and time.monotonic() >= self.topology.down_until:
                self.discover_async()
            time.sleep(0.01)
        while self._warming and time.monotonic() < end:
            time.sleep(0.01)
        return (not self.cluster or self.rc is not None) and not self._warming

    # -- warm connections ---------------------------------------------------------------------
    def warm_node(self, name: str) -> list[threading.Thread]:
        """Open up to `warm` connections to a node in the background (module docstring): as
        many PINGs at once, each on a thread of its own, so each takes a connection of its
        own from the node's pool (fewer where one ends before another starts: on a near
        server, a new connection is cheap anyway). A failure is not a health signal here:
        the calls, and their probes, judge the node. Returns the threads started."""
        client = self.client_for(name)
        if client is None or self.closed or self._warm <= 0:
            return []
        with self._lock:
            self._warming += self._warm
        started = []
        for _ in range(self._warm):
            t = threading.Thread(target=self._warm_one, args=(client,), daemon=True,
                                 name="kvs-remote-warm")
            try:
                t.start()
            except RuntimeError:        # no thread to be had: the calls connect themselves
                with self._lock:
                    self._warming -= 1
            else:
                started.append(t)
        return started

    def _warm_one(self, client: redis.Redis) -> None:
        try:
            if not self.closed:
                client.ping()
        except Exception:  # noqa: BLE001 - see warm_node
            pass
        finally:
            with self._lock:
                self._warming -= 1

    def close(self) -> None:
        self.closed = True
        for c in [self.standalone, self.rc]:
            if c is not None:
                try:
                    c.close()
                except Exception:  # noqa: BLE001
                    pass


def _start_over(client: redis.Redis) -> None:
    """Forget a node client's connections: the idle ones are closed, and those in use are
    dropped when given back (redis-py's pool lets go of a connection it no longer counts)."""
    pool = client.connection_pool
    try:
        pool.disconnect(inuse_connections=False)
        pool.reset()
    except Exception:  # noqa: BLE001 - a pool of another shape: calls reconnect themselves
        log.debug("remote tier: could not start a node's connection pool over", exc_info=True)
