"""The gpu tier as a tier, on the CPU device, with a real daemon and real engine processes.

Each engine is its own interpreter: it connects, opens the daemon's device pool by handle (the
CPU device's shared-memory slab), and moves blocks between that pool and its own paged cache
with `PagedCopier` (`kvstore_client.device_kv.DeviceKV`). Blocks are generated from seeds, so
any process can rebuild the bytes a block must hold and compare them bit for bit.
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
from kvstore_client import KVLayout, connect
from kvstore_client import gpu as cg
from kvstore_client.device_kv import DeviceKV

from tests.daemon import cleanup, start_daemon

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=16, dtype="bfloat16")
T = LAYOUT.block_tokens
BB = LAYOUT.block_bytes                      # 16 KiB a block
DEADLINE_S = 30.0
LEASE_TTL_S = 5.0           # the killed client's leases (below DEADLINE_S: they expire in it)
# How long the module daemon keeps an expired write lease's slots unused (kvstore/held_writes.py).
# The default, 30 s, equals DEADLINE_S: a poll for the slots raced the hold and lost on a loaded
# machine. Long enough to see the slots held right after expiry, well inside DEADLINE_S.
WRITE_HOLD_S = 5.0

# The engine both sides run: a vLLM-layout paged cache whose block b holds seed-derived KV.
ENGINE = """
import sys, numpy as np, torch, kvstore_client
from kvstore_client import gpu as cg
from kvstore_client.device_kv import DeviceKV
from tests.test_gpu_tier_cpu import LAYOUT, engine_cache, keys_for
"""


def engine_cache(num_blocks: int, seed: int | None) -> tuple[list[torch.Tensor], cg.PagedKVCache]:
    """vLLM flash-attn layout [2, blocks, T, H, D] per layer; block b of seed s is
    deterministic (seed None: zeros)."""
    L = LAYOUT
    shape = (2, num_blocks, L.block_tokens, L.num_kv_heads, L.head_dim)
    if seed is None:
        raw = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(L.num_layers)]
    else:
        g = torch.Generator().manual_seed(seed)
        raw = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(L.num_layers)]
    return raw, cg.PagedKVCache.from_vllm(raw)


def canonical(cache: cg.PagedKVCache, b: int) -> torch.Tensor:
    ts = cache.tensors
    return torch.stack([torch.stack([ts[2 * i][b], ts[2 * i + 1][b]])
                        for i in range(len(ts) // 2)]).contiguous()


def keys_for(ns, seed: int, n: int) -> list[bytes]:
    tokens = np.random.default_rng(seed).integers(0, 50_000, size=n * T)
    return ns.keys(tokens)


def gpu_daemon(tmp_path: Path, **over):
    cfg = {"gpu.enabled": "true", "gpu.backend": "cpu", "gpu.capacity": "1MiB",
           "host.capacity": "2MiB", "ssd.capacity": "64MiB"}
    cfg.update(over)
    return start_daemon(tmp_path, cfg)


def run_engine(code: str, timeout: float = 120) -> str:
    proc = subprocess.run([sys.executable, "-c", ENGINE + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, f"engine failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def poll(fn, what: str) -> None:
    end = time.monotonic() + DEADLINE_S
    while not fn():
        if time.monotonic() > end:
            raise AssertionError(f"{what} did not happen within {DEADLINE_S} s")
        time.sleep(0.1)


def tiers(c) -> dict:
    return c.stats()["tiers"]


def first_lossy_demotion(address: str, codec: str) -> None:
    """Have the daemon make its first demotion in `codec` now, and wait for the error sample it
    takes. The first lossy demotion measures the codec's error, which loads torch into the
    daemon (tens of seconds on a loaded 2-core machine) inside whatever call demotes: an
    engine's Reserve that evicts inline would spend its deadline on that load instead of on
    the eviction a test means to check."""
    with connect(address, timeout=DEADLINE_S * 4) as c:
        ns = c.namespace(LAYOUT, model="gpu/first-lossy-demotion", codec=codec)
        kv = torch.randn(LAYOUT.num_layers, 2, T, LAYOUT.num_kv_heads, LAYOUT.head_dim,
                         generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
        assert ns.store_keys(keys_for(ns, 3, 1), kv) == 1
        c.evict("host")
        poll(lambda: c.stats()["counters"].get(f"codec_error_samples_{codec}", 0) >= 1,
             f"the daemon's first {codec} error sample")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    d = gpu_daemon(tmp_path_factory.mktemp("gputier"),
                   **{"leases.expired_write_hold_s": str(WRITE_HOLD_S)})
    try:
        yield d
    finally:
        cleanup(d)


def test_daemon_advertises_the_cpu_device_pool(daemon) -> None:
    with connect(daemon.address) as c:
        c.namespace(LAYOUT, model="gpu/advertise")
        (pool,) = c.gpu_pools
        assert pool["kind"] == cg.CPU_POOL_KIND and pool["device"] == 0
        assert pool["size"] == 1 << 20 and pool["name"]
        assert "gpu" in tiers(c)
    assert "using the CPU device" in daemon.output()


def test_engine_a_stores_in_gpu_engine_b_gathers_the_same_bytes(daemon) -> None:
    # Engine A: blocks 3, 0, 5, 1 of its cache hold the prompt's 4 blocks.
    out = run_engine(f"""
        c = kvstore_client.connect({daemon.address!r}, transport="shm")
        ns = c.namespace(LAYOUT, model="gpu/share")
        _, cache = engine_cache(8, seed=11)
        dkv = DeviceKV(ns, cache)
        print(dkv.store_keys(keys_for(ns, 1, 4), [3, 0, 5, 1]))
        print(ns.lookup_result(keys_for(ns, 1, 4)).per_tier["gpu"])
    """)
    assert out.split() == ["4", "4"]
    # Engine B: another process acquires the prefix in the gpu tier and gathers it into its
    # own cache blocks 7, 2, 4, 6 through the opened pool.
    out = run_engine(f"""
        from tests.test_gpu_tier_cpu import canonical
        c = kvstore_client.connect({daemon.address!r}, transport="shm")
        ns = c.namespace(LAYOUT, model="gpu/share")
        _, ref = engine_cache(8, seed=11)
        _, mine = engine_cache(8, seed=None)
        dkv = DeviceKV(ns, mine)
        n = dkv.load_keys(keys_for(ns, 1, 4), [7, 2, 4, 6])
        same = all(torch.equal(canonical(mine, b2).view(torch.int16),
                               canonical(ref, b).view(torch.int16))
                   for b, b2 in zip([3, 0, 5, 1], [7, 2, 4, 6]))
        untouched = not any(canonical(mine, b).any() for b in (0, 1, 3, 5))
        print(n, same, untouched)
    """)
    assert out.split() == ["4", "True", "True"]
    with connect(daemon.address) as c:
        assert c.stats()["active_leases"] == 0
        ns = c.namespace(LAYOUT, model="gpu/share")
        # The host path reads gpu-only blocks too (copied down, verified).
        kv = torch.zeros((LAYOUT.num_layers, 2, 4 * T, LAYOUT.num_kv_heads, LAYOUT.head_dim),
                         dtype=torch.bfloat16)
        assert ns.load_keys(keys_for(ns, 1, 4), kv) == 4
        _, ref = engine_cache(8, seed=11)
        assert torch.equal(kv[:, :, :T].view(torch.int16), canonical(ref, 3).view(torch.int16))


@pytest.mark.parametrize("codec", ["lossless", "int8"])
def test_watermark_eviction_demotes_to_host_then_ssd_and_acquire_promotes_back(
        tmp_path: Path, codec: str) -> None:
    # gpu: 16 slots; host: 24 slots; 48 blocks written to gpu push the first ones to SSD.
    d = gpu_daemon(tmp_path, **{"gpu.capacity": str(16 * BB), "host.capacity": str(24 * BB)})
    try:
        if codec != "lossless":
            first_lossy_demotion(d.address, codec)
        with connect(d.address) as c:
            to_ssd_before = c.stats()["counters"].get("bytes_host_to_ssd", 0)
        out = run_engine(f"""
            c = kvstore_client.connect({d.address!r}, transport="shm")
            ns = c.namespace(LAYOUT, model="gpu/evict", codec={codec!r})
            _, cache = engine_cache(48, seed=21)
            dkv = DeviceKV(ns, cache)
            keys = keys_for(ns, 2, 48)
            n = 0
            for i in range(0, 48, 8):   # prompt grows 8 blocks at a time
                n += dkv.store_keys(keys[:i + 8], list(range(i + 8)))
            print(n)
        """)
        assert out.split() == ["48"]
        with connect(d.address) as c:
            ns = c.namespace(LAYOUT, model="gpu/evict", codec=codec)
            t = tiers(c)
            assert t["gpu"]["evictions"] > 0 and t["host"]["evictions"] > 0
            assert t["gpu"]["used_bytes"] <= 16 * BB
            counters = c.stats()["counters"]
            assert counters["bytes_gpu_to_host"] > 0
            assert counters["bytes_host_to_ssd"] > to_ssd_before
            per = ns.lookup_result(keys_for(ns, 2, 48)).per_tier
            assert per["gpu"] == 0 and per["ssd"] > 0      # the prefix start went down
            _, ref = engine_cache(48, seed=21)
            _, mine = engine_cache(12, seed=None)
            n = DeviceKV(ns, mine).load_keys(keys_for(ns, 2, 12), list(range(12)))
            assert n == 12
            assert ns.lookup_result(keys_for(ns, 2, 12)).per_tier["gpu"] == 12
            for b in range(12):
                got, want = canonical(mine, b), canonical(ref, b)
                if codec == "lossless":
                    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), b
                else:
                    err = (got.float() - want.float()).norm() / want.float().norm()
                    assert err < 0.02, (b, float(err))
            assert c.stats()["active_leases"] == 0
    finally:
        cleanup(d)


def test_sigkilled_client_holding_gpu_slots_leaks_nothing(daemon) -> None:
    """A client holding gpu slots is SIGKILLed: its leases expire, its slots come back after
    the write hold (a stalled, not dead, writer could still copy into them until then).

    While it lives, the child renews its two leases when the test asks, right before each
    check, so a check needs the lease to outlast one RPC, not a renewal thread to keep pace on
    a loaded machine; once killed, nothing renews them and they expire within LEASE_TTL_S."""
    with connect(daemon.address) as c:
        ns = c.namespace(LAYOUT, model="gpu/crash")
        c.evict("gpu")                           # other tests' blocks: out of the way
        _, cache = engine_cache(4, seed=31)
        assert DeviceKV(ns, cache).store_keys(keys_for(ns, 3, 4), range(4)) == 4
        base = tiers(c)["gpu"]["used_bytes"]
        child = subprocess.Popen([sys.executable, "-c", ENGINE + textwrap.dedent(f"""
            from kvstore_client._proto import kvstore_pb2 as pb
            ttl = {LEASE_TTL_S}
            c = kvstore_client.connect({daemon.address!r}, transport="shm")
            ns = c.namespace(LAYOUT, model="gpu/crash")
            # a write lease on 6 fresh gpu slots and a read lease on the stored blocks
            w = c.call("Reserve", pb.ReserveRequest(namespace_id=ns.ns_id, count=6,
                                                    tier="gpu", ttl_s=ttl)).lease
            r = c.call("Acquire", pb.AcquireRequest(namespace_id=ns.ns_id,
                                                    keys=keys_for(ns, 3, 4), tier="gpu",
                                                    ttl_s=ttl)).lease
            print("HOLDING", len(w.slots), len(r.slots), flush=True)
            for _ in sys.stdin:                  # the test asks before each of its checks
                for lid in (w.lease_id, r.lease_id):
                    c.call("RenewLease", pb.RenewLeaseRequest(lease_id=lid, ttl_s=ttl))
                print("RENEWED", flush=True)
        """)], cwd=ROOT, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE)

        def renewed() -> None:
            child.stdin.write("renew\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "RENEWED", child.stderr.read()

        try:
            line = child.stdout.readline()
            assert line.split() == ["HOLDING", "6", "4"], child.stderr.read()
            renewed()
            assert tiers(c)["gpu"]["used_bytes"] == base + 6 * BB
            renewed()
            assert c.stats()["active_leases"] == 2
            renewed()
            c.evict("gpu")                       # pinned by the child's read lease: stays
            assert ns.lookup_result(keys_for(ns, 3, 4)).per_tier["gpu"] == 4
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(10)
            for f in (child.stdin, child.stdout, child.stderr):
                f.close()
        # The leases were reaped after the last Stats that still counted them began: the
        # slots are surely held if the next look comes well inside the hold from that start.
        end, last_counted = time.monotonic() + DEADLINE_S, None
        while True:
            asked = time.monotonic()
            if c.stats()["active_leases"] == 0:
                break
            assert time.monotonic() < end, "the dead client's leases did not expire"
            last_counted = asked
            time.sleep(0.1)
        st = c.stats()
        if last_counted is not None and time.monotonic() - last_counted < WRITE_HOLD_S / 2:
            assert st["counters"].get("expired_write_slots_held") == 6
            assert st["tiers"]["gpu"]["used_bytes"] == base + 6 * BB
        poll(lambda: tiers(c)["gpu"]["used_bytes"] == base, "its gpu slots coming back")
        assert c.stats()["counters"].get("expired_write_slots_held", 0) == 0
        c.evict("gpu")                           # unpinned now: demoted to host
        assert tiers(c)["gpu"]["used_bytes"] == 0
        per = ns.lookup_result(keys_for(ns, 3, 4)).per_tier
        assert per["gpu"] == 0 and per["host"] == 4
        _, mine = engine_cache(4, seed=None)
        assert DeviceKV(ns, mine).load_keys(keys_for(ns, 3, 4), range(4)) == 4
        for b in range(4):
            assert torch.equal(canonical(mine, b).view(torch.int16),
                               canonical(cache, b).view(torch.int16))


def test_leased_gpu_block_is_never_evicted(tmp_path: Path) -> None:
    d = gpu_daemon(tmp_path, **{"gpu.capacity": str(8 * BB), "host.capacity": str(64 * BB)})
    try:
        with connect(d.address) as c:
            ns = c.namespace(LAYOUT, model="gpu/pinned")
            _, cache = engine_cache(40, seed=41)
            dkv = DeviceKV(ns, cache)
            held = keys_for(ns, 4, 2)
            assert dkv.store_keys(held, [0, 1]) == 2
            from kvstore_client._proto import kvstore_pb2 as pb
            lease = c.call("Acquire", pb.AcquireRequest(namespace_id=ns.ns_id, keys=held,
                                                        tier="gpu", ttl_s=60)).lease
            slots = [(s.offset, s.length) for s in lease.slots]
            for i in range(6):                   # 36 more blocks through an 8-slot tier
                dkv.store_keys(keys_for(ns, 100 + i, 6), range(2 + 6 * i, 8 + 6 * i))
                c.evict("gpu")
            assert tiers(c)["gpu"]["evictions"] >= 36
            assert ns.lookup_result(held).per_tier["gpu"] == 2
            for (off, n), b in zip(slots, [0, 1], strict=True):
                got = torch.from_numpy(dkv.pool.view(off, n).copy()).view(torch.bfloat16)
                assert torch.equal(got.view(LAYOUT.block_shape).view(torch.int16),
                                   canonical(cache, b).view(torch.int16))
            c.release(lease.lease_id)
            c.evict("gpu")
            assert ns.lookup_result(held).per_tier["gpu"] == 0
    finally:
        cleanup(d)


def test_bad_gpu_requests_say_what_is_wrong(daemon) -> None:
    from kvstore_client import InvalidArgument
    from kvstore_client._proto import kvstore_pb2 as pb

    with connect(daemon.address) as c:
        ns = c.namespace(LAYOUT, model="gpu/bad")
        with pytest.raises(InvalidArgument, match="device 3"):
            c.call("Reserve", pb.ReserveRequest(namespace_id=ns.ns_id, count=1, tier="gpu",
                                                device=3))
        _, cache = engine_cache(2, seed=1)
        with pytest.raises(Exception, match="no gpu pool for device 2"):
            DeviceKV(ns, cache, device=2)
