"""KV events from the store: every change of residency, with its tier's medium, token ids and
parent chain, and the stream's protection against bad input and slow consumers.

A real store (real LMDB, shared memory, ZMQ sockets) publishing to a subscriber that works as a
router does (tests/events_helpers.py)."""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest
from kvstore_client import KVLayout, NamespaceSpec
from kvstore_client.errors import InvalidArgument

from kvstore.config import EngineStreamConfig, StoreConfig
from kvstore.events.errors import EventsAddressError
from kvstore.events.texts import own_hash
from kvstore.store import Store
from tests.events_helpers import Sub, firsts, free_port, held, removed, stored, zmq
from tests.store_helpers import SMALL, kv_block, random_prompt

T = SMALL.block_tokens


def make(tmp_path, *, gpu: int = 0, host: int = 1 << 20, **events) -> Store:
    cfg = StoreConfig(data_dir=str(tmp_path / "data"))
    cfg.host.capacity = host
    cfg.ssd.capacity = 64 << 20
    if gpu:
        cfg.gpu.enabled, cfg.gpu.capacity, cfg.gpu.backend = True, gpu, "cpu"
    cfg.events.enabled = True
    cfg.events.endpoint = "tcp://127.0.0.1:0"
    cfg.events.replay_endpoint = "tcp://127.0.0.1:0"
    cfg.events.interval_ms = 2.0
    for k, v in events.items():
        setattr(cfg.events, k, v)
    return Store(cfg.check())


def sub_of(store: Store, name: str = "node") -> Sub:
    pub, replay = store.events.addresses[name]
    return Sub(pub, replay)


def put(store: Store, ns: bytes, keys: list[bytes], tokens, tier: str = "host",
        parent: bytes | None = None) -> None:
    lease = store.reserve(ns, len(keys), tier=tier)
    for k, s in zip(keys, lease.slots, strict=True):
        pool = store.gpu[s.device] if tier == "gpu" else store.host
        pool.view(s.offset, s.length)[:] = np.frombuffer(kv_block(k), np.uint8)
    store.commit(lease.id, keys, parent=parent, token_ids=[int(t) for t in tokens])


def register(store: Store, model: str = "m", **kw) -> bytes:
    return store.register_namespace(NamespaceSpec(model=model, layout=SMALL, **kw)).ns_id


def test_every_residency_change_is_published_with_its_medium(tmp_path):
    rng = np.random.default_rng(1)
    with make(tmp_path) as store:
        sub = sub_of(store)
        try:
            ns = register(store)
            tokens, keys = random_prompt(rng, 4)
            hs = [own_hash(ns + k) for k in keys]
            put(store, ns, keys, tokens)
            evs = sub.wait(lambda e: len(firsts(stored(e, "CPU"))) == 4, what="stored")
            cpu = firsts(stored(evs, "CPU"))
            assert [e["block_hashes"] for e in cpu] == [[h] for h in hs]
            assert [e["parent_block_hash"] for e in cpu] == [None, *hs[:-1]]
            assert [t for e in cpu for t in e["token_ids"]] == tokens.tolist()
            assert all(e["block_size"] == T for e in cpu)

            store.evict("host")                                     # demoted to SSD
            evs = sub.wait(lambda e: held(e) == {"STORAGE": set(hs)}, what="demotion")
            # the SSD copy is announced before the host copy goes: never a moment without
            first_removal = next(i for i, e in enumerate(evs) if e["type"] == "BlockRemoved")
            assert len(firsts(stored(evs[:first_removal], "STORAGE"))) == 4

            lease = store.acquire(ns, keys)                         # promoted: text from LMDB
            store.release(lease.id)
            sub.wait(lambda e: held(e) == {"STORAGE": set(hs), "CPU": set(hs)},
                     what="promotion")

            store.evict("ssd")                                      # evicted from SSD
            sub.wait(lambda e: held(e) == {"CPU": set(hs)}, what="ssd eviction")

            store.delete(ns, keys[2:])                              # deleted
            sub.wait(lambda e: held(e) == {"CPU": set(hs[:2])}, what="deletion")
            store.delete(ns)                                        # the whole namespace
            sub.wait(lambda e: not held(e), what="namespace deletion")
            assert store.events.recorder.overflows == 0
        finally:
            sub.close()


