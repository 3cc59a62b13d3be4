"""`ssd.capacity` bounds what the SSD tier takes on disk, not the sum of its value lengths.

The bound these tests hold the tier to: the payload file's size (st_size) never passes the
capacity rounded down to 4 KiB, and nor do the data blocks the filesystem allocated for it;
st_blocks * 512 also counts the filesystem's own blocks that map the file's extents (ext4: a
4 KiB block per 340 extents once the inode's four are used, which O_DIRECT writes into
preallocated space split), so it may pass that by those, never by a 256th of it. And
`used_bytes` (what the store evicts by) is the sum of the values' extents, the same after
a close and reopen, with or without the index image, and from a folder an earlier build left
with the sum of value lengths saved in its place. Before, a tier of 4 KiB blocks (8 KiB extents
with their frame header) took twice its capacity on disk, plus a growth step.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from collections import deque
from pathlib import Path

import lmdb
import numpy as np
import pytest
from kvstore_client import KVLayout, connect

from tests.daemon import cleanup, start_daemon
from tiers import frame
from tiers.ssd import CapacityFull, SSDTier, extent_size

MIB = 1 << 20
ALIGN = 4096
REC = struct.Struct("<QQQ")         # an index record's offset, length, xxh3


def k(i: int) -> bytes:
    return b"D" * 16 + i.to_bytes(16, "big")


def val(i: int, n: int) -> bytes:
    return np.random.default_rng(i).bytes(n)


def on_disk(path: str | Path) -> tuple[int, int]:
    """(st_size, st_blocks * 512) of the tier's payload file."""
    st = os.stat(os.path.join(path, "payload.dat"))
    return st.st_size, st.st_blocks * 512


def assert_within(path: str | Path, capacity: int) -> None:
    """The bound (module docstring): st_size within the capacity; st_blocks within it and the
    filesystem's blocks that map the file (at most one per 340 of its 4 KiB blocks)."""
    size, allocated = on_disk(path)
    limit = capacity // ALIGN * ALIGN
    assert size <= limit and allocated <= limit + limit // 256, (size, allocated, capacity)


def lmdb_truth(path: str | Path) -> tuple[int, int, int | None]:
    """(records, the sum of their extents, the used bytes LMDB saved) of a closed tier."""
    env = lmdb.open(os.path.join(path, "index"), readonly=True, lock=False, max_dbs=8)
    try:
        blocks, tier = env.open_db(b"index", create=False), env.open_db(b"_tier", create=False)
        with env.begin() as txn:
            lengths = [REC.unpack_from(v)[1] for _, v in txn.cursor(db=blocks)]
            saved = txn.get(b"used_bytes", db=tier)
    finally:
        env.close()
    return (len(lengths), sum(map(extent_size, lengths)),
            None if saved is None else struct.unpack("<Q", saved)[0])


class Evicting:
    """The store's pattern on a bare tier: before a batch, past the high watermark of the
    capacity, evict the oldest values down to the low one (kvstore/moves/ssd_room.py), with the
    batch's extents as what it needs; where no free extent fits (CapacityFull), evict one more
    and try again."""

    def __init__(self, t: SSDTier, high: float = 0.95, low: float = 0.85) -> None:
        self.t, self.high, self.low = t, high, low
        self.resident: deque[tuple[bytes, int]] = deque()
        self.evicted = self.refused = 0

    def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        t, cap = self.t, self.t.capacity
        need = sum(extent_size(len(v)) for _, v in items)
        if t.used_bytes + need > self.high * cap:
            while self.resident and t.used_bytes + need > self.low * cap:
                self._evict_one()
        while True:
            try:
                t.put_many([(key, v, b"m") for key, v in items])
                break
            except CapacityFull:
                self.refused += 1
                self._evict_one()
        self.resident.extend((key, len(v)) for key, v in items)

    def _evict_one(self) -> None:
        key, n = self.resident.popleft()
        assert self.t.delete_sized([key]) == extent_size(n)
        self.evicted += 1

    def extents(self) -> int:
        return sum(extent_size(n) for _, n in self.resident)


