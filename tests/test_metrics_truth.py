"""Are the daemon's numbers true? Metrics and Stats against the ground truth of real workloads.

Operators read the Prometheus endpoint and `Stats`; these tests drive a real daemon with the SDK
and check what the two say against what was done (blocks stored, keys asked, calls made), what
Lookup's per_tier says, what the SSD index holds (read from LMDB with the daemon stopped) and
what Redis holds (STRLEN of the keys), and that every exported series is in README's metrics
table with its type and labels, and back.

Found by the audit that wrote them (each test says which it keeps fixed):
- the per-device gpu series of event counts (stored, evictions, ...) were gauges without
  `_total`, and no kvstore_gpu_device_* series was in README's table;
- kvstore_expired_write_slots_held and kvstore_remote_deletes_waiting, documented, were absent
  until their first event;
- the remote tier's bytes_deleted stayed 0 while the daemon deleted keys (it passed no sizes).
"""

from __future__ import annotations

import os
import re
import signal
import struct
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import lmdb
import numpy as np
import pytest
from kvstore_client import KVLayout, connect
from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client._proto import kvstore_pb2_grpc as pb_grpc

from kvstore.tenants import hash_token
from tests.daemon import Daemon, cleanup, start_daemon
from tests.redis_fixtures import redis_server_fixture  # noqa: F401  (fixture redis_server)
from tiers.ssd import extent_size

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=16, dtype="float16")
T = LAYOUT.block_tokens
BB = LAYOUT.block_bytes                          # 16 KiB, a whole number of 4 KiB slots
DEADLINE_S = 60.0
LEASE_TTL_S = 2.0

Series = dict[tuple[str, frozenset], float]
_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


# -- reading the endpoint ---------------------------------------------------------------------
def scrape(d: Daemon) -> tuple[Series, dict[str, str]]:
    """(value of each series, TYPE of each family)."""
    with urllib.request.urlopen(d.metrics_url, timeout=30) as r:
        text = r.read().decode()
    vals: Series = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, fam, typ = line.split(" ", 3)
            types[fam] = typ
        elif line and not line.startswith("#"):
            m = _LINE.match(line)
            assert m, line
            vals[m.group(1), frozenset(_LABEL.findall(m.group(2) or ""))] = float(m.group(3))
    return vals, types


def v(vals: Series, name: str, **labels: str) -> float:
    return vals[name, frozenset(labels.items())]


def tier(vals: Series, field: str, t: str) -> float:
    gauge = field in ("capacity_bytes", "used_bytes", "blocks")
    return v(vals, f"kvstore_tier_{field}" + ("" if gauge else "_total"), tier=t)


class Scrapes:
    """Successive scrapes of one daemon run; each asserts no counter went down since the last."""

    def __init__(self, d: Daemon) -> None:
        self.d = d
        self.last: Series | None = None

    def __call__(self) -> Series:
        vals, types = scrape(self.d)
        if self.last is not None:
            down = [f"{n}{dict(lab)}: {x} -> {vals[n, lab]}"
                    for (n, lab), x in self.last.items()
                    if types.get(n) == "counter" and (n, lab) in vals and vals[n, lab] < x]
            assert not down, f"counters went down: {down}"
        self.last = vals
        return vals