def test_gpu_tier_blocks_are_gpu_medium_and_demote_to_cpu(tmp_path):
    rng = np.random.default_rng(2)
    with make(tmp_path, gpu=64 * 4096) as store:
        sub = sub_of(store)
        try:
            ns = register(store)
            tokens, keys = random_prompt(rng, 3)
            hs = {own_hash(ns + k) for k in keys}
            put(store, ns, keys, tokens, tier="gpu")
            evs = sub.wait(lambda e: held(e) == {"GPU": hs}, what="gpu store")
            gpu = firsts(stored(evs, "GPU"))
            assert [t for e in gpu for t in e["token_ids"]] == tokens.tolist()
            store.evict("gpu")                                      # demoted to host
            sub.wait(lambda e: held(e) == {"CPU": hs}, what="gpu demotion")
        finally:
            sub.close()


def test_stop_clears_and_restart_reannounces_with_later_sequence_numbers(tmp_path):
    rng = np.random.default_rng(3)
    tokens, keys = random_prompt(rng, 3)
    port, rport = free_port(), free_port()
    ev = {"endpoint": f"tcp://127.0.0.1:{port}", "replay_endpoint": f"tcp://127.0.0.1:{rport}"}
    store = make(tmp_path, **ev)
    sub = sub_of(store)
    try:
        ns = register(store)
        hs = {own_hash(ns + k) for k in keys}
        put(store, ns, keys, tokens)
        sub.wait(lambda e: held(e) == {"CPU": hs})
        store.close()                       # flushes to SSD, then AllBlocksCleared
        evs = sub.wait(lambda e: e and e[-1]["type"] == "AllBlocksCleared", what="stop")
        assert held(evs[:-1])["CPU"] == hs and held(evs) == {}
        last = sub.last_seq()
        store = make(tmp_path, **ev)
        evs = sub.wait(lambda e: held(e) == {"STORAGE": hs}, since=last + 1, what="restart")
        assert evs[0]["type"] == "AllBlocksCleared"
        # chained as before, token ids from the blocks' SSD meta
        assert [t for e in firsts(stored(evs)) for t in e["token_ids"]] == tokens.tolist()
        assert min(s for s in sub.batches if s > last) == last + 1   # a clean stop: no gap
    finally:
        sub.close()
        store.close()


def test_crash_restart_never_goes_back(tmp_path):
    """A crash leaves no clean sequence file: the next start is above every number sent."""
    from kvstore.events.seqfile import SeqFile
    f = tmp_path / "node.seq"
    a = SeqFile(f)
    sent = [a.take() for _ in range(5)]
    b = SeqFile(f)                          # no close(): as after kill -9
    assert b.take() > max(sent)
    b.close()
    c = SeqFile(f)
    assert c.take() == b.next               # clean: goes on where it stopped
    f.write_text("garbage\n")
    now_us = time.time_ns() // 1000
    assert SeqFile(f).take() >= now_us      # unreadable: the clock


def test_a_late_subscriber_is_told_what_is_held(tmp_path):
    """A router that subscribes after the blocks were stored (vllm-router fetches no batch
    from before the first it sees) still learns them: each subscription makes the stream
    announce what the daemon holds, without clearing anything."""
    rng = np.random.default_rng(8)
    with make(tmp_path) as store:
        ns = register(store)
        tokens, keys = random_prompt(rng, 3)
        put(store, ns, keys, tokens)
        store.evict("host")
        hs = {own_hash(ns + k) for k in keys}
        early = sub_of(store)
        try:
            early.wait(lambda e: held(e) == {"STORAGE": hs} and any(
                x["type"] == "AllBlocksCleared" for x in e), what="the start announcement")
            late = Sub(store.events.addresses["node"][0])    # no replay: only what comes
            try:
                evs = late.wait(lambda e: held(e) == {"STORAGE": hs}, what="late subscriber")
                assert not any(e["type"] == "AllBlocksCleared" for e in evs)
            finally:
                late.close()
            # the early subscriber heard repeats only: its view is unchanged
            assert held(early.events()) == {"STORAGE": hs}
            counters = store.events.streams[0].counters
            early.wait(lambda e: counters["subscriptions"] >= 2, what="subscriptions counted")
        finally:
            early.close()


