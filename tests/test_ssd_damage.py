"""Damaged SSD records: a start goes on, a damaged block is a miss and is dropped, and nothing
else is lost; Stats and metrics never wait for the SSD filesystem.

- One damaged LMDB record (a block's msgpack meta, a namespace's JSON) used to stop the daemon
  from starting (a traceback, exit 1; the only way back was to delete the SSD folder). Now it
  is skipped, counted and logged once, and every intact block is served bit-exact; a file
  LMDB itself finds damaged is refused in one line naming it (kvstore/opening.py).
- A damaged record length was trusted: a Get allocated it (1 GiB) or failed for good (16
  TiB), and the record could never be deleted. Now it is a miss before anything is allocated,
  and deletes and evictions of it succeed with used bytes kept sane (tiers/ssd/tier.py).
- Stats and every metrics scrape read LMDB (a read transaction, which py-lmdb begins holding
  the GIL: on a frozen filesystem the whole daemon stalled). Now they read counts the tier
  keeps in memory (tiers/ssd/index.py).

The records are damaged with the lmdb module on the daemon's own folder, as a disk or a stray
write would leave them.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import struct
from contextlib import contextmanager
from pathlib import Path

import lmdb
import numpy as np
import pytest
from kvstore_client import connect
from kvstore_client.errors import DataLoss

from kvstore.metrics import StoreCollector
from tests.daemon import DaemonError, cleanup, start_daemon
from tests.store_helpers import SMALL, kv_block, make_store, namespace, random_prompt
from tests.test_crash import LAYOUT, prompt_kv
from tiers.ssd import SSDTier, extent_size

REC = struct.Struct("<QQQ")         # an SSD record: offset, value length, checksum; then meta
MIB = 1 << 20


def served(ns, keys: list[bytes]) -> int:
    """How many leading blocks of `keys` a load serves; fails on a single wrong byte."""
    want = prompt_kv(keys)
    out = np.zeros_like(want)
    n = ns.load_keys(keys, out)
    T = LAYOUT.block_tokens
    assert np.array_equal(out[:, :, :n * T].view(np.uint16), want[:, :, :n * T].view(np.uint16)
                          ), "a block was served with bytes other than the ones stored"
    return n


def store_chains(address: str, models: list[str], chains: int = 4, blocks: int = 4
                 ) -> dict[str, tuple[bytes, list[list[bytes]]]]:
    """Chains of blocks in a namespace per model, flushed to SSD: {model: (ns_id, chains)}.
    The keys are a function of the model and the position (the same LMDB every run)."""
    out = {}
    with connect(address) as c:
        for model in models:
            ns = c.namespace(LAYOUT, model=model)
            keys = [[hashlib.blake2b(f"{model}/{i}/{j}".encode(), digest_size=16).digest()
                     for j in range(blocks)] for i in range(chains)]
            for ks in keys:
                ns.store_keys(ks, prompt_kv(ks))
            out[model] = (ns.ns_id, keys)
        c.flush()
    return out


@contextmanager
def lmdb_of(data_dir: Path):
    """The SSD tier's LMDB environment (the daemon stopped, or running: LMDB allows a second
    process) and its block and namespace databases."""
    env = lmdb.open(str(data_dir / "ssd" / "index"), subdir=True, max_dbs=8)
    try:
        yield env, env.open_db(b"index"), env.open_db(b"namespaces")
    finally:
        env.close()


def test_damaged_meta_and_namespace_records_are_skipped_and_the_rest_served(tmp_path):
    d = start_daemon(tmp_path, {"ssd.capacity": "64MiB"})
    try:
        stored = store_chains(d.address, ["intact", "damaged-ns"])
        ns_a, chains_a = stored["intact"]
        ns_b, chains_b = stored["damaged-ns"]
        d.stop()
        bad_key = ns_a + chains_a[0][1]             # block 1 of the first chain
        with lmdb_of(d.data_dir) as (env, blocks, nss), env.begin(write=True) as txn:
            raw = txn.get(bad_key, db=blocks)
            assert raw is not None, "the block is not on SSD: the test proves nothing"
            txn.put(bad_key, raw[:REC.size] + b"\xc1" * 8, db=blocks)   # 0xc1: never msgpack
            txn.put(ns_b, b"\xff" * 8 + txn.get(ns_b, db=nss)[8:], db=nss)
        d.start()                                   # used to exit 1 with a traceback
        log = d.output()
        assert "Traceback" not in log
        warnings = [line for line in log.splitlines() if "WARNING" in line and "damaged" in line]
        assert len(warnings) == 1, warnings     # one line with the counts, not one a record
        assert "1 damaged namespace record" in warnings[0]
        assert "1 damaged block record" in warnings[0]
        with connect(d.address) as c:
            a = c.namespace(LAYOUT, model="intact")
            b = c.namespace(LAYOUT, model="damaged-ns")     # registered again: a new record
            assert served(a, chains_a[0]) == 1      # the damaged block is a miss
            assert served(a, chains_a[0][1:2]) == 0
            for keys in chains_a[1:]:
                assert served(a, keys) == len(keys)
            for keys in chains_b:                   # not indexed until the next start
                assert served(b, keys) == 0
            assert c.stats()["counters"]["ssd_damaged_records"] == 2
        d.stop()
        with lmdb_of(d.data_dir) as (env, blocks, _), env.begin() as txn:
            assert txn.get(bad_key, db=blocks) is None, "the damaged record was kept"
        d.start()           # no index image was written: this start scans and finds them
        assert not [line for line in d.output().splitlines() if "WARNING" in line]
        with connect(d.address) as c:
            a = c.namespace(LAYOUT, model="intact")
            b = c.namespace(LAYOUT, model="damaged-ns")
            for keys in chains_b:
                assert served(b, keys) == len(keys)
            for keys in chains_a[1:]:
                assert served(a, keys) == len(keys)
            assert served(a, chains_a[0]) == 1
    finally:
        cleanup(d)


def test_random_bit_flips_in_lmdb_never_serve_wrong_bytes_nor_stop_with_a_traceback(tmp_path):
    """32 bits flipped anywhere past LMDB's meta pages, per seed: the daemon starts and serves
    only bytes that were stored (what the flips damaged is a miss), or refuses to start in one
    line naming the damaged file. It used to exit with a traceback on a damaged record."""
    d = start_daemon(tmp_path, {"ssd.capacity": "64MiB"})
    try:
        stored = store_chains(d.address, ["a", "b"], chains=8)
        d.stop()
        clean = tmp_path / "clean"
        clean.mkdir()
        os.rename(d.data_dir / "ssd", clean / "ssd")
        for seed in (1, 14, 18):
            shutil.rmtree(d.data_dir / "ssd", ignore_errors=True)
            shutil.copytree(clean / "ssd", d.data_dir / "ssd")
            mdb = d.data_dir / "ssd" / "index" / "data.mdb"
            rng = random.Random(seed)
            fd = os.open(mdb, os.O_RDWR)
            try:
                size = os.fstat(fd).st_size
                for _ in range(32):
                    at = rng.randrange(8192, size)
                    os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 1 << rng.randrange(8)]), at)
            finally:
                os.close(fd)
            try:
                d.start()
            except DaemonError:
                assert d.proc.returncode == 1
                log = d.output()
                assert "Traceback" not in log, log
                assert len([x for x in log.splitlines() if "data.mdb is damaged" in x]) == 1, log
                continue
            with connect(d.address) as c:
                for model, (_, chains) in stored.items():
                    ns = c.namespace(LAYOUT, model=model)
                    for keys in chains:
                        served(ns, keys)            # asserts every byte it serves
            assert d.alive() and "Traceback" not in d.output()
            d.kill()
    finally:
        cleanup(d)


def test_a_file_lmdb_finds_damaged_is_refused_in_one_line(tmp_path):
    d = start_daemon(tmp_path, {"ssd.capacity": "64MiB"})
    try:
        store_chains(d.address, ["m"], chains=2)
        d.stop()
        mdb = d.data_dir / "ssd" / "index" / "data.mdb"
        fd = os.open(mdb, os.O_RDWR)
        try:
            for page in range(2, os.fstat(fd).st_size // 4096):     # past the meta pages
                os.pwrite(fd, b"\xff\xff", page * 4096 + 10)        # page flags: no type
        finally:
            os.close(fd)
        with pytest.raises(DaemonError) as err:
            d.start()
        assert d.proc.returncode == 1
        log = d.output()
        assert "Traceback" not in log
        lines = [line for line in log.splitlines() if "data.mdb is damaged" in line]
        assert len(lines) == 1, log
        assert "cannot open the store" in lines[0] and "move" in lines[0], lines[0]
        assert str(err.value)
    finally:
        cleanup(d)


def test_a_damaged_length_is_a_miss_and_can_be_evicted_live(tmp_path):
    """Set while the daemon runs: a 1 GiB length made the Get fail INTERNAL after allocating
    1 GiB (kept per thread), a 16 TiB one failed every Get of the chain for good."""
    d = start_daemon(tmp_path, {"host.capacity": "8MiB", "ssd.capacity": "64MiB"})
    try:
        ns_id, chains = store_chains(d.address, ["m"])["m"]
        with connect(d.address) as c:
            c.evict("host")                         # the chains are on SSD only
        with lmdb_of(d.data_dir) as (env, blocks, _), env.begin(write=True) as txn:
            for chain, length in ((chains[0], 1 << 30), (chains[1], 1 << 44)):
                k = ns_id + chain[1]
                raw = txn.get(k, db=blocks)
                off, _, checksum = REC.unpack_from(raw)
                txn.put(k, REC.pack(off, length, checksum) + raw[REC.size:], db=blocks)
        rss_before = _rss(d.proc.pid)
        with connect(d.address) as c:
            ns = c.namespace(LAYOUT, model="m")
            for _ in range(2):                      # the second time: dropped, a plain miss
                assert served(ns, chains[0]) == 1
                assert served(ns, chains[1]) == 1
            for keys in chains[2:]:
                assert served(ns, keys) == len(keys)
            assert _rss(d.proc.pid) - rss_before < 256 * MIB
            assert c.stats()["counters"]["corrupt_blocks"] >= 2
            c.evict("host")
            c.evict("ssd")                          # every record deleted, none refused
            ssd = c.stats()["tiers"]["ssd"]
            assert ssd["blocks"] == 0
            # The damaged records' true lengths are unknown: not subtracted, never negative.
            assert 0 <= ssd["used_bytes"] <= 2 * (LAYOUT.block_bytes + 4096)
        assert d.alive()
        assert "Traceback" not in d.output()
        d.kill()
        d.start()                                   # a scan recounts the used bytes exactly
        with connect(d.address) as c:
            assert c.stats()["tiers"]["ssd"]["used_bytes"] == 0
    finally:
        cleanup(d)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    return 0


# -- the SSD tier on its own ------------------------------------------------------------------
def _k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _val(i: int, n: int = 20000) -> bytes:
    return np.random.default_rng(i).bytes(n)


def _set_length(t: SSDTier, k: bytes, length: int) -> None:
    """Rewrite a stored record's length in place (what a flipped bit on disk leaves)."""
    with t._index._env.begin(write=True) as txn:
        raw = txn.get(k, db=t._index.blocks)
        off, _, checksum = REC.unpack_from(raw)
        txn.put(k, REC.pack(off, length, checksum) + raw[REC.size:], db=t._index.blocks)


