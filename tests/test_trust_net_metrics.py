"""The metrics endpoint of a daemon with tenants (finding 11, docs/security.md, Metrics).

It has no authentication, and on loopback every local user reaches it. Before, it showed every
tenant's blocks, bytes and lookup hits to whoever scraped it, and each scrape walked every
block under the store lock. Now per-tenant series are an opt-in (`server.metrics_tenants`),
and the walk goes a slice of index rows per hold of the lock, with the same figures.
"""

from __future__ import annotations

import re
import urllib.request

import numpy as np
from kvstore_client import KVLayout, connect

from tests.daemon import cleanup, start_daemon
from tests.trust_net_helpers import TOKENS, tenants_file

TINY = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_tokens=16, dtype="bfloat16")
SLOT = 4096                     # a 1 KiB block's host slot (4 KiB aligned)


def scrape(d) -> str:
    return urllib.request.urlopen(d.metrics_url, timeout=30).read().decode()


def store_blocks(d, tenant: str, blocks: int, seed: int) -> None:
    ids = np.arange(16 * blocks) + seed * 10**7
    kv = np.random.default_rng(seed).integers(0, 2**16, (1, 2, 16 * blocks, 1, 16),
                                              dtype=np.uint16)
    with connect(d.address, token=TOKENS[tenant], transport="grpc") as c:
        ns = c.namespace(TINY, model="m")
        assert ns.store(ids, kv) == blocks
        assert ns.lookup(ids) == 16 * blocks


def test_no_tenant_figures_without_the_opt_in(tmp_path) -> None:
    d = start_daemon(tmp_path, {"auth.tokens_file": str(tenants_file(tmp_path))})
    try:
        store_blocks(d, "a", 3, 1)
        text = scrape(d)
        assert "kvstore_lookups_total" in text               # daemon-wide figures are there
        assert 'tenant="' not in text, [x for x in text.splitlines() if 'tenant="' in x][:3]
    finally:
        cleanup(d)


def test_opted_in_tenant_figures_count_every_block_once(tmp_path) -> None:
    """More blocks than one slice of the walk (2,048 rows): the figures are exact."""
    d = start_daemon(tmp_path, {"auth.tokens_file": str(tenants_file(tmp_path)),
                                "server.metrics_tenants": True})
    try:
        store_blocks(d, "a", 5000, 1)
        store_blocks(d, "b", 3001, 2)
        with connect(d.address, token=TOKENS["b"], transport="grpc") as b:
            b.evict("host", 1000 * SLOT)
        text = scrape(d)

        def value(name: str, tenant: str, tier: str) -> int:
            m = re.search(rf'^{name}{{tenant="{tenant}",tier="{tier}"}} (\S+)$', text, re.M)
            return int(float(m.group(1))) if m else 0
        assert value("kvstore_tenant_blocks", "a", "host") == 5000
        assert value("kvstore_tenant_bytes", "a", "host") == 5000 * SLOT
        b_host = value("kvstore_tenant_blocks", "b", "host")
        b_ssd = value("kvstore_tenant_blocks", "b", "ssd")
        assert b_host <= 2001 and b_ssd >= 1000 and b_host + b_ssd >= 3001, (b_host, b_ssd)
        assert value("kvstore_tenant_blocks", "a", "ssd") == 0
        assert f'kvstore_tenant_lookup_hit_blocks_total{{tenant="a"}} {5000.0}' in text
    finally:
        cleanup(d)