def test_4k_and_odd_sized_values_past_capacity_stay_within_it_on_disk(tmp_path):
    """Four times the capacity in 4 KiB frames (8 KiB extents) and values of odd sizes: the
    payload file stays within the capacity, eviction by used_bytes keeps making room, and
    used_bytes is the sum of the resident values' extents throughout."""
    cap = 64 * MIB
    path = str(tmp_path / "ssd")
    rng = np.random.default_rng(0)
    t = SSDTier(path, cap)
    try:
        ev = Evicting(t)
        i = 0
        for batch in range(130):
            if batch % 2:       # 64 framed 4 KiB blocks
                items = [(k(i + j), val(i + j, 4096 + frame.HEADER_BYTES)) for j in range(64)]
            else:               # odd sizes: a few bytes past a 4 KiB multiple, or anything
                sizes = rng.integers(1, 300_000, 24)
                sizes[::3] = rng.integers(1, 40, 8) * 4096 + 1
                items = [(k(i + j), val(i + j, int(n))) for j, n in enumerate(sizes)]
            i += len(items)
            ev.put_many(items)
            assert t.used_bytes == ev.extents()
            assert_within(path, cap)
            assert t.used_bytes <= t.file_bytes <= cap
        assert ev.evicted > 0
        assert sum(n for _, n in ev.resident) < t.used_bytes     # extents, not lengths
        last, n = ev.resident[-1]
        assert t.get(last) == val(int.from_bytes(last[16:], "big"), n)
    finally:
        t.close()


@pytest.mark.parametrize("cap", [64 * MIB + 12345, 100 * MIB + 4096 * 3])
def test_growth_stops_at_the_capacity_and_refuses_past_it(tmp_path, cap):
    """A caller that never evicts: the file's last growth step stops at the capacity (a
    capacity that is no multiple of the step included) and the write that finds no room gets
    CapacityFull; the file never grew past it, and what was stored stays whole."""
    path = str(tmp_path / "ssd")
    t = SSDTier(path, cap)
    try:
        stored = 0
        with pytest.raises(CapacityFull, match="ssd.capacity"):
            for i in range(10_000):
                t.put_many([(k(i * 8 + j), val(j, 300_001), b"") for j in range(8)])
                stored = (i + 1) * 8
                assert_within(path, cap)
        assert stored and t.used_bytes == stored * extent_size(300_001) <= cap
        assert t.file_bytes == on_disk(path)[0] == cap // ALIGN * ALIGN
        assert_within(path, cap)
        assert t.get(k(stored - 1)) == val(7, 300_001)
        assert t.get(k(stored)) is None             # the refused batch stored nothing
    finally:
        t.close()


def test_a_write_at_the_capacity_waits_for_extents_a_reader_holds(tmp_path):
    """At the capacity, the extents a delete freed while a read was in progress come back when
    the read ends: a write that needs them waits for that rather than failing (or growing the
    file past the capacity, as it did)."""
    cap = 16 * MIB
    path = str(tmp_path / "ssd")
    t = SSDTier(path, cap)
    try:
        n = cap // extent_size(MIB)
        t.put_many([(k(i), val(i, MIB), b"") for i in range(n)])
        assert t.file_bytes == cap
        reading, release = threading.Event(), threading.Event()

        def read() -> None:
            t.visit_many([k(0)], lambda i, view: (reading.set(), release.wait(30)))
        reader = threading.Thread(target=read)
        reader.start()
        try:
            assert reading.wait(30)
            assert t.delete_many([k(i) for i in range(4)]) == 4     # held back by the read
            threading.Timer(0.3, release.set).start()
            start = time.monotonic()
            t.put_many([(k(100 + i), val(100 + i, MIB), b"") for i in range(4)])
            assert time.monotonic() - start >= 0.2
        finally:
            release.set()
            reader.join(30)
        assert_within(path, cap)
        assert t.used_bytes == n * extent_size(MIB)
        assert t.get(k(103)) == val(103, MIB)
    finally:
        t.close()


def _fill(path: str, cap: int) -> tuple[int, list[int]]:
    """A tier with values of many sizes and holes between them; (used bytes, lengths kept)."""
    t = SSDTier(path, cap)
    lengths = [4096 + frame.HEADER_BYTES if i % 3 else 1 + i * 331 for i in range(300)]
    t.put_many([(k(i), val(i, n), b"m") for i, n in enumerate(lengths)])
    t.delete_many([k(i) for i in range(0, 300, 4)])
    t.put(k(5), val(5, 123_457), b"m")              # an overwrite with another size
    lengths[5] = 123_457
    kept = [n for i, n in enumerate(lengths) if i % 4]
    used = t.used_bytes
    assert used == sum(map(extent_size, kept))
    t.close(image={})                               # with the tier's own index image
    return used, kept


def _reopen_used(path: str, cap: int) -> int:
    t = SSDTier(path, cap)
    try:
        assert t.get(k(5)) == val(5, 123_457) and t.get(k(4)) is None
        return t.used_bytes
    finally:
        t.close(image={})