@pytest.mark.parametrize("length", [1 << 30, 1 << 44, 20000 * 3])
def test_damaged_length_is_data_loss_and_the_record_deletes(tmp_path, length):
    t = SSDTier(str(tmp_path / "ssd"), 64 * MIB)
    try:
        t.put_many([(_k(i), _val(i), b"m") for i in range(6)])
        _set_length(t, _k(2), length)
        reads = []
        real_read = t._payload.read
        t._payload.read = lambda off, n: reads.append(n) or real_read(off, n)
        with pytest.raises(DataLoss):
            t.get(_k(2))
        got = t.visit_many([_k(1), _k(2), _k(3)], lambda i, v: None)
        assert got[0] is True and isinstance(got[1], DataLoss) and got[2] is True
        # Nothing was read or allocated for a length past the payload file's end.
        assert max(reads) < MIB, reads
        assert t.delete_sized([_k(2)]) in (0, extent_size(length))  # true length unknown
        assert 0 <= t.used_bytes <= 6 * extent_size(20000)
        assert len(t) == 5
        t.put(_k(3), _val(33), b"m")                    # overwrites and deletes still count
        assert t.delete_many([_k(4)]) == 1
        assert [t.get(_k(i)) for i in (0, 1, 3, 5)] == [_val(0), _val(1), _val(33), _val(5)]
    finally:
        t.close()


