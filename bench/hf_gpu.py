"""An HF transformers engine on a GPU reusing a prompt prefix that another process stored in
kvstore's gpu tier: time to first token with reuse against recomputing the prefix.

Why: the gpu tier exists so that a prefix one engine computed reaches another engine's cache
by a device-to-device gather instead of a prefill. bench/gpu.py measures the gather as a copy;
this measures what an engine gains from it, end to end, on a real model: a ~1B-parameter
random-weight Llama (bf16, SDPA) built from a config (no download), an 8k-token prompt, blocks
of 32 tokens.

- A producer process prefills the prefix (the full blocks before the last token) and stores
  its blocks into the daemon's gpu tier with `DeviceKV.store_keys` from a token-major copy of
  the HF cache tensors (HF's head-major [1, H, S, D] interleaves blocks, which `PagedKVCache`
  refuses), then exits.
- A consumer process (the same seeded weights) times two paths, alternated, medians of R:
  reuse: `DeviceKV.load_keys` (Acquire + gather into its token-major buffers + Release), a
  DynamicCache over [1, H, P, D] views of those buffers, the forward of the suffix; recompute:
  what the engine does without kvstore, one forward of the whole prompt. TTFT ends at the
  argmax of the last logits.
- The engine runs each path twice over: eagerly, as transformers does by default, and with
  both forwards captured as CUDA graphs, as serving engines run theirs (an eager forward of a
  few dozen tokens costs ~12 ms of Python and kernel launches on an H200's host, about as
  much as the rest of the reuse path four times over, and the same with or without a cache).
  The headline figure is the graphed engine's where capture works; both are reported.
- Both paths then decode greedily from a recompute split the same way (prefix, then suffix,
  so the KV and the last forward are computed identically); the tokens must agree, the loaded
  KV must equal the recomputed KV bit for bit, and the graphed reuse must pick the eager
  one's first token (`hf_gpu_outputs_equal`, `hf_gpu_kv_equal`; whether its logits are
  bit-identical too is reported).

Usage: python bench/hf_gpu.py [--device cuda|cpu] [--tokens N] [--quick] [--out FILE]
The last stdout line is one JSON object (also written to FILE); progress goes to stderr.
Without a CUDA device the default run prints only `"cuda": "skipped: no CUDA device"`.
`--device cpu` runs everything on the daemon's CPU device (a shared-memory slab standing in
for device memory, the same client code) with a tiny model and 256 tokens: the test's path.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# This folder holds scripts named like packages (bench/tiers.py, bench/vllm.py): off the path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
for _p in (ROOT / "client", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from bench import hf_gpu_engine as engine  # noqa: E402
from bench.hf_gpu_engine import child, say  # noqa: E402

BLOCK_TOKENS = 32
# ~1.1B parameters in bf16: 16 layers x 2 x 8 kv heads x 64 dims x 2 bytes = 32 KiB per token,
# so 8k tokens are 256 MiB of KV and a block of 32 tokens is 1 MiB.
SHAPES: dict[str, dict[str, int]] = {
    "cuda": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=32000),
    "cpu": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=512),
}
DEFAULT_TOKENS = {"cuda": 8192, "cpu": 256}
# The gpu tier holds the prefix with room to spare; nothing is demoted, so the host tier is
# small and there is no SSD tier. Leases live 120 s: a first Triton compile runs under one.
_COMMON = {"gpu.enabled": "true", "host.capacity": "64MiB", "ssd.enabled": "false",
           "leases.default_ttl_s": "120"}
DAEMON_SETTINGS: dict[str, dict[str, str]] = {
    "cuda": {**_COMMON, "gpu.backend": "cuda", "gpu.capacity": "1GiB"},
    "cpu": {**_COMMON, "gpu.backend": "cpu", "gpu.capacity": "64MiB"},
}
DAEMON_START_S = 120.0
PRODUCER_DEADLINE_S = 300.0
CONSUMER_DEADLINE_S = 480.0
TARGETS = {"hf_gpu_ttft_speedup_8k": 5.0, "hf_gpu_outputs_equal": True}

# ---------------------------------------------------------------------------------------------
# the parent: daemon, processes, report
# ---------------------------------------------------------------------------------------------
def _run_child(ctx: Any, what: str, fn_name: str, setup: dict, deadline_s: float) -> dict:
    """Run `fn_name` in a spawned process; its result, or RuntimeError with its error.
    Every wait has a deadline; a child that outlives it is terminated, then killed."""
    q = ctx.Queue()
    proc = ctx.Process(target=child, args=(fn_name, setup, q), daemon=True,
                       name=f"hf_gpu-{what}")
    proc.start()
    end = time.monotonic() + deadline_s
    try:
        while True:
            try:
                status, res = q.get(timeout=1.0)
                break
            except queue.Empty:
                if not proc.is_alive():
                    try:                # the result may have landed as it exited
                        status, res = q.get(timeout=5.0)
                        break
                    except queue.Empty:
                        raise RuntimeError(f"the {what} process exited with code "
                                           f"{proc.exitcode} without a result") from None
                if time.monotonic() > end:
                    raise RuntimeError(f"the {what} process gave no result within "
                                       f"{deadline_s:.0f} s") from None
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.terminate()
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
    if status != "ok":
        raise RuntimeError(f"the {what} process failed:\n{res}")
    return res


def _emit(out: dict, path: str | None) -> None:
    line = json.dumps(out)
    if path:
        Path(path).write_text(line + "\n")
    print(line, flush=True)


def run(args: argparse.Namespace) -> dict:
    import numpy as np

    from kvstore_demo.chat import temporary_daemon

    dev = args.device
    shape = SHAPES[dev]
    tokens = args.tokens or DEFAULT_TOKENS[dev]
    bt = BLOCK_TOKENS
    prefix = (tokens - 1) // bt * bt
    if prefix < bt:
        raise SystemExit(f"--tokens must exceed one block ({bt} tokens)")
    reps = 3 if args.quick else 5
    steps = 16
    ids = np.random.default_rng(1).integers(0, shape["vocab_size"], tokens).tolist()
    out: dict[str, Any] = {"bench": "hf_gpu", "backend": dev, "quick": args.quick,
                           "tokens": tokens, "prefix_tokens": prefix, "block_tokens": bt,
                           "prefix_blocks": prefix // bt, "reps": reps, "steps": steps,
                           "dtype": "bfloat16", "model": {**shape}}
    # The daemon and the spawned engines import kvstore and kvstore_client from this checkout.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "client")] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    ctx = mp.get_context("spawn")       # CUDA cannot be used in forked children
    say(f"starting a daemon (gpu tier backend {dev!r}); model {shape}, {tokens} tokens")
    with temporary_daemon(DAEMON_SETTINGS[dev], start_timeout_s=DAEMON_START_S,
                          say=say) as address:
        setup = {"device": dev, "shape": shape, "dtype": "bfloat16", "ids": ids,
                 "max_positions": tokens + steps + 64, "block_tokens": bt, "prefix": prefix,
                 "address": address, "reps": reps, "steps": steps, "t0": engine.T0}
        say("producer: build the model, prefill the prefix, store its blocks")
        prod = _run_child(ctx, "producer", "_produce", setup, PRODUCER_DEADLINE_S)
        out["producer"] = {k: prod[k] for k in ("prefill_ms", "store_ms", "stored",
                                                 "per_tier")}
        if prod["stored"] != prefix // bt:
            raise RuntimeError(f"the producer stored {prod['stored']} blocks, not the "
                               f"prefix's {prefix // bt}")
        say("consumer: build the model, time reuse against recompute")
        cons = _run_child(ctx, "consumer", "_consume", setup, CONSUMER_DEADLINE_S)
    eager = {"reuse_ms": cons.pop("ttft_reuse_ms"), "recompute_ms": cons.pop("ttft_recompute_ms")}
    eager["speedup"] = round(eager["recompute_ms"] / eager["reuse_ms"], 3)
    graphed = cons.pop("graphs")
    if "ttft_reuse_graphs_ms" in cons:
        graphed.update(reuse_ms=cons.pop("ttft_reuse_graphs_ms"),
                       recompute_ms=cons.pop("ttft_recompute_graphs_ms"))
        graphed["speedup"] = round(graphed["recompute_ms"] / graphed["reuse_ms"], 3)
    # The headline engine runs its forwards as CUDA graphs where they could be captured (as
    # serving engines do); the eager engine's figures are reported beside it either way.
    head = graphed if "speedup" in graphed else eager
    tokens_equal = cons["tokens_reuse"] == cons["tokens_recompute"]
    load_s = cons["load_ms"] / 1e3
    out.update({
        "device": cons.pop("device"), "torch": cons.pop("torch"),
        "transformers": cons.pop("transformers"), "cuda_runtime": cons.pop("cuda_runtime"),
        "params": cons.pop("params"), "prefix_bytes": cons["prefix_bytes"],
        "engine": "cuda graphs" if head is graphed else "eager",
        "hf_gpu_ttft_reuse_ms": head["reuse_ms"],
        "hf_gpu_ttft_recompute_ms": head["recompute_ms"],
        "hf_gpu_ttft_speedup_8k": head["speedup"],
        "hf_gpu_outputs_equal": tokens_equal and graphed.get("first_token_equal", True),
        "hf_gpu_kv_equal": cons.pop("kv_equal"),
        "eager": eager, "graphs": graphed,
        "load_ms": round(cons.pop("load_ms"), 3),
        "load_GBps": round(cons["prefix_bytes"] / load_s / 1e9, 2),
        "blocks_loaded": cons.pop("blocks_loaded"),
        "weights_equal": cons.pop("weights") == prod["weights"],
        "kv_loaded_equals_producer": cons.pop("kv_loaded") == prod["kv"],
        "kv_recomputed_equals_producer": cons.pop("kv_recomputed") == prod["kv"],
    })
    out.update(cons)
    out["targets"] = dict(TARGETS)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda (default; a ~1B model, 8k tokens) or cpu (the daemon's CPU "
                         "device, a tiny model, 256 tokens)")
    ap.add_argument("--tokens", type=int, default=0, help="prompt length (default: 8192 on "
                    "cuda, 256 on cpu)")
    ap.add_argument("--quick", action="store_true", help="3 repetitions instead of 5")
    ap.add_argument("--out", default=None, help="also write the JSON object to this file")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        from kvstore_client import gpu as cg

        if not cg.cuda_available():
            _emit({"bench": "hf_gpu", "cuda": "skipped: no CUDA device"}, args.out)
            return 0
    t0 = time.monotonic()
    try:
        out = run(args)
    except Exception as e:
        say(f"failed: {e}")
        _emit({"bench": "hf_gpu", "backend": args.device,
               "error": "".join(traceback.format_exception_only(e))[-6000:]}, args.out)
        return 1
    out["wall_s"] = round(time.monotonic() - t0, 1)
    say(f"{out['device']} ({out['engine']}): TTFT reuse {out['hf_gpu_ttft_reuse_ms']:.2f} ms (load "
        f"{out['load_ms']:.2f} ms, {out['load_GBps']} GB/s) vs recompute "
        f"{out['hf_gpu_ttft_recompute_ms']:.2f} ms: x{out['hf_gpu_ttft_speedup_8k']} at "
        f"{out['tokens']} tokens; outputs equal {out['hf_gpu_outputs_equal']}, KV equal "
        f"{out['hf_gpu_kv_equal']}")
    _emit(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
