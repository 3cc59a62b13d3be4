"""Start and stop costs: no torch for namespaces that never quantize, a bounded stop flush."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from kvstore.moves import host_room
from tests.daemon import start_daemon
from tests.store_helpers import kv_block, make_store, namespace, random_prompt

ROOT = Path(__file__).resolve().parent.parent

NO_TORCH = """
import sys
import numpy as np
from kvstore_client import KVLayout, NamespaceSpec, block_keys
from kvstore.config import StoreConfig
from kvstore.warmup import one_torch_thread
from kvstore.store import Store

one_torch_thread()
cfg = StoreConfig(data_dir=sys.argv[1])
cfg.host.capacity = 1 << 20
cfg.ssd.capacity = 16 << 20
layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=8, dtype="float16")
with Store(cfg) as store:
    ns = store.register_namespace(NamespaceSpec(model="m", layout=layout)).ns_id
    keys = block_keys(np.arange(8 * 40), 8)
    blocks = [np.full(layout.block_bytes, i, np.uint8).tobytes() for i in range(40)]
    store.put(ns, keys, blocks)
    store.evict("host")                       # demote (encode lossless) ...
    got = store.get(ns, keys)                 # ... and promote (decode) again
    assert [v for _, v in got] == blocks, "bytes changed"
print("torch" in sys.modules)
"""


def test_lossless_daemon_path_never_imports_torch(tmp_path):
    """Why: importing torch took 12-46 s of a loaded machine's start; only lossy codecs need it."""
    out = subprocess.run([sys.executable, "-c", NO_TORCH, str(tmp_path / "data")],
                         capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": f"{ROOT}:{ROOT / 'client'}", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout + out.stderr


def test_close_flush_budget_drops_the_rest_and_says_so(tmp_path):
    store = make_store(tmp_path, host_capacity=4 << 20)
    ns = namespace(store)
    _, keys = random_prompt(np.random.default_rng(0), 300)
    store.put(ns, keys, [kv_block(k) for k in keys])
    lines: list[str] = []
    store.close(flush_budget_s=0.0, progress=lines.append)
    assert lines[0].startswith("flushing ") and "at most 0 s" in lines[0]
    assert any("dropped" in line and "300 host-only blocks" in line for line in lines), lines
    store = make_store(tmp_path, host_capacity=4 << 20)
    try:
        assert store.lookup(ns, keys).prefix_blocks == 0    # nothing was written
    finally:
        store.close()


def test_close_flush_with_budget_writes_everything_and_reports(tmp_path):
    store = make_store(tmp_path, host_capacity=4 << 20)
    ns = namespace(store)
    _, keys = random_prompt(np.random.default_rng(1), 200)
    blocks = [kv_block(k) for k in keys]
    store.put(ns, keys, blocks)
    lines: list[str] = []
    store.close(flush_budget_s=600.0, progress=lines.append)
    assert lines[-1].startswith("flushed 200 blocks"), lines
    store = make_store(tmp_path, host_capacity=4 << 20)
    try:
        assert [v for _, v in store.get(ns, keys)] == blocks
    finally:
        store.close()


def test_close_flush_counts_the_blocks_written_not_tried(tmp_path):
    """A host copy that fails its checksum is not written to SSD (it is dropped as corrupt):
    the stop's flush says 199 of 200 were flushed, as many as a restart finds."""
    store = make_store(tmp_path, host_capacity=4 << 20)
    ns = namespace(store)
    _, keys = random_prompt(np.random.default_rng(4), 200)
    blocks = [kv_block(k) for k in keys]
    store.put(ns, keys, blocks)
    e = store.state.index.get(ns + keys[7])
    store.host.view(e.host, e.size)[100] ^= 0xFF            # a torn host copy
    lines: list[str] = []
    store.close(flush_budget_s=600.0, progress=lines.append)
    assert lines[-1].startswith("flushed 199 blocks"), lines
    store = make_store(tmp_path, host_capacity=4 << 20)
    try:
        got = store.get(ns, keys)
        assert [k for k, _ in got] == keys[:7]                # the prefix up to the torn one
        assert sum(store.lookup(ns, [k]).prefix_blocks for k in keys) == 199
    finally:
        store.close()


def test_sigterm_prints_flush_progress_and_stops(tmp_path):
    from kvstore_client import KVLayout, connect

    d = start_daemon(tmp_path, {"server.stop_flush_s": "30"})
    try:
        layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=8,
                          dtype="float16")
        with connect(d.address) as c:
            ns = c.namespace(layout, model="stop-test")
            kv = np.random.default_rng(2).standard_normal(
                (2, 2, 8 * 20, 2, 16)).astype(np.float16)
            assert ns.store_keys([i.to_bytes(16, "big") for i in range(20)], kv) == 20
    finally:
        assert d.stop() == 0
    out = d.output()
    assert "stopping: finishing in-flight calls" in out
    assert "flushing 20 host blocks to SSD, at most 30 s" in out
    assert "flushed 20 blocks" in out and "stopped" in out


def _wait(cond, deadline_s: float = 30.0) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_background_demotion_keeps_host_under_low_watermark(tmp_path):
    store = make_store(tmp_path, host_capacity=1 << 20)     # 1 MiB: ~250 slots of 4 KiB
    try:
        ns = namespace(store)
        _, keys = random_prompt(np.random.default_rng(3), 230)   # ~90%: past low, under high
        blocks = [kv_block(k) for k in keys]
        store.put(ns, keys, blocks)
        low = store.config.host.low_watermark * store.host.capacity
        assert _wait(lambda: store.host.used_bytes <= low), store.host.used_bytes
        st = store.stats()
        assert st["counters"].get("reserve_waits", 0) == 0
        assert st["counters"]["background_demotion_bytes"] > 0
        assert st["tiers"]["ssd"]["blocks"] > 0
        assert [v for _, v in store.get(ns, keys)] == blocks     # demoted blocks come back
    finally:
        store.close()


