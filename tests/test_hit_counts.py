"""The hit rate counts what engines asked for to load, not what stores looked up.

kvstore/lookup.py: a Lookup or LookupAcquire counts each tier's resident prefix as its hits, a
Locate (the vLLM and SGLang adapters' lookup) the keys resident in each tier; the lookups a
store makes of the prefix it need not write (LookupReserve, a Lookup marked for_store) count
in `store_lookups` only. Before, every store of new blocks added them as misses, and an
engine loading only through Locate showed a hit rate of 0.
"""

from __future__ import annotations

import numpy as np
from kvstore_client import KVLayout, connect

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=8, dtype="float16")
T = LAYOUT.block_tokens


def _kv(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((2, 2, n * T, 2, 16)).astype(np.float16)


def _keys(ns, n: int, seed: int) -> list[bytes]:
    return ns.keys(np.random.default_rng(seed).integers(0, 50_000, size=n * T))


def _counts(c) -> dict:
    st = c.stats()
    cnt = st["counters"]
    return {"host_hits": st["tiers"]["host"].get("hits", 0),
            "host_misses": st["tiers"]["host"].get("misses", 0),
            "ssd_hits": st["tiers"]["ssd"].get("hits", 0),
            "ssd_misses": st["tiers"]["ssd"].get("misses", 0),
            "asked": cnt.get("lookup_blocks", 0), "hit": cnt.get("lookup_hit_blocks", 0),
            "store_lookups": cnt.get("store_lookups", 0)}


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def test_stores_are_not_misses_and_loads_by_locate_are_hits(daemon) -> None:
    with connect(daemon.address) as shm, connect(daemon.address, transport="grpc") as grpc:
        ns, gns = shm.namespace(LAYOUT, model="hits"), grpc.namespace(LAYOUT, model="hits")
        assert (shm.transport, grpc.transport) == ("shm", "grpc")
        keys, more = _keys(ns, 8, 1), _keys(ns, 4, 2)

        # stores over shared memory (LookupReserve, then store-ahead) and over Put: no hit or
        # miss, only the store's own lookups
        base = _counts(shm)
        assert ns.store_keys(keys[:4], _kv(4, 1)) == 4
        assert ns.store_keys(keys, _kv(8, 1)) == 4              # the first 4 were cached
        assert gns.store_keys(more, _kv(4, 2)) == 4
        d = _delta(_counts(shm), base)
        assert set(d) == {"store_lookups"} and d["store_lookups"] >= 3, d

        # an engine's Lookup: the prefix in host is its hits, the rest misses
        base = _counts(shm)
        assert ns.lookup_keys(keys + [b"\x01" * 16] * 1) == 8
        assert _delta(_counts(shm), base) == {"host_hits": 8, "host_misses": 1, "ssd_misses": 9,
                                              "asked": 9, "hit": 8}

        # a Locate, as the vLLM tier asks: every key on its own
        shm.evict("host")                       # all 12 on SSD now, none in host
        base = _counts(shm)
        unknown = [b"\x02" * 16, b"\x03" * 16]
        assert ns.locate(keys + unknown) == ["ssd"] * 8 + [None, None]
        assert _delta(_counts(shm), base) == {"host_misses": 10, "ssd_hits": 8,
                                              "ssd_misses": 2, "asked": 10, "hit": 8}

        # a pin (LookupAcquire) is a load's lookup: counted
        base = _counts(shm)
        with ns.pin(keys) as p:
            assert p.lookup.prefix_blocks == 8
        d = _delta(_counts(shm), base)
        assert d["asked"] == 8 and d["hit"] == 8 and d["ssd_hits"] == 8, d
        assert "store_lookups" not in d