def test_sdk_sees_wants_token_ids_only_where_published(tmp_path):
    with make(tmp_path, models=["llama-*"]) as store:
        yes = register(store, "llama-3")
        other = register(store, "qwen")
        rank1 = register(store, "llama-3", shard_rank=1, shard_size=2)
        external = register(store, "llama-3", hash_scheme="external:vllm-sha256-abc")
        assert store.wants_token_ids(yes)
        assert not store.wants_token_ids(other)
        assert not store.wants_token_ids(rank1)
        assert not store.wants_token_ids(external)   # named by its engine's events instead
        lease = store.reserve(yes, 2)
        with pytest.raises(InvalidArgument, match="3 token ids for 2 keys"):
            store.commit(lease.id, [b"a" * 32, b"b" * 32], token_ids=[1, 2, 3])
        with pytest.raises(InvalidArgument, match="unsigned 32-bit"):
            store.commit(lease.id, [b"a" * 32], token_ids=[-1] * T)
        store.release(lease.id)


def test_events_off_keeps_nothing(tmp_path):
    cfg = StoreConfig(data_dir=str(tmp_path / "data"))
    cfg.host.capacity = 1 << 20
    with Store(cfg.check()) as store:
        assert store.events is None and store.index.listener is None
        ns = register(store)
        assert not store.wants_token_ids(ns)
        rng = np.random.default_rng(4)
        tokens, keys = random_prompt(rng, 2)
        put(store, ns, keys, tokens)                 # accepted, not kept
        store.evict("host")
        import msgpack
        assert set(msgpack.unpackb(store.ssd.get_meta(ns + keys[0]))) == {"p", "s", "c", "t"}


def test_overflow_starts_every_stream_over(tmp_path, caplog):
    rng = np.random.default_rng(5)
    with make(tmp_path, max_queue=16) as store:
        sub = sub_of(store)
        try:
            ns = register(store)
            tokens, keys = random_prompt(rng, 64)
            with caplog.at_level(logging.WARNING, logger="kvstore.events"):
                put(store, ns, keys, tokens)        # 64 changes at once: past max_queue
                hs = {own_hash(ns + k) for k in keys}
                evs = sub.wait(lambda e: held(e) == {"CPU": hs}, what="recovery")
            assert store.events.recorder.overflows >= 1
            assert any(e["type"] == "AllBlocksCleared" for e in evs[1:])
            assert "fell 16 residency changes behind" in caplog.text
        finally:
            sub.close()


def test_a_burst_of_stores_wakes_the_publisher_once_and_a_later_store_again(tmp_path):
    """The wake-up is a syscall made under the store lock: while changes keep coming the
    publisher looks at the queue on its own timer, and once it has gone back to sleep the next
    change still wakes it (nothing waits in the queue unannounced)."""
    rng = np.random.default_rng(12)
    with make(tmp_path) as store:
        sub = sub_of(store)
        rec = store.events.recorder
        wakes: list[float] = []
        wake = rec.wake
        rec.wake = lambda: (wakes.append(time.monotonic()), wake())
        try:
            ns = register(store)
            n = 0
            for _ in range(20):             # each store announced before the next one
                tokens, keys = random_prompt(rng, 2)
                put(store, ns, keys, tokens)
                n += 2
                sub.wait(lambda e, n=n: len(firsts(stored(e))) == n, what="a store")
            # one wake-up for the burst (a stall of the machine past LINGER_S may add one)
            assert 1 <= len(wakes) <= 3
            deadline = time.monotonic() + 20
            while rec.woken and time.monotonic() < deadline:
                sub.pump(0.05)
            assert not rec.woken, "the publisher never went back to sleep"
            before = len(wakes)
            tokens, keys = random_prompt(rng, 2)
            put(store, ns, keys, tokens)
            sub.wait(lambda e: len(firsts(stored(e))) == n + 2, what="the store after sleep")
            assert len(wakes) == before + 1
        finally:
            sub.close()


