"""Operator mistakes against the real `kvstore serve`: one line on stderr, exit 2, no traceback,
before any slow work (issue: an operator's first hour). Also the SDK's wrong address and the
progress lines of a stop that has work to wait for.

"Before any slow work" is checked by what the process had imported when it exited (no torch,
numpy, grpc, LMDB, numba, no store), not by a wall-clock bound: the time itself, interpreter
start included, is bench/startup.py's mistake_exit_s.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from kvstore_client import KVLayout, connect
from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client._proto import kvstore_pb2_grpc as pb_grpc
from kvstore_client.errors import Unavailable

from tests import expected_skips
from tests.daemon import cleanup, start_daemon
from tests.test_server import BIG, BIG_BYTES, blocks, chain, put, register

# Modules whose import is the slow part of a start (or comes only with it); a mistake must be
# reported before any of them is loaded.
SLOW_MODULES = ("torch", "numpy", "grpc", "lmdb", "numba", "kvstore.store", "kvstore.daemon",
                "kvstore.server")

# `python -m kvstore ARGS`, reporting the modules it loaded at its exit (serve leaves through
# os._exit) into the file named by KVS_TEST_MODULES_OUT.
_SERVE = """
import json, os, runpy, sys
_exit = os._exit
def _report(code=0):
    with open(os.environ["KVS_TEST_MODULES_OUT"], "w") as f:
        json.dump(sorted(sys.modules), f)
    _exit(code)
os._exit = _report
sys.argv = ["kvstore", *sys.argv[1:]]
try:
    runpy.run_module("kvstore", run_name="__main__", alter_sys=True)
finally:
    _report(0)
"""


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}


def serve(args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None,
          shm_size: str | None = None) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run `python -m kvstore serve ARGS` to its end; (result, modules it had loaded).

    shm_size: run it in a mount namespace of its own whose /dev/shm is a tmpfs of that size,
    nobody else's (root only), so the free space it finds is known."""
    with tempfile.TemporaryDirectory(prefix="kvs-op-mods-") as d:
        out = Path(d) / "modules.json"
        argv = [sys.executable, "-c", _SERVE, "serve", *args]
        if shm_size is not None:
            argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                    f"mount -t tmpfs -o size={shm_size} kvs-test-shm /dev/shm && exec \"$@\"",
                    "sh", *argv]
        res = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                             env={**_env(), **(env or {}), "KVS_TEST_MODULES_OUT": str(out)},
                             cwd=cwd, stdin=subprocess.DEVNULL)
        modules = json.loads(out.read_text()) if out.exists() else []
    return res, modules


def assert_one_line(res: subprocess.CompletedProcess, modules: list[str], *words: str) -> None:
    err = res.stderr
    assert res.returncode == 2, (res.returncode, err)
    assert "Traceback" not in err, err
    assert err.endswith("\n") and err.count("\n") == 1, err       # exactly one line
    assert err.startswith("kvstore: "), err
    for w in words:
        assert w in err, (w, err)
    assert "starting:" not in err and res.stdout == ""             # no slow work began
    assert modules, "the process did not report what it had loaded"
    slow = sorted({m if m in SLOW_MODULES else m.split(".")[0] for m in modules
                   if m in SLOW_MODULES or m.split(".")[0] in SLOW_MODULES})
    assert not slow, f"the mistake was found after loading {slow}: {err}"


def _base(tmp_path: Path) -> list[str]:
    """Flags that keep a mistake-free start small and off the shared ports."""
    return ["--tcp", "", "--metrics", "", "--host-capacity", "16MiB", "--ssd-capacity", "64MiB",
            "--socket", str(_short_dir(tmp_path) / "kvs.sock")]


_SHORT: dict[Path, Path] = {}


@pytest.fixture(autouse=True)
def _short_socket_dir(tmp_path: Path) -> Iterator[None]:
    """A folder short enough for a socket path (pytest's tmp_path may not be), removed after."""
    if len(str(tmp_path)) < 80:
        _SHORT[tmp_path] = tmp_path
        yield
        return
    short = Path(tempfile.mkdtemp(prefix="kvs-op-"))
    _SHORT[tmp_path] = short
    try:
        yield
    finally:
        shutil.rmtree(short, ignore_errors=True)
        _SHORT.pop(tmp_path, None)


