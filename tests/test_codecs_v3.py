"""The compiled codecs: lossy payload v3 (tiers/codecs/legacy/) and lossless payload v2.

Lossy v3 is no longer written by default (v4 is, tests/test_codecs_v4.py), but every v3 payload
already stored must still decode: these tests write v3 with its own encoder.

Formats: docs/codecs.md. What is checked here: v3/v2 headers, round trips within bounds in
every dtype and for head dims the Hadamard rotation cannot take, sink keys with a scale of their
own, older payloads (lossy v1/v2, lossless v1) still decoding, lossless bit-exactness on the data
that defeats its top-byte coder, and corrupt payloads being DataLoss (never a crash or a wrong
length). Speed is measured by bench/codecs.py, never asserted here.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from kvstore_client.common.layout import KVLayout
from kvstore_client.errors import DataLoss

from tiers import codecs
from tiers.codecs import lossless as codec_lossless
from tiers.codecs import lossy_torch as codec_quant
from tiers.codecs.legacy import lossy_v3 as codec_q3

SMOL = KVLayout(num_layers=3, num_kv_heads=3, head_dim=64, block_tokens=16, dtype="bfloat16")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def kv_block(layout: KVLayout, seed: int = 0, sink: bool = True) -> np.ndarray:
    """Random KV with what real keys have: channel offsets and an outlier channel; token 3's
    value near zero (an attention sink)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(layout.block_shape, generator=g)
    x[:, 0] += torch.randn(layout.head_dim, generator=g) * 3          # per-channel key offsets
    x[:, 0, ..., 1] *= 8                                               # an outlier key channel
    if sink and layout.block_tokens > 3:
        x[:, 1, 3] *= 0.01
        x[:, 0, 3] *= 4
    return x.to(DTYPES[layout.dtype]).contiguous().view(torch.uint8).numpy().reshape(-1).copy()


def vals(raw: np.ndarray, layout: KVLayout) -> torch.Tensor:
    return torch.from_numpy(raw.copy()).view(DTYPES[layout.dtype]).float().reshape(
        layout.block_shape)


def roundtrip(codec: str, raw: np.ndarray, layout: KVLayout) -> tuple[bytes, np.ndarray]:
    """Encode with the v3 encoder for lossy codecs (the default for lossless), then decode
    through the public API."""
    payload = bytes(codec_q3.encode(raw, layout, codec) if codec in codecs.LOSSY
                    else codecs.encode(codec, raw, layout))
    out = np.full(layout.block_bytes, 0xCD, np.uint8)
    codecs.decode(codec, payload, layout, out)
    return payload, out


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("head_dim", [64, 32, 24])
def test_int8_v3_round_trip_bounds(dtype, head_dim):
    layout = KVLayout(2, 2, head_dim, 16, dtype)
    raw = kv_block(layout, head_dim)
    payload, out = roundtrip("int8", raw, layout)
    assert payload[0] == codec_q3.VERSION
    flags = payload[1]
    rotated = head_dim & (head_dim - 1) == 0
    assert bool(flags & codec_q3.F_ROT_K) == rotated and bool(flags & codec_q3.F_ROT_V) == rotated
    assert bool(flags & codec_q3.F_IDX12) == (head_dim >= 64)
    assert flags & codec_q3.F_SINKS
    x, y = vals(raw, layout), vals(out, layout)
    for j in (0, 1):     # keys, values: within INT8's grid over each group
        assert codecs.relative_error(x[:, j], y[:, j]) < 0.01
    # the sink's key (token 3) has a scale of its own (one per vector: without the rotation an
    # outlier channel sets it, hence the looser bound)
    assert codecs.relative_error(x[:, 0, 3], y[:, 0, 3]) < (0.01 if rotated else 0.02)
    assert len(payload) <= 0.56 * layout.block_bytes


def test_warm_up_compiles_and_leaves_codecs_working():
    codecs.warm_up()
    payload, out = roundtrip("int8", kv_block(SMOL), SMOL)
    assert payload[0] == 3 and out.any()
    assert bytes(codecs.encode("int8", kv_block(SMOL), SMOL))[0] == 4


def test_int8_v3_size_on_a_smollm_shaped_block():
    payload, _ = roundtrip("int8", kv_block(SMOL), SMOL)
    # codes 0.5x + scales; the bench measures 0.546x on SmolLM2's real KV
    assert len(payload) / SMOL.block_bytes <= 0.55


