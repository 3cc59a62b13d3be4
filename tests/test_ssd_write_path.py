"""The SSD write path: SSDTier.put_filled, the encode-or-store-raw choice, and the store's
demotion through both (real payload file, real LMDB, real host slab)."""

from __future__ import annotations

import errno
import time

import numpy as np
import pytest
from kvstore_client import KVLayout
from kvstore_client.errors import DataLoss, InvalidArgument

from kvstore.config import ConfigError, StoreConfig
from kvstore.encode_choice import EncodeChoice
from tiers import frame
from tiers.ssd import SSDTier, extent_size

from .store_helpers import kv_block, make_store, namespace, random_prompt

MIB = 1 << 20
LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, block_tokens=16, dtype="bfloat16")


def k(i: int) -> bytes:
    return b"W" * 16 + i.to_bytes(16, "big")


def val(i: int, n: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture
def ssd(tmp_path):
    t = SSDTier(str(tmp_path / "ssd"), capacity=256 * MIB)
    yield t
    t.close()


def _fill_from(values: list[bytes], refuse: set[int] = frozenset()):
    def fill(i: int, dst: memoryview) -> bool:
        dst[:] = values[i]
        return i not in refuse
    return fill


def test_put_filled_stores_what_fill_wrote_and_leaves_out_refused_values(ssd):
    values = [val(i, 100_000 + i) for i in range(6)]
    got = ssd.put_filled([(k(i), len(v), b"m%d" % i) for i, v in enumerate(values)],
                         _fill_from(values, refuse={1, 4}))
    assert got == [True, False, True, True, False, True]
    for i, v in enumerate(values):
        if i in (1, 4):
            assert ssd.get(k(i)) is None
        else:
            assert ssd.get(k(i)) == v and ssd.get_meta(k(i)) == b"m%d" % i
    assert ssd.used_bytes == sum(extent_size(len(v)) for i, v in enumerate(values)
                                 if i not in (1, 4))
    again = [values[1], values[4]]
    assert ssd.put_filled([(k(10 + j), len(v), b"") for j, v in enumerate(again)],
                          _fill_from(again)) == [True, True]
    assert ssd.get(k(10)) == values[1] and ssd.get(k(11)) == values[4]


def test_put_filled_stores_nothing_when_fill_raises(ssd):
    ssd.put(k(0), val(0, 5000), b"")
    used = ssd.used_bytes

    def fill(i: int, dst: memoryview) -> bool:
        if i == 2:
            raise RuntimeError("encoder broke")
        dst[:] = bytes(len(dst))
        return True

    with pytest.raises(RuntimeError, match="encoder broke"):
        ssd.put_filled([(k(i), 3 * MIB, b"") for i in range(1, 5)], fill)
    assert ssd.used_bytes == used and len(ssd) == 1
    assert all(ssd.get(k(i)) is None for i in range(1, 5))


def test_put_filled_rejects_bad_items(ssd):
    with pytest.raises(InvalidArgument, match="length"):
        ssd.put_filled([(k(1), -1, b"")], _fill_from([b""]))
    with pytest.raises(InvalidArgument, match="keys must be bytes"):
        ssd.put_filled([("x", 1, b"")], _fill_from([b"a"]))


def test_batches_of_many_runs_land_whole(ssd, monkeypatch):
    """Runs are filled on the caller and written by the tier's writer thread while the next
    is filled; with small runs a batch is many of them, and every value must still land."""
    import tiers.ssd.payload as mod
    monkeypatch.setattr(mod, "RUN_BYTES", 64 << 10)
    values = [val(i, 20_000 + 997 * i) for i in range(40)]
    ssd.put_many([(k(i), v, b"") for i, v in enumerate(values)])
    assert [ssd.get(k(i)) for i in range(40)] == values
    ssd.delete_many([k(i) for i in range(0, 40, 3)])       # holes: runs split on reuse
    again = [val(100 + i, 20_000 + 997 * i) for i in range(0, 40, 3)]
    ssd.put_many([(k(i), v, b"") for i, v in zip(range(0, 40, 3), again, strict=True)])
    want = dict(enumerate(values)) | dict(zip(range(0, 40, 3), again, strict=True))
    assert [ssd.get(k(i)) for i in range(40)] == [want[i] for i in range(40)]


def test_a_failed_write_among_queued_runs_stores_nothing_and_leaves_none_in_flight(
        ssd, monkeypatch):
    """Runs are queued behind the one being written; when one write fails, put_filled
    raises only after every queued write has ended (their extents are freed at once), stores
    nothing, and the tier takes the same batch again afterwards."""
    import threading

    import tiers.ssd.payload as mod
    monkeypatch.setattr(mod, "RUN_BYTES", 64 << 10)
    real = mod._pwrite_all
    lock = threading.Lock()
    state = {"started": 0, "ended": 0, "fail": True}

    def pwrite(fd: int, data: memoryview, offset: int) -> None:
        with lock:
            state["started"] += 1
            n = state["started"]
        try:
            # No pause needed for the queue: put_filled submits run 4 before it waits for
            # run 3, so run 4 is always queued behind the write that fails.
            if state["fail"] and n == 3:
                raise OSError(errno.EIO, "Input/output error")
            real(fd, data, offset)
        finally:
            with lock:
                state["ended"] += 1

    monkeypatch.setattr(mod, "_pwrite_all", pwrite)
    ssd.put(k(99), val(99, 5000), b"")
    used = ssd.used_bytes
    values = [val(i, 60_000) for i in range(12)]
    items = [(k(i), len(v), b"") for i, v in enumerate(values)]
    with pytest.raises(OSError, match="Input/output"):
        ssd.put_filled(items, _fill_from(values))
    assert state["started"] == state["ended"] > 3
    assert ssd.used_bytes == used and len(ssd) == 1
    assert all(ssd.get(k(i)) is None for i in range(12))
    state["fail"] = False
    assert ssd.put_filled(items, _fill_from(values)) == [True] * 12
    assert [ssd.get(k(i)) for i in range(12)] == values
    assert ssd.used_bytes == used + sum(extent_size(len(v)) for v in values)


@pytest.mark.o_direct
def test_o_direct_refused_mid_way_falls_back_to_buffered_writes(ssd, monkeypatch):
    import tiers.ssd.payload as mod
    if not ssd.direct_io:
        pytest.skip("this filesystem refuses O_DIRECT at open already")
    real = mod._pwrite_all
    direct = ssd._payload.dfd

    def pwrite(fd: int, data: memoryview, offset: int) -> None:
        if fd == direct:
            raise OSError(errno.EINVAL, "Invalid argument")
        real(fd, data, offset)

    monkeypatch.setattr(mod, "_pwrite_all", pwrite)
    values = [val(i, 300_000) for i in range(8)]
    ssd.put_many([(k(i), v, b"") for i, v in enumerate(values)])
    assert not ssd.direct_io
    assert [ssd.get(k(i)) for i in range(8)] == values


def test_unframe_checked_skips_only_the_payload_hash():
    value = bytearray(frame.frame("raw", 4, b"abcd"))
    value[-1] ^= 1                         # a payload flip: found by the hash, not by `checked`
    with pytest.raises(DataLoss, match="checksum"):
        frame.unframe(value)
    assert frame.unframe(value, checked=True)[0] == "raw"
    value[16] ^= 1                         # a length flip: found either way
    with pytest.raises(DataLoss):
        frame.unframe(value, checked=True)


# ------------------------------------------------------------------ the choice


def test_choice_stores_raw_until_compressing_is_measured_not_to_slow_demotion():
    c = EncodeChoice("auto", threads=2)
    assert not c.compress("lossless")             # nothing measured yet: raw
    assert c.compress("int8") and c.compress("fp8_e4m3")   # lossy codecs always apply
    c.note_write(2_000_000_000, 1.0)              # the disk: 2 GB/s
    c.note_encode(300_000_000, 210_000_000, 1.0, one_thread=False)   # 0.3 GB/s, ratio 0.7
    assert not c.compress("lossless")             # 1/0.3 + 0.7/2 > 1/2
    fast = EncodeChoice("auto", threads=2)
    fast.note_write(2_000_000_000, 1.0)
    for _ in range(20):                           # 8 GB/s on one thread, x2 threads
        fast.note_encode(8_000_000_000, 4_000_000_000, 1.0, one_thread=True)
    assert fast.encode_bps == pytest.approx(16e9)
    assert fast.compress("lossless")              # 1/16 + 0.5/2 <= 1/2
    assert fast.describe()["compressing"] is True


def test_choice_modes_and_probe_interval():
    always, never = EncodeChoice("always", 2), EncodeChoice("never", 2)
    assert always.compress("lossless") and not never.compress("lossless")
    assert not always.probe() and not never.probe()
    auto = EncodeChoice("auto", 2)
    assert auto.probe() and not auto.probe()      # one probe, then none for PROBE_S


def test_config_rejects_an_unknown_compress_mode(tmp_path):
    cfg = StoreConfig(data_dir=str(tmp_path))
    cfg.ssd.compress = "sometimes"
    with pytest.raises(ConfigError, match="ssd.compress"):
        cfg.check()


# ------------------------------------------------------------------ through the store


def _demote_and_read(store, ns: bytes, n: int, seed: int) -> tuple[list[bytes], list]:
    rng = np.random.default_rng(seed)
    _, keys = random_prompt(rng, n, LAYOUT)
    data = [kv_block(key, LAYOUT) for key in keys]
    store.put(ns, keys, data)
    store.evict("host")
    return data, store.get(ns, keys)


@pytest.mark.parametrize("mode", ["never", "always", "auto"])
def test_lossless_blocks_come_back_bit_exact_in_every_mode(tmp_path, mode):
    with make_store(tmp_path, host_capacity=8 * MIB, ssd_compress=mode) as store:
        ns = namespace(store, LAYOUT, codec="lossless")
        data, got = _demote_and_read(store, ns, 24, seed=3)
        assert [d for _, d in got] == data
        c = store.stats()["counters"]
        raw, packed = c.get("codec_blocks_raw", 0), c.get("codec_blocks_lossless", 0)
        assert raw + packed == 24
        if mode == "never":
            assert raw == 24
            assert c["codec_out_bytes_raw"] == 24 * (LAYOUT.block_bytes + frame.HEADER_BYTES)
        elif mode == "always":
            assert packed == 24
            assert c["codec_out_bytes_lossless"] < c["codec_in_bytes_lossless"]
        else:
            assert raw == 24              # a fresh store stores raw until a probe says so
            choice = store.moves.host_to_ssd.encode_choice
            deadline = time.monotonic() + 30
            while choice.encode_bps is None and time.monotonic() < deadline:
                time.sleep(0.05)          # the probe runs on a worker thread
            assert choice.encode_bps is not None and choice.write_bps is not None


def test_raw_blocks_survive_a_restart(tmp_path):
    with make_store(tmp_path, host_capacity=8 * MIB, ssd_compress="never") as store:
        ns = namespace(store, LAYOUT)
        data, _ = _demote_and_read(store, ns, 8, seed=4)
    with make_store(tmp_path, host_capacity=8 * MIB, ssd_compress="always") as store:
        ns = namespace(store, LAYOUT)
        rng = np.random.default_rng(4)
        _, keys = random_prompt(rng, 8, LAYOUT)
        assert [d for _, d in store.get(ns, keys)] == data


def test_flush_writes_raw_blocks_under_the_lock(tmp_path):
    """Flush (and a stop's flush) take the same path without releasing the lock."""
    with make_store(tmp_path, host_capacity=8 * MIB, ssd_compress="never") as store:
        ns = namespace(store, LAYOUT)
        rng = np.random.default_rng(5)
        _, keys = random_prompt(rng, 10, LAYOUT)
        data = [kv_block(key, LAYOUT) for key in keys]
        store.put(ns, keys, data)
        assert store.flush() == 10
        assert len(store.ssd) == 10
        for key, d in zip(keys, data, strict=True):
            value = store.ssd.get(ns + key)
            codec, raw_len, payload = frame.unframe(value)
            assert codec == "raw" and raw_len == len(d) and bytes(payload) == d


# ------------------------------------------------------------------ reads


def test_visit_many_reads_runs_and_reports_each_key(ssd, monkeypatch):
    import tiers.ssd.payload as mod
    monkeypatch.setattr(mod, "READ_RUN_BYTES", 3 * 64 << 10)   # runs of about three values
    values = [val(i, 50_000 + 101 * i) for i in range(10)]
    ssd.put_many([(k(i), v, b"") for i, v in enumerate(values)])
    ssd.delete(k(4))                                   # a hole in the middle of the file
    seen: dict[int, bytes] = {}
    order = [k(9), k(0), k(4), k(5), k(77), *[k(i) for i in (1, 2, 3, 6, 7, 8)]]
    got = ssd.visit_many(order, lambda i, mv: seen.__setitem__(i, bytes(mv)))
    assert got == [True, True, False, True, False] + [True] * 6
    want = {i: values[int.from_bytes(key[16:], "big")] for i, key in enumerate(order)
            if got[i] is True}
    assert seen == want


def test_visit_many_refuses_a_corrupt_value_and_serves_its_neighbours(tmp_path):
    import os
    t = SSDTier(str(tmp_path / "ssd"), capacity=64 * MIB)
    try:
        values = [val(i, 40_000) for i in range(3)]
        t.put_many([(k(i), v, b"") for i, v in enumerate(values)])
        t.sync()
        off = t._index.record(k(1))[0]                 # where the middle value lies
        fd = os.open(t.data_files()[0], os.O_RDWR)
        try:
            os.pwrite(fd, b"\x00\x01\x02", off + 1000)
        finally:
            os.close(fd)
        seen: dict[int, bytes] = {}
        got = t.visit_many([k(0), k(1), k(2)], lambda i, mv: seen.__setitem__(i, bytes(mv)))
        assert got[0] is True and got[2] is True
        assert isinstance(got[1], DataLoss) and "checksum" in str(got[1])
        assert seen == {0: values[0], 2: values[2]}
    finally:
        t.close()


def test_cold_promotion_reads_adjacent_blocks_back_exact(tmp_path):
    """Through the store: many blocks demoted together come back by coalesced reads."""
    with make_store(tmp_path, host_capacity=16 * MIB, ssd_compress="never") as store:
        ns = namespace(store, LAYOUT)
        data, got = _demote_and_read(store, ns, 40, seed=6)
        assert [d for _, d in got] == data
        assert store.stats()["counters"].get("corrupt_blocks", 0) == 0


def test_runs_go_down_in_pieces_only_while_reads_come(ssd, monkeypatch):
    """A spill with no reads behind it writes each run in one go (the disk's queue stays
    deep); once reads come, runs go in WRITE_PIECE pieces, so that a read queues behind one
    piece of writes at most, not a whole run."""
    import tiers.ssd.payload as mod
    if not ssd.direct_io:
        pytest.skip("the filesystem refuses O_DIRECT: writes are buffered, value by value")
    monkeypatch.setattr(mod, "WRITE_PIECE", 64 << 10)
    sizes: list[int] = []
    real = mod._pwrite_all

    def pwrite(fd: int, data: memoryview, offset: int) -> None:
        sizes.append(len(data))
        real(fd, data, offset)

    monkeypatch.setattr(mod, "_pwrite_all", pwrite)
    values = [val(i, 60_000) for i in range(8)]           # adjacent extents: one run
    ssd.put_many([(k(i), v, b"") for i, v in enumerate(values)])
    assert len(sizes) == 1 and sizes[0] > 4 * (64 << 10), sizes
    assert ssd.get(k(3)) == values[3]                      # a read: pieces from now on
    sizes.clear()
    more = [val(20 + i, 60_000) for i in range(8)]
    ssd.put_many([(k(20 + i), v, b"") for i, v in enumerate(more)])
    assert len(sizes) >= 7 and max(sizes) <= 64 << 10, sizes
    assert [ssd.get(k(20 + i)) for i in range(8)] + [ssd.get(k(i)) for i in range(8)] \
        == more + values
    monkeypatch.setattr(mod, "READS_RECENT_S", 0.0)       # reads long past: whole runs again
    sizes.clear()
    ssd.put_many([(k(40 + i), v, b"") for i, v in enumerate(values)])
    assert len(sizes) == 1, sizes
