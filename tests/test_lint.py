"""The tree stays ruff-clean (config in pyproject.toml)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_clean():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (make setup installs it)")
    res = subprocess.run([ruff, "check", str(ROOT)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
