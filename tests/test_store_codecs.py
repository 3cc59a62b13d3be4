"""Namespaces with lossy SSD codecs: blocks come back from SSD within the codec's error.

The bounds are the attention-output errors docs/codecs.md reports for each codec on synthetic
KV with outlier key channels (bench/codecs.py measures them on real KV too).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvstore_client import KVLayout

from tiers.codecs import attention_error

from .store_helpers import make_store, namespace, random_prompt

LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, block_tokens=16, dtype="bfloat16")
BOUND = {"fp8_e4m3": 0.06, "int8": 0.01}


def outlier_kv(rng: np.random.Generator) -> torch.Tensor:
    """[L, 2, T, H, D] bf16 with a few large key channels, as real K has."""
    x = torch.from_numpy(rng.standard_normal(LAYOUT.block_shape).astype(np.float32))
    x[:, 0, :, :, :3] *= 25
    x[:, 0] += 2.0                        # keys carry a constant offset too
    return x.to(torch.bfloat16)


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def as_kv(b: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.bfloat16).reshape(LAYOUT.block_shape)


@pytest.mark.parametrize("codec", ["fp8_e4m3", "int8"])
def test_lossy_namespace_serves_blocks_within_error(tmp_path, codec):
    rng = np.random.default_rng(0)
    with make_store(tmp_path, host_capacity=4 << 20) as store:
        ns = namespace(store, LAYOUT, codec=codec)
        _, keys = random_prompt(rng, 6, LAYOUT)
        blocks = [outlier_kv(rng) for _ in keys]
        store.put(ns, keys, [as_bytes(b) for b in blocks])
        store.evict("host")
        assert store.lookup(ns, keys).per_tier["host"] == 0
        got = store.get(ns, keys)
        assert len(got) == len(keys)
        q = torch.from_numpy(rng.standard_normal((LAYOUT.num_kv_heads, 64, LAYOUT.head_dim))
                             .astype(np.float32))
        errs = []
        for (_, data), ref in zip(got, blocks, strict=True):
            back = as_kv(data).float()
            ref = ref.float()
            for layer in range(LAYOUT.num_layers):
                k, v = ref[layer, 0].transpose(0, 1), ref[layer, 1].transpose(0, 1)
                kh, vh = back[layer, 0].transpose(0, 1), back[layer, 1].transpose(0, 1)
                errs.append(attention_error(q * 0.2, k, v, kh, vh))
        err = torch.cat(errs)
        assert float(err.mean()) <= BOUND[codec], float(err.mean())
        assert float(err.mean()) > 0          # it really went through the lossy codec
        c = store.stats()["counters"]
        assert c[f"codec_out_bytes_{codec}"] < 0.6 * c[f"codec_in_bytes_{codec}"]
        assert c[f"codec_error_samples_{codec}"] >= 1


def test_lossy_codec_refuses_non_finite_block_and_stores_it_lossless(tmp_path):
    rng = np.random.default_rng(1)
    with make_store(tmp_path) as store:
        ns = namespace(store, LAYOUT, codec="int8")
        _, keys = random_prompt(rng, 2, LAYOUT)
        bad = outlier_kv(rng)
        bad[0, 0, 3, 1, 5] = float("inf")
        bad[1, 1, 0, 0, 0] = float("nan")
        data = [as_bytes(bad), as_bytes(outlier_kv(rng))]
        store.put(ns, keys, data)
        store.evict("host")
        got = store.get(ns, keys)
        assert got[0][1] == data[0]                       # bit-exact, inf and NaN kept
        assert store.stats()["counters"]["lossy_refused_nonfinite"] == 1


@pytest.mark.parametrize("codec", ["fp8_e4m3", "int8"])
def test_a_lossy_block_stored_again_after_its_promotion_is_served_as_stored(tmp_path, codec):
    """A promotion of a lossy copy gives the block the checksum of its dequantized bytes; a
    client storing the block again (another engine's store of the same prefix) then put raw
    bytes under that checksum, and every read dropped them as corrupt."""
    rng = np.random.default_rng(3)
    with make_store(tmp_path, host_capacity=4 << 20) as store:
        ns = namespace(store, LAYOUT, codec=codec)
        _, keys = random_prompt(rng, 4, LAYOUT)
        data = [as_bytes(outlier_kv(rng)) for _ in keys]
        store.put(ns, keys, data)
        store.evict("host")
        assert len(store.get(ns, keys)) == 4            # promoted: dequantized host copies
        store.evict("host")                             # (their SSD copies stay)
        store.put(ns, keys, data)                       # the same raw bytes again
        assert [d for _, d in store.get(ns, keys)] == data
        c = store.stats()["counters"]
        assert c.get("corrupt_blocks", 0) == 0 and c.get("get_checksum_mismatch", 0) == 0


def test_other_bytes_under_a_stored_key_keep_the_block_it_has(tmp_path):
    """Engines may differ in low bits: bytes stored under a key whose block lives on SSD only
    used to become its host copy under the block's checksum, which they fail, so every read
    dropped the block as corrupt. One block never holds two versions: the one it has stays."""
    rng = np.random.default_rng(4)
    with make_store(tmp_path) as store:
        ns = namespace(store, LAYOUT, codec="lossless")
        _, keys = random_prompt(rng, 3, LAYOUT)
        data = [as_bytes(outlier_kv(rng)) for _ in keys]
        store.put(ns, keys, data)
        store.evict("host")
        other = [bytes(d[:-1]) + bytes([d[-1] ^ 1]) for d in data]
        assert store.put(ns, keys, other).stored == 0
        assert [d for _, d in store.get(ns, keys)] == data
        c = store.stats()["counters"]
        assert c["duplicate_blocks_differing"] == 3 and c.get("corrupt_blocks", 0) == 0


def test_lossless_namespace_round_trips_bit_exact_through_ssd(tmp_path):
    rng = np.random.default_rng(2)
    with make_store(tmp_path, ssd_compress="always") as store:
        ns = namespace(store, LAYOUT, codec="lossless")
        _, keys = random_prompt(rng, 4, LAYOUT)
        data = [as_bytes(outlier_kv(rng)) for _ in keys]
        store.put(ns, keys, data)
        store.evict("host")
        assert [d for _, d in store.get(ns, keys)] == data
        c = store.stats()["counters"]
        assert c["codec_out_bytes_lossless"] < c["codec_in_bytes_lossless"]


def test_store_uses_the_adaptive_policy_by_default(tmp_path):
    from kvstore.policies import LRUPolicy, make_policy
    with make_store(tmp_path) as store:
        default = type(make_policy("default"))
        assert default is not LRUPolicy
        assert isinstance(store.policies["host"], default)
        assert isinstance(store.policies["ssd"], default)