def test_replay_and_bad_replay_requests(tmp_path, caplog):
    rng = np.random.default_rng(6)
    with make(tmp_path) as store:
        sub = sub_of(store)
        try:
            ns = register(store)
            for _ in range(3):
                tokens, keys = random_prompt(rng, 2)
                put(store, ns, keys, tokens)
            sub.wait(lambda e: len(firsts(stored(e))) == 6)
            seqs = sorted(sub.batches)
            assert sub.replay_from(seqs[-2]) == seqs[-2:]           # from a given number on
            assert sub.replay_from(0) == seqs                        # long gone: all it has
            ctx = zmq.Context()
            bad = ctx.socket(zmq.DEALER)
            bad.connect(store.events.addresses["node"][1])
            with caplog.at_level(logging.WARNING, logger="kvstore.events"):
                for junk in ([b"", b"xy"], [b"garbage"], [b"", b"12345678", b"more"]):
                    bad.send_multipart(junk)
                # stores go on, and a good request is still answered after the garbage
                tokens, keys = random_prompt(rng, 2)
                put(store, ns, keys, tokens)
                sub.wait(lambda e: len(firsts(stored(e))) == 8)
                deadline = 200
                while store.events.streams[0].counters["bad_replay_requests"] < 3 and deadline:
                    sub.pump(0.05)
                    deadline -= 1
                assert sub.replay_from(seqs[-1])[0] == seqs[-1]
            assert store.events.streams[0].counters["bad_replay_requests"] == 3
            assert "malformed replay request" in caplog.text
            assert not bad.poll(100)                                 # garbage gets no answer
            bad.close(0)
            ctx.term()
        finally:
            sub.close()


def test_a_consumer_that_never_reads_does_not_hold_stores_back(tmp_path):
    rng = np.random.default_rng(7)
    with make(tmp_path, hwm=4) as store:
        ctx = zmq.Context()
        stuck = ctx.socket(zmq.SUB)                  # subscribes, never reads
        stuck.setsockopt(zmq.RCVHWM, 1)
        stuck.setsockopt(zmq.SUBSCRIBE, b"")
        stuck.connect(store.events.addresses["node"][0])
        sub = sub_of(store)
        try:
            ns = register(store)
            n = 0
            for _ in range(50):
                tokens, keys = random_prompt(rng, 4)
                put(store, ns, keys, tokens)
                n += 4
            # every store went through; the publisher kept up (no overflow) and a reading
            # consumer, topped up from the replay buffer, has every block
            assert len(store.index) == n
            sub.wait(lambda e: len(firsts(stored(e))) == n, what="every block")
            assert store.events.recorder.overflows == 0
        finally:
            stuck.close(0)
            ctx.term()
            sub.close()


def test_an_address_in_use_is_refused_at_bind(tmp_path):
    port = free_port()
    ctx = zmq.Context()
    holder = ctx.socket(zmq.PUB)
    holder.bind(f"tcp://127.0.0.1:{port}")
    try:
        with pytest.raises(EventsAddressError, match=r"events.endpoint = 'tcp://127.0.0.1:\d+' "
                                                      "is already in use"):
            make(tmp_path, endpoint=f"tcp://127.0.0.1:{port}")
        # nothing was left behind: the next store binds and the data folder opens
        make(tmp_path).close()
    finally:
        holder.close(0)
        ctx.term()


# -- an engine's own events, relayed -----------------------------------------------------------

VLLM_LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=2 * T,
                       dtype="float16")


class FakeEngine:
    """Publishes what a vLLM engine with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 publishes: its
    GPU blocks' full hashes, parent, token ids (and, as vLLM's offloading connector does,
    placeholder CPU events for its own offloading tier)."""

    def __init__(self) -> None:
        import msgpack
        self.msgpack = msgpack
        self.ctx = zmq.Context()
        # PUB semantics; XPUB also shows when the daemon's subscription has arrived.
        self.pub = self.ctx.socket(zmq.XPUB)
        # As vLLM's publisher given a concrete address: it connects, the daemon binds.
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.pub.connect(self.endpoint)
        self.seq = 0
        self.subscribed = False

    def send(self, events: list[dict]) -> None:
        if not self.subscribed:
            assert self.pub.poll(30_000), "the daemon never subscribed to the engine"
            self.pub.recv()
            self.subscribed = True
        payload = self.msgpack.packb([1.0, events, 0], use_bin_type=True)
        self.pub.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def close(self) -> None:
        self.pub.close(0)
        self.ctx.term()


def _vllm_hashes(n: int, seed: int) -> list[bytes]:
    import hashlib
    return [hashlib.sha256(f"{seed}-{i}".encode()).digest() for i in range(n)]


