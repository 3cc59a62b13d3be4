"""Startup and stop of the real `kvstore serve`: what an operator waits for, and fast start.

Figures, each the median of `--runs` runs:
  mistake_exit_s    spawn -> exit of `kvstore serve` with a TCP port already in use: the
                    one-line, exit-2 path (preflight), which must come before any slow work.
                    Target < 5 s.
  python_floor_s    spawn -> exit of `python -c "import kvstore.cli"`: the interpreter's own
                    start, the floor under mistake_exit_s on this machine right now.
  start_s           spawn -> health SERVING (prefaults the host pool, opens LMDB).
  idle_sigterm_s    SIGTERM -> exit of a daemon that serves nothing. Target < 1 s.
  mistake_vs_start  mistake_exit_s / start_s: how much of the start a mistake costs (small).
Ratios against references measured in the same run:
  ready_vs_bare_grpc    daemon with the default config (TCP and a fixed metrics port off),
                        spawn -> SERVING, against a bare grpcio server process with only the
                        health service on a Unix socket. Target <= 2.
  restart_100k_vs_bare  the same for a daemon whose SSD tier holds 100k blocks (written and
                        stopped cleanly by a Store, so the restart reads its index image;
                        kvstore/warm_image.py). Target <= 3.
  stop_flush_vs_disk    GB/s at which SIGTERM writes a full host pool down to SSD (from the
                        daemon's own "flushed N blocks (X GB) in Y s" line) against a
                        sequential O_DIRECT write on the same disk right after it; the median
                        of the runs' ratios (stop_flush_vs_disk_runs). Target >= 0.5.

Usage: python bench/startup.py [--quick] [--runs N] [--host-capacity SIZE] [--dir DIR]. The
last line of the output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
from bench.refs import odirect_write_read  # noqa: E402

ROOT = _HERE.parent


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "client"),
                                                   env.get("PYTHONPATH", "")) if p)
    return env


def _serving(sock: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(f"unix:{sock}") as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        return r.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def python_floor() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import kvstore.cli"], env=_env(), check=True,
                   timeout=120)
    return time.perf_counter() - t0


def mistake_exit(tmp: Path) -> float:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--data-dir",
                              str(tmp / "data"), "--tcp", f"127.0.0.1:{port}", "--metrics", ""],
                             env=_env(), capture_output=True, text=True, timeout=120)
        took = time.perf_counter() - t0
    if res.returncode != 2 or res.stderr.count("\n") != 1:
        raise SystemExit(f"expected one line and exit 2, got {res.returncode}: {res.stderr}")
    return took


def start_and_stop(tmp: Path, host_capacity: str) -> tuple[float, float]:
    sock = str(tmp / "kvs.sock")
    args = [sys.executable, "-m", "kvstore", "serve", "--data-dir", str(tmp / "data"),
            "--socket", sock, "--tcp", "", "--metrics", "127.0.0.1:0",
            "--host-capacity", host_capacity, "--ssd-capacity", "1GiB"]
    log = open(tmp / "daemon.log", "wb")
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    log.close()
    try:
        deadline = time.monotonic() + 300
        while not (os.path.exists(sock) and _serving(sock)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("daemon did not start:\n" + (tmp / "daemon.log").read_text())
            time.sleep(0.02)
        start = time.perf_counter() - t0
        time.sleep(0.5)                          # idle: nothing in flight
        t1 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        stop = time.perf_counter() - t1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return start, stop


DEADLINE_S = 120.0
BARE_SERVER = """
import sys
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
server = grpc.server(futures.ThreadPoolExecutor(4))
h = health.HealthServicer()
health_pb2_grpc.add_HealthServicer_to_server(h, server)
server.add_insecure_port("unix:" + sys.argv[1])
server.start()
h.set("", health_pb2.HealthCheckResponse.SERVING)
server.wait_for_termination()
"""
_FLUSHED = re.compile(r"flushed (\d+) blocks \(([\d.]+) GB\) in ([\d.]+) s")


def _spawn_until_ready(argv: list[str], sock: str, log: Path) -> tuple[subprocess.Popen, float]:
    """Start a process and poll its socket's health; returns it and the seconds to SERVING."""
    with open(log, "wb") as out:
        t = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=_env(),
                                stdin=subprocess.DEVNULL)
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{argv[:4]} exited with {proc.returncode}: "
                               f"{log.read_text(errors='replace')[-2000:]}")
        if os.path.exists(sock) and _serving(sock):
            return proc, time.perf_counter() - t
        time.sleep(0.01)
    proc.kill()
    raise RuntimeError(f"{argv[:4]} not SERVING within {DEADLINE_S} s")


