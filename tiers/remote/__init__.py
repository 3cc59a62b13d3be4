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
  tier reconnects by itself. Block reads and writes get a deadline sized from their bytes, and
  when one is late the node is PINGed first: it goes down only if the PING is late too, so one
  caller's large values do not take it away from everyone. Nothing here raises into the caller
  unless asked (`raise_errors`). A misconfigured client (wrong password, TLS certificates) is
  such a down node too; `stats["last_error"]` and one WARNING in the log say which of those it
  is (redis-py's own messages often do not), with every password masked.
* **Bounded reads.** A read asks for at most the caller's `max_value_bytes` + 1 bytes of a
  value: whatever someone planted in the shared Redis, a longer value or a non-string key is a
  counted `corrupt` miss, deleted, and never costs the daemon more memory than that.
* **Verified values.** Values are `tiers.frame` frames (header + xxh3 checksum, the same bytes the
  SSD tier stores); a value that fails its check is a counted `corrupt` miss, never returned.
* **Capacity belongs to Redis.** Redis' maxmemory policy may drop any key at any time (see
  docs/remote.md); a vanished key is an ordinary miss. The store bounds what it demotes by
  `capacity` from its own index (the raw bytes of the blocks it holds as remote).

redis-py is a hard dependency (imported here, not lazily); `kvstore` is never imported: the
config is duck-typed (any object with RemoteConfig's attribute names).

| module | job |
| --- | --- |
| `tier` | `RemoteTier`: the batched exists / get / put / delete, deadlines, verification |
| `nodes` | routing keys to nodes, each node's back-off "down" state, cluster topology |
| `connection` | redis-py options from the checked config and URLs; failure text, passwords masked |
| `stats` | counters, latencies and the bytes this process wrote |
"""

from __future__ import annotations

from .connection import SOCKET_GRACE_S, describe_error, mask_url
from .nodes import make_key
from .tier import DEFAULT_MAX_VALUE_BYTES, VALUE_SLACK_BYTES, RemoteTier

__all__ = ["DEFAULT_MAX_VALUE_BYTES", "SOCKET_GRACE_S", "VALUE_SLACK_BYTES", "RemoteTier",
           "describe_error", "make_key", "mask_url"]
