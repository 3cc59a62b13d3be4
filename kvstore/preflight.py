"""Checks `kvstore serve` runs on its config before any slow work.

Why a separate pass: the daemon's slow steps (importing torch, prefaulting the host pool,
opening LMDB, binding gRPC) each fail on an operator's mistake in their own way, often after
half a minute and with a traceback or gRPC's log noise. Everything that can be known from the
config and the machine alone is checked here first, with the standard library only, so a
mistake costs one line naming the cause and the fix (exit 2) within a second of start.

What stays with the daemon: the data-folder lock (another daemon may start between this check
and the lock, so the lock is the authority) and the real binds (a port can be taken after the
check; the daemon reports that too, in one line).
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import tempfile
from pathlib import Path

from .config import StoreConfig, format_size

MAX_SOCKET_PATH = 107          # sockaddr_un.sun_path holds 108 bytes with the NUL
MIN_FREE_DISK = 64 << 20       # LOCK file, LMDB meta pages and the first blocks
SHM_DIR = "/dev/shm"
# What the daemon holds beside its shared-memory pools, counted against a memory limit: the
# interpreter, gRPC, LMDB's and the libraries' pages (~230 MiB resident, measured at an idle
# start), and room for the messages in flight.
DAEMON_HEAP_MARGIN = 256 << 20
# A cgroup v1 memory.limit_in_bytes at or above this is "no limit" (the kernel reports
# PAGE_COUNTER_MAX pages, about 2**63 bytes).
_NO_LIMIT = 1 << 62


class PreflightError(Exception):
    """An operator's mistake found before start; the message is the one line to print."""


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def check_data_dir(data_dir: str) -> None:
    """The data folder exists or can be made, is a folder, is writable and has room."""
    p = Path(data_dir).absolute()
    fix = "or pass another --data-dir"
    if p.exists() and not p.is_dir():
        raise PreflightError(f"data folder {p} is a file, not a folder; remove it {fix}")
    if not p.exists():
        parent = p.parent
        if not parent.is_dir():
            raise PreflightError(f"data folder {p} cannot be created: its parent {parent} does "
                                 f"not exist; create it (mkdir -p {parent}) {fix}")
        probe_in = parent
    else:
        probe_in = p
    _check_writable(probe_in, p)
    free = _free_bytes(probe_in)
    if free < MIN_FREE_DISK:
        raise PreflightError(f"data folder {p} is on a full disk ({format_size(free)} free, at "
                             f"least {format_size(MIN_FREE_DISK)} needed); free some space {fix}")


def _check_writable(folder: Path, data_dir: Path) -> None:
    """Create and remove a file: the only test that also holds for root and read-only mounts."""
    try:
        fd, name = tempfile.mkstemp(prefix=".kvstore-probe-", dir=folder)
    except OSError as e:
        what = ("is on a read-only filesystem" if e.errno == errno.EROFS
                else f"is not writable by this user (uid {os.geteuid()})"
                if e.errno in (errno.EACCES, errno.EPERM)
                else f"cannot be written ({os.strerror(e.errno or 0)})")
        where = (f"data folder {data_dir}" if folder == data_dir
                 else f"{folder} (where data folder {data_dir} would be made)")
        raise PreflightError(f"{where} {what}; fix its permissions or pass another --data-dir"
                             ) from None
    os.close(fd)
    os.unlink(name)


def check_socket(socket_path: str, data_dir: str) -> None:
    """Short enough for sockaddr_un, in an existing folder, not over a non-socket file."""
    sock = os.path.abspath(socket_path)
    n = len(sock.encode())
    if n > MAX_SOCKET_PATH:
        raise PreflightError(f"socket path {sock} is {n} bytes, longer than the "
                             f"{MAX_SOCKET_PATH} a Unix socket allows; set --socket "
                             "(server.socket) to a shorter path")
    parent = Path(sock).parent
    if not parent.exists() and parent != Path(data_dir).absolute():
        raise PreflightError(f"socket folder {parent} does not exist; create it or set "
                             "--socket (server.socket) to a path in an existing folder")
    if parent.exists() and not parent.is_dir():
        raise PreflightError(f"socket path {sock}: {parent} is not a folder; set --socket "
                             "(server.socket) to a path in an existing folder")
    try:
        mode = os.lstat(sock).st_mode
    except OSError:
        return
    if not stat.S_ISSOCK(mode):
        raise PreflightError(f"socket path {sock} exists and is not a socket; remove it or "
                             "set --socket (server.socket) to another path")