@contextmanager
def relayed(tmp_path, replay: bool = False, **events):
    """A store relaying a FakeEngine on its merged stream "e0", a subscriber of that stream,
    and a vLLM namespace: (engine, store, sub, ns)."""
    engine = FakeEngine()
    eng = EngineStreamConfig(name="e0", source=engine.endpoint,
                             endpoint=f"tcp://127.0.0.1:{free_port()}",
                             replay_endpoint=f"tcp://127.0.0.1:{free_port()}" if replay else "")
    try:
        with make(tmp_path, endpoint="", replay_endpoint="", engines=[eng], **events) as store:
            sub = sub_of(store, "e0")
            try:
                ns = store.register_namespace(NamespaceSpec(
                    model="m", layout=VLLM_LAYOUT,
                    hash_scheme="external:vllm-sha256-0123")).ns_id
                yield engine, store, sub, ns
            finally:
                sub.close()
    finally:
        engine.close()


def test_engine_stream_relays_gpu_events_and_names_vllm_blocks(tmp_path):
    from kvstore_client.vllm.keyspace import fold_key
    with relayed(tmp_path, replay=True) as (engine, store, sub, ns):
        # 4 engine blocks of T tokens = 2 offload chunks of 2*T: keys fold the chunk's
        # last block hash and group index, as kvstore_client/vllm does
        hs = _vllm_hashes(4, 1)
        u = [int.from_bytes(h, "big") & (2**64 - 1) for h in hs]
        toks = list(range(100, 100 + 4 * T))
        chunk_keys = [fold_key(hs[1] + bytes(4)), fold_key(hs[3] + bytes(4))]
        # chunk 0 is stored before the engine's events arrive, chunk 1 after
        put_raw(store, ns, chunk_keys[:1])
        engine.send([{"type": "BlockStored", "block_hashes": hs, "parent_block_hash": None,
                      "token_ids": toks, "block_size": T, "lora_id": None,
                      "medium": "GPU", "lora_name": None},
                     {"type": "BlockStored", "block_hashes": [hs[0]],
                      "parent_block_hash": None, "token_ids": [], "block_size": 0,
                      "lora_id": None, "medium": "CPU", "lora_name": None}])
        evs = sub.wait(lambda e: "CPU" in held(e), what="late join")
        gpu = stored(evs, "GPU")
        assert [e["block_hashes"][0] for e in gpu] == u
        assert [t for e in gpu for t in e["token_ids"]] == toks
        cpu = firsts(stored(evs, "CPU"))    # the engine's own CPU placeholder is dropped
        assert cpu == [{"type": "BlockStored", "block_hashes": [u[i]],
                        "parent_block_hash": [None, u[0]][i],
                        "token_ids": toks[i * T:(i + 1) * T], "block_size": T,
                        "lora_id": None, "medium": "CPU", "lora_name": None}
                       for i in range(2)]
        # garbage from the engine costs a counted, rate-limited log line, nothing else
        engine.pub.send_multipart([b"one frame"])
        engine.pub.send_multipart([b"", (99).to_bytes(8, "big"), b"\xc1 not msgpack"])
        relay = store.events.publisher.relays[0]
        sub.wait(lambda e: relay.counters["bad_messages"] >= 2, what="garbage counted")
        put_raw(store, ns, chunk_keys[1:])
        evs = sub.wait(lambda e: held(e).get("CPU") == set(u), what="join at store")
        assert [e["parent_block_hash"] for e in stored(evs, "CPU")
                if e["block_hashes"] == [u[2]]][-1] == u[1]
        # the engine restarts (its numbering starts again): its stream starts over with
        # what the daemon holds, and nothing of its old GPU blocks
        last = sub.last_seq()
        engine.seq = 0
        engine.send([])
        evs = sub.wait(lambda e: held(e) == {"CPU": set(u)} and len(e) > 1,
                       since=last + 1, what="engine restart")
        assert evs[0]["type"] == "AllBlocksCleared"


