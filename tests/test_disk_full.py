"""The SSD tier's filesystem fills up, or the data folder cannot be written at all.

Each test makes its own small tmpfs (root only; skipped cleanly elsewhere), so a full disk is
real: LMDB's commits fail the way they fail on a full SSD (a short write, reported as EIO).
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from kvstore_client import KVLayout, ResourceExhausted, connect

from tests.daemon import cleanup, start_daemon

# Every test mounts a tmpfs of its own (expected_skips.py: a skip only where mounting is refused).
pytestmark = pytest.mark.tmpfs

LAYOUT = KVLayout(num_layers=8, num_kv_heads=4, head_dim=64, block_tokens=16, dtype="bfloat16")
T = LAYOUT.block_tokens           # 128 KiB blocks


def make_kv(seed: int, blocks: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    L, _, _, H, D = LAYOUT.block_shape
    return torch.randn((L, 2, blocks * T, H, D), generator=g).to(torch.bfloat16)


def prompt(seed: int, blocks: int) -> list[int]:
    return torch.randint(0, 50_000, (blocks * T,), generator=torch.Generator().manual_seed(
        1000 + seed)).tolist()


def _mount(where: Path, size: str, ro: bool = False) -> None:
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode})")
    if ro:
        subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True, timeout=30)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where = tmp_path / "run" / "data"      # the daemon's data folder (tests/daemon.py)
    _mount(where, "96m")                   # above the 64 MiB free the daemon wants to start
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], timeout=30)


def fill(fs: Path) -> Path:
    """Write a ballast file until the filesystem is full; returns it."""
    ballast = fs / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (1 << 20, 4096):
            chunk = b"\xff" * size
            try:
                while os.write(fd, chunk) == size:
                    pass
            except OSError as e:
                assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return ballast


def test_full_ssd_filesystem(small_fs: Path, tmp_path: Path) -> None:
    d = start_daemon(tmp_path / "run", {"host.capacity": "4MiB", "ssd.capacity": "1GiB"})
    try:
        with connect(d.address, transport="grpc") as c:
            ns = c.namespace(LAYOUT, model="diskfull")
            old_ids, old_kv = prompt(0, 8), make_kv(0, 8)
            assert ns.store(old_ids, old_kv) == 8
            assert c.flush() == 8                         # on SSD while there is room
            ballast = fill(small_fs)

            # host keeps working: writes land in host, victims that cannot be demoted go
            for i in range(1, 12):
                assert ns.store(prompt(i, 8), make_kv(i, 8)) == 8
            counters = c.stats()["counters"]
            assert counters["ssd_disk_full_errors"] >= 1
            assert counters["ssd_disk_full_dropped_blocks"] >= 1
            # The drops keep every block held reachable: a parent whose children stay is
            # kept (lookups walk a prompt from its first block; a child without its parent
            # would hold room no lookup finds).
            held = c.stats(namespaces=True)["namespace_list"][0]["blocks"]
            assert held == sum(ns.lookup(prompt(i, 8)) // T for i in range(12))
            # a write that must land on SSD says where and how much room is left
            with pytest.raises(ResourceExhausted) as ei:
                c.flush()
            msg = str(ei.value)
            assert f"filesystem under {small_fs / 'ssd'} is full" in msg
            assert "bytes free" in msg
            # blocks already on SSD are still served (promoted into host)
            out = torch.zeros_like(old_kv)
            assert ns.load(old_ids, out=out) == 8 * T
            assert torch.equal(out.view(torch.int16), old_kv.view(torch.int16))

            # recovery: space comes back, SSD writes land again
            ballast.unlink()
            new_ids, new_kv = prompt(50, 8), make_kv(50, 8)
            assert ns.store(new_ids, new_kv) == 8
            c.flush()
            c.evict("host")
            out = torch.zeros_like(new_kv)
            assert ns.load(new_ids, out=out) == 8 * T
            assert torch.equal(out.view(torch.int16), new_kv.view(torch.int16))
            assert c.stats()["tiers"]["ssd"]["blocks"] >= 16
        assert "Traceback" not in d.output()
        assert d.output().count("logged once a minute") == 1
    finally:
        cleanup(d)


def serve(data_dir: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return subprocess.run(
        [sys.executable, "-m", "kvstore", "serve", "--data-dir", str(data_dir),
         "--socket", str(tmp_path / "s.sock"), "--set", "server.tcp=",
         "--set", "server.metrics=", "--set", "host.capacity=8MiB"],
        capture_output=True, text=True, timeout=120, env=env)


def test_start_on_a_full_filesystem_is_one_line_and_keeps_lock(small_fs: Path,
                                                                  tmp_path: Path) -> None:
    data = small_fs
    (data / "LOCK").write_text("4242\n")       # the previous holder's pid
    fill(small_fs)
    r = serve(data, tmp_path)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"kvstore: cannot start: data folder {data} is on a full disk")
    assert (data / "LOCK").read_text() == "4242\n"


def test_start_on_a_read_only_filesystem_is_one_line(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    ro = tmp_path / "ro"
    _mount(ro, "16m")
    try:
        (ro / "data").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True, timeout=30)
        for data, where in ((ro / "data", f"data folder {ro / 'data'}"),
                            (ro / "missing", f"{ro} (where data folder {ro / 'missing'} would "
                                             "be made)")):
            r = serve(data, tmp_path)
            assert r.returncode == 2, r.stderr
            lines = r.stderr.strip().splitlines()
            assert len(lines) == 1, r.stderr
            assert lines[0].startswith(f"kvstore: cannot start: {where} is on a read-only "
                                       "filesystem"), lines
    finally:
        subprocess.run(["umount", "-l", str(ro)], timeout=30)


def test_grpc_status_is_resource_exhausted(small_fs: Path, tmp_path: Path) -> None:
    """The raw status a non-SDK client sees for a flush that cannot land."""
    d = start_daemon(tmp_path / "run", {"host.capacity": "4MiB", "ssd.capacity": "1GiB"})
    try:
        with connect(d.address, transport="grpc") as c:
            ns = c.namespace(LAYOUT, model="diskfull-raw")
            fill(small_fs)
            ns.store(prompt(20, 4), make_kv(20, 4))
            from kvstore_client._proto import kvstore_pb2 as pb
            from kvstore_client._proto import kvstore_pb2_grpc as pbg
            with d.channel() as ch:
                with pytest.raises(grpc.RpcError) as ei:
                    pbg.KVStoreStub(ch).Flush(pb.FlushRequest(), timeout=60)
            assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "bytes free" in ei.value.details()
    finally:
        cleanup(d)
