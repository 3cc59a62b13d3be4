"""Codecs: exact round trips, bounded lossy error (synthetic and real MiniLM KV), deliberate
handling of inf/NaN, and DataLoss (never a crash) for every kind of bad payload."""

from __future__ import annotations

import importlib.util
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvstore_client.common.layout import KVLayout
from kvstore_client.errors import DataLoss, InvalidArgument

from tiers import codecs, frame
from tiers.codecs import NonFiniteBlock
from tiers.codecs import lossy_torch as codec_quant

DTYPES = ("float16", "bfloat16", "float32")
LOSSY = ("int8", "fp8_e4m3")
# Element error bound (‖x̂−x‖/‖x‖) on the synthetic outlier KV: INT8 measures ~0.5%, FP8 ~2%.
ELEM_BOUND = {"int8": 0.012, "fp8_e4m3": 0.04}


def _load_kv_capture():
    path = Path(__file__).resolve().parent.parent / "bench" / "kv_capture.py"
    spec = importlib.util.spec_from_file_location("kv_capture", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kv_capture"] = mod
    spec.loader.exec_module(mod)
    return mod


kc = _load_kv_capture()


def as_block(x: np.ndarray | torch.Tensor, dtype: str) -> np.ndarray:
    t = torch.as_tensor(x).to(codecs.TORCH_DTYPES[dtype]).contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().copy()


def values(block: np.ndarray, dtype: str) -> torch.Tensor:
    return torch.from_numpy(block.copy()).view(codecs.TORCH_DTYPES[dtype]).float()


def roundtrip(codec: str, block: np.ndarray, layout: KVLayout) -> np.ndarray:
    payload = codecs.encode(codec, block, layout)
    value = frame.frame(codec, layout.block_bytes, payload)
    name, raw_len, body = frame.unframe(value)
    assert (name, raw_len) == (codec, layout.block_bytes)
    out = np.full(layout.block_bytes, 0xAB, np.uint8)
    codecs.decode(name, body, layout, out)
    return out


def outlier_kv(layout: KVLayout, seed: int = 0) -> torch.Tensor:
    cap = kc.synthetic_kv(layout.num_layers, layout.block_tokens, layout.num_kv_heads,
                          layout.head_dim, seed)
    return torch.from_numpy(np.stack([cap.k[0], cap.v[0]], axis=1))


# ordinary blocks and single-token blocks (1 head of 8 dims) in every dtype
EDGE_LAYOUTS = ([KVLayout(2, 2, 16, 8, d) for d in DTYPES]
                + [KVLayout(3, 1, 8, 1, d) for d in DTYPES])


def edge_blocks(layout: KVLayout) -> dict[str, torch.Tensor]:
    shape = layout.block_shape
    tiny = torch.finfo(codecs.TORCH_DTYPES[layout.dtype]).tiny
    huge = torch.randn(shape)
    huge.view(-1)[7] = 3e4
    return {
        "zeros": torch.zeros(shape),
        "outlier": huge,
        "subnormal": (torch.rand(shape) - 0.5) * tiny,
        "kv": outlier_kv(layout),
        "negative_zero": torch.full(shape, -0.0),
    }


@pytest.mark.parametrize("layout", EDGE_LAYOUTS, ids=lambda lay: f"{lay.dtype}-T{lay.block_tokens}")
def test_exact_codecs_round_trip_bit_exact(layout):
    for name, x in edge_blocks(layout).items():
        block = as_block(x, layout.dtype)
        for codec in ("raw", "lossless"):
            assert np.array_equal(roundtrip(codec, block, layout), block), (codec, name)


@pytest.mark.parametrize("layout", EDGE_LAYOUTS, ids=lambda lay: f"{lay.dtype}-T{lay.block_tokens}")
@pytest.mark.parametrize("codec", LOSSY)
def test_lossy_round_trip_within_bounds(layout, codec):
    tiny = torch.finfo(codecs.TORCH_DTYPES[layout.dtype]).tiny
    for name, x in edge_blocks(layout).items():
        block = as_block(x, layout.dtype)
        x = values(block, layout.dtype)
        y = values(roundtrip(codec, block, layout), layout.dtype)
        assert torch.isfinite(y).all(), name
        if name == "subnormal":   # deliberately allowed to flush below the smallest normal
            assert float((y - x).abs().max()) <= tiny, name
            continue
        if name in ("zeros", "negative_zero"):
            assert float(y.abs().max()) == 0.0
            continue
        # every element within half a quantization step of its group's range (int8) or FP8's
        # relative precision; the norm-wise error bounded as measured
        assert codecs.relative_error(x, y) <= ELEM_BOUND[codec], name
        assert float((y - x).abs().max()) <= 0.07 * float(x.abs().max()), name


def test_lossy_error_on_outlier_kv_is_small_in_attention():
    layout = KVLayout(4, 8, 64, 16, "bfloat16")
    cap = kc.synthetic_kv(4, 128, 8, 64)
    int8 = kc.codec_accuracy(cap, "int8", "bfloat16", 16)
    fp8 = kc.codec_accuracy(cap, "fp8_e4m3", "bfloat16", 16)
    per_tensor = kc.codec_accuracy(cap, "fp8_e4m3", "bfloat16", 16, reference=kc.per_tensor_fp8)
    assert int8.attn_mean < 0.03 and int8.size_ratio <= 0.55
    assert fp8.attn_mean < per_tensor.attn_mean * 0.6 and fp8.size_ratio <= 0.55
    assert layout.block_bytes > 0


def test_fp8_bit_decode_matches_torch_for_every_code():
    codes = torch.arange(256, dtype=torch.uint8)
    ref = codes.view(torch.float8_e4m3fn).float()
    got = codec_quant._fp8_to_half(codes.clone()).float() * 256
    finite = ~torch.isnan(ref)
    assert torch.equal(got[finite], ref[finite])


@pytest.mark.parametrize("codec", ["lossless", "raw"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_lossless_keeps_inf_and_nan_bits(codec, dtype):
    layout = KVLayout(2, 2, 8, 4, dtype)
    x = torch.randn(layout.block_shape)
    x.view(-1)[[0, 5, 9]] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    block = as_block(x, dtype)
    assert np.array_equal(roundtrip(codec, block, layout), block)


@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("part", [0, 1])   # K or V
def test_lossy_refuses_non_finite(codec, bad, part):
    layout = KVLayout(2, 2, 8, 4, "bfloat16")
    x = torch.randn(layout.block_shape)
    x[1, part, 3, 1, 2] = bad
    with pytest.raises(NonFiniteBlock):
        codecs.encode(codec, as_block(x, "bfloat16"), layout)
    assert issubclass(NonFiniteBlock, ValueError)


def test_lossy_sizes_and_lossless_compresses_real_like_kv():
    layout = KVLayout(4, 8, 64, 32, "bfloat16")
    block = as_block(outlier_kv(layout), "bfloat16")
    n = layout.block_bytes
    assert len(codecs.encode("lossless", block, layout)) < 0.9 * n
    assert len(codecs.encode("int8", block, layout)) <= 0.55 * n
    assert len(codecs.encode("fp8_e4m3", block, layout)) <= 0.55 * n


@pytest.mark.parametrize("codec", LOSSY)
def test_encode_tensor_matches_encode(codec):
    layout = KVLayout(2, 4, 32, 16, "bfloat16")
    x = outlier_kv(layout).to(torch.bfloat16)
    a = bytes(codecs.encode(codec, as_block(x, "bfloat16"), layout))
    b = bytes(codecs.encode_tensor(codec, x, layout))
    assert a == b
    assert bytes(codecs.encode_tensor("lossless", x, layout)) == bytes(
        codecs.encode("lossless", as_block(x, "bfloat16"), layout))


def test_bf16_scales_lose_nothing_measurable():
    layout = KVLayout(4, 8, 64, 16, "bfloat16")
    block = as_block(outlier_kv(layout), "bfloat16")
    x = values(block, "bfloat16")
    for codec in LOSSY:
        base = codec_quant.SCHEMES[codec]
        f32 = codec_quant.QuantScheme(codec, base.k_group, base.k_offset, base.v_group,
                                      base.v_offset, side_f32=True)
        errs = []
        for scheme in (base, f32):
            out = np.empty_like(block)
            codecs.decode(codec, codecs.encode(codec, block, layout, scheme), layout, out)
            errs.append(codecs.relative_error(x, values(out, "bfloat16")))
        assert errs[0] <= errs[1] * 1.02, (codec, errs)


def test_measure_error_for_metrics():
    layout = KVLayout(2, 4, 32, 16, "bfloat16")
    block = as_block(outlier_kv(layout), "bfloat16")
    assert codecs.measure_error("lossless", block, layout)["element"] == 0.0
    m = codecs.measure_error("int8", block, layout)
    assert 0 < m["element"] < 0.02 and 0 <= m["attention_mean"] <= m["attention_max"] < 0.1


# ----------------------------------------------------------------- real KV (MiniLM)


@pytest.fixture(scope="module")
def minilm():
    if kc.missing():
        pytest.skip(f"not installed: {', '.join(kc.missing())} (`make dev` installs them)")
    return kc.load_capture(kc.PASSAGES[:2])


# The lossy size bound of the issue, 0.55x, is asserted on the trained causal LM
# (tests/test_codecs_trained.py, 0.546x). MiniLM, bidirectional, has a value sink in 22% of its
# (layer, head) slabs and payload v4 keeps those tokens exact (docs/codecs.md): 0.558x. So on
# MiniLM this checks 0.56x (0.55x before v4), and the test's name says so.
MINILM_LOSSY_SIZE = 0.56


def test_minilm_kv_accuracy_and_size_with_its_value_sinks_kept_exact(minilm):
    lossless = kc.codec_accuracy(minilm, "lossless", "bfloat16", 16)
    assert lossless.exact and lossless.size_ratio < 0.85
    int8 = kc.codec_accuracy(minilm, "int8", "bfloat16", 16)
    assert int8.attn_mean <= 0.01 and int8.attn_worst <= 0.015
    assert int8.size_ratio <= MINILM_LOSSY_SIZE
    fp8 = kc.codec_accuracy(minilm, "fp8_e4m3", "bfloat16", 16)
    ref = kc.codec_accuracy(minilm, "fp8_e4m3", "bfloat16", 16, reference=kc.per_tensor_fp8)
    assert fp8.attn_mean <= ref.attn_mean and fp8.size_ratio <= MINILM_LOSSY_SIZE
    assert fp8.attn_worst <= 0.75 * ref.attn_worst
    fp16 = kc.codec_accuracy(minilm, "int8", "float16", 16, passages=1)
    assert fp16.attn_mean <= 0.01


# ----------------------------------------------------------------- corrupt payloads

LAYOUT = KVLayout(2, 2, 16, 8, "bfloat16")


def good_payloads() -> dict[str, bytes]:
    block = as_block(outlier_kv(LAYOUT), "bfloat16")
    return {c: bytes(codecs.encode(c, block, LAYOUT)) for c in codecs.CODEC_IDS}


@pytest.mark.parametrize("codec", list(codecs.CODEC_IDS))
def test_truncated_or_extended_payload_is_data_loss(codec):
    p = good_payloads()[codec]
    out = np.empty(LAYOUT.block_bytes, np.uint8)
    for bad in (p[:-1], p[: len(p) // 2], p[:3], b"", p + b"\0"):
        if codec == "lossless" and bad == p + b"\0":
            continue   # trailing bytes after a zstd frame: caught by the frame's length+checksum
        with pytest.raises(DataLoss):
            codecs.decode(codec, bad, LAYOUT, out)


def test_payload_for_another_layout_or_codec_is_data_loss():
    p = good_payloads()
    out = np.empty(LAYOUT.block_bytes, np.uint8)
    f32 = KVLayout(2, 2, 16, 8, "float32")   # same shape, other dtype: lossless planes differ
    with pytest.raises(DataLoss):
        codecs.decode("lossless", p["lossless"], f32, np.empty(f32.block_bytes, np.uint8))
    wider = KVLayout(2, 4, 16, 8, "bfloat16")  # other shape: scales and codes do not fit
    for codec in ("lossless", "int8", "fp8_e4m3"):
        with pytest.raises(DataLoss):
            codecs.decode(codec, p[codec], wider, np.empty(wider.block_bytes, np.uint8))
    with pytest.raises(DataLoss):
        codecs.decode("int8", p["lossless"], LAYOUT, out)
    with pytest.raises(DataLoss, match="unknown codec"):
        codecs.decode("zstd9", p["lossless"], LAYOUT, out)


@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("bad", [float("nan"), -1.0, 0.0, float("inf")])
def test_bad_scales_are_data_loss(codec, bad):
    block = as_block(outlier_kv(LAYOUT), "bfloat16")
    scheme = codec_quant.QuantScheme(**{**codec_quant.SCHEMES[codec].__dict__, "compress": False})
    p = bytearray(codecs.encode(codec, block, LAYOUT, scheme))
    struct.pack_into("<H", p, codec_quant.HEADER_BYTES + 4,
                     torch.tensor([bad], dtype=torch.bfloat16).view(torch.int16).item() & 0xFFFF)
    out = np.empty(LAYOUT.block_bytes, np.uint8)
    with pytest.raises(DataLoss, match="scales"):
        codecs.decode(codec, bytes(p), LAYOUT, out)


@pytest.mark.parametrize("codec", ["lossless", "int8", "fp8_e4m3"])
def test_header_fields_are_checked(codec):
    p = bytearray(good_payloads()[codec])
    out = np.empty(LAYOUT.block_bytes, np.uint8)
    for pos, val in ((0, 99), (1, 0x80), (2, 0x3F)):
        q = bytearray(p)
        q[pos] = val
        with pytest.raises(DataLoss):
            codecs.decode(codec, bytes(q), LAYOUT, out)


def test_flipped_byte_in_compressed_body_is_data_loss_or_caught_by_frame():
    p = good_payloads()["lossless"]
    value = bytearray(frame.frame("lossless", LAYOUT.block_bytes, p))
    value[frame.HEADER_BYTES + 10] ^= 0xFF
    with pytest.raises(DataLoss):
        frame.unframe(value)
    q = bytearray(p)
    q[10] ^= 0xFF
    out = np.empty(LAYOUT.block_bytes, np.uint8)
    try:   # without the frame, zstd may or may not notice; it must not crash
        codecs.decode("lossless", bytes(q), LAYOUT, out)
    except DataLoss:
        pass


def test_caller_errors_are_invalid_argument():
    with pytest.raises(InvalidArgument):
        codecs.encode("gzip", np.zeros(LAYOUT.block_bytes, np.uint8), LAYOUT)
    with pytest.raises(InvalidArgument):
        codecs.encode("int8", np.zeros(LAYOUT.block_bytes - 2, np.uint8), LAYOUT)
    with pytest.raises(InvalidArgument):
        codecs.decode("int8", good_payloads()["int8"], LAYOUT, np.zeros(3, np.uint8))


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(list(codecs.CODEC_IDS) + ["bogus"]), st.binary(max_size=3000))
def test_fuzz_random_payload_only_data_loss(codec, data):
    out = np.empty(LAYOUT.block_bytes, np.uint8)
    try:
        codecs.decode(codec, data, LAYOUT, out)
    except DataLoss:
        pass


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["lossless", "int8", "fp8_e4m3"]), st.integers(0, 10**6),
       st.integers(1, 255))
def test_fuzz_corrupted_valid_payload_only_data_loss(codec, pos, xor):
    p = bytearray(good_payloads()[codec])
    p[pos % len(p)] ^= xor
    out = np.empty(LAYOUT.block_bytes, np.uint8)
    try:
        codecs.decode(codec, bytes(p), LAYOUT, out)
    except DataLoss:
        pass
