"""Hugging Face transformers integration: reuse cached prompt prefixes in causal LMs.

A transformers causal LM (Llama/Qwen/Mistral-style, GQA included) keeps its KV in a `Cache`
object whose layers hold keys and values as `[batch, kv_heads, seq, head_dim]`. kvstore stores
blocks in one canonical layout, `[layers, 2 (K,V), tokens, kv_heads, head_dim]`, so that every
engine can share them; this module converts between the two and wraps the prefill:

    lookup -> load the cached prefix into a fresh DynamicCache -> prefill only the rest -> store

Positions are passed explicitly (`position_ids = arange(n, T)`), so RoPE continues from the
prefix length whatever the transformers version derives on its own.

torch and transformers are imported here, lazily with respect to the rest of the SDK: importing
`kvstore_client` never pulls them in; importing `kvstore_client.hf` does.

Scope: batch size 1, full-attention layers (sliding-window layers keep only a window of KV, which
is not the prefix a block key names, so such models are refused rather than served wrong KV).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .common.errors import InvalidArgument
from .common.layout import KVLayout

_TORCH_TO_NS: dict[torch.dtype, str] = {
    torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_NS_TO_TORCH: dict[str, torch.dtype] = {v: k for k, v in _TORCH_TO_NS.items()}


def _text_config(config: Any) -> Any:
    """The decoder config (multimodal configs nest it); plain LM configs are returned as is."""
    get = getattr(config, "get_text_config", None)
    if get is None:
        return config
    try:
        return get(decoder=True)
    except TypeError:  # older transformers: no `decoder` keyword
        return get()


def _check_full_attention(config: Any) -> None:
    tc = _text_config(config)
    layer_types = getattr(tc, "layer_types", None) or []
    # Qwen2-style configs carry a window but switch it off with use_sliding_window=False;
    # Mistral-style configs use it whenever sliding_window is set.
    windowed = bool(getattr(tc, "sliding_window", None)) and \
        getattr(tc, "use_sliding_window", True) is not False
    if any(t != "full_attention" for t in layer_types) or (not layer_types and windowed):
        raise InvalidArgument(
            "this model uses sliding-window attention on some layers; its cache does not hold "
            "the whole prefix, so kvstore prefix reuse is not supported for it")


def layout_for_model(model_or_config: Any, block_tokens: int = 16,
                     dtype: torch.dtype | str | None = None) -> KVLayout:
    """The KVLayout of a transformers causal LM, read from its config (and dtype)."""
    config = getattr(model_or_config, "config", model_or_config)
    _check_full_attention(config)
    tc = _text_config(config)
    heads = tc.num_attention_heads
    kv_heads = getattr(tc, "num_key_value_heads", None) or heads
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // heads
    if dtype is None:
        dtype = getattr(model_or_config, "dtype", None) or torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_TO_NS:
            raise InvalidArgument(f"model dtype {dtype} has no kvstore namespace dtype; "
                                  f"use one of {sorted(_NS_TO_TORCH)}")
        dtype = _TORCH_TO_NS[dtype]
    return KVLayout(num_layers=tc.num_hidden_layers, num_kv_heads=kv_heads, head_dim=head_dim,
                    block_tokens=block_tokens, dtype=dtype)


@contextmanager
def _single_threaded() -> Iterator[None]:
    """Run torch ops on one intra-op thread for the duration (the process setting is restored).

    The layout conversions are a few dozen ~1 MiB copies. On a busy machine, each parallel
    region waits for its slowest (descheduled) thread: measured 2 ms single-threaded against
    up to 130 ms with 2 threads on a loaded 2-core box. One thread copies at memory speed anyway.
    """
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _as_ids(input_ids: Any) -> torch.Tensor:
    """Token ids as a 1-D int64 CPU tensor; accepts a list, ndarray, [T] or [1, T] tensor."""
    t = torch.as_tensor(np.asarray(input_ids.cpu() if isinstance(input_ids, torch.Tensor)
                                   else input_ids))
    if t.ndim == 2:
        if t.shape[0] != 1:
            raise InvalidArgument(f"only batch size 1 is supported, got input_ids {tuple(t.shape)}")
        t = t[0]
    if t.ndim != 1:
        raise InvalidArgument(f"input_ids must be [T] or [1, T], got shape {tuple(t.shape)}")
    return t.to(torch.int64)


def cache_seq_length(cache: Any) -> int:
    """Tokens held by a transformers cache (0 for an empty one)."""
    return int(cache.get_seq_length()) if cache is not None else 0


def _layer_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    layers = getattr(cache, "layers", None)
    if layers is not None:  # transformers >= 4.56
        return layers[layer].keys, layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def cache_to_canonical(cache: Any, start: int = 0, end: int | None = None,
                       dtype: torch.dtype | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens [start, end) of a batch-1 cache as a CPU tensor [L, 2, end-start, H, D].

    Copies (the cache's own tensors keep being appended to by the model); `out` may be a
    preallocated buffer of at least that many tokens, which avoids fresh-buffer page faults.
    """
    num_layers = len(cache)
    k0, _ = _layer_kv(cache, 0)
    if k0.shape[0] != 1:
        raise InvalidArgument(f"only batch size 1 is supported, cache batch is {k0.shape[0]}")
    total = k0.shape[-2]
    end = total if end is None else end
    if not 0 <= start <= end <= total:
        raise InvalidArgument(f"token range [{start}, {end}) outside the cache's {total} tokens")
    _, heads, _, head_dim = k0.shape
    dtype = dtype or k0.dtype
    n = end - start
    if out is None:
        out = torch.empty((num_layers, 2, n, heads, head_dim), dtype=dtype)
    else:
        out = out[:, :, :n]
    with _single_threaded():
        for layer in range(num_layers):
            k, v = _layer_kv(cache, layer)
            out[layer, 0].copy_(k[0, :, start:end].transpose(0, 1))
            out[layer, 1].copy_(v[0, :, start:end].transpose(0, 1))
    return out


