"""Fixtures every test module can use without importing them, and the suite's rules:

- under CI (`CI` set) a skip fails its test unless tests/expected_skips.py lists it and its
  condition holds here;
- no test leaves sys.path changed (a folder such as bench/ left in front shadows real packages:
  bench/vllm.py once stood in for vLLM and turned a test into a false skip);
- a run holds little disk: a passing test's tmp_path goes when it ends (pyproject's
  tmp_path_retention_policy) and a passing module's tmp_path_factory folders when it ends.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import expected_skips, other_uid
from tests.daemon import daemon_fixture  # noqa: F401  (registers the `daemon` fixture)

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    for name, text in expected_skips.MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")


def _reason(longrepr: object) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


_FAILED_MODULES: set[str] = set()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    rep = yield
    if rep.failed:
        _FAILED_MODULES.add(item.nodeid.split("::", 1)[0])
    if rep.skipped and not hasattr(rep, "wasxfail") and expected_skips.in_ci():
        expected, text = expected_skips.judge(item, _reason(rep.longrepr))
        if not expected:
            rep.outcome = "failed"
            rep.longrepr = text
        elif isinstance(rep.longrepr, tuple) and len(rep.longrepr) == 3:
            rep.longrepr = (*rep.longrepr[:2], text)        # -rs prints why it is allowed
    return rep


_UNEXPECTED_MODULE_SKIPS: list[str] = []


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> pytest.CollectReport:
    """A whole module skipped at import is never expected under CI. It stays a skip here (an
    error would stop the session before any test ran) and fails the run at its end."""
    rep = yield
    if rep.skipped and expected_skips.in_ci():
        _UNEXPECTED_MODULE_SKIPS.append(f"{rep.nodeid}: {_reason(rep.longrepr)}")
    return rep


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _UNEXPECTED_MODULE_SKIPS:
        terminalreporter.section("modules skipped under CI, which expects no such skip")
        for line in _UNEXPECTED_MODULE_SKIPS:
            terminalreporter.line(line)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _UNEXPECTED_MODULE_SKIPS and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_report_header(config: pytest.Config) -> list[str]:
    if not expected_skips.in_ci():
        return ["CI not set: skips are reported (-rs), not failed"]
    return ["CI set: a skip fails unless expected here; expected skips:",
            *(f"  {line}" for line in expected_skips.summary())]


def _bench_on_path() -> list[str]:
    bench = ROOT / "bench"
    return [p for p in sys.path if p and Path(p).resolve() == bench]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Modules run at import during collection: none may leave bench/ on sys.path."""
    left = _bench_on_path()
    if left:
        raise pytest.UsageError(f"a test module left {left} on sys.path while it was imported; "
                                "load bench scripts by path (importlib), never through sys.path")


def _inside_checkout(p: str) -> bool:
    return Path(p or ".").resolve().is_relative_to(ROOT)


@pytest.fixture(autouse=True)
def _sys_path_unchanged() -> Iterator[None]:
    """A test may not insert into sys.path, remove from it, or add a folder of the checkout:
    that changes what later tests import. (A package appending its own data folder at the end,
    as grpc_tools does, shadows nothing.)"""
    before = list(sys.path)
    yield
    after = list(sys.path)
    added = after[len(before):]
    if after[:len(before)] != before or any(_inside_checkout(p) for p in added):
        sys.path[:] = before
        pytest.fail(f"this test changed sys.path (before: {before}, after: {after}); load "
                    "modules by path instead, so later tests import what they mean to",
                    pytrace=False)


@pytest.fixture(autouse=True, scope="module")
def _module_folders_removed(request: pytest.FixtureRequest,
                            tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The folders a module's fixtures made with tmp_path_factory (a shared daemon's data, a
    cluster's nodes) go when the module passed, as a passing test's tmp_path does. Each daemon
    preallocates its SSD file (32 MiB at the test capacity) and the suite starts hundreds:
    kept to the end of the run, they filled a CI machine's /tmp before it ended. A module
    with a failure keeps its folders, for reading. (So a session-scoped fixture cannot keep
    a tmp_path_factory folder: it would go with the first module that used it.)"""
    base = tmp_path_factory.getbasetemp()
    before = set(base.iterdir())
    yield
    if request.node.nodeid in _FAILED_MODULES:
        return
    for path in set(base.iterdir()) - before:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def other_uids() -> Iterator[None]:
    """For tests that run a client under another uid (tests/other_uid.py): skips where that
    cannot work; under CI makes the folders down to the checkout searchable for the run."""
    with other_uid.searchable() as why:
        if why:
            pytest.skip(why)
        yield
