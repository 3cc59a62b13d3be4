"""Hugging Face figures: TTFT speedup from prefix reuse, and what lossy codecs do to the model.

Measured in one run against one daemon (a temporary one unless `--address` is given), on the
trained SmolLM2-135M-Instruct (kvstore_demo/trained_model.py) over real text through its tokenizer
(`--model demo` for the random-weight model), fp32 on CPU:

- `ttft_speedup`: a prompt = shared prefix (2,048 tokens of real prose) + a new turn (real
  prose too). Median TTFT of a full prefill over median TTFT with kvstore (lookup + load of the
  prefix + prefill of the new turn), the two interleaved so machine noise hits both.
  `ttft_vs_floor` compares the kvstore TTFT with the same partial prefill on a cache already in
  process memory (the best any store can do).
- `lossless_max_abs`: max |logit difference| of reuse through kvstore against that same
  partial prefill on the in-memory cache (0: kvstore returned the KV bit for bit), and
  `lossless_ssd_max_abs` after the blocks were demoted to SSD and promoted back.
  `full_vs_reuse_max_abs`: against a full prefill (differs in float rounding only: a different
  chunking of the same attention).
- `fp8_top1`, `int8_top1` (+ `_mean_kl`): namespaces with that codec; blocks demoted to SSD
  (encoded) by an admin Evict of the host tier, then promoted (decoded) by the load. Next-token
  distributions over 32 greedy steps (teacher-forced on the reference's greedy path) against
  the no-reuse run: top-1 agreement and mean KL(ref || reuse).

Last line: one JSON object. `--quick` finishes within about a minute on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import torch  # noqa: E402
from kvstore_client import connect  # noqa: E402
from kvstore_client.hf import (  # noqa: E402
    PrefixCacheRunner,
    cache_to_canonical,
    canonical_to_cache,
    compare_distributions,
    forward_with_cache,
    full_prefill,
    greedy_decode,
    teacher_forced_logits,
)

from kvstore_demo.chat import TRAINED, build_model, daemon_address  # noqa: E402
from kvstore_demo.text import PASSAGES, document  # noqa: E402


def evict_host(client: Any, address: str) -> None:
    """Demote everything evictable from the host tier to SSD (the admin Evict RPC)."""
    if hasattr(client, "evict"):
        client.evict("host", 0)
        return
    import grpc
    from kvstore_client._proto import kvstore_pb2 as pb
    from kvstore_client._proto import kvstore_pb2_grpc as pbg

    target = address if address.startswith("unix:") or ":" in address else f"unix:{address}"
    with grpc.insecure_channel(target) as ch:
        pbg.KVStoreStub(ch).Evict(pb.EvictRequest(tier="host", bytes=0), timeout=60)


def measure_speedup(runner: PrefixCacheRunner, model: Any, prefix: torch.Tensor,
                    turns: Any, reps: int) -> dict[str, float]:
    """`turns()` gives the next new turn's tokens."""

    def turn() -> torch.Tensor:
        return torch.cat([prefix, turns()])

    runner.prefill(turn(), store=True)           # the first engine computes and stores the prefix
    base, reuse, floor, loads, diffs, full_diffs, reused = [], [], [], [], [], [], []
    for i in range(reps):
        prompt = turn()
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for which in order:
            if which == 0:
                t0 = time.perf_counter()
                ref, ref_cache = full_prefill(model, prompt)
                base.append(time.perf_counter() - t0)
            else:
                t0 = time.perf_counter()
                res = runner.prefill(prompt, store=False)
                reuse.append(time.perf_counter() - t0)
                loads.append(res.timings["lookup"] + res.timings["load"])
                reused.append(res.reused_tokens)
        full_diffs.append(float((ref - res.logits).abs().max()))
        # Floor: the same partial prefill on a cache that is already in memory.
        n = res.reused_tokens
        local = canonical_to_cache(cache_to_canonical(ref_cache, 0, n), model.config)
        t0 = time.perf_counter()
        floor_logits = forward_with_cache(model, prompt[n:], local, n)
        floor.append(time.perf_counter() - t0)
        diffs.append(float((floor_logits - res.logits).abs().max()))
    med = statistics.median
    kv_bytes = min(reused) * runner.layout.block_bytes // runner.layout.block_tokens
    return {"ttft_speedup": med(base) / med(reuse), "ttft_full_s": med(base),
            "ttft_reuse_s": med(reuse), "ttft_vs_floor": med(reuse) / med(floor),
            "load_s": med(loads), "load_gbps": kv_bytes / med(loads) / 1e9,
            "reused_tokens": min(reused), "lossless_max_abs": max(diffs),
            "full_vs_reuse_max_abs": max(full_diffs)}


