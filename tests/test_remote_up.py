"""The remote tier's health as the operator sees it, against a real 3-node Redis Cluster (the
least `redis-cli --cluster create` makes without replicas).

Before, `kvstore_remote_up` was 0 while any one cluster node was down, though the tier still
served every slot of the other: an alert on it fired for a degraded tier as for a dead one,
and nothing said how many nodes answered. Now `kvstore_remote_up` is 1 while any node
answers, and `kvstore_remote_nodes_up` / `kvstore_remote_nodes` say how many of how many
(the tier's stats: `serving`, `nodes_up`, `nodes_total`; `up` still means every node).
deploy/prometheus-alerts.yml alerts on each, and the series those rules name exist here.
"""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests.daemon import cleanup, start_daemon
from tests.redis_fixtures import start_redis
from tests.test_remote_tier import (  # noqa: F401 - own_cluster: a fixture
    Cfg,
    framed,
    gkeys,
    own_cluster_fixture,
    pairs,
    wait_until,
)
from tiers.remote import RemoteTier, make_key

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parent.parent
ALERTS = ROOT / "deploy" / "prometheus-alerts.yml"
PREFIX = b"up:"


def _health(t: RemoteTier) -> tuple[bool, bool, int, int]:
    s = t.stats
    return s["serving"], s["up"], s["nodes_up"], s["nodes_total"]


def test_one_node_down_still_serves_and_is_counted(own_cluster):
    cfg = Cfg(urls=own_cluster.urls, cluster=True, key_prefix=PREFIX.decode(),
              backoff_min_ms=10, backoff_max_ms=50)
    with RemoteTier(cfg) as t:
        assert t.wait_ready(10)
        assert _health(t) == (True, True, 3, 3)
        keys = gkeys(32)
        vals = [framed(500, seed=i) for i in range(32)]
        t.put_many(pairs(keys, vals))
        victim = own_cluster.nodes[1]
        on_victim = [own_cluster.node_for_key(make_key(PREFIX, k)) is victim for k in keys]
        assert any(on_victim) and not all(on_victim)
        victim.kill()
        try:
            # A call that reaches the dead node marks it down; the others still serve.
            assert wait_until(lambda: (t.exists_many(keys), _health(t))[1][2] == 2, 10)
            assert _health(t) == (True, False, 2, 3)
            assert t.exists_many(keys) == [not v for v in on_victim]
            own_cluster.nodes[0].kill()
            own_cluster.nodes[2].kill()
            assert wait_until(lambda: (t.exists_many(keys), _health(t))[1][2] == 0, 10)
            assert _health(t) == (False, False, 0, 3)
        finally:
            own_cluster.start()
        # Probes bring both back once calls try them again (the restarted nodes are empty).
        assert wait_until(lambda: (t.exists_many(keys), _health(t))[1] == (True, True, 3, 3),
                          20)


def test_standalone_counts_one_node(tmp_path):
    proc = start_redis(tmp_path)
    try:
        with RemoteTier(Cfg(urls=[proc.url], backoff_min_ms=10, backoff_max_ms=50)) as t:
            assert t.exists_many(gkeys(1)) == [False]
            assert _health(t) == (True, True, 1, 1)
            proc.kill()
            assert wait_until(lambda: (t.exists_many(gkeys(1)), _health(t))[1][0] is False, 10)
            assert _health(t) == (False, False, 0, 1)
    finally:
        proc.kill()


def _scrape(url: str) -> dict[str, float]:
    """The unlabelled kvstore_remote_* samples of one scrape."""
    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r"^(kvstore_remote_[a-z_]+) (\S+)$", text, re.M)}


def test_daemon_metrics_and_alert_series(own_cluster, tmp_path):
    """A daemon writing through to the cluster: remote_up stays 1 with one node down, and
    nodes_up says 2 of 3; 0 with all down; every kvstore_remote_* series the shipped alert
    rules name is exported."""
    import kvstore_client
    from kvstore_client import KVLayout

    d = start_daemon(tmp_path / "d", {
        "remote.enabled": True, "remote.urls": ",".join(own_cluster.urls),
        "remote.cluster": True, "remote.key_prefix": "dup:", "remote.write_through": True,
        "remote.deadline_ms": 2000})
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_tokens=16)
    rng = np.random.default_rng(0)
    seq = iter(range(10**6))

    def write() -> None:
        """New blocks, written through to the cluster: calls that reach every node."""
        base = next(seq) * 10**4
        kv = rng.integers(0, 2**16, (1, 2, 16 * 16, 1, 16), dtype=np.uint16)  # bf16 bits
        assert ns.store(list(range(base, base + 16 * 16)), kv) == 16

    try:
        ns = kvstore_client.connect(d.address, timeout=60).namespace(layout, model="m")
        assert wait_until(lambda: _scrape(d.metrics_url).get("kvstore_remote_nodes") == 3, 20)
        m = _scrape(d.metrics_url)
        assert (m["kvstore_remote_up"], m["kvstore_remote_nodes_up"]) == (1, 3)
        named = set(re.findall(r"\bkvstore_remote_[a-z0-9_]+", ALERTS.read_text()))
        assert {"kvstore_remote_up", "kvstore_remote_nodes_up", "kvstore_remote_nodes"} <= named
        assert named <= set(m), named - set(m)

        own_cluster.nodes[1].kill()
        try:
            def nodes_up(n: int) -> bool:
                write()
                return _scrape(d.metrics_url)["kvstore_remote_nodes_up"] == n
            assert wait_until(lambda: nodes_up(2), 20)
            m = _scrape(d.metrics_url)
            assert (m["kvstore_remote_up"], m["kvstore_remote_nodes"]) == (1, 3), m
            own_cluster.nodes[0].kill()
            own_cluster.nodes[2].kill()
            assert wait_until(lambda: nodes_up(0), 20)
            assert _scrape(d.metrics_url)["kvstore_remote_up"] == 0
        finally:
            own_cluster.start()
        deadline = time.monotonic() + 30
        while not nodes_up(3):
            assert time.monotonic() < deadline, _scrape(d.metrics_url)
            time.sleep(0.1)
        assert _scrape(d.metrics_url)["kvstore_remote_up"] == 1
    finally:
        cleanup(d)