def kv(blocks: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((2, 2, blocks * T, 2, 64)).astype(np.float16)


def on_disk(nbytes: int, blocks: int) -> int:
    """The SSD tier's used bytes for `blocks` values of equal length adding up to `nbytes`:
    each takes its extent in the payload file."""
    assert nbytes % blocks == 0
    return blocks * extent_size(int(nbytes) // blocks)


def ssd_truth(data_dir: Path) -> tuple[int, int]:
    """(records, bytes of their extents) in the SSD index; the daemon must be stopped."""
    env = lmdb.open(str(data_dir / "ssd" / "index"), readonly=True, lock=False, max_dbs=8)
    try:
        db = env.open_db(b"index", create=False)
        n = total = 0
        with env.begin(db=db) as txn:
            for _, rec in txn.cursor():
                n += 1
                total += extent_size(struct.unpack_from("<QQQ", rec)[1])  # off, len, xxh3
        return n, total
    finally:
        env.close()


# -- README's table ---------------------------------------------------------------------------
def readme_table() -> dict[str, tuple[str, frozenset]]:
    """{metric as README names it: (type, labels)} from the Metrics section's tables."""
    text = (ROOT / "README.md").read_text().split("\n## Metrics", 1)[1].split("\n## ", 1)[0]
    out = {}
    for line in text.splitlines():
        m = re.match(r"^\| `(kvstore_[a-z0-9_]+)` \| (\w+) \|([^|]*)\|", line)
        if m:
            out[m.group(1)] = (m.group(2), frozenset(re.findall(r"`(\w+)`", m.group(3))))
    return out


def exported(vals: Series, types: dict[str, str]) -> dict[str, tuple[str, frozenset]]:
    """{family as README names it (counters with `_total`): (type, labels)}."""
    out: dict[str, tuple[str, frozenset]] = {}
    for name, labels in vals:
        fam = name
        if name not in types:               # a histogram's _bucket / _sum / _count
            fam = next(name[:-len(s)] for s in ("_bucket", "_sum", "_count")
                       if name.endswith(s) and name[:-len(s)] in types)
        if not fam.startswith("kvstore_"):
            continue
        typ, seen = out.get(fam, (types[fam], frozenset()))
        out[fam] = (typ, seen | {k for k, _ in labels if k != "le"})
    return out


# -- the tests --------------------------------------------------------------------------------
def test_figures_follow_a_host_and_ssd_workload(daemon: Daemon) -> None:
    """Stores, lookups, a duplicate Put, Evict, promotion, host read hits, Delete, Flush, an
    int8 namespace, a SIGKILLed client's lease and a restart: after each, the figures equal what
    was done, Stats says what the endpoint says, and no counter goes down."""
    d = daemon
    snap = Scrapes(d)
    c = connect(d.address)
    ns = c.namespace(LAYOUT, model="truth/a")
    toks = np.arange(8 * T)
    keys = ns.keys(toks)
    data = kv(8, 1)

    def stats_agree(vals: Series) -> None:
        """Stats says what the scrape before it said. (Not host used_bytes: the Stats call
        carries the client's releases, its reserve-ahead's slots among them.)"""
        st = c.stats()
        for t, f in st["tiers"].items():
            for k in ("capacity_bytes", "blocks", "hits", "misses", "evictions"):
                assert tier(vals, k, t) == f[k], (t, k)

    snap()
    assert ns.store(toks, data) == 8
    s1 = snap()
    stats_agree(s1)
    assert tier(s1, "blocks", "host") == 8 and tier(s1, "stored", "host") == 8
    assert v(s1, "kvstore_blocks") == 8
    assert v(s1, "kvstore_bytes_moved_total", path="client->host") == 8 * BB

    # Lookup: 12 keys, the first 8 cached in host
    r = ns.lookup_result(ns.keys(np.arange(12 * T)))
    s2 = snap()
    assert (r.prefix_blocks, r.per_tier["host"]) == (8, 8)
    d_ = lambda a, b, name, **lab: v(b, name, **lab) - v(a, name, **lab)  # noqa: E731
    assert d_(s1, s2, "kvstore_lookups_total") == 1
    assert d_(s1, s2, "kvstore_lookup_blocks_total") == 12
    assert d_(s1, s2, "kvstore_lookup_hit_blocks_total") == 8
    assert d_(s1, s2, "kvstore_tier_hits_total", tier="host") == 8
    assert d_(s1, s2, "kvstore_tier_misses_total", tier="host") == 4
    assert d_(s1, s2, "kvstore_tier_misses_total", tier="ssd") == 12

    # The same 8 blocks again through a Put stream (no lookup first, as a racing engine)
    blocks = [np.ascontiguousarray(data[:, :, i * T:(i + 1) * T]).tobytes() for i in range(8)]
    with d.channel() as ch:
        pb_grpc.KVStoreStub(ch).Put(iter([pb.PutRequest(
            namespace_id=ns.ns_id, blocks=[pb.Block(key=k, data=b)
                                           for k, b in zip(keys, blocks, strict=True)])]),
            timeout=30)
    s3 = snap()
    assert d_(s2, s3, "kvstore_duplicate_blocks_total") == 8
    assert d_(s2, s3, "kvstore_tier_stored_total", tier="host") == 0
    assert tier(s3, "blocks", "host") == 8 and tier(s3, "used_bytes", "host") >= 8 * BB

    # Evict host: every block demoted to SSD; SSD bytes are the extents of what crossed
    # host->ssd
    freed, n = c.evict("host")
    s4 = snap()
    assert (freed, n) == (8 * BB, 8)
    assert tier(s4, "blocks", "host") == 0 and tier(s4, "used_bytes", "host") == 0
    assert tier(s4, "blocks", "ssd") == 8
    assert d_(s3, s4, "kvstore_tier_evictions_total", tier="host") == 8
    assert d_(s3, s4, "kvstore_tier_demotions_total", tier="host") == 8
    assert d_(s3, s4, "kvstore_tier_demotions_in_total", tier="ssd") == 8
    assert on_disk(d_(s3, s4, "kvstore_bytes_moved_total", path="host->ssd"), 8) == tier(
        s4, "used_bytes", "ssd")
    assert ns.lookup_result(keys).per_tier == {"host": 0, "ssd": 8}

    # Load: promoted from SSD, then read from host
    out = np.zeros_like(data)
    s5 = snap()
    assert ns.load(toks, out) == 8 * T and np.array_equal(out, data)
    s6 = snap()
    assert d_(s5, s6, "kvstore_tier_promotions_total", tier="host") == 8
    assert d_(s5, s6, "kvstore_acquired_blocks_total") == 8
    assert on_disk(d_(s5, s6, "kvstore_bytes_moved_total", path="ssd->host"), 8) == tier(
        s6, "used_bytes", "ssd")
    assert tier(s6, "blocks", "host") == 8 and tier(s6, "blocks", "ssd") == 8
    assert ns.load(toks, out) == 8 * T
    s7 = snap()
    assert d_(s6, s7, "kvstore_tier_read_hits_total", tier="host") == 8
    assert d_(s6, s7, "kvstore_tier_promotions_total", tier="host") == 0

    # Delete the last 3: gone from both tiers and the index
    assert ns.delete(keys[5:]) == 3
    s8 = snap()
    stats_agree(s8)
    assert d_(s7, s8, "kvstore_deleted_blocks_total") == 3
    assert tier(s8, "blocks", "host") == 5 and tier(s8, "used_bytes", "host") == 5 * BB
    assert tier(s8, "blocks", "ssd") == 5 and v(s8, "kvstore_blocks") == 5

    # Flush 4 host-only blocks; then an int8 namespace demoted: SSD grows by its codec's output
    assert ns.store(np.arange(4 * T) + 10**5, kv(4, 2)) == 4
    c.flush()
    s9 = snap()
    assert tier(s9, "blocks", "ssd") == 9 and tier(s9, "blocks", "host") == 9
    assert d_(s8, s9, "kvstore_tier_demotions_in_total", tier="ssd") == 4
    ns8 = c.namespace(LAYOUT, model="truth/a", codec="int8")
    assert ns8.store(np.arange(6 * T) + 10**6, kv(6, 3)) == 6
    c.evict("host")
    s10 = snap()
    grew = tier(s10, "used_bytes", "ssd") - tier(s9, "used_bytes", "ssd")
    assert tier(s10, "blocks", "ssd") == 15
    assert d_(s9, s10, "kvstore_codec_blocks_total", codec="int8") == 6
    assert d_(s9, s10, "kvstore_codec_bytes_in_total", codec="int8") == 6 * BB
    out = d_(s9, s10, "kvstore_codec_bytes_out_total", codec="int8")
    assert on_disk(out, 6) == grew < 6 * BB
    assert d_(s9, s10, "kvstore_bytes_moved_total", path="host->ssd") == out

    # A client SIGKILLed holding a read lease: active leases back to 0 once it expires
    c.stats()                               # carries this client's releases (reserve-ahead)
    assert v(snap(), "kvstore_active_leases") == 0
    code = textwrap.dedent(f"""
        import numpy as np, time
        from kvstore_client import KVLayout, connect
        c = connect({d.address!r}, lease_ttl_s={LEASE_TTL_S})
        ns = c.namespace(KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=16,
                                  dtype="float16"), model="truth/a")
        p = ns.pin(ns.keys(np.arange(5 * 16)))
        print("pinned", flush=True)
        time.sleep(600)
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'client'}"})
    try:
        assert child.stdout.readline().strip() == "pinned"
        s11 = snap()
        assert v(s11, "kvstore_active_leases") == 1
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
    end = time.monotonic() + DEADLINE_S
    while v(s12 := snap(), "kvstore_active_leases") != 0:
        assert time.monotonic() < end, "the killed client's lease never expired"
        time.sleep(0.2)
    assert d_(s11, s12, "kvstore_leases_expired_total") == 1
    assert tier(s12, "used_bytes", "host") == tier(s12, "blocks", "host") * BB

    # Restart on the same folder: the SSD figures are the index's, before and after
    c.close()
    d.stop()
    n_rec, nbytes = ssd_truth(d.data_dir)
    assert (n_rec, nbytes) == (tier(s12, "blocks", "ssd"), tier(s12, "used_bytes", "ssd"))
    d.start()
    s13 = scrape(d)[0]                      # a new run: its counters start again at 0
    assert (tier(s13, "blocks", "ssd"), tier(s13, "used_bytes", "ssd")) == (n_rec, nbytes)
    assert tier(s13, "blocks", "host") == 0 and tier(s13, "used_bytes", "host") == 0
    assert v(s13, "kvstore_blocks") == n_rec and v(s13, "kvstore_active_leases") == 0
    with connect(d.address) as c2:
        r = c2.namespace(LAYOUT, model="truth/a").lookup_result(keys)
        assert r.per_tier == {"host": 0, "ssd": 5}


@pytest.mark.redis
def test_every_series_is_in_the_readme_table_and_back(tmp_path: Path, redis_server) -> None:
    """Every tier on (gpu on the CPU device, host, SSD, remote) and per-tenant series: each
    exported family is in README's table with its type and labels, and each documented one is
    exported, from the first scrape on for the store's levels.

    Failed before: kvstore_gpu_device_stored (and evictions, demotions, bytes_in, ...) were
    gauges without `_total` and no kvstore_gpu_device_* was documented; the documented gauges
    kvstore_expired_write_slots_held and kvstore_remote_deletes_waiting were absent."""
    import torch  # noqa: F401  (DeviceKV's cache)
    from kvstore_client.device_kv import DeviceKV

    from tests.test_gpu_tier_cpu import LAYOUT as GPU_LAYOUT
    from tests.test_gpu_tier_cpu import engine_cache, keys_for

    tf = tmp_path / "tenants.toml"
    tf.write_text(f'[tenants.root]\ntoken_sha256 = "{hash_token("root-token")}"\nadmin = true\n')
    d = start_daemon(tmp_path, {"auth.tokens_file": str(tf), "server.metrics_tenants": True,
                                "remote.enabled": True, "remote.urls": redis_server.url,
                                "remote.deadline_ms": 2000, "gpu.enabled": True,
                                "gpu.backend": "cpu", "gpu.capacity": "1MiB"})
    try:
        first, _ = scrape(d)
        assert v(first, "kvstore_expired_write_slots_held") == 0
        assert v(first, "kvstore_remote_deletes_waiting") == 0
        with connect(d.address, token="root-token", transport="shm") as c:
            ns = c.namespace(LAYOUT, model="truth/names")
            ns.store(np.arange(4 * T), kv(4, 1))
            c.evict("host")
            out = np.zeros_like(kv(4, 1))
            assert ns.load(np.arange(4 * T), out) == 4 * T
            gns = c.namespace(GPU_LAYOUT, model="truth/gpu")
            _, cache = engine_cache(8, seed=11)
            assert DeviceKV(gns, cache).store_keys(keys_for(gns, 1, 4), [3, 0, 5, 1]) == 4
            c.evict("gpu")
        vals, types = scrape(d)
    finally:
        cleanup(d)
    table, have = readme_table(), exported(vals, types)
    # The catch-all for counters without a metric of their own stays empty: every counter
    # this workload touches has its name (a new one shows up here first).
    assert table.pop("kvstore_store_events_total", None) == ("counter", frozenset({"name"}))
    assert "kvstore_store_events_total" not in have, [
        lb for n, lb in vals if n == "kvstore_store_events_total"]
    assert not set(have) - set(table), f"exported, not in README: {sorted(set(have) - set(table))}"
    assert not set(table) - set(have), f"in README, not exported: {sorted(set(table) - set(have))}"
    differ = {k: (table[k], have[k]) for k in table if table[k] != have[k]}
    assert not differ, f"README (type, labels) vs exported: {differ}"
    # each device's counts add up to the gpu tier's
    for field in ("stored", "evictions", "demotions"):
        assert v(vals, f"kvstore_gpu_device_{field}_total", device="0", kind="cpu") == \
            tier(vals, field, "gpu") == 4, field


@pytest.mark.redis
def test_remote_bytes_deleted_counts_what_redis_gave_back(tmp_path: Path, redis_server) -> None:
    """Delete of blocks held in Redis: keys_deleted and bytes_deleted equal what Redis held.

    Failed before: the daemon's deletes passed no sizes to the remote tier, which then left
    bytes_deleted at 0 for ever (and RemoteTier.used_bytes only grew)."""
    d = start_daemon(tmp_path, {"ssd.enabled": False, "remote.enabled": True,
                                "remote.urls": redis_server.url, "remote.deadline_ms": 2000})
    r = redis_server.client()
    try:
        with connect(d.address) as c:
            ns = c.namespace(LAYOUT, model="truth/remote")
            toks = np.arange(6 * T)
            assert ns.store(toks, kv(6, 1)) == 6
            c.evict("host")
            vals, _ = scrape(d)
            stored = list(r.scan_iter(match=b"kvs:*"))
            held = sum(r.strlen(k) for k in stored)
            assert tier(vals, "blocks", "remote") == len(stored) == 6
            assert v(vals, "kvstore_remote_events_total", event="bytes_written") == held
            assert tier(vals, "used_bytes", "remote") == 6 * BB      # raw, as documented
            assert ns.delete(ns.keys(toks)) == 6
        end = time.monotonic() + DEADLINE_S
        while (vals := scrape(d)[0])[
                "kvstore_remote_events_total", frozenset({("event", "keys_deleted")})] < 6:
            assert time.monotonic() < end, "the remote deletes never landed"
            time.sleep(0.2)
        assert not list(r.scan_iter(match=b"kvs:*"))
        assert v(vals, "kvstore_remote_events_total", event="bytes_deleted") == held
        assert tier(vals, "blocks", "remote") == 0 and tier(vals, "used_bytes", "remote") == 0
    finally:
        cleanup(d)
