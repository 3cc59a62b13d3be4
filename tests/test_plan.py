"""`kvstore plan` against figures computed by hand (bytes per token = 2 x layers x KV heads x
head dim x bytes per element; MLA: layers x (kv_lora_rank + qk_rope_head_dim) x bytes)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvstore.cli import main
from kvstore.plan import PlanError, explicit_shape, shape_from_hf_config, tier_fits

# Llama-3-70B's config.json (the fields that matter).
LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8192,
             "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8,
             "torch_dtype": "bfloat16"}
# Llama-2-7B: MHA (no num_key_value_heads in older configs means one KV head per head).
LLAMA2_7B = {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
             "torch_dtype": "float16"}
# Falcon-7B: MQA spelled multi_query, GPT-style field names.
FALCON_7B = {"hidden_size": 4544, "n_head": 71, "n_layer": 32, "multi_query": True,
             "torch_dtype": "bfloat16"}
# DeepSeek-V3: MLA.
DEEPSEEK_V3 = {"hidden_size": 7168, "num_attention_heads": 128, "num_hidden_layers": 61,
               "num_key_value_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
               "qk_nope_head_dim": 128, "v_head_dim": 128, "torch_dtype": "bfloat16"}
# Qwen3-8B: head_dim given explicitly (not hidden_size / heads).
QWEN3_8B = {"hidden_size": 4096, "head_dim": 128, "num_attention_heads": 32,
            "num_hidden_layers": 36, "num_key_value_heads": 8, "torch_dtype": "bfloat16"}

MiB, GiB = 1 << 20, 1 << 30


@pytest.mark.parametrize("cfg, kind, per_token", [
    (LLAMA_70B, "GQA", 2 * 80 * 8 * 128 * 2),          # 327,680 = 320 KiB
    (LLAMA2_7B, "MHA", 2 * 32 * 32 * 128 * 2),         # 524,288 = 512 KiB
    (FALCON_7B, "MQA", 2 * 32 * 1 * 64 * 2),           # 8,192
    (DEEPSEEK_V3, "MLA", 61 * (512 + 64) * 2),         # 70,272
    (QWEN3_8B, "GQA", 2 * 36 * 8 * 128 * 2),           # 147,456
    ({"text_config": LLAMA_70B, "architectures": ["LlavaForConditionalGeneration"]}, "GQA",
     327_680),
])
def test_bytes_per_token_by_attention_variant(cfg, kind, per_token):
    shape = shape_from_hf_config(cfg)
    assert shape.attention == kind
    assert shape.bytes_per_token == per_token


def test_llama_70b_block_and_tier_fits_by_hand():
    shape = shape_from_hf_config(LLAMA_70B)
    assert shape.bytes_per_token == 327_680
    fits = {(f.tier, f.codec): f for f in tier_fits(shape, 16, {"host": GiB, "ssd": 8 * GiB})}
    host = fits["host", "raw"]
    assert host.bytes_per_block == 5_242_880               # 5 MiB, already 4 KiB aligned
    assert host.blocks == 204 and host.tokens == 3264       # 204 x 5 MiB <= 1 GiB < 205 x
    lossless = fits["ssd", "lossless"]
    assert lossless.bytes_per_block == 4_037_018            # ceil(5,242,880 x 0.77)
    assert lossless.blocks == 2127                          # 8 GiB // 4,037,018
    assert fits["ssd", "fp8_e4m3"].bytes_per_block == 2_883_584   # fp8 v4: the size of int8
    assert fits["ssd", "fp8_e4m3"].blocks == 2978
    assert fits["ssd", "int8"].bytes_per_block == 2_883_584
    assert fits["ssd", "int8"].blocks == 2978
    assert ("ssd", "raw") not in fits and ("host", "lossless") not in fits


def test_host_blocks_take_whole_4k_extents():
    shape = shape_from_hf_config(DEEPSEEK_V3)
    (host,) = tier_fits(shape, 16, {"host": 64 * MiB})
    assert host.bytes_per_block == 1_126_400                 # 1,124,352 rounded up to 4 KiB
    assert host.blocks == 59 and host.tokens == 944


def test_explicit_shape_and_dtype_override():
    mqa = explicit_shape(32, 1, 128, "float16", attention_heads=32)
    assert (mqa.attention, mqa.bytes_per_token) == ("MQA", 2 * 32 * 128 * 2)
    assert explicit_shape(32, 8, 128, "fp8").bytes_per_token == 2 * 32 * 8 * 128
    assert shape_from_hf_config(LLAMA_70B, dtype="float32").bytes_per_token == 655_360


@pytest.mark.parametrize("cfg, words", [
    ({"hidden_size": 4096}, "num_hidden_layers"),
    ({**LLAMA_70B, "num_key_value_heads": 7}, "multiple"),
    ({**LLAMA_70B, "torch_dtype": "float7"}, "float7"),
    ({**LLAMA_70B, "num_hidden_layers": 0}, "num_hidden_layers"),
])
def test_bad_configs_name_the_field(cfg, words):
    with pytest.raises(PlanError, match=words):
        shape_from_hf_config(cfg)


def test_cli_json_uses_the_configured_tiers(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_70B))
    rc = main(["plan", str(path), "--json", "--host-capacity", "64MiB", "--ssd-capacity",
               "256MiB", "--set", "remote.enabled=true", "--set", "remote.urls=redis://x:1",
               "--set", "remote.capacity=1GiB"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["bytes_per_token"] == 327_680 and out["bytes_per_block"] == 5_242_880
    fits = {(t["tier"], t["codec"]): t["blocks"] for t in out["tiers"]}
    assert fits["host", "raw"] == 12                        # 64 MiB // 5 MiB
    assert fits["ssd", "lossless"] == 66                    # 256 MiB // 4,037,018
    assert fits["ssd", "fp8_e4m3"] == 93
    assert fits["ssd", "int8"] == 93
    assert fits["remote", "lossless"] == 265                # 1 GiB // 4,037,018
    rc = main(["plan", str(tmp_path), "--set", "ssd.enabled=false", "--block-tokens", "32"])
    text = capsys.readouterr().out
    assert rc == 0 and "bytes per block (32 tokens): 10,485,760" in text and "ssd" not in text


def test_cli_mistakes_are_one_line_exit_2(tmp_path):
    for argv, words in ((["--layers", "80"], "--kv-heads"),
                        ([str(tmp_path / "nothing.json")], "no config file"),
                        (["--layers", "80", "--kv-heads", "8", "--head-dim", "128",
                          "--dtype", "float7"], "float7")):
        res = subprocess.run([sys.executable, "-m", "kvstore", "plan", *argv],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 2, res.stderr
        assert res.stderr.count("\n") == 1 and words in res.stderr, res.stderr
        assert "Traceback" not in res.stderr
