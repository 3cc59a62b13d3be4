"""kvstore's vLLM tier through vLLM's own classes: chunk identity across parallel layouts and
namespaces, cache_salt, KV events, retention hints from engine signals, geometry and version
refusals. Runs tests/vllm_tier_scenarios.py in each vLLM environment of the matrix against a
real daemon (see tests/test_vllm_manager.py for the runner pattern)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.daemon import cleanup, start_daemon
from tests.vllm_versions import MATRIX

ROOT = Path(__file__).resolve().parents[1]
RUN_DEADLINE_S = 600.0


def _python(version: str) -> Path:
    py = ROOT / MATRIX[version] / "bin" / "python"
    if not py.exists():
        why = f"the vLLM {version} environment is missing ({py}); `make test` builds it"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return py


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KVSTORE_") and k != "PYTHONHASHSEED"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "client"), str(ROOT)])
    return env


def _run(py: Path, tmp: Path, only: str, config: dict[str, Any] | None = None
         ) -> dict[str, Any]:
    d = start_daemon(tmp / "daemon", config or {"host.capacity": "128MiB"})
    out = tmp / "result.json"
    try:
        proc = subprocess.run(
            [str(py), str(ROOT / "tests" / "vllm_tier_scenarios.py"), "--address", d.address,
             "--out", str(out), "--only", only],
            env=_env(), cwd=tmp, capture_output=True, text=True, timeout=RUN_DEADLINE_S,
            stdin=subprocess.DEVNULL)
        assert d.alive(), f"the daemon died during the run:\n{d.output()[-3000:]}"
    finally:
        cleanup(d)
    assert proc.returncode == 0 and out.exists(), (
        f"vllm_tier_scenarios.py failed (rc {proc.returncode}):\n{proc.stderr[-5000:]}")
    result = json.loads(out.read_text())
    for name, err in result["errors"].items():
        pytest.fail(f"scenario {name} raised:\n{err}")
    return result


# The release tested end to end; vLLM 0.33 runs its own tier tests and the manager tests
# (tests/test_vllm_contract.py, tests/test_vllm_manager.py) and the version check below.
END_TO_END = "0.32.0"


@pytest.fixture(scope="module", params=[END_TO_END])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
        ) -> dict[str, Any]:
    # Retention hints are checked by their effect on eviction order, so the host tier evicts
    # by plain LRU here (the default policy also weighs what it has learned of hints).
    r = _run(_python(request.param), tmp_path_factory.mktemp("vllm-tier"),
             "parallel,namespaces,cache_salt,events,geometry,signals",
             {"host.capacity": "128MiB", "host.policy": "lru"})
    assert r["vllm"] == request.param
    return r


def test_replicated_chunks_are_shared_across_tp_sizes(run: dict[str, Any]) -> None:
    """A TP=2 writer and a TP=4 reader of a replicated (MLA) layout: one namespace, and the
    reader loads the writer's chunks through the tier with the same bytes."""
    s = run["scenarios"]["parallel"]["replicated"]
    assert s["exceptions"] == []
    assert s["same_namespace"] and s["hit"] and s["bytes_equal"], s
    assert ":replicated" in s["writer_layout"]


def test_canonical_pages_are_shared_across_tp_sizes(run: dict[str, Any]) -> None:
    """vLLM's canonical layout makes pages topology-free (where it certifies them
    parallel-agnostic): an MHA TP=2 writer's chunks load byte-equal in a TP=4 reader."""
    s = run["scenarios"]["parallel"]["mha_canonical"]
    assert s["same_namespace"] and s["hit"] and s["bytes_equal"], s
    assert ":canonical-" in s["writer_layout"]


def test_mha_direct_layout_is_not_shared_across_tp_sizes(run: dict[str, Any]) -> None:
    """The direct layout is each worker's cell in rank order: a TP=2 chunk is not a TP=4 chunk,
    so a TP=4 reader finds nothing, also where vLLM flags the config parallel-agnostic."""
    for case in ("mha_direct", "mha_direct_agnostic"):
        s = run["scenarios"]["parallel"][case]
        assert not s["same_namespace"] and not s["hit"], (case, s)
        assert all(a[-1] == "MISS" for a in s["answers"]), (case, s["answers"])
    same = run["scenarios"]["parallel"]["mha_same_tp"]
    assert same["same_namespace"] and same["hit"] and same["bytes_equal"]


