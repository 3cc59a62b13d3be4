"""Which skips a CI run accepts, and the condition that must hold for each.

Under CI (the `CI` environment variable set: `.ci/run` sets it) every skip is a failure unless
the skipped test carries the marker of an entry below and that entry's condition holds on this
machine, checked here, not taken from the test's own reason. So a skip caused by a broken
import, a layout CI did not expect or a missing tool fails the run instead of passing quietly.
Outside CI skips stay skips; `make test` prints each with its reason (`-rs`).

Keep the list short: a test that can create what it needs (a tmpfs as root, a world-searchable
checkout, the engines' environments `make test` builds) does so instead of being listed.
"""

from __future__ import annotations

import errno
import functools
import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest


def in_ci() -> bool:
    return bool(os.environ.get("CI"))


@dataclass(frozen=True)
class ExpectedSkip:
    marker: str                     # the tests it covers carry this marker
    condition: str                  # what must be true of this machine, in words
    holds: Callable[[], bool]       # checks it here


@functools.cache
def no_nvidia_gpu() -> bool:
    """No NVIDIA GPU device here. A GPU that torch cannot use is a broken setup, not a reason."""
    return not glob.glob("/dev/nvidia[0-9]*")


@functools.cache
def cannot_mount_tmpfs() -> bool:
    """Whether `mount -t tmpfs` is refused to this process (not root, or a container without
    CAP_SYS_ADMIN), tried on a folder of its own."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        return True
    where = Path(tempfile.mkdtemp(prefix="kvs-mount-probe-"))
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
                           capture_output=True, timeout=30)
        if r.returncode != 0:
            return True
        subprocess.run(["umount", str(where)], capture_output=True, timeout=30)
        return False
    finally:
        where.rmdir()


@functools.cache
def tmp_refuses_o_direct() -> bool:
    """Whether the filesystem pytest's temporary folders live on refuses O_DIRECT (tmpfs does)."""
    fd = -1
    with tempfile.TemporaryDirectory(prefix="kvs-odirect-probe-") as d:
        try:
            fd = os.open(os.path.join(d, "probe"), os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        except OSError as e:
            return e.errno == errno.EINVAL
        finally:
            if fd >= 0:
                os.close(fd)
    return False


@functools.cache
def cannot_limit_memory() -> bool:
    """Whether this process may not make a memory cgroup with a limit (cgroups v2 with the
    memory controller handed down, or v1, writable), tried as the test does."""
    from tests.test_ops_config import _new_memory_cgroup
    got = _new_memory_cgroup(1 << 30)
    if isinstance(got, str):
        return True
    got[0].rmdir()
    return False


EXPECTED: tuple[ExpectedSkip, ...] = (
    ExpectedSkip("cuda", "no NVIDIA GPU on this machine (no /dev/nvidia<N>)", no_nvidia_gpu),
    ExpectedSkip("tmpfs", "this process may not mount a tmpfs (not root, or no CAP_SYS_ADMIN)",
                 cannot_mount_tmpfs),
    ExpectedSkip("o_direct", "the filesystem of the temporary folders refuses O_DIRECT",
                 tmp_refuses_o_direct),
    ExpectedSkip("memory_cgroup", "this process may not make a memory cgroup with a limit "
                 "(no writable cgroup v2 memory controller or v1 hierarchy)",
                 cannot_limit_memory),
)

MARKERS = {
    "cuda": "needs an NVIDIA GPU with CUDA; an expected skip on a machine without one",
    "tmpfs": "mounts a tmpfs of its own; an expected skip where this process may not mount",
    "o_direct": "needs O_DIRECT on the temporary folders' filesystem; an expected skip where "
                "it is refused",
    "memory_cgroup": "runs the daemon in a memory cgroup of its own; an expected skip where "
                     "this process may not make one",
}


def judge(item: pytest.Item | None, reason: str) -> tuple[bool, str]:
    """(True, the reason with the condition that allows it) for an expected skip; otherwise
    (False, why it fails the CI run)."""
    names = {m.name for m in item.iter_markers()} if item is not None else set()
    for e in EXPECTED:
        if e.marker in names:
            if e.holds():
                return True, f"{reason} [expected under CI: {e.condition}]"
            return False, (f"skipped under CI although this machine does not meet the "
                           f"condition of its expected skip ({e.marker}: {e.condition}): "
                           f"{reason}")
    return False, f"skipped under CI, which expects no skip here: {reason}"


def summary() -> list[str]:
    """The expected skips and whether each condition holds on this machine."""
    return [f"{e.marker}: {e.condition}: {'holds' if e.holds() else 'does not hold'}"
            for e in EXPECTED]