def test_reopen_keeps_used_bytes_with_and_without_the_index_image(tmp_path):
    path, cap = str(tmp_path / "ssd"), 64 * MIB
    used, kept = _fill(path, cap)
    assert lmdb_truth(path) == (len(kept), used, used)
    assert os.path.exists(os.path.join(path, "index.img"))
    assert _reopen_used(path, cap) == used                      # from the index image
    os.unlink(os.path.join(path, "index.img"))
    assert _reopen_used(path, cap) == used                      # from a scan of the index
    t = SSDTier(path, cap)
    t.put(k(1000), val(1000, 5000), b"m")
    t.scan_next_open = True                                    # as a crash: no image
    t.close()
    assert not os.path.exists(os.path.join(path, "index.img"))
    assert _reopen_used(path, cap) == used + extent_size(5000)
    assert_within(path, cap)


def _as_an_earlier_build_left_it(path: str, figure: int) -> None:
    """LMDB's saved used bytes set to `figure` (an earlier build's sum of value lengths), and
    the index image, if any, stamped with it and with LMDB's new transaction id: the folder an
    earlier build's clean stop leaves."""
    env = lmdb.open(os.path.join(path, "index"), max_dbs=8)
    try:
        tier = env.open_db(b"_tier")
        with env.begin(write=True) as txn:
            txn.put(b"used_bytes", struct.pack("<Q", figure), db=tier)
        txnid = env.info()["last_txnid"]
    finally:
        env.close()
    img = Path(path) / "index.img"
    if img.exists():
        data = img.read_bytes()
        magic = data[:8]
        (hlen,) = struct.unpack_from("<I", data, 8)
        head = json.loads(data[12:12 + hlen])
        head.update(txnid=txnid, used_bytes=figure)
        new = json.dumps(head).encode()
        img.write_bytes(magic + struct.pack("<I", len(new)) + new + data[12 + hlen:])


@pytest.mark.parametrize("image", [True, False])
def test_a_folder_an_earlier_build_left_counts_extents_at_open(tmp_path, image):
    """An earlier build saved the sum of value lengths (and stamped its index image with it):
    the open ends with the sum of extents, and commits it, so the next open (image or scan)
    finds the same."""
    path, cap = str(tmp_path / "ssd"), 64 * MIB
    used, kept = _fill(path, cap)
    if not image:
        os.unlink(os.path.join(path, "index.img"))
    _as_an_earlier_build_left_it(path, sum(kept))
    assert lmdb_truth(path)[2] == sum(kept) != used
    t = SSDTier(path, cap)
    try:
        assert (t._image is not None) == image      # the old image is still current
        assert t.used_bytes == used
    finally:
        t.close(image={})
    assert lmdb_truth(path) == (len(kept), used, used)
    assert _reopen_used(path, cap) == used
    os.unlink(os.path.join(path, "index.img"))
    assert _reopen_used(path, cap) == used


@pytest.mark.parametrize("image", [True, False])
def test_a_file_past_the_capacity_is_cut_back_at_open(tmp_path, image):
    """A payload file larger than the capacity (an earlier build grew it past; or the capacity
    was lowered) is cut back at open to the capacity, or to its last stored extent where that
    lies further; nothing stored is lost."""
    path = str(tmp_path / "ssd")
    t = SSDTier(path, 512 * MIB)                    # grows 64 MiB at a time
    t.put_many([(k(i), val(i, MIB), b"") for i in range(20)])
    t.delete_many([k(i) for i in range(10, 20)])
    t.close(image={})
    assert on_disk(path)[0] == 64 * MIB
    if not image:
        os.unlink(os.path.join(path, "index.img"))
    t = SSDTier(path, 16 * MIB)
    try:
        assert_within(path, 16 * MIB)
        assert t.file_bytes == 16 * MIB
        assert [t.get(k(i)) for i in (0, 9, 10)] == [val(0, MIB), val(9, MIB), None]
        assert t.used_bytes == 10 * extent_size(MIB)
        t.put_many([(k(100 + i), val(100 + i, MIB), b"") for i in range(4)])
        assert t.get(k(103)) == val(103, MIB)
        assert_within(path, 16 * MIB)
    finally:
        t.close(image={})
    t = SSDTier(path, 8 * MIB)                      # the stored values reach past 8 MiB
    try:
        top = t.file_bytes
        assert 8 * MIB < top <= 16 * MIB and t.get(k(103)) == val(103, MIB)
    finally:
        t.close()


# -- through a daemon --------------------------------------------------------------------------
SMALL_4K = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_tokens=16,
                    dtype="float16")                 # 4 KiB blocks: 8 KiB extents framed
ODD_12K = KVLayout(num_layers=3, num_kv_heads=1, head_dim=64, block_tokens=16,
                   dtype="float16")                  # 12 KiB blocks: 16 KiB extents framed


def _kv(layout: KVLayout, blocks: int, seed: int) -> np.ndarray:
    L, _, _, H, D = layout.block_shape
    rng = np.random.default_rng(seed)
    return rng.standard_normal((L, 2, blocks * layout.block_tokens, H, D)).astype(np.float16)


