"""The SDK against a real daemon subprocess: shared memory across processes, Put/Get streams,
restarts served from SSD, dedup, partial prefixes, paged caches, lease renewal.

Every block is generated from a seed, so a second process can rebuild the expected bytes and
compare them bit for bit without shipping them around.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import kvstore_client
import numpy as np
import pytest
import torch
from kvstore_client import (
    DataLoss,
    DeadlineExceeded,
    InvalidArgument,
    KVLayout,
    LeaseExpired,
    PagedKV,
    Unavailable,
    connect,
)
from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client.client import grpc_target
from kvstore_client.wire import decode_get, encode_put

from tests.daemon import cleanup, start_daemon

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=16, dtype="bfloat16")
T = LAYOUT.block_tokens


def make_kv(seed: int, tokens: int, layout: KVLayout = LAYOUT) -> torch.Tensor:
    """Deterministic bf16 KV [L, 2, tokens, H, D] that any process can rebuild."""
    g = torch.Generator().manual_seed(seed)
    L, _, _, H, D = layout.block_shape
    return torch.randn((L, 2, tokens, H, D), generator=g).to(torch.bfloat16)


def bits(x: torch.Tensor) -> np.ndarray:
    return x.contiguous().view(torch.int16).numpy()


def prompt(seed: int, tokens: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, size=tokens, dtype=np.int64)


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory: pytest.TempPathFactory):
    d = start_daemon(tmp_path_factory.mktemp("client"))
    try:
        yield d
    finally:
        cleanup(d)


@pytest.fixture
def ns(shared_daemon):
    with connect(shared_daemon.address, transport="shm") as c:
        yield c.namespace(LAYOUT, model="test/model", tenant_salt=f"{id(c)}")


def run_script(code: str, *args: str, timeout: float = 60) -> str:
    """Run `code` in a fresh interpreter (a separate engine process); returns its stdout."""
    root = str(Path(__file__).resolve().parent.parent)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=root)
    assert proc.returncode == 0, f"child failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


# ------------------------------------------------------------------------- pure helpers

def test_put_encoding_and_get_decoding_match_protobuf() -> None:
    data = np.arange(70_000, dtype=np.uint8)  # > 2 varint bytes of length
    raw = encode_put(b"n" * 16, b"p" * 16, [(b"k" * 16, data), (b"j" * 32, b"xyz")])
    msg = pb.PutRequest.FromString(raw)
    assert msg.namespace_id == b"n" * 16 and msg.parent == b"p" * 16
    assert [b.key for b in msg.blocks] == [b"k" * 16, b"j" * 32]
    assert msg.blocks[0].data == data.tobytes() and msg.blocks[1].data == b"xyz"

    resp = pb.GetResponse(blocks=[pb.Block(key=b"a" * 16, data=bytes(range(200))),
                                  pb.Block(key=b"b" * 20, data=b"q" * 5000)]).SerializeToString()
    got = [(k, resp[o:o + n]) for k, o, n in decode_get(resp)]
    assert got == [(b"a" * 16, bytes(range(200))), (b"b" * 20, b"q" * 5000)]
    assert decode_get(b"") == []


def test_addresses() -> None:
    assert grpc_target("/tmp/k.sock") == ("unix:/tmp/k.sock", True)
    assert grpc_target("unix:///tmp/k.sock") == ("unix:/tmp/k.sock", True)
    assert grpc_target("localhost:50551") == ("localhost:50551", True)
    assert grpc_target("10.1.2.3:50551") == ("10.1.2.3:50551", False)
    with pytest.raises(InvalidArgument):
        grpc_target("host:notaport")
    with pytest.raises(InvalidArgument):
        connect("/tmp/x.sock", transport="carrier-pigeon")


@pytest.mark.parametrize("kv_axis,page_axis", [(0, 1), (1, 0)])
@pytest.mark.parametrize("torch_gather", [False, True])
def test_paged_gather_scatter_roundtrip(kv_axis: int, page_axis: int, torch_gather: bool) -> None:
    from kvstore_client.buffers import aligned_buffer
    lay = KVLayout(3, 2, 8, 4, "bfloat16")
    shape = [0, 0, 4, 2, 8]
    shape[kv_axis], shape[page_axis] = 2, 10
    layers = [torch.randn(shape).to(torch.bfloat16) for _ in range(3)]
    p = PagedKV(lay, layers, kv_axis=kv_axis, page_axis=page_axis, use_torch_gather=torch_gather)
    base = aligned_buffer(5 * 8192)
    offsets, table = [0, 3 * 8192, 8192], [7, 2, 5]
    p.gather(base, offsets, table)
    for off, page in zip(offsets, table, strict=True):
        block = torch.from_numpy(base[off:off + lay.block_bytes].view(np.int16).copy())
        expect = torch.stack([x.movedim((page_axis, kv_axis), (0, 1))[page] for x in layers])
        assert torch.equal(block.view(torch.bfloat16).view(lay.block_shape), expect)
    back = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(3)]
    PagedKV(lay, back, kv_axis=kv_axis, page_axis=page_axis,
            use_torch_gather=torch_gather).scatter(base, offsets, [1, 4, 9])
    for a, b in zip(layers, back, strict=True):
        a, b = a.movedim((page_axis, kv_axis), (0, 1)), b.movedim((page_axis, kv_axis), (0, 1))
        assert torch.equal(a[[7, 2, 5]], b[[1, 4, 9]])
        assert not b[[0, 2, 3]].any()


def test_sdk_does_not_import_torch_or_daemon() -> None:
    out = run_script("""
        import sys, kvstore_client
        print(sorted(m for m in ("torch", "kvstore", "tiers") if m in sys.modules))
    """)
    assert out.strip() == "[]"


# ------------------------------------------------------------------ against the daemon

def test_store_in_one_process_load_in_another(shared_daemon) -> None:
    """A writer process stores bf16 torch KV via shm; this process loads identical bits."""
    tokens = 5 * T + 7   # 5 full blocks and a partial one that is never stored
    out = run_script(f"""
        import numpy as np, torch, kvstore_client
        from tests.test_client import LAYOUT, make_kv, prompt
        with kvstore_client.connect({shared_daemon.socket!r}, transport="shm") as c:
            ns = c.namespace(LAYOUT, model="xproc")
            print(c.transport, ns.store(prompt(1, {tokens}), make_kv(11, {tokens})))
    """)
    assert out.split() == ["shm", "5"]
    with connect(shared_daemon.socket) as c:
        ns = c.namespace(LAYOUT, model="xproc")
        assert c.transport == "shm"                 # "auto" mapped the pool
        ids = prompt(1, tokens)
        assert ns.lookup(ids) == 5 * T
        got = np.zeros((4, 2, tokens, 2, 64), dtype=np.uint16)   # numpy bf16 bits
        assert ns.load(ids, out=got) == 5 * T
        expect = bits(make_kv(11, tokens))[:, :, :5 * T]
        assert np.array_equal(got[:, :, :5 * T].view(np.int16), expect)
        assert not got[:, :, 5 * T:].any()   # past the prefix: untouched


def test_grpc_and_shm_transports_give_the_same_bytes(shared_daemon) -> None:
    kv = make_kv(2, 4 * T)
    with connect(shared_daemon.address, transport="shm") as s, \
            connect(shared_daemon.address, transport="grpc") as g:
        ns_s = s.namespace(LAYOUT, model="transports")
        ns_g = g.namespace(LAYOUT, model="transports")
        assert (s.transport, g.transport) == ("shm", "grpc")
        assert ns_s.ns_id == ns_g.ns_id
        a, b = prompt(2, 4 * T), prompt(3, 4 * T)
        assert ns_s.store(a, kv) == 4
        assert ns_g.store(b, kv) == 4
        for ns in (ns_s, ns_g):
            for ids in (a, b):
                out = torch.zeros_like(kv)
                assert ns.load(ids, out=out) == 4 * T
                assert torch.equal(bits_t(out), bits_t(kv))


def bits_t(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16)


def test_partial_prefix_lookups(ns) -> None:
    ids = prompt(4, 6 * T)
    assert ns.lookup(ids) == 0
    assert ns.store(ids[:4 * T], make_kv(4, 4 * T)) == 4
    assert ns.lookup(ids) == 4 * T                  # longer prompt: the cached 4 blocks
    assert ns.lookup(ids[:2 * T + 5]) == 2 * T      # shorter prompt: its full blocks
    assert ns.lookup(ids[:T - 1]) == 0              # no full block
    other = ids.copy()
    other[T + 3] += 1                               # differs in block 1: only block 0 shared
    assert ns.lookup(other) == T
    res = ns.lookup_result(ns.keys(ids))
    assert res.prefix_blocks == 4 and res.per_tier.get("host") == 4
    # out shorter than the cached prefix: load what fits, in whole blocks
    out = torch.zeros((4, 2, 2 * T + 3, 2, 64), dtype=torch.bfloat16)
    assert ns.load(ids, out=out) == 2 * T
    assert torch.equal(bits_t(out[:, :, :2 * T]), bits_t(make_kv(4, 4 * T)[:, :, :2 * T]))


def test_dedup_writes_missing_blocks_only(ns) -> None:
    ids = prompt(5, 8 * T)
    kv = make_kv(5, 8 * T)
    assert ns.store(ids[:3 * T], kv) == 3
    assert ns.store(ids[:3 * T], kv) == 0           # all cached: nothing written
    assert ns.store(ids, kv) == 5                   # only the 5 new blocks
    assert ns.store(ids, kv) == 0
    keys = ns.keys(ids)
    assert ns.store_keys(keys, kv) == 0 and ns.lookup_keys(keys) == 8


def test_paged_store_and_load_through_daemon(ns) -> None:
    pages = 12
    L, _, _, H, D = LAYOUT.block_shape
    src = [torch.randn(2, pages, T, H, D).to(torch.bfloat16) for _ in range(L)]  # vLLM flash
    ids = prompt(6, 3 * T + 2)
    table = [9, 0, 4]
    assert PagedKV(ns, src).store(ids, table) == 3
    # a page-first engine with another block table sees the same blocks
    dst = [torch.zeros(pages, 2, T, H, D, dtype=torch.bfloat16) for _ in range(L)]
    assert PagedKV(ns, dst, kv_axis=1, page_axis=0).load(ids, [3, 7, 11, 1]) == 3 * T
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(bits_t(s[:, table].transpose(0, 1).contiguous()),
                           bits_t(d[[3, 7, 11]]))
    # and the dense sequence API agrees with the paged one
    seq = torch.zeros((L, 2, 3 * T, H, D), dtype=torch.bfloat16)
    assert ns.load(ids, out=seq) == 3 * T
    for i, page in enumerate(table):
        for layer in range(L):
            assert torch.equal(bits_t(seq[layer, :, i * T:(i + 1) * T]),
                               bits_t(src[layer][:, page]))


def test_bad_input_says_what_is_wrong(ns) -> None:
    ids = prompt(7, 2 * T)
    with pytest.raises(InvalidArgument, match="dtype"):
        ns.store(ids, torch.zeros((4, 2, 2 * T, 2, 64), dtype=torch.float32))
    with pytest.raises(InvalidArgument, match="bfloat16"):
        ns.store(ids, np.zeros((4, 2, 2 * T, 2, 64), dtype=np.float32))
    with pytest.raises(InvalidArgument, match="fewer than"):
        ns.store(ids, torch.zeros((4, 2, T, 2, 64), dtype=torch.bfloat16))
    with pytest.raises(InvalidArgument, match="shape"):
        ns.store(ids, torch.zeros((4, 2, 2 * T, 64, 2), dtype=torch.bfloat16))
    with pytest.raises(InvalidArgument, match="block_table"):
        PagedKV(ns, [torch.zeros(2, 4, T, 2, 64, dtype=torch.bfloat16)] * 4).store(ids, [0])


def test_unreachable_daemon_fails_within_the_deadline(tmp_path: Path) -> None:
    with pytest.raises((Unavailable, DeadlineExceeded)):
        connect(str(tmp_path / "nobody.sock"), timeout=0.5).namespace(LAYOUT, model="m")


def test_long_copy_renews_its_lease(shared_daemon) -> None:
    """A read lease of 1 s held through a 2.5 s copy stays valid (renewed), and is released."""
    with connect(shared_daemon.address, lease_ttl_s=1.0) as c:
        ns = c.namespace(LAYOUT, model="renew")
        ids = prompt(8, 2 * T)
        kv = make_kv(8, 2 * T)
        assert ns.store(ids, kv) == 2
        seen: list[int] = []
        out = torch.zeros_like(kv)
        dst = out.view(torch.int16).numpy()

        def slow_drain(base: np.ndarray, offsets, first: int) -> None:
            seen.append(c.stats()["active_leases"])
            threading.Event().wait(2.5)
            for j, off in enumerate(offsets):
                i = first + j
                dst[:, :, i * T:(i + 1) * T] = base[off:off + LAYOUT.block_bytes].view(
                    np.int16).reshape(LAYOUT.block_shape)
        assert ns.load_blocks(ns.keys(ids), slow_drain) == 2
        assert seen == [1]                         # one attempt: the lease never lapsed
        assert c.counters["leases_lost"] == 0
        assert torch.equal(bits_t(out), bits_t(kv))
        assert c.stats()["active_leases"] == 0     # released at the end


def test_close_releases_outstanding_leases(shared_daemon, monkeypatch) -> None:
    monkeypatch.setattr(kvstore_client.leases, "SPARE_IDLE_S", 60.0)
    c = connect(shared_daemon.address, lease_ttl_s=60)
    ns = c.namespace(LAYOUT, model="close")
    ids = prompt(9, T)
    ns.store(ids, make_kv(9, T))
    holding, done = threading.Event(), threading.Event()

    def drain(base, offsets, first) -> None:
        holding.set()
        done.wait(30)
    t = threading.Thread(target=lambda: ns.load_blocks(ns.keys(ids), drain), daemon=True)
    t.start()
    assert holding.wait(30)
    with connect(shared_daemon.address) as watcher:
        # The load's read lease, and the write lease the store's Commit reserved ahead for
        # this client's next store (held up to leases.SPARE_IDLE_S).
        assert watcher.stats()["active_leases"] == 2
        c.close()                                   # 60 s leases, released now
        assert watcher.stats()["active_leases"] == 0
    done.set()
    t.join(30)


def test_restart_reloads_from_ssd_transparently(shared_daemon) -> None:
    """Restart the daemon under a live client: the next calls re-register and re-map by
    themselves, and the blocks come back from SSD."""
    d = shared_daemon
    with connect(d.address) as c:
        ns = c.namespace(LAYOUT, model="restart")
        ids = prompt(10, 4 * T)
        kv = make_kv(10, 4 * T)
        assert ns.store(ids, kv) == 4
        first_id = c.daemon_id
        d.restart()                              # graceful: host blocks flushed to SSD
        res = ns.lookup_result(ns.keys(ids))     # same client, no reconnect by hand
        assert res.prefix_blocks == 4 and res.per_tier.get("ssd") == 4
        assert res.per_tier.get("host", 0) == 0
        out = torch.zeros_like(kv)
        assert ns.load(ids, out=out) == 4 * T    # promoted from SSD, through the new pool
        assert torch.equal(bits_t(out), bits_t(kv))
        assert c.daemon_id != first_id and c.transport == "shm"
        assert c.counters["resyncs"] >= 1
        assert c.stats()["tiers"]["ssd"]["hits"] >= 4
        assert ns.store(ids, kv) == 0            # still deduplicated after the restart
        more = prompt(12, 2 * T)
        assert ns.store(more, make_kv(12, 2 * T)) == 2   # writes go to the new pool
        out2 = torch.zeros((4, 2, 2 * T, 2, 64), dtype=torch.bfloat16)
        assert ns.load(more, out=out2) == 2 * T
        assert torch.equal(bits_t(out2), bits_t(make_kv(12, 2 * T)))


def test_checksum_mismatch_is_never_served(shared_daemon) -> None:
    """A block whose slot bytes no longer match the lease checksum ends the prefix there."""
    with connect(shared_daemon.address) as c:
        ns = c.namespace(LAYOUT, model="corrupt")
        ids = prompt(11, 3 * T)
        kv = make_kv(11, 3 * T)
        assert ns.store(ids, kv) == 3
        out = torch.zeros_like(kv)
        dst = out.view(torch.int16).numpy()

        def corrupting_drain(base, offsets, first) -> None:
            base[offsets[1] + 100] ^= 0xFF           # a stray write into block 1's slot
            for j, off in enumerate(offsets):
                i = first + j
                dst[:, :, i * T:(i + 1) * T] = base[off:off + LAYOUT.block_bytes].view(
                    np.int16).reshape(LAYOUT.block_shape)
        assert ns.load_blocks(ns.keys(ids), corrupting_drain) == 1
        assert c.counters["checksum_failures"] == 1
        lease = c.call("Acquire", pb.AcquireRequest(namespace_id=ns.ns_id, keys=ns.keys(ids)))
        c.release(lease.lease.lease_id)
        c.pool.slab.array[lease.lease.slots[1].offset + 100] ^= 0xFF   # repair block 1
        assert ns.load(ids, out=out) == 3 * T        # intact again: all three served
        assert torch.equal(bits_t(out), bits_t(kv))


def test_public_names() -> None:
    for name in ("connect", "Client", "Namespace", "PagedKV", "LookupResult", "DataLoss"):
        assert hasattr(kvstore_client, name)
    assert issubclass(DataLoss, kvstore_client.KVStoreError)


def test_retain_hints_reach_the_daemon(ns) -> None:
    ids = prompt(8, 3 * T)
    assert ns.store(ids, make_kv(8, 3 * T)) == 3
    keys = ns.keys(ids)
    assert ns.retain(keys, "low") == 3
    assert ns.retain(keys + [b"\x02" * len(keys[0])], "high") == 3   # unknown keys skipped
    with pytest.raises(InvalidArgument, match="retention level must be one of low, normal, high"):
        ns.retain(keys, "forever")
    # the daemon checks too, for clients that skip the SDK
    with pytest.raises(InvalidArgument, match="retention level"):
        ns.client.call("Retain", pb.RetainRequest(namespace_id=ns.ns_id, keys=keys,
                                                  level="forever"))
    assert ns.lookup(ids) == 3 * T                   # a hint never drops anything


def loaded_blocks(ns, keys: list[bytes]) -> dict[int, np.ndarray]:
    """The cached prefix of `keys` as each block's bytes (canonical layout), by position."""
    got: dict[int, np.ndarray] = {}

    def drain(base: np.ndarray, offsets, first: int) -> None:
        for j, off in enumerate(offsets):
            got[first + j] = base[off:off + ns.block_bytes].copy()
    assert ns.load_blocks(keys, drain) == len(got)
    return got


