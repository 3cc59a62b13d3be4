"""HostTier and kvstore_client.common.shm: a real shm slab shared with real client processes."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import textwrap
from multiprocessing import shared_memory

import numpy as np
import pytest
from kvstore_client.common.shm import attach
from kvstore_client.errors import InvalidArgument, NotFound, ResourceExhausted

from tiers.host import HostTier

MIB = 1 << 20


def _name() -> str:
    return f"kvstore-test-{secrets.token_hex(4)}"


def _exists(name: str) -> bool:
    try:
        s = attach(name, 4096)
    except NotFound:
        return False
    s.close()
    return True


def run_client(code: str) -> str:
    """Run `code` in a fresh interpreter (a separate OS process, like an engine)."""
    env = dict(os.environ, PYTHONWARNINGS="error::UserWarning")   # resource_tracker leak warnings
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "resource_tracker" not in out.stderr, out.stderr
    return out.stdout


@pytest.fixture
def host():
    t = HostTier(8 * MIB, shm_name=_name())
    yield t
    t.close()


def test_alloc_view_describe(host):
    d = host.describe()
    assert d == {"kind": "shm", "name": host.shm_name, "size": 8 * MIB}
    off = host.alloc(3 * MIB)
    v = host.view(off, 3 * MIB)
    assert v.dtype == np.uint8 and v.shape == (3 * MIB,)
    assert v.ctypes.data % 4096 == 0                       # page-aligned block address
    assert not v.any()                                      # pre-faulted with zeros
    v[:] = 7
    assert host.view(off, 3 * MIB)[123] == 7               # zero copy: same memory
    assert host.used_bytes == 3 * MIB
    host.free(off)
    assert host.used_bytes == 0
    with pytest.raises(InvalidArgument, match="outside"):
        host.view(7 * MIB, 2 * MIB)


def test_full_slab_raises(host):
    host.alloc(8 * MIB)
    with pytest.raises(ResourceExhausted):
        host.alloc(1)


def test_generated_name():
    t = HostTier(1 * MIB)
    try:
        assert t.describe()["name"].startswith("kvstore-")
        assert _exists(t.shm_name)
    finally:
        t.close()


def test_other_process_reads_and_writes_and_does_not_unlink(host):
    off = host.alloc(2 * MIB)
    pattern = np.arange(2 * MIB, dtype=np.uint64).astype(np.uint8)
    host.view(off, 2 * MIB)[:] = pattern
    d = host.describe()
    out = run_client(f"""
        import numpy as np
        from kvstore_client.common.shm import attach
        slab = attach({d['name']!r}, {d['size']})
        block = slab.array[{off}:{off} + {2 * MIB}]
        want = np.arange({2 * MIB}, dtype=np.uint64).astype(np.uint8)
        print("match", bool((block == want).all()))
        slab.array[{off}:{off} + 4096] = 0xAB          # the client writes into the slab
        del block
        slab.close()
    """)
    assert "match True" in out
    assert (host.view(off, 4096) == 0xAB).all()
    assert (host.view(off + 4096, 100) == pattern[4096:4196]).all()
    # the client has exited: the segment must still be there for the next client
    assert _exists(d["name"])
    out = run_client(f"""
        from kvstore_client.common.shm import attach
        s = attach({d['name']!r}, {d['size']})
        print(int(s.array[{off}]))
    """)
    assert out.strip() == str(0xAB)


def test_close_unlinks():
    t = HostTier(1 * MIB, shm_name=_name())
    name = t.shm_name
    client = attach(name, 1 * MIB)
    t.close()
    assert not _exists(name)
    client.array[0] = 1       # a client's existing mapping stays valid after unlink
    client.close()
    t.close()                 # idempotent


def test_stale_segment_with_same_name_is_replaced():
    name = _name()
    stale = shared_memory.SharedMemory(name=name, create=True, size=4096)
    stale.buf[:4] = b"old!"
    try:
        t = HostTier(2 * MIB, shm_name=name)
        try:
            s = attach(name, 2 * MIB)
            assert bytes(s.buf[:4]) == b"\0\0\0\0" and s.size == 2 * MIB
            s.close()
        finally:
            t.close()
    finally:
        stale.close()
        try:
            stale.unlink()
        except FileNotFoundError:
            pass   # HostTier removed it, as it should


def test_attach_errors(host):
    with pytest.raises(NotFound, match="does not exist"):
        attach(_name(), 4096)
    with pytest.raises(InvalidArgument, match="fewer than"):
        attach(host.shm_name, 16 * MIB)
    with pytest.raises(InvalidArgument):
        attach("a/b", 4096)
    with pytest.raises(InvalidArgument):
        attach(host.shm_name, 0)


def test_bad_host_config():
    with pytest.raises(InvalidArgument, match="capacity"):
        HostTier(100)
    with pytest.raises(InvalidArgument, match="shm_name"):
        HostTier(1 * MIB, shm_name="x/y")
