"""Lossy payload v4: the default of `int8` and `fp8_e4m3`.

Format: docs/codecs.md and tiers/codecs/lossy.py. What is checked here: the header and the exact
payload length, round trips within bounds in every dtype and for head dims the rotation cannot
take, the tokens kept exact (the value sink's key and value, the outlier key) being bit-exact and
counted in the size, determinism, non-finite input refused, tiny and zero blocks, and corrupt
payloads being DataLoss. Quality on a trained model: tests/test_codecs_trained.py.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from kvstore_client.common.layout import KVLayout
from kvstore_client.errors import DataLoss

from tiers import codecs
from tiers.codecs import lossy as codec_q4
from tiers.codecs import lossy_kernels

SMOL = KVLayout(num_layers=3, num_kv_heads=3, head_dim=64, block_tokens=16, dtype="bfloat16")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
LOSSY = ["int8", "fp8_e4m3"]
BOUND = {"int8": 0.01, "fp8_e4m3": 0.05}         # relative error of all keys / all values


def kv_block(layout: KVLayout, seed: int = 0) -> np.ndarray:
    """Random KV with what real keys have (channel offsets, an outlier channel), token 3 a sink
    (value near zero, unusual key) and token 9's key far from the others (an outlier key)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(layout.block_shape, generator=g)
    x[:, 0] += torch.randn(layout.head_dim, generator=g) * 3
    x[:, 0, ..., 1] *= 8
    x[:, 1, 3] *= 0.01
    x[:, 0, 3] *= 4
    x[:, 0, 9] += 12 * torch.randn(layout.head_dim, generator=g)
    return x.to(DTYPES[layout.dtype]).contiguous().view(torch.uint8).numpy().reshape(-1).copy()


def vals(raw: np.ndarray, layout: KVLayout) -> torch.Tensor:
    return torch.from_numpy(raw.copy()).view(DTYPES[layout.dtype]).float().reshape(
        layout.block_shape)


def roundtrip(codec: str, raw: np.ndarray, layout: KVLayout) -> tuple[bytes, np.ndarray]:
    payload = bytes(codecs.encode(codec, raw, layout))
    out = np.full(layout.block_bytes, 0xCD, np.uint8)
    codecs.decode(codec, payload, layout, out)
    return payload, out


def exact_counts(payload: bytes, layout: KVLayout) -> tuple[int, int]:
    """(exact keys, exact values) named by a v4 payload."""
    L, _, T, H, _ = layout.block_shape
    pos = codec_q4.HEADER_BYTES + codec_q4.side_bytes(layout) + layout.block_elements
    width = 2 if L * T * H <= 1 << 16 else 4
    counts = []
    for bit in (codec_q4.F_XK, codec_q4.F_XV):
        n = 0
        if payload[1] & bit:
            n = struct.unpack_from("<I", payload, pos)[0]
            pos += 4 + n * width
        counts.append(n)
    return counts[0], counts[1]


@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("head_dim", [64, 32, 24])
def test_v4_round_trip_bounds_and_exact_tokens(codec, dtype, head_dim):
    layout = KVLayout(2, 2, head_dim, 16, dtype)
    raw = kv_block(layout, head_dim)
    payload, out = roundtrip(codec, raw, layout)
    assert payload[0] == codec_q4.VERSION
    rotated = head_dim & (head_dim - 1) == 0
    assert bool(payload[1] & codec_q4.F_ROT_K) == rotated
    assert bool(payload[1] & codec_q4.F_ROT_V) == (rotated and codec == "int8")
    x, y = vals(raw, layout), vals(out, layout)
    for j in (0, 1):
        assert codecs.relative_error(x[:, j], y[:, j]) < BOUND[codec]
    # the sink (token 3): key and value bit-exact; the outlier key (token 9) bit-exact
    assert torch.equal(x[:, 0, 3], y[:, 0, 3]) and torch.equal(x[:, 1, 3], y[:, 1, 3])
    assert torch.equal(x[:, 0, 9], y[:, 0, 9])
    nk, nv = exact_counts(payload, layout)
    assert nk == 2 * 2 * 2 and nv == 2 * 2               # per (layer, head): 2 keys, 1 value
    item = layout.block_bytes // layout.block_elements
    want = (codec_q4.HEADER_BYTES + codec_q4.side_bytes(layout) + layout.block_elements
            + 2 * 4 + (nk + nv) * (2 + head_dim * (item - 1)))
    assert len(payload) == want


