"""The CPU device behind the device interface (tiers/device.py), and the store's gpu tier on it
under concurrent threads.

The interface tests check what the store relies on: batched copies with completion, gather,
checksums, encode, export to another process by handle, bad input refused, close. The
concurrency test hammers one store with gpu writers, gpu and host readers, deletes and
evictions, then checks every gpu and host slot has exactly one owner.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import xxhash
from kvstore_client import gpu as cg
from kvstore_client.common.layout import KVLayout
from kvstore_client.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted

from kvstore.state import aligned as _aligned
from tiers.device_cpu import CpuDeviceTier

from .store_helpers import kv_block, make_store, namespace, quiet, random_prompt

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


@pytest.fixture
def dev():
    t = CpuDeviceTier(4 * MiB, 0, slab_name=f"kvstore-test-cpudev-{id(object())}")
    yield t
    t.close()


def rand(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_batched_copies_round_trip_and_complete(dev):
    host = rand(2 * MiB, 1)
    back = np.zeros(2 * MiB, np.uint8)
    offs = [dev.alloc(256 << 10) for _ in range(6)]
    items = [(g, i * (256 << 10), 256 << 10) for i, g in enumerate(reversed(offs))]
    up = dev.copy_from_host_batch(items, host)
    down = dev.copy_to_host_batch(items, back, after=up)     # ordered after the upload
    down.wait(30)
    assert up.done() and down.done() and down.nbytes == 6 * (256 << 10)
    assert np.array_equal(back[:6 * (256 << 10)], host[:6 * (256 << 10)])
    assert dev.checksums([(offs[-1], 256 << 10)]) == [xxhash.xxh3_64_intdigest(
        host[:256 << 10])]
    for o in offs:
        dev.free(o)
    assert dev.used_bytes == 0


def test_gather_within_and_across_devices(dev):
    other = CpuDeviceTier(MiB, 1, slab_name=f"kvstore-test-cpudev-b-{id(dev)}")
    try:
        dev.view(0, 8192)[:] = rand(8192, 2)
        dev.gather([(0, 65536, 4096), (4096, 0, 4096)], other).wait(30)
        assert np.array_equal(other.view(65536, 4096), dev.view(0, 4096))
        assert np.array_equal(other.view(0, 4096), dev.view(4096, 4096))
        dev.gather([(0, 1 << 20, 8192)]).wait(30)
        assert np.array_equal(dev.view(1 << 20, 8192), dev.view(0, 8192))
    finally:
        other.close()


def test_bad_ranges_and_buffers_are_refused(dev):
    with pytest.raises(InvalidArgument, match="outside"):
        dev.copy_to_host_batch([(dev.capacity - 10, 0, 20)], np.zeros(64, np.uint8))
    with pytest.raises(InvalidArgument, match="1-D contiguous uint8"):
        dev.copy_from_host_batch([(0, 0, 8)], np.zeros(8, np.float32))
    with pytest.raises(InvalidArgument, match="at least"):
        CpuDeviceTier(100)
    with pytest.raises(InvalidArgument, match="outside"):
        dev.view(dev.capacity, 1)


def test_a_failed_copy_raises_when_waited_for(dev):
    gate = threading.Event()
    busy = dev._executor().submit(gate.wait, 30)     # holds the device's copy thread
    t = dev.copy_to_host_batch([(0, 0, 16)], np.zeros(16, np.uint8))
    with pytest.raises(DeadlineExceeded):            # queued behind it: cannot have finished
        t.wait(0.05)
    gate.set()
    assert busy.result(5)
    t.wait(5)
    bad = dev.copy_to_host_batch([(0, 0, 16)], np.zeros(16, np.uint8),
                                 after=cg.Transfer(cg.FutureEvent(_failed())))
    with pytest.raises(RuntimeError, match="upstream"):
        bad.wait(5)


def _failed():
    import concurrent.futures as cf

    f: cf.Future = cf.Future()
    f.set_exception(RuntimeError("upstream copy failed"))
    return f


def test_encode_batch_matches_the_cpu_codec(dev):
    from tiers import codecs

    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=16, dtype="float16")
    raw = (np.random.default_rng(3).standard_normal(lay.block_elements)
           .astype(np.float16).view(np.uint8))
    off = dev.alloc(lay.block_bytes)
    dev.view(off, lay.block_bytes)[:] = raw
    for codec in ("lossless", "int8"):
        (payload,) = dev.encode_batch([(off, lay.block_bytes)], codec, lay).result(60)
        assert payload == bytes(codecs.encode(codec, raw, lay))
    with pytest.raises(InvalidArgument, match="layout needs"):
        dev.encode_batch([(off, 100)], "lossless", lay)


def test_another_process_opens_the_slab_by_handle(dev):
    dev.view(0, 4096)[:] = 7
    desc = dev.describe()
    assert desc["kind"] == cg.CPU_POOL_KIND and desc["size"] == dev.capacity
    code = ("import sys, json; from kvstore_client import gpu as cg\n"
            f"p = cg.open_pool({desc!r})\n"
            "assert cg.open_pool(p.desc) is p\n"
            "print(int(p.view(0, 4096).sum())); p.view(4096, 16)[:] = 9; p.close()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(7 * 4096)
    assert (dev.view(4096, 16) == 9).all()      # the same memory, not a copy
    with pytest.raises(InvalidArgument, match="shared-memory segment"):
        cg.CpuPoolDesc.parse(dict(desc, name=""))


def test_close_is_idempotent_and_unlinks(dev):
    name = dev.slab_name
    dev.close()
    dev.close()
    assert not (Path("/dev/shm") / name).exists()
    with pytest.raises(InvalidArgument, match="closed"):
        dev.view(0, 1)


# ------------------------------------------------------------------ the store, hammered

def test_gpu_tier_under_concurrent_threads(tmp_path):
    rng = np.random.default_rng(5)
    prompts = [random_prompt(rng, 6)[1] for _ in range(12)]
    with make_store(tmp_path, host_capacity=40 * 4096, ssd_capacity=8 << 20,
                    gpu_capacity=16 * 4096) as store:
        ns = namespace(store)
        (gdev,) = store.gpu
        stop = threading.Event()
        errors: list[BaseException] = []
        seen = {"acquired": 0, "stored": 0, "churned": 0}
        enough = threading.Event()           # every kind of thread made progress

        def progress(what: str, n: int) -> None:
            seen[what] += n
            if min(seen.values()) >= 50:
                enough.set()

        def writer(seed):
            r = np.random.default_rng(seed)
            while not stop.is_set():
                keys = prompts[r.integers(len(prompts))]
                try:
                    lease = store.reserve(ns, len(keys), tier="gpu")
                except ResourceExhausted:
                    continue
                for k, s in zip(keys, lease.slots, strict=True):
                    store.gpu[s.device].view(s.offset, s.length)[:] = np.frombuffer(
                        kv_block(k), np.uint8)
                progress("stored", store.commit(lease.id, keys).stored)

        def reader(seed, tier):
            r = np.random.default_rng(seed)
            while not stop.is_set():
                keys = prompts[r.integers(len(prompts))][:int(r.integers(1, 7))]
                try:
                    lease = store.acquire(ns, keys, tier=tier)
                except ResourceExhausted:
                    continue
                for k, s in zip(lease.keys, lease.slots, strict=True):
                    view = (store.gpu[s.device] if tier == "gpu" else store.host).view(
                        s.offset, s.length)
                    assert view.tobytes() == kv_block(k), "a leased slot held other bytes"
                store.release(lease.id)
                progress("acquired", len(lease.slots))

        def churn(seed):
            r = np.random.default_rng(seed)
            while not stop.is_set():
                op = r.integers(3)
                if op == 0:
                    store.evict("gpu", 4 * 4096)
                elif op == 1:
                    store.delete(ns, [prompts[r.integers(len(prompts))][-1]])
                else:
                    store.evict("host", 4 * 4096)
                progress("churned", 1)

        def guard(fn, *a):
            try:
                fn(*a)
            except BaseException as exc:
                errors.append(exc)
                stop.set()
        threads = [threading.Thread(target=guard, args=a) for a in
                   [(writer, 1), (writer, 2), (reader, 3, "gpu"), (reader, 4, "gpu"),
                    (reader, 5, "host"), (churn, 6)]]
        for t in threads:
            t.start()
        # Until every thread kind has done some work (or one failed): a goal, not a duration.
        stop.wait(1.5)
        end = time.monotonic() + 120
        while not (enough.is_set() or stop.is_set()) and time.monotonic() < end:
            enough.wait(0.05)
        enough_in_time = enough.is_set() or stop.is_set()
        stop.set()
        for t in threads:
            t.join(60)
        assert not errors, errors[0]
        assert enough_in_time, f"the threads made too little progress in 120 s: {seen}"
        with quiet(store):
            assert not store.leases.all()
            entries = list(store.index.entries())
            assert store.gpu[gdev].used_bytes == sum(_aligned(e.size) for e in entries
                                                     if e.gpu is not None)
            assert store.host.used_bytes == sum(_aligned(e.size) for e in entries
                                                if e.host is not None)
            assert all(e.pins == 0 and e.gpu_pins == 0 and e.moving is None for e in entries)
            for e in entries:
                if e.gpu is not None:
                    assert store.gpu[gdev].view(e.gpu, e.size).tobytes() == kv_block(e.key)


def test_gpu_only_blocks_are_located_and_read_through_host(tmp_path):
    rng = np.random.default_rng(9)
    _, keys = random_prompt(rng, 3)
    with make_store(tmp_path, gpu_capacity=16 * 4096) as store:
        ns = namespace(store)
        lease = store.reserve(ns, 3, tier="gpu")
        for k, s in zip(keys, lease.slots, strict=True):
            store.gpu[s.device].view(s.offset, s.length)[:] = np.frombuffer(kv_block(k),
                                                                             np.uint8)
        assert store.commit(lease.id, keys).stored == 3
        assert store.where(ns, keys) == ["gpu"] * 3
        assert store.lookup(ns, keys).per_tier == {"host": 0, "gpu": 3, "ssd": 0}
        assert store.get(ns, keys) == [(k, kv_block(k)) for k in keys]   # copied down
        assert store.where(ns, keys) == ["host"] * 3
        assert store.counters["bytes_gpu_to_host"] == 3 * len(kv_block(keys[0]))
