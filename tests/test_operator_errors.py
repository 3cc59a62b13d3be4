"""Operator mistakes against the real `kvstore serve`: one line on stderr, exit 2, no traceback,
before any slow work (issue: an operator's first hour). Also the SDK's wrong address and the
progress lines of a stop that has work to wait for.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from kvstore_client import KVLayout, connect
from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client._proto import kvstore_pb2_grpc as pb_grpc
from kvstore_client.errors import Unavailable

from tests.daemon import cleanup, start_daemon
from tests.test_server import BIG, BIG_BYTES, blocks, chain, put, register

# The bar for "at once": the one line comes within 5 s of start. An exit this slow
# would mean the check ran after the slow work (importing torch, prefaulting, LMDB).
ONE_LINE_DEADLINE_S = 5.0


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}


def serve(args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
          ) -> tuple[subprocess.CompletedProcess, float]:
    """Run `python -m kvstore serve ARGS` to its end; (result, seconds it took)."""
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "kvstore", "serve", *args], capture_output=True,
                         text=True, timeout=120, env={**_env(), **(env or {})}, cwd=cwd,
                         stdin=subprocess.DEVNULL)
    return res, time.monotonic() - t0


def assert_one_line(res: subprocess.CompletedProcess, took: float, *words: str) -> None:
    err = res.stderr
    assert res.returncode == 2, (res.returncode, err)
    assert "Traceback" not in err, err
    assert err.endswith("\n") and err.count("\n") == 1, err       # exactly one line
    assert err.startswith("kvstore: "), err
    for w in words:
        assert w in err, (w, err)
    assert "starting:" not in err and res.stdout == ""             # no slow work began
    assert took < ONE_LINE_DEADLINE_S, f"took {took:.1f} s: {err}"


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
    res, took = serve(["--data-dir", str(f), *_base(tmp_path)])
    assert_one_line(res, took, str(f), "not a folder", "--data-dir")


def test_data_dir_without_parent(tmp_path):
    d = tmp_path / "missing" / "deeper" / "data"
    res, took = serve(["--data-dir", str(d), *_base(tmp_path)])
    assert_one_line(res, took, "does not exist", "mkdir -p", "--data-dir")
    assert not (tmp_path / "missing").exists()


def test_data_dir_read_only(tmp_path, read_only_dir):
    res, took = serve(["--data-dir", str(read_only_dir), *_base(tmp_path)])
    assert_one_line(res, took, str(read_only_dir), "--data-dir")
    assert "read-only" in res.stderr or "not writable" in res.stderr


def test_data_dir_on_a_full_disk(tmp_path, small_mount):
    res, took = serve(["--data-dir", str(small_mount / "data"), *_base(tmp_path)])
    assert_one_line(res, took, "full disk", "free", "--data-dir")


@pytest.mark.parametrize("flag", ["--tcp", "--metrics"])
def test_port_in_use_is_found_before_the_store_opens(tmp_path, busy_port, flag):
    base = [a for a in _base(tmp_path)]
    i = base.index(flag)
    base[i + 1] = f"127.0.0.1:{busy_port}"
    res, took = serve(["--data-dir", str(tmp_path / "data"), *base])
    assert_one_line(res, took, f"127.0.0.1:{busy_port}", "already in use", flag)
    assert not (tmp_path / "data").exists()            # the store never opened


def test_socket_path_too_long(tmp_path):
    long_sock = str(tmp_path / ("s" * 120 + ".sock"))
    res, took = serve(["--data-dir", str(tmp_path / "data"), *_base(tmp_path)[:-2],
                       "--socket", long_sock])
    assert_one_line(res, took, "107", "server.socket")


def test_socket_in_a_missing_folder(tmp_path):
    sock = _short_dir(tmp_path) / "nowhere" / "kvs.sock"
    res, took = serve(["--data-dir", str(tmp_path / "data"), *_base(tmp_path)[:-2],
                       "--socket", str(sock)])
    assert_one_line(res, took, str(sock.parent), "does not exist", "--socket")


def test_socket_path_is_a_regular_file(tmp_path):
    f = _short_dir(tmp_path) / "precious.txt"
    f.write_text("keep me")
    res, took = serve(["--data-dir", str(tmp_path / "data"), *_base(tmp_path)[:-2],
                       "--socket", str(f)])
    assert_one_line(res, took, "not a socket")
    assert f.read_text() == "keep me"


def test_host_pool_larger_than_dev_shm(tmp_path):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    st = os.statvfs("/dev/shm")
    too_big = st.f_bavail * st.f_frsize + (1 << 30)
    args = _base(tmp_path)
    args[args.index("--host-capacity") + 1] = str(too_big)
    res, took = serve(["--data-dir", str(tmp_path / "data"), *args])
    assert_one_line(res, took, "/dev/shm", "host.capacity", "--host-capacity")


def test_cpu_device_gpu_tier_counts_against_dev_shm(tmp_path):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    st = os.statvfs("/dev/shm")
    # The gpu slab alone fits; with the 16 MiB host pool of _base it does not.
    gpu = st.f_bavail * st.f_frsize - (8 << 20)
    res, took = serve(["--data-dir", str(tmp_path / "data"), *_base(tmp_path), "--set",
                       "gpu.enabled=true", "--set", "gpu.backend=cpu", "--set",
                       f"gpu.capacity={gpu}", "--set", "gpu.devices=0"])
    assert_one_line(res, took, "/dev/shm", "CPU-device gpu tier", "gpu.capacity")


@pytest.mark.parametrize("extra, words", [
    (["--tcp", "127.0.0.1:58111", "--metrics", "127.0.0.1:58111"], ["both", "--metrics"]),
    (["--set", "ssd.enabled=false", "--set", "ssd.write_through=true"],
     ["ssd.write_through", "ssd.enabled"]),
    (["--set", "remote.enabled=true", "--set", "remote.urls=redis://127.0.0.1:1",
      "--set", "remote.tls_cert_file=/nonexistent.pem"], ["remote.tls_cert_file"]),
])
def test_conflicting_settings(tmp_path, extra, words):
    res, took = serve(["--data-dir", str(tmp_path / "data"), *_base(tmp_path), *extra])
    assert_one_line(res, took, *words)


def test_environment_variable_error_names_the_variable(tmp_path):
    res, took = serve(["--data-dir", str(tmp_path / "data"), *_base(tmp_path)],
                      env={"KVSTORE_HOST__CAPACITY": "lots"})
    assert_one_line(res, took, "KVSTORE_HOST__CAPACITY", "'lots'")
    res, took = serve(["--data-dir", str(tmp_path / "data"), *_base(tmp_path)],
                      env={"KVSTORE_SERVER__WORKERS": "0"})
    assert_one_line(res, took, "server.workers", "KVSTORE_SERVER__WORKERS")


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