def test_v4_size_on_a_smollm_shaped_block():
    """Codes 0.5x + scales 0.037x; each exact vector adds its lower bytes (the bench measures
    0.540x on SmolLM2's real KV). Gaussian KV has neither sinks nor outlier keys."""
    raw = torch.randn(SMOL.block_shape, generator=torch.Generator().manual_seed(2)).to(
        torch.bfloat16).contiguous().view(torch.uint8).numpy().reshape(-1).copy()
    payload, _ = roundtrip("int8", raw, SMOL)
    assert exact_counts(payload, SMOL) == (0, 0)
    assert len(payload) / SMOL.block_bytes <= 0.54


@pytest.mark.parametrize("codec", LOSSY)
def test_v4_is_deterministic_and_refuses_non_finite(codec):
    raw = kv_block(SMOL, 7)
    assert bytes(codecs.encode(codec, raw, SMOL)) == bytes(codecs.encode(codec, raw, SMOL))
    for bad in (np.inf, np.nan):
        for part in (0, 1):
            x = vals(raw, SMOL)
            x[1, part, 5, 2, 9] = bad
            blk = x.to(torch.bfloat16).contiguous().view(torch.uint8).numpy().reshape(-1).copy()
            with pytest.raises(codecs.NonFiniteBlock):
                codecs.encode(codec, blk, SMOL)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("codec", LOSSY)
def test_v4_refuses_magnitudes_its_float32_math_cannot_hold(codec, dtype):
    """Finite values past 2**MAX_EXP overflowed the rotation and the outlier rule in float32:
    a payload that never decoded, or an outlier decoded to inf and NaN. They are refused like
    inf/NaN (the store keeps such a block lossless); just below the bound a block still
    round-trips finite, within the codec's error."""
    lay = KVLayout(2, 2, 64, 16, dtype)
    bound = 2.0 ** lossy_kernels.MAX_EXP
    for spike, whole in ((1e37, False), (bound, False), (bound, True)):
        x = torch.randn(lay.block_shape)
        if whole:
            x = x * bound / 8
            x[1, 0, 3, 1] = bound                # one head's keys all at the bound
        else:
            x[1, 0, 5, 1, 7] = spike
        raw = x.to(DTYPES[dtype]).contiguous().view(torch.uint8).numpy().reshape(-1).copy()
        with pytest.raises(codecs.NonFiniteBlock, match=f"2\\*\\*{lossy_kernels.MAX_EXP}"):
            codecs.encode(codec, raw, lay)
    x = torch.randn(lay.block_shape) * (bound / 64)
    x[1, 0, 5, 1, 7] = bound / 2
    raw = x.to(DTYPES[dtype]).contiguous().view(torch.uint8).numpy().reshape(-1).copy()
    _, out = roundtrip(codec, raw, lay)
    y, ref = vals(out, lay).double(), vals(raw, lay).double()      # (norms past float32)
    assert bool(torch.isfinite(y).all())
    assert float((y - ref).norm() / ref.norm()) < BOUND[codec]


@pytest.mark.parametrize("codec", LOSSY)
def test_v4_tiny_and_zero_blocks(codec):
    """All-zero blocks decode to zeros; values near float32's smallest normal keep an error
    below it (1/scale overflows there, the kernel divides instead)."""
    lay = KVLayout(2, 2, 16, 8, "float32")
    _, out = roundtrip(codec, np.zeros(lay.block_bytes, np.uint8), lay)
    assert not out.any()
    x = (torch.rand(lay.block_shape) - 0.5) * torch.finfo(torch.float32).tiny
    raw = x.contiguous().view(torch.uint8).numpy().reshape(-1).copy()
    _, out = roundtrip(codec, raw, lay)
    assert float((vals(out, lay) - x).abs().max()) <= torch.finfo(torch.float32).tiny