def _stop(proc: subprocess.Popen, timeout: float = DEADLINE_S) -> float:
    t = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        raise RuntimeError(f"process ignored SIGTERM for {timeout} s") from None
    return time.perf_counter() - t


def _daemon_argv(data: Path, sock: str, extra: dict[str, str] | None = None) -> list[str]:
    args = [sys.executable, "-m", "kvstore", "serve", "--data-dir", str(data), "--socket", sock,
            "--set", "server.tcp=", "--set", "server.metrics="]
    for k, v in (extra or {}).items():
        args += ["--set", f"{k}={v}"]
    return args


def bare_start_s(tmp: Path, runs: int) -> float:
    times = []
    for i in range(runs):
        sock = str(tmp / f"bare{i}.sock")
        proc, dt = _spawn_until_ready([sys.executable, "-c", BARE_SERVER, sock], sock,
                                      tmp / f"bare{i}.log")
        times.append(dt)
        proc.kill()
        proc.wait(10)
    return statistics.median(times)


def daemon_start_s(tmp: Path, data: Path, runs: int, extra: dict[str, str] | None = None
                   ) -> float:
    times = []
    for i in range(runs):
        sock = str(tmp / "d.sock")
        proc, dt = _spawn_until_ready(_daemon_argv(data, sock, extra), sock,
                                      tmp / f"daemon{i}.log")
        times.append(dt)
        _stop(proc)
    return statistics.median(times)


def fill_ssd(data: Path, n_blocks: int) -> None:
    """n small blocks written down to the SSD tier through the Store (the real format)."""
    from kvstore_client import KVLayout, NamespaceSpec

    from kvstore.config import StoreConfig
    from kvstore.store import Store

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_tokens=16,
                      dtype="float16")                       # 1 KiB blocks
    cfg = StoreConfig(data_dir=str(data))
    cfg.host.capacity = 64 << 20
    cfg.ssd.capacity = 1 << 30
    rng = np.random.default_rng(1)
    with Store(cfg) as store:
        ns = store.register_namespace(NamespaceSpec(model="startup-bench",
                                                    layout=layout)).ns_id
        block = rng.integers(0, 255, layout.block_bytes, dtype=np.uint8).tobytes()
        step = 4096
        for start in range(0, n_blocks, step):
            keys = [i.to_bytes(16, "little") for i in range(start, min(n_blocks, start + step))]
            store.put(ns, keys, [block] * len(keys))
        store.flush()
        assert len(store.ssd) >= n_blocks, f"only {len(store.ssd)} blocks reached SSD"


