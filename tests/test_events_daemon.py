"""KV events from a real `kvstore serve`: engines' token ids through the SDK and the fast lane,
the bytes on the wire decoded by vLLM's own classes, bad token ids refused, and an event
address in use refused at start in one line (exit 2)."""

from __future__ import annotations

import re
import shutil
import socket
import tempfile
from pathlib import Path

import numpy as np
import pytest
from kvstore_client import KVLayout, connect
from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client.errors import InvalidArgument

from tests.daemon import cleanup, start_daemon
from tests.events_helpers import Sub, firsts, held, stored, vllm_decode
from tests.test_operator_errors import assert_one_line, serve

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_tokens=16, dtype="float16")
T = LAYOUT.block_tokens
EVENTS = {"events.enabled": "true", "events.endpoint": "tcp://127.0.0.1:0",
          "events.replay_endpoint": "tcp://127.0.0.1:0"}


def streams_of(d) -> dict[str, tuple[str, str]]:
    """Stream name -> (PUB, replay) addresses from the daemon's start lines."""
    return {m.group(1): (m.group(2), m.group(3)) for m in re.finditer(
        r"KV events \((\S+) stream\) on (\S+?), replay on (\S+)", d.output())}


def node_subscriber(d):
    """(a subscriber of the daemon's node stream, a client, its "llama" namespace)."""
    pub, replay = streams_of(d)["node"]
    sub = Sub(pub, replay)
    client = connect(d.address)
    return sub, client, client.namespace(model="llama", layout=LAYOUT)


