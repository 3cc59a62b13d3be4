"""A tenant's own host pool (a memfd from the handshake) across a daemon crash and restart.

A reader that never stores must not keep copying out of the dead run's pool when another client
of its tenant registered the namespace in the new run first: a memfd has no name whose inode
would show the restart, and nothing the reader calls answers NotFound. It must resync once and
load the new run's bytes; a checksum failure of its stale mapping must not count as a corrupt
block (the vLLM tier deletes those, for every engine). A block really corrupt in the daemon
still does. The vLLM test runs tests/vllm_pool_restart.py, which also closes its engines: vLLM
must then close its primary tier's mmap (no buffer export of the tier left behind).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from kvstore_client import connect
from kvstore_client.common.handoff import Session, socket_id

from kvstore.tenants import hash_token
from tests.daemon import Daemon, cleanup, start_daemon
from tests.kv_data import LAYOUT, T, make_kv, prompt
from tests.test_vllm_tier import _env, _python

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "token-of-the-pool-tenant"


def tenant_daemon(tmp_path: Path, by: str) -> Daemon:
    """A daemon whose one tenant (this uid, or a token) has a host pool of its own."""
    who = f'uids = [{os.getuid()}]' if by == "uid" else f'token_sha256 = "{hash_token(TOKEN)}"'
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(textwrap.dedent(f"""
        [tenants.pool-tenant]
        {who}
        host_quota = "8MiB"
    """))
    return start_daemon(tmp_path / "run", {"auth.tokens_file": str(tenants)})


def crash_restart(d: Daemon) -> None:
    d.kill()            # SIGKILL: the socket files and the dead run's memfd mappings stay
    d.start()


@pytest.mark.parametrize("by", ["uid", "token"])
def test_a_reader_resyncs_once_to_the_new_runs_pool(tmp_path: Path, by: str) -> None:
    d = tenant_daemon(tmp_path, by)
    token = TOKEN if by == "token" else None
    try:
        ids, kv = prompt(1, 4), make_kv(1, 4)
        with connect(d.address, transport="shm", token=token) as w, \
                connect(d.address, transport="shm", token=token) as r:
            wns, rns = w.namespace(LAYOUT, model="m"), r.namespace(LAYOUT, model="m")
            assert r.pool is not None and r.pool.fd_backed
            assert wns.store(ids, kv) == 4
            out = torch.zeros_like(kv)
            assert rns.load(ids, out) == 4 * T
            crash_restart(d)
            # The writer registers the namespace in the new run first, and fills other slots
            # before these blocks (at the old offsets, the old pool's bytes would still verify).
            assert wns.store(prompt(2, 3), make_kv(2, 3)) == 3
            assert wns.store(ids, kv) == 4
            before = dict(r.counters)
            for _ in range(2):
                out = torch.zeros_like(kv)
                assert rns.load(ids, out) == 4 * T
                assert torch.equal(out.view(torch.int16), kv.view(torch.int16))
            assert r.counters["resyncs"] - before["resyncs"] == 1, r.counters
            # A token client keeps its session, so its first copy may fail its checksum before
            # a handshake shows the pool moved: a local failure, never a corrupt block.
            assert r.counters["checksum_failures"] - before["checksum_failures"] <= (
                1 if by == "token" else 0), r.counters
            assert r.counters["corrupt_blocks"] == 0
            assert wns.lookup(ids) == 4 * T           # nothing was dropped
    finally:
        cleanup(d)


def test_a_block_corrupt_in_a_tenant_pool_still_counts_as_corrupt(tmp_path: Path) -> None:
    """The check that tells a dead run's mapping from a bad block must not excuse a bad one."""
    d = tenant_daemon(tmp_path, "uid")
    try:
        ids, kv = prompt(3, 4), make_kv(3, 4)
        with connect(d.address, transport="shm") as w, connect(d.address, transport="shm") as r:
            wns, rns = w.namespace(LAYOUT, model="m"), r.namespace(LAYOUT, model="m")
            assert wns.store(ids, kv) == 4
            with wns.pin(wns.keys(ids)) as pinned:      # where block 2 sits in the pool
                off = int(pinned._lease.slots[2].offset)
                w.pool.slab.array[off:off + 64] ^= 0xFF
            out = torch.zeros_like(kv)
            assert rns.load(ids, out) == 2 * T
            assert r.counters["corrupt_blocks"] == 1 and r.counters["checksum_failures"] == 1
            assert r.counters["resyncs"] == 0 and not r.pool.replaced
    finally:
        cleanup(d)


# -- through vLLM's tiering manager ------------------------------------------------------------

VLLM = "0.32.0"


@pytest.mark.timeout(660)
def test_vllm_reader_loads_after_a_restart_and_deletes_nothing(tmp_path: Path) -> None:
    py = _python(VLLM)
    d = tenant_daemon(tmp_path, "uid")
    out = tmp_path / "result.json"
    env = _env()
    try:
        child = subprocess.Popen(
            [str(py), str(ROOT / "tests" / "vllm_pool_restart.py"), d.address, str(out)],
            env=env, cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []
        try:
            assert child.stdout is not None and child.stdin is not None
            for line in child.stdout:
                lines.append(line)
                if line.startswith("RESTART"):
                    crash_restart(d)
                    child.stdin.write("go\n")
                    child.stdin.flush()
            rc = child.wait(600)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    finally:
        cleanup(d)
    text = "".join(lines)
    assert rc == 0 and out.exists(), f"vllm_pool_restart.py failed (rc {rc}):\n{text[-5000:]}"
    s: dict[str, Any] = json.loads(out.read_text())
    assert s["exceptions"] == [], s["exceptions"]
    assert s["before"]["bytes_equal"] and s["fd_backed"]
    assert s["held_before"] == ["host"] * 4, s
    after = s["after"]
    assert all(a[-1] == "HIT" for a in after["answers"]), after
    assert after["bytes_equal"], after
    assert all(j["success"] for j in after["jobs"]), after["jobs"]
    assert after["corrupt_dropped"] == 0 and after["resyncs"] == 1, after
    assert s["held_after"] == ["host"] * 4, s         # B deleted none of C's blocks
    # Closing the engines: vLLM closes each primary tier's mmap and logs when it cannot.
    assert "Failed to close mmap_obj" not in text and "BufferError" not in text, text[-5000:]


def test_a_socket_bound_again_is_another_run_even_on_the_same_inode(tmp_path: Path) -> None:
    """A filesystem may give a newly bound socket the inode its predecessor just freed (ext4
    nearly always does): a session must still see another daemon run there, or a token
    client keeps copying through the dead run's pools (tests/test_tenant_gpu.py)."""
    path = str(tmp_path / "kvstore.sock.auth")
    first = socket.socket(socket.AF_UNIX)
    first.bind(path)
    session = Session("a", "token", None, 0, socket_id=socket_id(path))
    assert session.current(path)
    first.close()
    os.unlink(path)
    again = socket.socket(socket.AF_UNIX)
    try:
        again.bind(path)
        assert not session.current(path)
    finally:
        again.close()