def test_background_demotions_overlap(tmp_path, monkeypatch):
    """While one demoter's batch is on the disk, writes past the low watermark start the next
    batch on the assistant (the disk never waits for one thread to fill, sync and settle),
    and every block comes back byte-exact. The assistant works only for large blocks
    (ASSIST_MIN_BLOCK), so here every block counts as large."""
    monkeypatch.setattr(host_room, "ASSIST_MIN_BLOCK", 0)
    store = make_store(tmp_path, host_capacity=1 << 20)     # 1 MiB: ~250 slots of 4 KiB
    try:
        put_filled = store.ssd.put_filled
        lock = threading.Lock()
        inside: list[str] = []
        first_in, overlapped = threading.Event(), threading.Event()

        def gated(items, fill):
            with lock:
                inside.append(threading.current_thread().name)
                if len(inside) == 2:
                    overlapped.set()
            first_in.set()
            overlapped.wait(10)               # deadline: without a second batch, fail, not hang
            try:
                return put_filled(items, fill)
            finally:
                with lock:
                    inside.remove(threading.current_thread().name)
        monkeypatch.setattr(store.ssd, "put_filled", gated)
        ns = namespace(store)
        _, keys = random_prompt(np.random.default_rng(5), 235)
        blocks = [kv_block(k) for k in keys]
        store.put(ns, keys[:225], blocks[:225])                 # past low: a first batch
        assert first_in.wait(30), "the background demoter wrote nothing"
        store.put(ns, keys[225:], blocks[225:])                 # still under high: no inline
        assert overlapped.wait(10), "no second demotion started while the first was in flight"
        assert store.stats()["counters"].get("reserve_waits", 0) == 0
        low = store.config.host.low_watermark * store.host.capacity
        assert _wait(lambda: store.host.used_bytes <= low), store.host.used_bytes
        assert [v for _, v in store.get(ns, keys)] == blocks
    finally:
        store.close()


def test_small_blocks_are_demoted_by_one_thread(tmp_path, monkeypatch):
    """Blocks below ASSIST_MIN_BLOCK are demoted by the demoter alone: the assistant, a second
    thread of Python work on the interpreter the requests need, stays idle, and every block
    still reaches SSD and comes back byte-exact."""
    store = make_store(tmp_path, host_capacity=1 << 20)     # 4 KiB blocks
    try:
        put_filled = store.ssd.put_filled
        writers: set[str] = set()

        def noted(items, fill):
            writers.add(threading.current_thread().name)
            return put_filled(items, fill)
        monkeypatch.setattr(store.ssd, "put_filled", noted)
        ns = namespace(store)
        rng = np.random.default_rng(6)
        low = store.config.host.low_watermark * store.host.capacity
        stored = []
        for n in (210, 20, 20, 20, 20, 20, 20):    # to just under low, then past it six times
            _, keys = random_prompt(rng, n)        # (by less than the room under high: no
            blocks = [kv_block(k) for k in keys]   # writer evicts on its own thread)
            store.put(ns, keys, blocks)
            stored.append((keys, blocks))
            assert _wait(lambda: store.host.used_bytes <= low), store.host.used_bytes
        assert writers == {"kvstore-demoter-0"}, writers
        assert store.stats()["counters"].get("reserve_waits", 0) == 0
        for keys, blocks in stored:
            assert [v for _, v in store.get(ns, keys)] == blocks
    finally:
        store.close()


def test_reserve_that_must_evict_inline_is_counted(tmp_path):
    store = make_store(tmp_path, host_capacity=1 << 20, background_demotion=False)
    try:
        ns = namespace(store)
        _, keys = random_prompt(np.random.default_rng(4), 240)
        store.put(ns, keys, [kv_block(k) for k in keys])         # fill to ~94%, no demoter
        lease = store.reserve(ns, 20)                            # needs room: evicts inline
        store.release(lease.id)
        c = store.stats()["counters"]
        assert c["reserve_waits"] == 1 and c["reserve_wait_seconds"] > 0
    finally:
        store.close()


def test_flush_covers_blocks_the_background_demoter_is_writing(tmp_path, monkeypatch):
    """flush() returns only when every block is on SSD, including a batch the demoter started
    while flush waited for earlier ones (those are skipped by flush's own pass)."""
    store = make_store(tmp_path, host_capacity=1 << 20)
    try:
        put_filled = store.ssd.put_filled
        writing = threading.Event()

        def slow(items, fill):            # a slow disk: batches stay in flight for a while
            writing.set()
            time.sleep(0.02)
            return put_filled(items, fill)
        monkeypatch.setattr(store.ssd, "put_filled", slow)
        ns = namespace(store)
        for r in range(4):
            store.evict("host")               # empty, then ~95%: two demoter batches
            writing.clear()
            _, keys = random_prompt(np.random.default_rng(10 + r), 242)
            store.put(ns, keys, [kv_block(k) for k in keys])
            assert writing.wait(30), "the background demoter wrote nothing"
            store.flush()                     # while the demoter's batch is on the disk
            missing = [k for k in keys if not store.ssd.contains(ns + k)]
            assert not missing, f"round {r}: {len(missing)} blocks not on SSD after flush"
    finally:
        store.close()
