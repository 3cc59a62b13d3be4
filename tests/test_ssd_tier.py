"""SSDTier on a real LMDB environment in a temporary folder."""

from __future__ import annotations

import os
import threading

import pytest
from kvstore_client.errors import InvalidArgument, Unavailable

from tiers.ssd import SSDTier, initial_map_size

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
    ssd.put_many([(k(i), val(i, 1000 * (i + 1)), b"m%d" % i) for i in range(10)])
    assert ssd.used_bytes == sum(1000 * (i + 1) for i in range(10))
    assert ssd.get_many([k(0), k(99), k(9)]) == [val(0, 1000), None, val(9, 10_000)]
    ssd.put(k(0), val(0, 500), b"m0")             # overwrite replaces the old size
    assert ssd.used_bytes == sum(1000 * (i + 1) for i in range(1, 10)) + 500
    assert ssd.delete_many([k(0), k(1), k(42)]) == 2
    assert ssd.used_bytes == sum(1000 * (i + 1) for i in range(2, 10))
    assert len(ssd) == 8
    scanned = {key: (m, size) for key, m, size in ssd.scan_meta()}
    assert scanned == {k(i): (b"m%d" % i, 1000 * (i + 1)) for i in range(2, 10)}
    assert ssd.delete_sized([k(2), k(3), k(42)]) == 3000 + 4000   # bytes, missing keys: 0
    assert ssd.delete_sized([k(2)]) == 0
    assert ssd.used_bytes == sum(1000 * (i + 1) for i in range(4, 10))


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
        assert [ssd.delete_sized([k(i)]) for i in range(100)] == [10_000] * 100
    finally:
        stop.set()
        t.join()
    assert ssd.used_bytes == sum(size for _, _, size in ssd.scan_meta())


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
        assert t.used_bytes == used == 5 * 300_000
        assert [t.get(k(i)) for i in range(5)] == [val(i, 300_000) for i in range(5)]
        assert t.namespaces() == {b"A" * 16: b"{}"}
        assert t.get_state("policy") == b"snap"
        assert sorted(t.scan_meta()) == sorted((k(i), b"meta%d" % i, 300_000) for i in range(5))
        assert all(os.path.getsize(f) > 0 for f in t.data_files())
    finally:
        t.close()


def test_scan_meta_spans_batches_and_allows_writes(ssd, monkeypatch):
    import tiers.ssd as mod
    monkeypatch.setattr(mod, "_SCAN_BATCH", 7)
    ssd.put_many([(k(i), b"v", b"%d" % i) for i in range(50)])
    seen = []
    for key, meta, _size in ssd.scan_meta():
        seen.append(key)
        ssd.set_meta(key, meta + b"!")            # writing while scanning must not deadlock
    assert seen == sorted(k(i) for i in range(50))
    assert all(m.endswith(b"!") for _, m, _ in ssd.scan_meta())


def test_evict_before_put_loop_never_hits_map_full(tmp_path):
    """The store's pattern: evict oldest until the new value fits, then put. Many 2 MiB values
    cycling through a small cap, with varying sizes to stress LMDB's free-page reuse."""
    cap = 24 * MIB
    t = SSDTier(str(tmp_path / "ssd"), capacity=cap)
    try:
        assert t.map_size >= initial_map_size(cap)
        resident: list[bytes] = []
        for i in range(120):
            v = val(i, 2 * MIB + 32 + (i % 5) * 40_000)
            while t.used_bytes + len(v) > cap:
                assert t.delete(resident.pop(0))
            t.put(k(i), v, b"m")
            resident.append(k(i))
            assert t.used_bytes <= cap
        assert t.get(resident[-1]) == v
        assert t.used_bytes == sum(t.size_of(x) for x in resident)
    finally:
        t.close()


def test_map_grows_instead_of_failing(tmp_path):
    t = SSDTier(str(tmp_path / "ssd"), capacity=1 * MIB)   # caller ignores the cap on purpose
    try:
        before = t.map_size
        t.put_many([(k(i), val(i, 2 * MIB), b"") for i in range(40)])   # 80 MiB > 65.5 MiB map
        assert t.map_size > before
        assert t.get(k(39)) == val(39, 2 * MIB)
    finally:
        t.close()


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
    import tiers.ssd as mod
    ssd.put_many([(k(i), b"v", b"") for i in range(30)])
    monkeypatch.setattr(mod, "PROGRESS_MIN_ENTRIES", 1000)
    assert len(list(ssd.scan_meta())) == 30
    assert "ssd index" not in capsys.readouterr().err
    monkeypatch.setattr(mod, "PROGRESS_MIN_ENTRIES", 10)
    assert len(list(ssd.scan_meta())) == 30
    assert "ssd index" in capsys.readouterr().err
