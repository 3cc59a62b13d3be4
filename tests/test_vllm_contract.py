"""vLLM's own secondary-tier tests, run against kvstore's tier, for every vLLM in the matrix.

`make vllm-tests` fetches vLLM's `tests/v1/kv_offload/` from each release's sdist on PyPI (pinned
by sha256) into `.engine-tests/vllm-<version>/`; this test runs vLLM's
`tiering/test_fs_tier.py` there, in that release's environment, with tests/vllm_tier_shim.py
putting KVStoreTier where the tests build the fs tier, against a real daemon. Every test vLLM
wrote must pass, except those the shim's DESELECTED names (the fs tier's own machinery), and
exactly those are deselected.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.daemon import cleanup, start_daemon
from tests.engine_deselected import VLLM_DESELECTED as DESELECTED
from tests.engine_deselected import VLLM_SINCE as SINCE
from tests.vllm_versions import MATRIX

ROOT = Path(__file__).resolve().parents[1]
RUN_DEADLINE_S = 600.0
# The engine run is one subprocess behind a module fixture, bounded by RUN_DEADLINE_S; the
# suite's default per-test timeout (300 s) would cut it short first on a loaded machine.
pytestmark = pytest.mark.timeout(RUN_DEADLINE_S + 60)


def _missing(why: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)


def _paths(version: str) -> tuple[Path, Path]:
    py = ROOT / MATRIX[version] / "bin" / "python"
    tests = ROOT / ".engine-tests" / f"vllm-{version}" / "tests" / "v1" / "kv_offload" / "tiering"
    if not py.exists():
        _missing(f"the vLLM {version} environment is missing ({py}); `make test` builds it")
    if not (tests / "test_fs_tier.py").exists():
        _missing(f"vLLM {version}'s tests are not fetched ({tests}); `make vllm-tests` "
                 "fetches them")
    return py, tests


@pytest.mark.parametrize("version", sorted(MATRIX))
def test_vllm_fs_tier_contract_passes_against_kvstore(version: str, tmp_path: Path) -> None:
    py, tests = _paths(version)
    d = start_daemon(tmp_path / "daemon", {"host.capacity": "128MiB"})
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KVSTORE_") and k != "PYTHONHASHSEED"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "client"), str(ROOT)]
        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(KVSTORE_ADDRESS=d.address, KVSTORE_CONTRACT_REPORT=str(report))
    root = tests.parents[3]
    try:
        proc = subprocess.run(
            [str(py), "-m", "pytest", "-c", os.devnull, "--rootdir", str(root),
             "-p", "no:cacheprovider", "-p", "tests.vllm_tier_shim", "--import-mode=importlib",
             "--basetemp", str(tmp_path / "vllm-tmp"),      # goes with this test's tmp_path
             "-q", "-rfEs", "-W", "ignore::DeprecationWarning", str(tests / "test_fs_tier.py")],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=RUN_DEADLINE_S,
            stdin=subprocess.DEVNULL)
        assert d.alive(), f"the daemon died during the run:\n{d.output()[-3000:]}"
    finally:
        cleanup(d)
    out = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert report.exists(), f"vLLM's tests did not run (rc {proc.returncode}):\n{out}"
    r = json.loads(report.read_text())
    assert r["vllm"] == version
    bad = {n: o for n, o in r["outcomes"].items() if o != "passed"}
    assert not bad and proc.returncode == 0, f"vLLM's tests failed against kvstore: {bad}\n{out}"
    assert len(r["outcomes"]) >= 20, r["outcomes"]
    release = tuple(int(x) for x in version.split(".")[:2])
    expected = sorted(k for k in DESELECTED if SINCE.get(k, (0, 32)) <= release)
    assert r["deselected"] == expected, (
        "the deselected tests are not exactly those the shim lists (a vLLM test renamed or "
        f"gone?): ran without {r['deselected']}, listed {expected}")