def test_pp_dtype_and_tenant_salt_name_other_namespaces(run: dict[str, Any]) -> None:
    s = run["scenarios"]["namespaces"]
    assert s["base"] == s["base_again"]
    ids = [s[k] for k in ("base", "pp2", "float16", "bfloat16", "salt_a", "salt_b")]
    assert len(set(ids)) == len(ids), s
    other, same = s["other_salt_share"], s["same_salt_share"]
    assert not other["same_namespace"] and not other["hit"]
    assert all(a[-1] == "MISS" for a in other["answers"])
    assert same["same_namespace"] and same["hit"] and same["bytes_equal"]


def test_cache_salt_keeps_salted_requests_apart(run: dict[str, Any]) -> None:
    """Keys made by vLLM's own Request hashing: another salt never hits, the same salt does."""
    s = run["scenarios"]["cache_salt"]
    assert s["exceptions"] == []
    assert s["keys_differ"] and s["same_salt_same_keys"]
    assert all(a[-1] == "MISS" and "HIT" not in a for a in s["other_salt"])
    assert all(a[-1] == "HIT" for a in s["same_salt"]) and s["same_bytes"]


def test_kv_events_only_for_stored_jobs_and_found_removals(run: dict[str, Any]) -> None:
    s = run["scenarios"]["events"]
    assert s["exceptions"] == []
    # Through vLLM's manager: the tier's stored event (LOCAL; the primary tier's own events
    # carry no locality), keys exactly the stored ones.
    ours = [v for v in s["through_manager"] if v["locality"] == "LOCAL"]
    assert [(v["keys"], v["medium"], v["removed"]) for v in ours] == [
        (s["stored_keys"], "CPU", False)], s["through_manager"]
    # A failed store job (a chunk outside the primary tier) fails alone and announces nothing.
    assert s["jobs"] == {"1": False, "2": True}
    assert [(v["keys"], v["removed"]) for v in s["after_stores"]] == [(s["k2"], False)]
    assert s["load_ok"] == [True] and s["after_load"] == []
    # A block deleted behind the tier's back: the load stops before it and says it is gone.
    assert s["missing_load"] == [[False, s["k2"][:1]]]
    assert [(v["keys"], v["removed"]) for v in s["after_missing_load"]] == [(s["k2"][1:], True)]
    # ... and a lookup that misses an announced block says so too.
    assert s["lookup_after_delete"] == "MISS"
    assert [(v["keys"], v["removed"]) for v in s["after_lookup"]] == [(s["k2"][:1], True)]
    # vLLM's KV events off: the tier emits none, and says why once.
    assert s["off_events"] == [] and len(s["off_warnings"]) == 1


def test_engine_signals_reorder_eviction(run: dict[str, Any]) -> None:
    """closed -> evicted first although stored last; continues and preempted -> kept past an
    older request that said nothing. Plain LRU would evict continues, preempted, plain,
    closed."""
    s = run["scenarios"]["signals"]
    assert s["exceptions"] == []
    assert s["hints_sent"] == 3, "closed, continues and preempted each send one hint"
    assert s["eviction_order"] == ["closed", "plain", "continues", "preempted"], s


def test_chunk_sizes_that_cannot_be_right_are_refused_with_one_line(
        run: dict[str, Any]) -> None:
    s = run["scenarios"]["geometry"]
    big, mocked = s["chunk_larger_than_row"], s["not_an_integer"]
    assert big and big.startswith("BadGeometry: kvstore's vLLM tier: a chunk of 40000 bytes")
    assert mocked and "not an integer" in mocked
    assert "\n" not in big and "\n" not in mocked


@pytest.mark.parametrize("version", sorted(MATRIX))
def test_a_vllm_outside_the_matrix_is_refused_at_load(version: str) -> None:
    """The installed vLLM reporting a release outside the matrix: loading the tier fails with
    one line naming the supported releases."""
    py = _python(version)
    script = (
        "import vllm\n"
        "from kvstore_client.vllm.compat import UnsupportedVLLM\n"
        "for fake in ('0.31.0', '0.34.0'):\n"
        "    vllm.__version__ = fake\n"
        "    try:\n"
        "        import kvstore_client.vllm.tier\n"
        "    except UnsupportedVLLM as e:\n"
        "        print(repr(str(e)))\n"
        "    else:\n"
        "        print('loaded')\n")
    p = subprocess.run([str(py), "-c", script], env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()[-2:]
    assert lines == [repr("kvstore's vLLM tier supports vLLM 0.32 and 0.33 (tiered KV "
                          f"offloading); installed vLLM: {fake}") for fake in ("0.31.0", "0.34.0")]
