"""vLLM's real tiering manager with kvstore's tier, against a real daemon.

tests/vllm_manager.py runs in each vLLM environment of the matrix (`.venv-vllm` for 0.32,
`.venv-vllm033` for 0.33; tests/test_vllm_contract.py lists them): it builds vLLM's
TieringOffloadingSpec and TieringOffloadingManager (small CPU primary tier, KVStoreTier loaded by
vLLM's tier factory) and calls the manager as vLLM's offloading connector does. These tests start
one daemon, run that script once, and check what the engine saw: store -> cascade -> primary
eviction -> RETRY -> HIT_PENDING -> HIT with the stored bytes, SSD blocks promoted ahead, a daemon
that is down or hung, a corrupted block, vLLM's stats, and the refusal of per-process hashes.
"""

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
# The engine run is one subprocess behind a module fixture, bounded by RUN_DEADLINE_S; the
# suite's default per-test timeout (300 s) would cut it short first on a loaded machine.
pytestmark = pytest.mark.timeout(RUN_DEADLINE_S + 60)


def _need_vllm(version: str) -> Path:
    py = ROOT / MATRIX[version] / "bin" / "python"
    if py.exists():
        return py
    why = f"the vLLM {version} environment is missing ({py} does not exist); `make test` builds it"
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture(scope="module", params=sorted(MATRIX))
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
        ) -> dict[str, Any]:
    py = _need_vllm(request.param)
    tmp = tmp_path_factory.mktemp("vllm-manager")
    d = start_daemon(tmp, {"host": {"capacity": "64MiB"}, "ssd": {"capacity": "256MiB"}})
    out = tmp / "result.json"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KVSTORE_") and k != "PYTHONHASHSEED"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "client"), str(ROOT)])
    try:
        proc = subprocess.run(
            [str(py), str(ROOT / "tests" / "vllm_manager.py"), "--address", d.address,
             "--out", str(out), "--daemon-pid", str(d.proc.pid)],
            env=env, cwd=tmp, capture_output=True, text=True, timeout=RUN_DEADLINE_S,
            stdin=subprocess.DEVNULL)
        assert d.alive(), f"the daemon died during the run:\n{d.output()[-3000:]}"
    finally:
        cleanup(d)
    assert proc.returncode == 0 and out.exists(), (
        f"vllm_manager.py failed (rc {proc.returncode}):\n{proc.stderr[-5000:]}")
    result = json.loads(out.read_text())
    result["stderr"] = proc.stderr
    assert result["vllm"] == request.param, result["vllm"]
    return result


def scenario(run: dict[str, Any], name: str) -> dict[str, Any]:
    err = run["errors"].get(name)
    assert err is None, f"scenario {name} raised:\n{err}"
    s = run["scenarios"][name]
    assert s.get("exceptions", []) == [], f"the manager raised into vLLM: {s['exceptions']}"
    return s


def test_cascade_eviction_promotion_hit(run: dict[str, Any]) -> None:
    s = scenario(run, "cascade_promote")
    assert s["stored"] == 6 and s["settled"]
    assert [j["success"] for j in s["store_jobs"]] == [True]
    assert s["evicted_from_primary"] == ["MISS"] * 6, "filling the primary tier did not evict"
    assert s["daemon_where"] == ["host"] * 6
    # The storing engine knows it stored them (straight to promotion unless that knowledge
    # aged out), then HIT, with the same bytes.
    for a in s["a_answers"]["answers"]:
        assert a in (["HIT_PENDING", "HIT"], ["RETRY", "HIT_PENDING", "HIT"]), a
    assert s["a_bytes_equal"] is True
    # A second engine asks the daemon first (RETRY), then the tier's HIT starts a promotion.
    assert s["b_answers"]["answers"] == [["RETRY", "HIT_PENDING", "HIT"]] * 6
    assert s["b_bytes_equal"] is True
    assert [j["success"] for j in s["b_jobs"]] == [True]
    assert s["b_tier"]["vllm:kvstore_lookup_hit_chunks"] == 6
    assert s["b_tier"]["vllm:kvstore_loaded_chunks"] == 6
    assert s["b_tier"]["keys_asked"] == 6
    assert s["b_tier"]["queries"] < 6, "lookups were not batched into Locate calls"


def test_stats_flow_into_vllm(run: dict[str, Any]) -> None:
    s = scenario(run, "cascade_promote")
    assert s["stats_type"] == "OffloadingConnectorStats"
    assert s["stats_values"]["vllm:kvstore_lookup_hit_chunks"] == 6
    assert s["stats_values"]["vllm:kvstore_loaded_chunks"] == 6
    ours = {d for d in s["metric_definitions"] if d.startswith("vllm:kvstore_")}
    assert {"vllm:kvstore_lookup_hit_chunks", "vllm:kvstore_loaded_chunks",
            "vllm:kvstore_stored_chunks", "vllm:kvstore_load_failed_chunks"} <= ours


