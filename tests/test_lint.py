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


def _copy_checkout(dst: Path) -> None:
    """The checkout as a fresh clone has it: no virtualenvs, caches, data or build output."""
    ignore = shutil.ignore_patterns(".git", ".venv*", "__pycache__", "*.egg-info", "build",
                                    "dist", "data", ".pytest_cache", ".ruff_cache",
                                    ".hypothesis", "bench", ".engine-tests", "models",
                                    ".pydeps")
    shutil.copytree(ROOT, dst, ignore=ignore, symlinks=True)
    shutil.copytree(ROOT / "bench", dst / "bench",
                    ignore=shutil.ignore_patterns("__pycache__", "out"))


def test_ruff_clean_after_pip_install_of_the_client(tmp_path):
    """`pip install ./client` leaves client/build/ (a copy of the generated stubs); the next
    `make test` must still pass its lint."""
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (make dev installs it)")
    clone = tmp_path / "clone"
    _copy_checkout(clone)
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                          "--no-build-isolation", "--no-index", "--target",
                          str(tmp_path / "site"), "./client"],
                         cwd=clone, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert list((clone / "client" / "build").rglob("*.py")), "pip left no build folder?"
    res = subprocess.run([ruff, "check", "."], cwd=clone, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
