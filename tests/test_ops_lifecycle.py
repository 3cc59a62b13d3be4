"""The daemon's start and stop against what an operator's mistakes and crashes leave: a second
daemon on a live daemon's socket or shm name, a data folder other users could read, a
truncated LMDB file, a slab left by a daemon killed with its children.

Every daemon here is a real `kvstore serve` process (tests/daemon.py); every shm segment a test
names is removed at its end.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvstore_client._proto import kvstore_pb2_grpc as pb_grpc

from tests.daemon import TEST_DEFAULTS, Daemon, DaemonError, cleanup, start_daemon
from tests.test_server import SMALL_BYTES, blocks, chain, get, put, register
from tests.trust_net_helpers import tenants_file
from tiers.ssd.index import LmdbIndex

SHM = Path("/dev/shm")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def shm_name() -> Iterator[str]:
    """A segment name no other test uses; whatever is left under it is removed after."""
    name = f"kvstore-test-ops-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        yield name
    finally:
        try:
            (SHM / name).unlink()
        except FileNotFoundError:
            pass


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A folder short enough for socket paths (pytest's tmp_path may not be)."""
    d = Path(tempfile.mkdtemp(prefix="kvs-ops-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _serve(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore", "serve", *args],
                          capture_output=True, text=True, timeout=120, env=env,
                          stdin=subprocess.DEVNULL)


def _store_and_check(d: Daemon, seed: int) -> None:
    """A new client registers, stores 4 blocks over gRPC and reads them back."""
    with d.channel() as ch:
        stub = pb_grpc.KVStoreStub(ch)
        ns = register(stub).namespace_id
        keys, data = chain(4, seed), blocks(4, SMALL_BYTES, seed)
        assert put(stub, ns, keys, data).stored == 4
        got, _ = get(stub, ns, keys)
        assert got == list(zip(keys, data, strict=True))


def _kill_with_children(d: Daemon) -> None:
    """SIGKILL the daemon and its children (the resource tracker) together, as a container
    kill or systemd's KillMode=control-group does: nobody is left to unlink the slab."""
    pid = d.proc.pid
    os.kill(pid, signal.SIGSTOP)         # no new child meanwhile
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            kids += [int(p) for p in
                     Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except OSError:
            pass
    for k in kids:
        try:
            os.kill(k, signal.SIGKILL)
        except ProcessLookupError:
            pass
    d.kill()


# -----------------------------------------------------------------------------------------
def test_refused_start_on_a_live_socket_leaves_it_alone(tmp_path, short_dir):
    """A second `kvstore serve` given a live daemon's --socket is refused, and its way out
    removes nothing it did not make: the first daemon's socket stays, new clients connect."""
    a = start_daemon(tmp_path / "a")
    try:
        before = os.lstat(a.socket)
        res = _serve(["--data-dir", str(short_dir / "b"), "--socket", a.socket, "--tcp", "",
                      "--metrics", "", "--host-capacity", "16MiB", "--ssd-capacity", "64MiB"],
                     a.env)
        assert res.returncode == 1, res.stderr
        assert f"another process is listening on {a.socket}" in res.stderr
        assert "Traceback" not in res.stderr
        after = os.lstat(a.socket)       # the very same socket file
        assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)
        assert os.path.exists(a.socket + ".lane")
        assert a.alive()
        _store_and_check(a, 1)           # a new client, over a new connection
    finally:
        cleanup(a)


# -----------------------------------------------------------------------------------------
def _open_to_others(folder: Path) -> list[str]:
    """Entries under `folder` (itself included) with any right for group or other users,
    sockets aside."""
    m = stat.S_IMODE(os.lstat(folder).st_mode)
    bad = [f"{folder} {m:04o}"] if m & 0o077 else []
    for root, dirs, files in os.walk(folder):
        for n in (*dirs, *files):
            p = Path(root) / n
            st = os.lstat(p)
            if stat.S_ISSOCK(st.st_mode) or stat.S_ISLNK(st.st_mode):
                continue
            if stat.S_IMODE(st.st_mode) & 0o077:
                bad.append(f"{p} {stat.S_IMODE(st.st_mode):04o}")
    return bad


