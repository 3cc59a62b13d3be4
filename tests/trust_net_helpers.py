"""Shared by the tests/test_trust_net_*.py attacks: tenants, daemon figures, raw sockets.

Why raw gRPC calls and sockets here: the attacks are what a hostile peer sends (a call whose
message never comes, a frame that announces more than it sends), which the SDK never does.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

from kvstore.tenants import hash_token

TOKENS = {"a": "token-of-a", "b": "token-of-b"}
MAX_MESSAGE = 1 << 30


def tenants_file(folder: Path, extra: str = "") -> Path:
    p = folder / "tenants.toml"
    p.write_text(textwrap.dedent(f"""
        [tenants.a]
        token_sha256 = "{hash_token(TOKENS['a'])}"
        uids = [0]
        [tenants.b]
        token_sha256 = "{hash_token(TOKENS['b'])}"
    """) + extra)
    return p


def md(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[tenant]}"),)


def world_readable_dir() -> Path:
    """A folder other uids can reach (pytest's tmp_path sits under a 0700 folder of root)."""
    base = Path(tempfile.mkdtemp(prefix="kvs-tn-"))
    base.chmod(0o755)
    return base


def settled(d, timeout: float = 120.0) -> None:
    """Wait until the daemon's after-start work (numpy, the Get kernel, the codec kernels:
    a couple of hundred MiB) is done, so a memory figure measures the attack, not that."""
    end = time.monotonic() + timeout
    while not any(w in d.output() for w in ("codec kernels loaded", "codec warm-up failed")):
        assert time.monotonic() < end, "the daemon's warm-up did not finish"
        time.sleep(0.1)


def status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in KiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                k, v = line.split(":")
                out[k] = int(v.split()[0])
    return out


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=[
        ("grpc.max_send_message_length", MAX_MESSAGE),
        ("grpc.max_receive_message_length", MAX_MESSAGE)])


class Stall:
    """Client-streaming calls whose request never comes until released (or never)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def requests(self) -> Iterator[bytes]:
        self.release.wait(120)
        return
        yield b""                               # a generator that sends nothing


def stalled_calls(ch: grpc.Channel, method: str, n: int, stall: Stall,
                  metadata: tuple | None = None) -> list[grpc.Future]:
    call = ch.stream_unary(f"/kvstore.v1.KVStore/{method}", request_serializer=lambda b: b,
                           response_deserializer=lambda b: b)
    return [call.future(stall.requests(), timeout=60, metadata=metadata) for _ in range(n)]


def code_of(future: grpc.Future, timeout: float) -> grpc.StatusCode:
    """The status a call ended with (OK when it answered), waiting at most `timeout`."""
    try:
        future.result(timeout=timeout)
        return grpc.StatusCode.OK
    except grpc.FutureTimeoutError:
        raise AssertionError(f"the call did not end within {timeout} s") from None
    except grpc.RpcError as e:
        return e.code()


def hello(path: str, line: bytes, timeout: float = 10.0) -> tuple[socket.socket, dict]:
    """Connect, send one first line, read the one-line answer."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(path)
    s.sendall(line)
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = s.recv(4096)
        if not chunk:
            break
        buf += chunk
    return s, json.loads(buf) if buf else {}


def closed_within(s: socket.socket, timeout: float) -> bytes:
    """What the peer sent before closing `s`; fails if it stays open past `timeout`."""
    end = time.monotonic() + timeout
    got = b""
    while True:
        left = end - time.monotonic()
        if left <= 0:
            raise AssertionError(f"the daemon kept the connection open past {timeout} s")
        ready, _, _ = select.select([s], [], [], left)
        if ready:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:          # closed with our bytes unread
                return got
            if not chunk:
                return got
            got += chunk


OTHER_UID_PRELUDE = """
import os, sys, socket, time, select, json
os.setgroups([]); os.setgid(4343); os.setuid(4343)      # from here on: another user
"""


def other_uid_child(body: str, *args: str) -> subprocess.Popen:
    """A Python child running `body` (with `args` in sys.argv[1:]) under uid 4343; its lines
    are read with read_line (unbuffered: select must see every line that has not been read)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen([sys.executable, "-c", OTHER_UID_PRELUDE + textwrap.dedent(body),
                             *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, bufsize=0, env=env)


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    end = time.monotonic() + timeout
    line = b""
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, end - time.monotonic()))
        if not ready:
            raise AssertionError(f"the child said nothing within {timeout} s")
        c = proc.stdout.read(1)
        if not c:
            raise AssertionError(f"the child ended: {proc.stderr.read().decode()}")
        line += c
    return line.decode().strip()