def _bind_problem(host: str, port: int) -> str | None:
    """Why a TCP listener cannot bind host:port now, or None when it can."""
    if port == 0:
        return None             # any free port: nothing to collide with
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"names a host that cannot be resolved ({e.strerror})"
    family, _, _, _, sockaddr = infos[0]
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        # As the real listeners do, so a port in TIME_WAIT after a restart is not "in use".
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(sockaddr)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return "is already in use by another process"
        if e.errno == errno.EADDRNOTAVAIL:
            return f"names an address ({host}) that is not on this machine"
        if e.errno == errno.EACCES:
            return "needs privileges (ports below 1024)"
        return f"cannot be bound ({os.strerror(e.errno or 0)})"
    finally:
        s.close()
    return None


def _bindable(key: str, address: str) -> None:
    host, _, port_text = address.rpartition(":")
    host = host.strip("[]")
    why = _bind_problem(host, int(port_text))
    if why is not None:
        flag = "--tcp" if key == "tcp" else "--metrics"
        raise PreflightError(f"server.{key} = {address!r} {why}; set {flag} to another "
                             "host:port, or '' to disable it")


def check_ports(cfg: StoreConfig) -> None:
    """TCP and metrics listeners: distinct, and free now (before the store opens)."""
    srv = cfg.server
    if srv.tcp and srv.metrics and srv.tcp == srv.metrics and not srv.tcp.endswith(":0"):
        raise PreflightError(f"server.tcp and server.metrics are both {srv.tcp!r}; give the "
                             "metrics endpoint its own port (--metrics)")
    for key in ("tcp", "metrics"):
        addr = getattr(srv, key)
        if addr:
            _bindable(key, addr)


def check_events(cfg: StoreConfig) -> None:
    """The KV event streams' TCP addresses are free now (ZMQ binds them with the store)."""
    ev = cfg.events
    if not ev.enabled:
        return
    addrs = [("events.endpoint", ev.endpoint), ("events.replay_endpoint", ev.replay_endpoint)]
    for i, eng in enumerate(ev.engines):
        addrs += [(f"events.engines[{i}].endpoint", eng.endpoint),
                  (f"events.engines[{i}].replay_endpoint", eng.replay_endpoint)]
        if eng.source and "*" not in eng.source and "::" not in eng.source:
            addrs.append((f"events.engines[{i}].source", eng.source))   # the daemon binds it
    for key, addr in addrs:
        if not addr.startswith("tcp://"):
            continue
        host, _, port = addr[len("tcp://"):].rpartition(":")
        why = _bind_problem("" if host == "*" else host.strip("[]"), int(port))
        if why is not None:
            raise PreflightError(f"{key} = {addr!r} {why}; set it to another address")


def _cpu_device_bytes(cfg: StoreConfig) -> int:
    """Shared memory the gpu tier takes when the CPU device serves it (no CUDA here)."""
    g = cfg.gpu
    if not g.enabled:
        return 0
    # /dev/nvidiactl: the cheap, import-free sign of an NVIDIA driver ("auto" picks CUDA).
    if g.backend == "cpu" or (g.backend == "auto" and not os.path.exists("/dev/nvidiactl")):
        return g.capacity * len(g.devices)
    return 0