def test_data_folder_is_owner_only_even_where_an_older_daemon_left_it_open(tmp_path):
    """LMDB's index names models and tenants (and holds token ids with events on): the data
    folder and all the daemon keeps in it are its user's alone, also for a folder an older
    build left 0755/0644 (tightened at start)."""
    d = start_daemon(tmp_path)
    try:
        _store_and_check(d, 3)
        assert _open_to_others(d.data_dir) == []
        d.stop()
        for root, _dirs, files in os.walk(d.data_dir):  # as an older build left it
            os.chmod(root, 0o755)
            for n in files:
                os.chmod(Path(root) / n, 0o644)
        assert _open_to_others(d.data_dir) != []
        d.start()
        assert _open_to_others(d.data_dir) == []
        assert "made owner-only" in d.output()
        assert stat.S_IMODE(os.lstat(d.socket).st_mode) == 0o600     # sockets: unchanged
        d.stop()
        assert _open_to_others(d.data_dir) == []          # the index image, written at stop
    finally:
        cleanup(d)


def test_with_tenants_a_socket_in_the_data_folder_stays_reachable(short_dir):
    """With tenants and the default socket path (inside the data folder), other uids must
    reach the 0666 sockets: the folder is 0711 (searchable, never listable); what is in it
    stays owner-only."""
    data = short_dir / "data"
    data.mkdir()
    settings = {**TEST_DEFAULTS, "auth.tokens_file": str(tenants_file(short_dir))}
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    d = Daemon(data, str(data / "kvstore.sock"), settings, env, short_dir).start()
    try:
        assert stat.S_IMODE(os.stat(data).st_mode) == 0o711
        assert stat.S_IMODE(os.lstat(d.socket).st_mode) == 0o666
        for p in (data / "LOCK", data / "ssd", data / "ssd" / "index" / "data.mdb"):
            assert stat.S_IMODE(os.lstat(p).st_mode) & 0o077 == 0, p
    finally:
        cleanup(d)


# ------------------------------------------------------------------------------------
def test_a_live_daemons_shm_name_is_refused(tmp_path, shm_name):
    """Two daemons given one host.shm_name: the second is refused with one line naming the
    key, and the first keeps its slab (same inode) and its engines their blocks."""
    a = start_daemon(tmp_path / "a", {"host.shm_name": shm_name})
    b = None
    try:
        _store_and_check(a, 5)
        inode = os.stat(SHM / shm_name).st_ino
        with pytest.raises(DaemonError) as err:
            b = start_daemon(tmp_path / "b", {"host.shm_name": shm_name})
        text = str(err.value)
        assert "exited with code 1" in text and "Traceback" not in text
        line = [ln for ln in text.splitlines() if ln.startswith("kvstore: cannot open")]
        assert len(line) == 1 and f"host.shm_name {shm_name!r}" in line[0], text
        assert "in use by a running kvstore daemon" in line[0]
        assert os.stat(SHM / shm_name).st_ino == inode
        assert a.alive()
        _store_and_check(a, 6)
        _shm_round_trip(a)
    finally:
        if b is not None:
            cleanup(b)
        cleanup(a)
    assert not (SHM / shm_name).exists()           # a clean stop removes it