def test_ssd_blocks_retry_while_promoted_then_hit(run: dict[str, Any]) -> None:
    s = scenario(run, "ssd")
    assert s["evicted_blocks"] >= 6
    assert s["where_after_evict"] == ["ssd"] * 6
    assert s["answers"]["answers"] == [["RETRY", "HIT_PENDING", "HIT"]] * 6
    assert s["tier"]["pending"] >= 6, "the tier never saw the blocks below host"
    assert s["prefetched"] >= 6, "the daemon did not promote them ahead (Locate prefetch)"
    assert s["bytes_equal"] is True
    assert s["where_after_load"] == ["host"] * 6


def test_daemon_down_misses_within_deadline(run: dict[str, Any]) -> None:
    s = scenario(run, "down")
    assert s["settled"]
    assert s["jobs"] and not any(j["success"] for j in s["jobs"]), "stores to nowhere succeeded"
    assert all(a[-1] == "MISS" and "HIT" not in a for a in s["answers"]["answers"])
    assert max(s["answers"]["retry_s"]) < s["deadline_s"]     # no RETRY past the deadline
    assert s["tier"]["vllm:kvstore_store_failed_chunks"] > 0


def test_daemon_hung_fails_jobs_and_misses(run: dict[str, Any]) -> None:
    s = scenario(run, "hung")
    assert s["first"] == ["HIT_PENDING"] * 4
    assert s["settled"], "a promotion against a hung daemon never finished"
    promotion = s["jobs"][-1]
    # One SDK call's deadline (a lane hello and the gRPC fallback share it), and a margin for
    # a loaded machine: an extra wait of timeout_s (a hello with its own deadline) fails this.
    assert s["promote_fail_s"] <= s["timeout_s"] + 0.8
    if promotion["success"]:
        # The Locate was answered (its blocks pinned) before the stop, a race a loaded machine
        # can lose: the promotion then needed no more of the daemon, and loaded the right bytes.
        assert s["in_primary"] == ["HIT"] * 4 and s["loaded_bytes_equal"] is True, s
    else:
        assert promotion["successful_keys"] is None
        assert s["in_primary"] == ["MISS"] * 4, \
            "a failed promotion left chunks in the primary tier"
    assert all(a == ["RETRY", "MISS"] for a in s["other_answers"]["answers"])
    assert max(s["other_answers"]["retry_s"]) < s["deadline_s"]   # none past the deadline


def test_corrupt_block_fails_its_job_and_is_recomputed(run: dict[str, Any]) -> None:
    s = scenario(run, "corrupt")
    bad = s["bad_index"]
    keys = s["keys"]
    failed = [j for j in s["jobs"] if not j["success"]]
    assert len(failed) == 1, f"expected one failed promotion, got {s['jobs']}"
    assert failed[0]["successful_keys"] == keys[:bad]
    assert s["hit_keys"] == keys[:bad] and s["hit_bytes_equal"] is True
    # The corrupt chunk and those after it answer MISS (vLLM recomputes them), not HIT again.
    for a in s["answers"]["answers"][bad:]:
        assert a[-1] == "MISS", a
    assert s["checksum_failures"] == 1
    assert s["tier"]["corrupt_dropped"] == 1 and s["daemon_where_after"][bad] is None
    assert s["after_recompute"]["answers"] == [["RETRY", "HIT_PENDING", "HIT"]] * len(keys)
    assert s["after_recompute_bytes_equal"] is True


def test_process_random_hashes_refused_with_one_line(run: dict[str, Any]) -> None:
    s = scenario(run, "process_random")
    r = s["refused"]
    assert r["exceptions"] == []
    assert len(r["errors"]) == 1, r["errors"]
    assert "PYTHONHASHSEED" in r["errors"][0] and "allow_process_local" in r["errors"][0]
    assert r["tier"]["disabled"] and r["tier"]["namespace"] is None
    assert r["jobs"] and not any(j["success"] for j in r["jobs"])
    assert all(a[-1] == "MISS" for a in r["answers"]["answers"])
    p = s["process_local"]
    assert p["exceptions"] == [] and p["errors"] == []
    assert all(j["success"] for j in p["jobs"])
    assert all(a[-1] == "HIT" for a in p["answers"]["answers"]) and p["bytes_equal"] is True
    assert any("PROCESS-LOCAL" in w for w in p["warnings"])
    # Another engine in process-local mode has a namespace of its own: no hits there.
    assert len(set(p["namespaces"])) == 2
    assert all(a[-1] == "MISS" for a in p["other_engine_answers"]["answers"])


def test_runner_reports_vllm_version(run: dict[str, Any]) -> None:
    major, minor = (int(x) for x in run["vllm"].split(".")[:2])
    assert (major, minor) >= (0, 32), run["vllm"]


def test_jobs_submitted_together_keep_their_own_results(run: dict[str, Any]) -> None:
    s = scenario(run, "batched")
    assert [j["success"] for j in s["stored"]] == [True, True, True], s["stored"]
    a, b, c = s["loaded"]
    assert a["success"] and c["success"], s["loaded"]
    assert not b["success"] and b["successful_keys"] == s["keys"][1][:1]
    assert s["equal"][0] == [True] * 3 and s["equal"][2] == [True] * 3
    assert s["equal"][1][0] is True
    # However the jobs were grouped (that depends on thread timing), every job ran once.
    assert 1 <= s["tier"]["store_batches"] <= 3 and 2 <= s["tier"]["load_batches"] <= 3