def canonical_to_cache(kv: torch.Tensor | np.ndarray, config: Any = None,
                       device: torch.device | str | None = None,
                       dtype: torch.dtype | None = None) -> Any:
    """A new DynamicCache holding `kv` ([L, 2, T, H, D]) as the model's first T positions."""
    from transformers import DynamicCache

    kv = torch.as_tensor(kv)
    if kv.ndim != 5 or kv.shape[1] != 2:
        raise InvalidArgument(
            f"kv must be [layers, 2, tokens, heads, head_dim], got {tuple(kv.shape)}")
    try:
        cache = DynamicCache(config=config) if config is not None else DynamicCache()
    except TypeError:  # transformers < 4.56 takes no config
        cache = DynamicCache()
    if kv.shape[2] == 0:
        return cache
    on_cpu = device is None or torch.device(device).type == "cpu"
    with _single_threaded() if on_cpu else nullcontext():
        for layer in range(kv.shape[0]):
            # [T, H, D] -> [1, H, T, D]. Always a contiguous copy: `kv` may be a reused load
            # buffer, and some transformers versions keep the tensor given to `update` as is.
            k, v = (kv[layer, i].transpose(0, 1).unsqueeze(0).to(
                device=device, dtype=dtype, memory_format=torch.contiguous_format, copy=True)
                for i in (0, 1))
            cache.update(k, v, layer)
    return cache


@dataclass
class PrefillResult:
    """What one prefill produced; `timings` (seconds) separates lookup, load, compute and store.

    Time to first token is `ttft_s` (lookup + load + compute): storing the new blocks is work an
    engine does after the first token is out (or in the background).
    """

    logits: torch.Tensor            # [vocab] next-token logits after the prompt
    cache: Any                      # the transformers cache holding the whole prompt
    reused_tokens: int              # prompt tokens loaded from kvstore instead of computed
    stored_blocks: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def ttft_s(self) -> float:
        t = self.timings
        return t.get("lookup", 0.0) + t.get("load", 0.0) + t.get("compute", 0.0)


def _model_device_dtype(model: Any) -> tuple[torch.device, torch.dtype]:
    p = next(model.parameters())
    return p.device, p.dtype


_CACHE_KWARG: dict[type, str] = {}


def cache_kwarg(model: Any) -> str:
    """The name a model's forward takes its cache by: `cache` in transformers that renamed it
    (5.2x, where `past_key_values` is deprecated and goes in 5.40), else `past_key_values`."""
    cls = type(model)
    name = _CACHE_KWARG.get(cls)
    if name is None:
        params = inspect.signature(model.forward).parameters
        name = _CACHE_KWARG[cls] = "cache" if "cache" in params else "past_key_values"
    return name


