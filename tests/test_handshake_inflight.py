"""Handshake replies that carry file descriptors, left unread by the tenant they were sent to
(kvstore/handoff.py, kvstore/unix_listener.py `hold`).

Linux charges an fd sent with SCM_RIGHTS and not yet received to the sending user, the
daemon's, and past its RLIMIT_NOFILE of them refuses every later fd-carrying send unless the
sender has CAP_SYS_RESOURCE or CAP_SYS_ADMIN. Before: the daemon closed and forgot each
connection once it had sent the tenant's pool fd, so one tenant that left ~1,024 replies unread
made every other tenant's handshake fail ("answered no JSON line"; the daemon logged "Too many
references") for as long as it kept its sockets open.

Two tests, because the suite runs as root and root is exempt from that kernel limit:
- the cap itself, which holds whoever runs the daemon: a tenant with limits.pending_per_uid
  replies unread is refused (RESOURCE_EXHAUSTED, no fd) until it reads or closes one, and
  another tenant's handshake is untouched;
- the outage end to end, with the daemon started as a service user would run it: without
  CAP_SYS_RESOURCE/CAP_SYS_ADMIN (setpriv) and with a low open-files limit (prlimit), both from
  util-linux, which Debian marks Essential.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import textwrap
import time
from pathlib import Path

import pytest
from kvstore_client import ResourceExhausted
from kvstore_client.common.handoff import handshake, handshake_path

from kvstore.tenants import hash_token
from tests.daemon import Daemon, cleanup, start_daemon
from tests.trust_net_helpers import TOKENS, settled, world_readable_dir

CAP = 4                      # limits.pending_per_uid in these daemons
SOFT, HARD = 200, 256        # the open-files limit the end-to-end daemon starts with
CAP_SYS_ADMIN, CAP_SYS_RESOURCE = 21, 24


def tenants_with_pools(folder: Path) -> Path:
    p = folder / "tenants.toml"
    p.write_text(textwrap.dedent(f"""
        [tenants.a]
        token_sha256 = "{hash_token(TOKENS['a'])}"
        host_quota = "4MiB"
        [tenants.b]
        token_sha256 = "{hash_token(TOKENS['b'])}"
        host_quota = "4MiB"
    """))
    return p


def settings(folder: Path, **extra: object) -> dict[str, object]:
    return {"auth.tokens_file": str(tenants_with_pools(folder)), "host.capacity": "32MiB",
            "ssd.capacity": "64MiB", **extra}


def unread_handshake(path: str, token: str) -> tuple[socket.socket, dict]:
    """A handshake whose answer is looked at (MSG_PEEK, which leaves its fds queued) but not
    read: what a tenant that never reads its replies leaves behind."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.sendall((json.dumps({"v": 1, "token": token}) + "\n").encode())
    end = time.monotonic() + 10
    data = b""
    while not data.endswith(b"\n"):
        ready, _, _ = select.select([s], [], [], max(0.0, end - time.monotonic()))
        assert ready, "the daemon did not answer the handshake"
        got = s.recv(8192, socket.MSG_PEEK)
        if len(got) == len(data):                  # closed with no (further) answer
            break
        data = got
    return s, json.loads(data) if data.endswith(b"\n") else {}


def read_fds(s: socket.socket) -> list[int]:
    """Read the answer waiting on `s` and close the fds it carried; returns them."""
    _msg, fds, _flags, _addr = socket.recv_fds(s, 8192, 17)
    for fd in fds:
        os.close(fd)
    return fds


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_tenant_with_its_cap_of_unread_replies_is_refused_and_no_one_else() -> None:
    base = world_readable_dir()
    d = start_daemon(base, settings(base, **{"limits.pending_per_uid": CAP}))
    path = handshake_path(d.socket)
    held: list[socket.socket] = []
    try:
        settled(d)                                  # its warm-up opens no more files after this
        fds_before = open_fds(d.proc.pid)
        answers = []
        for _ in range(CAP + 6):
            s, reply = unread_handshake(path, TOKENS["a"])
            held.append(s)
            answers.append(reply)
        pools = [r for r in answers if r.get("pool_size")]
        refusals = [r for r in answers if r.get("error") == "RESOURCE_EXHAUSTED"]
        assert len(pools) == CAP and len(refusals) == 6, answers
        assert "limits.pending_per_uid" in refusals[0]["message"]
        assert all(read_fds(s) == [] for s, r in zip(held, answers, strict=True) if "error" in r)

        for _ in range(3):                          # b: unaffected, its pool fd included
            b = handshake(path, TOKENS["b"])
            assert b.tenant == "b" and b.pool_fd is not None and b.pool_size == 4 << 20
            b.close_fds()
        with pytest.raises(ResourceExhausted):
            handshake(path, TOKENS["a"], timeout=0.5).close_fds()

        mine = [s for s, r in zip(held, answers, strict=True) if r.get("pool_size")]
        mine[0].shutdown(socket.SHUT_RDWR)         # its fds stay queued: still counted
        time.sleep(0.6)
        with pytest.raises(ResourceExhausted):
            handshake(path, TOKENS["a"], timeout=0.5).close_fds()
        assert len(read_fds(mine[1])) == 1          # read, socket kept open: counted no more
        a = handshake(path, TOKENS["a"])
        assert a.pool_fd is not None
        a.close_fds()

        for s in held:
            s.close()
        held.clear()
        end = time.monotonic() + 5                  # the daemon closes its ends in turn
        while open_fds(d.proc.pid) > fds_before + 2:
            assert time.monotonic() < end, "the daemon kept the answered connections open"
            time.sleep(0.1)
        for _ in range(CAP):                        # a's whole allowance back
            s, reply = unread_handshake(path, TOKENS["a"])
            held.append(s)
            assert reply.get("pool_size") == 4 << 20, reply
    finally:
        for s in held:
            s.close()
        cleanup(d)
        shutil.rmtree(base, ignore_errors=True)


