"""SSDTier on a real payload file and LMDB index in a temporary folder."""

from __future__ import annotations

import os
import threading

import pytest
from kvstore_client.errors import DataLoss, InvalidArgument, Unavailable

from tiers import frame
from tiers.ssd import CapacityFull, SSDTier, extent_size, initial_map_size

MIB = 1 << 20


def k(i: int) -> bytes:
    return b"N" * 16 + i.to_bytes(16, "big")


def val(i: int, n: int = 4096) -> bytes:
    return bytes([i % 251]) * n


@pytest.fixture
def ssd(tmp_path):
    t = SSDTier(str(tmp_path / "ssd"), capacity=64 * MIB)
    yield t
    t.close()


def test_put_get_meta_delete_round_trip(ssd):
    assert ssd.get(k(1)) is None and ssd.get_meta(k(1)) is None
    ssd.put(k(1), val(1, 100_000), b"\x81\xa1p\xc0")
    assert ssd.get(k(1)) == val(1, 100_000)
    assert ssd.get_meta(k(1)) == b"\x81\xa1p\xc0"
    assert ssd.size_of(k(1)) == 100_000
    assert ssd.visit(k(1), lambda mv: bytes(mv[:3])) == val(1, 3)
    assert ssd.visit(k(2), len) is None
    ssd.set_meta(k(1), b"new")
    assert ssd.get_meta(k(1)) == b"new" and ssd.size_of(k(1)) == 100_000
    assert ssd.delete(k(1)) is True
    assert ssd.delete(k(1)) is False
    assert ssd.get(k(1)) is None and ssd.get_meta(k(1)) is None
    assert ssd.used_bytes == 0
    with pytest.raises(InvalidArgument, match="not in the SSD tier"):
        ssd.set_meta(k(1), b"x")


def test_batches_and_accounting(ssd):
    """used_bytes and delete_sized count extents (what the values take on disk); scan_meta
    and size_of say the values' lengths."""
    ssd.put_many([(k(i), val(i, 1000 * (i + 1)), b"m%d" % i) for i in range(10)])
    assert ssd.used_bytes == sum(extent_size(1000 * (i + 1)) for i in range(10))
    assert ssd.get_many([k(0), k(99), k(9)]) == [val(0, 1000), None, val(9, 10_000)]
    ssd.put(k(0), val(0, 500), b"m0")             # overwrite replaces the old size
    assert ssd.used_bytes == sum(extent_size(1000 * (i + 1)) for i in range(1, 10)) + 4096
    assert ssd.delete_many([k(0), k(1), k(42)]) == 2
    assert ssd.used_bytes == sum(extent_size(1000 * (i + 1)) for i in range(2, 10))
    assert len(ssd) == 8
    scanned = {key: (m, size) for key, m, size in ssd.scan_meta()}
    assert scanned == {k(i): (b"m%d" % i, 1000 * (i + 1)) for i in range(2, 10)}
    assert ssd.delete_sized([k(2), k(3), k(42)]) == 4096 + 4096   # extents, missing keys: 0
    assert ssd.delete_sized([k(2)]) == 0
    assert ssd.used_bytes == sum(extent_size(1000 * (i + 1)) for i in range(4, 10))


def test_delete_sized_counts_its_own_bytes_while_another_thread_writes(ssd):
    """The store evicts SSD blocks under its lock while a demotion writes without it:
    delete_sized reports what the delete freed, whatever the writer committed meanwhile."""
    ssd.put_many([(k(i), val(i, 10_000), b"") for i in range(100)])
    stop = threading.Event()

    def write() -> None:
        i = 1000
        while not stop.is_set():
            ssd.put_many([(k(i), val(i, 50_000), b"")])
            i += 1
    t = threading.Thread(target=write)
    t.start()
    try:
        assert [ssd.delete_sized([k(i)]) for i in range(100)] == [extent_size(10_000)] * 100
    finally:
        stop.set()
        t.join()
    assert ssd.used_bytes == sum(extent_size(size) for _, _, size in ssd.scan_meta())


