"""Engine processes killed with SIGKILL while holding leases: nothing leaks, nothing torn is served.

The child processes run the real SDK with 1-second leases that their lease keeper renews while
they live; once killed, nobody renews, so the daemon must reclaim the slots at the deadline on its
own. The checks poll Stats with a generous deadline instead of timing anything.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from kvstore_client import connect

from tests.daemon import cleanup, start_daemon
from tests.test_client import LAYOUT, T, bits_t, make_kv, prompt

ROOT = Path(__file__).resolve().parent.parent
RECLAIM_DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def crash_daemon(tmp_path_factory: pytest.TempPathFactory):
    d = start_daemon(tmp_path_factory.mktemp("crash"), {"leases.expired_write_hold_s": "1"})
    try:
        yield d
    finally:
        cleanup(d)


def spawn(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_line(proc: subprocess.Popen, word: str) -> str:
    line = proc.stdout.readline()
    if word not in line:
        proc.kill()
        raise AssertionError(f"child said {line!r}, not {word!r}; stderr:\n{proc.stderr.read()}")
    return line


def kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    proc.stdout.close()
    proc.stderr.close()


def poll(fn, what: str) -> None:
    end = time.monotonic() + RECLAIM_DEADLINE_S
    while not fn():
        if time.monotonic() > end:
            raise AssertionError(f"{what} did not happen within {RECLAIM_DEADLINE_S} s")
        time.sleep(0.1)


def test_writer_killed_mid_copy_never_publishes(crash_daemon) -> None:
    ids = prompt(100, 2 * T)
    kv = make_kv(100, 2 * T)
    with connect(crash_daemon.address) as c:
        ns = c.namespace(LAYOUT, model="crash-writer")
        base_used = c.stats()["tiers"]["host"]["used_bytes"]
        child = spawn(f"""
            import sys, time, numpy as np, kvstore_client
            from tests.test_client import LAYOUT, make_kv, prompt
            c = kvstore_client.connect({crash_daemon.socket!r}, transport="shm", lease_ttl_s=1.0)
            ns = c.namespace(LAYOUT, model="crash-writer")
            src = make_kv(100, {2 * T}).view(__import__("torch").int16).numpy()
            def fill(base, offsets, first):
                # block 0 complete, block 1 half written: then the engine dies
                bb = LAYOUT.block_bytes
                base[offsets[0]:offsets[0] + bb] = src[:, :, :16].reshape(-1).view(np.uint8)
                base[offsets[1]:offsets[1] + bb // 2] = 0x5A
                print("COPYING", flush=True)
                time.sleep(600)
            ns.store_blocks(ns.keys(prompt(100, {2 * T})), fill)
        """)
        try:
            wait_line(child, "COPYING")
            assert c.stats()["active_leases"] == 1     # the child's write lease, kept alive
            out = torch.zeros_like(kv)
            assert ns.lookup(ids) == 0                 # nothing published mid-copy
            assert ns.load(ids, out=out) == 0 and not out.any()
            assert c.stats()["tiers"]["host"]["used_bytes"] > base_used   # slots reserved
        finally:
            kill(child)
        poll(lambda: c.stats()["active_leases"] == 0, "the dead writer's lease expiring")
        poll(lambda: c.stats()["tiers"]["host"]["used_bytes"] == base_used,
             "the dead writer's slots returning to the pool")
        assert ns.lookup(ids) == 0                     # the torn write was never published
        assert ns.store(ids, kv) == 2                  # a live writer stores the real blocks
        out = torch.zeros_like(kv)
        assert ns.load(ids, out=out) == 2 * T
        assert torch.equal(bits_t(out), bits_t(kv))


def test_reader_killed_holding_a_read_lease(crash_daemon) -> None:
    ids = prompt(101, 3 * T)
    kv = make_kv(101, 3 * T)
    with connect(crash_daemon.address) as c:
        ns = c.namespace(LAYOUT, model="crash-reader")
        assert ns.store(ids, kv) == 3
        child = spawn(f"""
            import time, kvstore_client
            from tests.test_client import LAYOUT, prompt
            c = kvstore_client.connect({crash_daemon.socket!r}, transport="shm", lease_ttl_s=1.0)
            ns = c.namespace(LAYOUT, model="crash-reader")
            def drain(base, offsets, first):
                print("HOLDING", len(offsets), flush=True)
                time.sleep(600)
            ns.load_blocks(ns.keys(prompt(101, {3 * T})), drain)
        """)
        try:
            assert wait_line(child, "HOLDING").split() == ["HOLDING", "3"]
            assert c.stats()["active_leases"] == 1
            c.evict("host")                            # pinned blocks must stay in host
            assert ns.lookup_result(ns.keys(ids)).per_tier.get("host") == 3
        finally:
            kill(child)
        poll(lambda: c.stats()["active_leases"] == 0, "the dead reader's lease expiring")
        c.evict("host")                                # unpinned now: evictable
        assert ns.lookup_result(ns.keys(ids)).per_tier.get("host", 0) == 0
        out = torch.zeros_like(kv)
        assert ns.load(ids, out=out) == 3 * T          # back from SSD, intact
        assert np.array_equal(bits_t(out).numpy(), bits_t(kv).numpy())