def test_a_handshake_refused_for_the_cap_is_tried_again_within_its_deadline() -> None:
    """More processes of one tenant than limits.pending_per_uid handshaking at once: the
    ones past the cap were refused RESOURCE_EXHAUSTED and failed at once. The SDK now tries
    again, backing off, within its one deadline: a process that meets the cap while the
    others finish gets its session a moment later."""
    import threading
    base = world_readable_dir()
    d = start_daemon(base, settings(base, **{"limits.pending_per_uid": CAP}))
    path = handshake_path(d.socket)
    held = [unread_handshake(path, TOKENS["a"])[0] for _ in range(CAP)]
    try:
        got: list[object] = []
        late = threading.Thread(target=lambda: got.append(_try(path, 20)))
        t0 = time.monotonic()
        late.start()
        time.sleep(1.0)                             # it is refused meanwhile, and waits
        assert late.is_alive() and not got
        read_fds(held[0])                           # one of the others is done
        late.join(20)
        session = got[0]
        assert not isinstance(session, Exception), session
        assert session.tenant == "a" and session.pool_fd is not None
        assert time.monotonic() - t0 >= 1.0
        session.close_fds()
        held.append(unread_handshake(path, TOKENS["a"])[0])     # the cap full again
        with pytest.raises(ResourceExhausted):     # still refused once its deadline is out
            handshake(path, TOKENS["a"], timeout=0.3).close_fds()
    finally:
        for s in held:
            s.close()
        cleanup(d)
        shutil.rmtree(base, ignore_errors=True)


def _try(path: str, timeout: float) -> object:
    try:
        return handshake(path, TOKENS["a"], timeout=timeout)
    except Exception as e:  # noqa: BLE001 - handed to the test's thread
        return e


def as_a_service_user(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start daemons without the capabilities that exempt root from the in-flight limit and
    with a low open-files limit, as `docs/security.md` deploys it (a user of its own)."""
    missing = [t for t in ("setpriv", "prlimit") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} (util-linux) not installed")
    wrap = ["prlimit", f"--nofile={SOFT}:{HARD}", "--"]
    if os.geteuid() == 0:                 # a user other than root has neither capability
        wrap = ["setpriv", "--bounding-set", "-sys_resource,-sys_admin", *wrap]
    argv = Daemon.argv
    monkeypatch.setattr(Daemon, "argv", lambda self: [*wrap, *argv(self)])


def proc_status(pid: int, key: str) -> str:
    with open(f"/proc/{pid}/status") as f:
        return next(line.split(":", 1)[1].strip() for line in f if line.startswith(key + ":"))


def test_unread_replies_of_one_tenant_leave_other_tenants_their_pools(monkeypatch) -> None:
    """The outage itself: tenant a leaves more replies unread than the daemon's
    open-files limit (even once raised to the hard one); tenant b's handshakes still bring
    its pool. Then: the daemon did raise its soft limit (a complement, not the fix)."""
    as_a_service_user(monkeypatch)
    base = world_readable_dir()
    d = start_daemon(base, settings(base))
    path = handshake_path(d.socket)
    held: list[socket.socket] = []
    try:
        caps = int(proc_status(d.proc.pid, "CapEff"), 16)
        assert not caps & (1 << CAP_SYS_ADMIN | 1 << CAP_SYS_RESOURCE), hex(caps)
        b = handshake(path, TOKENS["b"])
        assert b.pool_fd is not None
        b.close_fds()
        for _ in range(HARD + 50):
            s, _reply = unread_handshake(path, TOKENS["a"])
            held.append(s)
        for _ in range(3):
            b = handshake(path, TOKENS["b"])
            assert b.tenant == "b" and b.pool_fd is not None and b.pool_size == 4 << 20
            b.close_fds()
        assert "Too many references" not in d.output()
        with open(f"/proc/{d.proc.pid}/limits") as f:
            nofile = next(line.split()[3:5] for line in f if line.startswith("Max open files"))
        assert nofile == [str(HARD), str(HARD)], "the soft limit was not raised to the hard"
    finally:
        for s in held:
            s.close()
        cleanup(d)
        shutil.rmtree(base, ignore_errors=True)
