"""Runs a real vLLM engine (CPU) for the vLLM tests and bench; one engine per process.

Runs under the vLLM environment (`.venv-vllm`, built by `make test`), never under pytest: the
tests start it as a subprocess and read the JSON it writes, so every engine is a separate
process with its own empty prefix cache, as two engines on one node are.

    python tests/vllm_engine.py model DIR [--layers N --hidden H --heads A --kv-heads K]
    python tests/vllm_engine.py run --model DIR --prompts FILE --out FILE [--kvstore ADDRESS]
        [--codec C] [--hash-algo A] [--allow-process-local] [--max-tokens N] [--ttft]
        [--events ENDPOINT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # engine in this process: ~4 s start
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

BLOCK = 32  # the CPU attention backend wants a multiple of 32


def make_model(args: argparse.Namespace) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 2,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, vocab_size=8192,
                      max_position_embeddings=8192, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                      torch_dtype="float32", initializer_range=0.15)
    LlamaForCausalLM(cfg).save_pretrained(args.dir, safe_serialization=True)
    print(json.dumps({"model": args.dir}))


def _tier_config(args: argparse.Namespace) -> dict:
    tier = {"type": "KVStoreTier", "module_path": "kvstore_client.vllm.tier",
            "address": args.kvstore, "codec": args.codec, "lookup_deadline_s": 2.0,
            "timeout_s": 5.0}
    if args.allow_process_local:
        tier["allow_process_local"] = True
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "CPUTieringSpec",
                "spec_module_path": "kvstore_client.vllm.cpu_worker",
                "cpu_bytes_to_use": args.primary_mib << 20,
                "secondary_tiers": [tier]}}


def _tier():
    from kvstore_client.vllm import tier
    return tier.instances()[-1] if tier.instances() else None


def _settle(llm, tokens_params, deadline_s: float = 60.0) -> None:
    """Step the engine until the kvstore tier has no transfer or lookup in flight, so that
    everything this engine stored has reached the daemon before the process exits."""
    from vllm.inputs import TokensPrompt

    t = _tier()
    end = time.monotonic() + deadline_s
    i = 0
    while t is not None and time.monotonic() < end:
        llm.generate(TokensPrompt(prompt_token_ids=[5, 6, 7, 8 + i % 50]), tokens_params,
                     use_tqdm=False)
        i += 1
        if i >= 3 and not t.has_pending_work():
            break


def run(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(args.prompts) as f:
        prompts = json.load(f)
    kw = dict(model=args.model, skip_tokenizer_init=True, dtype="float32",
              max_model_len=args.max_model_len, max_num_seqs=4, enforce_eager=True, seed=0,
              enable_prefix_caching=True, block_size=BLOCK, max_num_batched_tokens=8192)
    if args.hash_algo:
        kw["prefix_caching_hash_algo"] = args.hash_algo
    if args.kvstore:
        kw["kv_transfer_config"] = _tier_config(args)
    if args.events:     # the engine's own KV events, as `--kv-events-config` publishes them
        from vllm.config import KVEventsConfig
        kw["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                endpoint=args.events)
    t0 = time.monotonic()
    llm = LLM(**kw)
    start_s = time.monotonic() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                        detokenize=False, logprobs=0)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    results = []
    for i, p in enumerate(prompts):
        if args.kill_pid and i == args.kill_after:   # the daemon dies mid-run
            os.kill(args.kill_pid, 9)
        if args.ttft:   # time to first token: a one-token request, nothing else in flight
            t = time.monotonic()
            o = llm.generate(TokensPrompt(prompt_token_ids=p), one, use_tqdm=False)[0]
            results.append({"ttft_s": time.monotonic() - t, "cached": o.num_cached_tokens,
                            "tokens": list(o.outputs[0].token_ids)})
            continue
        t = time.monotonic()
        o = llm.generate(TokensPrompt(prompt_token_ids=p), sp, use_tqdm=False)[0]
        results.append({"s": time.monotonic() - t, "cached": o.num_cached_tokens,
                        "tokens": list(o.outputs[0].token_ids),
                        "logprob": o.outputs[0].cumulative_logprob})
    if args.kvstore:
        _settle(llm, one)
    t = _tier()
    out = {"start_s": start_s, "results": results, "pid": os.getpid(),
           "tier": t.stats() if t is not None else None}
    with open(args.out, "w") as f:
        json.dump(out, f)
    sys.stdout.flush()
    _drop_offload_region(t)
    os._exit(0)   # skip vLLM's slow interpreter teardown; the output is written


def _drop_offload_region(tier: object) -> None:
    """Unlink the primary tier's shared-memory file: os._exit skips vLLM's cleanup, which would
    have, and each engine run left its primary tier (64 MiB and up) in /dev/shm."""
    spec = getattr(tier, "_offloading_spec", None)
    path = getattr(getattr(spec, "_scheduler_mmap", None), "mmap_path", None)
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("model")
    m.add_argument("dir")
    m.add_argument("--layers", type=int, default=4)
    m.add_argument("--hidden", type=int, default=256)
    m.add_argument("--heads", type=int, default=4)
    m.add_argument("--kv-heads", type=int, default=2)
    r = sub.add_parser("run")
    r.add_argument("--model", required=True)
    r.add_argument("--prompts", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--kvstore", default="")
    r.add_argument("--codec", default="lossless")
    r.add_argument("--hash-algo", default="")
    r.add_argument("--allow-process-local", action="store_true")
    r.add_argument("--max-tokens", type=int, default=8)
    r.add_argument("--max-model-len", type=int, default=4096)
    r.add_argument("--primary-mib", type=int, default=64)
    r.add_argument("--ttft", action="store_true")
    r.add_argument("--events", default="", help="publish the engine's KV events (ZMQ) here")
    r.add_argument("--kill-pid", type=int, default=0, help="SIGKILL this pid (the daemon)...")
    r.add_argument("--kill-after", type=int, default=0, help="...before prompt number N")
    args = ap.parse_args()
    (make_model if args.cmd == "model" else run)(args)


if __name__ == "__main__":
    main()