def test_a_length_beyond_what_its_block_can_be_is_refused_before_reading(tmp_path):
    t = SSDTier(str(tmp_path / "ssd"), 64 * MIB, value_limit=lambda gkey, meta: 30000)
    try:
        t.put_many([(_k(i), _val(i), b"m") for i in range(4)])
        _set_length(t, _k(1), 1 << 20)              # inside the payload file, past the limit
        reads = []
        real_read = t._payload.read
        t._payload.read = lambda off, n: reads.append(n) or real_read(off, n)
        with pytest.raises(DataLoss, match="more than its block can take"):
            t.get(_k(1))
        assert reads == []
        assert t.get(_k(0)) == _val(0)
    finally:
        t.close()


def test_reopen_drops_records_naming_impossible_extents_and_keeps_the_rest(tmp_path):
    """A scan of the index at open (no index image): a length past the file, a length that
    overlaps the next value's extent, a record too short to name one. The damaged are deleted,
    their neighbours kept and served, used bytes recounted, and new writes never land on a
    kept value."""
    path = str(tmp_path / "ssd")
    t = SSDTier(path, 64 * MIB)
    t.put_many([(_k(i), _val(i), b"m") for i in range(8)])
    t.close()
    env = lmdb.open(os.path.join(path, "index"), subdir=True, max_dbs=8)
    try:
        blocks = env.open_db(b"index")
        with env.begin(write=True) as txn:
            for i, length in ((1, 1 << 40), (4, 20000 * 3)):
                raw = txn.get(_k(i), db=blocks)
                off, _, checksum = REC.unpack_from(raw)
                txn.put(_k(i), REC.pack(off, length, checksum) + raw[REC.size:], db=blocks)
            txn.put(_k(6), b"\x01\x02", db=blocks)
    finally:
        env.close()
    t = SSDTier(path, 64 * MIB)                     # the token changed: a scan, no image
    try:
        assert t.dropped_at_open == 3
        assert len(t) == 5
        assert t.used_bytes == 5 * extent_size(20000)
        for i in (1, 4, 6):
            assert t.get(_k(i)) is None
        t.put_many([(_k(100 + i), _val(100 + i), b"m") for i in range(8)])
        for i in (0, 2, 3, 5, 7):
            assert t.get(_k(i)) == _val(i)
        for i in range(8):
            assert t.get(_k(100 + i)) == _val(100 + i)
    finally:
        t.close()


