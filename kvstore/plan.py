"""`kvstore plan`: how much KV a configuration holds, before an operator sizes anything.

Why a planner: sizing a tier needs bytes per token, which depends on the attention variant
(MHA, GQA and MQA store K and V for each KV head; MLA stores one compressed latent per token)
and then on what each tier stores per block (host: the raw block in 4 KiB-aligned extents;
SSD and remote: the block encoded with the namespace codec). All of it is arithmetic on the
model's config.json and the daemon's config, so it runs without torch, a daemon or a GPU.

bytes per token = 2 (K, V) x layers x KV heads x head dim x bytes per element
                = layers x (kv_lora_rank + qk_rope_head_dim) x bytes per element   (MLA)
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .config import format_size

DTYPE_BYTES = {"float32": 4, "fp32": 4, "float": 4, "float16": 2, "fp16": 2, "half": 2,
               "bfloat16": 2, "bf16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1,
               "int8": 1}
# Stored bytes / raw bytes, measured on real KV in 16-token blocks (docs/codecs.md, table at
# the top). The host tier always holds raw blocks; SSD and remote hold the namespace codec's.
CODEC_RATIOS = {"raw": 1.0, "lossless": 0.77, "fp8_e4m3": 0.55, "int8": 0.55}
HOST_ALIGN = 4096          # host slab extents (tiers/slab.py)


class PlanError(ValueError):
    """The model description is incomplete or contradictory; the message names the field."""


@dataclass(frozen=True)
class ModelShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    attention: str            # "MHA" | "GQA" | "MQA" | "MLA"
    latent_dim: int = 0       # MLA only: kv_lora_rank + qk_rope_head_dim

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        if self.attention == "MLA":
            return self.layers * self.latent_dim * self.dtype_bytes
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PlanError(f"{name} must be a positive integer, got {value!r}")
    return value


def _dtype(value: Any) -> str:
    name = str(value).removeprefix("torch.").lower()
    if name not in DTYPE_BYTES:
        raise PlanError(f"dtype {value!r} is not one of {sorted(DTYPE_BYTES)}")
    return name


def attention_kind(attention_heads: int, kv_heads: int) -> str:
    if kv_heads == attention_heads:
        return "MHA"
    if kv_heads == 1:
        return "MQA"
    return "GQA"


def explicit_shape(layers: int, kv_heads: int, head_dim: int, dtype: str = "bfloat16",
                   attention_heads: int | None = None) -> ModelShape:
    """A shape from the four numbers (attention_heads only names the variant)."""
    kv = _positive("kv heads", kv_heads)
    heads = _positive("attention heads", attention_heads) if attention_heads else kv
    if heads % kv:
        raise PlanError(f"attention heads ({heads}) must be a multiple of KV heads ({kv})")
    return ModelShape(_positive("layers", layers), kv, _positive("head dim", head_dim),
                      _dtype(dtype), attention_kind(heads, kv))


def _first(cfg: dict, *names: str) -> Any:
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return None


def shape_from_hf_config(cfg: dict[str, Any], dtype: str | None = None) -> ModelShape:
    """A Hugging Face config.json (Llama, Mistral, Qwen, Falcon, GPT-BigCode, DeepSeek...).

    Multimodal configs keep the language model under `text_config`; MQA is spelled
    `num_key_value_heads: 1`, `multi_query: true` or `n_head_kv`; MLA (DeepSeek-V2/V3) is the
    presence of `kv_lora_rank`.
    """
    if _first(cfg, "num_hidden_layers", "n_layer", "num_layers") is None and isinstance(
            cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "torch_dtype": cfg["text_config"].get(
            "torch_dtype") or cfg.get("torch_dtype")}
    layers = _first(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(cfg, "num_attention_heads", "n_head")
    if layers is None or heads is None:
        raise PlanError("config.json names no num_hidden_layers / num_attention_heads; pass "
                        "--layers, --kv-heads and --head-dim instead")
    layers, heads = _positive("num_hidden_layers", layers), _positive("num_attention_heads",
                                                                      heads)
    dt = _dtype(dtype or _first(cfg, "torch_dtype", "dtype") or "bfloat16")
    if cfg.get("kv_lora_rank"):
        latent = _positive("kv_lora_rank", cfg["kv_lora_rank"]) + int(
            cfg.get("qk_rope_head_dim") or 0)
        return ModelShape(layers, 1, latent, dt, "MLA", latent_dim=latent)
    if cfg.get("multi_query"):
        kv = 1
    else:
        kv = _positive("num_key_value_heads",
                       _first(cfg, "num_key_value_heads", "n_head_kv", "num_kv_heads") or heads)
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        hidden = _first(cfg, "hidden_size", "n_embd", "d_model")
        if hidden is None:
            raise PlanError("config.json names neither head_dim nor hidden_size")
        head_dim = _positive("hidden_size", hidden) // heads
    if heads % kv:
        raise PlanError(f"num_attention_heads ({heads}) must be a multiple of "
                        f"num_key_value_heads ({kv})")
    return ModelShape(layers, kv, _positive("head_dim", head_dim), dt, attention_kind(heads, kv))


def load_hf_config(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise PlanError(f"no config file at {p}") from None
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"cannot read {p} as JSON: {e}") from None
    if not isinstance(data, dict):
        raise PlanError(f"{p} holds no JSON object")
    return data


@dataclass(frozen=True)
class TierFit:
    tier: str
    capacity_bytes: int
    codec: str
    bytes_per_block: int       # what the tier spends on one block with this codec
    blocks: int
    tokens: int


def tier_fits(shape: ModelShape, block_tokens: int, tiers: dict[str, int]) -> list[TierFit]:
    """Blocks and tokens per tier: host at raw size in aligned extents, keyed tiers per codec."""
    block = shape.bytes_per_token * _positive("block tokens", block_tokens)
    out = []
    for tier, capacity in tiers.items():
        if tier in ("host", "gpu"):
            codecs = {"raw": math.ceil(block / HOST_ALIGN) * HOST_ALIGN}
        else:
            codecs = {c: math.ceil(block * r) for c, r in CODEC_RATIOS.items() if c != "raw"}
        for codec, per_block in codecs.items():
            n = capacity // per_block
            out.append(TierFit(tier, capacity, codec, per_block, n, n * block_tokens))
    return out


def tiers_from_config(cfg: Any) -> dict[str, int]:
    """Capacity of each enabled tier of a StoreConfig (GPU: per device x devices)."""
    tiers = {"host": cfg.host.capacity}
    if cfg.gpu.enabled:
        tiers["gpu"] = cfg.gpu.capacity * max(1, len(cfg.gpu.devices))
    if cfg.ssd.enabled:
        tiers["ssd"] = cfg.ssd.capacity
    if cfg.remote.enabled:
        tiers["remote"] = cfg.remote.capacity
    return tiers


def plan(shape: ModelShape, block_tokens: int, tiers: dict[str, int]) -> dict[str, Any]:
    """Everything `kvstore plan --json` prints."""
    return {"model": asdict(shape) | {"bytes_per_token": shape.bytes_per_token},
            "block_tokens": block_tokens,
            "bytes_per_block": shape.bytes_per_token * block_tokens,
            "tiers": [asdict(f) for f in tier_fits(shape, block_tokens, tiers)]}


def format_plan(result: dict[str, Any]) -> str:
    """The plan as a person reads it at a terminal."""
    m = result["model"]
    heads = (f"latent {m['latent_dim']}" if m["attention"] == "MLA"
             else f"{m['kv_heads']} KV heads x head dim {m['head_dim']}")
    lines = [f"model: {m['attention']}, {m['layers']} layers, {heads}, {m['dtype']}",
             f"bytes per token: {m['bytes_per_token']:,} ({format_size(m['bytes_per_token'])})",
             f"bytes per block ({result['block_tokens']} tokens): "
             f"{result['bytes_per_block']:,} ({format_size(result['bytes_per_block'])})", ""]
    rows = [("tier", "capacity", "codec", "per block", "blocks", "tokens")]
    for t in result["tiers"]:
        rows.append((t["tier"], format_size(t["capacity_bytes"]), t["codec"],
                     format_size(t["bytes_per_block"]), f"{t['blocks']:,}", f"{t['tokens']:,}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        lines.append("  ".join(c.ljust(w) if i in (0, 2) else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True))))
    lines.append("")
    lines.append("SSD/remote sizes are measured ratios on real KV (docs/codecs.md); the host "
                 "pool holds raw blocks.")
    return "\n".join(lines)