def test_namespaces_and_state(ssd):
    ssd.put_namespace(b"A" * 16, b'{"model":"a"}')
    ssd.put_namespace(b"B" * 16, b'{"model":"b"}')
    assert ssd.namespaces() == {b"A" * 16: b'{"model":"a"}', b"B" * 16: b'{"model":"b"}'}
    assert ssd.get_state("policy") is None
    ssd.put_state("policy", b"\x00snapshot")
    assert ssd.get_state("policy") == b"\x00snapshot"


def test_reopen_keeps_everything(tmp_path):
    path = str(tmp_path / "ssd")
    t = SSDTier(path, capacity=64 * MIB)
    t.put_many([(k(i), val(i, 300_000), b"meta%d" % i) for i in range(5)])
    t.put_namespace(b"A" * 16, b"{}")
    t.put_state("policy", b"snap")
    used = t.used_bytes
    t.close()
    with pytest.raises(Unavailable):
        t.get(k(0))
    t = SSDTier(path, capacity=64 * MIB)
    try:
        assert t.used_bytes == used == 5 * extent_size(300_000)
        assert [t.get(k(i)) for i in range(5)] == [val(i, 300_000) for i in range(5)]
        assert t.namespaces() == {b"A" * 16: b"{}"}
        assert t.get_state("policy") == b"snap"
        assert sorted(t.scan_meta()) == sorted((k(i), b"meta%d" % i, 300_000) for i in range(5))
        assert all(os.path.getsize(f) > 0 for f in t.data_files())
    finally:
        t.close()


def test_scan_meta_spans_batches_and_allows_writes(ssd, monkeypatch):
    import tiers.ssd.index as mod
    monkeypatch.setattr(mod, "_SCAN_BATCH", 7)
    ssd.put_many([(k(i), b"v", b"%d" % i) for i in range(50)])
    seen = []
    for key, meta, _size in ssd.scan_meta():
        seen.append(key)
        ssd.set_meta(key, meta + b"!")            # writing while scanning must not deadlock
    assert seen == sorted(k(i) for i in range(50))
    assert all(m.endswith(b"!") for _, m, _ in ssd.scan_meta())


def put_evicting(t: SSDTier, resident: list[bytes], key: bytes, v: bytes, cap: int) -> None:
    """The store's pattern: evict oldest until the new value's extent fits, then put; where
    the room left is in pieces too small for it (CapacityFull: the payload file stays within
    the cap), evict one more and try again."""
    while t.used_bytes + extent_size(len(v)) > cap:
        assert t.delete(resident.pop(0))
    while True:
        try:
            t.put(key, v, b"m")
            break
        except CapacityFull:
            assert t.delete(resident.pop(0))
    resident.append(key)


def test_evict_before_put_loop_never_hits_map_full(tmp_path):
    """The store's pattern (put_evicting). Many 2 MiB values cycling through a small cap, with
    varying sizes to stress LMDB's free-page reuse."""
    cap = 24 * MIB
    t = SSDTier(str(tmp_path / "ssd"), capacity=cap)
    try:
        assert t.map_size >= initial_map_size(cap)
        resident: list[bytes] = []
        for i in range(120):
            v = val(i, 2 * MIB + 32 + (i % 5) * 40_000)
            put_evicting(t, resident, k(i), v, cap)
            assert t.used_bytes <= t.file_bytes <= cap
        assert t.get(resident[-1]) == v
        assert t.used_bytes == sum(extent_size(t.size_of(x)) for x in resident)
    finally:
        t.close()


def test_map_grows_instead_of_failing(tmp_path, monkeypatch):
    import tiers.ssd.index as mod
    monkeypatch.setattr(mod, "MAP_SLACK", 2 * MIB)          # a tiny index map, on purpose
    t = SSDTier(str(tmp_path / "ssd"), capacity=4 * MIB)   # 600 4 KiB extents fit
    try:
        before = t.map_size
        t.put_many([(k(i), val(i, 100), b"m" * 3000) for i in range(600)])  # ~2.4 MiB of records
        assert t.map_size > before
        assert t.get(k(599)) == val(599, 100) and t.get_meta(k(7)) == b"m" * 3000
    finally:
        t.close()