def test_eviction_of_a_damaged_record_succeeds(tmp_path):
    """In the store: the oldest SSD block's length damaged (bit 30); evicting the SSD tier,
    whose batches pick it first, used to fail every time (used bytes went negative)."""
    s = make_store(tmp_path, host_capacity=64 * SMALL.block_bytes)
    try:
        ns = namespace(s)
        rng = np.random.default_rng(3)
        prompts = []
        for _ in range(6):
            _, keys = random_prompt(rng, 4)
            s.put(ns, keys, [kv_block(k) for k in keys])
            prompts.append(keys)
        s.flush()
        s.evict("host")
        g = ns + prompts[0][0]
        raw_len = s.ssd.size_of(g)
        _set_length(s.ssd, g, raw_len ^ (1 << 30))
        assert s.get(ns, prompts[1]) == [(k, kv_block(k)) for k in prompts[1]]
        s.evict("ssd")
        assert len(s.ssd) == 0
        assert 0 <= s.ssd.used_bytes <= extent_size(raw_len)
        assert s.get(ns, prompts[0]) == []
    finally:
        s.close(flush=False)


# -- Stats and metrics never read LMDB ------------------------------------------------------
class _CountingEnv:
    """Stands in for the SSD tier's LMDB environment, counting the transactions begun."""

    def __init__(self, env: lmdb.Environment) -> None:
        self.env = env
        self.begun = 0

    def begin(self, *args, **kwargs):
        self.begun += 1
        return self.env.begin(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.env, name)


def test_stats_and_metrics_scrapes_open_no_lmdb_transaction(tmp_path):
    """A read transaction writes LMDB's reader table holding the GIL: on a frozen SSD
    filesystem, one Stats call or scrape stalled every thread of the daemon (3-5 s)."""
    s = make_store(tmp_path, host_capacity=16 * SMALL.block_bytes)
    try:
        ns = namespace(s)
        rng = np.random.default_rng(4)
        for _ in range(8):
            _, keys = random_prompt(rng, 4)
            s.put(ns, keys, [kv_block(k) for k in keys])
        s.flush()
        s.delete(ns, keys[2:])
        index = s.ssd._index
        real = index._env
        counting = index._env = _CountingEnv(real)
        try:
            stats = s.stats()
            families = list(StoreCollector(s).collect())
        finally:
            index._env = real
        assert counting.begun == 0, "Stats or a metrics scrape began an LMDB transaction"
        assert families
        with real.begin() as txn:                   # the counts read are LMDB's own
            assert stats["tiers"]["ssd"]["blocks"] == txn.stat(index.blocks)["entries"]
            used = sum(extent_size(REC.unpack_from(v)[1])
                       for _, v in txn.cursor(db=index.blocks))
        assert stats["tiers"]["ssd"]["blocks"] > 0
        assert stats["tiers"]["ssd"]["used_bytes"] == used
    finally:
        s.close(flush=False)