def kv_for(n_tokens: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((LAYOUT.num_layers, 2, n_tokens, LAYOUT.num_kv_heads,
                                LAYOUT.head_dim)).astype(np.float16)


def test_sdk_stores_carry_token_ids_and_the_wire_is_vllms(tmp_path):
    d = start_daemon(tmp_path, {**EVENTS, "host.capacity": "16MiB"})
    sub = None
    try:
        sub, client, ns = node_subscriber(d)
        assert ns.wants_token_ids
        tokens = np.arange(5000, 5000 + 6 * T + 5)          # 6 full blocks and a tail
        assert ns.store(tokens, kv_for(len(tokens), 1)) == 6
        evs = sub.wait(lambda e: len(firsts(stored(e, "CPU"))) == 6, what="stored")
        cpu = firsts(stored(evs, "CPU"))
        assert [t for e in cpu for t in e["token_ids"]] == tokens[:6 * T].tolist()
        assert [e["parent_block_hash"] for e in cpu[1:]] == \
            [e["block_hashes"][0] for e in cpu[:-1]]
        # a second store of a longer prompt: only its new blocks, chained to the cached ones
        longer = np.concatenate([tokens[:6 * T], np.arange(9000, 9000 + 2 * T)])
        assert ns.store(longer, kv_for(len(longer), 2)) == 2
        evs = sub.wait(lambda e: len(firsts(stored(e, "CPU"))) == 8, what="second store")
        assert firsts(stored(evs, "CPU"))[6]["parent_block_hash"] == cpu[-1]["block_hashes"][0]
        assert client.evict("host")[1] == 8                  # demoted: STORAGE, then removed
        sub.wait(lambda e: set(held(e)) == {"STORAGE"}, what="demotion")
        ns.delete(ns.keys(longer)[6:])
        evs = sub.wait(lambda e: len(held(e).get("STORAGE", ())) == 6, what="deletion")
        client.close()
        d.stop()
        sub.wait(lambda e: e[-1]["type"] == "AllBlocksCleared", what="stop")
        # every batch the daemon sent decodes with vLLM's own msgspec classes and encodes back
        # to the same bytes
        decoded = vllm_decode([sub.raw[s] for s in sorted(sub.raw)], tmp_path)
        if decoded is None:
            pytest.skip("vLLM's environment is not built here (make vllm-env): decoded with "
                        "msgpack only")
        assert all(b["same_bytes"] for b in decoded), decoded
        kinds = {k for b in decoded for k in b["types"]}
        assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    finally:
        if sub is not None:
            sub.close()
        cleanup(d)


def test_paged_and_device_stores_announce_their_blocks(tmp_path):
    """PagedKV.store (a paged engine's host path) and DeviceKV.store (the gpu tier) took the
    prompt's token ids but never sent them, so none of their blocks was ever announced."""
    import torch
    from kvstore_client import gpu as cg
    from kvstore_client.device_kv import DeviceKV
    from kvstore_client.paged import PagedKV
    d = start_daemon(tmp_path, {**EVENTS, "host.capacity": "16MiB", "gpu.enabled": "true",
                                "gpu.backend": "cpu", "gpu.capacity": "4MiB"})
    sub = None
    try:
        sub, client, ns = node_subscriber(d)
        shape = (2, 8, T, LAYOUT.num_kv_heads, LAYOUT.head_dim)
        rng = np.random.default_rng(3)
        pages = [rng.standard_normal(shape).astype(np.float16) for _ in range(LAYOUT.num_layers)]
        tokens = np.arange(100, 100 + 3 * T)
        assert PagedKV(ns, pages).store(tokens, [5, 2, 7]) == 3
        evs = sub.wait(lambda e: len(firsts(stored(e, "CPU"))) == 3, what="PagedKV's store")
        assert [t for e in firsts(stored(evs, "CPU")) for t in e["token_ids"]] == \
            tokens.tolist()
        cache = cg.PagedKVCache.from_vllm([torch.randn(shape).to(torch.float16)
                                           for _ in range(LAYOUT.num_layers)])
        on_gpu = np.arange(700, 700 + 2 * T)
        assert DeviceKV(ns, cache).store(on_gpu, [1, 4]) == 2
        evs = sub.wait(lambda e: len(firsts(stored(e, "GPU"))) == 2, what="DeviceKV's store")
        assert [t for e in firsts(stored(evs, "GPU")) for t in e["token_ids"]] == \
            on_gpu.tolist()
        client.close()
    finally:
        if sub is not None:
            sub.close()
        cleanup(d)


def test_token_ids_that_do_not_fit_the_keys_are_refused(tmp_path):
    d = start_daemon(tmp_path, EVENTS)
    try:
        client = connect(d.address)
        ns = client.namespace(model="llama", layout=LAYOUT)
        lease = client.call("Reserve", pb.ReserveRequest(namespace_id=ns.ns_id, count=2)).lease
        with pytest.raises(InvalidArgument, match="3 token ids for 2 keys; send 16 per key"):
            client.call("Commit", pb.CommitRequest(lease_id=lease.lease_id,
                                                   keys=[b"a" * 32, b"b" * 32],
                                                   token_ids=bytes(12), checksums=[1, 2]))
        lease = client.call("Reserve", pb.ReserveRequest(namespace_id=ns.ns_id, count=1)).lease
        with pytest.raises(InvalidArgument, match="5 bytes of token ids"):
            client.call("Commit", pb.CommitRequest(lease_id=lease.lease_id, keys=[b"a" * 32],
                                                   token_ids=bytes(5), checksums=[1]))
        with pytest.raises(InvalidArgument, match="token ids for 1 blocks"):
            ns.store_keys([b"c" * 32], kv_for(T, 3), token_ids=[1, 2])
        # the daemon goes on serving
        assert ns.store(np.arange(T), kv_for(T, 4)) == 1
        client.close()
    finally:
        cleanup(d)


def test_events_off_asks_for_no_token_ids(tmp_path):
    d = start_daemon(tmp_path)
    try:
        client = connect(d.address)
        ns = client.namespace(model="llama", layout=LAYOUT)
        assert not ns.wants_token_ids
        assert ns.store(np.arange(2 * T), kv_for(2 * T, 5)) == 2
        assert "KV events" not in d.output()
        client.close()
    finally:
        cleanup(d)


def test_event_address_in_use_is_one_line_and_exit_2(tmp_path):
    short = Path(tempfile.mkdtemp(prefix="kvs-ev-"))
    try:
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = busy.getsockname()[1]
            res, mods = serve(
                ["--tcp", "", "--metrics", "",
                 "--host-capacity", "16MiB", "--socket", str(short / "kvs.sock"),
                 "--data-dir", str(tmp_path / "data"), "--set", "events.enabled=true",
                 "--set", f"events.endpoint=tcp://127.0.0.1:{port}"])
        assert_one_line(res, mods,
                        f"events.endpoint = 'tcp://127.0.0.1:{port}'", "already in use")
    finally:
        shutil.rmtree(short, ignore_errors=True)