def test_payload_file_stops_at_a_cap_the_caller_ignores(tmp_path):
    """A caller that never evicts gets CapacityFull at the cap, never a file past it (it used
    to grow to whatever was put); what was stored before stays readable."""
    t = SSDTier(str(tmp_path / "ssd"), capacity=8 * MIB)
    try:
        t.put_many([(k(i), val(i, 2 * MIB), b"") for i in range(3)])   # 3 x (2 MiB + 64 KiB)
        with pytest.raises(CapacityFull, match="ssd.capacity"):
            t.put_many([(k(i), val(i, 2 * MIB), b"") for i in range(3, 40)])   # 74 MiB more
        assert t.file_bytes <= 8 * MIB and os.path.getsize(t.data_files()[0]) <= 8 * MIB
        assert [t.get(k(i)) for i in (0, 2, 3)] == [val(0, 2 * MIB), val(2, 2 * MIB), None]
        assert t.used_bytes == 3 * extent_size(2 * MIB)
    finally:
        t.close()


def test_freed_extents_are_reused_and_accounting_stays_exact(tmp_path):
    """Cycling many varied values through a small cap never grows the file past it."""
    cap = 24 * MIB
    t = SSDTier(str(tmp_path / "ssd"), capacity=cap)
    try:
        resident: list[bytes] = []
        for i in range(300):
            put_evicting(t, resident, k(i), val(i, 2 * MIB + (i % 7) * 33_000), cap)
        assert t.file_bytes <= cap                           # not 300 x 2 MiB
        assert t.used_bytes == sum(extent_size(t.size_of(x)) for x in resident)
        assert t.get(resident[0]) == val(int.from_bytes(resident[0][16:], "big"),
                                         t.size_of(resident[0]))
    finally:
        t.close()


def test_reopen_rebuilds_free_space_without_clobbering(tmp_path):
    path = str(tmp_path / "ssd")
    t = SSDTier(path, capacity=64 * MIB)
    t.put_many([(k(i), val(i, 100_000 + i), b"") for i in range(20)])
    t.delete_many([k(i) for i in range(0, 20, 2)])          # holes between live extents
    t.close()
    t = SSDTier(path, capacity=64 * MIB)
    try:
        t.put_many([(k(100 + i), val(100 + i, 100_000), b"") for i in range(30)])
        for i in range(1, 20, 2):                             # the survivors are intact
            assert t.get(k(i)) == val(i, 100_000 + i)
        assert all(t.get(k(100 + i)) == val(100 + i, 100_000) for i in range(30))
        assert t.used_bytes == sum(extent_size(size) for _, _, size in t.scan_meta())
    finally:
        t.close()


def test_corrupt_payload_is_data_loss_never_bytes(tmp_path):
    t = SSDTier(str(tmp_path / "ssd"), capacity=64 * MIB)
    try:
        t.put(k(1), val(1, 50_000), b"")
        t.put(k(2), val(2, 50_000), b"")
        path = t.data_files()[0]
        with open(path, "r+b") as f:                        # flip one byte of block 1
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 0xFF]))
        off = 100
        assert off < 50_000
        with pytest.raises(DataLoss, match="checksum"):
            t.get(k(1))
        assert t.get(k(2)) == val(2, 50_000)
    finally:
        t.close()


def test_buffered_fallback_when_o_direct_is_refused(tmp_path, monkeypatch):
    import tiers.ssd.payload as mod
    monkeypatch.setattr(mod, "_open_direct", lambda path: None)
    t = SSDTier(str(tmp_path / "ssd"), capacity=64 * MIB)
    try:
        assert not t.direct_io
        t.put_many([(k(i), val(i, 70_000), b"") for i in range(5)])
        assert [t.get(k(i)) for i in range(5)] == [val(i, 70_000) for i in range(5)]
    finally:
        t.close()