def stop_flush_gbps(tmp: Path, pool_bytes: int) -> tuple[float, float, str]:
    """Fill a daemon's host pool over shm, SIGTERM it, read the flush rate from its log."""
    from kvstore_client import KVLayout, connect

    tmp.mkdir(parents=True, exist_ok=True)
    data = tmp / "flush-data"
    sock = str(tmp / "f.sock")
    log = tmp / "flush.log"
    cap = pool_bytes * 2
    proc, _ = _spawn_until_ready(
        _daemon_argv(data, sock, {"host.capacity": str(cap), "ssd.capacity": str(4 * cap),
                                  "server.stop_flush_s": "600"}), sock, log)
    # A daemon that has run a while: its codec warm-up (numba loading kernels, 1-2 s of a
    # core after SERVING) done, so the flush is timed, not the two sharing the cores.
    end = time.monotonic() + DEADLINE_S
    while "codec kernels loaded" not in log.read_text(errors="replace"):
        if time.monotonic() > end or proc.poll() is not None:
            proc.kill()
            raise RuntimeError(f"no codec warm-up line:\n{log.read_text(errors='replace')}")
        time.sleep(0.05)
    layout = KVLayout(num_layers=16, num_kv_heads=8, head_dim=128, block_tokens=32,
                      dtype="bfloat16")                        # 2 MiB blocks
    n = max(1, pool_bytes // layout.block_bytes)
    rng = np.random.default_rng(2)
    shape = layout.block_shape
    x = (rng.standard_normal((shape[0], 2, 8 * shape[2], shape[3], shape[4]),
                             dtype=np.float32))
    kv = (x.view(np.uint32) >> 16).astype(np.uint16)     # bf16 bits, 8 blocks of tokens
    try:
        with connect("unix:" + sock) as c:
            ns = c.namespace(layout, model="startup-flush")
            for b in range(0, n, 8):
                keys = [(b + j).to_bytes(16, "little") for j in range(min(8, n - b))]
                ns.store_keys(keys, kv[:, :, :len(keys) * shape[2]])
        stop_s = _stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text(errors="replace")
    m = _FLUSHED.search(text)
    if m is None:
        raise RuntimeError(f"no flush line in the daemon's output:\n{text[-2000:]}")
    gb, secs = float(m.group(2)), float(m.group(3))
    return gb / max(secs, 1e-9), stop_s, m.group(0)


def issue14_figures(quick: bool, folder: str) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-startup-", dir=folder))
    runs = 3 if quick else 7
    try:
        bare = bare_start_s(tmp, runs)
        ready = daemon_start_s(tmp, tmp / "fresh", runs)
        n_blocks = 100_000
        fill_ssd(tmp / "warm", n_blocks)
        restart = daemon_start_s(tmp, tmp / "warm", runs, {"ssd.capacity": str(1 << 30)})
        pool = (256 if quick else 1024) << 20
        # Each flush paired with a disk reference right after it, the median of the ratios:
        # both move 2x from one moment to the next on this shared virtual disk.
        flushes = []
        for i in range(runs):
            gbps, stop_s, line = stop_flush_gbps(tmp / f"flush{i}", pool)
            disk_w, _ = odirect_write_read(str(tmp), pool)
            flushes.append((gbps / (pool / disk_w / 1e9), gbps, pool / disk_w / 1e9, stop_s,
                            line))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    flushes.sort()
    flush_ratio, flush_gbps, disk_gbps, stop_s, line = flushes[len(flushes) // 2]
    return {
        "ready_vs_bare_grpc": round(ready / bare, 3),
        "restart_100k_vs_bare": round(restart / bare, 3),
        "stop_flush_vs_disk": round(flush_ratio, 3),
        "stop_flush_vs_disk_runs": [round(f[0], 3) for f in flushes],
        "bare_grpc_ready_s": round(bare, 3),
        "daemon_ready_s": round(ready, 3),
        "restart_100k_ready_s": round(restart, 3),
        "stop_flush_gbps": round(flush_gbps, 3),
        "disk_write_gbps": round(disk_gbps, 3),
        "stop_total_s": round(stop_s, 2),
        "flush_line": line,
        "restart_blocks": n_blocks,
    }


def compile_sources() -> None:
    """Write the project's bytecode before timing starts. Why: an installed daemon has its
    .pyc files (pip compiles them), and the bare server imports only installed packages; from
    a source tree with PYTHONDONTWRITEBYTECODE set (as on the shared machine) every daemon
    start would instead compile each module edited since its last .pyc, which times the
    compiler, not the start."""
    import compileall

    for sub in ("kvstore", "tiers", "client/kvstore_client"):
        compileall.compile_dir(str(ROOT / sub), quiet=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 runs (default 5)")
    ap.add_argument("--runs", type=int, default=0)
    ap.add_argument("--host-capacity", default="1GiB", help="host pool of the timed daemon")
    ap.add_argument("--dir", default=os.getcwd(), help="folder on the disk to measure")
    args = ap.parse_args()
    runs = args.runs or (3 if args.quick else 5)
    compile_sources()
    floors, mistakes, starts, stops = [], [], [], []
    for _ in range(runs):
        tmp = Path(tempfile.mkdtemp(prefix="kvs-start-"))
        try:
            floors.append(python_floor())
            mistakes.append(mistake_exit(tmp))
            s, t = start_and_stop(tmp, args.host_capacity)
            starts.append(s)
            stops.append(t)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    res = {"runs": runs, "host_capacity": args.host_capacity,
           "python_floor_s": round(statistics.median(floors), 3),
           "mistake_exit_s": round(statistics.median(mistakes), 3),
           "start_s": round(statistics.median(starts), 3),
           "idle_sigterm_s": round(statistics.median(stops), 3),
           "idle_sigterm_max_s": round(max(stops), 3)}
    res["mistake_vs_start"] = round(res["mistake_exit_s"] / res["start_s"], 3)
    res["idle_sigterm_target_met"] = res["idle_sigterm_s"] < 1.0
    res["mistake_exit_target_met"] = res["mistake_exit_s"] < 5.0
    res.update(issue14_figures(args.quick, args.dir))
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = -1.0
    res["load_avg_1m"] = round(load, 2)
    for k, v in res.items():
        print(f"{k:26s} {v}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