def test_two_threads_storing_over_grpc_each_send_their_own_bytes(shared_daemon) -> None:
    """Over Put streams a store stages its blocks and gRPC's sender encodes them while the RPC
    runs, so two threads storing through one Namespace (the Client is thread-safe) must not
    share that staging. A's fill returns only after B's fill has run: with one buffer per
    Namespace, A's keys would be stored with B's bytes every time, and served as valid."""
    bb, n = LAYOUT.block_bytes, 4
    a_filled, b_filled = threading.Event(), threading.Event()

    def filler(mark: int, after: threading.Event | None, before: threading.Event | None):
        def fill(base: np.ndarray, offsets, first: int) -> None:
            if after is not None:
                assert after.wait(30), "the other store's fill never ran"
            for j, off in enumerate(offsets):
                base[off:off + bb] = mark + first + j
            if before is not None:
                before.set()
            if mark == 0xA0:
                assert b_filled.wait(30), "the other store's fill never ran"
        return fill

    with connect(shared_daemon.address, transport="grpc") as c:
        ns = c.namespace(LAYOUT, model="grpc-staging", tenant_salt=f"{id(c)}")
        assert c.transport == "grpc"
        keys = {m: [bytes([m, i]) * 8 for i in range(n)] for m in (0xA0, 0xB0)}
        fills = {0xA0: filler(0xA0, None, a_filled), 0xB0: filler(0xB0, a_filled, b_filled)}
        errors: list[BaseException] = []

        def store(m: int) -> None:
            try:
                assert ns.store_blocks(keys[m], fills[m]) == n
            except BaseException as e:  # noqa: BLE001 - reported by the test thread
                errors.append(e)
        threads = [threading.Thread(target=store, args=(m,), daemon=True) for m in keys]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads) and not errors, errors
        for m, ks in keys.items():
            got = loaded_blocks(ns, ks)
            assert len(got) == n
            for i in range(n):
                assert np.all(got[i] == m + i), f"block {i} of store {m:#x} holds other bytes"