def _shm_round_trip(d: Daemon) -> None:
    """An engine that maps the daemon's slab stores and loads a prompt through it."""
    code = f"""
import numpy as np, torch
from kvstore_client import KVLayout, connect
layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=16, dtype="bfloat16")
kv = torch.randn((2, 2, 64, 2, 64), generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
with connect({d.address!r}, transport="shm") as c:
    ns = c.namespace(layout, model="m")
    assert ns.store(np.arange(64), kv) == 4
    out = torch.zeros_like(kv)
    assert ns.load(np.arange(64), out=out) == 64 and torch.equal(out, kv)
    print(c.transport)
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=d.env)
    assert res.returncode == 0 and res.stdout.strip() == "shm", res.stdout + res.stderr


def test_a_slab_left_by_a_daemon_killed_with_its_children_is_reclaimed(tmp_path, shm_name):
    """SIGKILL to the daemon and its resource tracker leaves the slab in /dev/shm; nobody
    holds its lock, so the next daemon of that name (the next start on the folder, whose
    name derives from it, or any other) takes it over, and its clean stop removes it."""
    a = start_daemon(tmp_path / "a", {"host.shm_name": shm_name})
    b = None
    try:
        _store_and_check(a, 7)
        _kill_with_children(a)
        left = os.stat(SHM / shm_name)                  # left behind
        b = start_daemon(tmp_path / "b", {"host.shm_name": shm_name})
        assert os.stat(SHM / shm_name).st_ino != left.st_ino
        _shm_round_trip(b)
        assert b.stop() == 0
        assert not (SHM / shm_name).exists()
        a.start()                                        # the first folder: starts as well
        _store_and_check(a, 8)
    finally:
        if b is not None:
            cleanup(b)
        cleanup(a)


# -----------------------------------------------------------------------------------------
def _truncate_lmdb(data_dir: Path, size: int = 8192) -> Path:
    p = data_dir / "ssd" / "index" / "data.mdb"
    assert p.stat().st_size > size
    os.truncate(p, size)
    return p


def test_truncated_lmdb_file_is_one_line_and_leaves_no_slab(tmp_path, shm_name):
    """A data.mdb shorter than its meta pages say (cut by a copy or a lost tail) is refused
    with one line naming the file, before LMDB maps it (a SIGBUS before), and no shm slab is
    left behind."""
    d = start_daemon(tmp_path, {"host.shm_name": shm_name})
    try:
        with d.channel() as ch:
            stub = pb_grpc.KVStoreStub(ch)
            ns = register(stub).namespace_id
            keys, data = chain(64, 9), blocks(64, SMALL_BYTES, 9)
            assert put(stub, ns, keys, data).stored == 64
        assert d.stop() == 0                            # the blocks go down to SSD
        path = _truncate_lmdb(d.data_dir)
        with pytest.raises(DaemonError) as err:
            d.start()
        text = str(err.value)
        assert "exited with code 1" in text, text
        assert "Fatal Python error" not in text and "Traceback" not in text, text
        lines = [ln for ln in d.output().splitlines() if ln.startswith("kvstore: cannot")]
        assert len(lines) == 1 and str(path) in lines[0] and "truncated" in lines[0], text
        assert not (SHM / shm_name).exists()
    finally:
        cleanup(d)


_LENGTH_CHECK = """
import os, sys
from kvstore_client.common.errors import Unavailable
from tiers.ssd.index import LmdbIndex
folder = sys.argv[1]
idx = LmdbIndex(folder, 64 << 20, sync=False)
with idx._env.begin(write=True, db=idx.blocks) as txn:
    for i in range(3000):
        txn.put(b"k%08d" % i, os.urandom(64))
idx.close()
LmdbIndex(folder, 64 << 20, sync=False).close()
path = os.path.join(folder, "index", "data.mdb")
for size in (3 * 4096, 5000):     # (5000: both meta pages' heads, then nothing)
    os.truncate(path, size)
    try:
        LmdbIndex(folder, 64 << 20, sync=False)
    except Unavailable as e:
        assert "truncated" in str(e) and path in str(e), e
        print("REFUSED")
os.truncate(path, 0)            # empty: LMDB starts a new environment, as it always did
LmdbIndex(folder, 64 << 20, sync=False).close()
print("EMPTY OK")
"""


def test_lmdb_index_checks_the_file_length_before_mapping(tmp_path):
    """The check itself (tiers/ssd/index.py): a short file is an Unavailable naming it, not
    a SIGBUS (in a child, which a SIGBUS would kill); an empty one starts anew."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(ROOT / "client"), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", _LENGTH_CHECK, str(tmp_path / "ssd")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert res.returncode == 0, (res.returncode, res.stderr[-2000:])
    assert res.stdout.split() == ["REFUSED", "REFUSED", "EMPTY", "OK"], res.stdout


def test_lmdb_files_are_made_owner_only(tmp_path):
    old = os.umask(0o022)
    try:
        LmdbIndex(str(tmp_path / "ssd"), 64 << 20, sync=False).close()
    finally:
        os.umask(old)
    for p in ("ssd/index", "ssd/index/data.mdb", "ssd/index/lock.mdb"):
        assert stat.S_IMODE(os.stat(tmp_path / p).st_mode) & 0o077 == 0, p


def test_slab_lock_in_process(shm_name):
    """tiers/host.py itself: a name held by a live slab is refused (naming host.shm_name), an
    unlocked leftover of the name is reclaimed."""
    import _posixshmem

    from tiers.host import HostTier, SegmentInUse, check_free

    a = HostTier(1 << 20, shm_name=shm_name, prefault=False)
    try:
        with pytest.raises(SegmentInUse, match=f"host.shm_name {shm_name!r}"):
            check_free(shm_name)
        with pytest.raises(SegmentInUse, match=f"host.shm_name {shm_name!r}"):
            HostTier(1 << 20, shm_name=shm_name, prefault=False)
        assert os.stat(SHM / shm_name).st_size == 1 << 20          # still a's
    finally:
        a.close()
    fd = _posixshmem.shm_open("/" + shm_name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    os.close(fd)                                  # a leftover nobody holds
    check_free(shm_name)
    b = HostTier(1 << 20, shm_name=shm_name, prefault=False)
    try:
        assert os.stat(SHM / shm_name).st_size == 1 << 20
    finally:
        b.close()
    assert not (SHM / shm_name).exists()
