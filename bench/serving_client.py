"""The serving benchmark's client: streamed `/v1/completions` with token-id prompts, timed to
the first token, and the engines' own counters.

Why streamed: time to first token is the time until the first streamed chunk that carries a
generated token; the whole response's time gives the request's latency. Prompts go as lists
of token ids, so neither the router nor the engine needs a tokenizer.

The generated token ids come back as logprob tokens (`logprobs: 0`; the engine runs with
`--return-tokens-as-token-ids`, which names them `token_id:N`), not through vLLM's own
`return_token_ids` field: vllm-router 0.1.17 reads a request body holding a field it does not
know as opaque, and then credits no cached prefix to any worker, so every `kv_aware`
decision would be blind.
"""

from __future__ import annotations

import http.client
import json
import re
import time
from dataclasses import dataclass, field

REQUEST_DEADLINE_S = 300.0


@dataclass
class Completion:
    ttft_s: float
    latency_s: float
    tokens: list[int]
    prompt_tokens: int
    cached_tokens: int
    id: str = ""                # the completion's id (`cmpl-...`), as the engine logs it
    extra: dict = field(default_factory=dict)

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def complete(port: int, model: str, prompt: list[int], max_tokens: int,
             deadline_s: float = REQUEST_DEADLINE_S) -> Completion:
    """One greedy streamed completion; raises RuntimeError on an HTTP error or a response
    without tokens or usage."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0.0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True},
                       "logprobs": 0}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=deadline_s)
    t0 = time.perf_counter()
    end = time.monotonic() + deadline_s
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"/v1/completions answered {resp.status}: "
                               f"{resp.read()[:500]!r}")
        ttft = None
        tokens: list[int] = []
        usage = None
        cid = ""
        for raw in resp:
            if time.monotonic() > end:
                raise RuntimeError(f"the response took longer than {deadline_s:.0f} s")
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            cid = cid or str(chunk.get("id") or "")
            for choice in chunk.get("choices") or ():
                got = _token_ids(choice)
                if got and ttft is None:
                    ttft = time.perf_counter() - t0
                tokens += got
            usage = chunk.get("usage") or usage
        latency = time.perf_counter() - t0
    finally:
        conn.close()
    if ttft is None or usage is None:
        raise RuntimeError("the streamed response carried no token or no usage")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Completion(ttft, latency, tokens, int(usage["prompt_tokens"]), int(cached), cid)


def _token_ids(choice: dict) -> list[int]:
    """The generated ids of one streamed choice, from its logprob tokens (`token_id:N`)."""
    out = []
    for t in (choice.get("logprobs") or {}).get("tokens") or ():
        if not (isinstance(t, str) and t.startswith(_TOKEN_PREFIX)):
            raise RuntimeError(f"a logprob token {t!r} is not `{_TOKEN_PREFIX}N`: is the engine "
                               "running with --return-tokens-as-token-ids?")
        out.append(int(t[len(_TOKEN_PREFIX):]))
    return out


_TOKEN_PREFIX = "token_id:"
_METRIC = re.compile(r'^(vllm:[a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+)$')
_SOURCE = re.compile(r'source="([a-z_]+)"')
WANTED = ("vllm:prompt_tokens_by_source_total", "vllm:external_prefix_cache_hits_total",
          "vllm:external_prefix_cache_queries_total", "vllm:kvstore_loaded_chunks",
          "vllm:kvstore_lookup_hit_chunks", "vllm:kvstore_lookup_miss_chunks")


def engine_counters(text: str) -> dict[str, float]:
    """The counters the report uses, from an engine's /metrics text: prompt tokens by source
    (local_compute = prefilled, local_cache_hit = its own prefix cache, external_kv_transfer
    = loaded from the offloading tiers) and the kvstore tier's own counters."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if not m or not m.group(1).startswith(WANTED):
            continue
        name = m.group(1)
        if name == "vllm:prompt_tokens_by_source_total":
            src = _SOURCE.search(m.group(2) or "")
            name = f"prompt_tokens_{src.group(1) if src else 'unknown'}"
        else:
            name = name.removeprefix("vllm:").removesuffix("_total")
        out[name] = out.get(name, 0.0) + float(m.group(3))
    return out


def add_counters(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in {*a, *b}}
