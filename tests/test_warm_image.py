"""The SSD index image (tiers/ssd/image.py, kvstore/warm_image.py): a restart from it rebuilds
exactly what the scan of LMDB rebuilds, and an image that is stale (LMDB written since, a kill
-9 after writing), corrupt, truncated or from another stop is never used."""

from __future__ import annotations

import json
import logging
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from kvstore_client import connect

from kvstore import warm_image
from kvstore.store import Store
from tests.daemon import cleanup, start_daemon
from tests.store_helpers import SMALL, kv_block, make_store, namespace, random_prompt
from tiers.slab import ExtentAllocator
from tiers.ssd import SSDTier
from tiers.ssd import image as ssd_image
from tiers.ssd.image import NAME

ROOT = Path(__file__).resolve().parent.parent


def _fill(store: Store, ns: bytes, rng: np.random.Generator, prompts: int, blocks: int
          ) -> list[list[bytes]]:
    out = []
    for _ in range(prompts):
        _, keys = random_prompt(rng, blocks)
        store.put(ns, keys, [kv_block(k) for k in keys])
        out.append(keys)
    store.flush()
    return out


def _state(store: Store) -> tuple:
    """Everything a restart rebuilds, in comparable form; drains the SSD policy (last)."""
    idx = store.index
    blocks = {}
    for g in list(idx._rows):
        e = idx.read(g)
        blocks[g] = (e.size, e.checksum, e.parent_gkey, e.children, e.ssd)
    ssd = store.ssd
    alloc = ssd._payload.alloc
    free = sum(alloc._free.values())    # the image keeps free extents as they were; the scan
                                        # rebuilds each gap as one: the same free bytes
    pol = store.policies["ssd"]
    order = []
    while (v := pol.pick(lambda g: True)) is not None:
        order.append(v)
        pol.remove(v)
    return (blocks, dict(idx._awaited), sorted(store.namespaces), len(ssd), ssd.used_bytes,
            dict(alloc._used), free, alloc.top, order)


def _open_both(tmp_path: Path, **kw) -> tuple[Store, Store]:
    """The same folder opened from its image and (a copy without the image) by the scan."""
    scan = tmp_path / "scan"
    shutil.copytree(tmp_path / "data", scan / "data")
    (scan / "data" / "ssd" / NAME).unlink()
    return make_store(tmp_path, **kw), make_store(scan, **kw)


def _loaded_from_image(caplog: pytest.LogCaptureFixture) -> bool:
    return any("loaded the index image" in r.getMessage() for r in caplog.records)


def test_restart_from_the_image_equals_the_scan(tmp_path, caplog):
    """Chains, a second namespace, deletes (free rows and extents), a parent deleted under its
    children (awaited parents), host evictions (ghost keys): image and scan agree on every
    block, the namespaces, the free-space map and the SSD policy's whole eviction order."""
    caplog.set_level(logging.INFO, logger="kvstore.store")
    rng = np.random.default_rng(5)
    s = make_store(tmp_path, host_capacity=40 * SMALL.block_bytes)
    ns, ns2 = namespace(s), namespace(s, model="other")
    prompts = _fill(s, ns, rng, 12, 6) + _fill(s, ns2, rng, 3, 4)
    s.delete(ns, prompts[0][:2] + prompts[3])           # free rows and extents
    _, orphans = random_prompt(rng, 3)                  # a parent never stored (awaited)
    s.put(ns, orphans, [kv_block(k) for k in orphans], parent=rng.bytes(16))
    s.evict("ssd", 8 * SMALL.block_bytes)               # ghost history
    _fill(s, ns, rng, 2, 5)
    s.close()
    assert (tmp_path / "data" / "ssd" / NAME).exists()
    caplog.clear()
    a, b = _open_both(tmp_path, host_capacity=40 * SMALL.block_bytes)
    try:
        assert _loaded_from_image(caplog)
        assert b.ssd._image is None                      # the copy without it scanned
        sa, sb = _state(a), _state(b)
        assert sa[0] and sa[1], "the fixture must have blocks and awaited parents"
        assert sa[-1], "the SSD policy held nothing to compare"
        assert sa == sb
    finally:
        a.close(flush=False)
        b.close(flush=False)


def test_blocks_are_served_byte_exact_after_a_restart_from_the_image(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kvstore.store")
    rng = np.random.default_rng(6)
    s = make_store(tmp_path)
    ns = namespace(s)
    prompts = _fill(s, ns, rng, 8, 5)
    s.close()
    caplog.clear()
    s = make_store(tmp_path)
    try:
        assert _loaded_from_image(caplog)
        # the rows' child links (kvstore/index.py, followed by lookups) came back too
        assert sum(1 for f in s.index._flags if f & ~7) >= sum(len(k) - 1 for k in prompts)
        for keys in prompts:
            assert s.lookup(ns, keys).prefix_blocks == len(keys)
            assert s.get(ns, keys) == [(k, kv_block(k)) for k in keys]
        more = _fill(s, ns, rng, 2, 5)                   # writes after an image load
        s.evict("ssd")                                   # and the policy still frees all
        assert len(s.ssd) == 0 and len(s.policies["ssd"]) == 0
        for keys in more:                                # still on host
            assert s.get(ns, keys) == [(k, kv_block(k)) for k in keys]
    finally:
        s.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "other_stop", "lmdb_written",
                                    "meta_rewritten"])
