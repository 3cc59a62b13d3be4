"""A stand-in for `vllm serve` in the serving benchmark's `--dry-run`: it speaks the parts of
the engine's HTTP API and KV-event stream the harness and the router use, in milliseconds.

Why: a real engine takes a minute of CPU to start, so a check of the harness wiring (the
daemons' configs, the event relays, the router's arguments and its reading of our requests,
the restart, the report) cannot afford one. Everything around the engine stays real; only the
engine is replaced, and only where `--dry-run` asks for it.

What it does, as vLLM does it:
- `GET /health`, `GET /v1/models`, `GET /metrics` (prompt tokens by source, as vLLM names them);
- `POST /v1/completions` with a token-id prompt, streamed: the generated tokens as logprob
  tokens `token_id:N` (as `--return-tokens-as-token-ids` names them), then the usage with
  `prompt_tokens_details.cached_tokens`: the prompt's longest prefix of whole blocks it served
  before (an unbounded prefix cache), each chunk with the completion's `id`, which it logs as
  vLLM's `--enable-log-requests` does ("Received request cmpl-...-0"); with `--prefill-us`,
  it takes that long a token not cached (plus `--floor-ms`), one request at a time, so that
  requests sent together overlap and queue;
- its prefix cache's new blocks as `BlockStored` (medium GPU, full 32-byte hashes chained by
  parent, token ids, group 0) on `--events`, in vLLM's wire format, binding a wildcard or ipc
  endpoint and connecting to any other, as vLLM's publisher does. Unlike vLLM, whose first
  batch comes long after it started, a stand-in answers at once, so before each batch it waits
  (at most SUBSCRIBERS_S) until `--subscribers` subscriptions reached it: a batch sent before a
  subscriber joined is lost to it, and the harness would wait for it in vain.

The generated tokens are a function of the prompt alone, so every setup must produce the same.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import socket
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VOCAB = 8000
SUBSCRIBERS_S = 10.0


def block_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    h = hashlib.sha256(parent or b"root")
    h.update(json.dumps(tokens).encode())
    return h.digest()


def generated(prompt: list[int], n: int) -> list[int]:
    digest = hashlib.sha256(json.dumps(prompt).encode()).digest()
    return [int.from_bytes(digest[2 * i:2 * i + 2], "big") % VOCAB for i in range(n)]


class Engine:
    def __init__(self, model: str, block_size: int, events: str, subscribers: int,
                 prefill_us: float = 0.0, floor_ms: float = 0.0) -> None:
        self.model, self.block_size = model, block_size
        self.prefill_us, self.floor_ms = prefill_us, floor_ms
        self.busy = threading.Lock()
        self.cached: set[bytes] = set()
        self.counts = {"local_compute": 0, "local_cache_hit": 0}
        self.lock = threading.Lock()
        self.pub = None
        self.seq = 0
        self.subscribers, self.subscribed = subscribers, 0
        if events:
            import zmq

            # XPUB: a PUB that hands over each subscription, so joins can be counted
            self.pub = zmq.Context.instance().socket(zmq.XPUB)
            self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
            self.pub.setsockopt(zmq.LINGER, 0)
            if "*" in events or events.startswith(("ipc://", "inproc://")):
                self.pub.bind(events)
            else:
                self.pub.connect(events)

    def _await_subscribers(self) -> None:
        end = time.monotonic() + SUBSCRIBERS_S
        while self.subscribed < self.subscribers:
            left = end - time.monotonic()
            if left <= 0 or not self.pub.poll(int(left * 1000)):
                return
            msg = self.pub.recv()
            if msg[:1] == b"\x01":
                self.subscribed += 1

    def serve(self, prompt: list[int]) -> int:
        """Cached tokens for `prompt`; its whole blocks join the cache and are announced."""
        bs = self.block_size
        with self.lock:
            parent: bytes | None = None
            cached, hit, new = 0, True, []
            for i in range(len(prompt) // bs):
                toks = prompt[i * bs:(i + 1) * bs]
                h = block_hash(parent, toks)
                if hit and h in self.cached:
                    cached += bs
                else:
                    hit = False
                    if h not in self.cached:
                        self.cached.add(h)
                        new.append((h, parent, toks))
                parent = h
            self.counts["local_cache_hit"] += cached
            self.counts["local_compute"] += len(prompt) - cached
            self._announce(new)
        return cached

    def _announce(self, new: list[tuple[bytes, bytes | None, list[int]]]) -> None:
        if self.pub is None or not new:
            return
        import msgpack

        events = [{"type": "BlockStored", "block_hashes": [h], "parent_block_hash": p,
                   "token_ids": toks, "block_size": self.block_size, "lora_id": None,
                   "medium": "GPU", "lora_name": None, "extra_keys": [None], "group_idx": 0,
                   "kv_cache_spec_kind": "full_attention"} for h, p, toks in new]
        self._await_subscribers()
        batch = msgpack.packb([time.time(), events, None], use_bin_type=True)
        self.pub.send_multipart([b"", self.seq.to_bytes(8, "big"), batch])
        self.seq += 1

    def compute(self, tokens: int) -> None:
        """Stand for a prefill: `prefill_us` a token, one request at a time, so that
        requests sent together overlap and queue as on an engine."""
        if self.prefill_us > 0:
            with self.busy:
                time.sleep(self.floor_ms / 1000 + tokens * self.prefill_us / 1e6)

    def metrics(self) -> str:
        return "".join(f'vllm:prompt_tokens_by_source_total{{source="{k}"}} {v}.0\n'
                       for k, v in self.counts.items())


def handler(engine: Engine) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            # headers and body go out as two writes: without this, Nagle's algorithm holds
            # the second until the peer's delayed ACK (40 ms) on some of the router's reads
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, b"")
            elif self.path == "/metrics":
                self._send(200, engine.metrics().encode(), "text/plain")
            elif self.path == "/v1/models":
                self._send(200, json.dumps({"object": "list", "data": [
                    {"id": engine.model, "object": "model"}]}).encode())
            else:
                self._send(404, b"{}")

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
            prompt = body.get("prompt")
            if (self.path != "/v1/completions" or not isinstance(prompt, list)
                    or not all(isinstance(t, int) for t in prompt) or not body.get("stream")):
                self._send(400, b'{"error": "a streamed completion of a token-id prompt"}')
                return
            n = int(body.get("max_tokens") or 1)
            cid = f"cmpl-{uuid.uuid4().hex}"
            # the line vLLM logs with --enable-log-requests: the harness finds its ids here
            sys.stderr.write(f"INFO: Received request {cid}-0: params: max_tokens={n}.\n")
            sys.stderr.flush()
            cached = engine.serve(prompt)
            engine.compute(len(prompt) - cached)
            chunks = [{"id": cid, "choices": [{"index": 0, "text": "", "logprobs": {
                "tokens": [f"token_id:{t}"]}}]} for t in generated(prompt, n)]
            chunks.append({"id": cid, "choices": [], "usage": {
                "prompt_tokens": len(prompt), "completion_tokens": n,
                "total_tokens": len(prompt) + n,
                "prompt_tokens_details": {"cached_tokens": cached}}})
            raw = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
            self._send(200, raw + b"data: [DONE]\n\n", "text/event-stream")

        def log_message(self, fmt: str, *args: object) -> None:
            # the access-log line the harness counts, as uvicorn writes it
            sys.stderr.write(f'INFO: "{self.requestline}" {args[1] if len(args) > 1 else ""}\n')
            sys.stderr.flush()

    return Handler


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--events", default="", help="the --kv-events-config endpoint")
    ap.add_argument("--subscribers", type=int, default=1,
                    help="subscriptions to wait for before the first batch")
    ap.add_argument("--prefill-us", type=float, default=0.0,
                    help="microseconds a prefilled token takes (0: answer at once)")
    ap.add_argument("--floor-ms", type=float, default=0.0,
                    help="milliseconds every request takes besides its prefill tokens")
    args = ap.parse_args(argv)
    engine = Engine(args.model, args.block_size, args.events, args.subscribers,
                    args.prefill_us, args.floor_ms)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), handler(engine))
    print(f"stand-in engine on 127.0.0.1:{args.port}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