def test_the_daemons_own_start_over_keeps_a_relayed_engines_gpu_blocks(tmp_path):
    """A start-over the daemon makes for its own reasons (its publisher fell behind) clears
    the merged stream; the engine still holds its GPU blocks and says nothing, so the stream
    announces them again after the daemon's, as it does to a consumer that subscribes; a
    block the engine removed is not announced again."""
    rng = np.random.default_rng(9)
    with relayed(tmp_path, max_queue=16) as (engine, store, sub, ns):
        hs = _vllm_hashes(4, 2)
        u = {int.from_bytes(h, "big") & (2**64 - 1) for h in hs}
        engine.send([{"type": "BlockStored", "block_hashes": hs, "parent_block_hash": None,
                      "token_ids": list(range(7, 7 + 4 * T)), "block_size": T,
                      "lora_id": None, "medium": "GPU", "lora_name": None}])
        sub.wait(lambda e: held(e).get("GPU") == u, what="the engine's GPU blocks")
        engine.send([{"type": "BlockRemoved", "block_hashes": [hs[3]], "medium": "GPU"}])
        kept = u - {int.from_bytes(hs[3], "big") & (2**64 - 1)}
        sub.wait(lambda e: held(e).get("GPU") == kept, what="the engine's removal")
        last = sub.last_seq()
        tokens, keys = random_prompt(rng, 64)
        put(store, register(store), keys, tokens)   # 64 changes at once: past max_queue
        evs = sub.wait(lambda e: any(x["type"] == "AllBlocksCleared" for x in e)
                       and held(e).get("GPU") == kept, since=last + 1,
                       what="the engine's blocks after the daemon's start-over")
        assert store.events.recorder.overflows >= 1
        assert [t for e in stored(evs, "GPU") for t in e["token_ids"]] == list(
            range(7, 7 + 3 * T))
        late = sub_of(store, "e0")
        try:
            late.wait(lambda e: held(e).get("GPU") == kept, what="a late subscriber")
        finally:
            late.close()


def test_a_lora_adapters_blocks_are_announced_with_its_name(tmp_path):
    """Routers hash a LoRA adapter's blocks with its name: kvstore's copy of such a block goes
    out with the lora_id and lora_name of the engine events that named it, and SSD keeps them
    (a promotion announces them again). A chunk whose engine blocks disagree is not named."""
    from kvstore_client.vllm.keyspace import fold_key
    with relayed(tmp_path, replay=True) as (engine, store, sub, ns):
        hs = _vllm_hashes(6, 2)
        u = [int.from_bytes(h, "big") & (2**64 - 1) for h in hs]
        toks = list(range(500, 500 + 6 * T))

        def ev(i: int, parent: bytes | None, lora_id, lora_name) -> dict:
            return {"type": "BlockStored", "block_hashes": [hs[i]],
                    "parent_block_hash": parent, "token_ids": toks[i * T:(i + 1) * T],
                    "block_size": T, "lora_id": lora_id, "medium": "GPU",
                    "lora_name": lora_name}
        # chunks (0,1) and (2,3) of adapter 7; chunk (4,5) mixes the adapter and the base
        engine.send([ev(0, None, 7, "adapter-x"), ev(1, hs[0], 7, "adapter-x"),
                     ev(2, hs[1], 7, "adapter-x"), ev(3, hs[2], 7, "adapter-x"),
                     ev(4, hs[3], 7, "adapter-x"), ev(5, hs[4], None, None)])
        sub.wait(lambda e: set(u) <= held(e).get("GPU", set()), what="engine blocks")
        put_raw(store, ns, [fold_key(hs[i] + bytes(4)) for i in (1, 3, 5)])
        evs = sub.wait(lambda e: len(held(e).get("CPU", ())) == 4, what="named chunks")
        cpu = stored(evs, "CPU")
        assert {(e["lora_id"], e["lora_name"]) for e in cpu} == {(7, "adapter-x")}
        assert sorted(h for e in cpu for h in e["block_hashes"]) == sorted(u[:4])
        # the GPU events are forwarded with their adapter too
        gpu = {e["block_hashes"][0]: (e["lora_id"], e["lora_name"])
               for e in stored(evs, "GPU")}
        assert gpu[u[0]] == (7, "adapter-x") and gpu[u[5]] == (None, None)
        # to SSD and back: the adapter survives the block's meta
        store.evict("host")
        last = sub.last_seq()
        evs = sub.wait(lambda e: len(held(e).get("STORAGE", ())) == 4, since=last + 1,
                       what="on SSD")
        ssd = stored(evs, "STORAGE")
        assert {(e["lora_id"], e["lora_name"]) for e in ssd} == {(7, "adapter-x")}