@pytest.mark.parametrize("tokens", [1, 2])
def test_v4_blocks_of_one_or_two_tokens(tokens):
    lay = KVLayout(2, 2, 32, tokens, "bfloat16")
    raw = (torch.randn(lay.block_shape) * 3).to(torch.bfloat16).contiguous().view(
        torch.uint8).numpy().reshape(-1).copy()
    _, out = roundtrip("int8", raw, lay)
    assert codecs.relative_error(vals(raw, lay), vals(out, lay)) < 0.01


def test_corrupt_v4_payloads_are_data_loss():
    payload = bytearray(codecs.encode("int8", kv_block(SMOL, 5), SMOL))
    assert payload[1] & codec_q4.F_XK and payload[1] & codec_q4.F_XV
    out = np.empty(SMOL.block_bytes, np.uint8)
    side = struct.unpack_from("<I", payload, 4)[0]
    xk_at = codec_q4.HEADER_BYTES + side + SMOL.block_elements

    def bad(p: bytes | bytearray, match: str | None = None) -> None:
        with pytest.raises(DataLoss, match=match):
            codecs.decode("int8", bytes(p), SMOL, out)

    bad(payload[:-1])
    bad(payload + b"\0")
    bad(payload[:7])
    bad(payload[:xk_at + 2])
    for flags in (payload[1] | 0x40, payload[1] & ~codec_q4.F_XV, payload[1] & ~codec_q4.F_XK):
        p = bytearray(payload)
        p[1] = flags
        bad(p)
    p = bytearray(payload)
    p[3] = 1                                                     # reserved byte
    bad(p)
    p = bytearray(payload)
    struct.pack_into("<I", p, 4, side + 1)
    bad(p, "scales")
    for value in (0.0, float("nan"), -1.0):                       # key scale base of slab 0
        p = bytearray(payload)
        bits = np.array([value], np.float32).view(np.uint32)[0] >> 16
        struct.pack_into("<H", p, codec_q4.HEADER_BYTES + 4, int(bits))
        bad(p, "scales")
    n = struct.unpack_from("<I", payload, xk_at)[0]
    for count in (0, 10**6, n + 1):
        p = bytearray(payload)
        struct.pack_into("<I", p, xk_at, count)
        bad(p)
    first = xk_at + 4
    for pos in (0xFFFF, struct.unpack_from("<H", payload, first + 2)[0]):  # range, order
        p = bytearray(payload)
        struct.pack_into("<H", p, first, pos)
        bad(p, "exact-token positions")
    odd = KVLayout(2, 2, 24, 16, "bfloat16")
    for bit in (codec_q4.F_ROT_K, codec_q4.F_ROT_V):
        p = bytearray(codecs.encode("int8", kv_block(odd), odd))
        p[1] |= bit
        with pytest.raises(DataLoss, match="power of two"):
            codecs.decode("int8", bytes(p), odd, np.empty(odd.block_bytes, np.uint8))


def test_v4_positions_use_u32_past_65536_tokens_and_heads():
    lay = KVLayout(num_layers=64, num_kv_heads=32, head_dim=8, block_tokens=33,
                   dtype="bfloat16")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(lay.block_shape, generator=g)
    x[:, 1, 3] *= 0.01
    raw = x.to(torch.bfloat16).contiguous().view(torch.uint8).numpy().reshape(-1).copy()
    payload, out = roundtrip("int8", raw, lay)
    y = vals(out, lay)
    assert torch.equal(x.to(torch.bfloat16).float()[:, 1, 3], y[:, 1, 3])
    assert exact_counts(payload, lay)[1] == 64 * 32
