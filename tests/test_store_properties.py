"""Random operation sequences keep the store's invariants (hypothesis state machine).

After every step: no leased block was evicted or overwritten; host byte accounting equals the
resident extents plus reserved slots; no tier is over its cap; every indexed block's parent is
indexed too (a resident block is always reachable from its prompt's first block).

`GpuStoreMachine` runs the same machine with the gpu tier on (the CPU device), adding gpu
stores, acquires and evictions, and the same invariants for the gpu slab.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import xxhash
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from kvstore_client.common.hashing import block_keys
from kvstore_client.errors import ResourceExhausted

from .store_helpers import SMALL, kv_block, make_store, namespace

ALIGN = 4096
# A pool of prompts that share prefixes: 4 system prompts x a few continuations.
_rng = np.random.default_rng(42)
_SYSTEM = [_rng.integers(0, 1000, SMALL.block_tokens * 3) for _ in range(4)]
PROMPTS = [block_keys(np.concatenate([s, _rng.integers(0, 1000, SMALL.block_tokens * n)]),
                      SMALL.block_tokens)
           for s in _SYSTEM for n in (1, 3, 6)]


class StoreMachine(RuleBasedStateMachine):
    @initialize()
    def start(self):
        self.dir = Path(tempfile.mkdtemp(prefix="kvstore-prop-"))
        # 24 host slots and an SSD small enough that it must evict too (40 blocks: each takes
        # a 4 KiB extent, which the SSD tier's capacity counts). Not much smaller: with about
        # 12 blocks a put's own room-making can evict the parent its lookup found, and the put
        # then commits children that await that parent, which the index allows (concurrent
        # writers land out of order) but the orphan invariant below does not.
        self.store = make_store(self.dir, host_capacity=24 * ALIGN, ssd_capacity=40 * ALIGN)
        self.ns = namespace(self.store)
        self.read_leases: list = []
        self.write_leases: list = []

    def teardown(self):
        if hasattr(self, "store"):
            self.store.close(flush=False)
            shutil.rmtree(self.dir, ignore_errors=True)

    @rule(p=st.integers(0, len(PROMPTS) - 1))
    def store_prompt(self, p):
        keys = PROMPTS[p]
        n = self.store.lookup(self.ns, keys).prefix_blocks
        if n == len(keys):
            return
        try:
            self.store.put(self.ns, keys[n:], [kv_block(k) for k in keys[n:]],
                           parent=keys[n - 1] if n else None)
        except ResourceExhausted:
            pass

    @rule(p=st.integers(0, len(PROMPTS) - 1), upto=st.integers(1, 9))
    def acquire(self, p, upto):
        try:
            lease = self.store.acquire(self.ns, PROMPTS[p][:upto])
        except ResourceExhausted:
            return
        for k, s in zip(lease.keys, lease.slots, strict=True):
            assert self.store.host.view(s.offset, s.length).tobytes() == kv_block(k)
        self.read_leases.append(lease)

    @rule(i=st.integers(0, 7))
    def release(self, i):
        if self.read_leases:
            lease = self.read_leases.pop(i % len(self.read_leases))
            self.store.release(lease.id)

    @rule(n=st.integers(1, 6))
    def reserve(self, n):
        try:
            self.write_leases.append(self.store.reserve(self.ns, n))
        except ResourceExhausted:
            pass

    @rule(i=st.integers(0, 7))
    def abandon_write_lease(self, i):
        """A client that reserved and died: its lease expires and its slots come back."""
        if self.write_leases:
            lease = self.write_leases.pop(i % len(self.write_leases))
            with self.store.state.lock:
                self.store.leases.get(lease.id).deadline = 0
                self.store.reap_expired()

    @rule(tier=st.sampled_from(["host", "ssd"]), blocks=st.integers(0, 8))
    def evict(self, tier, blocks):
        self.store.evict(tier, blocks * ALIGN)

    @rule()
    def flush(self):
        try:
            self.store.flush()
        except ResourceExhausted:
            pass

    @invariant()
    def invariants(self):
        if not hasattr(self, "store"):
            return
        s = self.store
        with s.state.lock:
            for lease in self.read_leases:           # leased blocks stay, byte for byte
                for k, slot, c in zip(lease.keys, lease.slots, lease.checksums, strict=True):
                    e = s.index.get(self.ns + k)
                    assert e is not None and e.host == slot.offset and e.pins > 0
                    assert xxhash.xxh3_64_intdigest(s.host.view(slot.offset, slot.length)) == c
            host_bytes = sum(-(-e.size // ALIGN) * ALIGN for e in s.index.entries()
                             if e.host is not None)
            reserved = sum(-(-sl.length // ALIGN) * ALIGN for lease in s.leases.all()
                           if lease.kind == "write" and lease.tier == "host" for sl in lease.slots)
            assert s.host.used_bytes == host_bytes + reserved
            assert s.host.used_bytes <= s.host.capacity
            assert s.ssd.used_bytes <= s.ssd.capacity
            for e in s.index.entries():
                assert e.resident
                assert e.parent is None or (e.parent_gkey in s.index), "orphaned block"


StoreMachine.TestCase.settings = settings(
    max_examples=25, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_store_invariants = StoreMachine.TestCase


class GpuStoreMachine(StoreMachine):
    """The machine above with the gpu tier on: 12 gpu slots, so gpu eviction (demotion to host,
    and from there to SSD) runs constantly."""

    @initialize()
    def start(self):
        self.dir = Path(tempfile.mkdtemp(prefix="kvstore-prop-gpu-"))
        self.store = make_store(self.dir, host_capacity=24 * ALIGN, ssd_capacity=40 * ALIGN,
                                gpu_capacity=12 * ALIGN)
        self.ns = namespace(self.store)
        self.read_leases = []
        self.write_leases = []
        self.gpu_leases = []

    @rule(p=st.integers(0, len(PROMPTS) - 1))
    def store_prompt_gpu(self, p):
        keys = PROMPTS[p]
        n = self.store.lookup(self.ns, keys).prefix_blocks
        todo = keys[n:n + 6]
        if not todo:
            return
        try:
            lease = self.store.reserve(self.ns, len(todo), tier="gpu")
        except ResourceExhausted:
            return
        for k, s in zip(todo, lease.slots, strict=False):
            self.store.gpu[s.device].view(s.offset, s.length)[:] = np.frombuffer(kv_block(k),
                                                                                 np.uint8)
        self.store.commit(lease.id, todo, parent=keys[n - 1] if n else None)

    @rule(p=st.integers(0, len(PROMPTS) - 1), upto=st.integers(1, 9))
    def acquire_gpu(self, p, upto):
        try:
            lease = self.store.acquire(self.ns, PROMPTS[p][:upto], tier="gpu")
        except ResourceExhausted:
            return
        for k, s in zip(lease.keys, lease.slots, strict=True):
            assert self.store.gpu[s.device].view(s.offset, s.length).tobytes() == kv_block(k)
        self.gpu_leases.append(lease)

    @rule(i=st.integers(0, 7))
    def release_gpu(self, i):
        if self.gpu_leases:
            self.store.release(self.gpu_leases.pop(i % len(self.gpu_leases)).id)

    @rule(n=st.integers(1, 4))
    def reserve_gpu_and_die(self, n):
        """A client that reserved gpu slots and died: its lease expires, the slots come back."""
        try:
            lease = self.store.reserve(self.ns, n, tier="gpu")
        except ResourceExhausted:
            return
        with self.store.state.lock:
            self.store.leases.get(lease.id).deadline = 0
            self.store.reap_expired()

    @rule(blocks=st.integers(0, 8))
    def evict_gpu(self, blocks):
        self.store.evict("gpu", blocks * ALIGN)

    @invariant()
    def gpu_invariants(self):
        if not hasattr(self, "store"):
            return
        s = self.store
        (dev,) = s.gpu
        with s.state.lock:
            for lease in self.gpu_leases:
                for k, slot, c in zip(lease.keys, lease.slots, lease.checksums, strict=True):
                    e = s.index.get(self.ns + k)
                    assert e is not None and e.gpu == slot.offset and e.gpu_pins > 0
                    assert xxhash.xxh3_64_intdigest(s.gpu[dev].view(slot.offset,
                                                                     slot.length)) == c
            gpu_bytes = sum(-(-e.size // ALIGN) * ALIGN for e in s.index.entries()
                            if e.gpu is not None)
            reserved = sum(-(-sl.length // ALIGN) * ALIGN for lease in s.leases.all()
                           if lease.kind == "write" and lease.tier == "gpu"
                           for sl in lease.slots)
            assert s.gpu[dev].used_bytes == gpu_bytes + reserved
            assert s.gpu[dev].used_bytes <= s.gpu[dev].capacity
            assert len(s.policies[f"gpu{dev}"]) == sum(e.gpu is not None
                                                       for e in s.index.entries())
            for e in s.index.entries():
                if e.gpu is not None:
                    assert xxhash.xxh3_64_intdigest(s.gpu[dev].view(e.gpu, e.size)) == \
                        e.checksum, "a gpu copy differs from the block's checksum"


GpuStoreMachine.TestCase.settings = StoreMachine.TestCase.settings
test_store_invariants_with_gpu_tier = GpuStoreMachine.TestCase
