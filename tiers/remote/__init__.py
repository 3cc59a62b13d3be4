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

redis-py is a hard dependency (imported here, not lazily); `kvstore` is never imported: the
config is duck-typed (any object with RemoteConfig's attribute names).

| module | job |
| --- | --- |
| `tier` | `RemoteTier`: the batched exists / get / put / delete, deadlines, verification |
| `nodes` | routing keys to nodes, each node's back-off "down" state, cluster topology |
| `connection` | redis-py options from the config and URLs; failure text an operator can act on |
| `stats` | counters, latencies and the bytes this process wrote |
"""

from __future__ import annotations

from .connection import SOCKET_GRACE_S, describe_error
from .nodes import make_key
from .tier import RemoteTier

__all__ = ["SOCKET_GRACE_S", "RemoteTier", "describe_error", "make_key"]
