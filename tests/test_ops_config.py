"""The operator's surface around the config: what `kvstore serve` and `kvstore status` refuse, in
one line and with which exit code, and what they must not refuse.

- Memory: a host pool above the memory limit of the daemon's cgroup (a container's) or the
  machine's free memory is refused at start, naming host.capacity and the limit, where it was
  OOM-killed after SERVING before (kvstore/preflight.py, check_memory).
- Config files that cannot be read (a folder, no permission, not UTF-8) and values of the wrong
  type are one line naming the file or key, exit 2, not a traceback (kvstore/config.py).
- KVSTORE_* variables that are not settings (KVSTORE_TOKEN, KVSTORE_NO_KERNEL) are left alone;
  an unknown one is refused by name, never with its value (it may be a secret).
- `kvstore status` refused by the handshake: one line, exit 1.
- Non-finite numbers and leases that never expire are refused at load; a client's ttl_s of
  inf or nan is refused by the server (kvstore/handlers/validate.py, check_ttl).
- [remote] has no policy or watermarks (nothing reads them): they are unknown settings.
- README's promise about series that exist from the first scrape matches metrics.RPC_CODES.
- Store-open refusals of a value (policy, shm_name, a host pool under a page) are config
  errors found before anything slow: exit 2, naming the key.
- A metrics endpoint beyond loopback is warned about at start.

Most cases run `python -m kvstore serve` to its (fast) refusal; a case that wrongly starts a
daemon is stopped at once and fails.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvstore.config as config
import kvstore.preflight as preflight
from kvstore.cli import SMALL_HOST_POOL, build_config, default_config_path, make_parser
from kvstore.config import ConfigError, StoreConfig, load_config
from kvstore.preflight import PreflightError
from tests.daemon import cleanup, start_daemon

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
GiB = 1 << 30


# ------------------------------------------------------------------------------- helpers

def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update(extra or {})
    return env


class Ran:
    """What one `kvstore ...` run printed and how it ended; `started`: it reached SERVING
    (and was stopped here)."""

    def __init__(self, rc: int, out: str, err: str, started: bool) -> None:
        self.rc, self.out, self.err, self.started = rc, out, err, started

    def __repr__(self) -> str:
        return f"rc={self.rc} started={self.started} stderr={self.err!r}"


def kvstore(args: list[str], env: dict[str, str] | None = None, prefix: list[str] = (),
            wait_s: float = 30.0) -> Ran:
    """Run `python -m kvstore ARGS` (after `prefix`, e.g. a wrapper entering a cgroup) to its
    end; a daemon that reaches SERVING instead is stopped at once (SIGTERM, then SIGKILL)."""
    with tempfile.TemporaryDirectory(prefix="kvs-oc-log-") as d:
        out_path, err_path = Path(d) / "out", Path(d) / "err"
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            p = subprocess.Popen([*prefix, sys.executable, "-m", "kvstore", *args],
                                 stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                 env=_env(env))
        started = False
        end = time.monotonic() + wait_s
        try:
            while p.poll() is None and time.monotonic() < end:
                if "serving gRPC" in err_path.read_text(errors="replace"):
                    started = True
                    break
                time.sleep(0.05)
        finally:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
        return Ran(p.returncode, out_path.read_text(errors="replace"),
                   err_path.read_text(errors="replace"), started)


def assert_one_line(r: Ran, *words: str, code: int = 2, early: bool = True) -> str:
    """Refused with `code`, without a traceback, in one line naming `words`; `early`: before
    the daemon began its slow start (so that line is all it printed)."""
    assert not r.started, f"the daemon started: {r}"
    assert r.rc == code, r
    assert "Traceback" not in r.err, r.err
    lines = r.err.strip().splitlines()
    if early:
        assert len(lines) == 1 and "starting:" not in r.err, r.err
    last = lines[-1] if lines else ""
    assert last.startswith("kvstore: "), r.err
    for w in words:
        assert w in last, (w, last)
    return last


@pytest.fixture
def short(tmp_path: Path) -> Iterator[Path]:
    """A folder short enough for a socket path (pytest's tmp_path may not be)."""
    d = Path(tempfile.mkdtemp(prefix="kvs-oc-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def base(tmp_path: Path, short: Path) -> list[str]:
    """A small start off the shared ports: 16 MiB host pool, 64 MiB SSD, no TCP or metrics."""
    return ["--data-dir", str(tmp_path / "data"), "--socket", str(short / "kvs.sock"),
            "--tcp", "", "--metrics", "", "--host-capacity", "16MiB", "--ssd-capacity", "64MiB"]


def serve(tmp_path: Path, short: Path, *args: str, env: dict[str, str] | None = None,
          toml: str | bytes | None = None) -> Ran:
    """`kvstore serve` with base() and `args`; `toml`: a config file with this content."""
    extra = list(args)
    if toml is not None:
        cfg = tmp_path / "kv.toml"
        cfg.write_bytes(toml if isinstance(toml, bytes) else toml.encode())
        extra = ["--config", str(cfg), *extra]
    return kvstore(["serve", *base(tmp_path, short), *extra], env=env)


# ------------------------------------------------------------------------- memory limit

def _fake_cgroup(tmp_path: Path, mount_line: str, membership: str,
                 limits: dict[str, str]) -> tuple[str, str]:
    """A /proc/self/mountinfo and /proc/self/cgroup of one line each, and limit files under
    tmp_path (their paths relative to it)."""
    for rel, text in limits.items():
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text + "\n")
    (tmp_path / "mountinfo").write_text(mount_line.replace("@", str(tmp_path)) + "\n")
    (tmp_path / "cgroup").write_text(membership + "\n")
    return str(tmp_path / "mountinfo"), str(tmp_path / "cgroup")


def test_memory_limit_is_found_in_cgroup_v2_and_v1(tmp_path):
    # v2, nested: the parent's limit is the tighter one.
    v2 = tmp_path / "v2"
    files = _fake_cgroup(v2, "30 23 0:26 / @/cg rw - cgroup2 cgroup2 rw", "0::/a/b",
                         {"cg/a/memory.max": str(3 * GiB), "cg/a/b/memory.max": "max"})
    assert preflight.memory_limit(*files) == (3 * GiB, str(v2 / "cg/a/memory.max"))
    # v1 (memory controller mounted alone, a hybrid v2 mount without it beside it).
    v1 = tmp_path / "v1"
    (v1 / "unified").mkdir(parents=True)
    mount = ("35 31 0:32 / @/memory rw - cgroup cgroup rw,memory\n"
             "41 31 0:38 / @/unified rw - cgroup2 cgroup2 rw")
    files = _fake_cgroup(v1, mount, "4:memory:/x/y\n0::/",
                         {"memory/memory.limit_in_bytes": "9223372036854771712",
                          "memory/x/memory.limit_in_bytes": "9223372036854771712",
                          "memory/x/y/memory.limit_in_bytes": str(GiB)})
    assert preflight.memory_limit(*files) == (GiB, str(v1 / "memory/x/y/memory.limit_in_bytes"))
    # A container: the mount shows its own cgroup as root, /proc/self/cgroup the host's path.
    ct = tmp_path / "ct"
    files = _fake_cgroup(ct, "30 23 0:26 /kubepods/pod1 @/cg rw - cgroup2 cgroup2 rw",
                         "0::/kubepods/pod1", {"cg/memory.max": str(2 * GiB)})
    assert preflight.memory_limit(*files) == (2 * GiB, str(ct / "cg/memory.max"))
    # No limit anywhere; no cgroup files at all.
    files = _fake_cgroup(tmp_path / "none", "30 23 0:26 / @/cg rw - cgroup2 cgroup2 rw", "0::/",
                         {"cg/memory.max": "max"})
    assert preflight.memory_limit(*files) is None
    assert preflight.memory_limit(str(tmp_path / "none-1"), str(tmp_path / "none-2")) is None


def _meminfo(tmp_path: Path, available: int, swap_free: int = 0) -> str:
    f = tmp_path / "meminfo"
    f.write_text(f"MemTotal: {24 * GiB // 1024} kB\nMemAvailable: {available // 1024} kB\n"
                 f"SwapFree: {swap_free // 1024} kB\n")
    return str(f)


def _cfg(host: int, data_dir: Path) -> StoreConfig:
    cfg = StoreConfig()
    cfg.host.capacity = host
    cfg.data_dir = str(data_dir)
    return cfg


def test_check_memory_refuses_what_cannot_fit_and_passes_the_defaults(tmp_path):
    check = preflight.check_memory
    plenty = _meminfo(tmp_path, 22 * GiB)
    where = "/sys/fs/cgroup/x/memory.max"
    with pytest.raises(PreflightError) as ei:
        check(_cfg(2 * GiB, tmp_path), (GiB, where), plenty)
    assert "host.capacity (2.0 GiB)" in str(ei.value) and "1.0 GiB" in str(ei.value)
    assert where in str(ei.value) and "--host-capacity" in str(ei.value)
    # The daemon's own heap counts against the limit: a 512 MiB pool under a 640 MiB limit
    # leaves it 128 MiB.
    with pytest.raises(PreflightError, match="the daemon's own"):
        check(_cfg(512 * MiB, tmp_path), (640 * MiB, where), plenty)
    # The defaults: 1 GiB on a normal machine (no limit, or a roomy one) ...
    check(StoreConfig(), None, plenty)
    check(StoreConfig(), (8 * GiB, where), plenty)
    # ... and 512 MiB on a small machine or under a small limit (512 MiB + the margin).
    check(_cfg(SMALL_HOST_POOL, tmp_path),
          (SMALL_HOST_POOL + preflight.DAEMON_HEAP_MARGIN, where), _meminfo(tmp_path, 700 * MiB))
    # Free memory: the pool alone must fit in MemAvailable (+ free swap).
    with pytest.raises(PreflightError, match="free memory"):
        check(_cfg(2 * GiB, tmp_path), None, _meminfo(tmp_path, GiB))
    check(_cfg(2 * GiB, tmp_path), None, _meminfo(tmp_path, GiB, swap_free=2 * GiB))
    # A segment a crashed daemon left for this data folder is freed by this start.
    shm = tmp_path / "shm"
    shm.mkdir()
    cfg = _cfg(2 * GiB, tmp_path)
    cfg.host.shm_name = "kvs-oc-leftover"
    with open(shm / "kvs-oc-leftover", "wb") as f:
        f.write(b"\1" * (2 * MiB))
    short_by_1mib = _meminfo(tmp_path, 2 * GiB - MiB)
    with pytest.raises(PreflightError):
        check(cfg, None, short_by_1mib, str(shm / "elsewhere"))
    check(cfg, None, short_by_1mib, str(shm))      # its 2 MiB come back


def test_small_default_pool_under_a_memory_limit(monkeypatch):
    """The 512 MiB default of small machines also holds under a memory limit below 8 GiB,
    where the 1 GiB default with the daemon's heap would not fit a 1 GiB container."""
    args = make_parser().parse_args(["serve"])
    monkeypatch.setattr(preflight, "memory_limit", lambda *a: (GiB, "memory.max"))
    assert build_config(args, environ={}).host.capacity == SMALL_HOST_POOL
    preflight.check_memory(build_config(args, environ={}), (GiB, "memory.max"), "/nonexistent")
    monkeypatch.setattr(preflight, "memory_limit", lambda *a: (64 * GiB, "memory.max"))
    if os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >= 8 * GiB:
        assert build_config(args, environ={}).host.capacity == StoreConfig().host.capacity


def _mounts() -> list[tuple[str, str, list[str]]]:
    """(fstype, mount point, super options) of each cgroup mount of this process."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        fstype, _, rest = line.split(" - ", 1)[1].partition(" ")
        if fstype in ("cgroup", "cgroup2"):
            out.append((fstype, fields[4], rest.split(" ")[-1].split(",")))
    return out


def _new_memory_cgroup(limit: int) -> tuple[Path, Path] | str:
    """(folder, its cgroup.procs) of a new memory cgroup limited to `limit` bytes: v2 where the
    root hands the memory controller down, else v1; or why none can be made here."""
    name = f"kvs-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    why = []
    for fstype, point, options in _mounts():
        if fstype == "cgroup2":
            control = Path(point) / "cgroup.subtree_control"
            try:
                if "memory" not in control.read_text().split():
                    why.append(f"cgroup v2 at {point} does not hand down the memory controller")
                    continue
                d = Path(point) / name
                d.mkdir()
            except OSError as e:
                why.append(f"cgroup v2 at {point}: {e.strerror}")
                continue
            limit_file = d / "memory.max"
        elif "memory" in options:
            own = next((ln.split(":", 2)[2] for ln in
                        Path("/proc/self/cgroup").read_text().splitlines()
                        if "memory" in ln.split(":")[1].split(",")), "/")
            parent = Path(point) / own.lstrip("/")
            try:
                d = (parent if parent.is_dir() else Path(point)) / name
                d.mkdir()
            except OSError as e:
                why.append(f"cgroup v1 memory at {point}: {e.strerror}")
                continue
            limit_file = d / "memory.limit_in_bytes"
        else:
            continue
        try:
            limit_file.write_text(str(limit))
            return d, d / "cgroup.procs"
        except OSError as e:
            d.rmdir()
            why.append(f"{limit_file}: {e.strerror}")
    return "; ".join(why) or "no memory cgroup hierarchy is mounted"


@pytest.fixture
def memory_cgroup() -> Iterator:
    """make(limit) -> a wrapper command that runs its arguments in a new memory cgroup."""
    made: list[Path] = []

    def make(limit: int) -> list[str]:
        got = _new_memory_cgroup(limit)
        if isinstance(got, str):
            pytest.skip(f"cannot make a memory cgroup with a limit here (needs cgroups v2 with "
                        f"the memory controller, or v1, writable by this process): {got}")
        folder, procs = got
        made.append(folder)
        return ["sh", "-c", f'echo $$ > "{procs}" && exec "$@"', "sh"]

    try:
        yield make
    finally:
        for folder in made:
            for _ in range(50):            # its processes are gone once it is empty
                try:
                    folder.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)


@pytest.mark.memory_cgroup
def test_pool_over_the_cgroup_limit_is_refused_in_one_line(tmp_path, short, memory_cgroup):
    """A pool over the memory limit, at a small scale: before, preflight passed, the daemon
    said SERVING and the prefault of the pool was OOM-killed (exit -9, nothing naming
    host.capacity)."""
    args = base(tmp_path, short)
    args[args.index("--host-capacity") + 1] = "320MiB"
    r = kvstore(["serve", *args], prefix=memory_cgroup(256 * MiB))
    line = assert_one_line(r, "host.capacity (320.0 MiB)", "memory limit is 256.0 MiB",
                           "kvs-test-", "--host-capacity")
    assert line.startswith("kvstore: cannot start: ")
    # A pool that fits with the daemon's heap under a 1 GiB limit starts as before.
    r = kvstore(["serve", *base(tmp_path, short)], prefix=memory_cgroup(GiB))
    assert r.started and r.rc == 0, r


# --------------------------------------------------------- files that cannot be read

def test_config_file_that_cannot_be_read_is_one_line(tmp_path, short):
    folder = tmp_path / "conf.d"
    folder.mkdir()
    assert_one_line(serve(tmp_path, short, "--config", str(folder)),
                    "config file", str(folder), "is a folder")
    assert_one_line(serve(tmp_path, short, env={"KVSTORE_CONFIG": str(folder)}),
                    "config file", str(folder), "is a folder")
    assert_one_line(serve(tmp_path, short, toml=b"\xff\xfe[host]\ncapacity = '32MiB'\n"),
                    "config file", "kv.toml", "not UTF-8")
    not_dir = tmp_path / "file"
    not_dir.write_text("")
    assert_one_line(serve(tmp_path, short, "--config", str(not_dir / "kv.toml")),
                    "config file", "cannot be read")


def test_config_file_without_permission_is_one_line(tmp_path, short):
    cfg = tmp_path / "secret.toml"
    cfg.write_text("[host]\ncapacity = '32MiB'\n")
    cfg.chmod(0o000)
    prefix: list[str] = []
    if os.geteuid() == 0:            # root reads any file: run as root without DAC override
        if not shutil.which("setpriv"):
            pytest.skip("as root, an unreadable file needs setpriv (util-linux) to drop "
                        "CAP_DAC_OVERRIDE")
        prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    r = kvstore(["serve", *base(tmp_path, short), "--config", str(cfg)], prefix=prefix)
    assert_one_line(r, "config file", str(cfg), "cannot be read", "Permission denied")


def test_tokens_file_not_utf8_is_one_line(tmp_path, short):
    tf = tmp_path / "tokens.toml"
    tf.write_bytes(b"\xff[tenants.a]\nuids = [12345]\n")
    r = serve(tmp_path, short, "--set", f"auth.tokens_file={tf}")
    # Tenants are read as the daemon starts (after its "starting:" line).
    assert_one_line(r, "auth.tokens_file", str(tf), "not UTF-8", early=False)


def test_gpu_devices_of_the_wrong_type_is_one_line(tmp_path, short):
    r = serve(tmp_path, short, toml="[gpu]\nenabled = true\nbackend = 'cpu'\ndevices = ['a']\n")
    assert_one_line(r, "gpu.devices", "list of integers")
    r = serve(tmp_path, short, "--set", "gpu.enabled=true", "--set", "gpu.devices=0,a")
    assert_one_line(r, "gpu.devices")


# ------------------------------------------------------------- KVSTORE_* variables

def test_documented_variables_are_not_settings(tmp_path):
    args = make_parser().parse_args(["serve", "--data-dir", str(tmp_path)])
    env = {"KVSTORE_TOKEN": "t0k3n-secret", "KVSTORE_NO_KERNEL": "1"}
    assert build_config(args, environ=env) == build_config(args, environ={})


def test_status_with_kvstore_token_and_no_daemon(tmp_path):
    """Before: `config error: environment variable KVSTORE_TOKEN='…'` (exit 2, the token
    echoed). Now the token is no setting: status looks for the daemon."""
    r = kvstore(["status", "--data-dir", str(tmp_path)], env={"KVSTORE_TOKEN": "t0k3n-secret"})
    assert_one_line(r, "no kvstore daemon", code=1)
    assert "t0k3n-secret" not in r.err


def test_unknown_variable_is_named_without_its_value(tmp_path, short):
    r = serve(tmp_path, short, env={"KVSTORE_API_TOKEN": "hunter2-secret"})
    assert_one_line(r, "KVSTORE_API_TOKEN", "unknown setting")
    assert "hunter2" not in r.err
    # A known setting's bad value is still shown; a secret's never.
    r = serve(tmp_path, short, env={"KVSTORE_SERVER__WORKERS": "many"})
    assert_one_line(r, "KVSTORE_SERVER__WORKERS", "'many'", "server.workers")
    with pytest.raises(ConfigError) as ei:
        load_config(None, environ={"KVSTORE_REMOTE__PASSWORD__X": "hunter2-secret"})
    assert "hunter2" not in str(ei.value) and "KVSTORE_REMOTE__PASSWORD__X" in str(ei.value)
    f = tmp_path / "pw.toml"
    f.write_text("[remote]\npassword = 12345678\nurls = 'redis://:hunter2@h:6379'\n")
    for text in ("[remote]\npassword = 12345678\n", "[remote]\nurls = 'redis://:hunter2@h'\n"):
        f.write_text(text)
        with pytest.raises(ConfigError) as ei:
            load_config(f, environ={})
        assert "12345678" not in str(ei.value) and "hunter2" not in str(ei.value), ei.value


# ---------------------------------------------- status, metrics warning

@pytest.fixture(scope="module")
def tenants_daemon(tmp_path_factory) -> Iterator[tuple]:
    """A daemon with one tenant (a token, and a uid that is not ours) and its metrics endpoint
    on every address; (daemon, the tenant's token)."""
    tmp_path = tmp_path_factory.mktemp("tenants")
    token = "ops-token-" + uuid.uuid4().hex
    tf = tmp_path / "tokens.toml"
    uid = 12345 if os.getuid() != 12345 else 12346
    tf.write_text(f"[tenants.ops]\ntoken_sha256 = ['{hashlib.sha256(token.encode()).hexdigest()}"
                  f"']\nuids = [{uid}]\nadmin = true\n")
    d = start_daemon(tmp_path, {"auth.tokens_file": str(tf), "server.metrics": "0.0.0.0:0"})
    try:
        yield d, token
    finally:
        cleanup(d)


def test_status_refused_by_the_handshake_is_one_line(tenants_daemon):
    d, _ = tenants_daemon
    r = kvstore(["status", "--socket", d.socket])
    line = assert_one_line(r, "UNAUTHENTICATED", "KVSTORE_TOKEN", code=1)
    assert "no tenant lists uid" in line


def test_status_with_kvstore_token_reaches_the_daemon(tenants_daemon):
    """Before, only with --address: the config loader refused KVSTORE_TOKEN (exit 2)."""
    d, token = tenants_daemon
    r = kvstore(["status", "--socket", d.socket], env={"KVSTORE_TOKEN": token})
    assert r.rc == 0 and "daemon" in r.out and token not in r.out + r.err, r


def test_metrics_beyond_loopback_is_warned_about(tenants_daemon):
    d, _ = tenants_daemon
    assert re.search(r"kvstore: WARNING: server\.metrics=0\.0\.0\.0:0 listens beyond "
                     r"loopback with no authentication", d.output()), d.output()


# ----------------------------------------------------- types and never-ending leases

@pytest.mark.parametrize("toml, words", [
    ("[server]\nworkers = true\n", ["server.workers", "expected an integer"]),
    ("[server]\nworkers = 2.9\n", ["server.workers", "expected an integer"]),
    ("[server]\nworkers = '16'\n", ["server.workers", "expected an integer"]),
    ("data_dir = ['a', 'b']\n", ["data_dir", "expected a string"]),
    ("[ssd]\nsync = 'yes'\n", ["ssd.sync", "expected true or false"]),
    ("[server]\nshutdown_grace_s = '5'\n", ["server.shutdown_grace_s", "expected a number"]),
    ("[leases]\ndefault_ttl_s = inf\nmax_ttl_s = inf\n", ["leases.", "finite"]),
    ("[leases]\nmax_ttl_s = nan\n", ["leases.max_ttl_s", "finite"]),
    ("[leases]\nmax_ttl_s = 1e300\n", ["leases", "max_ttl_s <= 86400"]),
    ("[limits]\nrequest_deadline_s = inf\n", ["limits.request_deadline_s", "finite"]),
    # a size with no unit is bytes: 2.9 was read as 2 (then refused as too small, saying so
    # of a value nobody wrote); the fraction is what is wrong
    ("[ssd]\ncapacity = 2.9\n", ["ssd.capacity", "fraction of a byte", "2.9GiB"]),
    ("[host]\ncapacity = '0.5'\n", ["host.capacity", "fraction of a byte"]),
])
def test_wrong_types_and_endless_values_are_refused(tmp_path, short, toml, words):
    assert_one_line(serve(tmp_path, short, toml=toml), "config error", *words)


def test_flags_and_variables_are_read_as_their_type(tmp_path):
    """Text from --set and KVSTORE_* is read as the key's type; a non-finite number is
    refused there too."""
    cfg = load_config(None, {"server": {"workers": "3", "shutdown_grace_s": "2.5"},
                             "ssd": {"sync": "on"}, "gpu": {"devices": "0,1"}},
                      environ={"KVSTORE_LEASES__MAX_TTL_S": "120"})
    assert (cfg.server.workers, cfg.server.shutdown_grace_s, cfg.ssd.sync, cfg.gpu.devices,
            cfg.leases.max_ttl_s) == (3, 2.5, True, [0, 1], 120.0)
    for overrides, key in (({"server": {"workers": "2.9"}}, "server.workers"),
                           ({"leases": {"max_ttl_s": "inf"}}, "leases.max_ttl_s"),
                           ({"server": {"stop_flush_s": "nan"}}, "server.stop_flush_s"),
                           ({"ssd": {"sync": "perhaps"}}, "ssd.sync")):
        with pytest.raises(ConfigError, match=re.escape(key)):
            load_config(None, overrides, environ={})


def test_client_lease_ttl_inf_or_nan_is_refused():
    """The RPC side (every Reserve, Acquire, Renew and fused call goes through check_ttl;
    the store's LeaseTable refuses what passes it above max_ttl_s)."""
    from kvstore_client.common.errors import InvalidArgument

    from kvstore.handlers.validate import check_ttl
    from kvstore.leases import LeaseTable

    for bad in (math.inf, -math.inf, math.nan, -1.0, 601.0):
        with pytest.raises(InvalidArgument):
            check_ttl(bad, 600.0)
    assert check_ttl(0.0, 600.0) is None and check_ttl(5.0, 600.0) == 5.0
    table = LeaseTable(30.0, 600.0)
    for bad in (math.inf, math.nan, 1e300):
        with pytest.raises(InvalidArgument):
            table.ttl(bad)


# --------------------------------------------------------------- [remote] settings

@pytest.mark.parametrize("key, value", [("policy", "'bogus'"), ("high_watermark", "0.01"),
                                        ("low_watermark", "0.01")])
def test_remote_has_no_policy_or_watermarks(tmp_path, short, key, value):
    r = serve(tmp_path, short, toml=f"[remote]\n{key} = {value}\n")
    assert_one_line(r, f"remote.{key}", "unknown setting")
    default = default_config_path().read_text().split("[remote]", 1)[1].split("\n[", 1)[0]
    assert not re.search(rf"^{key}\s*=", default, re.M)


# ----------------------------------------------------------------- README metrics

def test_readme_says_which_rpc_series_exist_from_the_first_scrape():
    from kvstore.metrics import RPC_CODES

    text = " ".join((ROOT / "README.md").read_text().split())
    m = re.search(r"Most series exist from the first scrape, at 0:(?P<early>.*?)Any other "
                  r"code gets its series only with its first call", text)
    assert m, "README.md must say which RPC codes exist from the first scrape"
    early = set(re.findall(r"`([A-Z_]+)`", m.group("early")))
    assert early == set(RPC_CODES), (early ^ set(RPC_CODES))
    # The codes tenants' refusals and the gate's charges answer exist from the start too.
    assert {"UNAUTHENTICATED", "PERMISSION_DENIED", "OUT_OF_RANGE"} <= set(RPC_CODES)


# ------------------------------------------------------ refusals from the store open

@pytest.mark.parametrize("setting, words", [
    ("host.policy=bogus", ["host.policy", "'bogus'", "arc"]),
    ("ssd.policy=lfu", ["ssd.policy", "'lfu'"]),
    ("host.shm_name=a/b", ["host.shm_name", "'a/b'"]),
])
def test_store_open_values_are_config_errors(tmp_path, short, setting, words):
    r = serve(tmp_path, short, "--set", setting)
    assert_one_line(r, "config error", *words)


def test_host_pool_under_a_page_is_a_config_error(tmp_path, short):
    r = serve(tmp_path, short, "--host-capacity", "1")
    assert_one_line(r, "config error", "host.capacity", "4096")


@pytest.mark.parametrize("how", [["--ssd-capacity", "1"], ["--ssd-capacity", "67108863"],
                                 "toml"], ids=["one_byte", "a_byte_short", "file"])
def test_an_ssd_tier_under_one_eviction_batch_is_a_config_error(tmp_path, short, how):
    """Before, `ssd.capacity = 1` (one byte: a bare number is bytes) started, and every write
    failed "ssd tier full (0 of 1 bytes)" once the host pool was full: no host eviction batch
    ever fit. Now: refused at load, naming the key and the minimum."""
    if how == "toml":             # (base()'s --ssd-capacity left out: a flag beats the file)
        cfg = tmp_path / "kv.toml"
        cfg.write_text("[ssd]\ncapacity = 1\n")
        args = base(tmp_path, short)
        i = args.index("--ssd-capacity")
        r = kvstore(["serve", *args[:i], *args[i + 2:], "--config", str(cfg)], env=_env())
    else:
        r = serve(tmp_path, short, *how)
    assert_one_line(r, "config error", "ssd.capacity", "at least 64.0 MiB", "67108864 bytes")


def test_ssd_floor_follows_the_eviction_batch():
    """The floor is two host eviction batches, and only where the SSD tier is on."""
    from kvstore.moves.host_room import BATCH_BYTES

    assert config.SSD_BATCH_BYTES == BATCH_BYTES
    assert config.SSD_MIN_CAPACITY == 2 * BATCH_BYTES
    assert load_config(overrides={"ssd": {"capacity": "64MiB"}}, environ={}).ssd.capacity \
        == 64 * MiB
    cfg = load_config(overrides={"ssd": {"enabled": "false", "capacity": "1"}}, environ={})
    assert not cfg.ssd.enabled
    with pytest.raises(ConfigError, match=r"ssd.capacity must be at least 64.0 MiB.*got 1 "
                                          r"bytes.*\(set by KVSTORE_SSD__CAPACITY\)"):
        load_config(environ={"KVSTORE_SSD__CAPACITY": "1"})


def test_policy_names_match_the_policies():
    from kvstore.policies import _POLICIES

    assert set(config.POLICIES) == set(_POLICIES)


# ------------------------------------------------------------ metrics exposure

def test_metrics_exposure_warning():
    from kvstore.cli import metrics_exposure

    cfg = StoreConfig()
    for addr in ("127.0.0.1:9551", "localhost:1", "[::1]:1", ""):
        cfg.server.metrics = addr
        assert metrics_exposure(cfg) is None, addr
    cfg.server.metrics, cfg.server.metrics_tenants = "0.0.0.0:9551", True
    assert "each tenant's series" in metrics_exposure(cfg)
