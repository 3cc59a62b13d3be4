"""Lossy codecs judged on a trained causal LM (SmolLM2-135M-Instruct,
kvstore_demo/trained_model.py):
worst (layer, head) attention error, size, and next-token agreement on real text; and the v2
payload that keeps attention-sink keys exact. Skipped where the model is not installed
(`make setup` installs it)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from kvstore_client.common.layout import KVLayout
from kvstore_client.errors import DataLoss

from kvstore_demo import trained_model
from tiers import codecs
from tiers.codecs import lossy_torch as codec_quant

ROOT = Path(__file__).resolve().parents[1]


def _kv_capture():
    spec = importlib.util.spec_from_file_location("kv_capture", ROOT / "bench" / "kv_capture.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("kv_capture", mod)
    spec.loader.exec_module(mod)
    return mod


kc = _kv_capture()


@pytest.fixture(scope="module")
def smollm():
    if not trained_model.available():
        pytest.skip(f"SmolLM2 not installed: {trained_model.INSTALL_HINT}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)            # under CPU contention one thread is far faster
    try:
        model, tok = trained_model.load()
        yield model, kc.capture_causal(model, tok, n_prompts=2)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(1200)       # loads the model (about 20 s on an idle core, minutes when busy)
def test_lossy_codecs_are_bounded_in_the_worst_head(smollm):
    model, cap = smollm
    assert len(cap.ids[0]) == 704 and cap.prefix == 640
    int8 = kc.causal_codec_accuracy(cap, "int8", model)
    fp8 = kc.causal_codec_accuracy(cap, "fp8_e4m3", model)
    per_tensor = kc.causal_codec_accuracy(cap, "fp8_e4m3", model, reference=kc.per_tensor_fp8)
    # Measured (bench/codecs.py, 5 prompts): int8 v4 worst 0.0078 (v3: 0.0107, v2: 0.021),
    # fp8 v4 0.065 vs per-tensor 0.154. The bounds, asserted as it states them:
    assert int8.attn_worst <= 0.01 and int8.size_ratio <= 0.55 and int8.top1 == 1.0
    assert int8.attn_mean <= 0.003
    assert fp8.attn_worst <= 0.5 * per_tensor.attn_worst
    assert fp8.size_ratio <= 0.55 and fp8.top1 >= 0.99
    assert int8.attn_mean < fp8.attn_mean < per_tensor.attn_mean


@pytest.mark.timeout(1200)
def test_lossy_codecs_hold_their_bounds_on_held_out_prompts(smollm):
    """The v4 thresholds were chosen on the bench's prompts; these 2 start at other passages.
    Measured on 5 such prompts: int8 worst 0.0078, fp8 0.45x per-tensor, top-1 1.0 / 0.9906."""
    model, _ = smollm
    _, tok = trained_model.load()
    cap = kc.capture_causal(model, tok, n_prompts=2, first=2)
    int8 = kc.causal_codec_accuracy(cap, "int8", model)
    fp8 = kc.causal_codec_accuracy(cap, "fp8_e4m3")
    per_tensor = kc.causal_codec_accuracy(cap, "fp8_e4m3", reference=kc.per_tensor_fp8)
    assert int8.attn_worst <= 0.01 and int8.size_ratio <= 0.55 and int8.top1 == 1.0
    assert fp8.attn_worst <= 0.5 * per_tensor.attn_worst and fp8.size_ratio <= 0.55


@pytest.mark.timeout(1200)
def test_sink_keys_are_kept_exact_and_cut_the_worst_head(smollm):
    model, cap = smollm
    v2 = codec_quant.QuantScheme("int8", v_group=codec_quant.TOKEN)      # the v2 scheme
    on = kc.causal_codec_accuracy(cap, "int8", scheme=v2)
    off = kc.causal_codec_accuracy(
        cap, "int8", scheme=codec_quant.QuantScheme("int8", v_group=codec_quant.TOKEN,
                                                    exact_sinks=False))
    assert on.attn_worst < 0.75 * off.attn_worst
    layout = KVLayout(cap.num_layers, cap.kv_heads, cap.head_dim, 16, "bfloat16")
    blk = kc.round_to(np.ascontiguousarray(cap.kv[0][:, :, :16]), "bfloat16")  # the first block
    payload = codecs.encode("int8", kc.to_dtype_bytes(blk, "bfloat16"), layout, v2)
    assert payload[0] == 2 and payload[1] & codec_quant.F_EXACT
    out = np.empty(layout.block_bytes, np.uint8)
    codecs.decode("int8", payload, layout, out)
    got = torch.from_numpy(out).view(torch.bfloat16).float().reshape(layout.block_shape)
    sinks = codec_quant.sink_mask(torch.from_numpy(blk[:, 1]))
    assert bool(sinks.any())
    assert torch.equal(got[:, 0][sinks], torch.from_numpy(blk[:, 0])[sinks])


# ------------------------------------------------------------ payload format (no model needed)
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=8, dtype="bfloat16")


def _block_with_sink(seed: int = 0) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(LAYOUT.block_shape, generator=g)
    x[:, 1, 0] *= 0.01                  # token 0: a near-zero value, as an attention sink has
    x[:, 0, 0] *= 5                     # ... and an unusual key
    return x.to(torch.bfloat16).contiguous().view(torch.uint8).numpy().reshape(-1).copy()


@pytest.mark.parametrize("codec", ["int8", "fp8_e4m3"])
def test_v2_payload_keeps_sink_keys_bit_exact(codec):
    raw = _block_with_sink()
    payload = bytes(codecs.encode(codec, raw, LAYOUT, codec_quant.SCHEMES[codec]))
    assert payload[0] == 2
    out = np.empty(LAYOUT.block_bytes, np.uint8)
    codecs.decode(codec, payload, LAYOUT, out)
    a = torch.from_numpy(raw).view(torch.bfloat16).reshape(LAYOUT.block_shape)
    b = torch.from_numpy(out).view(torch.bfloat16).reshape(LAYOUT.block_shape)
    assert torch.equal(a[:, 0, 0], b[:, 0, 0])          # the sink keys, every layer and head
    assert codecs.relative_error(a.float(), b.float()) < 0.05


@pytest.mark.parametrize("codec", ["int8", "fp8_e4m3"])
def test_v1_payloads_still_decode(codec):
    """Payloads written before exact sink keys (version 1) decode as before."""
    raw = _block_with_sink(1)
    s = codec_quant.SCHEMES[codec]
    v1 = codec_quant.QuantScheme(codec, s.k_group, s.k_offset, s.v_group, s.v_offset,
                                 compress=s.compress, exact_sinks=False)
    payload = bytes(codecs.encode(codec, raw, LAYOUT, v1))
    assert payload[0] == 1
    out = np.empty(LAYOUT.block_bytes, np.uint8)
    codecs.decode(codec, payload, LAYOUT, out)
    a = torch.from_numpy(raw).view(torch.bfloat16).float()
    assert codecs.relative_error(a, torch.from_numpy(out).view(torch.bfloat16).float()) < 0.1


def test_bad_exact_sections_are_data_loss():
    scheme = codec_quant.QuantScheme("int8", v_group=codec_quant.TOKEN, compress=False)
    payload = bytearray(codecs.encode("int8", _block_with_sink(2), LAYOUT, scheme))
    assert payload[0] == 2
    out = np.empty(LAYOUT.block_bytes, np.uint8)
    for bad in (payload[:-1], payload + b"\0", bytes([1]) + payload[1:]):  # short, long, v1 flag
        with pytest.raises(DataLoss):
            codecs.decode("int8", bytes(bad), LAYOUT, out)
    flipped = bytearray(payload)
    side = int.from_bytes(payload[4:8], "little")
    flipped[8 + side + LAYOUT.block_elements] ^= 0x80      # one more key named by the bitmap
    with pytest.raises(DataLoss, match="exact keys"):
        codecs.decode("int8", bytes(flipped), LAYOUT, out)