def test_block_texts_keep_their_adapter_through_meta():
    from kvstore.events.texts import BlockText
    plain = BlockText((1, 2), None, bytes([0x92, 1, 2]), 1)
    lora = plain._replace(lora=(3, "a"))
    assert BlockText.unpack(plain.pack()) == plain and len(plain.pack()) == 4
    assert BlockText.unpack(lora.pack()) == lora
    for bad in ([*plain.pack(), [True, "a"]], [*plain.pack(), [1, "x" * 300]],
                [*plain.pack(), [1, "a"], 0], [*plain.pack(), [None, None]]):
        assert BlockText.unpack(bad) is None


def put_raw(store: Store, ns: bytes, keys: list[bytes]) -> None:
    """Store blocks by key alone, as the vLLM adapter does (no token ids)."""
    lease = store.reserve(ns, len(keys))
    for s in lease.slots:
        store.host.view(s.offset, s.length)[:] = 7
    store.commit(lease.id, keys)


def test_publisher_runs_beside_concurrent_stores(tmp_path):
    """Stores from several threads while the publisher runs: what the router ends up with is
    exactly what the store holds."""
    with make(tmp_path, host=256 << 10) as store:
        sub = sub_of(store)
        try:
            ns = register(store)
            errors = []

            def writer(seed: int) -> None:
                rng = np.random.default_rng(seed)
                try:
                    for _ in range(20):
                        tokens, keys = random_prompt(rng, 4)
                        put(store, ns, keys, tokens)
                except Exception as e:  # noqa: BLE001
                    errors.append(e)
            threads = [threading.Thread(target=writer, args=(s,)) for s in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert not errors

            def truth() -> dict[str, set[int]]:
                """What the store holds now (background demotion may still be moving)."""
                out: dict[str, set[int]] = {}
                with store.state.lock:
                    for e in store.index.entries():
                        for tier, on in (("CPU", e.host is not None), ("STORAGE", e.ssd)):
                            if on:
                                out.setdefault(tier, set()).add(own_hash(e.gkey))
                return out
            sub.wait(lambda e: held(e) == truth(), what="final state")
            # promotions (texts from SSD meta), then SSD evictions under them: still in step
            rng = np.random.default_rng(9)
            for _ in range(5):
                tokens, keys = random_prompt(rng, 4)
                put(store, ns, keys, tokens)
            store.evict("host")
            with store.state.lock:
                picked = [e.key for e in store.index.entries()][:40]
            for key in picked:
                lease = store.acquire(ns, [key])
                store.release(lease.id)
            store.evict("ssd", 20 * SMALL.block_bytes)
            sub.wait(lambda e: held(e) == truth(), what="after promotions")
        finally:
            sub.close()


@pytest.mark.parametrize("high", [2**8, 2**16, 2**32])
@pytest.mark.parametrize("block_tokens", [1, 15, 16, 64])
def test_token_ids_pack_as_vllms_encoder_packs_them(block_tokens, high):
    """Token ids go out as msgpack arrays, each int in its smallest form (what vLLM's msgspec
    encoder writes): the daemon packs a commit's blocks at once, by value class (ids below
    0x10000, most vocabularies, by a path of their own: both must write the same bytes)."""
    import msgpack

    from kvstore.events.texts import _pack_ints, pack_commit, pack_token_blocks, tokens_u32
    rng = np.random.default_rng(block_tokens * 7 + high.bit_length())
    edges = [e for e in (0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1) if e < high]
    for _ in range(5):
        tokens = np.concatenate([rng.permutation(edges * 3),
                                 rng.integers(0, high, 400, dtype=np.int64)])
        tokens = tokens[:len(tokens) // block_tokens * block_tokens]
        raw = tokens_u32(tokens)
        got = pack_token_blocks(raw, block_tokens)
        want = [msgpack.packb(tokens[i:i + block_tokens].tolist())
                for i in range(0, len(tokens), block_tokens)]
        assert got == want
        keys = [bytes([i % 256, i // 256]) * 8 for i in range(len(want))]
        packed = pack_commit(b"n" * 16, keys, None, raw, block_tokens)
        data, starts, _ = _pack_ints(raw)        # the general path, for every value class
        assert packed.data == data
        assert packed.offsets == [*starts[::block_tokens].tolist(), len(data)]


def test_a_chain_stored_at_once_goes_out_as_one_event(tmp_path):
    """The changes of one store merge into one BlockStored of the chain, as vLLM announces a
    request's blocks (kvstore/events/runs.py), and its deletion into one BlockRemoved; a
    block whose parent is not the last one starts a new event."""
    rng = np.random.default_rng(5)
    with make(tmp_path) as store:
        sub = sub_of(store)
        try:
            ns = register(store)
            tokens, keys = random_prompt(rng, 6)
            hs = [own_hash(ns + k) for k in keys]
            put(store, ns, keys, tokens)
            evs = sub.wait(lambda e: held(e).get("CPU") == set(hs), what="stored")
            raw = [e for e in evs if e["type"] == "BlockStored"]
            assert [e["block_hashes"] for e in raw] == [hs]
            assert raw[0]["parent_block_hash"] is None
            assert raw[0]["token_ids"] == tokens.tolist()
            last = sub.last_seq()
            store.delete(ns, keys)
            evs = sub.wait(lambda e: {h for x in removed(e) for h in x["block_hashes"]}
                           == set(hs), since=last + 1, what="deleted")
            assert len([e for e in evs if e["type"] == "BlockRemoved"]) == 1
            # two unrelated prompts stored back to back: two chains, two events
            t1, k1 = random_prompt(rng, 2)
            t2, k2 = random_prompt(rng, 2)
            last = sub.last_seq()
            put(store, ns, k1, t1)
            put(store, ns, k2, t2)
            want = {own_hash(ns + k) for k in k1 + k2}
            evs = sub.wait(lambda e: held(e).get("CPU") == want, since=last + 1, what="two")
            raw = [e for e in evs if e["type"] == "BlockStored"]
            assert sorted(map(tuple, (e["block_hashes"] for e in raw))) == sorted(
                [tuple(own_hash(ns + k) for k in k1), tuple(own_hash(ns + k) for k in k2)])
        finally:
            sub.close()


def test_a_block_loaded_back_from_redis_is_announced_with_its_token_ids(tmp_path):
    """Redis kept no block text: a block whose last local copy went, loaded back from Redis,
    was held in host and never announced, nor was another node's load of it. With
    remote.value_notes the value carries the text (sealed with it), and the load announces it
    as one from SSD is."""
    from tests.redis_fixtures import start_redis
    server = start_redis(tmp_path / "redis")

    def node(name: str) -> Store:
        cfg = StoreConfig(data_dir=str(tmp_path / name))
        cfg.host.capacity = 1 << 20
        cfg.ssd.enabled = False
        cfg.remote.enabled, cfg.remote.urls = True, [server.url]
        cfg.remote.deadline_ms, cfg.remote.write_through = 2000, True
        cfg.remote.value_notes = True
        cfg.events.enabled = True
        cfg.events.endpoint = "tcp://127.0.0.1:0"
        cfg.events.interval_ms = 2.0
        return Store(cfg.check())

    def texts_of(evs: list[dict]) -> dict[int, list[int]]:
        return {e["block_hashes"][0]: e["token_ids"] for e in stored(evs, "CPU")}

    tokens, keys = random_prompt(np.random.default_rng(12), 4)
    try:
        with node("a") as a:
            sub = sub_of(a)
            try:
                ns = register(a)
                hs = {own_hash(ns + k) for k in keys}
                want = {own_hash(ns + k): [int(t) for t in tokens[i * T:(i + 1) * T]]
                        for i, k in enumerate(keys)}
                put(a, ns, keys, tokens)
                sub.wait(lambda e: held(e).get("CPU") == hs, what="the store")
                a.evict("host")                       # only Redis holds the blocks now
                last = sub.last_seq()
                sub.wait(lambda e: not held(e).get("CPU"), what="the eviction")
                assert [k for k, _ in a.get(ns, keys)] == keys       # loaded from Redis
                evs = sub.wait(lambda e: held(e).get("CPU") == hs, since=last + 1,
                               what="the blocks loaded back from Redis")
                assert texts_of(evs) == want
            finally:
                sub.close()
        with node("b") as b:                          # another node, the same Redis
            sub = sub_of(b)
            try:
                assert register(b) == ns
                assert [k for k, _ in b.get(ns, keys)] == keys
                evs = sub.wait(lambda e: held(e).get("CPU") == hs, what="the other node's load")
                assert texts_of(evs) == want
            finally:
                sub.close()
    finally:
        server.stop()
