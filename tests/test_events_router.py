"""A real router's index of kvstore's blocks: NVIDIA Dynamo's standalone KV indexer subscribed
to two nodes' daemons.

Engines A and B share node 1's daemon, engine C has node 2's; each engine is registered with
the indexer as its own worker, A and B with node 1's stream, C with node 2's (the deployment of
docs/routing.md for engines that publish no events of their own). The engines are SDK clients
storing prompts given as token ids. For every prompt the indexer must answer each worker's
`longest_matched`, per tier, as the daemons hold it: through stores, demotion to SSD,
promotion, eviction, deletion, a clean restart and a crash (no stale block after either).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from kvstore_client import KVLayout, connect

from tests.daemon import cleanup, start_daemon
from tests.events_helpers import free_port

ROOT = Path(__file__).resolve().parent.parent
ROUTERS_PY = ROOT / ".venv-routers" / "bin" / "python"
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_tokens=16, dtype="float16")
T = LAYOUT.block_tokens
DEADLINE_S = 60.0
MODEL = "llama-test"

pytestmark = pytest.mark.skipif(not ROUTERS_PY.exists(),
                                reason="the routers' environment is not built (make routers-env)")


class Indexer:
    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [str(ROUTERS_PY), "-m", "dynamo.indexer", "--port", str(self.port), "--threads",
             "1"], stdout=open(log, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.log = log
        end = time.monotonic() + DEADLINE_S
        while True:
            try:
                self._call("GET", "workers")
                return
            except (urllib.error.URLError, ConnectionError):
                if self.proc.poll() is not None or time.monotonic() > end:
                    raise RuntimeError(f"indexer did not start: {_tail(log)}") from None
                time.sleep(0.1)

    def _call(self, method: str, path: str, body: dict | None = None):
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/{path}", method=method,
                                     data=json.dumps(body).encode() if body else None,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read().decode())

    def register(self, worker: int, endpoint: str, replay: str) -> None:
        got = self._call("POST", "register", {
            "instance_id": worker, "endpoint": endpoint, "replay_endpoint": replay,
            "model_name": MODEL, "block_size": T})
        assert got == {"status": "ok"}, got

    def matched(self, tokens: np.ndarray) -> dict[int, tuple[int, int, int]]:
        """worker -> (longest_matched, cpu, disk) in tokens (cpu and disk count the prefix
        held in that tier or a faster one), workers matching nothing left out."""
        got = self._call("POST", "query", {"token_ids": [int(t) for t in tokens],
                                           "model_name": MODEL})
        out = {}
        for w, m in got.get("instances", {}).items():
            if m["longest_matched"]:
                out[int(w)] = (m["longest_matched"], m["cpu"], m["disk"])
        return out

    def expect(self, tokens: np.ndarray, want: dict[int, tuple[int, int, int]],
               what: str) -> None:
        end = time.monotonic() + DEADLINE_S
        while True:
            got = self.matched(tokens)
            if got == want:
                return
            if time.monotonic() > end:
                raise AssertionError(f"{what}: the indexer answers {got}, expected {want}; "
                                     f"indexer log tail:\n{_tail(self.log)}")
            time.sleep(0.1)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _tail(p: Path) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", p.read_text(errors="replace"))[-3000:]


def node(tmp: Path) -> tuple[dict, str, str]:
    pub, rep = free_port(), free_port()
    cfg = {"events.enabled": "true", "events.endpoint": f"tcp://127.0.0.1:{pub}",
           "events.replay_endpoint": f"tcp://127.0.0.1:{rep}", "host.capacity": "16MiB"}
    return cfg, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}"


def prompt(seed: int, blocks: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 30000, size=blocks * T)


def kv(tokens: np.ndarray) -> np.ndarray:
    rng = np.random.default_rng(int(tokens[0]))
    return rng.standard_normal((LAYOUT.num_layers, 2, len(tokens), LAYOUT.num_kv_heads,
                                LAYOUT.head_dim)).astype(np.float16)


def engine(d):
    return connect(d.address).namespace(model=MODEL, layout=LAYOUT)


def test_dynamo_indexer_credits_every_engine_of_a_node_per_tier(tmp_path):
    A, B, C = 1, 2, 3
    cfg1, pub1, rep1 = node(tmp_path / "n1")
    cfg2, pub2, rep2 = node(tmp_path / "n2")
    idx = Indexer(tmp_path / "indexer.log")
    n1 = n2 = None
    try:
        n1 = start_daemon(tmp_path / "n1", cfg1)
        n2 = start_daemon(tmp_path / "n2", cfg2)
        idx.register(A, pub1, rep1)
        idx.register(B, pub1, rep1)
        idx.register(C, pub2, rep2)
        a, b, c = engine(n1), engine(n1), engine(n2)
        p1, p2 = prompt(1, 4), prompt(2, 3)
        full = 4 * T

        # stored by engine A: a host (CPU) hit for A and for B, which shares the daemon
        assert a.store(p1, kv(p1)) == 4
        idx.expect(p1, {A: (full, full, full), B: (full, full, full)}, "store by A")
        # a longer prompt that starts with it matches as far as it is held
        idx.expect(np.concatenate([p1, prompt(9, 2)]),
                   {A: (full, full, full), B: (full, full, full)}, "prefix")
        # stored by engine C on node 2: only C
        assert c.store(p2, kv(p2)) == 3
        idx.expect(p2, {C: (3 * T, 3 * T, 3 * T)}, "store on node 2")
        idx.expect(p1, {A: (full, full, full), B: (full, full, full)}, "node 2 beside node 1")

        # demoted to SSD: a disk hit
        assert a.client.evict("host")[1] == 4
        idx.expect(p1, {A: (full, 0, full), B: (full, 0, full)}, "demotion to SSD")
        # loaded by engine B: promoted back to host
        out = np.zeros_like(kv(p1))
        assert b.load(p1, out) == full
        b.client.close()                        # its read lease ends with it
        idx.expect(p1, {A: (full, full, full), B: (full, full, full)}, "promotion")
        # evicted: host copies go, then the last block's SSD copy (leaves first)
        assert a.client.evict("host")[1] == 4
        a.client.evict("ssd", 1)
        idx.expect(p1, {A: (3 * T, 0, 3 * T), B: (3 * T, 0, 3 * T)}, "eviction")
        # deleted
        assert a.delete(a.keys(p1)) == 3
        idx.expect(p1, {}, "deletion")

        # a clean restart: SSD blocks come back (host ones were flushed to SSD at the stop),
        # deleted ones do not, nothing is a host hit any more
        p3, p4 = prompt(3, 2), prompt(4, 3)
        a.store(p3, kv(p3))
        a.store(p4, kv(p4))
        a.client.evict("host")                  # p3, p4 on SSD ...
        a.load(p3, np.zeros_like(kv(p3)))       # ... and p3 in host as well
        idx.expect(p3, {A: (2 * T, 2 * T, 2 * T), B: (2 * T, 2 * T, 2 * T)}, "before restart")
        a.client.close()
        n1.restart()
        idx.expect(p3, {A: (2 * T, 0, 2 * T), B: (2 * T, 0, 2 * T)}, "clean restart")
        idx.expect(p4, {A: (3 * T, 0, 3 * T), B: (3 * T, 0, 3 * T)}, "clean restart p4")
        idx.expect(p1, {}, "deleted before the restart")
        idx.expect(p2, {C: (3 * T, 3 * T, 3 * T)}, "node 2 untouched")

        # a crash: the host-only blocks die with the daemon and must leave the index
        a = engine(n1)
        p5 = prompt(5, 2)
        a.store(p5, kv(p5))
        idx.expect(p5, {A: (2 * T, 2 * T, 2 * T), B: (2 * T, 2 * T, 2 * T)}, "before crash")
        a.client.close()
        n1.kill()
        n1.start()
        idx.expect(p5, {}, "crash: host blocks gone")
        idx.expect(p4, {A: (3 * T, 0, 3 * T), B: (3 * T, 0, 3 * T)}, "crash: SSD kept")
        c.client.close()
    finally:
        for d in (n1, n2):
            if d is not None:
                cleanup(d)
        idx.close()


class FakeWorker:
    """An OpenAI-compatible worker that answers every completion with its own name (the
    router only needs /health and the completion route to be there)."""

    def __init__(self, name: str) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, body: dict) -> None:
                raw = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self) -> None:
                self._reply({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                self._reply({"id": "x", "object": "text_completion", "model": MODEL,
                             "choices": [{"index": 0, "text": name, "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                       "total_tokens": 2}})

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_vllm_router_routes_to_the_node_that_holds_the_prefix(tmp_path):
    """vllm-router's kv_aware policy, fed by the two daemons' node streams, sends a prompt to
    the worker whose node stored it, also once the blocks are on SSD only."""
    router_bin = ROOT / ".venv-routers" / "bin" / "vllm-router"
    cfg1, pub1, rep1 = node(tmp_path / "n1")
    cfg2, pub2, rep2 = node(tmp_path / "n2")
    w1, w2 = FakeWorker("w1"), FakeWorker("w2")
    port = free_port()
    n1 = n2 = router = None
    log = tmp_path / "router.log"
    try:
        n1 = start_daemon(tmp_path / "n1", cfg1)
        n2 = start_daemon(tmp_path / "n2", cfg2)
        router = subprocess.Popen(
            [str(router_bin), "--host", "127.0.0.1", "--port", str(port), "--policy",
             "kv_aware", "--worker-urls", w1.url, w2.url,
             "--kv-event-source", f"{w1.url}={pub1}", "--kv-event-source", f"{w2.url}={pub2}",
             # what it missed before its subscription took, it fetches from the replay socket
             "--kv-event-replay-source", f"{w1.url}={rep1}",
             "--kv-event-replay-source", f"{w2.url}={rep2}",
             "--kv-event-block-size", str(T), "--kv-event-model", MODEL,
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
            stdout=open(log, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

        def route(tokens: np.ndarray) -> str:
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions", headers={
                    "content-type": "application/json"}, data=json.dumps(
                    {"model": MODEL, "prompt": [int(t) for t in tokens],
                     "max_tokens": 1}).encode())
            with urllib.request.urlopen(req, timeout=10) as r:
                return json.loads(r.read())["choices"][0]["text"]

        def routed_to(tokens: np.ndarray, want: str, what: str) -> None:
            end = time.monotonic() + DEADLINE_S
            while True:
                try:
                    if route(tokens) == want and all(route(tokens) == want for _ in range(5)):
                        return
                except (urllib.error.URLError, ConnectionError):
                    if router.poll() is not None:
                        raise AssertionError(f"vllm-router exited:\n{_tail(log)}") from None
                if time.monotonic() > end:
                    raise AssertionError(f"{what}: not routed to {want}:\n{_tail(log)}")
                time.sleep(0.1)

        p1, p2 = prompt(11, 8), prompt(12, 8)
        c2 = engine(n2)
        assert c2.store(p1, kv(p1)) == 8
        routed_to(np.concatenate([p1, prompt(13, 1)]), "w2", "stored on node 2")
        c2.client.evict("host")
        routed_to(p1, "w2", "on node 2's SSD")
        c1 = engine(n1)
        assert c1.store(p2, kv(p2)) == 8
        routed_to(p2, "w1", "stored on node 1")
        c1.client.close()
        c2.client.close()
    finally:
        if router is not None:
            router.terminate()
            router.wait(10)
        for d in (n1, n2):
            if d is not None:
                cleanup(d)
        w1.close()
        w2.close()