@torch.inference_mode()
def forward_with_cache(model: Any, ids: torch.Tensor, cache: Any, start: int) -> torch.Tensor:
    """Run `ids` (1-D) at positions start.. on top of `cache`; returns last-position logits."""
    device, _ = _model_device_dtype(model)
    pos = torch.arange(start, start + len(ids), device=device).unsqueeze(0)
    out = model(input_ids=ids.to(device).unsqueeze(0), position_ids=pos, use_cache=True,
                logits_to_keep=1, **{cache_kwarg(model): cache})
    return out.logits[0, -1]


class PrefixCacheRunner:
    """Prefill a transformers causal LM with kvstore prefix reuse.

    `ns` is a namespace handle from `client.namespace(...)` (anything with `lookup`, `load` and
    `store` as in the SDK). Build one with `PrefixCacheRunner.create(client, model, name)` to
    register the namespace from the model's own config.
    """

    def __init__(self, ns: Any, model: Any, layout: KVLayout) -> None:
        self.ns = ns
        self.model = model
        self.layout = layout
        self._dtype = _NS_TO_TORCH[layout.dtype]
        # reused: a fresh one page-faults on every load (docs/performance.md)
        self._buf: torch.Tensor | None = None

    @classmethod
    def create(cls, client: Any, model: Any, model_name: str, *, revision: str = "",
               block_tokens: int = 16, codec: str = "lossless", **ns_kwargs: Any
               ) -> PrefixCacheRunner:
        """Register (or join) the namespace matching `model` and return a runner for it."""
        layout = layout_for_model(model, block_tokens=block_tokens)
        ns = client.namespace(layout, model=model_name, revision=revision, codec=codec,
                              **ns_kwargs)
        return cls(ns, model, layout)

    def _load_buffer(self, tokens: int) -> torch.Tensor:
        lay = self.layout
        if self._buf is None or self._buf.shape[2] < tokens:
            self._buf = torch.empty((lay.num_layers, 2, tokens, lay.num_kv_heads, lay.head_dim),
                                    dtype=self._dtype)
        return self._buf[:, :, :tokens]

    def reusable_tokens(self, n_tokens: int) -> int:
        """At most the full blocks before the last token: the last token must run for logits."""
        bt = self.layout.block_tokens
        return max(0, (n_tokens - 1) // bt * bt)

    def load_prefix(self, input_ids: Any) -> tuple[Any, int, dict[str, float]]:
        """(cache with the cached prefix, its length in tokens, timings) for `input_ids`."""
        ids = _as_ids(input_ids)
        timings: dict[str, float] = {}
        device, model_dtype = _model_device_dtype(self.model)
        limit = self.reusable_tokens(len(ids))
        t0 = time.perf_counter()
        hit = min(int(self.ns.lookup(ids[:limit].numpy())), limit) if limit else 0
        t1 = time.perf_counter()
        timings["lookup"] = t1 - t0
        n = 0
        kv = self._load_buffer(hit)     # with hit == 0, an empty [L, 2, 0, H, D] view
        if hit:
            # The daemon may have evicted blocks since lookup: trust only what load returns.
            n = int(self.ns.load(ids[:hit].numpy(), out=kv))
            n = min(n, hit) // self.layout.block_tokens * self.layout.block_tokens
        cache = canonical_to_cache(kv[:, :, :n], self.model.config, device=device,
                                   dtype=model_dtype)
        timings["load"] = time.perf_counter() - t1
        return cache, n, timings

    def store(self, token_ids: Any, cache: Any) -> int:
        """Store the full blocks of `token_ids` whose KV `cache` holds; returns blocks written.

        Usable after generation too: pass prompt + generated ids; only positions the cache
        already holds (all but the last generated token) count.
        """
        ids = _as_ids(token_ids)
        n = min(len(ids), cache_seq_length(cache))
        full = n // self.layout.block_tokens * self.layout.block_tokens
        if full == 0:
            return 0
        kv = cache_to_canonical(cache, 0, full, dtype=self._dtype)
        return int(self.ns.store(ids[:full].numpy(), kv))

    def prefill(self, input_ids: Any, *, store: bool = True) -> PrefillResult:
        """lookup -> load -> prefill the rest -> (store); logits equal a full prefill's."""
        ids = _as_ids(input_ids)
        if len(ids) == 0:
            raise InvalidArgument("cannot prefill an empty prompt")
        cache, n, timings = self.load_prefix(ids)
        t0 = time.perf_counter()
        logits = forward_with_cache(self.model, ids[n:], cache, n)
        timings["compute"] = time.perf_counter() - t0
        stored = 0
        if store:
            t1 = time.perf_counter()
            stored = self.store(ids, cache)
            timings["store"] = time.perf_counter() - t1
        return PrefillResult(logits=logits, cache=cache, reused_tokens=n, stored_blocks=stored,
                             timings=timings)

    def generate(self, input_ids: Any, *, store: bool = True, **generate_kwargs: Any
                 ) -> torch.Tensor:
        """`model.generate` with the cached prefix preloaded; stores prompt + output blocks.

        transformers' own generate prefills only the tokens the cache does not yet hold.
        """
        ids = _as_ids(input_ids)
        cache, _, _ = self.load_prefix(ids)
        device, _ = _model_device_dtype(self.model)
        out = self.model.generate(ids.to(device).unsqueeze(0),
                                  attention_mask=torch.ones(1, len(ids), dtype=torch.long,
                                                            device=device),
                                  **{cache_kwarg(self.model): cache}, **generate_kwargs)
        if store:
            self.store(out[0], cache)
        return out


@torch.inference_mode()
def full_prefill(model: Any, input_ids: Any) -> tuple[torch.Tensor, Any]:
    """Plain prefill without kvstore (the reference): (last-position logits, cache)."""
    from transformers import DynamicCache

    ids = _as_ids(input_ids)
    try:
        cache = DynamicCache(config=model.config)
    except TypeError:
        cache = DynamicCache()
    return forward_with_cache(model, ids, cache, 0), cache


@torch.inference_mode()
def teacher_forced_logits(model: Any, first_logits: torch.Tensor, cache: Any,
                          tokens: Sequence[int]) -> list[torch.Tensor]:
    """Next-token logits at each step when feeding `tokens` one by one onto `cache`.

    Step 0 is `first_logits`. Feeding a fixed token path (the reference run's greedy output)
    compares two caches on the same positions, so one early disagreement does not make every
    later step incomparable.
    """
    out = [first_logits]
    pos = cache_seq_length(cache)
    for i, tok in enumerate(tokens[:-1]):
        out.append(forward_with_cache(model, torch.tensor([int(tok)]), cache, pos + i))
    return out


@torch.inference_mode()
def greedy_decode(model: Any, first_logits: torch.Tensor, cache: Any, steps: int
                  ) -> tuple[list[int], list[torch.Tensor]]:
    """`steps` greedy tokens after `first_logits` (mutates `cache`), and the logits each came from.

    The logits list of a reference run equals `teacher_forced_logits` on its own tokens, so one
    decode gives both the token path and the reference distributions.
    """
    toks = [int(first_logits.argmax())]
    logits = [first_logits]
    pos = cache_seq_length(cache)
    for i in range(steps - 1):
        logits.append(forward_with_cache(model, torch.tensor([toks[-1]]), cache, pos + i))
        toks.append(int(logits[-1].argmax()))
    return toks, logits


def compare_distributions(ref: Sequence[torch.Tensor], test: Sequence[torch.Tensor]
                          ) -> dict[str, float]:
    """Top-1 agreement and mean KL(ref || test) of next-token distributions, step by step."""
    if len(ref) != len(test) or not ref:
        raise InvalidArgument("need two equally long, non-empty lists of logits")
    r = torch.stack([x.float() for x in ref])
    t = torch.stack([x.float() for x in test])
    lr, lt = torch.log_softmax(r, -1), torch.log_softmax(t, -1)
    kl = (lr.exp() * (lr - lt)).sum(-1)
    return {"top1": float((r.argmax(-1) == t.argmax(-1)).float().mean()),
            "mean_kl": float(kl.mean()), "max_kl": float(kl.max()),
            "max_abs": float((r - t).abs().max())}