def check_shm(cfg: StoreConfig, shm_dir: str = SHM_DIR) -> None:
    """The host pool (and a CPU-device gpu tier) are shared-memory segments prefaulted at
    start: they must fit in /dev/shm, or the daemon dies of SIGBUS while prefaulting."""
    if not os.path.isdir(shm_dir):
        return                  # no /dev/shm (not Linux): the host tier reports its own error
    free = _free_bytes(Path(shm_dir))
    device = _cpu_device_bytes(cfg)
    if cfg.host.capacity + device > free:
        free += _own_segment_bytes(cfg, shm_dir)    # freed as this start replaces it
    if cfg.host.capacity + device > free:
        what = (f"host.capacity is {format_size(cfg.host.capacity)}" if not device else
                f"host.capacity ({format_size(cfg.host.capacity)}) plus the CPU-device gpu tier "
                f"({format_size(device)}) need {format_size(cfg.host.capacity + device)}")
        raise PreflightError(
            f"{what} but {shm_dir} has only {format_size(free)} free; lower --host-capacity"
            f"{' / gpu.capacity' if device else ''} or enlarge {shm_dir} (containers: docker "
            "run --shm-size=..., Kubernetes: an emptyDir with medium: Memory)")


def _shm_bytes(cfg: StoreConfig) -> int:
    """The shared memory the daemon prefaults: the host pool and a CPU-device gpu tier."""
    return cfg.host.capacity + _cpu_device_bytes(cfg)


def _own_segment_bytes(cfg: StoreConfig, shm_dir: str = SHM_DIR) -> int:
    """The size of the host segment a crashed daemon on this data folder left behind: the
    start replaces it, so its memory comes back (kvstore/store.py names it)."""
    name = cfg.host.shm_name.lstrip("/")
    if not name:
        try:
            import blake3
        except ImportError:
            return 0
        name = "kvstore-" + blake3.blake3(
            str(Path(cfg.data_dir).resolve()).encode()).hexdigest()[:16]
    try:
        return os.stat(os.path.join(shm_dir, name)).st_blocks * 512
    except OSError:
        return 0


def _cgroup_dirs(mountinfo: str, cgroup: str) -> list[tuple[str, str]]:
    """(folder, limit file) of this process's memory cgroup and each of its ancestors, for
    cgroup v2 (memory.max) and v1 (memory.limit_in_bytes), innermost first.

    From /proc/self/mountinfo (where each hierarchy is mounted, and which of its cgroups the
    mount shows as its root) and /proc/self/cgroup (this process's cgroup in each). In a
    container the mount's root is often the container's own cgroup; a path outside the
    mount's root (no cgroup namespace) is looked up from the mount point itself."""
    try:
        with open(mountinfo) as f:
            mounts = f.read().splitlines()
        with open(cgroup) as f:
            memberships = f.read().splitlines()
    except OSError:
        return []
    paths: dict[str, str] = {}           # "v2" or "v1" -> this process's cgroup path
    for line in memberships:
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            paths["v2"] = path
        elif "memory" in controllers.split(","):
            paths["v1"] = path
    out: list[tuple[str, str]] = []
    for line in mounts:
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        fstype, _, rest = line.split(" - ", 1)[1].partition(" ")
        options = rest.split(" ")[-1].split(",")
        if fstype == "cgroup2":
            version, limit_file = "v2", "memory.max"
        elif fstype == "cgroup" and "memory" in options:
            version, limit_file = "v1", "memory.limit_in_bytes"
        else:
            continue
        if version not in paths:
            continue
        root, point = fields[3], fields[4].replace("\\040", " ")
        path = paths[version]
        rel = os.path.relpath(path, root) if path == root or path.startswith(
            root.rstrip("/") + "/") else "."
        parts = [] if rel == "." else rel.split("/")
        for i in range(len(parts), -1, -1):
            out.append((os.path.join(point, *parts[:i]), limit_file))
    return out


def memory_limit(mountinfo: str = "/proc/self/mountinfo", cgroup: str = "/proc/self/cgroup"
                 ) -> tuple[int, str] | None:
    """(bytes, where) of the tightest memory limit on this process's cgroup or an ancestor
    (cgroup v2 memory.max, v1 memory.limit_in_bytes), or None where there is none. tmpfs
    pages, the host pool's among them, are charged to it."""
    best: tuple[int, str] | None = None
    for folder, limit_file in _cgroup_dirs(mountinfo, cgroup):
        where = os.path.join(folder, limit_file)
        try:
            with open(where) as f:
                text = f.read().strip()
        except OSError:
            continue
        if not text.isdigit() or int(text) >= _NO_LIMIT:
            continue                    # "max" (v2) or the v1 "unlimited" figure
        if best is None or int(text) < best[0]:
            best = (int(text), where)
    return best


