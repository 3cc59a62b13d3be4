"""Startup and stop of the real `kvstore serve` (issue 16: an operator's first hour).

Figures, each the median of `--runs` runs:
  mistake_exit_s    spawn -> exit of `kvstore serve` with a TCP port already in use: the
                    one-line, exit-2 path (preflight), which must come before any slow work.
                    Target < 5 s.
  python_floor_s    spawn -> exit of `python -c "import kvstore.cli"`: the interpreter's own
                    start, the floor under mistake_exit_s on this machine right now.
  start_s           spawn -> health SERVING (imports torch, prefaults the host pool, opens LMDB).
  idle_sigterm_s    SIGTERM -> exit of a daemon that serves nothing. Target < 1 s.
  mistake_vs_start  mistake_exit_s / start_s: how much of the start a mistake costs (small).

Usage: python bench/startup.py [--quick] [--runs N] [--host-capacity SIZE]. The last line of
the output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 runs (default 5)")
    ap.add_argument("--runs", type=int, default=0)
    ap.add_argument("--host-capacity", default="1GiB", help="host pool of the timed daemon")
    args = ap.parse_args()
    runs = args.runs or (3 if args.quick else 5)
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