def test_daemon_keeps_the_ssd_tier_within_its_capacity_on_disk(tmp_path):
    """A real daemon, a 64 MiB SSD tier and 1.1x that in extents of 4 KiB and 12 KiB blocks
    (0.64x in value lengths, which the tier used to count: it never evicted and the file grew
    to 72 MiB): the file stays within the capacity, the tier evicts, and Stats' used bytes are
    the extents of the records in LMDB, the same after a clean restart and a scan."""
    assert SMALL_4K.block_bytes == 4096 and ODD_12K.block_bytes == 12288
    cap = 64 * MIB
    d = start_daemon(tmp_path, {"host.capacity": "16MiB", "ssd.capacity": str(cap),
                                "ssd.compress": "never"})
    data = d.data_dir / "ssd"
    try:
        with connect(d.address) as c:
            small = c.namespace(SMALL_4K, model="bound/4k")
            odd = c.namespace(ODD_12K, model="bound/12k")
            last = None
            for r in range(12):
                n = 1000 if r % 2 else 250
                ns, layout = (small, SMALL_4K) if r % 2 else (odd, ODD_12K)
                toks = np.arange(n * layout.block_tokens) + r * 10**6
                data_kv = _kv(layout, n, r)
                assert ns.store(toks, data_kv) == n
                last = (ns, toks, data_kv)
                assert_within(data, cap)
            c.evict("host")
            assert_within(data, cap)
            ssd = c.stats()["tiers"]["ssd"]
            assert ssd["evictions"] > 0 and ssd["blocks"] > 0
            assert ssd["used_bytes"] <= cap
            ns, toks, data_kv = last
            out = np.zeros_like(data_kv)
            assert ns.load(toks, out) == len(toks) and np.array_equal(out, data_kv)
            used = c.stats()["tiers"]["ssd"]["used_bytes"]
        d.stop()
        assert_within(data, cap)
        records, extents, saved = lmdb_truth(data)
        assert extents == saved == used
        d.start()
        with connect(d.address) as c:
            assert c.stats()["tiers"]["ssd"]["used_bytes"] == used
        d.stop()
        os.unlink(data / "index.img")
        d.start()
        with connect(d.address) as c:
            assert c.stats()["tiers"]["ssd"]["used_bytes"] == used
            assert c.stats()["tiers"]["ssd"]["blocks"] == records
        assert "Traceback" not in d.output()
    finally:
        cleanup(d)


def test_room_in_pieces_too_small_is_evicted_into_a_fitting_hole(tmp_path):
    """The payload file at its cap with its free room in 4 KiB holes (every other small block
    deleted: half the tier free, under the watermark, so make_room evicts nothing) and 64 KiB
    blocks to demote: CapacityFull. The store evicts twice the batch and tries again, so the
    big blocks land instead of being dropped on every demotion from then on."""
    from kvstore_client import NamespaceSpec

    from tests.store_helpers import SMALL, make_store

    big = KVLayout(num_layers=2, num_kv_heads=2, head_dim=128, block_tokens=64,
                   dtype="float16")                        # 64 KiB a block
    store = make_store(tmp_path, host_capacity=8 << 20, ssd_capacity=64 << 20,
                       ssd_compress="never")
    try:
        small = store.register_namespace(NamespaceSpec(model="small", layout=SMALL)).ns_id
        rng = np.random.default_rng(5)
        blob = bytes(SMALL.block_bytes)
        keys = [rng.bytes(16) for _ in range(14_000)]      # ~55 MiB of 4 KiB extents
        for i in range(0, len(keys), 500):
            store.put(small, keys[i:i + 500], [blob] * len(keys[i:i + 500]))
        store.flush()
        for i in range(0, len(keys), 1000):
            store.delete(small, keys[i:i + 1000:2])
        st = store.state
        assert st.ssd.used_bytes < 0.6 * (64 << 20)
        bns = store.register_namespace(NamespaceSpec(model="big", layout=big)).ns_id
        bkeys = [rng.bytes(16) for _ in range(200)]        # 12.5 MiB: more than the tail
        for i in range(0, len(bkeys), 20):
            store.put(bns, bkeys[i:i + 20], [bytes(big.block_bytes)] * 20)
        store.flush()
        assert st.counters["ssd_capacity_full_evictions"] > 0
        assert st.counters["ssd_disk_full_dropped_blocks"] == 0
        on_ssd = sum(1 for g in bkeys if (e := st.index.get(bns + g)) is not None and e.ssd)
        assert on_ssd == len(bkeys)
        assert_within(st.ssd.path, 64 << 20)
    finally:
        store.close()
