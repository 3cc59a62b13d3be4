"""Every shell and Python block in README.md and docs/*.md runs, as a newcomer would run it.

How: each ```sh / ```bash / ```python block is run on its own (a fresh `bash -euo pipefail` or
`python`), from a temporary folder that is not the repository, against a temporary daemon
whose socket is in $KVSTORE_ADDRESS (the SDK's and `kvstore status`'s default address), and
twice in a row, so an example that only works once (the second run finds the first run's
blocks) or only from the repository root fails here.

Opt-out: a block that needs software or hardware the test environment lacks (a GPU, a model
download, an inference engine), or that is a signature listing and not a program, carries an
HTML comment on the line right before its fence, with the reason in parentheses:

    <!-- docs-test: skip (needs vLLM) -->
    ```python
    ...

Markdown renderers hide the comment. A marker without a reason, or one not followed by a code
fence, fails the test (so markers cannot go stale unnoticed).

Each ```toml block (a daemon config, or a tenants file for `auth.tokens_file`) is loaded the
way `kvstore serve --config` loads it, so a key, table or value type the daemon would refuse
fails here; a placeholder token hash (`"<sha256 hex>"`) is read as a valid one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = {"sh": "shell", "bash": "shell", "shell": "shell", "python": "python"}
SKIP_MARKER = re.compile(r"^<!--\s*docs-test:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->\s*$")
ANY_MARKER = re.compile(r"^\s*<!--\s*docs-test:")
FENCE = re.compile(r"^```(?P<lang>[A-Za-z0-9_+-]*)\s*$")
RUNS = 2
BLOCK_TIMEOUT_S = 300


@dataclass
class Block:
    path: Path
    line: int                 # 1-based line of the opening fence
    lang: str
    code: str
    skip_reason: str | None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def parse(path: Path, problems: list[str] | None = None) -> list[Block]:
    """Fenced blocks of one Markdown file with their opt-out markers; misplaced or malformed
    markers are appended to `problems`."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            if ANY_MARKER.search(lines[i]) and problems is not None:
                nxt = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
                if not SKIP_MARKER.match(lines[i].strip()) or not (nxt and nxt.group("lang")):
                    problems.append(f"{path.name}:{i + 1}: a docs-test marker must read "
                                    "`<!-- docs-test: skip (reason) -->` and stand on the "
                                    "line right before a code fence")
            i += 1
            continue
        start, lang = i, m.group("lang")
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1                                    # the closing fence
        prev = lines[start - 1].strip() if start else ""
        marker = SKIP_MARKER.match(prev)
        blocks.append(Block(path, start + 1, lang, "\n".join(body) + "\n",
                            marker.group("reason").strip() if marker else None))
    return blocks


ALL_BLOCKS = [b for p in DOC_FILES for b in parse(p)]
TO_RUN = [b for b in ALL_BLOCKS if b.lang in RUNNABLE and b.skip_reason is None]


def test_markers_are_well_formed_and_some_blocks_run():
    problems: list[str] = []
    for p in DOC_FILES:
        parse(p, problems)
    assert not problems, problems
    assert DOC_FILES[0].name == "README.md"
    readme = [b for b in TO_RUN if b.path.name == "README.md"]
    assert {b.lang for b in readme} >= {"sh", "python"}, "the README's examples must be run"
    for b in ALL_BLOCKS:
        if b.skip_reason is not None:
            assert len(b.skip_reason) >= 5, f"{b.name}: give a reason to skip"


TOML_BLOCKS = [b for b in ALL_BLOCKS if b.lang == "toml" and b.skip_reason is None]


@pytest.mark.parametrize("block", TOML_BLOCKS, ids=lambda b: b.name)
def test_doc_config_block_loads(block, tmp_path):
    from kvstore.config import load_config
    from kvstore.tenants import load_tenants

    path = tmp_path / "kvstore.toml"
    path.write_text(block.code.replace('"<sha256 hex>"', '"' + "0" * 64 + '"'))
    cfg = load_config(path, environ={})         # raises ConfigError naming the bad key
    if cfg.tenants:
        cfg.auth.tokens_file = ""               # the block's own tables, not a file it names
        assert load_tenants(cfg)


@pytest.fixture(scope="module")
def docs_daemon(tmp_path_factory):
    from tests.daemon import cleanup, start_daemon

    d = start_daemon(tmp_path_factory.mktemp("docs"))
    try:
        yield d
    finally:
        cleanup(d)


def _env(daemon, tmp_path: Path) -> dict[str, str]:
    """What a newcomer's shell has after `make setup`: the kvstore command on PATH (this
    interpreter's, with this checkout importable) and the daemon's address exported."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["KVSTORE_ADDRESS"] = daemon.socket
    # The daemon's config for `kvstore status` without --address would be ./data; the
    # variable above wins, as the README says.
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "client"),
                                         env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "kvstore"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m kvstore "$@"\n')
    shim.chmod(0o755)
    env["PATH"] = f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}" \
                  f"{env.get('PATH', '')}"
    return env


@pytest.mark.parametrize("block", TO_RUN, ids=lambda b: b.name)
def test_doc_block_runs_twice_from_another_folder(block, docs_daemon, tmp_path):
    env = _env(docs_daemon, tmp_path)
    argv = (["bash", "-euo", "pipefail", "-c", block.code] if RUNNABLE[block.lang] == "shell"
            else [sys.executable, "-c", block.code])
    for run in range(1, RUNS + 1):
        cwd = tmp_path / f"run{run}"          # not the repository: relative paths must not
        cwd.mkdir()                           # depend on it
        res = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                             timeout=BLOCK_TIMEOUT_S, stdin=subprocess.DEVNULL)
        assert res.returncode == 0, (f"{block.name} failed on run {run}:\n"
                                     f"--- stdout\n{res.stdout}\n--- stderr\n{res.stderr}")