def test_a_pin_held_across_a_restart_says_pin_again(shared_daemon) -> None:
    """A Pinned keeps the pool mapping it pinned in. Once another call of its client re-maps
    a restarted daemon's pool, that mapping is closed, and loading the pin must raise the
    documented LeaseExpired ("pin again"), not an AttributeError or TypeError from inside the
    copy: engines catch KVStoreError. Both the one-pass kernel and the numpy drain."""
    d = shared_daemon
    with connect(d.address, transport="shm") as c:
        ns = c.namespace(LAYOUT, model="pin-restart", tenant_salt=f"{id(c)}")
        ids, kv = prompt(21, 4 * T), make_kv(21, 4 * T)
        assert ns.store(ids, kv) == 4
        pinned = ns.pin(ns.keys(ids))
        assert pinned.blocks == 4
        d.restart()
        out = torch.zeros_like(kv)
        assert ns.load(ids, out=out) == 4 * T       # this call re-maps the new run's pool
        assert torch.equal(bits_t(out), bits_t(kv)) and c.counters["resyncs"] >= 1
        strided = torch.zeros((4, 2, 2, 4 * T, 64), dtype=torch.bfloat16).transpose(2, 3)
        for dst in (torch.zeros_like(kv), strided):
            with pytest.raises(LeaseExpired, match="pin again"):
                pinned.load_keys(dst)
        pinned.release()
        again = ns.pin(ns.keys(ids))                # what the error says to do works
        assert again.blocks == 4 and again.load_keys(out) == 4
        assert torch.equal(bits_t(out), bits_t(kv))
        again.release()


