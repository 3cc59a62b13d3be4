"""SGLang's own backend tests and its own cache controller, driving kvstore's HiCache backend.

tests/sglang_contract.py runs in the SGLang environment (`.venv-sglang`) against a real daemon:
the backend tests SGLang ships in its wheel (`storage/mooncake_store/test_mooncake_store.py`,
with kvstore's backend where they build Mooncake's), and SGLang's HiCacheController, built on
CPU, backing up, querying and transferring pages through the backend, then losing the daemon.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.daemon import cleanup, start_daemon
from tests.engine_deselected import SGLANG_DESELECTED
from tests.test_sglang import sglang_python

ROOT = Path(__file__).resolve().parent.parent
RUN_DEADLINE_S = 600


def _cmd(address: str, *args: str) -> list[str]:
    return [sglang_python(), str(ROOT / "tests" / "sglang_contract.py"), "--address", address,
            *args]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "client"), str(ROOT)])
    return env


def _result(rc: int, out: str, err: str) -> dict[str, Any]:
    assert rc == 0, f"sglang_contract.py failed ({rc}):\n{err[-4000:]}"
    r = json.loads(out.strip().splitlines()[-1])
    for name, tb in r["errors"].items():
        pytest.fail(f"{name} raised:\n{tb}")
    return r


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """SGLang's wheel tests, then the controller on a page-first pool; the runner SIGKILLs the
    daemon, records what the controller saw, and waits for this fixture to restart it."""
    sglang_python()
    tmp = tmp_path_factory.mktemp("sgl-contract")
    d = start_daemon(tmp / "daemon")
    gate = tmp / "restart-now"
    try:
        p = subprocess.Popen(_cmd(d.address, "--only", "wheel_tests,controller",
                                  "--layout", "page_first", "--kill-pid", str(d.proc.pid),
                                  "--restart-gate", str(gate)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=_env(), cwd=ROOT)
        end = time.monotonic() + RUN_DEADLINE_S
        while not gate.exists() and p.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        if gate.exists():
            assert not d.alive(), "the runner did not kill the daemon"
            d.restart()
        out, err = p.communicate(timeout=RUN_DEADLINE_S)
    finally:
        cleanup(d)
    r = _result(p.returncode, out, err)
    assert r["sglang"] == "0.5.23"
    return r


def test_sglang_wheel_backend_tests_pass(killed_run: dict[str, Any]) -> None:
    """Every configuration the test module's own __main__ runs passes, including MLA on a
    rank that is not the storage writer (tp 3/8); exactly the listed tests are not run."""
    w = killed_run["runs"]["wheel_tests"]
    assert w["backend"] == "kvstore_client.sglang.backend.KVStoreHiCache"
    bad = {n: o for n, o in w["outcomes"].items() if o != "passed"}
    assert not bad, bad
    assert len(w["outcomes"]) == 4 and w["errors"] == 0
    assert False in w["writers"], "no non-writer rank ran"
    assert w["deselected"] == sorted(SGLANG_DESELECTED)
    covered = {n.split("::")[1].split("[")[0] for n in [*w["outcomes"], *w["deselected"]]}
    assert covered == set(w["module_tests"]), (
        f"the wheel's test module has tests this runner does not know: {w['module_tests']}")


def test_sglang_controller_backs_up_finds_and_transfers_pages(
        killed_run: dict[str, Any]) -> None:
    c = killed_run["runs"]["controller"]
    assert c["backend"] == "KVStoreHiCache" and c["zero_copy_calls"] == "_page_set_zero_copy"
    assert c["backup_tokens"] == c["prompt_tokens"] == 96
    assert c["hit_tokens"] == 96 and c["hashes_match"]
    assert c["loaded_tokens"] == 96 and c["bytes_equal"]
    assert c["miss"] == 0


def test_sglang_controller_survives_the_daemon_killed(killed_run: dict[str, Any]) -> None:
    """Daemon gone: the hit query finds nothing, the backup writes nothing, no controller
    thread dies, each within the backend's deadlines; the daemon back: the same controller
    backs up and loads again."""
    c = killed_run["runs"]["controller"]
    assert c["killed_hit_tokens"] == 0 and c["killed_backup_tokens"] == 0
    assert c["killed_s"] < 2 * (3.0 + 1.0) + 10
    assert c["threads_alive_after_kill"] and c["threads_alive"]
    assert c["recovered"] is True


def test_sglang_controller_with_the_shm_host_pool(tmp_path: Path) -> None:
    """SGLang's shared-memory host pool (`"allocator": "shm"`: a memfd whose fd the pool
    exports): the controller moves pages through the backend the same way, byte-equal, copied
    by the SDK's kernel straight between that pool and the daemon's."""
    d = start_daemon(tmp_path / "daemon")
    try:
        p = subprocess.run(_cmd(d.address, "--only", "controller", "--layout", "layer_first",
                                "--allocator", "shm"),
                           capture_output=True, text=True, env=_env(), cwd=ROOT,
                           timeout=RUN_DEADLINE_S)
    finally:
        cleanup(d)
    c = _result(p.returncode, p.stdout, p.stderr)["runs"]["controller"]
    assert c["pool_fd"] is True and c["layout"] == "layer_first"
    assert c["backup_tokens"] == 96 and c["hit_tokens"] == 96
    assert c["loaded_tokens"] == 96 and c["bytes_equal"]
    assert c["stats"]["copy"] == "kernel" and c["stats"]["errors"] == 0


def test_an_sglang_outside_the_matrix_is_refused_at_load() -> None:
    """SGLang reporting another release (and no SGLang at all): loading the backend fails with
    one line naming the supported releases."""
    script = (
        "import importlib.metadata as md, sys\n"
        "real = md.version\n"
        "md.version = lambda name: sys.argv[1] if name == 'sglang' else real(name)\n"
        "from kvstore_client.sglang.compat import UnsupportedSGLang\n"
        "try:\n"
        "    import kvstore_client.sglang.backend\n"
        "except UnsupportedSGLang as e:\n"
        "    print(repr(str(e)))\n")
    for fake in ("0.5.22", "0.6.0"):
        p = subprocess.run([sglang_python(), "-c", script, fake], capture_output=True,
                           text=True, env=_env(), timeout=300)
        assert p.stdout.strip().splitlines()[-1:] == [repr(
            "kvstore's SGLang backend supports SGLang 0.5.23; installed SGLang: " + fake)], (
            p.stdout[-2000:], p.stderr[-2000:])
    p = subprocess.run([sys.executable, "-c", "import kvstore_client.sglang.backend"],
                       capture_output=True, text=True, env=_env(), timeout=120)
    assert p.returncode != 0
    assert p.stderr.strip().splitlines()[-1] == (
        "kvstore_client.sglang.compat.UnsupportedSGLang: kvstore's SGLang backend supports "
        "SGLang 0.5.23; installed SGLang: not installed")
