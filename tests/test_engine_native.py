"""Engine-native blocks (opaque bytes in an engine's layout) and per-key Locate with prefetch."""

from __future__ import annotations

import time

import kvstore_client
import numpy as np
import pytest
from kvstore_client import KVLayout
from kvstore_client.errors import InvalidArgument, NotFound

from tests.daemon import cleanup, start_daemon
from tiers import codecs
from tiers.codecs import reorder as codec_engine

# A vLLM-CPU-like block: 2 layers, per layer [heads, K/V, tokens, dim].
DECLARED = dict(num_layers=2, num_kv_heads=2, head_dim=32, block_tokens=32, dtype="float32",
                engine_layout="vllm-offload:LBHNC:test", kv_axes="LH2TD")
NBYTES = 2 * 2 * 32 * 2 * 32 * 4


def _declared() -> KVLayout:
    return KVLayout(block_bytes_opaque=NBYTES, **DECLARED)


def _opaque(nbytes: int = 12345) -> KVLayout:
    return KVLayout(0, 0, 0, 0, "uint8", engine_layout="engine:opaque", block_bytes_opaque=nbytes)


def test_engine_layout_validation_names_the_problem():
    assert _opaque().block_bytes == 12345 and not _opaque().declared
    assert _declared().declared and _declared().block_bytes == NBYTES
    with pytest.raises(InvalidArgument, match="kv_axes"):
        KVLayout(block_bytes_opaque=NBYTES, **{**DECLARED, "kv_axes": "LH2TX"})
    with pytest.raises(InvalidArgument, match="do not|holds"):
        KVLayout(block_bytes_opaque=NBYTES + 4, **DECLARED)
    with pytest.raises(InvalidArgument, match="engine-native"):
        KVLayout(2, 2, 32, 32, "float32", block_bytes_opaque=NBYTES)
    with pytest.raises(InvalidArgument, match="dtype"):
        KVLayout(0, 0, 0, 0, "int4", engine_layout="x", block_bytes_opaque=8)
    with pytest.raises(InvalidArgument, match="needs to know which bytes"):
        kvstore_client.NamespaceSpec(model="m", layout=_opaque(), codec="int8")


def test_canonical_namespace_ids_do_not_change():
    """Namespaces registered before engine layouts existed keep their ids (and blocks)."""
    lay = KVLayout(4, 2, 64, 16, "bfloat16")
    spec = kvstore_client.NamespaceSpec(model="m", layout=lay)
    assert b"engine_layout" not in spec.canonical()
    other = kvstore_client.NamespaceSpec(model="m", layout=_declared())
    assert b"engine_layout" in other.canonical() and other.digest != spec.digest


def test_declared_reorder_is_an_exact_permutation():
    lay = _declared()
    rng = np.random.default_rng(0)
    block = rng.standard_normal(NBYTES // 4).astype(np.float32).view(np.uint8)
    canon, clay = codec_engine.to_canonical(block, lay)
    # Element (layer 1, V, token 3, head 1, dim 5) sits at [1, head 1, V, token 3, dim 5].
    interior = block.view(np.float32).reshape(2, 2, 2, 32, 32)
    assert canon.view(np.float32).reshape(clay.block_shape)[1, 1, 3, 1, 5] == \
        interior[1, 1, 1, 3, 5]
    back = np.empty_like(block)
    codec_engine.from_canonical(canon, lay, back)
    assert np.array_equal(back, block)


@pytest.mark.parametrize("codec", ["lossless", "int8", "fp8_e4m3"])
def test_engine_blocks_through_codecs(codec):
    lay = _declared() if codec != "lossless" else _opaque(NBYTES)
    rng = np.random.default_rng(1)
    block = rng.standard_normal(NBYTES // 4).astype(np.float32).view(np.uint8)
    out = np.empty_like(block)
    codecs.decode(codec, codecs.encode(codec, block, lay), lay, out)
    if codec == "lossless":
        assert np.array_equal(out, block)
        return
    err = codecs.measure_error(codec, block, lay)
    assert 0 < err["element"] < 0.08
    assert err["attention_max"] < 0.15


@pytest.fixture
def daemon(tmp_path):
    d = start_daemon(tmp_path, {"host.capacity": "8MiB"})
    try:
        yield d
    finally:
        cleanup(d)


def _store(ns, n: int, nbytes: int, seed: int = 0) -> tuple[list[bytes], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    blocks = [rng.standard_normal(nbytes // 4).astype(np.float32).view(np.uint8)
              for _ in range(n)]
    keys = [bytes([seed, i]) * 16 for i in range(n)]

    def fill(base, offsets, first):
        for j, off in enumerate(offsets):
            base[off:off + nbytes] = blocks[first + j]
    assert ns.store_blocks(keys, fill) == n
    return keys, blocks


def _load(ns, keys, nbytes) -> dict[int, np.ndarray]:
    got: dict[int, np.ndarray] = {}

    def drain(base, offsets, first):
        for j, off in enumerate(offsets):
            got[first + j] = base[off:off + nbytes].copy()
    ns.load_blocks(keys, drain)
    return got


def test_opaque_blocks_round_trip_bit_exact_through_ssd(daemon):
    with kvstore_client.connect(daemon.address) as c:
        ns = c.namespace(_opaque(NBYTES), model="engine", hash_scheme="external:test-v1")
        keys, blocks = _store(ns, 8, NBYTES)
        c.evict("host")
        assert ns.locate(keys) == ["ssd"] * 8
        got = _load(ns, keys, NBYTES)
        assert len(got) == 8 and all(np.array_equal(got[i], blocks[i]) for i in range(8))


def test_locate_answers_per_key_and_prefetches_into_host(daemon):
    with kvstore_client.connect(daemon.address) as c:
        ns = c.namespace(_declared(), model="engine", hash_scheme="external:test-v1",
                         codec="int8")
        keys, blocks = _store(ns, 6, NBYTES)
        c.evict("host")
        unknown = b"\x99" * 32
        # Not a prefix: a missing key in the middle does not hide the ones after it.
        assert ns.locate([keys[0], unknown, keys[2]]) == ["ssd", None, "ssd"]
        assert ns.locate(keys[:3], prefetch=True) == ["ssd"] * 3
        deadline = time.monotonic() + 10
        while ns.locate(keys[:3]) != ["host"] * 3:
            assert time.monotonic() < deadline, "prefetch did not promote the blocks"
            time.sleep(0.05)
        assert ns.locate(keys[3:]) == ["ssd"] * 3          # only what was asked for
        counters = c.stats()["counters"]
        assert counters["prefetched_blocks"] == 3
        got = _load(ns, keys[:3], NBYTES)
        for i in range(3):   # int8 copies, decoded back into vLLM's interior order
            a, b = blocks[i].view(np.float32), got[i].view(np.float32)
            assert np.linalg.norm(a - b) / np.linalg.norm(a) < 0.02


def test_locate_bad_input(daemon):
    with kvstore_client.connect(daemon.address) as c:
        ns = c.namespace(_opaque(4096), model="engine", hash_scheme="external:test-v1")
        with pytest.raises(InvalidArgument, match="key"):
            ns.locate([b"short"])
        assert ns.locate([]) == []
        from kvstore_client._proto import kvstore_pb2 as pb
        with pytest.raises(NotFound):
            c.call("Locate", pb.LocateRequest(namespace_id=b"\x01" * 16, keys=[b"k" * 16]))