def test_two_threads_storing_through_one_paged_kv_each_store_their_own_pages(
        shared_daemon) -> None:
    """PagedKV's torch path (device caches; use_torch_gather here) gathers pages into a host
    staging buffer before the slots: two threads storing through one PagedKV must not share
    it. With one buffer per PagedKV, about half the blocks held the other thread's pages."""
    pages, n, rounds = 64, 32, 10
    layers = [torch.zeros((2, pages, T, 2, 64), dtype=torch.bfloat16) for _ in range(4)]
    for layer in layers:
        for p in range(pages):
            layer[:, p] = p                         # small integers: exact in bf16
    want = {p: int(torch.tensor(float(p), dtype=torch.bfloat16).view(torch.int16))
            for p in range(pages)}
    with connect(shared_daemon.address, transport="shm") as c:
        ns = c.namespace(LAYOUT, model="paged-staging", tenant_salt=f"{id(c)}")
        paged = PagedKV(ns, layers, use_torch_gather=True)

        def keys(w: int, r: int) -> list[bytes]:
            return [bytes([w, r, i]) * 6 for i in range(n)]
        errors: list[BaseException] = []

        def store(w: int) -> None:
            try:
                for r in range(rounds):
                    assert paged.store_keys(keys(w, r), list(range(w * n, (w + 1) * n))) == n
            except BaseException as e:  # noqa: BLE001 - reported by the test thread
                errors.append(e)
        threads = [threading.Thread(target=store, args=(w,), daemon=True) for w in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads) and not errors, errors
        wrong = []
        for w in (0, 1):
            for r in range(rounds):
                got = loaded_blocks(ns, keys(w, r))
                assert len(got) == n
                wrong += [(w, r, i) for i in range(n)
                          if not np.all(got[i].view(np.int16) == want[w * n + i])]
        assert not wrong, f"{len(wrong)} blocks hold another page's bytes: {wrong[:4]}"