def measure_codec(client: Any, address: str, model: Any, name: str, codec: str,
                  prompt: torch.Tensor, ref_tokens: list[int], ref_logits: list[torch.Tensor],
                  ref_cache: Any, block_tokens: int) -> dict[str, float]:
    """Store with `codec`, demote to SSD, promote by loading; compare 32 steps with the ref."""
    runner = PrefixCacheRunner.create(client, model, f"{name}-{codec}", codec=codec,
                                      block_tokens=block_tokens)
    runner.store(prompt, ref_cache)
    evict_host(client, address)
    res = runner.prefill(prompt, store=False)
    if res.reused_tokens == 0:
        raise RuntimeError(f"{codec}: nothing was reused after demotion to SSD")
    test = teacher_forced_logits(model, res.logits, res.cache, ref_tokens)
    return compare_distributions(ref_logits, test)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions (about a minute)")
    p.add_argument("--address", default="", help="a running daemon (default: start one)")
    p.add_argument("--prefix-tokens", type=int, default=2048)
    p.add_argument("--turn-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--reps", type=int, default=0, help="default: 3 with --quick, else 9")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a busy shared machine OpenMP spinning "
                        "made 2 threads ~15x slower, ttft_speedup 1.6 instead of 14.8; 0: "
                        "torch's default)")
    p.add_argument("--model", default=TRAINED, choices=[TRAINED, "demo"],
                   help="smollm2 (trained, real text; default) or demo (random weights, "
                        "random tokens: faster, meaningless codec figures)")
    args = p.parse_args(argv)
    reps = args.reps or (3 if args.quick else 9)
    if args.threads:
        torch.set_num_threads(args.threads)

    gen = torch.Generator().manual_seed(7)
    if args.model == TRAINED:
        from kvstore_demo import trained_model

        model, tok = trained_model.load()
        text = tok(document(4 * len(PASSAGES)), add_special_tokens=False).input_ids
        if len(text) < args.prefix_tokens:
            raise SystemExit(f"the demo text has {len(text)} tokens; --prefix-tokens is larger")
        prefix = torch.tensor(text[:args.prefix_tokens])
        # new turns: other real passages, `turn_tokens` long each
        turn_text = [torch.tensor(tok(document(3, start=i), add_special_tokens=False)
                                  .input_ids[:args.turn_tokens]) for i in range(len(PASSAGES))]
        counter = iter(range(1 << 30))
        turns = lambda: turn_text[next(counter) % len(turn_text)]  # noqa: E731
    else:
        model = build_model("demo")
        vocab = model.config.vocab_size
        prefix = torch.randint(0, vocab, (args.prefix_tokens,), generator=gen)
        turns = lambda: torch.randint(0, vocab, (args.turn_tokens,), generator=gen)  # noqa: E731
    name = f"bench-demo-ttft-{os.getpid()}-{time.time_ns()}"
    out: dict[str, Any] = {"bench": "demo_ttft", "quick": args.quick,
                           "prefix_tokens": args.prefix_tokens, "turn_tokens": args.turn_tokens,
                           "model_params_m": round(sum(x.numel() for x in model.parameters())
                                                   / 1e6, 1),
                           "threads": torch.get_num_threads(), "reps": reps,
                           "model": "SmolLM2-135M-Instruct" if args.model == TRAINED
                           else "random Llama-style (demo)"}
    with daemon_address(args.address) as address, connect(address) as client:
        runner = PrefixCacheRunner.create(client, model, name, block_tokens=args.block_tokens)
        out.update(measure_speedup(runner, model, prefix, turns, reps))

        prompt = torch.cat([prefix, turns()])
        ref_first, ref_cache = full_prefill(model, prompt)
        ref_store = canonical_to_cache(cache_to_canonical(ref_cache), model.config)
        ref_tokens, ref_logits = greedy_decode(model, ref_first, ref_cache, args.steps)
        for codec, key in (("lossless", "lossless_ssd"), ("fp8_e4m3", "fp8"), ("int8", "int8")):
            m = measure_codec(client, address, model, name, codec, prompt, ref_tokens,
                              ref_logits, ref_store, args.block_tokens)
            if codec == "lossless":
                out["lossless_ssd_max_abs"] = m["max_abs"]
            else:
                out[f"{key}_top1"] = m["top1"]
                out[f"{key}_mean_kl"] = m["mean_kl"]
                out[f"{key}_max_kl"] = m["max_kl"]
    out["steps"] = args.steps
    for k, v in out.items():
        if isinstance(v, float):
            out[k] = float(f"{v:.4g}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