def test_a_damaged_or_stale_image_is_ignored(tmp_path, caplog, damage):
    """Each kind of bad image makes the restart scan; what it serves is what was stored."""
    caplog.set_level(logging.INFO, logger="kvstore.store")
    rng = np.random.default_rng(7)
    s = make_store(tmp_path)
    ns = namespace(s)
    prompts = _fill(s, ns, rng, 6, 4)
    s.close()
    img = tmp_path / "data" / "ssd" / NAME
    if damage == "flip":
        raw = bytearray(img.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        img.write_bytes(bytes(raw))
    elif damage == "truncate":
        img.write_bytes(img.read_bytes()[:-100])
    elif damage == "other_stop":                        # an older stop's image put back
        old = img.read_bytes()
        s = make_store(tmp_path)
        prompts += _fill(s, ns, rng, 2, 4)
        s.close()
        img.write_bytes(old)
    elif damage == "lmdb_written":                      # another program wrote to LMDB
        t = SSDTier(str(tmp_path / "data" / "ssd"), 64 << 20)
        t.delete_many([ns + prompts[0][-1]])
        t.close()
        prompts[0] = prompts[0][:-1]
    else:           # same record count and bytes, one record's meta changed: only LMDB's
        t = SSDTier(str(tmp_path / "data" / "ssd"), 64 << 20)  # transaction id tells
        g = ns + prompts[1][0]
        t.set_meta(g, t.get_meta(g))
        t.close()
    caplog.clear()
    s = make_store(tmp_path)
    try:
        assert not _loaded_from_image(caplog)
        assert len(s.index) == sum(map(len, prompts)) == len(s.ssd)
        for keys in prompts:
            assert s.get(ns, keys) == [(k, kv_block(k)) for k in keys]
    finally:
        s.close(flush=False)


def test_an_image_is_not_trusted_after_a_crash(tmp_path, caplog):
    """Opened from its image, written to, then gone without close (as kill -9): the next
    open scans and finds the blocks written after the image."""
    caplog.set_level(logging.INFO, logger="kvstore.store")
    rng = np.random.default_rng(8)
    s = make_store(tmp_path)
    ns = namespace(s)
    before = _fill(s, ns, rng, 4, 4)
    s.close()
    script = textwrap.dedent(f"""
        import os, sys
        import numpy as np
        from tests.store_helpers import make_store, namespace, kv_block, random_prompt
        from pathlib import Path
        s = make_store(Path({str(tmp_path)!r}))
        assert s.ssd._image is not None, "the clean stop's image was not used"
        ns = namespace(s)
        _, keys = random_prompt(np.random.default_rng(9), 4)
        s.put(ns, keys, [kv_block(k) for k in keys])
        s.flush()
        sys.stdout.write(b"".join(keys).hex())
        sys.stdout.flush()
        os._exit(0)
    """)
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    raw = bytes.fromhex(res.stdout)
    after = [raw[i:i + 16] for i in range(0, len(raw), 16)]
    assert (tmp_path / "data" / "ssd" / NAME).exists()    # left behind, stale
    caplog.clear()
    s = make_store(tmp_path)
    try:
        assert not _loaded_from_image(caplog)
        for keys in before + [after]:
            assert s.get(ns, keys) == [(k, kv_block(k)) for k in keys]
    finally:
        s.close(flush=False)


def _rewrite_section(folder: Path, name: str, blob: bytes) -> None:
    """Replace one section of a current image, keeping its stamp (so it still passes the
    stamp and checksum checks): a section whose own content is inconsistent."""
    raw = (folder / NAME).read_bytes()
    head = len(ssd_image.MAGIC) + 4
    (hlen,) = struct.unpack_from("<I", raw, len(ssd_image.MAGIC))
    meta = json.loads(raw[head:head + hlen])
    stamp = ssd_image.Stamp(bytes.fromhex(meta["token"]), meta["txnid"], meta["entries"],
                            meta["used_bytes"])
    sections = ssd_image.read_image(str(folder), stamp)
    assert sections is not None
    sections[name] = blob
    ssd_image.write_image(str(folder), stamp, sections)


@pytest.mark.parametrize("section", [warm_image.INDEX, warm_image.POLICY])
def test_a_section_that_does_not_fit_falls_back_to_the_scan(tmp_path, caplog, section):
    """A policy naming blocks the index section lacks, or a section that is not ours: the
    store scans instead, and serves every block."""
    caplog.set_level(logging.INFO, logger="kvstore.store")
    rng = np.random.default_rng(10)
    small = make_store(tmp_path / "small")
    _fill(small, namespace(small), rng, 1, 2)
    smaller = warm_image.dump(small.index, small.policies["ssd"], set(small.namespaces))
    small.close(flush=False)
    s = make_store(tmp_path)
    ns = namespace(s)
    prompts = _fill(s, ns, rng, 5, 4)
    s.close()
    _rewrite_section(tmp_path / "data" / "ssd", section,
                     smaller[warm_image.INDEX] if section == warm_image.INDEX else b"\x93junk")
    caplog.clear()
    s = make_store(tmp_path)
    try:
        assert not _loaded_from_image(caplog)
        assert any("ignoring the SSD index image" in r.getMessage() for r in caplog.records)
        assert len(s.index) == sum(map(len, prompts)) == len(s.policies["ssd"])
        for keys in prompts:
            assert s.get(ns, keys) == [(k, kv_block(k)) for k in keys]
    finally:
        s.close(flush=False)


def test_allocator_state_round_trips_and_refuses_nonsense():
    a = ExtentAllocator(1 << 20, 4096)
    offs = [a.alloc(n) for n in (4096, 8192, 4096, 12288, 4096)]
    a.free(offs[1])
    a.free(offs[3])
    b = ExtentAllocator.from_state(a.state())
    assert (b._used, b._free, b.top, b.used_bytes) == (a._used, a._free, a.top, a.used_bytes)
    assert [b.alloc(8192), b.alloc(12288)] == [a.alloc(8192), a.alloc(12288)]
    bad = a.state()
    bad["used_bytes"] += 4096
    with pytest.raises(ValueError):
        ExtentAllocator.from_state(bad)
    bad = a.state()
    bad["free_off"] = bad["used_off"][:8]            # a free extent that is also allocated
    bad["free_size"] = bad["used_size"][:8]
    lazy = ExtentAllocator.from_state(bad)          # the used map is built on first use
    with pytest.raises(ValueError):
        lazy.alloc(4096)
    with pytest.raises(ValueError):                 # and refuses every use after, too
        lazy.free(offs[0])


def test_daemon_restarts_from_its_image_and_not_after_kill_9(tmp_path):
    """The real daemon: a clean stop leaves an image the next start uses; after writes and
    a kill -9 the next start scans; bytes are exact either way."""
    d = start_daemon(tmp_path, {"host.capacity": "4MiB", "ssd.capacity": "128MiB"})
    rng = np.random.default_rng(11)
    layout = SMALL
    try:
        def store(c, n):
            ns = c.namespace(layout, model="image")
            keys = [rng.bytes(16) for _ in range(n)]
            ns.store_keys(keys, np.concatenate([np.frombuffer(kv_block(k), np.float16).reshape(
                layout.num_layers, 2, layout.block_tokens, layout.num_kv_heads,
                layout.head_dim) for k in keys], axis=2))
            return keys

        def check(keys):
            with connect(d.address) as c:
                ns = c.namespace(layout, model="image")
                want = np.concatenate([np.frombuffer(kv_block(k), np.float16).reshape(
                    layout.num_layers, 2, layout.block_tokens, layout.num_kv_heads,
                    layout.head_dim) for k in keys], axis=2)
                got = np.zeros_like(want)
                assert ns.load_keys(keys, got) == len(keys)
                assert np.array_equal(got.view(np.uint16), want.view(np.uint16))

        with connect(d.address) as c:
            first = store(c, 40)
            c.flush()
        d.restart()
        assert "loaded the index image: 40 blocks" in d.output()
        check(first)
        with connect(d.address) as c:
            second = store(c, 10)
            c.flush()
        d.kill()
        d.start()
        assert "loaded the index image" not in d.output()
        assert "rebuilt the index: 50 blocks" in d.output()
        check(first + second)
    finally:
        cleanup(d)


def test_the_daemon_is_serving_before_numpy_prometheus_or_the_sdk_load(tmp_path):
    """What the daemon imports before SERVING (default config, no metrics endpoint): none of
    the heavy modules a data call or an HTTP scrape needs (start time)."""
    script = textwrap.dedent(f"""
        import sys
        from kvstore.config import StoreConfig
        from kvstore.daemon import Daemon
        cfg = StoreConfig(data_dir={str(tmp_path / "data")!r})
        cfg.server.tcp = cfg.server.metrics = ""
        cfg.server.socket = {str(tmp_path / "s.sock")!r}
        cfg.host.capacity = 64 << 20
        d = Daemon(cfg)
        d.start()
        loaded = [m for m in ("numpy", "prometheus_client", "kvstore_client.client",
                              "kvstore_client.namespace", "tiers.codecs", "zstandard",
                              "multiprocessing.resource_tracker") if m in sys.modules]
        d.request_stop()
        d.shutdown()
        print("LOADED", loaded)
    """)
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "LOADED []" in res.stdout, res.stdout + res.stderr


def test_sdk_names_resolve_lazily():
    script = ("import sys, kvstore_client.errors as e; assert 'numpy' not in sys.modules; "
              "import kvstore_client as k; assert k.connect and k.KVLayout and k.NotFound "
              "is e.NotFound and sorted(k.__all__) == sorted(k._WHERE); "
              "print(all(getattr(k, n) is not None for n in k.__all__))")
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "True", res.stderr