def test_int8_v3_is_deterministic_and_refuses_non_finite():
    raw = kv_block(SMOL, 7)
    assert bytes(codec_q3.encode(raw, SMOL, "int8")) == bytes(codec_q3.encode(raw, SMOL, "int8"))
    for bad in (np.inf, np.nan):
        x = vals(raw, SMOL)
        x[1, 1, 5, 2, 9] = bad
        blk = x.to(torch.bfloat16).contiguous().view(torch.uint8).numpy().reshape(-1).copy()
        with pytest.raises(codecs.NonFiniteBlock):
            codec_q3.encode(blk, SMOL, "int8")


def test_tiny_and_zero_blocks():
    """All-zero blocks decode to zeros; values near float32's smallest normal keep an error
    below it (1/scale overflows there, the kernel divides instead)."""
    lay = KVLayout(2, 2, 16, 8, "float32")
    _, out = roundtrip("int8", np.zeros(lay.block_bytes, np.uint8), lay)
    assert not out.any()
    x = (torch.rand(lay.block_shape) - 0.5) * torch.finfo(torch.float32).tiny
    raw = x.contiguous().view(torch.uint8).numpy().reshape(-1).copy()
    _, out = roundtrip("int8", raw, lay)
    err = (vals(out, lay) - x).abs().max()
    assert float(err) <= torch.finfo(torch.float32).tiny


@pytest.mark.parametrize("codec", ["int8", "fp8_e4m3"])
def test_older_lossy_payloads_still_decode(codec):
    raw = kv_block(SMOL, 3)
    s = codec_quant.SCHEMES[codec]
    v1 = codec_quant.QuantScheme(codec, s.k_group, s.k_offset, s.v_group, s.v_offset,
                                 exact_sinks=False)
    for scheme, version in ((v1, 1), (s, 2)):
        payload = bytes(codecs.encode(codec, raw, SMOL, scheme))
        assert payload[0] == version
        out = np.empty(SMOL.block_bytes, np.uint8)
        codecs.decode(codec, payload, SMOL, out)
        assert codecs.relative_error(vals(raw, SMOL), vals(out, SMOL)) < 0.05


def test_fp8_v3_payloads_decode():
    """FP8 was never written as v3 by default (v2, then v4), but a v3 FP8 payload is a valid
    format."""
    raw = kv_block(SMOL, 4)
    payload = codec_q3.encode(raw, SMOL, "fp8_e4m3")
    assert payload[0] == 3
    out = np.empty(SMOL.block_bytes, np.uint8)
    codecs.decode("fp8_e4m3", payload, SMOL, out)
    assert codecs.relative_error(vals(raw, SMOL), vals(out, SMOL)) < 0.05
    assert bytes(codecs.encode("fp8_e4m3", raw, SMOL))[0] == 4


def test_corrupt_v3_payloads_are_data_loss():
    payload = bytearray(codec_q3.encode(kv_block(SMOL, 5), SMOL, "int8"))
    assert payload[1] & codec_q3.F_SINKS
    out = np.empty(SMOL.block_bytes, np.uint8)
    side = struct.unpack_from("<I", payload, 4)[0]

    def bad(p: bytes | bytearray, match: str | None = None) -> None:
        with pytest.raises(DataLoss, match=match):
            codecs.decode("int8", bytes(p), SMOL, out)

    bad(payload[:-1])
    bad(payload + b"\0")
    bad(payload[:7])
    for flags in (payload[1] | 0x40, payload[1] & ~codec_q3.F_SINKS):
        p = bytearray(payload)
        p[1] = flags
        bad(p)
    p = bytearray(payload)
    p[2] = 1                                                     # reserved byte
    bad(p)
    p = bytearray(payload)
    struct.pack_into("<I", p, 4, side + 1)
    bad(p, "scales")
    for value in (0.0, float("nan"), -1.0):                       # key scale base of slab 0
        p = bytearray(payload)
        bits = np.array([value], np.float32).view(np.uint32)[0] >> 16
        struct.pack_into("<H", p, codec_q3.HEADER_BYTES + 4, int(bits))
        bad(p, "scales")
    p = bytearray(payload)
    p[-1] = 0xFF                          # the bitmap's last byte: two sinks in a (layer, head)
    p[-2] = 0xFF
    bad(p)
    p = bytearray(payload)
    p[1] &= ~codec_q3.F_ROT_K
    out2 = np.empty_like(out)
    codecs.decode("int8", bytes(p), SMOL, out2)           # a valid (if different) payload
    odd = KVLayout(2, 2, 24, 16, "bfloat16")
    rotated_in_odd_dims = bytearray(codec_q3.encode(kv_block(odd), odd, "int8"))
    rotated_in_odd_dims[1] |= codec_q3.F_ROT_K
    with pytest.raises(DataLoss, match="power of two"):
        codecs.decode("int8", bytes(rotated_in_odd_dims), KVLayout(2, 2, 24, 16, "bfloat16"),
                      np.empty(KVLayout(2, 2, 24, 16, "bfloat16").block_bytes, np.uint8))