def _meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    out = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                words = value.split()
                if words and words[0].isdigit():
                    out[key] = int(words[0]) * (1024 if words[1:2] == ["kB"] else 1)
    except OSError:
        pass
    return out


def check_memory(cfg: StoreConfig, limit: tuple[int, str] | None | bool = True,
                 meminfo: str = "/proc/meminfo", shm_dir: str = SHM_DIR) -> None:
    """The pools the daemon prefaults at start must fit in the memory it may use, or it is
    OOM-killed while prefaulting, after it said SERVING (tmpfs pages count against a
    container's memory limit, whatever /dev/shm's size says).

    Two bounds: this process's cgroup memory limit (`limit`; True: look it up), which the
    pools and the daemon's own heap (DAEMON_HEAP_MARGIN) must fit under; and the machine's
    MemAvailable plus free swap, which the pools alone must fit in (the heap is left out
    there: on a small machine the 512 MiB default starts in what is left)."""
    pools = _shm_bytes(cfg)
    device = pools - cfg.host.capacity
    what = (f"host.capacity ({format_size(cfg.host.capacity)})" if not device else
            f"host.capacity ({format_size(cfg.host.capacity)}) plus the CPU-device gpu tier "
            f"({format_size(device)})")
    fix = f"lower --host-capacity{' / gpu.capacity' if device else ''}"
    if limit is True:
        limit = memory_limit()
    if limit:
        cap, where = limit
        if pools + DAEMON_HEAP_MARGIN > cap:
            raise PreflightError(
                f"{what} and the daemon's own ~{format_size(DAEMON_HEAP_MARGIN)} need "
                f"{format_size(pools + DAEMON_HEAP_MARGIN)} but this process's memory limit is "
                f"{format_size(cap)} ({where}); {fix} or raise the memory limit (container, "
                "systemd MemoryMax)")
    info = _meminfo(meminfo)
    if "MemAvailable" in info:
        room = info["MemAvailable"] + info.get("SwapFree", 0)
        if pools > room:
            room += _own_segment_bytes(cfg, shm_dir)    # freed as this start replaces it
        if pools > room:
            raise PreflightError(
                f"{what} is more than this machine's free memory ({format_size(room)}, "
                f"MemAvailable{' + SwapFree' if info.get('SwapFree') else ''}); {fix} or free "
                "memory")


def check_conflicts(cfg: StoreConfig) -> None:
    """Settings that are each valid but cannot hold together."""
    if not cfg.host.enabled:
        raise PreflightError("host.enabled = false is not supported: every block passes "
                             "through the host pool; lower host.capacity instead")
    if cfg.ssd.write_through and not cfg.ssd.enabled:
        raise PreflightError("ssd.write_through = true needs ssd.enabled = true; enable the SSD "
                             "tier or drop write_through")
    if cfg.remote.write_through and not cfg.remote.enabled:
        raise PreflightError("remote.write_through = true needs remote.enabled = true; enable "
                             "the remote tier or drop write_through")
    if cfg.remote.enabled:
        for key in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
            path = getattr(cfg.remote, key)
            if path and not os.path.isfile(path):
                raise PreflightError(f"remote.{key} = {path!r}: no such file")
        if bool(cfg.remote.tls_cert_file) != bool(cfg.remote.tls_key_file):
            raise PreflightError("remote.tls_cert_file and remote.tls_key_file go together (a "
                                 "client certificate needs its key); set both or neither")


def preflight(cfg: StoreConfig) -> None:
    """Every check, cheapest first; raises PreflightError on the first mistake found."""
    check_conflicts(cfg)
    check_data_dir(cfg.data_dir)
    check_socket(cfg.socket_path, cfg.data_dir)
    check_shm(cfg)
    check_memory(cfg)
    check_ports(cfg)
    check_events(cfg)