def test_old_format_folder_is_migrated(tmp_path):
    """A folder written by the LMDB-payload format comes back whole, then in the new format;
    a value failing its frame's hash (the old format's only guard) is left behind, not given
    a fresh record checksum that reads would trust."""
    import lmdb
    path = tmp_path / "ssd"
    path.mkdir()
    env = lmdb.open(str(path), map_size=64 * MIB, subdir=True, max_dbs=8)
    dbs = {n: env.open_db(n) for n in (b"blocks", b"meta", b"namespaces", b"state", b"_tier")}
    old = [frame.frame("raw", 9000, val(i, 9000)) for i in range(6)]
    rotten = bytearray(old[5])
    rotten[-1] ^= 0x01
    with env.begin(write=True) as txn:
        for i in range(6):
            txn.put(k(i), old[i] if i < 5 else bytes(rotten), db=dbs[b"blocks"])
            txn.put(k(i), len(old[i]).to_bytes(8, "little") + b"meta%d" % i, db=dbs[b"meta"])
        txn.put(b"A" * 16, b"{}", db=dbs[b"namespaces"])
        txn.put(b"policy.ssd", b"snap", db=dbs[b"state"])
    env.close()
    t = SSDTier(str(path), capacity=64 * MIB)
    try:
        assert [t.get(k(i)) for i in range(6)] == old[:5] + [None]
        assert t.get_meta(k(3)) == b"meta3" and t.used_bytes == 5 * extent_size(len(old[0]))
        assert t.namespaces() == {b"A" * 16: b"{}"} and t.get_state("policy.ssd") == b"snap"
        assert not (path / "data.mdb").exists()
    finally:
        t.close()


def test_unknown_format_is_refused_in_one_line(tmp_path):
    import lmdb
    t = SSDTier(str(tmp_path / "ssd"), capacity=64 * MIB)
    t.close()
    env = lmdb.open(str(tmp_path / "ssd" / "index"), subdir=True, max_dbs=8)
    tier = env.open_db(b"_tier")
    with env.begin(write=True) as txn:
        txn.put(b"format", b"9", db=tier)
    env.close()
    with pytest.raises(Unavailable, match="has format '9'") as err:
        SSDTier(str(tmp_path / "ssd"), capacity=64 * MIB)
    assert "\n" not in str(err.value)


def test_concurrent_readers_and_writer(ssd):
    ssd.put_many([(k(i), val(i, 50_000), b"") for i in range(20)])
    errors = []

    def reader():
        try:
            for _ in range(50):
                for i in range(20):
                    got = ssd.get(k(i))
                    assert got is None or got == val(i, 50_000)
        except Exception as exc:   # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for th in threads:
        th.start()
    for r in range(30):
        ssd.put(k(r % 20), val(r % 20, 50_000), b"")
    for th in threads:
        th.join()
    assert not errors


@pytest.mark.parametrize("call", [
    lambda t: t.put("str-key", b"v", b""),
    lambda t: t.put(b"", b"v", b""),
    lambda t: t.put(b"x" * 600, b"v", b""),
    lambda t: t.put(b"key", "not bytes", b""),
    lambda t: t.get(123),
    lambda t: t.put_state("", b"x"),
])
def test_bad_input(ssd, call):
    with pytest.raises(InvalidArgument):
        call(ssd)


def test_bad_capacity(tmp_path):
    with pytest.raises(InvalidArgument, match="capacity"):
        SSDTier(str(tmp_path / "x"), capacity=0)


def test_scan_meta_progress_bar_for_large_tiers(ssd, monkeypatch, capsys):
    import tiers.ssd.tier as mod
    ssd.put_many([(k(i), b"v", b"") for i in range(30)])
    monkeypatch.setattr(mod, "PROGRESS_MIN_ENTRIES", 1000)
    assert len(list(ssd.scan_meta())) == 30
    assert "ssd index" not in capsys.readouterr().err
    monkeypatch.setattr(mod, "PROGRESS_MIN_ENTRIES", 10)
    assert len(list(ssd.scan_meta())) == 30
    assert "ssd index" in capsys.readouterr().err