# ------------------------------------------------------------------ lossless v2


def _lossless_inputs(layout: KVLayout) -> dict[str, np.ndarray]:
    n = layout.block_bytes
    rng = np.random.default_rng(0)
    special = vals(kv_block(layout), layout)
    special.view(-1)[:7] = torch.tensor([np.inf, -np.inf, np.nan, -0.0, 0.0, 1e-40, 6e4])
    return {
        "kv": kv_block(layout),
        "random_bytes": rng.integers(0, 256, n, dtype=np.uint8),      # escapes -> stored as is
        "special": special.to(DTYPES[layout.dtype]).contiguous().view(torch.uint8).numpy()
        .reshape(-1).copy(),
        "zeros": np.zeros(n, np.uint8),
        "few_escapes": np.where(rng.random(n) < 0.02, rng.integers(0, 256, n), 7).astype(
            np.uint8),
    }


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_lossless_v2_bit_exact(dtype):
    layout = KVLayout(2, 3, 16, 7, dtype)
    for name, raw in _lossless_inputs(layout).items():
        payload, out = roundtrip("lossless", raw, layout)
        assert payload[0] == codec_lossless.VERSION
        assert np.array_equal(out, raw), name
        # fp16's top byte holds 2 mantissa bits: too many distinct values for 15 codes, so
        # real fp16 KV is stored as is (bf16 and fp32 top bytes are sign + exponent)
        if name == "zeros" or (name == "kv" and dtype != "float16"):
            assert payload[1] & codec_lossless.F_PACKED, name
            # half of a 16-bit element's bytes, a quarter of fp32's, are coded
            assert len(payload) < (0.9 if layout.itemsize == 2 else 0.95) * layout.block_bytes

        if name == "random_bytes":
            assert payload[1] == 0 and len(payload) == 4 + layout.block_bytes


def test_lossless_v1_payloads_still_decode():
    for name, raw in _lossless_inputs(SMOL).items():
        payload = codec_lossless.encode_v1(raw, SMOL)
        assert payload[0] == 1
        out = np.empty(SMOL.block_bytes, np.uint8)
        codecs.decode("lossless", payload, SMOL, out)
        assert np.array_equal(out, raw), name


def test_corrupt_lossless_v2_is_data_loss():
    payload = bytearray(codecs.encode("lossless", kv_block(SMOL), SMOL))
    assert payload[1] & codec_lossless.F_PACKED
    out = np.empty(SMOL.block_bytes, np.uint8)
    n_esc = struct.unpack_from("<I", payload, 20)[0]
    cases = [payload[:-1], payload + b"\0", payload[:10]]
    p = bytearray(payload)
    struct.pack_into("<I", p, 20, n_esc + 1)            # length no longer matches
    cases.append(p)
    p = bytearray(payload)
    p[1] |= 0x80
    cases.append(p)
    p = bytearray(payload)
    p[2] = 4                                            # planes of another dtype
    cases.append(p)
    # codes say more escapes than the stream holds: flip nibbles to 15, keep the length
    low = (codec_lossless._V2.size + SMOL.block_elements)
    p = bytearray(payload)
    for i in range(low, low + 64):
        p[i] = 0xFF
    cases.append(p)
    for c in cases:
        with pytest.raises(DataLoss):
            codecs.decode("lossless", bytes(c), SMOL, out)
