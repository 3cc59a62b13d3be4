"""The suite's disk rule (tests/conftest.py): what a passing test or module wrote under pytest's
temp folder goes when it ends, and a failure keeps its folders for reading.

The suite starts hundreds of daemons and each preallocates its SSD payload file, so a run
that keeps every folder to its end needs many GiB of /tmp: a CI run once stopped at 73% with
ENOSPC on every later test. This runs a small inner session with the suite's own settings
(pyproject.toml) and rules (tests/conftest.py as a plugin) and looks at what is left."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PASSING = '''
import pytest

@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    d = tmp_path_factory.mktemp("kept_by_passing_module")
    (d / "payload.dat").write_bytes(bytes(1 << 20))
    return d

def test_one(shared, tmp_path):
    (tmp_path / "data").write_bytes(bytes(1 << 20))

def test_two(shared, tmp_path):
    (tmp_path / "data").write_bytes(bytes(1 << 20))
'''

FAILING = '''
import pytest

@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return tmp_path_factory.mktemp("kept_by_failing_module")

def test_passes(shared, tmp_path):
    (tmp_path / "data").write_text("ok")

def test_fails_on_purpose(shared, tmp_path):
    (tmp_path / "data").write_text("read me")
    assert False
'''


def test_passing_folders_go_and_failing_ones_stay(tmp_path):
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "test_passing_mod.py").write_text(PASSING)
    (inner / "test_failing_mod.py").write_text(FAILING)
    base = tmp_path / "base"
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "client")])
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(inner), "-p", "tests.conftest",
         "--basetemp", str(base), "test_passing_mod.py", "test_failing_mod.py"],
        cwd=inner, env=env, capture_output=True, text=True, timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "1 failed, 3 passed" in out, out
    left = sorted(p.name for p in base.iterdir() if not p.is_symlink())
    assert left == ["kept_by_failing_module0", "test_fails_on_purpose0"], (left, out)
    assert (base / "test_fails_on_purpose0" / "data").read_text() == "read me"
