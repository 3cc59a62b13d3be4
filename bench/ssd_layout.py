"""Is LMDB fast enough as the SSD tier's payload store, or do payloads need their own files?

Measures, in one run on the same disk, 2 MiB values:
- the disk's sequential O_DIRECT write and read (the reference),
- SSDTier.put_many (demotion batches) into the page cache, and put + fsync,
- cold reads (page cache dropped with posix_fadvise DONTNEED) through several read paths:
  `get` (copy out of the txn), `visit` (zero-copy view, one copy into a reused page-aligned
  buffer), `visit` + madvise(WILLNEED) first, and pread of the value's file extent,
  in write order and in random order.
Prints ratios against the disk; the last line is one JSON object. `--quick` stays under a minute.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import mmap
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.refs import drop_page_cache, odirect_write_read  # noqa: E402
from tiers.ssd import SSDTier  # noqa: E402

MIB = 1 << 20
VALUE = 2 * MIB + 64            # a 2 MiB block plus a frame header
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
MADV_WILLNEED = 3


def aligned(n: int) -> mmap.mmap:
    return mmap.mmap(-1, n)     # page-aligned, reused (docs/performance.md)


def resident_fraction(path: str) -> float:
    """Fraction of the file's pages in the page cache (mincore), to prove a pass is cold."""
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    fd = os.open(path, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    pages = (size + 4095) // 4096
    vec = (ctypes.c_ubyte * pages)()
    addr = _addr(mm)
    rc = _libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec)
    del mm      # numpy views are gone; the map closes with the object
    if rc != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(b & 1 for b in vec) / pages


def _addr(mm: mmap.mmap) -> int:
    return np.frombuffer(mm, dtype=np.uint8, count=1).ctypes.data


def disk_direct(folder: str, total: int) -> tuple[float, float]:
    """Sequential O_DIRECT write then read of `total` bytes; GB/s each (bench/refs.py)."""
    w, r = odirect_write_read(folder, total)
    return total / w / 1e9, total / r / 1e9


def map_base(data_file: str) -> int:
    """Start address of this process's mapping of the LMDB data file (offset 0)."""
    real = os.path.realpath(data_file)
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5] == real and int(parts[2], 16) == 0:
            return int(parts[0].split("-")[0], 16)
    raise RuntimeError("LMDB map not found")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dir", default=None, help="folder on the disk to test (default: tmp)")
    ap.add_argument("--mib", type=int, default=None, help="data volume per pass in MiB")
    args = ap.parse_args()
    total_mib = args.mib or (384 if args.quick else 1536)
    n = total_mib * MIB // VALUE
    root = tempfile.mkdtemp(prefix="kvs-ssd-bench-", dir=args.dir)
    res: dict[str, float] = {}
    try:
        dw, dr = disk_direct(root, n * VALUE)
        res.update(disk_direct_write_gbs=dw, disk_direct_read_gbs=dr)
        rng = random.Random(0)
        keys = [rng.randbytes(32) for _ in range(n)]
        payload = os.urandom(VALUE)
        tier = SSDTier(os.path.join(root, "ssd"), capacity=n * VALUE * 2)
        batch = 16
        t0 = time.perf_counter()
        for i in range(0, n, batch):
            tier.put_many([(k, payload, b"\x80") for k in keys[i:i + batch]])
        t1 = time.perf_counter()
        tier.sync()
        t2 = time.perf_counter()
        vol = n * VALUE
        res["put_cache_gbs"] = vol / (t1 - t0) / 1e9
        res["put_sync_gbs"] = vol / (t2 - t0) / 1e9
        data = tier.data_files()
        spath = tier.path
        tier.close()
        out = aligned(VALUE + 4096)
        out_np = np.frombuffer(out, dtype=np.uint8)
        fd = os.open(data[0], os.O_RDONLY)
        cur: dict = {}

        def r_get(k: bytes) -> None:
            v = cur["tier"].get(k)
            assert len(v) == VALUE

        def r_visit(k: bytes) -> None:
            cur["tier"].visit(k, lambda mv: out_np.__setitem__(slice(0, len(mv)),
                                                               np.frombuffer(mv, np.uint8)))

        def r_willneed(k: bytes) -> None:
            def f(mv: memoryview) -> None:
                src = np.frombuffer(mv, np.uint8)
                addr = src.ctypes.data
                start = addr & ~4095
                _libc.madvise(start, addr + len(mv) - start, MADV_WILLNEED)
                out_np[:len(mv)] = src
            cur["tier"].visit(k, f)

        def r_pread(k: bytes) -> None:
            def f(mv: memoryview) -> None:
                addr = np.frombuffer(mv, np.uint8).ctypes.data
                off = addr - cur["base"]
                start = off & ~4095
                got = os.preadv(fd, [memoryview(out)[:off - start + len(mv)]], start)
                assert got >= off - start + len(mv)
            cur["tier"].visit(k, f)

        orders = {"seq": keys, "rand": rng.sample(keys, len(keys))}
        paths = {"get": r_get, "visit": r_visit, "willneed": r_willneed, "pread": r_pread}
        resident = 0.0
        for pname, fn in paths.items():
            for oname, order in orders.items():
                # unmapped first: DONTNEED cannot drop pages a live LMDB map still maps
                drop_page_cache(data)
                resident = max(resident, resident_fraction(data[0]))
                cur["tier"] = SSDTier(spath, capacity=n * VALUE * 2)
                cur["base"] = map_base(data[0])
                t0 = time.perf_counter()
                for k in order:
                    fn(k)
                res[f"cold_{pname}_{oname}_gbs"] = vol / (time.perf_counter() - t0) / 1e9
                if pname == "visit" and oname == "seq":
                    t0 = time.perf_counter()
                    for k in keys:
                        fn(k)
                    res["warm_visit_gbs"] = vol / (time.perf_counter() - t0) / 1e9
                    t0 = time.perf_counter()
                    for k in keys:
                        r_get(k)
                    res["warm_get_gbs"] = vol / (time.perf_counter() - t0) / 1e9
                cur["tier"].close()
        res["max_resident_before_cold_pass"] = resident
        os.close(fd)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for key, v in list(res.items()):
        if key.startswith("cold_"):
            res[key.replace("_gbs", "_vs_disk_read")] = v / res["disk_direct_read_gbs"]
        if key.startswith("put_"):
            res[key.replace("_gbs", "_vs_disk_write")] = v / res["disk_direct_write_gbs"]
    res = {k: round(v, 3) for k, v in res.items()}
    for k, v in res.items():
        print(f"{k:40s} {v}", file=sys.stderr)
    print(json.dumps({"values": n, "value_bytes": VALUE, **res}))


if __name__ == "__main__":
    main()
