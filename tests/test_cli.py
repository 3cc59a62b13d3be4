"""The `kvstore` command line: config sources and their order, config errors, status, demo."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import tomllib

import pytest

from kvstore.cli import MALLOC_ENV, build_config, default_config_path, main, make_parser
from kvstore.config import StoreConfig, load_config
from tests.daemon import cleanup, start_daemon


def _fields(obj) -> set[str]:
    out = set()
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out |= {f"{f.name}.{sub}" for sub in _fields(value)}
        else:
            out.add(f.name)
    return out


def _keys(table: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in table.items():
        # An empty table is an open map (tenants), a key of its own.
        out |= _keys(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {prefix + k}
    return out


def test_embedded_default_equals_config_defaults():
    path = default_config_path()
    assert load_config(path, environ={}) == StoreConfig().check()
    assert _keys(tomllib.loads(path.read_text())) == _fields(StoreConfig())


def test_sources_in_order_file_env_flags(tmp_path):
    cfg_file = tmp_path / "kv.toml"
    cfg_file.write_text('data_dir = "/srv/kv"\n[host]\ncapacity = "2GiB"\n'
                        '[ssd]\ncapacity = "10GiB"\nsync = true\n')
    args = make_parser().parse_args(
        ["serve", "--config", str(cfg_file), "--host-capacity", "32MiB", "--tcp", "",
         "--set", "leases.max_ttl_s=120", "--set", "server.workers=3"])
    cfg = build_config(args, environ={"KVSTORE_HOST__CAPACITY": "16MiB",
                                      "KVSTORE_SSD__CAPACITY": "1GiB"})
    assert cfg.host.capacity == 32 << 20          # flag beats variable beats file
    assert cfg.ssd.capacity == 1 << 30            # variable beats file
    assert cfg.ssd.sync is True and cfg.data_dir == "/srv/kv"    # file beats default
    assert cfg.server.tcp == "" and cfg.server.workers == 3 and cfg.leases.max_ttl_s == 120
    assert cfg.socket_path == "/srv/kv/kvstore.sock"


@pytest.mark.parametrize("argv, words", [
    (["--set", "host.capacity=lots"], "host.capacity"),
    (["--set", "host.colour=red"], "colour"),
    (["--set", "novalue"], "section.key=value"),
    (["--tcp", "localhost"], "server.tcp"),
    (["--log-level", "chatty"], "log_level"),
    (["--set", "server.workers=0"], "server.workers"),
    (["--config", "/nonexistent/kv.toml"], "does not exist"),
])
def test_config_errors_are_one_line_exit_2(tmp_path, capsys, argv, words):
    rc = main(["serve", "--data-dir", str(tmp_path / "data"), *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("kvstore: config error:") and words in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "data").exists()       # nothing started


def test_config_error_from_the_real_command(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["KVSTORE_SSD__CAPACITY"] = "-5"
    r = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--data-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert "ssd.capacity" in r.stderr and "Traceback" not in r.stderr


def test_status_without_a_daemon(tmp_path, capsys):
    assert main(["status", "--data-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "no kvstore daemon" in err and str(tmp_path / "kvstore.sock") in err
    stale = tmp_path / "stale.sock"                # a socket file nobody listens on
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()
    assert main(["status", "--address", f"unix:{stale}", "--timeout", "2"]) == 1
    assert "no kvstore daemon answers" in capsys.readouterr().err


def test_serve_reads_env_and_status_shows_it(tmp_path):
    """KVSTORE_* reaches the daemon; `kvstore status` prints its table."""
    d = start_daemon(tmp_path, {"host.capacity": None},
                     env={"KVSTORE_HOST__CAPACITY": "32MiB"})
    try:
        status = [sys.executable, "-m", "kvstore", "status", "--socket", d.socket]
        r = subprocess.run(status, capture_output=True, text=True, timeout=60, env=d.env)
        assert r.returncode == 0, r.stderr
        rows = {line.split()[0]: line for line in r.stdout.splitlines() if line.strip()}
        assert {"tier", "host", "ssd"} <= set(rows)
        assert "32.0 MiB" in rows["host"] and "256.0 MiB" in rows["ssd"]
        r = subprocess.run(status + ["--json"], capture_output=True, text=True, timeout=60,
                           env=d.env)
        stats = json.loads(r.stdout)
        host = next(t for t in stats["tiers"] if t["name"] == "host")
        assert int(host["capacity_bytes"]) == 32 << 20
    finally:
        cleanup(d)


def _reader_gone(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run `cmd` with a stdout pipe whose read end is closed before it starts, as `| head -1`
    is once head has its line (here for certain: every write gets EPIPE)."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run(cmd, stdout=w, stderr=subprocess.PIPE, text=True, timeout=60,
                              env=env)
    finally:
        os.close(w)


def test_status_json_has_every_field_as_numbers(tmp_path):
    """`status --json`: counts are JSON numbers and fields at 0 are there (an empty tier's
    `blocks`), so a script reads them without a default; and `status | head` exits quietly."""
    d = start_daemon(tmp_path)
    try:
        status = [sys.executable, "-m", "kvstore", "status", "--socket", d.socket]
        r = subprocess.run(status + ["--json"], capture_output=True, text=True, timeout=60,
                           env=d.env)
        assert r.returncode == 0, r.stderr
        stats = json.loads(r.stdout)
        assert stats["namespaces"] == 0 and stats["active_leases"] == 0
        assert isinstance(stats["counters"], dict) and stats["daemon_id"]
        tiers = {t["name"]: t for t in stats["tiers"]}
        assert {"host", "ssd"} <= set(tiers)
        counts = ("capacity_bytes", "used_bytes", "blocks", "hits", "misses", "evictions")
        for t in tiers.values():
            assert set(t) == {"name", *counts}, t
            assert all(type(t[k]) is int for k in counts), t
        assert tiers["host"]["blocks"] == 0 and tiers["ssd"]["blocks"] == 0   # a fresh daemon
        assert tiers["host"]["capacity_bytes"] > 0

        for argv in (status, status + ["--json"]):
            r = _reader_gone(argv, d.env)
            assert (r.returncode, r.stderr) == (141, ""), r.stderr
    finally:
        cleanup(d)


@pytest.mark.parametrize("fmt", [[], ["--json"]])
def test_plan_into_a_closed_pipe_exits_quietly(fmt):
    """`kvstore plan ... | head -1`: no BrokenPipeError traceback or "Exception ignored"
    message; exit 141, as a shell reports a C tool killed by SIGPIPE."""
    cmd = [sys.executable, "-m", "kvstore", "plan", "--layers", "80", "--kv-heads", "8",
           "--head-dim", "128", "--attention-heads", "64", *fmt]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    full = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert full.returncode == 0 and full.stdout, full.stderr
    r = _reader_gone(cmd, env)
    assert (r.returncode, r.stderr) == (141, ""), r.stderr


def test_demo_subcommand_dispatches(capsys):
    with pytest.raises(SystemExit) as ei:
        main(["demo", "--help"])
    assert ei.value.code == 0
    assert "usage" in capsys.readouterr().out.lower()


def test_malloc_tuning_applies_what_the_environment_does_not_set():
    """serve's allocator settings go through mallopt(3) in-process (no re-exec); an operator's
    own MALLOC_* value is left alone."""
    code = "from kvstore.cli import tune_malloc; print(' '.join(sorted(tune_malloc())))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == sorted(MALLOC_ENV)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**env, "MALLOC_ARENA_MAX": "2"}, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == sorted(set(MALLOC_ENV) - {"MALLOC_ARENA_MAX"})