def _short_dir(tmp_path: Path) -> Path:
    return _SHORT[tmp_path]


def _try_mount(target: Path, options: str) -> bool:
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    target.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)],
                         capture_output=True, timeout=30)
    return res.returncode == 0


@pytest.fixture
def small_mount(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (a full disk as far as the daemon is concerned); root only."""
    target = tmp_path / "small"
    if not _try_mount(target, "size=1m"):
        pytest.skip("cannot mount a small tmpfs here (needs root and mount)")
    try:
        yield target
    finally:
        subprocess.run(["umount", str(target)], timeout=30)


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A folder this process cannot write: a read-only mount as root, mode 0555 otherwise."""
    target = tmp_path / "ro"
    if os.geteuid() == 0:
        if not _try_mount(target, "ro,size=1m"):
            pytest.skip("root ignores file modes and cannot mount a read-only tmpfs here")
        try:
            yield target
        finally:
            subprocess.run(["umount", str(target)], timeout=30)
    else:
        target.mkdir()
        target.chmod(0o555)
        try:
            yield target
        finally:
            target.chmod(0o755)


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port another process (here: this one) is listening on."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


def test_data_dir_is_a_file(tmp_path):
    f = tmp_path / "not-a-folder"
    f.write_text("x")
    res, mods = serve(["--data-dir", str(f), *_base(tmp_path)])
    assert_one_line(res, mods, str(f), "not a folder", "--data-dir")


def test_data_dir_without_parent(tmp_path):
    d = tmp_path / "missing" / "deeper" / "data"
    res, mods = serve(["--data-dir", str(d), *_base(tmp_path)])
    assert_one_line(res, mods, "does not exist", "mkdir -p", "--data-dir")
    assert not (tmp_path / "missing").exists()


@pytest.mark.tmpfs          # as root a read-only tmpfs (root ignores file modes)
def test_data_dir_read_only(tmp_path, read_only_dir):
    res, mods = serve(["--data-dir", str(read_only_dir), *_base(tmp_path)])
    assert_one_line(res, mods, str(read_only_dir), "--data-dir")
    assert "read-only" in res.stderr or "not writable" in res.stderr


@pytest.mark.tmpfs
def test_data_dir_on_a_full_disk(tmp_path, small_mount):
    res, mods = serve(["--data-dir", str(small_mount / "data"), *_base(tmp_path)])
    assert_one_line(res, mods, "full disk", "free", "--data-dir")


@pytest.mark.parametrize("flag", ["--tcp", "--metrics"])
def test_port_in_use_is_found_before_the_store_opens(tmp_path, busy_port, flag):
    base = [a for a in _base(tmp_path)]
    i = base.index(flag)
    base[i + 1] = f"127.0.0.1:{busy_port}"
    res, mods = serve(["--data-dir", str(tmp_path / "data"), *base])
    assert_one_line(res, mods, f"127.0.0.1:{busy_port}", "already in use", flag)
    assert not (tmp_path / "data").exists()            # the store never opened


def test_socket_path_too_long(tmp_path):
    long_sock = str(tmp_path / ("s" * 120 + ".sock"))
    res, mods = serve(["--data-dir", str(tmp_path / "data"), *_base(tmp_path)[:-2],
                       "--socket", long_sock])
    assert_one_line(res, mods, "107", "server.socket")


def test_socket_in_a_missing_folder(tmp_path):
    sock = _short_dir(tmp_path) / "nowhere" / "kvs.sock"
    res, mods = serve(["--data-dir", str(tmp_path / "data"), *_base(tmp_path)[:-2],
                       "--socket", str(sock)])
    assert_one_line(res, mods, str(sock.parent), "does not exist", "--socket")


def test_socket_path_is_a_regular_file(tmp_path):
    f = _short_dir(tmp_path) / "precious.txt"
    f.write_text("keep me")
    res, mods = serve(["--data-dir", str(tmp_path / "data"), *_base(tmp_path)[:-2],
                       "--socket", str(f)])
    assert_one_line(res, mods, "not a socket")
    assert f.read_text() == "keep me"


@pytest.fixture
def private_shm() -> str:
    """The size of the /dev/shm `serve(..., shm_size=...)` gives the daemon: a tmpfs in a mount
    namespace of its own, so no other process's segments change the free space it sees."""
    if expected_skips.cannot_mount_tmpfs():
        pytest.skip("mounting a private /dev/shm needs root and mount rights")
    if not shutil.which("unshare"):
        pytest.skip("unshare (util-linux) is not installed")
    return "64m"


@pytest.mark.tmpfs
def test_host_pool_larger_than_dev_shm(tmp_path, private_shm):
    args = _base(tmp_path)
    args[args.index("--host-capacity") + 1] = "65MiB"          # 1 MiB more than there is
    res, mods = serve(["--data-dir", str(tmp_path / "data"), *args], shm_size=private_shm)
    assert_one_line(res, mods, "/dev/shm", "host.capacity", "--host-capacity", "64.0 MiB free")


@pytest.mark.tmpfs
def test_cpu_device_gpu_tier_counts_against_dev_shm(tmp_path, private_shm):
    # The gpu slab alone (56 MiB) fits in the 64 MiB; with the 16 MiB host pool of _base it
    # does not.
    res, mods = serve(["--data-dir", str(tmp_path / "data"), *_base(tmp_path), "--set",
                       "gpu.enabled=true", "--set", "gpu.backend=cpu", "--set",
                       "gpu.capacity=56MiB", "--set", "gpu.devices=0"], shm_size=private_shm)
    assert_one_line(res, mods, "/dev/shm", "CPU-device gpu tier", "gpu.capacity",
                    "64.0 MiB free")


@pytest.mark.parametrize("extra, words", [
    (["--tcp", "127.0.0.1:58111", "--metrics", "127.0.0.1:58111"], ["both", "--metrics"]),
    (["--set", "ssd.enabled=false", "--set", "ssd.write_through=true"],
     ["ssd.write_through", "ssd.enabled"]),
    (["--set", "remote.enabled=true", "--set", "remote.urls=redis://127.0.0.1:1",
      "--set", "remote.tls_cert_file=/nonexistent.pem"], ["remote.tls_cert_file"]),
])
def test_conflicting_settings(tmp_path, extra, words):
    res, mods = serve(["--data-dir", str(tmp_path / "data"), *_base(tmp_path), *extra])
    assert_one_line(res, mods, *words)


def test_environment_variable_error_names_the_variable(tmp_path):
    res, mods = serve(["--data-dir", str(tmp_path / "data"), *_base(tmp_path)],
                      env={"KVSTORE_HOST__CAPACITY": "lots"})
    assert_one_line(res, mods, "KVSTORE_HOST__CAPACITY", "'lots'")
    res, mods = serve(["--data-dir", str(tmp_path / "data"), *_base(tmp_path)],
                      env={"KVSTORE_SERVER__WORKERS": "0"})
    assert_one_line(res, mods, "server.workers", "KVSTORE_SERVER__WORKERS")


def test_sdk_wrong_address_says_no_daemon_at_once(tmp_path):
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=4,
                      dtype="float16")
    missing = str(tmp_path / "no.sock")
    with socket.socket() as s:          # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    for address in (missing, f"unix:{missing}", f"127.0.0.1:{free_port}"):
        # A 120 s deadline: the old behaviour waited it out and said "deadline".
        with connect(address, timeout=120) as client:
            with pytest.raises(Unavailable, match="no kvstore daemon at"):
                client.namespace(layout, model="m")


def test_stop_with_work_says_what_it_waits_for(tmp_path):
    """A Get stream the client stops reading keeps a call in flight: the stop reports it each
    second until the grace period ends, then finishes."""
    d = start_daemon(tmp_path, {"host.capacity": "96MiB", "server.shutdown_grace_s": "3"})
    try:
        with d.channel() as ch:
            stub = pb_grpc.KVStoreStub(ch)
            reg = register(stub, BIG)
            keys = chain(24, 7)
            put(stub, reg.namespace_id, keys, blocks(24, BIG_BYTES, 7), per_message=1)
            stream = stub.Get(pb.GetRequest(namespace_id=reg.namespace_id, keys=keys),
                              timeout=60)
            next(stream)                  # the call is running; read no further
            assert d.stop() == 0
            with pytest.raises(grpc.RpcError):
                for _ in stream:
                    pass
        out = d.output()
        assert "stopping (1 s): waiting for 1 in-flight calls to finish" in out, out
        assert "kvstore: stopped" in out
    finally:
        cleanup(d)
